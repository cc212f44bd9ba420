"""Docs name tests as evidence; every test they name must exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_docs_name_exists():
    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= {(doc.name, f, t) for f, t in re.findall(r"(test_\w+\.py)::(test_\w+)", doc.read_text())}
    assert named, "the docs should cite tests"
    missing = [f"{doc}: {f}::{t}" for doc, f, t in sorted(named)
               if not (ROOT / "tests" / f).exists() or f"def {t}(" not in (ROOT / "tests" / f).read_text()]
    assert not missing, missing
