"""``rl.py``'s rows, made from the runs rl.json keeps (so a later command's rows include
the earlier commands' runs). Pure: no torch, no GPU.

Every row has model, quantization, cap, trainer ("generate" or "grpo"), generations (the
sequences generated at once: the batch, or the completions per prompt), completion_tokens,
step_s (one ``generate`` call, or one optimizer step), resident_step_s, speed_vs_resident,
decode_ms_per_token_step, window_layers, target, meets_target and command; the functions
below say what else each kind has.
"""

from __future__ import annotations

import math
import statistics

WHOLE = "whole"  # a cap: the whole GPU, no per-process memory fraction
DEFAULT_GRPO_CAP = "12GiB"  # the GRPO pair's streamed run's, unless ``rl.py --grpo-cap`` says
TIMED_FROM_STEP = 2  # GRPO steps before this fill slots and size the window: not timed
GENERATE_FIGURES = ("calls", "seconds", "layer_loads", "h2d_gbps", "stall_fraction", "window_layers")
TRAIN_FIGURES = ("h2d_gbps", "stall_fraction", "layer_loads", "window_layers", "peak_vram_gib", "oom_retries")
WINDOWS = {
    "runtime": "as the runtime leaves it",
    "all": "every layer, set by hand (vram_budget=None, get_runtime(model).set_window)",
}
TARGETS = {"generate": 0.95, "grpo": 0.8}  # streamed speed as a fraction of resident's


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def cap_label(cap: str) -> str:
    return "whole GPU" if cap == WHOLE else cap


def rows(runs: list) -> list:
    return generation_rows(runs) + grpo_pair_rows(runs) + grpo_big_rows(runs)


# -- generate ---------------------------------------------------------------------------


def generation_rows(runs: list) -> list:
    records = [run for run in runs if run.get("kind") == "generate"]
    # a resident record pairs only with streamed ones of its own command: a ratio is same-run
    resident = {(r["model"], r["batch"], r["command"]): r for r in records if r["mode"] == "resident"}
    streamed = [r for r in records if r["mode"] == "streamed"]
    return [generation_row(r, resident.get((r["model"], r["batch"], r["command"]))) for r in streamed]


def generation_target(record) -> tuple:
    """(threshold, what it is against): 0.95 of resident for the whole GPU as the runtime
    leaves the window; under a cap the copy bound, for which no threshold is set."""
    if record["cap"] != WHOLE:
        return (
            None,
            "fraction_of_bound: max(the resident token step, the copy bound) / the token step (no threshold set)",
        )
    if record["window"] != "runtime":
        return None, "none: the ceiling with every layer in the window, beside the runtime's row"
    return TARGETS["generate"], f"speed_vs_resident >= {TARGETS['generate']}"


def generation_row(record: dict, resident) -> dict:
    """Also: the window as run, the layer loads the runtime counted per token step and what
    they copied at the measured bandwidth, the planner's decode term over the layers outside
    the window (layers copied, copy bound, compute-bound batch) and whether the greedy
    tokens equal the resident model's."""
    step = median(record["generate_s"])
    resident_step = median(resident["generate_s"]) if resident else None
    decode, copy_bound = median(record["decode_ms_per_token_step"]), record.get("copy_bound_ms_per_token_step")
    resident_decode = median(resident["decode_ms_per_token_step"]) if resident else None
    # a token step cannot beat the resident one, nor the copy of the layers outside the window
    bound = max(resident_decode, copy_bound or 0.0) if resident_decode is not None else None
    tokens = record["batch"] * record["new_tokens"]
    speed = ratio(resident_step, step)
    threshold, target = generation_target(record)
    copied = median(record["bytes_per_token_step"])
    bandwidth = record.get("bandwidth_gbps")
    return {
        "model": record["model"],
        "quantization": "nf4",
        "cap": cap_label(record["cap"]),
        "trainer": "generate",
        "generations": record["batch"],
        "completion_tokens": record["new_tokens"],
        "prompt_tokens": record["prompt_tokens"],
        "window": WINDOWS[record["window"]],
        "resident": "bitsandbytes NF4 resident in the whole GPU, same weights, same process",
        "step_s": step,
        "resident_step_s": resident_step,
        "speed_vs_resident": speed,
        "tokens_per_s": ratio(tokens, step),
        "resident_tokens_per_s": ratio(tokens, resident_step),
        "decode_ms_per_token_step": decode,
        "resident_decode_ms_per_token_step": resident_decode,
        "prefill_s": median(record["prefill_s"]),
        "window_layers": record.get("window_layers"),
        "layers": record.get("layers"),
        "slots": record.get("slots"),
        "layer_loads_per_token_step": median(record["loads_per_token_step"]),
        "measured_copy_ms_per_token_step": ratio(copied, bandwidth * 1e6) if bandwidth else None,
        "planner_layers_copied": record.get("planner_layers_copied"),
        "copy_bound_ms_per_token_step": copy_bound,
        "fraction_of_copy_bound": ratio(copy_bound, decode),
        "bound_ms_per_token_step": bound,
        "fraction_of_bound": ratio(bound, decode),
        "compute_bound_batch": record.get("compute_bound_batch"),
        "bandwidth_gbps": bandwidth,
        "same_tokens_as_resident": record.get("same_tokens_as_resident"),
        "cap_applied": record.get("cap_applied", record["cap"] == WHOLE),
        "target": target,
        "meets_target": speed >= threshold if threshold and speed is not None else None,
        "rounds": len(record["generate_s"]),
        "command": [record["command"]],
    }


# -- GRPO -------------------------------------------------------------------------------


def timed(values: list, start: int) -> list:
    return list(values[start:])


def per_step_decode_ms(run: dict, start: int) -> list:
    """Each step's ``generate`` call over the completion's token steps (the prefill included)."""
    planned = run["settings_used"]["completion_tokens"]
    lengths = run.get("completion_lengths") or []
    pairs = [(s, lengths[i] if i < len(lengths) and lengths[i] else planned) for i, s in enumerate(run["generate_s"])]
    return [seconds / tokens * 1e3 for seconds, tokens in pairs[start:]]


def figures(runs: list, names, prefix: str, start: int) -> dict:
    """The median over the runs' timed steps of each of layerstream's logged figures."""
    return {
        name: median(
            [v for run in runs for v in timed(run["layerstream"].get(f"layerstream/{prefix}{name}", []), start)]
        )
        for name in names
    }


def pooled(runs: list, key: str, start: int) -> list:
    return [value for run in runs for value in timed(run[key], start)]


def grpo_pair_rows(runs: list) -> list:
    """One row per trainer, model, quantization, GPU, determinism setting, streamed cap and
    step count (runs measured before these were recorded were GRPO, NF4, not deterministic
    and under 12 GiB): a row pairs runs of one card, timed and compared alike (runs of other
    lengths save their adapters at other steps and log other losses)."""
    pairs = [run for run in runs if run.get("kind") == "grpo-pair"]
    kinds = sorted({pair_kind(r) for r in pairs}, key=str)
    return [grpo_pair_row([r for r in pairs if pair_kind(r) == kind]) for kind in kinds]


def quantization_of(run: dict) -> str:
    return run.get("quantization", "nf4")


def trainer_of(run: dict) -> str:
    return run.get("trainer", "grpo")


def deterministic(run: dict) -> bool:
    return bool(run.get("settings_used", {}).get("full_determinism"))


def streamed_cap(run: dict) -> str:
    """The cap the streamed run of this run's command had (the resident run's too: it pairs
    with that one); runs measured before it was recorded had 12 GiB."""
    return run.get("settings_used", {}).get("streamed_cap", DEFAULT_GRPO_CAP)


def pair_kind(run: dict) -> tuple:
    return (
        trainer_of(run),
        run["model"],
        quantization_of(run),
        run.get("gpu") or "",
        deterministic(run),
        streamed_cap(run),
        run.get("settings_used", {}).get("steps"),
    )


def grpo_pair_row(runs: list) -> dict:
    """TRL's script streamed under the cap against resident with the whole GPU: pooled step
    medians, the paired speed over the rounds both ran (``zero_edit.compare``), whether the
    losses and gradient norms agree, and layerstream's generate_* and training figures."""
    from zero_edit import compare

    resident = {run["round"]: run for run in runs if not run["streamed"]}
    streamed = {run["round"]: run for run in runs if run["streamed"]}
    both = sorted(set(resident) & set(streamed))
    plains, streameds = [resident[r] for r in both], [streamed[r] for r in both]
    first = runs[0]
    cap = next((run["cap"] for run in runs if run["streamed"]), None)
    trainer = trainer_of(first)
    verdict = compare((trainer, first["model"], quantization_of(first), cap), plains, streameds) if both else {}
    step = median(pooled(list(streamed.values()), "step_s", TIMED_FROM_STEP))
    resident_step = median(pooled(list(resident.values()), "step_s", TIMED_FROM_STEP))
    speed = verdict.get("speed_vs_plain")
    generating = figures(list(streamed.values()), GENERATE_FIGURES, "generate_", TIMED_FROM_STEP)
    return {
        "model": first["model"],
        "quantization": quantization_of(first),
        "cap": cap_label(cap) if cap else None,
        "trainer": trainer,
        "client": f"trl.scripts.{trainer}, unchanged",
        "resident": "the same script without layerstream (python -m), the whole GPU",
        "generations": first["settings_used"]["generations"],
        "completion_tokens": first["settings_used"]["completion_tokens"],
        "steps": first["settings_used"].get("steps"),
        "step_s": step,
        "resident_step_s": resident_step,
        "speed_vs_resident": speed,
        "speed_vs_resident_by_round": verdict.get("speed_vs_plain_by_round"),
        "speed_vs_resident_of_medians": verdict.get("speed_vs_plain_of_medians"),
        "decode_ms_per_token_step": median(
            [v for run in streamed.values() for v in per_step_decode_ms(run, TIMED_FROM_STEP)]
        ),
        "resident_decode_ms_per_token_step": median(
            [v for run in resident.values() for v in per_step_decode_ms(run, TIMED_FROM_STEP)]
        ),
        "window_layers": generating["window_layers"],
        "layerstream_generate": generating,
        "layerstream_train": figures(list(streamed.values()), TRAIN_FIGURES, "", TIMED_FROM_STEP),
        "alloc_retries": {  # the caching allocator's free-and-retry count by the last step, per side
            side: max((run["alloc_retries"][-1] for run in chosen.values() if run.get("alloc_retries")), default=None)
            for side, chosen in (("streamed", streamed), ("resident", resident))
        },
        "decode_trace": latest_decode_traces(streamed, resident),
        "full_determinism": deterministic(first),
        **training_compared(verdict, plains, streameds),
        "target": f"speed_vs_resident >= {TARGETS[trainer]}" if trainer in TARGETS else None,
        "meets_target": speed >= TARGETS[trainer] if speed is not None and trainer in TARGETS else None,
        "rounds": len(both),
        "rounds_measured_apart": measured_apart(plains, streameds),
        "failed_runs": [run["name"] for run in runs if run["returncode"] != 0],
        "gpu": next((run["gpu"] for run in runs if run.get("gpu")), None),
        "command": sorted({run["rl_command"] for run in runs}),
        "run_commands": {
            kind: chosen[max(chosen)]["command"]
            for kind, chosen in (("resident", resident), ("streamed", streamed))
            if chosen
        },
    }


def training_compared(verdict: dict, plains: list, streameds: list) -> dict:
    """Whether the streamed runs trained as the resident ones: losses, gradient norms, saved
    adapters, and whether the resident runs saved the same adapter as each other (where not,
    the script itself is not repeatable and a differing adapter says nothing about
    streaming). Runs whose every gradient norm is 0 trained nothing: not compared."""
    norms = [run["grad_norms"] for run in plains + streameds]
    if norms and not any(value for run_norms in norms for value in run_norms):
        note = "every gradient norm is 0: the runs trained nothing, so they do not compare training"
        return {"losses_equal": None, "grad_norms_equal": None, "adapters_equal": None, "adapters_note": note}
    residents = [run for run in plains if run.get("adapter")]
    repeat = adapters_compared(residents)["adapters_equal"] if len(residents) > 1 else None
    compared = {
        "losses_equal": verdict.get("losses_equal"),
        "grad_norms_equal": all(n == norms[0] for n in norms) if norms else None,
        **adapters_compared(plains + streameds),
        "resident_adapters_repeat": repeat,
    }
    logged = {run["name"]: len(run["losses"]) for run in plains + streameds}
    if len(set(logged.values())) > 1:  # a run stopped early: its steps against the others' first ones
        shortest = min(logged.values())
        first = [run["losses"][:shortest] for run in plains + streameds]
        alike = all(losses == first[0] for losses in first)
        compared["losses_equal"] = None
        compared["losses_note"] = (
            f"the runs logged different numbers of steps ({', '.join(f'{n}: {c}' for n, c in logged.items())}); "
            f"over the first {shortest} the losses are {'equal' if alike else 'not equal'}"
        )
    return compared


def measured_apart(plains: list, streameds: list) -> list:
    """The rounds whose resident and streamed runs came from different commands (``--sides``:
    another machine start, maybe another machine), so their speed is not a same-process pair."""
    return [p["round"] for p, s in zip(plains, streameds) if p.get("rl_command") != s.get("rl_command")]


def adapters_compared(runs: list) -> dict:
    """``adapters_equal``: whether every run saved the same adapter at the same step, bit for
    bit (``rl.adapter_digest``); None, with ``adapters_note`` naming the runs, where one saved
    none."""
    missing = [run["name"] for run in runs if not run.get("adapter")]
    if not runs or missing:
        return {"adapters_equal": None, "adapters_note": f"no saved adapter: {', '.join(missing) or 'no runs'}"}
    saved = {(run["adapter"]["step"], run["adapter"]["sha256"]) for run in runs}
    return {"adapters_equal": len(saved) == 1, "adapter_step": min(step for step, _ in saved)}


def latest_decode_traces(streamed: dict, resident: dict):
    """Each side's summary of a few traced token steps (``--trace-decode``: torch's profiler
    in the second step's generation) from its latest round that has one; None where neither."""
    traces = {}
    for side, chosen in (("streamed", streamed), ("resident", resident)):
        traced = [r for r in sorted(chosen) if chosen[r].get("decode_trace")]
        if traced:
            traces[side] = dict(chosen[traced[-1]]["decode_trace"], round=traced[-1])
    return traces or None


def grpo_big_rows(runs: list) -> list:
    return [grpo_big_row(run) for run in runs if run.get("kind") == "grpo-big"]


def trained(run: dict) -> bool:
    """Every step ran and logged a finite loss."""
    losses = run["losses"]
    return run["returncode"] == 0 and len(losses) == run["settings_used"]["steps"] and all(map(math.isfinite, losses))


def grpo_big_row(run: dict) -> dict:
    """Streamed only (no resident run fits): the steps after the first (which has no window
    yet), and where they go: generation (its copies and the compute's waits on them, from
    layerstream's generate_* figures) and the rest of the step (the training pass, the
    rewards, the optimizer)."""
    start = 1 if len(run["step_s"]) > 1 else 0
    step = median(timed(run["step_s"], start))
    generate = median(timed(run["generate_s"], start))
    generating = figures([run], GENERATE_FIGURES, "generate_", start)
    training = figures([run], TRAIN_FIGURES, "", start)
    layer_bytes, loads, gbps = run.get("layer_bytes"), generating["layer_loads"], generating["h2d_gbps"]
    copy_s = loads * layer_bytes / (gbps * 1e9) if layer_bytes and loads is not None and gbps else None
    stall = generating["stall_fraction"]
    return {
        "model": run["model"],
        "quantization": "nf4",
        "cap": cap_label(run["cap"]),
        "trainer": "grpo",
        "client": "GRPOTrainer (grpo_client.py: the model built in memory)",
        "generations": run["settings_used"]["generations"],
        "completion_tokens": run["settings_used"]["completion_tokens"],
        "step_s": step,
        "first_step_s": run["step_s"][0] if run["step_s"] else None,
        "resident": None,
        "resident_step_s": None,
        "speed_vs_resident": None,
        "decode_ms_per_token_step": median(per_step_decode_ms(run, start)),
        "window_layers": generating["window_layers"],
        "trains": trained(run),
        "where_time_goes": {
            "generate_s": generate,
            "generate_share": ratio(generate, step),
            "generate_copy_s": copy_s,
            "generate_stall_s": stall * generating["seconds"] if stall is not None and generating["seconds"] else None,
            "rest_of_step_s": step - generate if step is not None and generate is not None else None,
            "train_stall_fraction": training["stall_fraction"],
            "train_layer_loads": training["layer_loads"],
        },
        "layerstream_generate": generating,
        "layerstream_train": training,
        "peak_allocated_gib": run.get("peak_allocated_gib"),
        "peak_reserved_gib": run.get("peak_reserved_gib"),
        "target": "trains (no resident baseline fits)",
        "meets_target": trained(run),
        "timed_out": run["timed_out"],
        "gpu": run.get("gpu"),
        "out_of_memory": run["out_of_memory"],
        "command": [run["rl_command"]],
        "run_commands": {"streamed": run["command"]},
    }


def summary(table: list) -> str:
    """The rows as a Markdown table, for the command's output."""

    def number(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| model | cap | trainer | gens | tokens | window layers | step s | resident s | x resident | ms/token step |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        by_hand = " (by hand)" if row.get("window") == WINDOWS["all"] else ""
        window = f"{row['window_layers']:g}{by_hand}" if row.get("window_layers") is not None else "-"
        lines.append(
            f"| {row['model']} | {row['cap']} | {row['trainer']} | {row['generations']} | {row['completion_tokens']} | "
            f"{window} | {number(row['step_s'])} | {number(row['resident_step_s'])} | "
            f"{number(row['speed_vs_resident'], 2)} | {number(row['decode_ms_per_token_step'], 1)} |"
        )
    return "\n".join(lines)
