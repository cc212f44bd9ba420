"""The zero-edit benchmark's pairs on the CPU: the data it feeds TRL and the variants'
commands and comparisons."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_packed_pairs_give_trl_long_wrapped_sequences_of_the_repeated_data(monkeypatch, tmp_path):
    """--pair-tokens: the timed SFT pair packs sequences of that many tokens from the
    repeated data (a step bound by the GPU, not the host); without it, the short examples."""
    import zero_edit

    paths = {"llama3.2-3b": tmp_path / "m", "sft": tmp_path / "sft", "sft-packed": tmp_path / "packed"}
    plain = zero_edit.command(paths, "sft", "llama3.2-3b", "bf16", tmp_path / "o", 4, True)
    assert plain[plain.index("--max_length") + 1] == "256" and "--packing" not in plain
    monkeypatch.setattr(zero_edit, "PAIR_TOKENS", [2048])
    packed = zero_edit.command(paths, "sft", "llama3.2-3b", "bf16", tmp_path / "o", 4, True)
    assert packed[packed.index("--max_length") + 1] == "2048"
    assert packed[packed.index("--dataset_name") + 1] == str(tmp_path / "packed")
    assert packed[packed.index("--packing") :][:4] == ["--packing", "true", "--packing_strategy", "wrapped"]
    assert packed[:2] == ["layerstream", "run"], "the launcher form is unchanged"


def test_each_variant_puts_its_flags_right_after_the_launcher(tmp_path):
    import zero_edit

    paths = {"llama3-8b": tmp_path / "m", "sft": tmp_path / "sft"}
    for variant, (flags, _, _) in zero_edit.VARIANTS.items():
        line = zero_edit.command(paths, "sft", "llama3-8b", "4bit", tmp_path / "o", 4, True, variant)
        assert line[:2] == ["layerstream", "run"] and line[2 : 2 + len(flags)] == flags
        assert (
            line[2 + len(flags) :] == zero_edit.command(paths, "sft", "llama3-8b", "4bit", tmp_path / "o", 4, True)[2:]
        )
    accelerate = zero_edit.command(
        paths, "accelerate-sft", "llama3-8b", "4bit", tmp_path / "o", 4, True, "stream-embeddings"
    )
    at = accelerate.index("run") + 1
    assert accelerate[at - 3 : at + 1] == ["-m", "layerstream", "run", "--stream-embeddings"]


def test_a_variant_pair_runs_the_streamed_command_with_its_flags_and_compares_all_three(tmp_path):
    """``--variant``: each round also runs ``layerstream run`` with the variant's flags (the
    summary shows them taken), judged against the streamed run without them, with the losses
    of all three runs. (One variant runs here: a run costs half a minute; the other's command
    line is checked above.)"""
    import zero_edit

    variant = "stream-embeddings"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    argv = [sys.executable, str(ROOT / "benchmarks" / "zero_edit.py"), "--dry-run", "--work", str(tmp_path)]
    argv += ["--out", str(tmp_path / "out"), "--part", "pairs", "--variant", variant, "--pair-rounds", "1"]
    argv += ["--pair-steps", "4", "--full-determinism", "--only", "sft-llama3.2-3b-bf16-24GiB"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads((tmp_path / "out" / f"zero-edit-pairs-deterministic-{variant}.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert [n.split("24GiB-")[-1] for n in names] == ["plain", "streamed", f"streamed-{variant}"]
    assert all(r["returncode"] == 0 and len(r["losses"]) == 4 for r in result["rows"])
    log = (tmp_path / "runs" / f"{names[-1]}.log").read_text()
    assert "the streamed head is fetched to the device for it" in log, "the variant's flags reached the launcher"
    plain, verdict = result["pairs"]
    assert plain["against"] == "the streamed run against the plain script"
    assert verdict["case"].endswith(variant) and verdict["against"] == zero_edit.VARIANTS[variant][2]
    assert verdict["losses_equal_to_plain"] and verdict["speed_vs_plain"] > 0
