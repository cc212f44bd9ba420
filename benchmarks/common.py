"""Shared helpers for the GPU benchmarks: real-shape random-weight models, timing."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPE_FILES = Path(__file__).resolve().parents[1] / "configs" / "shapes"


def shipped_shape(name: str) -> dict:
    """A real model's config values as configs/shapes ships them (what `layerstream plan
    --model configs/shapes/<name>.json` plans)."""
    return json.loads((SHAPE_FILES / f"{name}.json").read_text())


# the benchmarks' names for the shapes (their results' file names carry them)
SHAPES = {
    # Llama-3-8B's layers, embeddings and head (Llama-3.1-8B differs in its context only):
    # 32 layers, 4096 hidden, 14336 MLP, GQA 32/8
    "llama3-8b": shipped_shape("llama-3.1-8b"),
    # Llama-3-70B's likewise: 80 layers, 8192 hidden, 28672 MLP, GQA 64/8
    "llama3-70b": shipped_shape("llama-3.1-70b"),
    # Mistral-7B-v0.3: Llama-3-8B's layer shape with a 32768-token vocabulary, so the loss
    # is small and a layer's recompute + backward, not the loss, sets the training peak
    "mistral-7b": shipped_shape("mistral-7b-v0.3"),
    # Qwen2.5-32B: 64 layers, 5120 hidden, 27648 MLP, GQA 40/8, q/k/v bias
    "qwen2.5-32b": shipped_shape("qwen2.5-32b"),
    # Qwen3-30B-A3B: 48 MoE layers, 128 experts of width 768, 8 routed per token
    "qwen3-30b-a3b": shipped_shape("qwen3-30b-a3b"),
    # gpt-oss-20b: 24 layers of 32 experts of width 2880, 4 routed per token, attention
    # alternating between a 128-token sliding window and full
    "gpt-oss-20b": shipped_shape("gpt-oss-20b"),
    # gpt-oss-120b: the same layer with 128 experts, 36 layers
    "gpt-oss-120b": shipped_shape("gpt-oss-120b"),
}


def _shape_values(shape) -> dict:
    """A SHAPES key, or a transformers config.json's values (configs/shapes/*.json)."""
    return dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)


def shape_config(shape, layers: int | None = None, **overrides):
    """The transformers config of a shape (a SHAPES key or config values), with
    ``layers`` decoder layers where given."""
    values = _shape_values(shape)
    model_type = values.pop("model_type")
    if layers is not None:
        values["num_hidden_layers"] = layers
        if "layer_types" in values:  # one attention type per layer (gpt-oss): the first ``layers``
            values["layer_types"] = values["layer_types"][:layers]
    values.update(overrides)
    return AutoConfig.for_model(model_type, **values)


def build_random(shape, dtype=torch.bfloat16, layers: int | None = None, attn: str = "sdpa", **overrides):
    """A model of a real shape with random weights, built on meta then filled on CPU."""
    config = shape_config(shape, layers, **overrides)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.to_empty(device="cpu")
    # random values drawn on the GPU when there is one (CPU RNG is single-threaded and slow)
    fill_device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=fill_device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.empty(param.shape, dtype=param.dtype, device=fill_device)
                param.copy_(values.normal_(0.0, 0.02, generator=gen))
        # rotary buffers were created on meta: recompute them on the host
        for module in model.modules():
            if "inv_freq" in module._buffers:
                fresh = type(module)(module.config)  # built on the host, buffers computed
                for name, buffer in fresh.named_buffers(recurse=False):
                    module._buffers[name] = buffer
    return model


def parse_streamed_config(spec: str):
    """A streamed row's "slots:prefetch[:backward_slots]" (backward slots default to auto)."""
    fields = spec.split(":")
    return int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) > 2 else "auto"


def cuda_timer():
    torch.cuda.synchronize()
    return time.perf_counter()


def cap_fraction(cap_bytes: int, total: int) -> float:
    """The fraction of the GPU's ``total`` bytes that caps a process at ``cap_bytes``
    (``torch.cuda.set_per_process_memory_fraction``). A cap above the GPU's memory is
    refused: run with the whole GPU instead, its figures would be recorded under a cap they
    never had (80 GiB on an H100, which has 79.6 GiB)."""
    if cap_bytes > total:
        raise SystemExit(
            f"a cap of {cap_bytes / 2**30:.1f} GiB is more than this GPU's {total / 2**30:.1f} GiB; "
            "give a cap it has, or run with the whole GPU"
        )
    return cap_bytes / total


def cap_gpu(cap_bytes: int) -> int:
    """Cap this process's use of GPU 0 at ``cap_bytes`` (``cap_fraction``); the GPU's memory."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap_fraction(cap_bytes, total))
    return total


def median(values):
    return statistics.median(values)


def machine() -> dict:
    """The library versions (``layerstream.system.versions``) and the GPU this process used,
    if it used one (a harness whose runs use the GPU in processes of their own leaves the
    device alone: asking for its name would start a CUDA context beside them)."""
    from layerstream.system.versions import versions

    info = versions()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def pinned_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Host-to-device GB/s of one large pinned copy (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        start = cuda_timer()
        dst.copy_(src, non_blocking=True)
        times.append(cuda_timer() - start)
    del src, dst
    return nbytes / median(times[1:]) / 1e9


def commit() -> str | None:
    """COMMIT where given (as scripts/gpu-suite.sh takes it), else HEAD, with "+modified" where
    tracked files differ from it: a copy of the working tree (the GPU machine's) can carry a
    HEAD older than the code that ran."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        clean = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD"], capture_output=True, cwd=Path(__file__).parent
            ).returncode
            == 0
        )
    except OSError:
        return None
    head = done.stdout.strip()
    return (head if clean else f"{head}+modified") if head else None


@functools.lru_cache(maxsize=None)
def code_of(commit_id: str | None) -> str | None:
    """What a run's speed depends on: the tree of ``src/`` at ``commit_id`` (commits that
    changed only docs or benchmarks ran the same code), or ``commit_id`` itself where this
    checkout cannot tell (a GPU machine's copy may lack the commit); "+modified" kept."""
    if not commit_id:
        return None
    base, _, modified = commit_id.partition("+")
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--verify", "-q", f"{base}:src"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        )
    except OSError:
        return commit_id
    tree = done.stdout.strip()
    if done.returncode != 0 or not tree:
        return commit_id
    return f"{tree}+{modified}" if modified else tree


# what a run's speed depends on besides the releases: the package, the Trainer script the
# client benchmark runs, and the recipes and shapes in configs/
CODE_PARTS = ("src/layerstream", "benchmarks/long_trainer_script.py", "configs")


def code_hash() -> str:
    """A hash of the files in ``CODE_PARTS`` as they are now (paths and contents): recorded by
    each attempt as it runs, so that whether two attempts ran the same code needs no git (a
    GPU machine's copy of the tree may carry an older history, or none)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for part in CODE_PARTS:
        path = root / part
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts or file.suffix == ".pyc" or not file.exists():
                continue
            digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def same_code(one: dict, other: dict) -> bool:
    """Whether two attempts ran the same code: by the hash each recorded as it ran (``code``),
    else by the src/ tree at their commits (``code_of``). An unrecorded commit, or one with
    uncommitted changes ("+modified"), matches only itself; two attempts without either are
    taken as the same, as attempts from before they kept their commit were pooled."""
    if one is other:
        return True
    if one.get("code") and other.get("code"):
        return one["code"] == other["code"]
    first, second = one.get("commit"), other.get("commit")
    if first is None or second is None:
        return first is None and second is None and not one.get("code") and not other.get("code")
    if "+" in first or "+" in second:
        return False
    return code_of(first) == code_of(second)


def card_of(gpu) -> str:
    """A short name of a GPU for run names: "NVIDIA H100 80GB HBM3" -> "h100" ("gpu": none known)."""
    model = re.search(r"\b[A-Z]+\d+[A-Z]*\b", gpu or "")
    return model.group(0).lower() if model else "gpu"


FOLLOWING = ("follows", "same_loss_for")  # a run's fields that name another run


def keep_by_card(runs: dict, run: dict) -> None:
    """Put ``run`` in ``runs`` under its name. Where one of that name was measured on another
    GPU, that one stays too, under its card's name (``-h200``): the run added last keeps the
    plain name, and each card's runs stay to be paired with their own card's only."""
    known = runs.get(run["name"])
    if known is not None and known.get("gpu") and run.get("gpu") and known["gpu"] != run["gpu"]:
        kept = f"{known['name']}-{card_of(known['gpu'])}"
        runs[kept] = dict(known, name=kept)
        for other in runs.values():  # its card's runs that name it (a baseline's run) follow it
            for key in FOLLOWING:
                if other.get(key) == known["name"] and other.get("gpu") == known["gpu"]:
                    other[key] = kept
    runs[run["name"]] = run


def write_result(name: str, payload: dict, out_dir: str | None = None, measured_on: dict | None = None) -> str:
    """``payload`` with the machine and the time, as ``<name>.json`` in ``out_dir`` (else
    ``$OUT``, else benchmarks/results); ``measured_on``: the machine the payload's runs were
    measured on, where that is not this one (rows remade from earlier results)."""
    out_dir = out_dir or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    payload = dict(payload, machine=measured_on or machine(), when=when)
    with open(path, "w") as handle:
        json.dump(payload, handle, indent=2)
    print(f"wrote {path}")
    return path


def build_random_nf4(
    shape, layers: int | None = None, double_quant: bool = True, dtype=torch.bfloat16, attn: str = "sdpa"
):
    """A real-shape NF4 model (as transformers loads one with BitsAndBytesConfig) on the host;
    a shape whose config names MXFP4 (gpt-oss as published) keeps its experts packed, random,
    as layerstream's loader keeps them (``modules.packed_experts``).

    Quantising fresh random weights costs seconds per large layer, so layer 0 is
    quantised once (on the GPU when there is one) and every other layer gets its own copy
    of those packed bytes and quant state: the same sizes and kernels as a real model.
    """
    import copy

    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    from layerstream.checkpoints import mxfp4
    from layerstream.checkpoints.computed_buffers import compute_buffers, initialisers
    from layerstream.modules import packed_experts
    from layerstream.modules.discovery import find_decoder_layers
    from layerstream.modules.nf4 import quantise_layer

    config = shape_config(shape, layers)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    quant_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
    )
    quantizer = AutoHfQuantizer.from_config(quant_config, pre_quantized=False)
    quantizer.preprocess_model(model, device_map=None, dtype=dtype)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.weight.data = torch.empty_like(module.weight.data, dtype=dtype)
    _, stack = find_decoder_layers(model)
    packed = mxfp4.keeps_packed(config)  # gpt-oss as published: its experts stay MXFP4, as the loader keeps them
    if packed:
        packed_experts.pack_every(stack, dtype)
    fill_device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=fill_device).manual_seed(0)

    def fill(module, recurse):
        module.to_empty(device="cpu", recurse=recurse)
        with torch.no_grad():
            for name, param in module.named_parameters(recurse=recurse):
                if name.endswith("norm.weight") or name == "weight" and "Norm" in type(module).__name__:
                    param.fill_(1.0)
                else:
                    values = torch.empty(param.shape, dtype=param.dtype, device=fill_device)
                    param.copy_(values.normal_(0.0, 0.02, generator=gen))
            for name, buffer in module.named_buffers(recurse=recurse):
                if name.endswith(("_blocks", "_scales")):
                    buffer.copy_(random_mxfp4(buffer.shape, name.endswith("_scales"), gen, fill_device))

    in_stack = {id(m) for layer in stack for m in layer.modules()}
    owners = initialisers(model)
    for module in model.modules():
        if id(module) not in in_stack and module is not stack:
            fill(module, recurse=False)
            compute_buffers([module], owners)
    fill(stack[0], recurse=True)
    compute_buffers(stack[0].modules(), owners)
    quantise_layer(stack[0], torch.device(fill_device), dtype, quant_config)
    source = dict(stack[0].named_modules())
    for layer in list(stack)[1:]:
        layer.to_empty(device="cpu")
        for name, module in layer.named_modules():
            original = source[name]
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                src = original._parameters[pname]
                if isinstance(src, bnb.nn.Params4bit):
                    module._parameters[pname] = bnb.nn.Params4bit(
                        src.data.clone(),
                        requires_grad=False,
                        quant_state=copy.deepcopy(src.quant_state),
                        blocksize=src.blocksize,
                        compress_statistics=src.compress_statistics,
                        quant_type=src.quant_type,
                        quant_storage=src.quant_storage,
                        bnb_quantized=True,
                        module=module,
                    )
                else:
                    with torch.no_grad():
                        param.copy_(src)
            for bname, buffer in module._buffers.items():
                if buffer is not None and bname.endswith(("_blocks", "_scales")):
                    buffer.copy_(original._buffers[bname])
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    if packed:  # the runtime's plan reads it (the config's quantization_config is bitsandbytes' now)
        setattr(model.config, mxfp4.PACKED, True)
    return model


# MXFP4 exponents (biased by 127) of random packed experts: FP4 values (at most 6) times
# 2**-9 .. 2**-5, about the spread of weights initialised with std 1/sqrt(hidden)
MXFP4_SCALES = (118, 122)


def random_mxfp4(shape, scales: bool, generator, device: str) -> torch.Tensor:
    """Random MXFP4 blocks (any byte is a valid pair of FP4 values) or exponents, on the host."""
    low, high = MXFP4_SCALES if scales else (0, 255)
    return torch.randint(low, high + 1, tuple(shape), dtype=torch.uint8, generator=generator, device=device).cpu()


def greedy_tokens(ids: torch.Tensor, new_tokens: int) -> dict:
    """``generate``'s arguments for exactly ``new_tokens`` greedy tokens after ``ids``, with
    the KV cache: the decoding every generation benchmark times."""
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
