"""The clients ``long_context_client.py`` runs and reads: each client's command (TRL's
``sft.py`` behind ``layerstream run``, ``layerstream train`` with the long recipe, a plain Trainer
script with ``--layer_stream``) and its plain baseline, the checkpoint and dataset they read,
and what their logs say (layerstream's lines, what "auto" turned on, the verdict)."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
LORA = "r=32 alpha=16 all-linear, dropout 0.05 (TRL's default)"
LONG_SETTINGS = ("offload_activations", "mlp_tile_tokens", "loss_chunk_tokens")
DATA_ROWS = 6  # rows of the dataset: every step a new one (3 steps), none repeated
TRAINED, OOM = "trained", "out of memory"

RECIPE = HERE.parent / "configs" / "llama-3.1-8b-qlora-long-24gb.yaml"  # `--client train`'s long recipe
TRAINER_SCRIPT = HERE / "long_trainer_script.py"  # `--client trainer`'s plain Trainer script
# trainer-ends: the Trainer script with --layer_stream_embeddings too (its float32 ends, from
# prepare_model_for_kbit_training, are 4.2 GB of an 8B model's budget)
CLIENTS = ("sft", "train", "trainer", "trainer-ends")
# whose plain run is each client's baseline: TRL's script for the two that train through TRL's
# SFTTrainer (the same loss), the Trainer script itself without --layer_stream
BASELINE_CLIENT = {"sft": "sft", "train": "sft", "trainer": "trainer", "trainer-ends": "trainer"}
LORAS = {
    "sft": LORA,
    "train": "the recipe's: r=32 alpha=64 all-linear, dropout 0",
    "trainer": "r=32 alpha=16 all-linear, dropout 0.05",
    "trainer-ends": "r=32 alpha=16 all-linear, dropout 0.05",
}
# --same-loss-baseline: the Trainer script's streamed run computes its loss with layerstream's
# chunked loss once "auto" turns it on, where the plain script computes the full logits' loss.
# Its same-loss baseline is the script with --layer_stream on the whole GPU (the window keeps
# every layer: nothing is copied) and the streamed run's loss_chunk_tokens: the same loss,
# layers resident. TRL's clients compute their loss alike on both sides (TRL's fused head).
SAME_LOSS_BASELINE = {"trainer": "trainer-same-loss"}
LORAS["trainer-same-loss"] = LORAS["trainer"]
# the layerstream flags each client's streamed run adds beyond its one word (the row's options)
CLIENT_OPTIONS = {"trainer-ends": {"stream_embeddings": "true"}}


def recipe_options() -> dict:
    """The long-sequence settings the recipe sets (the others are at "auto")."""
    import yaml

    stream = yaml.safe_load(RECIPE.read_text()).get("stream", {})
    names = ("offload_activations", "mlp_tile_tokens", "loss_chunk_tokens")
    return {name: str(stream[name]).lower() for name in names if name in stream}


def client_of(attempt: dict) -> str:
    return attempt.get("client", "sft")  # attempts from before --client were TRL's script


def client_label(client: str = "sft") -> str:
    from importlib.metadata import version

    if client == "train":
        return f"layerstream train {RECIPE.name} (TRL {version('trl')} SFTTrainer), with the cap as vram_budget"
    if client == "trainer":
        return "Trainer script (BitsAndBytesConfig, device_map, PEFT) with --layer_stream"
    if client == "trainer-ends":
        return "Trainer script (BitsAndBytesConfig, device_map, PEFT) with --layer_stream --layer_stream_embeddings"
    if client == "trainer-same-loss":
        return "Trainer script with --layer_stream on the whole GPU and the streamed run's loss_chunk_tokens"
    return f"TRL {version('trl')} trl.scripts.sft, unchanged, behind layerstream run"


# -- baselines --------------------------------------------------------------------------------
def baseline_label(baseline: str, run: dict) -> str:
    """What a row's baseline ``run`` was, by whose run it is (TRL's release: the run's own,
    where it kept one; runs from before they kept their versions say only TRL's)."""
    if baseline == "trainer-same-loss":
        return client_label(baseline)
    if baseline == "trainer":
        return "Trainer script without --layer_stream, the whole GPU"
    trl = (run.get("versions") or {}).get("trl")
    return f"TRL {trl} trl.scripts.sft, plain, the whole GPU" if trl else "TRL's trl.scripts.sft, plain, the whole GPU"


def baseline_for(args, streamed: Optional[dict]) -> tuple:
    """(whose run, flags added to it) is the baseline of the ``streamed`` run: the client's
    plain script, or with ``--same-loss-baseline`` (the Trainer script) its same-loss run
    given the streamed run's loss chunk, where it chunked one (else the plain script's loss
    is the streamed run's)."""
    flags = same_loss_flags(streamed) if args.same_loss_baseline else []
    return (SAME_LOSS_BASELINE[args.client], flags) if flags else (BASELINE_CLIENT[args.client], [])


# a same-loss baseline's other long-sequence settings, off: left at "auto", a length whose plan
# comes near the whole GPU would turn them on, and the baseline would no longer be resident
NOTHING_ELSE_ON = [
    "--layer_stream_mlp_tile_tokens",
    "0",
    "--layer_stream_offload_activations",
    "false",
    "--layer_stream_embeddings",
    "false",
]


def same_loss_flags(streamed: Optional[dict]) -> list:
    """What a same-loss baseline of the ``streamed`` run is given: the loss_chunk_tokens its
    "auto" decided and every other long-sequence setting off; [] where it chunked none (or
    said nothing): then the plain script's loss is the streamed run's, and the plain script
    is the baseline."""
    chunk = chunk_of(streamed) if streamed else None
    return ["--layer_stream_loss_chunk_tokens", str(int(chunk)), *NOTHING_ELSE_ON] if chunk else []


def given_chunk(flags: list) -> Optional[str]:
    """The loss chunk a same-loss baseline's flags gave it (None: not one)."""
    return (
        flags[flags.index("--layer_stream_loss_chunk_tokens") + 1]
        if "--layer_stream_loss_chunk_tokens" in flags
        else None
    )


def ran_as_given(attempt: dict, given: list) -> bool:
    """Whether a baseline ``attempt`` ran with the settings ``given``: given them, or (a
    same-loss run from before the other settings were given off) given the same chunk alone
    with "auto" turning nothing on."""
    flags = attempt.get("baseline_flags", [])
    if flags == given:
        return True
    settings = attempt.get("long_settings") or {}
    turned_on = settings.get("auto_decided") or any(" is on" in line for line in settings.get("lines") or [])
    return bool(given) and flags == given[:2] and not turned_on


def latest_streamed(attempts, client: str, cap: str, tokens: int) -> Optional[dict]:
    """The latest streamed run of ``client`` (no ablation) under ``cap`` at ``tokens``."""
    runs = [
        a
        for a in attempts
        if a["streamed"]
        and (a["cap"], a["tokens"], client_of(a)) == (cap, tokens, client)
        and not a.get("streamed_flags")
    ]
    return max(runs, key=lambda a: a["round"]) if runs else None


def attempt_name(attempts: dict, kind: str, cap: str, tokens: int, client: str, flags: list, loss_flags: list):
    """(name, round) of the next attempt of this kind: its round counts the earlier ones run
    alike, and a name already taken (an earlier run counted apart) takes the next round."""
    round_ = 1 + sum(
        (a["kind"], a["cap"], a["tokens"], client_of(a), a.get("streamed_flags", []))
        == (kind, cap, tokens, client, flags)
        and ran_as_given(a, loss_flags)
        for a in attempts.values()
    )
    prefix = "" if client == "sft" else f"{client}-"  # TRL's script's names as they were
    if loss_flags:  # a same-loss baseline is named by the chunk it was given
        prefix += f"chunk{given_chunk(loss_flags)}-"
    if flags:  # an ablation's attempts are named by their flags, apart from the client's own
        prefix += "ablation-" + re.sub(r"[^A-Za-z0-9]+", "-", " ".join(flags)).strip("-") + "-"
    while f"{prefix}{kind}-{cap}-{tokens}-round{round_}" in attempts:
        round_ += 1
    return f"{prefix}{kind}-{cap}-{tokens}-round{round_}", round_


def same_card(one: dict, other: dict) -> bool:
    """Whether two attempts ran on the same GPU model (either unknown: taken as the same; a
    speed ratio across cards would say nothing about layerstream)."""
    return not one.get("gpu") or not other.get("gpu") or one["gpu"] == other["gpu"]


def baseline_runs(attempts: list, client: str, tokens: int, streamed: dict) -> tuple:
    """(the baseline attempts, those that trained, whose they are) at ``tokens`` on the card of
    ``streamed`` (the row's latest streamed run): the client's same-loss runs given the loss
    chunk ``streamed`` decided, where one trained, else its plain script's."""
    flags = same_loss_flags(streamed)
    wanted = [(SAME_LOSS_BASELINE[client], flags)] if flags and client in SAME_LOSS_BASELINE else []
    wanted.append((BASELINE_CLIENT[client], []))  # a plain run was given no flag
    candidates = []
    for baseline, given in wanted:
        residents = sorted(
            (
                a
                for a in attempts
                if not a["streamed"]
                and a["tokens"] == tokens
                and client_of(a) == baseline
                and ran_as_given(a, given)
                and same_card(a, streamed)
            ),
            key=lambda a: a["round"],
        )
        candidates.append((residents, [a for a in residents if a["verdict"] == TRAINED], baseline))
    # the first whose runs trained; else the first that ran (its failures are the row's note)
    return next((c for c in candidates if c[1]), next((c for c in candidates if c[0]), candidates[0]))


def median_of(runs: list):
    """The median of the runs' timed steps (after each one's warm-up), pooled."""
    timed = [t for run in runs for t in run["step_s"][run["warmup_steps"] :]]
    return statistics.median(timed) if timed else None


def followed(base_runs: list, streamed_runs: list) -> tuple:
    """(baseline runs, streamed runs) pairwise: each baseline with the streamed run it followed,
    the one it names (``follows``; a same-loss baseline's ``same_loss_for``), else (attempts
    from before baselines named it) the one whose name ends in the same round; a baseline whose
    run is not among ``streamed_runs`` is left out. So a row's losses are compared within a
    pair, not against a round that no baseline followed."""
    by_name = {run["name"]: run for run in streamed_runs}
    by_round = {_round_in_name(run["name"]): run for run in streamed_runs}
    pairs = []
    for base in base_runs:
        named = base.get("follows") or base.get("same_loss_for")
        run = by_name.get(named) if named else by_round.get(_round_in_name(base["name"]))
        if run is not None:
            pairs.append((base, run))
    return [base for base, _ in pairs], [run for _, run in pairs]


def _round_in_name(name: str) -> Optional[str]:
    """ "round3" of "trainer-streamed-12GiB-24576-round3" (or of "...-round3-h100"): the name's
    round, which an older merge kept where it renumbered the field."""
    found = re.search(r"-(round\d+)(-[a-z0-9]+)?$", name)
    return found.group(1) if found else None


# -- inputs: the checkpoint and the dataset -------------------------------------------------
def write_checkpoint(work: Path, shape: str, timeout: float) -> Path:
    """``rl.write_checkpoint`` (reused when its index is there) in a fresh process: drawing the
    weights on the GPU would leave this process a CUDA context and cached blocks beside every run."""
    target = work / shape
    if not (target / "model.safetensors.index.json").exists():
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import Path; import rl; "
        code += f"rl.write_checkpoint(Path({str(work)!r}), {shape!r})"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=max(timeout, 1))
    return target


def random_words(rng: random.Random, chars: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words, total = [], 0
    while total < chars:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        words.append(word)
        total += len(word) + 1
    return " ".join(words)


def write_dataset(work: Path, checkpoint: Path, tokens: int) -> Path:
    """DIR/train.jsonl (``--dataset_name DIR``, as TRL's scripts read a local dataset) of
    ``DATA_ROWS`` rows of random words, each checked to tokenise, with the checkpoint's own
    tokenizer, to more than ``tokens`` tokens: every step then trains exactly ``--max_length``."""
    from transformers import AutoTokenizer

    folder = work / f"data-words-{tokens}"
    checked = folder / "checked.json"
    if checked.exists() and json.loads(checked.read_text()).get("checkpoint") == str(checkpoint):
        return folder
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rng, rows, chars = random.Random(0), [], tokens + 256
    while len(rows) < DATA_ROWS:
        text = random_words(rng, chars)
        if len(tokenizer(text)["input_ids"]) > tokens:
            rows.append(text)
        else:
            chars *= 2  # a tokenizer of several characters a token: longer rows
    lengths = [len(tokenizer(text)["input_ids"]) for text in rows]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))
    checked.write_text(json.dumps({"checkpoint": str(checkpoint), "tokens": lengths, "at_least": tokens}))
    return folder


# -- one attempt: TRL's script in a fresh process under capped.py ---------------------------
# how each client feeds its adapters, as the memory plan counts it: TRL's trainers cast a
# 4-bit model's adapters to bfloat16, the plain Trainer script leaves PEFT's float32; all
# three step under autocast (bf16); the dropout is TRL's default, the long recipe's 0, the
# script's 0.05
CLIENT_ADAPTERS = {
    "sft": dict(adapter_dtype="bfloat16", lora_dropout=True, autocast=True, trl_fused_head=True),
    "train": dict(adapter_dtype="bfloat16", lora_dropout=False, autocast=True, trl_fused_head=True),
    # prepare_model_for_kbit_training casts the embeddings, head and norms to float32: a
    # float32 residual stream, as the runtime plans it
    "trainer": dict(
        adapter_dtype="float32", lora_dropout=True, autocast=True, trl_fused_head=False, residual_dtype="float32"
    ),
}
CLIENT_ADAPTERS["trainer-ends"] = dict(CLIENT_ADAPTERS["trainer"], stream_embeddings=True)


def planned_longest(checkpoint: Path, client: str, cap_gib: float) -> int:
    """The longest length the memory plan fits under ``cap_gib`` for this client's run, its
    long-sequence settings and streamed ends left at "auto" as the run leaves them (GiB
    budget, batch 1; trainer-ends streams its ends from the start)."""
    from layerstream.plan import PlanRequest, load_config, max_seq
    from layerstream.units import GiB

    config = load_config(str(checkpoint))
    config.max_position_embeddings = max(config.max_position_embeddings, 1 << 21)  # no cap from the config
    request = PlanRequest(
        config,
        1,
        1,
        int(cap_gib * GiB),
        "nf4",
        lora_rank=32,
        **{
            "slots": "auto",
            "offload_activations": "auto",
            "mlp_tile_tokens": "auto",
            "loss_chunk_tokens": "auto",
            "stream_embeddings": "auto",
            **CLIENT_ADAPTERS[client],
        },
    )
    return max_seq(request)


def client_command(ctx, client: str, tokens: int, out: Path, streamed: bool) -> list:
    """The command of ``client`` at ``tokens``: streamed, or its plain baseline."""
    if client == "train" and streamed:
        return train_command(ctx, tokens, out)
    if client in ("trainer", "trainer-ends"):
        return trainer_command(ctx, tokens, out, streamed, ends=client == "trainer-ends")
    if client == "trainer-same-loss":  # run with the whole GPU: --layer_stream, layers resident
        return trainer_command(ctx, tokens, out, True)
    return sft_command(ctx, tokens, out, streamed)


def train_command(ctx, tokens: int, out: Path) -> list:
    """``layerstream train`` with the long recipe as shipped, its model, data, length and steps
    set to this run's, and the cap as its budget (the recipe's 24GiB names its card)."""
    sets = {
        "model.name": ctx.checkpoint,
        "model.config": ctx.checkpoint / "config.json",
        "data.path": ctx.data / "train.jsonl",
        "stream.vram_budget": "auto",
        "training.output_dir": out,
        "training.max_length": tokens,
        "training.max_steps": ctx.args.warmup + ctx.args.steps,
        "training.gradient_accumulation_steps": 1,
        "training.logging_steps": 1,
        "training.save_strategy": "no",
        "training.seed": 0,
    }
    if ctx.args.dry_run:
        sets.update({"stream.device": "cpu", "training.use_cpu": "true", "training.bf16": "false"})
    args = ["layerstream", "train", str(RECIPE)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args


EVERY_STEP_LOGGED_NOTHING_SAVED = "--logging_steps 1 --save_strategy no --report_to none --seed 0".split()


def run_flags(ctx, out: Path) -> list:
    """TrainingArguments flags both scripts take alike: where to write, how many steps, a log
    of every step, no checkpoint, no tracker, seed 0."""
    steps = str(ctx.args.warmup + ctx.args.steps)
    return ["--output_dir", str(out), "--max_steps", steps] + EVERY_STEP_LOGGED_NOTHING_SAVED


def trainer_command(ctx, tokens: int, out: Path, streamed: bool, ends: bool = False) -> list:
    """The plain Trainer script, with ``--layer_stream`` (and no other layerstream flag but
    ``--layer_stream_embeddings`` where ``ends``) or without."""
    args = [sys.executable, str(TRAINER_SCRIPT), "--model_name_or_path", str(ctx.checkpoint)]
    args += ["--dataset_file", str(ctx.data / "train.jsonl"), "--max_length", str(tokens)]
    args += run_flags(ctx, out)
    args += ["--per_device_train_batch_size", "1", "--gradient_checkpointing", "true"]
    args += ["--use_cpu", "true", "--bf16", "false"] if ctx.args.dry_run else ["--bf16", "true"]
    if streamed and ends:
        args += ["--layer_stream_embeddings", "true"]
    return args + (["--layer_stream", "true"] if streamed else [])


def sft_command(ctx, tokens: int, out: Path, streamed: bool) -> list:
    """TRL's sft script as a user runs it: ``python -m`` or behind ``layerstream run`` (no flag)."""
    args = ["-m", "trl.scripts.sft", "--model_name_or_path", str(ctx.checkpoint), "--dataset_name", str(ctx.data)]
    args += run_flags(ctx, out)
    args += ["--load_in_4bit", "--use_peft", "--lora_r", "32", "--lora_alpha", "16"]
    args += ["--lora_target_modules", "all-linear", "--per_device_train_batch_size", "1"]
    args += ["--max_length", str(tokens), "--dtype", ctx.args.dtype]
    args += ["--use_cpu", "--bf16", "false"] if ctx.args.dry_run else []  # as rl.py's dry run
    return (["layerstream", "run"] if streamed else [sys.executable]) + args


def layerstream_lines(log: str) -> list:
    """What layerstream printed: lines starting with 'layerstream' (also after a progress bar's
    carriage return) and the indented lines of its start-up summary that follow one."""
    kept, in_summary = [], False
    for piece in re.split(r"[\r\n]", log):
        at = piece.find("layerstream")
        if at >= 0 and "%|" in piece[at:] and "100%|" not in piece[at:]:  # its loading bar's states
            continue
        if at >= 0 and (at == 0 or piece[:at].rstrip().endswith(("]", "|")) or not piece[:at].strip()):
            kept.append(piece[at:].rstrip())
            in_summary = piece[at:].startswith("layerstream: streaming decoder layers")
        elif in_summary and piece.startswith("  "):
            kept.append(piece.rstrip())
        else:
            in_summary = False
    return kept


def summary_fields(lines: list) -> dict:
    """The start-up summary's lines by their label ('loss', 'long seq', 'predicted', ...)."""
    fields, key = {}, None
    for line in lines:
        if line.startswith("   ") and key:
            fields[key] += " " + line.strip()
        elif line.startswith("  ") and len(line) > 15:
            key = line[2:15].strip()
            fields[key] = line[15:].strip()
    return fields


def chunk_of(attempt: dict):
    """The loss_chunk_tokens a streamed attempt's "auto" decided (None: not seen, or off)."""
    decided = (attempt.get("long_settings") or {}).get("auto_decided") or {}
    return decided.get("loss_chunk_tokens") or None


def long_settings_seen(logs: list, lines: list) -> dict:
    """What ran for the long sequence: the Trainer log's figures of what "auto" turned on
    (layerstream/<setting>), the summary's loss and long-seq lines, and each line naming a setting."""
    figures = {}
    for entry in logs:
        figures.update({k.split("/", 1)[1]: v for k, v in entry.items() if k.startswith("layerstream/auto_long")})
        figures.update({k.split("/", 1)[1]: v for k, v in entry.items() if k.split("/", 1)[-1] in LONG_SETTINGS})
    summary = summary_fields(lines)
    named = [line for line in lines if any(s in line for s in LONG_SETTINGS) and not line.startswith("  ")]
    return {
        "auto_decided": figures or None,
        "loss_head": summary.get("loss"),
        "long_seq": summary.get("long seq"),
        "predicted": summary.get("predicted"),
        "lines": named,
    }


def verdict(returncode, timed_out: bool, steps: int, wanted: int, log: str) -> str:
    if returncode == 0 and steps >= wanted:
        return TRAINED
    if timed_out:
        return "timed out"
    if "out of memory" in log.lower() or "OutOfMemoryError" in log:
        return OOM
    return f"failed (exit {returncode})"
