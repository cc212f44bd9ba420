"""Docs name tests as evidence; every test they name must exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_docs_name_exists():
    """A test is cited as ``tests/<folder>/test_file.py::test_name``, its path from the
    repository root, so a reader can open it; a bare file name is a stale citation."""
    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= {(doc.name, f, t) for f, t in re.findall(r"([\w/]*test_\w+\.py)::(test_\w+)", doc.read_text())}
    assert named, "the docs should cite tests"
    missing = [
        f"{doc}: {f}::{t}"
        for doc, f, t in sorted(named)
        if not (ROOT / f).is_file() or f"def {t}(" not in (ROOT / f).read_text()
    ]
    assert not missing, missing


def test_the_tests_mirror_the_packages_folders():
    """tests/<folder>/ for each folder of src/layerstream (the front doors' tests in
    tests/api/), and no test file left at the top or with a name another folder uses."""
    package = ROOT / "src" / "layerstream"
    folders = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    tests = ROOT / "tests"
    assert folders <= {p.name for p in tests.iterdir() if p.is_dir()}, folders
    assert not list(tests.glob("test_*.py"))
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "pytest imports test files by their name"


def test_the_performance_matrix_in_the_docs_is_the_suites_own_table():
    page = (ROOT / "docs" / "performance.md").read_text()
    table = page.split("<!-- suite.md -->\n", 1)[1].split("<!-- /suite.md -->", 1)[0]
    assert table.strip() == (ROOT / "benchmarks" / "results" / "suite" / "suite.md").read_text().strip()


def test_the_performance_page_is_for_users_not_a_log():
    page = (ROOT / "docs" / "performance.md").read_text()
    assert len(page.splitlines()) < 200
    assert not re.search(r"\b[0-9a-f]{7}\b", page), "commit hashes belong in benchmarks/results/LOG.md"


USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a hexadecimal word of 7 to 40 characters with a letter in it, outside a file name
_HASH = re.compile(r"(?<![-/\w])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w.])")


def test_user_pages_carry_no_commit_hash_outside_a_result_files_name():
    found = [f"{page.name}: {word}" for page in USER_PAGES for word in _HASH.findall(page.read_text())]
    assert not found, found


def test_the_hash_check_sees_a_hash_and_passes_a_file_name():
    """Negative control."""
    assert _HASH.findall("Command (code at 7a73eca): see long-context-cdef4a0.json") == ["7a73eca"]


def _window_rows():
    """(label, automatic window, plan's window) of each row of the window table in performance.md."""
    page = (ROOT / "docs" / "performance.md").read_text()
    table = page.split("| model, budget | automatic window | plan predicts |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    return [(row[0].strip("| "), int(row[1].split(" of ")[0]), int(row[2])) for row in rows]


# label -> (shape file, benchmark shape, quantization, budget GiB, long-sequence options)
WINDOW_CASES = {
    "8B bf16, 12 GiB": ("llama-3.1-8b", "llama3-8b", "none", 12, {}),
    "8B bf16, 16 GiB": ("llama-3.1-8b", "llama3-8b", "none", 16, {}),
    "8B bf16, 24 GiB": ("llama-3.1-8b", "llama3-8b", "none", 24, {}),
    "8B NF4, 6 GiB, `loss_chunk_tokens=512`": ("llama-3.1-8b", "llama3-8b", "nf4", 6, {"loss_chunk_tokens": 512}),
    "8B NF4, 8 GiB": ("llama-3.1-8b", "llama3-8b", "nf4", 8, {}),
    "70B NF4, 16 GiB": ("llama-3.1-70b", "llama3-70b", "nf4", 16, {}),
    "70B NF4, 24 GiB": ("llama-3.1-70b", "llama3-70b", "nf4", 24, {}),
}


def test_the_window_table_states_the_measured_window_and_the_plans_prediction():
    """performance.md's window figures are the committed results' and what `layerstream plan`
    predicts for the same case: one case, one answer each."""
    import json

    from layerstream.plan import PlanRequest, load_config, make_plan
    from layerstream.units import GiB

    measured = {}
    for name in ("window-matrix-8b-paired-a8019c4.json", "window-matrix-70b-paired-a8019c4.json"):
        for row in json.loads((ROOT / "benchmarks/results/window-matrix" / name).read_text())["rows"]:
            measured[(row["shape"], row["quantization"], row["budget_gib"])] = row["auto_window"]
    rows = _window_rows()
    assert [label for label, _, _ in rows] == list(WINDOW_CASES)
    for label, automatic, predicted in rows:
        shape, bench, quantization, budget, options = WINDOW_CASES[label]
        config = load_config(ROOT / "configs" / "shapes" / f"{shape}.json")
        plan = make_plan(
            PlanRequest(config, seq=2048, batch=1, vram_bytes=budget * GiB, quantization=quantization, **options)
        )
        assert (automatic, predicted) == (measured[(bench, quantization, float(budget))], plan.window_layers), label


def test_the_plan_example_is_the_tools_output():
    """docs/plan.md's example is what the command it names prints (the line about this
    machine's RAM aside)."""
    import contextlib
    import io

    from layerstream.commands import cli

    page = (ROOT / "docs" / "plan.md").read_text()
    shown = page.split("## Reading the plan", 1)[1].split("```\n", 2)[1].split("```", 1)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(
            [
                "plan",
                "--model",
                str(ROOT / "configs/shapes/llama-3.1-8b.json"),
                "--vram-budget",
                "16GiB",
                "--seq",
                "2048",
            ]
        )

    def lines(text):
        return [line.rstrip() for line in text.splitlines() if not line.startswith("this machine:")]

    assert lines(shown) == lines(printed.getvalue())
