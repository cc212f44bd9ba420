"""pyproject.toml declares what the code imports: every package a module imports at its top
is a dependency (or, for the modules of one command, that command's extra), every package
imported anywhere is declared somewhere, and the test extra is built from the other extras."""

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "layerstream"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# import name -> distribution name, where they differ
DISTRIBUTION = {"yaml": "pyyaml"}
# modules imported only by one command, and the extra that command needs
COMMAND_MODULES = {"train.py": "train", "train_config.py": "train"}
# installed with torch itself where they are used (torch's CUDA builds depend on Triton), and
# imported only where importable, never at a module's top
WITH_TORCH = {"triton"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared(extra=None) -> set:
    requirements = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {_name(r) for r in requirements}


def _third_party_imports(path: Path):
    """(distribution, whether imported at the module's top) of every non-stdlib, non-package import."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            root = name.split(".")[0]
            if root in sys.stdlib_module_names or root in {"layerstream", "__future__"}:
                continue
            yield DISTRIBUTION.get(root, root).lower().replace("_", "-"), id(node) in top


def _undeclared(paths):
    everything = _declared().union(*(_declared(extra) for extra in PROJECT["optional-dependencies"]))
    missing = []
    for path in paths:
        command = COMMAND_MODULES.get(path.name)
        needed_at_import = _declared() | (_declared(command) if command else set())
        for package, at_top in _third_party_imports(path):
            if package not in (needed_at_import if at_top else everything | WITH_TORCH):
                missing.append(f"{path.name}: {package}")
    return sorted(set(missing))


def test_every_imported_package_is_declared_where_its_importer_needs_it():
    assert not _undeclared(PACKAGE.rglob("*.py")), _undeclared(PACKAGE.rglob("*.py"))


def test_the_check_finds_an_undeclared_import(tmp_path):
    """Negative control: an extra's package imported at the top of a module every command
    imports, a package declared nowhere, Triton at a module's top (allowed only where
    guarded), and one outside the extra of its command."""
    module = tmp_path / "module.py"
    module.write_text("import yaml\nimport torch\nimport triton\n\n\ndef f():\n    import nosuchdist\n    import trl\n")
    assert [m.split(": ")[1] for m in _undeclared([module])] == ["nosuchdist", "pyyaml", "triton"]
    (tmp_path / "train.py").write_text("import yaml\nimport matplotlib\n")
    assert [m.split(": ")[1] for m in _undeclared([tmp_path / "train.py"])] == ["matplotlib"]


def test_layerstream_train_has_an_extra_with_what_it_imports():
    assert {"trl", "datasets", "pyyaml"} <= _declared("train")


def test_the_test_extra_is_built_from_the_other_extras_without_repeating_them():
    extras = PROJECT["optional-dependencies"]
    others = {name for name in extras if name != "test"}
    taken = [re.fullmatch(r"layerstream\[(.*)\]", r) for r in extras["test"]]
    assert [set(m.group(1).split(",")) for m in taken if m] == [others], "test takes every other extra by name"
    repeated = _declared("test") & set().union(*(_declared(name) for name in others))
    assert not repeated, f"the test extra repeats {repeated}: take them from the other extras"


def test_the_build_backend_reads_the_license_string():
    """A PEP 639 license string (license = "Apache-2.0") needs setuptools 77 or newer."""
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    setuptools = next(r for r in build if _name(r) == "setuptools")
    assert isinstance(PROJECT["license"], str)
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")], "setuptools refuses both"
    assert re.fullmatch(r"setuptools>=(\d+).*", setuptools) and int(setuptools.split(">=")[1].split(".")[0]) >= 77


def test_the_classifiers_say_linux():
    """shared_store uses fcntl and /dev/shm, the host checks /proc: Linux only."""
    assert "Operating System :: POSIX :: Linux" in PROJECT["classifiers"]
