"""Host time that streaming adds per layer visit, on CUDA, with compute too small to hide it.

A deep Llama-shaped model with hidden size 64 at 16 tokens: the GPU finishes each layer
in microseconds, so a step's wall time is host time. Two figures per configuration:

- engine time: host time spent inside layerstream per visit (planning, issuing copies,
  event waits, binding and unbinding slot tensors), measured by timing the streamed
  call around the layer's own forward.
- A/B difference: streamed step minus resident step, run alternately in the same loop
  (so drift cancels), divided by layer visits. Training compares against resident
  training with the same non-reentrant checkpointing (streamed layers checkpoint
  themselves); the difference to resident training without checkpointing is reported too.

    python benchmarks/overhead.py            # writes $OUT/overhead.json or benchmarks/results/
    python benchmarks/overhead.py --change-check-ab   # the cost of the per-visit change check

``--change-check-ab`` measures what checking each visit for changed weights costs
(``LayerRecord.fresh``, which makes writes to streamed weights visible), in one process:
steps alternate between the check as shipped and the check replaced by a constant, so host
drift cancels; the difference per visit is the check's cost.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import layerstream
from layerstream.modules import layer as layer_mod

from common import cuda_timer, median, parse_streamed_config, write_result


def tiny_deep_model(layers: int):
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))


class Stepper:
    def __init__(self, model, ids, train: bool):
        self.model, self.ids, self.train = model, ids, train
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-4) if train else None
        model.train(train)

    def __call__(self) -> float:
        start = cuda_timer()
        if self.train:
            self.model(input_ids=self.ids, labels=self.ids).loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                self.model(input_ids=self.ids)
        return cuda_timer() - start


class EngineClock:
    """Accumulates host time inside StreamRuntime.run_layer that is not the layer's own call."""

    def __init__(self, runtime):
        self.total = 0.0
        self.inner = 0.0
        self.visits = 0
        # run_layer; versions before it was public (the A/B baseline) call it _run
        self.name = "run_layer" if hasattr(runtime, "run_layer") else "_run"
        run, call = getattr(runtime, self.name), layer_mod.call_unstreamed

        def timed_call(layer, args, kwargs):
            start = time.perf_counter()
            try:
                return call(layer, args, kwargs)
            finally:
                self.inner += time.perf_counter() - start

        def timed_run(*a, **k):
            start = time.perf_counter()
            try:
                return run(*a, **k)
            finally:
                self.total += time.perf_counter() - start
                self.visits += 1

        layer_mod.call_unstreamed = timed_call
        setattr(runtime, self.name, timed_run)

    def reset(self):
        self.total = self.inner = 0.0
        self.visits = 0

    def per_visit_us(self) -> float:
        return (self.total - self.inner) / max(self.visits, 1) * 1e6


def ab(resident_step, streamed_step, iters, warmup):
    diffs, res_times = [], []
    for i in range(warmup + iters):
        if i % 2:
            a = resident_step()
            b = streamed_step()
        else:
            b = streamed_step()
            a = resident_step()
        if i >= warmup:
            diffs.append(b - a)
            res_times.append(a)
    return median(diffs), median(res_times)


def change_check_ab(base, ids, iters: int, warmup: int, layers: int) -> dict:
    """Training and inference steps, alternately with the per-visit change check as shipped
    and replaced by a constant (median difference per visit), plus the check's own time."""
    from layerstream.tiers.store import LayerRecord

    model = copy.deepcopy(base)
    layerstream.stream_model(model, slots=3, prefetch=2, vram_budget=None)
    model.cuda()
    runtime = layerstream.get_runtime(model)
    shipped = LayerRecord.fresh
    row = {"slots": 3, "prefetch": 2}

    def with_check(checked: bool, step):
        def run():
            LayerRecord.fresh = shipped if checked else (lambda self: True)
            try:
                return step()
            finally:
                LayerRecord.fresh = shipped

        return run

    for train in (False, True):
        step = Stepper(model, ids, train)
        diff, plain = ab(with_check(False, step), with_check(True, step), iters, warmup)
        visits = layers * (2 if train else 1)
        key = "train" if train else "infer"
        row[f"{key}_check_us_per_visit"] = diff / visits * 1e6
        row[f"{key}_step_without_check_us_per_visit"] = plain / visits * 1e6
    record = runtime.records[len(runtime.records) // 2]
    start = time.perf_counter()
    for _ in range(100000):
        record.fresh()
    row["fresh_call_us"] = (time.perf_counter() - start) / 100000 * 1e6
    row["tensors_checked_per_visit"] = len(record.watch)
    layerstream.unstream_model(model, device="cpu")
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--configs",
        default="2:1,3:1,4:2",
        help="slots:prefetch[:backward_slots] list (backward slots default to auto, "
        "which takes none at this shape: its loss is tiny)",
    )
    parser.add_argument("--change-check-ab", action="store_true", help="only the per-visit change check's cost")
    args = parser.parse_args()
    ids = torch.randint(0, 256, (1, args.seq), device="cuda")
    base = tiny_deep_model(args.layers)
    if args.change_check_ab:
        gc.disable()
        row = change_check_ab(base, ids, args.iters, args.warmup, args.layers)
        gc.enable()
        print(row, flush=True)
        write_result("overhead-change-check", {"layers": args.layers, "seq": args.seq, "iters": args.iters, **row})
        return
    plain = copy.deepcopy(base).cuda()
    checkpointed = copy.deepcopy(base).cuda()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results = {"layers": args.layers, "seq": args.seq, "iters": args.iters, "rows": []}
    gc.disable()
    original_call = layer_mod.call_unstreamed
    for spec in args.configs.split(","):
        slots, prefetch, backward = parse_streamed_config(spec)
        model = copy.deepcopy(base)
        layerstream.stream_model(model, slots=slots, prefetch=prefetch, backward_slots=backward, vram_budget=None)
        model.cuda()
        runtime = layerstream.get_runtime(model)
        row = {"slots": slots, "prefetch": prefetch, "backward_slots_asked": backward}
        diff, res = ab(Stepper(plain, ids, False), Stepper(model, ids, False), args.iters, args.warmup)
        row["infer_ab_us_per_visit"] = diff / args.layers * 1e6
        row["resident_infer_us_per_layer"] = res / args.layers * 1e6
        diff, res = ab(Stepper(checkpointed, ids, True), Stepper(model, ids, True), args.iters, args.warmup)
        row["train_ab_us_per_visit"] = diff / (2 * args.layers) * 1e6
        row["resident_ckpt_train_us_per_visit"] = res / (2 * args.layers) * 1e6
        diff, _ = ab(Stepper(plain, ids, True), Stepper(model, ids, True), args.iters, args.warmup)
        row["train_ab_vs_no_ckpt_us_per_visit"] = diff / (2 * args.layers) * 1e6
        clock = EngineClock(runtime)
        for train in (False, True):
            step = Stepper(model, ids, train)
            for _ in range(args.warmup):
                step()
            per_step = []  # the median over steps keeps one slow step (a busy host) out
            for _ in range(args.iters):
                clock.reset()
                step()
                per_step.append(clock.per_visit_us())
            row["engine_train_us_per_visit" if train else "engine_infer_us_per_visit"] = median(per_step)
        layer_mod.call_unstreamed = original_call
        row["pinned"] = runtime.stats()["pinned"]
        row["backward_slots"] = runtime.stats()["backward_slots"]
        results["rows"].append(row)
        print(row, flush=True)
        delattr(runtime, clock.name)
        layerstream.unstream_model(model, device="cpu")
        del model
        torch.cuda.empty_cache()
    gc.enable()
    print(
        "| slots:prefetch | engine us/visit (infer) | engine us/visit (train) | A/B us/visit infer | "
        "A/B us/visit train (vs ckpt) | A/B train (vs no ckpt) | resident us/layer infer |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(
            f"| {r['slots']}:{r['prefetch']}+{r['backward_slots']} | {r['engine_infer_us_per_visit']:.1f} | "
            f"{r['engine_train_us_per_visit']:.1f} | {r['infer_ab_us_per_visit']:.1f} | "
            f"{r['train_ab_us_per_visit']:.1f} | {r['train_ab_vs_no_ckpt_us_per_visit']:.1f} | "
            f"{r['resident_infer_us_per_layer']:.0f} |"
        )
    write_result("overhead", results)


if __name__ == "__main__":
    main()
