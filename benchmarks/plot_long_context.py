"""The longest trainable sequence per GPU memory cap, as a picture (no GPU).

Reads the rows benchmarks/long_context.py (the project's harness) and
benchmarks/long_context_client.py (TRL's ``sft.py``, unchanged) wrote
(benchmarks/results/long-context.json) and draws them, one line per client, beside the figures Unsloth publishes for the same models and caps (its
long-context tables: QLoRA, LoRA r=32 on all linear layers, batch 1), and beside plain
Hugging Face with FlashAttention-2 from the same tables. Each measured point is labelled
with its speed against the best configuration without offload or tiling that fits the
H200's full memory at that length.

    python benchmarks/plot_long_context.py   # -> benchmarks/results/long-context/long-context.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "long-context.json")
PICTURE = os.path.join(HERE, "results", "long-context", "long-context.png")

# Published longest sequences in tokens per card size in GB (Unsloth's documentation,
# Llama-3.1-8B and Llama-3.3-70B QLoRA); 70B does not fit 24 GB there.
PUBLISHED = {
    "8B": {
        "Unsloth": {12: 21848, 16: 40724, 24: 78475, 80: 342733},
        "Hugging Face + FA2": {12: 932, 16: 2551, 24: 5789, 80: 28454},
    },
    "70B": {"Unsloth": {48: 12106, 80: 89389}},
}
COLOURS = {"Unsloth": "tab:blue", "Hugging Face + FA2": "tab:grey"}
# a measured row's line, by its client: the harness or the user's command
SERIES = {
    "harness": ("layerstream, harness", "tab:green", "o"),
    "sft": ("layerstream, TRL sft.py", "tab:red", "^"),
    "train": ("layerstream train, long recipe", "tab:purple", "v"),
    "trainer": ("layerstream, Trainer script", "tab:orange", "D"),
    "trainer-ends": ("layerstream, Trainer script, streamed ends", "tab:brown", "s"),
}
# the series whose points carry their figures: more notes at one cap would overlap
NOTED = ("harness", "sft")
# the start of each client's label in a row (long_context_client.client_label)
_CLIENT_LABELS = {"harness": "harness", "TRL ": "sft", "layerstream train ": "train", "Trainer script": "trainer"}
_ENDS_FLAG = "--layer_stream_embeddings"  # a Trainer script's row with it is a series of its own


def size_of(row: dict) -> str:
    return "70B" if "70B" in row["model"] else "8B"


def client_of(row: dict) -> str:
    """Which command a row measured: "harness" (the project's own loop), "sft" (TRL's script),
    "train" (`layerstream train`), "trainer" (a plain Trainer script) or "trainer-ends" (the
    same with --layer_stream_embeddings)."""
    for start, kind in _CLIENT_LABELS.items():
        if row["client"].startswith(start):
            return "trainer-ends" if kind == "trainer" and _ENDS_FLAG in row["client"] else kind
    raise ValueError(f"a row of an unknown client: {row['client']!r}")


def measured_points(rows: list) -> dict:
    """{"8B": {"harness": [(vram_gib, max_tokens, x_baseline or None), ...], "client": [...]},
    "70B": {...}}, each by cap."""
    points: dict = {size: {kind: [] for kind in SERIES} for size in ("8B", "70B")}
    for row in rows:
        base = row.get("baseline_step_s")
        ratio = base / row["step_s"] if base and row.get("step_s") else None
        points[size_of(row)][client_of(row)].append((row["vram_gib"], row["max_tokens"], ratio))
    return {size: {kind: sorted(found) for kind, found in by.items()} for size, by in points.items()}


def draw(points: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, size in zip(axes, ("8B", "70B")):
        for name, series in PUBLISHED[size].items():
            caps = sorted(series)
            ax.plot(
                caps,
                [series[c] for c in caps],
                marker="s",
                linestyle="--",
                color=COLOURS[name],
                label=f"{name} (published)",
            )
        for kind, ours in points[size].items():
            if not ours:
                continue
            label, colour, marker = SERIES[kind]
            caps, tokens = [p[0] for p in ours], [p[1] for p in ours]
            ax.plot(caps, tokens, marker=marker, linewidth=2, color=colour, label=f"{label} (measured)")
            if kind not in NOTED:  # the other clients' figures are in docs/workloads.md's table
                continue
            below = kind == "harness"  # the harness's notes below its line, TRL's above
            for cap, tokens, ratio in ours:
                note = f"{tokens:,}" + (f"\n{ratio:.2f}x speed" if ratio else "\nno baseline fits")
                offset = (6, -22) if below else (-46, 8)
                ax.annotate(note, (cap, tokens), textcoords="offset points", xytext=offset, fontsize=7, color=colour)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([12, 16, 24, 48, 80], ["12", "16", "24", "48", "80"])
        ax.set_xlim(9, 110)  # room left of the 12 GiB notes and right of the 80 GiB ones
        ax.set_xlabel("GPU memory (GiB cap; published: the card's GB)")
        ax.set_title(f"Llama-3 {size}-shaped QLoRA, r=32 all-linear, batch 1", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("longest sequence trained (tokens)")
    low, high = axes[0].get_ylim()
    axes[0].set_ylim(low, high * 2.5)  # room above the longest point for its note
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=RESULTS, help="rows written by long_context.py and long_context_client.py")
    parser.add_argument("--out", default=PICTURE, help="the PNG to write")
    args = parser.parse_args(argv)
    rows = json.load(open(args.results))
    if not rows:
        print(f"{args.results} has no rows: run benchmarks/long_context.py first", file=sys.stderr)
        return 1
    draw(measured_points(rows), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
