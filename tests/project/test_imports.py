"""The package's modules import downward only: no cycles, and no module imports one from
a layer above it (integrations register with the core; the core never reaches up)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "layerstream"

# lowest first; a module may import from its own layer and the ones before it. A folder is
# one entry: its files may import each other (without cycles, checked below by file).
LAYERS = [
    {"errors", "units", "system"},
    {"config", "decisions", "checkpoints", "data"},
    {"modules"},
    {"tiers"},
    {"long"},
    {"plan"},
    {"runtime"},
    {"api", "loading"},
    {"integrations", "commands", "__main__", "_site"},
]


def _module_of(path: Path) -> str:
    """The top-level name of a module of the package (a subpackage counts as one module)."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _imports(path: Path):
    """Every module of the package ``path`` imports, at any depth of the file (lazy
    imports in functions count: they run too)."""
    tree = ast.parse(path.read_text())
    inside = path.relative_to(PACKAGE).parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = inside[: len(inside) - node.level + 1]
            target = list(base) + (node.module.split(".") if node.module else [])
            if target:
                yield target[0]
            else:
                yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("layerstream"):
            parts = node.module.split(".")
            yield parts[1] if len(parts) > 1 else node.names[0].name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("layerstream."):
                    yield alias.name.split(".")[1]


def _graph():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue  # the package's front door re-exports everything
        module = _module_of(path)
        graph.setdefault(module, set()).update(m for m in _imports(path) if m != module)
    return graph


def test_every_module_has_a_layer():
    modules = {_module_of(p) for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"}
    assert modules == set().union(*LAYERS), "place new modules in LAYERS"


def test_no_module_imports_from_a_layer_above_it():
    rank = {module: i for i, layer in enumerate(LAYERS) for module in layer}
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets if rank[b] > rank[a]]
    assert not upward, upward


def test_there_are_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, cycles


def _dotted_of(path: Path) -> str:
    """The module's dotted name inside the package (a subpackage's ``__init__`` is the package)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(parts) -> str:
    """The longest module of the package that ``parts`` (a dotted path inside it) names."""
    for end in range(len(parts), 0, -1):
        candidate = PACKAGE.joinpath(*parts[:end])
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts[:end])
    return ""


def _dotted_imports(path: Path):
    """Every module of the package ``path`` imports, by dotted name (``from .plan import
    memory`` names ``plan.memory``; ``from .plan.memory import X`` too)."""
    tree = ast.parse(path.read_text())
    package = list(path.relative_to(PACKAGE).parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("layerstream")):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".")[1:]
            for alias in node.names:
                found = _resolve(base + [alias.name]) or _resolve(base)
                if found:
                    yield found
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("layerstream."):
                    found = _resolve(alias.name.split(".")[1:])
                    if found:
                        yield found


def _cycles(graph) -> list:
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_there_are_no_import_cycles_between_files():
    """The same at file level, by dotted name: a subpackage's modules (``plan.memory``,
    ``integrations.trainer``) may not import each other in a circle either. A package's
    ``__init__`` importing its own modules is how a package exports, not a cycle."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue
        name = _dotted_of(path)
        targets = {t for t in _dotted_imports(path) if t != name}
        if path.name == "__init__.py":
            targets = {t for t in targets if not t.startswith(name + ".")}
        graph.setdefault(name, set()).update(targets)
    assert "plan.memory" in graph and "integrations.trainer" in graph
    assert not _cycles(graph), _cycles(graph)


# the modules at the top of the package: its front doors (the rest lives in a folder per concept)
FRONT_DOORS = {"__init__", "__main__", "api", "loading", "config", "errors", "units"}


def test_the_top_of_the_package_holds_only_its_front_doors():
    assert {p.stem for p in PACKAGE.glob("*.py")} == FRONT_DOORS, "put a new module in the folder of its concept"


def test_each_folder_says_in_one_line_what_it_holds():
    folders = [p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    assert len(folders) >= 10
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        summary = doc.split("\n\n")[0]
        assert summary and "\n" not in summary, f"{folder.name}/__init__.py: first, one line saying what it holds"


def test_the_checks_above_can_fail():
    """Negative control: a made-up upward import is found."""
    rank = {module: i for i, layer in enumerate(LAYERS) for module in layer}
    graph = {"tiers": {"runtime"}}
    assert [f"{a} -> {b}" for a, t in graph.items() for b in t if rank[b] > rank[a]] == ["tiers -> runtime"]
    assert _cycles({"plan.memory": {"plan.shapes"}, "plan.shapes": {"plan.memory"}}) == [
        ["plan.memory", "plan.shapes", "plan.memory"]
    ]
