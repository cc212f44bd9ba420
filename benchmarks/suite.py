"""The performance matrix: one throughput.py run per cell, each in its own process (fresh
GPU memory, and a cell that fails or runs out of time loses only itself), resumable,
merged into one JSON result, one markdown table and one plot.

A cell is shape:quantization:seq:batch[:budget], e.g. llama3-70b:nf4:2048:1:16GiB.

    python benchmarks/suite.py --preset core              # runs what is missing, then merges
    python benchmarks/suite.py --merge-only               # table and plot from what is there
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRESETS = {
    # the targets of the performance issue that one session's device time can cover
    "core": [
        "llama3-8b:none:2048:1",
        "llama3-8b:nf4:2048:1",
        "llama3-70b:nf4:2048:1",
        "llama3-8b:none:2048:1:12GiB",
        "llama3-70b:nf4:2048:1:16GiB",
    ],
    "seq": [f"llama3-8b:{q}:{s}:1" for q in ("none", "nf4") for s in (512, 2048, 8192)],
    "batch": [f"llama3-8b:{q}:2048:4" for q in ("none", "nf4")],
    "shapes": ["qwen2.5-32b:none:2048:1:24GiB", "qwen3-30b-a3b:none:2048:1"],
}


def parse_cell(cell: str) -> dict:
    parts = cell.split(":")
    if len(parts) not in (4, 5):
        raise ValueError(f"cell {cell!r}: write shape:quantization:seq:batch[:budget]")
    shape, quantization, seq, batch = parts[:4]
    if quantization not in ("none", "nf4"):
        raise ValueError(f"cell {cell!r}: quantization is none or nf4")
    return {
        "shape": shape,
        "quantization": quantization,
        "seq": int(seq),
        "batch": int(batch),
        "budget": parts[4] if len(parts) == 5 else None,
    }


def cell_name(cell: str) -> str:
    return "cell-" + cell.replace(":", "-")


def run_cell(cell: str, out_dir: Path, configs: str, steps: int, timeout: int, trace: str | None = None) -> str:
    spec = parse_cell(cell)
    command = [
        sys.executable,
        str(HERE / "throughput.py"),
        "--shape",
        spec["shape"],
        "--quantization",
        spec["quantization"],
        "--seq",
        str(spec["seq"]),
        "--batch",
        str(spec["batch"]),
        "--configs",
        configs,
        "--steps",
        str(steps),
        "--name",
        cell_name(cell),
    ]
    if spec["budget"]:
        command += ["--budget", spec["budget"]]
    if trace:
        command += ["--trace", trace]
    try:
        done = subprocess.run(
            command, env=dict(os.environ, OUT=str(out_dir)), timeout=timeout, capture_output=True, text=True, cwd=HERE
        )
    except subprocess.TimeoutExpired:
        if (out_dir / f"{cell_name(cell)}.json").exists():
            # freeing tens of GB of page-locked memory can outlast the limit
            return f"ok (result written; the process outlived the {timeout} s limit in teardown)"
        return f"timed out after {timeout} s"
    return "ok" if done.returncode == 0 else f"failed ({done.returncode}): {done.stderr[-400:]}"


def merge(out_dir: Path, cells) -> dict:
    rows, missing = [], []
    for cell in cells:
        path = out_dir / f"{cell_name(cell)}.json"
        if not path.exists():
            missing.append(cell)
            continue
        result = json.loads(path.read_text())
        resident = result.get("resident")
        for row in result["rows"]:
            rows.append(
                {
                    "cell": cell,
                    **parse_cell(cell),
                    "config": f"{row['slots']}:{row['prefetch']}",
                    "step_s": row["step_s"],
                    "tokens_per_s": row["tokens_per_s"],
                    "peak_gib": row["peak_gib"],
                    "copy_bound_s": row["copy_bound_s"],
                    "h2d_gbps": row["h2d_gbps"],
                    "stall_s_per_step": row["stall_s_per_step"],
                    "window_layers": row.get("window_layers", 0),
                    "resident_step_s": resident["step_s"] if resident else None,
                    "fraction_of_resident": row.get("fraction_of_resident"),
                    "fraction_of_bound": row.get("fraction_of_bound"),
                    "machine": result.get("machine"),
                    "when": result.get("when"),
                }
            )
    return {"rows": rows, "missing": missing}


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def table(merged: dict) -> str:
    lines = [
        "| cell | config | step s | tokens/s | peak GiB | window layers | H2D GB/s | stall % of step | "
        "copy bound s | resident s | x resident | x bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in merged["rows"]:
        stall = 100 * r["stall_s_per_step"] / r["step_s"]
        lines.append(
            f"| {r['cell']} | {r['config']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['peak_gib']:.1f} | {r['window_layers']} | {r['h2d_gbps']:.1f} | {stall:.0f} | "
            f"{r['copy_bound_s']:.3f} | {_fmt(r['resident_step_s'], 3)} | "
            f"{_fmt(r['fraction_of_resident'])} | {_fmt(r['fraction_of_bound'])} |"
        )
    for cell in merged["missing"]:
        lines.append(f"| {cell} | not measured | | | | | | | | | | |")
    return "\n".join(lines)


def plot(merged: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return False
    rows = [r for r in merged["rows"] if r["fraction_of_resident"] is not None]
    if not rows:
        return False
    labels = [f"{r['cell']}\n{r['config']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["fraction_of_resident"] for r in rows], label="x resident")
    ax.scatter(range(len(rows)), [r["fraction_of_bound"] for r in rows], color="black", zorder=3, label="x bound")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("streamed speed as a fraction")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), default=[])
    parser.add_argument("--cells", default="", help="comma-separated cells")
    parser.add_argument("--configs", default="3:1,3:2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=540, help="seconds per cell")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results" / "suite"))
    parser.add_argument("--trace", default=None, help="slots:prefetch config to profile one step of, in every cell")
    parser.add_argument("--merge-only", action="store_true")
    args = parser.parse_args()
    named = [c for name in args.preset for c in PRESETS[name]] + [c for c in args.cells.split(",") if c]
    cells = list(dict.fromkeys(named))  # a cell named twice (two presets) runs once
    if not cells:
        parser.error("name cells with --preset or --cells")
    for cell in cells:
        parse_cell(cell)  # every cell is checked before any runs
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.merge_only:
        for cell in cells:
            if (out_dir / f"{cell_name(cell)}.json").exists():
                print(cell, "already measured", flush=True)
                continue
            print(cell, run_cell(cell, out_dir, args.configs, args.steps, args.timeout, args.trace), flush=True)
    merged = merge(out_dir, cells)
    from layerstream.system.versions import versions

    (out_dir / "suite.json").write_text(json.dumps(dict(merged, versions=versions()), indent=1))
    (out_dir / "suite.md").write_text(table(merged) + "\n")
    plot(merged, out_dir / "suite.png")
    print(table(merged))


if __name__ == "__main__":
    main()
