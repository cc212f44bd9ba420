"""Host time per streamed layer visit, on CUDA, with compute too small to hide it.

A 64-layer Llama-shaped model with hidden size 64 at 16 tokens: the GPU finishes each
layer in microseconds, so a step's wall time is host time. The streamed step minus the
resident step, divided by the number of layer visits, is what streaming adds per visit.
Training compares against resident training with the same non-reentrant checkpointing
(the streamed layers checkpoint themselves), so checkpointing's own cost is not charged
to streaming; the no-checkpointing figure is reported beside it.

    python benchmarks/overhead.py            # writes $OUT/overhead.json or benchmarks/results/
"""

from __future__ import annotations

import argparse
import copy

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import layerstream
from common import cuda_timer, median, write_result


def tiny_deep_model(layers: int):
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))


def time_steps(model, ids, train: bool, iters: int, warmup: int) -> float:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4) if train else None
    times = []
    for i in range(warmup + iters):
        start = cuda_timer()
        if train:
            model.train()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
        elapsed = cuda_timer() - start
        if i >= warmup:
            times.append(elapsed)
    return median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    ids = torch.randint(0, 256, (1, args.seq), device="cuda")
    base = tiny_deep_model(args.layers)
    resident = copy.deepcopy(base).cuda()
    results = {"layers": args.layers, "seq": args.seq, "iters": args.iters}
    results["resident_infer_s"] = time_steps(resident, ids, False, args.iters, args.warmup)
    results["resident_train_s"] = time_steps(resident, ids, True, args.iters, args.warmup)
    resident.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    results["resident_train_ckpt_s"] = time_steps(resident, ids, True, args.iters, args.warmup)
    del resident
    rows = []
    for slots, prefetch in [(2, 1), (3, 1), (4, 2)]:
        model = copy.deepcopy(base)
        layerstream.stream_model(model, slots=slots, prefetch=prefetch)
        model.cuda()
        infer = time_steps(model, ids, False, args.iters, args.warmup)
        train = time_steps(model, ids, True, args.iters, args.warmup)
        stats = layerstream.get_runtime(model).stats()
        row = {
            "slots": slots, "prefetch": prefetch,
            "streamed_infer_s": infer, "streamed_train_s": train,
            "infer_overhead_us_per_visit": (infer - results["resident_infer_s"]) / args.layers * 1e6,
            # a training step visits each layer twice (forward, then recompute in backward)
            "train_overhead_us_per_visit": (train - results["resident_train_ckpt_s"]) / (2 * args.layers) * 1e6,
            "train_overhead_vs_no_ckpt_us_per_visit": (train - results["resident_train_s"]) / (2 * args.layers) * 1e6,
            "pinned": stats["pinned"],
        }
        rows.append(row)
        print(row, flush=True)
        layerstream.unstream_model(model, device="cpu")
        del model
        torch.cuda.empty_cache()
    results["rows"] = rows
    print(f"| slots | prefetch | inference us/visit | training us/visit (vs ckpt) | training us/visit (vs no ckpt) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['slots']} | {r['prefetch']} | {r['infer_overhead_us_per_visit']:.1f} | "
              f"{r['train_overhead_us_per_visit']:.1f} | {r['train_overhead_vs_no_ckpt_us_per_visit']:.1f} |")
    write_result("overhead", results)


if __name__ == "__main__":
    main()
