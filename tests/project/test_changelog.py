"""Every changelog fragment is well formed."""

import re
from pathlib import Path

import pytest

CHANGELOG = Path(__file__).resolve().parents[2] / "changelog.d"
KINDS = {"added", "changed", "fixed", "removed", "performance", "docs"}
NAME = re.compile(r"^[a-z0-9][a-z0-9-]*\.([a-z]+)\.md$")
FRAGMENTS = sorted(p for p in CHANGELOG.iterdir() if p.name != "README.md")


def test_there_are_fragments():
    assert FRAGMENTS, "changelog.d holds no fragment"


@pytest.mark.parametrize("path", FRAGMENTS, ids=[p.name for p in FRAGMENTS])
def test_fragment_is_well_formed(path):
    match = NAME.match(path.name)
    assert match, f"{path.name}: name must be <slug>.<kind>.md"
    assert match.group(1) in KINDS, f"{path.name}: kind must be one of {sorted(KINDS)}"
    text = path.read_text().strip()
    assert text, f"{path.name} is empty"
    assert len(text) <= 1200, f"{path.name} is longer than a fragment should be"
    assert not text.startswith("#"), f"{path.name}: no headings in a fragment"
    assert not re.search(r"(?i)\bissue\s*#?\d+|#\d+\b", text), f"{path.name}: no issue numbers"
