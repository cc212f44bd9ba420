"""The disk tier on the GPU machine: the disk's direct-I/O read bandwidth (one and several
readers), then a streamed LoRA step with most layers read from disk (host_budget) against
the same run fed from RAM and against the disk bound (bytes read per step / bandwidth).

    python benchmarks/disk_tier.py --dir /path/on/nvme            # write + measure (8B bf16)
    python benchmarks/disk_tier.py --dir DIR --phase write         # only write the checkpoint
    python benchmarks/disk_tier.py --dir DIR --phase run           # reuse it
    python benchmarks/disk_tier.py --dry-run                       # tiny shapes on the CPU

The checkpoint is written layer by layer from one random layer's bytes (about 16 GB for the
8B shape): the disk reads real bytes, the values do not matter for speed. Rows go to
benchmarks/results/disk-tier.json. The 70B NF4 row needs a cache of packed NF4 layers,
which the disk tier does not have yet: it is reported as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

TINY = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def write_checkpoint(directory: Path, shape: dict, dtype=torch.bfloat16) -> None:
    """A random-weight safetensors checkpoint, one shard per layer, written layer by layer."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    values = dict(shape)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.dtype = str(dtype).replace("torch.", "")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    config.save_pretrained(directory)
    weight_map, one_layer = {}, {}
    layers = config.num_hidden_layers
    resident = {n: v for n, v in names.items() if ".layers." not in n}
    save_file(
        {n: torch.randn(s, dtype=torch.float32).mul_(0.02).to(d) for n, (s, d) in resident.items()},
        str(directory / "resident.safetensors"),
    )
    weight_map.update({n: "resident.safetensors" for n in resident})
    for index in range(layers):
        prefix = f"model.layers.{index}."
        tensors = {}
        for name, (size, kind) in names.items():
            if name.startswith(prefix):
                short = name[len(prefix) :]
                if short not in one_layer:
                    one_layer[short] = torch.randn(size, dtype=torch.float32).mul_(0.02).to(kind)
                tensors[name] = one_layer[short]
        file = f"layer-{index:05d}.safetensors"
        save_file(tensors, str(directory / file))
        weight_map.update({n: file for n in tensors})
        print(f"wrote {file}", flush=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def step_time(directory: Path, host_budget, device: str, seq: int, steps: int) -> tuple:
    """Median training-step time and the run's stats, LoRA r16 all-linear, batch 1."""
    from peft import LoraConfig, get_peft_model

    import layerstream

    config = layerstream.StreamConfig(device=device, host_budget=host_budget, vram_budget=None)
    model = layerstream.from_pretrained(directory, stream=config, dtype="auto")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size, (1, seq), device=device)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"  step {step}: {times[-1]:.3f} s", flush=True)
    runtime = layerstream.get_runtime(model)
    stats = runtime.stats()
    per_step = stats["disk_read_bytes"] / max(steps, 1)
    kept = sorted(times[1:] or times)
    return kept[len(kept) // 2], stats, per_step


def main(argv=None) -> int:
    from layerstream.disk import READERS
    from layerstream.disk_cli import measure_read_gbps
    from layerstream.units import GiB, MiB, parse_bytes

    from common import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where the checkpoint is written (a fast local disk)")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--host-budget", default="4GiB")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--measure-bytes", default="4GiB", help="size of the bandwidth probe file")
    parser.add_argument("--phase", choices=["all", "write", "run"], default="all")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    shape = TINY if args.dry_run else SHAPES[args.shape]
    directory = Path(args.dir or tempfile.mkdtemp(prefix="disk-tier-")) / (
        "tiny" if args.dry_run else f"{args.shape}-bf16"
    )
    if args.phase in ("all", "write") and not (directory / "model.safetensors.index.json").exists():
        write_checkpoint(directory, shape)
    if args.phase == "write":
        return 0
    probe = parse_bytes("32MiB" if args.dry_run else args.measure_bytes)
    bandwidth = {readers: measure_read_gbps(directory, probe, readers)[0] for readers in (1, READERS)}
    print(f"disk: {bandwidth[1]:.2f} GB/s with 1 reader, {bandwidth[READERS]:.2f} GB/s with {READERS}", flush=True)
    budget = parse_bytes("160KiB" if args.dry_run else args.host_budget)
    seq = 32 if args.dry_run else args.seq
    steps = 2 if args.dry_run else args.steps
    print("RAM-fed", flush=True)
    ram_step, _, _ = step_time(directory, None, device, seq, steps)
    print(f"disk-fed, host_budget {budget / MiB:.1f} MiB", flush=True)
    disk_step, stats, read_per_step = step_time(directory, budget, device, seq, steps)
    disk_gbps = bandwidth[READERS]
    rows = [
        {
            "model": "tiny" if args.dry_run else args.shape,
            "quantization": "none",
            "host_budget_gib": budget / GiB,
            "disk_gbps": disk_gbps,
            "step_s": disk_step,
            "ram_step_s": ram_step,
            "disk_bound_s": read_per_step / (disk_gbps * 1e9),
            "disk_layers": stats["disk_layers"],
            "disk_read_gbps": stats["disk_read_gbps"],
            "disk_stall_s_per_step": stats["disk_stall_seconds"] / steps,
            "direct_io": stats["direct_io"],
        },
        {"model": "llama3-70b", "quantization": "nf4", "not_run": "the NF4 layer cache is not built yet"},
    ]
    payload = {"rows": rows, "disk_gbps_by_readers": bandwidth, "seq": seq, "steps": steps}
    if args.dry_run:
        print(json.dumps(payload, indent=2))
        return 0
    from common import write_result

    write_result("disk-tier", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
