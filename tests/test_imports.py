"""The package's modules import downward only: no cycles, and no module imports one from
a layer above it (integrations register with the core; the core never reaches up)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "layerstream"

# lowest first; a module may import from its own layer and the ones before it
LAYERS = [
    {"errors", "units", "swap", "embedded", "log", "paths", "memory_limits", "versions"},
    {
        "config",
        "schedule",
        "window",
        "checksum",
        "cudart",
        "discovery",
        "computed_buffers",
        "conversion",
        "timeline",
        "chunked_loss",
        "trl_head",
        "tiles",
        "tiled_norm",
        "tiled_mlp",
        "disk_plan",
        "shared_store",
        "progress",
    },
    {"store", "pool", "nf4", "meter", "changes", "bindings", "passes", "plan", "offload"},
    {
        "embeddings",
        "layer",
        "backward_slots",
        "report",
        "checkpoint",
        "tensor_reader",
        "residency",
        "disk",
        "disk_files",
        "nf4_cache",
        "offload_policy",
        "long_policy",
        "budget_check",
    },
    {"runtime"},
    {"api", "loading"},
    {"integrations", "train", "cli", "demo", "__main__", "_site", "disk_cli"},
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
    graph = _graph()
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
    assert not cycles, cycles


def test_the_checks_above_can_fail():
    """Negative control: a made-up upward import is found."""
    rank = {module: i for i, layer in enumerate(LAYERS) for module in layer}
    graph = {"store": {"runtime"}}
    assert [f"{a} -> {b}" for a, t in graph.items() for b in t if rank[b] > rank[a]] == ["store -> runtime"]
