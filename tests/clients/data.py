"""The four data shapes the trainers read, written as JSONL from the instruction data
shipped with layerstream: plain texts (SFT, the Trainer), preference pairs (DPO, ORPO,
CPO), unpaired labelled completions (KTO), and prompts (GRPO, RLOO)."""

from __future__ import annotations

import json
from pathlib import Path

from layerstream.data import data_path

ROWS = 16


def _write(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write(directory: Path) -> Path:
    """``<kind>.jsonl`` files in ``directory``; each kind also as ``<kind>/train.jsonl``, the
    layout TRL's scripts read with ``--dataset_name``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pairs = [json.loads(line) for line in data_path().read_text().splitlines() if line.strip()][:ROWS]
    kinds = {
        "sft": [{"text": f"Q: {p['instruction']}\nA: {p['response']}"} for p in pairs],
        "preference": [
            {"prompt": f"Q: {p['instruction']}\nA:", "chosen": " " + p["response"], "rejected": " no."} for p in pairs
        ],
        "unpaired": [
            {
                "prompt": f"Q: {p['instruction']}\nA:",
                "completion": " " + p["response"] if i % 2 else " no.",
                "label": bool(i % 2),
            }
            for i, p in enumerate(pairs)
        ],
        "prompt": [{"prompt": f"Q: {p['instruction']}\nA:"} for p in pairs],
    }
    for kind, rows in kinds.items():
        _write(directory / f"{kind}.jsonl", rows)
        (directory / kind).mkdir(exist_ok=True)
        _write(directory / kind / "train.jsonl", rows)
    return directory
