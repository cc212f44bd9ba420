"""The disk tier on the GPU machine: the disk's direct-I/O read bandwidth (one and several
readers), then a streamed LoRA step with most layers read from disk (host_budget) against
the same model fed from RAM and against the disk bound (bytes read per step / bandwidth).

The bandwidth is probed on a file just written (``disk_bound_s``) and on the tier's own
files (``files_disk_bound_s``), before and after the disk-fed steps; a cache in front of the
disk can serve the first faster than bytes written minutes before and read in rounds larger
than it. The own-file probe runs again while a Python thread keeps the interpreter busy.

    python benchmarks/disk_tier.py --dir /nvme/x                                   # 8B bf16
    python benchmarks/disk_tier.py --dir /nvme/x --shape llama3-70b --quantization nf4
    python benchmarks/disk_tier.py --dir DIR ... --phase write|probe|ram|disk|probe_after|row
    python benchmarks/disk_tier.py --dry-run [--quantization nf4]                  # tiny, CPU

bf16: the checkpoint is written layer by layer from one random layer's bytes (about 16 GB
for the 8B shape) and the disk tier reads those files. NF4: the disk tier reads the NF4
layer cache, so the checkpoint's layer files are never read when the cache is complete.
The write phase quantises ONE random layer (on the GPU when there is one), writes its
packed bytes as every layer with the cache's own writer, under the fingerprint of a
synthetic checkpoint: the real config, real random non-layer tensors, and sparse layer
files (a valid safetensors header, the right size, no data blocks: zeros). For the 70B
shape that is about 40 GB of cache and 4 GB of checkpoint on disk instead of 140 GB. The
disk-fed load is refused before it starts when the cache does not match what the loader
would compute, and any quantisation during it is an error (the cache was not used). The
RAM-fed NF4 reference is the same packed layer in every layer (build_random_nf4), streamed
from host RAM.

Each phase fits one 10-minute command and keeps its result in DIR/<case>/phases.json; a
phase already done is skipped, so a run that was cut off resumes. The row goes to
benchmarks/results/disk-tier.json ($OUT when set), merged by (model, quantization).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
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
PHASES = ("write", "probe", "ram", "disk", "probe_after", "row")
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
CACHE = "nf4-cache"


def _meta_model(shape: dict, dtype, layers=None):
    from transformers import AutoModelForCausalLM

    from common import shape_config

    config = shape_config(shape, layers)
    config.dtype = str(dtype).replace("torch.", "")
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config, dtype=dtype)


def _layer_names(model) -> dict:
    """layer index -> {tensor name: (shape, dtype)} of a (meta) model's decoder layers."""
    by_layer: dict = {}
    for name, tensor in model.state_dict().items():
        if ".layers." in name:
            index = int(name.split(".layers.")[1].split(".")[0])
            by_layer.setdefault(index, {})[name] = (tuple(tensor.shape), tensor.dtype)
    return by_layer


def require_free(directory: Path, needed: int, what: str) -> None:
    """Stop before writing when the disk cannot take ``needed`` more bytes (a full disk
    half way through costs minutes of the GPU machine's time, and the earlier case's files
    may still be there)."""
    import shutil

    free = shutil.disk_usage(directory).free
    if needed > free:
        raise SystemExit(
            f"{directory}: {what} needs {needed / 1e9:.1f} GB more and the disk has {free / 1e9:.1f} GB free. "
            "Remove an earlier case's directory there (each case keeps its own) or pass another --dir."
        )


def write_checkpoint(directory: Path, shape: dict, dtype=torch.bfloat16) -> None:
    """A random-weight safetensors checkpoint, one shard per layer, written layer by layer."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config, model = _meta_model(shape, dtype)
    state = model.state_dict()
    names = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    require_free(directory, sum(t.numel() * t.element_size() for t in state.values()), "the checkpoint")
    config.save_pretrained(directory)
    weight_map, one_layer = {}, {}
    resident = {n: v for n, v in names.items() if ".layers." not in n}
    save_file(
        {n: torch.randn(s, dtype=torch.float32).mul_(0.02).to(d) for n, (s, d) in resident.items()},
        str(directory / "resident.safetensors"),
    )
    weight_map.update({n: "resident.safetensors" for n in resident})
    for index, tensors in sorted(_layer_names(model).items()):
        prefix = f"model.layers.{index}."
        values = {}
        for name, (size, kind) in tensors.items():
            short = name[len(prefix) :]
            if short not in one_layer:
                one_layer[short] = torch.randn(size, dtype=torch.float32).mul_(0.02).to(kind)
            values[name] = one_layer[short]
        file = f"layer-{index:05d}.safetensors"
        save_file(values, str(directory / file))
        weight_map.update({n: file for n in values})
        print(f"wrote {file}", flush=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_sparse_safetensors(path: Path, tensors: dict) -> None:
    """A valid safetensors file of zeros that takes no data blocks: the header, then a hole
    up to the size the header implies."""
    header, offset = {}, 0
    for name, (size, kind) in tensors.items():
        nbytes = torch.Size(size).numel() * kind.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[kind],
            "shape": list(size),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        handle.truncate(8 + len(text) + offset)


def _quant_config(dtype):
    """What from_pretrained(quantization="nf4") builds (double quantisation, NF4)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )


def quant_device() -> torch.device:
    """Where build_random_nf4 quantises, and so where the loader is told the cache was made."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def expected_source(directory: Path, dtype) -> dict:
    """The fingerprint the loader computes for this checkpoint and from_pretrained's settings."""
    from layerstream.checkpoints.stored import read_index
    from layerstream.tiers import nf4_cache

    files = read_index(directory / "model.safetensors.index.json")
    settings = nf4_cache.quant_settings(_quant_config(dtype), dtype, quant_device())
    return nf4_cache.fingerprint(list(files.values()), settings)


def _manifest_path(directory: Path, dtype=torch.bfloat16) -> Path:
    """The manifest the loader looks for: named by the fingerprint of the checkpoint and settings."""
    from layerstream.tiers import nf4_cache

    return directory / CACHE / nf4_cache.manifest_name(expected_source(directory, dtype))


def write_nf4_cache(directory: Path, shape: dict, dtype=torch.bfloat16) -> None:
    """The synthetic NF4 case: real non-layer tensors, sparse layer files, and a complete
    NF4 layer cache whose every layer is the packed bytes of one quantised random layer."""
    from safetensors.torch import save_file

    from layerstream.modules.discovery import find_decoder_layers, layer_name
    from layerstream.tiers import nf4_cache
    from layerstream.tiers.store import HostStore

    from common import build_random_nf4

    directory.mkdir(parents=True, exist_ok=True)
    config, meta = _meta_model(shape, dtype)
    index_path = directory / "model.safetensors.index.json"
    one = build_random_nf4(shape, layers=1, dtype=dtype)  # layer 0 as the full model's (same fill order)
    if not index_path.exists():  # the checkpoint, finished by its index (its mtimes are then fixed)
        resident = {n: t for n, t in one.state_dict().items() if ".layers." not in n}
        save_file({n: t.contiguous() for n, t in resident.items()}, str(directory / "resident.safetensors"))
        weight_map = {n: "resident.safetensors" for n in resident}
        for index, tensors in sorted(_layer_names(meta).items()):
            file = f"layer-{index:05d}.safetensors"
            write_sparse_safetensors(directory / file, tensors)
            weight_map.update({n: file for n in tensors})
        config.save_pretrained(directory)
        index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cache = nf4_cache.LayerCache([directory / CACHE], expected_source(directory, dtype))
    path, stack = find_decoder_layers(one)
    record = HostStore.plan_layer(0, layer_name(path, 0), stack[0], lambda t: True)
    data, layout = nf4_cache.region_bytes(record), nf4_cache.describe(stack[0], record)
    missing = [i for i in range(config.num_hidden_layers) if str(i) not in cache.layers]
    require_free(directory, len(missing) * data.numel(), f"the NF4 cache ({len(missing)} layers)")
    for index in range(config.num_hidden_layers):
        if str(index) not in cache.layers:
            cache.write(index, data, layout)
            print(f"cached layer {index} ({data.numel() / 2**20:.1f} MiB)", flush=True)


def train_step_times(model, device: str, seq: int, steps: int) -> tuple:
    """Median training-step time, LoRA r16 all-linear, batch 1 (the first step dropped), and
    the first step's loss (LoRA B starts at zero: it depends on the frozen weights only)."""
    from peft import LoraConfig, get_peft_model

    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"  step {step}: {times[-1]:.3f} s", flush=True)
    kept = sorted(times[1:] or times)
    return kept[len(kept) // 2], losses[0]


def load(directory: Path, quantization: str, host_budget, device: str, dtype=torch.bfloat16):
    """The streamed model as a user loads it; NF4 from the cache only (quantising is an error)."""
    import layerstream
    from layerstream.modules import nf4

    config = layerstream.StreamConfig(
        device=device, host_budget=host_budget, vram_budget=None, disk_cache_dir=str(directory / CACHE)
    )
    if quantization == "none":
        return layerstream.from_pretrained(directory, stream=config, dtype="auto")
    if not _manifest_path(directory, dtype).exists():  # its name is a hash of what it was made from
        raise SystemExit(
            f"the NF4 cache in {directory / CACHE} does not match its checkpoint (files, settings or versions "
            "changed): delete the directory and run --phase write again"
        )
    real = nf4.quantise_layer

    def refuse(*args):
        raise RuntimeError("the loader quantised a layer: the NF4 cache was not used (see its warnings)")

    nf4.quantise_layer = refuse
    try:
        return layerstream.from_pretrained(
            directory, quantization="nf4", stream=config, dtype=dtype, quantize_on=quant_device()
        )
    finally:
        nf4.quantise_layer = real


def ram_fed(directory: Path, args, shape: dict, device: str) -> dict:
    import layerstream

    if args.quantization == "none":
        model = load(directory, "none", None, device)
    else:
        from common import build_random_nf4

        model = build_random_nf4(shape, dtype=torch.bfloat16)
        layerstream.stream_model(model, device=device, vram_budget=None)
    step, loss = train_step_times(model, device, args.seq, args.steps)
    return {"ram_step_s": step, "first_loss": loss}


def disk_fed(directory: Path, args, budget: int, device: str) -> dict:
    import layerstream

    model = load(directory, args.quantization, budget, device)
    step, loss = train_step_times(model, device, args.seq, args.steps)
    runtime = layerstream.get_runtime(model)
    stats, tier = runtime.stats(), runtime.disk
    return {
        "step_s": step,
        "first_loss": loss,
        "read_bytes_per_step": stats["disk_read_bytes"] / max(args.steps, 1),
        "disk_layers": stats["disk_layers"],
        "disk_read_gbps": stats["disk_read_gbps"],
        "disk_stall_s_per_step": stats["disk_stall_seconds"] / args.steps,
        "direct_io": stats["direct_io"],
        "disk_reads_at_once": stats["disk_reads_at_once"],
        "disk_reads_at_once_changes": stats["disk_reads_at_once_changes"],
        "disk_gbps_probed_at_load": {str(n): rate / 1e9 for n, rate in tier.probed.items()},
        "disk_gbps_measured_in_run": {str(n): rate / 1e9 for n, rate in tier.choice.rates.items()},
    }


def dry_budget(directory: Path, quantization: str) -> int:
    """Five layers' worth (the ring and some RAM layers; the rest on disk) for the tiny model."""
    if quantization == "nf4":
        manifest = next((directory / CACHE).glob("manifest.*.json"))  # any: a stale one is refused at load
        return 5 * json.loads(manifest.read_text())["layers"]["0"]["nbytes"]
    return 5 * (directory / "layer-00000.safetensors").stat().st_size


def merge_row(name: str, row: dict, payload: dict) -> None:
    """Replace this (model, quantization)'s row in the result file, keep the others."""
    from common import write_result

    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / f"{name}.json"
    rows = json.loads(out.read_text()).get("rows", []) if out.exists() else []
    rows = [r for r in rows if (r.get("model"), r.get("quantization")) != (row["model"], row["quantization"])]
    write_result(name, dict(payload, rows=rows + [row]))


def arguments(argv=None):
    from common import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where the checkpoint (and NF4 cache) is written: a fast local disk")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--quantization", choices=["none", "nf4"], default="none")
    parser.add_argument("--host-budget", default=None, help="default 4GiB (bf16), 8GiB (nf4)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--measure-bytes", default="4GiB", help="size of the bandwidth probe file")
    parser.add_argument("--phase", choices=("all",) + PHASES, default="all")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the harness only")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.seq, args.steps = 32, 2
    return args


@contextlib.contextmanager
def _interpreter_busy():
    """A thread that runs Python bytecode until the block ends."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def main(argv=None) -> int:
    from layerstream.commands.disk import measure_files_gbps, measure_read_gbps, stored_layer_files
    from layerstream.tiers.disk import READERS
    from layerstream.units import GiB, parse_bytes

    from common import SHAPES

    args = arguments(argv)
    device = "cpu" if args.dry_run else "cuda"
    shape = TINY if args.dry_run else SHAPES[args.shape]
    model_name = "tiny" if args.dry_run else args.shape
    directory = Path(args.dir or tempfile.mkdtemp(prefix="disk-tier-")) / f"{model_name}-{args.quantization}"
    state_path = directory / "phases.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    wanted = PHASES if args.phase == "all" else (args.phase,)

    def done(phase: str, result: dict) -> None:
        state[phase] = result
        state_path.write_text(json.dumps(state, indent=1))

    if "write" in wanted:  # each writer resumes where it stopped
        if args.quantization == "nf4":
            write_nf4_cache(directory, shape)
        elif not (directory / "model.safetensors.index.json").exists():
            write_checkpoint(directory, shape)
        done("write", {})
    if "write" not in state:
        raise SystemExit(f"{directory} is not written yet: run --phase write first")

    def measure_disk(phase: str) -> None:
        probe = parse_bytes("32MiB" if args.dry_run else args.measure_bytes)
        bandwidth = {str(n): measure_read_gbps(directory, probe, n)[0] for n in (1, READERS)}
        print(f"disk: {bandwidth['1']:.2f} GB/s with 1 reader, {bandwidth[str(READERS)]:.2f} with {READERS}")
        # the tier's own files, written minutes before, each read on other layers than any
        # probe before it: what the disk gives for the bytes the tier reads; then the same
        # while a Python thread keeps the interpreter busy, as a training step's thread does
        # (a reader needs the interpreter lock between its reads)
        files = stored_layer_files(directory)
        first = 0 if phase == "probe" else 4
        own, busy = {}, {}
        for k, n in enumerate((1, READERS)):
            own[str(n)] = measure_files_gbps(files[first + k :: 8] or files, probe, n)[0]
            with _interpreter_busy():
                busy[str(n)] = measure_files_gbps(files[first + 2 + k :: 8] or files, probe, n)[0]
        print(f"the tier's files: {own['1']:.2f} GB/s with 1 reader, {own[str(READERS)]:.2f} with {READERS}")
        print(f"  with the interpreter busy: {busy['1']:.2f} and {busy[str(READERS)]:.2f}")
        done(
            phase,
            {"disk_gbps_by_readers": bandwidth, "files_gbps_by_readers": own, "files_busy_gbps_by_readers": busy},
        )

    if "probe" in wanted and "probe" not in state:
        measure_disk("probe")
    default_budget = "8GiB" if args.quantization == "nf4" else "4GiB"
    budget = (
        dry_budget(directory, args.quantization) if args.dry_run else parse_bytes(args.host_budget or default_budget)
    )
    if "ram" in wanted and "ram" not in state:
        print("RAM-fed", flush=True)
        done("ram", ram_fed(directory, args, shape, device))
    if "disk" in wanted and "disk" not in state:
        print(f"disk-fed, host_budget {budget / GiB:.3f} GiB", flush=True)
        done("disk", dict(disk_fed(directory, args, budget, device), host_budget=budget))
    if "probe_after" in wanted and "probe_after" not in state:  # the disk drifts: measure it on both sides
        measure_disk("probe_after")
    if "row" not in wanted:
        return 0
    missing = [p for p in ("probe", "ram", "disk") if p not in state]
    if missing:
        raise SystemExit(f"phases not run yet: {', '.join(missing)} (run them with --phase)")

    def both_sides(key: str) -> list:  # the probes' rates by reader count, before and after
        return [state[p][key] for p in ("probe", "probe_after") if key in state.get(p, {})]

    def best_mean(probes: list) -> float:  # the reader count whose mean over the probes is best
        return max(sum(p[n] for p in probes) / len(probes) for n in probes[0])

    # the bound is what the disk gives at its best (one reader beats four on some disks), as
    # the mean of the probes before and after the disk-fed steps where both ran; the strict
    # bound takes the fastest single probe
    probes, own = both_sides("disk_gbps_by_readers"), both_sides("files_gbps_by_readers")
    disk_gbps = best_mean(probes)
    strict_gbps = max(rate for p in probes for rate in p.values())
    files_gbps = best_mean(own) if own else None
    measured = dict(state["disk"])
    row = {
        "model": model_name,
        "quantization": args.quantization,
        "host_budget_gib": measured.pop("host_budget") / GiB,
        "disk_gbps": disk_gbps,
        "step_s": measured.pop("step_s"),
        "ram_step_s": state["ram"]["ram_step_s"],
        "disk_bound_s": measured["read_bytes_per_step"] / (disk_gbps * 1e9),
        "strict_disk_bound_s": measured["read_bytes_per_step"] / (strict_gbps * 1e9),
        # the same bound from reads of the tier's own files (a file just written may be served
        # by a cache in front of the disk that the tier's bytes, read round after round, miss)
        "files_gbps": files_gbps,
        "files_disk_bound_s": measured["read_bytes_per_step"] / (files_gbps * 1e9) if files_gbps else None,
        "files_gbps_by_readers": own,
        "files_busy_gbps_by_readers": both_sides("files_busy_gbps_by_readers"),
        "first_loss_equals_ram_fed": measured.pop("first_loss") == state["ram"]["first_loss"],
        "disk_gbps_by_readers": probes,
        **measured,
    }
    if args.quantization == "nf4":
        row["cache"] = "one quantised random layer's packed bytes as every layer; sparse checkpoint layer files"
    payload = {"seq": args.seq, "steps": args.steps}
    merge_row("disk-tier-dry-run" if args.dry_run else "disk-tier", row, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
