"""What one QLoRA Trainer step keeps alive at its peak, measured on the CPU, against the
planner's ``layer_working_bytes``: the plain Trainer setup of ``long_trainer_script.py``
(NF4 with double quantisation, bf16 compute, LoRA r=32 on every linear layer with dropout
0.05, gradient checkpointing, ``bf16=True``) streamed by layerstream with an MLP tile, a
chunked loss and offloaded activations, on a small random Llama of 8B-like ratios.

Why: the planner's per-layer terms (``layerstream.plan.working_set``) are derived from
allocation traces, and the dtypes of a prepared model (peft's
``prepare_model_for_kbit_training``: float32 embeddings, head, norms and adapters, so a
float32 residual stream) differ from TRL's (no preparation, adapters cast to bf16). A CPU
trace shows every tensor with its dtype, shape and the source line that made it, without a
GPU, and two lengths split each figure into bytes per token and a constant.

The second step is profiled (the first builds the optimizer's state) with torch's profiler
and ``profile_memory``; its allocation events are replayed (as ``step_insight`` replays the
CUDA allocator's) to the step's peak and each phase's peak. Bytes are those allocated
during the step and still alive: the model, optimizer state and anything older are not in
them. The measured layer working set is the activations and dequantised weights alive at
the step's peak, without the layer boundaries (offloaded inputs fetched back, the
embedding's output) and the rotary cos/sin, which the planner counts elsewhere.

    python benchmarks/cpu_step_trace.py --setup prepared --tokens 2048,4096 --work /tmp/trace \\
        --out benchmarks/results/cpu/step-trace 2>&1 | tee benchmarks/results/cpu/step-trace/prepared.log
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from collections import Counter, defaultdict
from typing import Dict, List, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from step_insight import live_at_peak, source_of  # noqa: E402

# the toy model: Llama-3-8B's ratios (MLP 3.5x hidden, GQA 4:1, head 64) at hidden 512
MODEL = dict(
    model_type="llama",
    hidden_size=512,
    intermediate_size=1792,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    num_hidden_layers=4,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)
LORA = dict(r=32, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
# transformers' and accelerate's wrappers around a module's forward: a tensor is charged to
# the line inside them (step_insight.source_of already skips torch's own frames)
WRAPPERS = ("/accelerate/", "/utils/generic.py", "/utils/deprecation", "/utils/output_capturing")
MAIN_PHASES = ("forward", "loss", "recompute", "mlp-bw", "norm-bw", "attn-bw", "other-bw")
KINDS = ("activation", "dequantised weight", "boundary", "rotary cos/sin", "adapter-sized")
# layer_working_bytes' bytes per element: bf16 compute, and a prepared model's float32
# residual stream and adapters, or TRL's bf16 adapters
PLANNER = dict(prepared=dict(elem=2, residual_elem=4, adapter_elem=4), reference=dict(elem=2, adapter_elem=2))
SMALL = 65536  # rows under this many bytes are summed, not listed
_FRAME = re.compile(r"(.*)\((\d+)\): (.*)")


def cuda_like_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: ``native_dropout``, whose backward keeps a bool mask.

    Why: on the CPU ``at::dropout`` draws its noise as a tensor of the input's dtype and
    keeps that, 2-4 bytes an element where a GPU step keeps 1; LoRA's dropout runs on every
    adapted projection's input, so the CPU's own dropout would make the trace disagree with
    the GPU (and the planner, which counts the bool mask) in every layer."""
    if not training or p == 0:
        return input
    return torch.native_dropout(input, p, True)[0]


# --- the replay: plain Python over events in step_insight's format, tested on made-up events


def phase_of(event: dict) -> str:
    """Which part of the step allocated a tensor, from its Python frames and the autograd
    function it ran under: the chunked loss (with the model's forward outside the layers),
    a layer's forward or its recompute, the tiled MLP's backward, attention's, a norm's, or
    ``bw:<function>`` for another backward function."""
    files = [f["filename"] for f in event["frames"]]
    names = [f["name"] for f in event["frames"]]
    in_layer = any("tiled_mlp" in f or "checkpoint.py" in f for f in files)
    if any("chunked_loss" in f for f in files) and not in_layer:
        return "loss"
    backward = [op.split(": ", 1)[1] for op in event["ops"] if op.startswith("autograd::engine::evaluate_function")]
    if not backward:
        return "forward"
    if "recompute_fn" in names:
        return "recompute"
    if "TiledFunctionBackward" in backward:  # the tile's own backward nests inside it
        return "mlp-bw"
    if "Attention" in backward[0]:
        return "attn-bw"
    if backward[0] in ("PowBackward0", "RsqrtBackward0", "MeanBackward1"):
        return "norm-bw"
    return "bw:" + backward[0]


def make_event(action: str, addr: int, size: int, frames: List[dict], ops=(), dtype="?", shape=()) -> dict:
    """One allocation (``alloc``) or free (``free_completed``) in step_insight's format, with
    what the replay reads besides: the ops above it, its dtype and shape, source and phase."""
    event = dict(action=action, addr=addr, size=size, frames=frames, ops=list(ops), dtype=dtype, shape=tuple(shape))
    event["source"] = source_of(frames)
    event["phase"] = phase_of(event)
    return event


def main_phase(phase: str) -> str:
    return "other-bw" if phase.startswith("bw:") else phase


def kind_of(event: dict, tokens: int, head_dim: int = 64, rank: int = LORA["r"]) -> str:
    """What a tensor is to the planner: an adapter-sized tensor (a gradient, AdamW's
    temporaries, a bf16 cast of a float32 adapter), an NF4 weight dequantised for a matmul,
    a layer boundary (an offloaded input fetched back, the embedding's output), the rotary
    cos/sin, or an activation (the layer's working set)."""
    shape, source = event["shape"], event["source"]
    if len(shape) == 2 and rank in shape and tokens not in shape and min(shape) == rank:
        return "adapter-sized"
    if "cpu/ops.py" in source or ("nf4.py" in source and tokens not in shape):
        return "dequantised weight"
    if "offload.py" in source or "aten::embedding" in event["ops"]:
        return "boundary"
    if [d for d in shape if d != 1] == [tokens, head_dim] and event["phase"] in ("loss", "forward"):
        return "rotary cos/sin"
    return "activation"


def alive_after(events: List[dict], index: int) -> List[dict]:
    """The allocations of ``events[: index + 1]`` not freed by then."""
    live: Dict[int, dict] = {}
    for event in events[: index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    return list(live.values())


def shape_text(shape: tuple, tokens: int) -> str:
    return "(" + ",".join("T" if d == tokens else str(d) for d in shape) + ")"


def grouped(alive: List[dict], tokens: int) -> dict:
    """Bytes alive by kind, and by (kind, dtype, shape with T for the tokens, phase that
    allocated it, source line): rows of at least ``SMALL`` bytes, largest first."""
    kinds: Counter = Counter()
    groups: Dict[tuple, list] = defaultdict(lambda: [0, 0])
    for event in alive:
        kind = kind_of(event, tokens)
        kinds[kind] += event["size"]
        key = (kind, event["dtype"], shape_text(event["shape"], tokens), event["phase"], event["source"])
        groups[key][0] += event["size"]
        groups[key][1] += 1
    rows = [
        dict(kind=k[0], dtype=k[1], shape=k[2], allocated_in=k[3], source=k[4], bytes=b, tensors=n)
        for k, (b, n) in groups.items()
    ]
    rows.sort(key=lambda r: (KINDS.index(r["kind"]), -r["bytes"]))
    small = sum(r["bytes"] for r in rows if r["bytes"] < SMALL)
    return dict(kinds={k: kinds[k] for k in KINDS}, rows=[r for r in rows if r["bytes"] >= SMALL], small_bytes=small)


def summarise(events: List[dict], tokens: int) -> dict:
    """The step's peak and each phase's (the largest total one of its allocations reached),
    with what is alive at the step's peak grouped, and step_insight's by-source table. A
    free of a block from before the trace is not among the events (``profiled_events``)."""
    live: Dict[int, int] = {}
    total, totals, peaks = 0, [], {}
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            phase = main_phase(event["phase"])
            if total > peaks.get(phase, (-1,))[0]:
                peaks[phase] = (total, index)
        elif event["addr"] in live:
            total -= live.pop(event["addr"])
        totals.append(total)
    peak = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    at_peak = grouped(alive_after(events, peak), tokens)
    kinds = at_peak["kinds"]
    return dict(
        tokens=tokens,
        peak_bytes=totals[peak] if totals else 0,
        peak_phase=main_phase(events[peak]["phase"]) if events else None,
        activation_bytes=kinds["activation"],
        layer_working_bytes=kinds["activation"] + kinds["dequantised weight"],
        phase_peaks={p: peaks[p][0] for p in MAIN_PHASES if p in peaks},
        kinds_at_phase_peaks={p: grouped(alive_after(events, peaks[p][1]), tokens)["kinds"] for p in peaks},
        at_peak=at_peak,
        by_source=live_at_peak(events)["by_source"][:20],
    )


def fit(tokens: List[int], low: float, high: float) -> dict:
    """Bytes per token between two lengths, and the constant left at the first."""
    slope = (high - low) / (tokens[1] - tokens[0])
    return dict(per_token=round(slope, 2), constant=round(low - slope * tokens[0]))


def slopes(low: dict, high: dict) -> dict:
    """Per token and constant bytes of each phase's peak, of each kind at the step's peak, of
    the working set measured and planned, and of each row alive at the step's peak."""
    tokens = [low["tokens"], high["tokens"]]
    names = ("kind", "dtype", "shape", "allocated_in", "source")

    def rows(summary: dict) -> Counter:
        return Counter({tuple(r[n] for n in names): r["bytes"] for r in summary["at_peak"]["rows"]})

    row_a, row_b = rows(low), rows(high)
    fits = [dict(zip(names, k), **fit(tokens, row_a[k], row_b[k])) for k in set(row_a) | set(row_b)]
    phases = [p for p in MAIN_PHASES if p in low["phase_peaks"] and p in high["phase_peaks"]]
    return dict(
        tokens=tokens,
        phase_peaks={p: fit(tokens, low["phase_peaks"][p], high["phase_peaks"][p]) for p in phases},
        kinds_at_peak={k: fit(tokens, low["at_peak"]["kinds"][k], high["at_peak"]["kinds"][k]) for k in KINDS},
        layer_working_bytes=fit(tokens, low["layer_working_bytes"], high["layer_working_bytes"]),
        planned_bytes=fit(tokens, low["planned_bytes"], high["planned_bytes"]),
        rows_at_peak=sorted(fits, key=lambda r: (-r["per_token"], -r["constant"])),
    )


# --- the run: the toy model, the Trainer step, the profiler's events


def build_model(work: str) -> str:
    """The toy model with random weights (common.build_random), saved once into ``work``."""
    path = os.path.join(work, "model")
    if not os.path.exists(os.path.join(path, "config.json")):
        from common import build_random

        build_random(dict(MODEL)).save_pretrained(path)
    return path


@functools.lru_cache(maxsize=None)
def full_path(name: str) -> str:
    """The file the profiler names relative to an import root (``torch/nn/...``, ``enum.py``),
    found on ``sys.path``: step_insight skips torch's own frames by their absolute paths."""
    found = (os.path.join(root, name) for root in sys.path if root and not name.startswith("/"))
    return next((path for path in found if os.path.isfile(path)), name)


def profiled_events(prof, depth: int = 40) -> List[dict]:
    """The profiler's allocations and frees in time order, in step_insight's format (frames
    innermost first, as dicts), with the ops above each and its tensor's dtype and shape
    (as the first op to take it saw it, at its largest; ``?`` and ``()`` where no op took
    it). A free of a block allocated before the trace is dropped: the bytes are the step's."""
    kinds = torch._C._profiler._EventType
    stack, found = list(prof.profiler.kineto_results.experimental_event_tree()), defaultdict(list)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        found[event.tag].append(event)
    meta: Dict[int, tuple] = {}
    for op in sorted(found[kinds.TorchOp], key=lambda e: e.start_time_ns):
        for value in op.extra_fields.inputs:
            for t in value if isinstance(value, list) else [value]:
                if isinstance(t, torch._C._profiler._TensorMetadata) and t.allocation_id and t.dtype:
                    size = t.dtype.itemsize * torch.Size(t.sizes).numel()
                    if size > meta.get(t.allocation_id, ("", (), -1))[2]:
                        meta[t.allocation_id] = (str(t.dtype).replace("torch.", ""), tuple(t.sizes), size)
    events, live = [], set()
    for event in sorted(found[kinds.Allocation], key=lambda e: (e.start_time_ns, e.id)):
        fields, frames, ops, parent = event.extra_fields, [], [], event.parent
        if fields.alloc_size < 0 and fields.ptr not in live:
            continue
        while parent is not None:
            match = _FRAME.match(parent.name) if parent.tag == kinds.PyCall else None
            path = match and full_path(match.group(1))
            if path and len(frames) < depth and not any(w in path for w in WRAPPERS):
                frames.append(dict(filename=path, line=int(match.group(2)), name=match.group(3)))
            elif parent.tag == kinds.TorchOp:
                ops.append(parent.name)
            parent = parent.parent
        (live.add if fields.alloc_size > 0 else live.discard)(fields.ptr)
        dtype, shape, _ = meta.get(fields.allocation_id, ("?", (), 0))
        action = "alloc" if fields.alloc_size > 0 else "free_completed"
        events.append(make_event(action, fields.ptr, abs(fields.alloc_size), frames, ops, dtype, shape))
    return events


def _peft_sees_autocast_as_on_a_gpu() -> None:
    """PEFT's bitsandbytes LoRA layer asks ``torch.is_autocast_enabled()``, CUDA's state,
    whether to cast its input to the adapters' dtype: on a GPU under ``bf16`` it does not.
    Here the CPU's autocast stands in for CUDA's, so the layer answers as on the GPU (else it
    casts attention's bf16 output to float32 for float32 adapters, which no GPU step does)."""
    from peft.tuners.lora import bnb as peft_bnb

    class TorchSeeingCpuAutocast:
        def is_autocast_enabled(self, *args):
            return torch.is_autocast_enabled(*args) if args else torch.is_autocast_enabled("cpu")

        def __getattr__(self, name):
            return getattr(torch, name)

    peft_bnb.torch = TorchSeeingCpuAutocast()


def trace_step(model_path: str, work: str, setup: str, tokens: int, tile: int, chunk: int) -> List[dict]:
    """Train two steps of the Trainer setup, its arguments parsed as long_trainer_script.py
    parses them; return the second step's events."""
    import transformers
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, HfArgumentParser, Trainer, TrainingArguments

    import layerstream

    flags = f"--output_dir {work}/{setup}-{tokens} --max_steps 2 --per_device_train_batch_size 1 --bf16 --use_cpu"
    flags += " --gradient_checkpointing --report_to none --save_strategy no --logging_steps 1 --learning_rate 1e-4"
    flags += " --dataloader_num_workers 0 --seed 0 --disable_tqdm true --layer_stream --layer_stream_device cpu"
    flags += f" --layer_stream_mlp_tile_tokens {tile} --layer_stream_loss_chunk_tokens {chunk}"
    flags += " --layer_stream_offload_activations true --layer_stream_vram_budget none --layer_stream_slots 3"
    parser = HfArgumentParser((TrainingArguments, layerstream.StreamingArguments))
    arguments, _ = parser.parse_args_into_dataclasses(flags.split())
    nf4 = dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    quantization = BitsAndBytesConfig(load_in_4bit=True, **nf4)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, device_map="cpu", quantization_config=quantization, dtype=torch.bfloat16
    )
    if setup == "prepared":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    torch.manual_seed(0)  # the adapters' initial values, as long_trainer_script.py seeds them
    model = get_peft_model(model, LoraConfig(**LORA))
    if setup == "reference":  # TRL's SFTTrainer on a quantised model: the adapters in bf16
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
    _peft_sees_autocast_as_on_a_gpu()
    print("parameters (dtype, trainable):", dict(Counter((str(p.dtype), p.requires_grad) for p in model.parameters())))
    ids = torch.randint(0, MODEL["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    data = Dataset.from_list([{"input_ids": ids, "labels": ids, "attention_mask": [1] * tokens}] * 2)
    out: List[dict] = []

    class ProfileSecondStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.prof = torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                self.prof.__exit__(None, None, None)
                out.extend(profiled_events(self.prof))

    callbacks = [ProfileSecondStep()]
    data_collator = transformers.default_data_collator
    Trainer(model=model, args=arguments, train_dataset=data, data_collator=data_collator, callbacks=callbacks).train()
    return out


def planner_arguments(setup: str, tile: int) -> dict:
    """``layer_working_bytes``' settings for this step: bf16 compute, NF4 weights, LoRA
    dropout, autocast, the MLP's tile, and the setup's residual stream and adapters."""
    return dict(PLANNER[setup], dequantised=True, mlp_tile_tokens=tile, lora_dropout=True, autocast=True)


def planned(model_path: str, setup: str, tokens: int, tile: int) -> int:
    """The planner's working set of one toy layer (``layer_working_bytes``)."""
    from transformers import AutoConfig

    from layerstream.plan.lora import lora_adapters
    from layerstream.plan.shapes import layer_shapes
    from layerstream.plan.working_set import layer_working_bytes

    config = AutoConfig.from_pretrained(model_path)
    shapes = layer_shapes(config, torch.bfloat16)
    adapted, _ = lora_adapters(config, shapes, LORA["target_modules"], LORA["r"], torch.bfloat16)
    return layer_working_bytes(config, shapes[0], adapted[0], tokens, **planner_arguments(setup, tile))


# --- the report


def mib(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"


def per_token(n: float, constant: Optional[float] = None) -> str:
    h = MODEL["hidden_size"]
    return f"{n:7.0f} B/tok ({n / h:5.2f} h)" + (f" + {mib(constant)}" if constant is not None else "")


def print_summary(s: dict) -> None:
    tokens, at_peak = s["tokens"], s["at_peak"]
    print(f"\n==== {tokens} tokens: step peak {mib(s['peak_bytes'])} in {s['peak_phase']}")
    print(f"activations at the peak {mib(s['activation_bytes'])}")
    print("phase peaks:", ", ".join(f"{p} {v / 2**20:.2f}" for p, v in s["phase_peaks"].items()), "MiB")
    ratio = s["layer_working_bytes"] / s["planned_bytes"] - 1
    print(
        f"layer working set: measured {mib(s['layer_working_bytes'])}, planned {mib(s['planned_bytes'])} ({ratio:+.1%})"
    )
    print("alive at the step's peak:", ", ".join(f"{k} {v / 2**20:.2f}" for k, v in at_peak["kinds"].items()), "MiB")
    print("by kind, dtype, shape (T: tokens), phase that allocated it, source line:")
    for r in at_peak["rows"]:
        grows = per_token(r["bytes"] / tokens) if "T" in r["shape"] else ""
        what = f"{r['kind'][:10]:10s} {r['dtype']:8s} {r['shape']:14s} [{r['allocated_in']}] {r['source']}"
        print(f"  {mib(r['bytes'])} {grows:22s} x{r['tensors']:<2d} {what}")
    print(f"  {mib(at_peak['small_bytes'])} in rows under {SMALL} bytes")


def print_slopes(fits: dict) -> None:
    print(f"\n==== per token between {fits['tokens'][0]} and {fits['tokens'][1]} tokens (h: hidden)")
    named = [(f"{p} phase peak", f) for p, f in fits["phase_peaks"].items()]
    named += [(f"{k} at the peak", f) for k, f in fits["kinds_at_peak"].items()]
    named += [("working set, measured", fits["layer_working_bytes"]), ("working set, planned", fits["planned_bytes"])]
    for name, f in named:
        print(f"  {name:32s} {per_token(f['per_token'], f['constant'])}")
    print("activations at the step's peak, by row:")
    for r in fits["rows_at_peak"]:
        if r["kind"] == "activation" and (abs(r["per_token"]) >= 4 or abs(r["constant"]) >= SMALL):
            print(
                f"  {per_token(r['per_token'], r['constant'])}  {r['dtype']:8s} {r['shape']:14s} "
                f"[{r['allocated_in']}] {r['source']}"
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", choices=("prepared", "reference"), required=True)
    parser.add_argument("--tokens", default="2048,4096", help="comma list of sequence lengths")
    parser.add_argument("--tile", type=int, default=512, help="layer_stream_mlp_tile_tokens")
    parser.add_argument("--chunk", type=int, default=512, help="layer_stream_loss_chunk_tokens")
    parser.add_argument("--work", default="/tmp/cpu-step-trace", help="the model and the Trainer's output")
    parser.add_argument("--out", default=None, help="result folder (else $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.nn.functional.dropout = cuda_like_dropout
    lengths = sorted(int(t) for t in args.tokens.split(","))
    command = " ".join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])
    print(command, "\nplanner:", planner_arguments(args.setup, args.tile), flush=True)
    model_path = build_model(args.work)
    summaries = []
    for tokens in lengths:
        summary = summarise(trace_step(model_path, args.work, args.setup, tokens, args.tile, args.chunk), tokens)
        summary["planned_bytes"] = planned(model_path, args.setup, tokens, args.tile)
        summaries.append(summary)
        print_summary(summary)
    payload = dict(
        command=command,
        setup=args.setup,
        model=MODEL,
        lora=LORA,
        tile=args.tile,
        loss_chunk=args.chunk,
        planner=planner_arguments(args.setup, args.tile),
        lengths=summaries,
    )
    if len(summaries) >= 2:
        payload["slopes"] = slopes(summaries[0], summaries[-1])
        print_slopes(payload["slopes"])
    from moe import commit

    from common import write_result

    write_result(args.setup, dict(payload, commit=commit()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
