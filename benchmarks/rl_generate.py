"""``rl.py``'s generation part: ``model.generate`` on a streamed NF4 model against the same
weights resident (bitsandbytes), in one process, alternated in rounds.

Each call is greedy with a KV cache and makes exactly ``new_tokens`` tokens; a streamer
(``TokenClock``) marks the prompt and each new token as generate hands them over (it has
waited for the token by then), so the prefill and a token step of decoding are timed inside
the one call, with the layer loads and bytes the runtime issued between the first and the
last token. A streamed record also keeps the window the call ran with and the planner's
decode term (``plan.decode.decode_term``) over the layers outside it, at the bandwidth
measured here.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

import layerstream
from layerstream.commands.run import allocator_defaults
from layerstream.units import parse_bytes

from common import build_random_nf4, cap_gpu, greedy_tokens, pinned_bandwidth
from rl_rows import WHOLE

MEASURED = ("generate_s", "prefill_s", "decode_ms_per_token_step", "loads_per_token_step", "bytes_per_token_step")
MARGIN_S = 90  # a batch is not started with less time than this left before the deadline


def time_left(deadline: float, what: str) -> bool:
    if deadline - time.monotonic() >= MARGIN_S:
        return True
    print(f"rl: under {MARGIN_S} s left of --deadline: {what} not measured", flush=True)
    return False


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth_gbps() -> float:
    """Pinned host-to-device GB/s on a GPU; on the CPU (the dry run) a host copy's, to fill the row."""
    if torch.cuda.is_available():
        return pinned_bandwidth()
    source, target = torch.empty(1 << 26, dtype=torch.uint8), torch.empty(1 << 26, dtype=torch.uint8)
    start = time.perf_counter()
    target.copy_(source)
    return source.numel() / max(time.perf_counter() - start, 1e-9) / 1e9


class TokenClock(BaseStreamer):
    """The time, and the layer loads and bytes the runtime had issued, at each ``put``: the
    prompt first, then each new token (generate moves it to the host first, so the token's
    compute is done)."""

    def __init__(self, model):
        self.pool = layerstream.get_runtime(model).pool if layerstream.is_streamed(model) else None
        self.marks = []

    def put(self, value) -> None:
        copied = (self.pool.loads, self.pool.h2d_bytes) if self.pool is not None else (0, 0)
        self.marks.append((time.perf_counter(), *copied))

    def end(self) -> None:
        pass

    def decode(self) -> dict:
        """The prefill (prompt to first token) and the token steps after it."""
        (prompt, _, _), (first, loads, nbytes), (last, end_loads, end_bytes) = (
            self.marks[0],
            self.marks[1],
            self.marks[-1],
        )
        steps = max(len(self.marks) - 2, 1)
        return {
            "prefill_s": first - prompt,
            "decode_ms_per_token_step": (last - first) / steps * 1e3,
            "loads_per_token_step": (end_loads - loads) / steps,
            "bytes_per_token_step": (end_bytes - nbytes) / steps,
        }


def timed_call(model, ids, new_tokens: int) -> dict:
    """One ``generate`` call: greedy, KV cache, exactly ``new_tokens`` new tokens."""
    clock = TokenClock(model)
    synchronize()
    start = time.perf_counter()
    out = model.generate(**greedy_tokens(ids, new_tokens), streamer=clock)
    synchronize()
    return {"generate_s": time.perf_counter() - start, "out": out, **clock.decode()}


def new_record(settings, batch: int, cap: str, window: str, command: str) -> dict:
    """``window``: "none" (the resident model), "runtime" or "all" (streamed)."""
    return {
        "name": f"generate-{settings.shape}-b{batch}-{cap}-{window}",
        "kind": "generate",
        "model": settings.model,
        "batch": batch,
        "cap": cap,
        "mode": "resident" if window == "none" else "streamed",
        "window": window,
        "new_tokens": settings.new_tokens,
        "prompt_tokens": settings.prompt_tokens,
        "rounds": settings.rounds,
        **{key: [] for key in MEASURED},
        "command": command,
    }


def add_round(record: dict, measured: dict, reference=None) -> None:
    """One round's figures; against the resident output of the same round where given."""
    for key in MEASURED:
        record[key].append(measured[key])
    record["tokens_generated"] = int(measured["out"].shape[1] - record["prompt_tokens"])
    if reference is not None:
        same = torch.equal(measured["out"].cpu(), reference.cpu())
        record["same_tokens_as_resident"] = record.get("same_tokens_as_resident", True) and same


def describe_window(record: dict, model, bandwidth: float, tflops) -> None:
    """The window the streamed model ran with, and the planner's decode term over the layers
    outside it (``plan.decode.decode_term``) at the measured bandwidth."""
    from layerstream.plan import layer_bytes, layer_shapes
    from layerstream.plan.decode import active_params, decode_term

    runtime = layerstream.get_runtime(model)
    window = set(runtime.window)
    sizes = layer_bytes(model.config, "nf4")
    streamed = [size for index, size in enumerate(sizes) if index not in window]
    params = active_params(layer_shapes(model.config))
    term = decode_term(streamed, runtime.config.slots, bandwidth, params, tflops)
    record.update(
        window_layers=len(window),
        layers=len(sizes),
        slots=runtime.config.slots,
        planner_layers_copied=term.layers_copied,
        copy_bound_ms_per_token_step=term.copy_seconds * 1e3,
        compute_bound_batch=term.compute_bound_batch,
        tflops=tflops,
        bandwidth_gbps=bandwidth,
    )


def build(shape: dict):
    model = build_random_nf4(shape)
    model.requires_grad_(False)
    return model


def set_cap(cap: str) -> None:
    if torch.cuda.is_available() and cap == WHOLE:  # an earlier cap in this process lifted
        torch.cuda.set_per_process_memory_fraction(1.0)
    elif torch.cuda.is_available():
        cap_gpu(parse_bytes(cap))


def prompts(settings, batch: int, vocab: int):
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, settings.prompt_tokens), generator=generator).to(device())


def streamed(shape: dict, settings, vram_budget):
    """The random model streamed as ``stream_model`` streams it, its resident part placed."""
    model = build(shape)
    layerstream.stream_model(model, slots=settings.slots, vram_budget=vram_budget, device=device())
    return model.to(device())


def measure_whole_gpu(settings, models: dict, bandwidth, tflops, command, save, deadline) -> None:
    """Per batch, rounds of one call by each model (``models``: the resident one first, then
    the streamed ones by window); round 0 warms up (and lets a window size itself)."""
    for batch in settings.batches:
        if not time_left(deadline, f"batch {batch} with the whole GPU"):
            return
        ids = prompts(settings, batch, models["none"].config.vocab_size)
        records = {window: new_record(settings, batch, WHOLE, window, command) for window in models}
        for round_index in range(settings.rounds + 1):
            reference = timed_call(models["none"], ids, settings.new_tokens)
            if round_index:
                add_round(records["none"], reference)
            for window, model in list(models.items())[1:]:
                measured = timed_call(model, ids, settings.new_tokens)
                if round_index:
                    add_round(records[window], measured, reference["out"])
                    describe_window(records[window], model, bandwidth, tflops)
        save(list(records.values()))


def measure_capped(settings, model, cap: str, bandwidth, tflops, command, save, deadline) -> None:
    """The model streamed again as a user under ``cap`` streams it, the cap enforced."""
    set_cap(cap)
    held = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None  # what else stays
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    layerstream.stream_model(model, slots=settings.slots, vram_budget=parse_bytes(cap), device=device())
    model.to(device())
    for batch in settings.batches:
        if not time_left(deadline, f"batch {batch} under {cap}"):
            break
        ids = prompts(settings, batch, model.config.vocab_size)
        record = new_record(settings, batch, cap, "runtime", command)
        for round_index in range(settings.rounds + 1):
            measured = timed_call(model, ids, settings.new_tokens)
            if round_index:
                add_round(record, measured)
                describe_window(record, model, bandwidth, tflops)
        if settings.profile:
            profile_call(model, ids, Path(settings.profile) / f"generate-{cap}-b{batch}")
        record["cap_applied"] = torch.cuda.is_available()
        record["allocated_before_gib"] = held
        if torch.cuda.is_available():
            record["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        save([record])
    layerstream.unstream_model(model, device="cpu")
    set_cap(WHOLE)


def profile_call(model, ids, stem: Path, new_tokens: int = 16) -> None:
    """One ``generate`` call under torch's profiler: ``stem``.json.gz (a Chrome trace: the copy
    stream beside the compute stream, the host's gaps), ``stem``.txt (operators by host
    time and kernels by device time), and ``stem``.host.txt: a second call under cProfile
    (the host's time by Python function, layerstream's hooks among them)."""
    from torch.profiler import ProfilerActivity, profile

    stem.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    with profile(activities=activities) as prof:
        timed_call(model, ids, new_tokens)
    host = cProfile.Profile()  # the host's time by Python function: decoding is launch-bound
    host.enable()
    timed_call(model, ids, new_tokens)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(45)
    Path(str(stem) + ".host.txt").write_text(text.getvalue())
    prof.export_chrome_trace(str(stem) + ".json.gz")
    averages = prof.key_averages()
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = averages.table(sort_by="self_cpu_time_total", row_limit=40) + averages.table(sort_by=sort, row_limit=25)
    (Path(str(stem) + ".txt")).write_text(table)


def measure_generation(settings, shape: dict, tflops, command: str, save, deadline: float) -> None:
    """With the whole GPU: the resident model, the model streamed as ``stream_model``'s
    defaults leave its window (``runtime``), and streamed with no window sizing and every
    layer set in the window by hand (``all``: the engine's ceiling); then the first streamed
    model again under each cap. ``save`` gets the records after each batch, so a part
    stopped early keeps what it measured."""
    allocator_defaults()  # what `layerstream run` and capped.py give both sides
    bandwidth = copy_bandwidth_gbps()
    if not settings.whole_gpu:  # the capped runs alone: nothing else holds GPU memory
        model = build(shape)
        for cap in settings.generate_caps:
            measure_capped(settings, model, cap, bandwidth, tflops, command, save, deadline)
        return
    models = {"none": build(shape).to(device()), "runtime": streamed(shape, settings, "auto")}
    models["all"] = streamed(shape, settings, None)
    layerstream.get_runtime(models["all"]).set_window(range(models["all"].config.num_hidden_layers))
    measure_whole_gpu(settings, models, bandwidth, tflops, command, save, deadline)
    model, by_hand = models.pop("runtime"), models.pop("all")
    for each in (model, by_hand):  # a runtime left alive would keep its window on the GPU
        layerstream.unstream_model(each, device="cpu")
    models.clear()
    del by_hand
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for cap in settings.generate_caps:
        measure_capped(settings, model, cap, bandwidth, tflops, command, save, deadline)
