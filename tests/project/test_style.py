"""The code is ruff-clean and ruff-formatted, as pyproject.toml configures them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff():
    found = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(found).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_passes(command):
    done = subprocess.run([_ruff(), *command], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


MAX_MODULE_LINES = 600


def test_every_module_reads_in_one_sitting():
    """No source module grows past the line limit the contributors' guide sets."""
    long = {
        str(path.relative_to(ROOT)): count
        for path in (ROOT / "src" / "layerstream").rglob("*.py")
        if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split these modules (over {MAX_MODULE_LINES} lines): {long}"
