"""Docs name tests as evidence; every test they name must exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_docs_name_exists():
    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= {(doc.name, f, t) for f, t in re.findall(r"(test_\w+\.py)::(test_\w+)", doc.read_text())}
    assert named, "the docs should cite tests"
    missing = [
        f"{doc}: {f}::{t}"
        for doc, f, t in sorted(named)
        if not (ROOT / "tests" / f).exists() or f"def {t}(" not in (ROOT / "tests" / f).read_text()
    ]
    assert not missing, missing


def test_the_performance_matrix_in_the_docs_is_the_suites_own_table():
    page = (ROOT / "docs" / "performance.md").read_text()
    table = page.split("<!-- suite.md -->\n", 1)[1].split("<!-- /suite.md -->", 1)[0]
    assert table.strip() == (ROOT / "benchmarks" / "results" / "suite" / "suite.md").read_text().strip()


def test_the_performance_page_is_for_users_not_a_log():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert len(page.splitlines()) < 200
    assert not re.search(r"\b[0-9a-f]{7}\b", page), "commit hashes belong in benchmarks/results/LOG.md"
