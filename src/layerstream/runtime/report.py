"""What a streamed model tells people: counters, the start-up summary, and what to change
when memory runs out or a budget cannot hold a step."""

from __future__ import annotations

from typing import Optional

import torch

from ..config import expandable_segments, gpu_memory_for_run
from ..errors import StreamingError
from ..long import chunked_loss, trl_head
from ..modules import nf4, packed_experts
from ..units import GiB, MiB, gib, size
from .disk_changes import SHARE


def stats(runtime) -> dict:
    """Counters since streaming began. Reads outstanding CUDA timing events (waits)."""
    pool = runtime.pool
    pool.settle()
    embeddings = runtime.embeddings
    return {
        "layers": len(runtime.records),
        "slots": runtime.config.slots,
        "prefetch": runtime.config.prefetch,
        "visits": runtime.visits,
        "layer_loads": pool.loads,
        "demand_loads": runtime.demand_loads,
        "h2d_bytes": pool.h2d_bytes,  # the layers, and the head and embedding rows when they stream
        "h2d_seconds": pool.h2d_seconds,
        "h2d_gbps": (pool.h2d_bytes / pool.h2d_seconds / 1e9) if pool.h2d_seconds else 0.0,
        "h2d_timed_bytes": pool.timed_bytes,  # the copies timed, for an interval's bandwidth
        "h2d_timed_seconds": pool.timed_seconds,
        "stall_seconds": pool.stall_seconds,
        "stalls": pool.stalls,
        "peak_resident_layers": runtime.peak_resident_layers,
        "slot_bytes": pool.ring_bytes,
        "backward_slots": runtime.prefetch.active_backward_slots,
        "backward_slot_peak_bytes": pool.borrowed_peak_bytes,
        "host_bytes": runtime.store.host_bytes + (embeddings.host_bytes if embeddings is not None else 0),
        "pinned": runtime.store.pinned,
        "device": str(runtime.device),
        "checksum_checks": runtime._checker.checks if runtime._checker is not None else 0,
        "window_layers": len(runtime.window),
        "window_changes": len(runtime.resident_window.window_changes),
        "oom_retries": runtime.resident_window.oom_retries,
        "alloc_retries": alloc_retries(runtime.device),
        "refreshed_layers": runtime.refreshed_layers,
        "stream_embeddings": embeddings is not None,
        **(
            embeddings.stats()
            if embeddings is not None
            else {"head_copies": 0, "head_h2d_bytes": 0, "embedding_h2d_bytes": 0}
        ),
        **runtime.nf4_counts,
        **runtime.experts.stats(),
        **disk_stats(runtime),
        **_offload_stats(runtime.offload_policy.offloader),
    }


def alloc_retries(device: torch.device) -> int:
    """The CUDA caching allocator's retries on ``device`` so far (0 off CUDA): allocations
    that succeeded only after it freed its cached blocks, each a device-wide sync. Near a
    memory limit they slow every step without failing any."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def disk_stats(runtime) -> dict:
    """The disk tier's counters (zeros and every layer in RAM without one)."""
    if runtime.disk is not None:
        return runtime.disk.stats()
    return {
        "ram_layers": len(runtime.records),
        "disk_layers": 0,
        "ring_regions": 0,
        "ring_bytes": 0,
        "disk_reads": 0,
        "disk_demand_reads": 0,
        "disk_read_bytes": 0,
        "disk_read_seconds": 0.0,
        "disk_read_gbps": 0.0,
        "disk_stall_seconds": 0.0,
        "disk_lookahead": 0,
        "disk_ring_too_small": False,
        "direct_io": False,
        "disk_reads_at_once": 0,
        "disk_reads_at_once_changes": 0,
    }


def _offload_stats(offloader) -> dict:
    """offload_activations' counters (zeros when it is off)."""
    return {
        "activations_offloaded": offloader.offloaded if offloader is not None else 0,
        "activations_restored": offloader.restored if offloader is not None else 0,
        "activation_d2h_bytes": offloader.d2h_bytes if offloader is not None else 0,
        "activation_h2d_bytes": offloader.h2d_bytes if offloader is not None else 0,
        "activation_host_bytes": offloader.host_bytes if offloader is not None else 0,
        "activation_checks": offloader.checks if offloader is not None else 0,
    }


def _auto(runtime, name: str) -> str:
    return " (auto)" if name in runtime.config.automatic else ""


def _budget_line(runtime) -> str:
    budget = runtime.config.vram_budget
    if budget is None:
        return "none: every layer streams (vram_budget=None)"
    what = "auto (the GPU memory this process can reach)" if budget == "auto" else gib(budget)
    return f"{what}; the resident window is sized from measured memory at the first training steps"


def summary(runtime) -> str:
    """A one-screen description: what streams, slots, bytes, pinning, the budget."""
    records, pool, store = runtime.records, runtime.pool, runtime.store
    streamed = sum(len(r.entries) for r in records)
    sizes = sorted({r.nbytes for r in records})
    size_text = f"{sizes[0] / MiB:.1f} MiB" if len(sizes) == 1 else f"{sizes[0] / MiB:.1f}..{sizes[-1] / MiB:.1f} MiB"
    lines = [
        "layerstream: streaming decoder layers",
        f"  stack        {runtime.layers_path} ({len(records)} layers, {streamed} tensors)",
        f"  layer size   {size_text} each",
        f"  host store   {store.host_bytes / GiB:.3f} GiB in {len(store.arenas)} arena(s), "
        f"{'pinned' if store.pinned else 'pageable'}",
        f"  device       {runtime.device}: {runtime.config.slots} slots{_auto(runtime, 'slots')} x "
        f"{pool.slot_bytes / MiB:.1f} MiB = {pool.total_bytes / GiB:.3f} GiB",
        f"  prefetch     {runtime.config.prefetch} layer(s) ahead{_auto(runtime, 'prefetch')}",
        f"  tiers        {_tiers_line(runtime)}",
        f"  vram budget  {_budget_line(runtime)}",
        f"  window       {len(runtime.window)} layer(s) on the GPU for good",
        f"  backward     {runtime.backward.note(runtime.prefetch.backward_slots, pool.cuda)}",
        f"  long seq     {runtime.long_settings.summary_line()}",
    ]
    if pool.cuda:
        segments = "on" if expandable_segments() else "off"
        lines.append(
            f"  allocator    expandable segments {segments}"
            + (" (set by layerstream run)" if _launcher_set_segments() else "")
        )
    if runtime.embeddings is not None:
        lines += [
            f"  embeddings   streamed: {runtime.embeddings.describe()}",
            "  resident     final norm, and every trainable tensor",
        ]
    else:
        why = (
            "stream_embeddings=auto: to host memory at a step the long-sequence settings leave over the plan's "
            "limit, back once a measured step leaves room"
            if runtime.config.stream_embeddings == "auto"
            else "stream_embeddings=False"
        )
        lines += [
            f"  embeddings   resident ({why})",
            "  resident     embeddings, final norm, head, and every trainable tensor",
        ]
    lines.append(f"  loss         {_loss_line(runtime)}")
    experts = _experts_line(runtime)
    if experts:
        lines.append(f"  experts      {experts}")
    return "\n".join(lines)


def _experts_line(runtime) -> str:
    """How a mixture of experts' stacks stream: by need or whole, packed in MXFP4 or not."""
    stacks = [stack for found in runtime.experts.stacks.values() for stack in found]
    if not stacks:
        return ""
    by_need = sum(stack.by_need for stack in stacks)
    copies = f"{by_need} of {len(stacks)} stacks copied by need in short passes" if by_need else "copied whole"
    packed = [p for _, _, p in packed_experts.packed_modules(runtime.model)]
    if not packed:
        return copies
    dtype = str(packed[0].dtype).replace("torch.", "")
    return f"{copies}; kept in MXFP4, each call dequantises its experts to {dtype} where it runs"


def _loss_line(runtime) -> str:
    """Which code computes the training loss: a fused loss (TRL's head, Liger's) replaces the
    model's forward, and with it a loss_chunk_tokens forward in front of it."""
    model, chunk = runtime.model, chunked_loss.chunk_tokens(runtime.model)
    bypassed = f"; loss_chunk_tokens={chunk} is not applied" if chunk else ""
    if trl_head.installed(model):
        head = "; the streamed head is fetched to the device for it" if runtime.embeddings is not None else ""
        return (
            f"TRL's fused log-prob head, {trl_head.TOKEN_TILE} tokens x {trl_head.VOCAB_TILE} "
            f"vocabulary columns at a time{head}{bypassed}"
        )
    if trl_head.metrics_only(model):
        return (
            "the trainer's own loss (label smoothing, or its compute_loss_func) on the model's full logits; "
            f"TRL's fused head runs after it, without gradients, for the logged metrics{bypassed}"
        )
    if chunked_loss.liger_computes(model):
        return f"Liger-Kernel's fused linear cross-entropy{bypassed}"
    if chunk:
        return f"layerstream's chunked loss, {chunk} tokens at a time (loss_chunk_tokens)"
    if runtime.config.loss_chunk_tokens == "auto" and runtime.long_settings.called_without_labels:
        return (
            "the trainer's own loss on the model's full logits (loss_chunk_tokens auto stays off: the model is "
            "called without labels for training)"
        )
    if runtime.config.loss_chunk_tokens == "auto" and runtime.long_settings.loss_chunks_possible:
        return "the model's own forward, full logits (loss_chunk_tokens auto: chunked once a step needs it)"
    if runtime.config.loss_chunk_tokens == "auto":
        return "the model's own forward (loss_chunk_tokens auto stays off: this model's loss is not one layerstream chunks)"
    return "the model's own forward, full logits (loss_chunk_tokens off)"


def _tiers_line(runtime) -> str:
    if runtime.disk is None:
        return f"{len(runtime.records)} layer(s) in host RAM, none on disk (host_budget unset or large enough)"
    return runtime.disk.describe()


def _launcher_set_segments() -> bool:
    import os

    return os.environ.get("LAYERSTREAM_SET_ALLOC_CONF") == "1"


def _plan_flags(runtime) -> str:
    """`layerstream plan`'s flags for this model and step as the runtime plans them (its
    dtypes, adapters, autocast, loss head), each after a space; "" where the planner cannot
    describe the adapters or the command cannot spell them."""
    from ..plan.model import dropout_probability
    from ..plan.request import plan_flags

    dropouts = (p for p in map(dropout_probability, runtime.model.modules()) if p > 0)
    request = runtime.long_settings.plan_request(1, 1)
    if not request.stream_embeddings and runtime.config.stream_embeddings == "auto":
        request = request.replace(stream_embeddings="auto")  # as the run decides it
    try:  # adapters the planner cannot describe, or the command cannot spell: no flags
        flags = plan_flags(request, next(dropouts, 0.05))
    except ValueError:
        return ""
    return "".join(f" {flag}" for flag in flags)


def explain_oom(runtime, exc: BaseException, where: str) -> BaseException:
    """The same out-of-memory error, with what streaming holds and which budget to change.

    Same type, so code that reacts to out-of-memory (the Trainer's auto_find_batch_size,
    layerstream's own retry with a smaller window) still does; explained once, however
    often it is re-raised.
    """
    if getattr(exc, "_layerstream_explained", False):
        return exc
    config, pool = runtime.config, runtime.pool
    one_slot = pool.slot_bytes / GiB
    lines = [
        str(exc),
        "",
        f"layerstream: the GPU ran out of memory {where}. Streaming holds {config.slots} slots x "
        f"{one_slot:.2f} GiB = {pool.total_bytes / GiB:.2f} GiB and {len(runtime.window)} window layer(s) on "
        f"{runtime.device}; the rest is the resident part (embeddings, head, adapters, optimizer state) "
        "and activations. To fit:",
        "  - shorten sequences or the batch (activations and logits grow with batch x seq length);",
    ]
    if runtime.window:
        lines.append(
            "  - give vram_budget a smaller size (--vram-budget, stream.vram_budget): the window then "
            "keeps fewer layers on the GPU;"
        )
    if config.slots > 2:
        lines.append(
            f"  - use fewer slots: StreamConfig(slots=2) (--slots 2, stream.slots: 2) frees "
            f"{(config.slots - 2) * one_slot:.2f} GiB;"
        )
    if not nf4.streams_4bit(runtime.records):
        lines.append("  - load the model in NF4 (quantization='nf4'): a quarter of the bytes per slot;")
    if runtime.embeddings is None:
        from .embeddings import host_bytes

        ends_bytes = host_bytes(runtime.model)
        if ends_bytes:
            lines.append(
                f"  - keep the input embedding and head in host memory: StreamConfig(stream_embeddings=True) "
                f"(--stream-embeddings, --layer_stream_embeddings true, stream.stream_embeddings: true) frees "
                f"{ends_bytes / GiB:.2f} GiB, "
                "less one head copied in for the loss;"
            )
    lines += [f"  - {line};" for line in _long_sequence_advice(runtime)]
    lines.append(
        f"  - `layerstream plan --model <model> --vram-budget <GPU memory> --seq <tokens>{_plan_flags(runtime)}` "
        "predicts what fits."
    )
    explained = type(exc)("\n".join(lines))
    explained._layerstream_explained = True
    return explained


def _long_sequence_advice(runtime) -> list:
    """The long-sequence settings at the shape of the last training step, each with what it
    frees there, and the longest sequence the plan fits under the budget (the GPU memory
    this process can reach when there is none); nothing when the model cannot be planned."""
    from ..plan.longest import oom_advice

    batch, seq = runtime.last_shape
    budget = runtime.config.budget_bytes()
    if budget is None and runtime.pool.cuda:
        budget = gpu_memory_for_run(runtime.device)
    settings = runtime.long_settings.settings_for(batch * seq)
    settings["offload_activations"] = runtime.pass_offloader is not None
    try:
        return oom_advice(runtime.long_settings.plan_request(batch, seq, **settings), budget)
    except ValueError:
        return []


def budget_refusal(memory, budget: int) -> StreamingError:
    """A training step the planner says an explicit vram_budget cannot hold, even with
    every layer streamed: said before anything is computed, in units that show each part
    (a tiny model's step takes kilobytes), with what is short and why."""
    advice = "\n".join(f"  - {line}" for line in memory.advice[1:])
    reserve = f"{size(memory.reserve_bytes)} kept in reserve (CUDA context, cuBLAS workspaces, allocator slack)"
    if memory.reserve_bytes >= budget:
        reserve += ", which alone takes the whole budget"
    return StreamingError(
        f"a training step of batch {memory.batch} x {memory.seq} tokens does not fit vram_budget="
        f"{size(budget)}: it needs {size(memory.needed_bytes - budget)} more. Nothing has "
        f"been computed yet. The memory planner predicts a peak of {size(memory.peak_vram_bytes)} (resident "
        f"part {size(memory.resident_bytes)}, {memory.slots} slots {size(memory.slot_bytes)}, activations "
        f"{size(memory.activation_bytes)}) beside {reserve}; vram_budget={size(memory.needed_bytes, round_up=True)} "
        f"or more holds it. What else would fit:\n{advice}"
    )


def peak_vram_gib(runtime) -> Optional[float]:
    if not runtime.pool.cuda:
        return None
    return round(torch.cuda.max_memory_allocated(runtime.device) / GiB, 3)


def trainable_streamed_tensor(name: str) -> str:
    """Why a streamed tensor that requires grad cannot train, in the words of what made it
    trainable: PEFT's bias training and modules_to_save act on tensors already streamed
    when PEFT comes after streaming (``layerstream run``, ``from_pretrained``)."""
    if name.endswith(".bias"):
        return (
            f"{name} requires grad: PEFT's bias='all' or bias='lora_only' trains the base layers' biases, "
            "but this model's decoder layers were streamed before PEFT was applied, so their biases are "
            "frozen copies in host memory. Use bias='none' (PEFT's default), or, in a script that calls "
            "layerstream.stream_model itself, apply get_peft_model before it (trainable tensors stay on the "
            "GPU); under `layerstream run` and layerstream.from_pretrained the layers stream as they load, "
            "so the base layers' biases cannot train there."
        )
    return (
        f"{name} requires grad, but streamed weights are frozen (gradients for them would have nowhere "
        "to live). Freeze the base model, e.g. with peft.get_peft_model(model, LoraConfig(...)), before "
        "training; a tensor made trainable after streaming (PEFT's modules_to_save or trainable tokens "
        "inside a decoder layer) must be made trainable before layerstream.stream_model."
    )


_CAST = "a cast of "  # how what_changed names a cast, which disk_layer_write advises on
_KEPT = "a change to a tensor the disk tier keeps on the device, "  # and one of a kept tensor


def what_changed(record) -> str:
    """How a refusal names a change to ``record``'s tensors: the largest dtype cast (peft's
    prepare_model_for_kbit_training casts a layer's norms and, where they are not 4-bit,
    larger weights: a disk layer refuses the large ones), else a change to its weights."""
    casts = []
    for entry in record.entries:
        tensor = entry.table.get(entry.name) if entry.bound else None
        if tensor is not None and tensor.dtype != entry.dtype:
            casts.append((tensor.numel() * tensor.element_size(), entry, tensor.dtype))
    if not casts:
        kept = record.kept_changed()
        return f"{_KEPT}{kept[0]}" if kept else "a change to its weights"
    _, entry, dtype = max(casts, key=lambda cast: cast[0])  # the first of the largest
    return f"{_CAST}{entry.qualified_name} from {entry.dtype} to {dtype}"


def shared_store_write(name: str, change: str) -> str:
    return (
        f"{name} is in a host store shared by this node's ranks (share_host_store), mapped read-only: "
        f"{change} is not possible. Change or merge weights in one process with share_host_store=False."
    )


def disk_layer_write(name: str, change: str, device) -> str:
    """A change to a layer the disk tier reads that cannot stay on the device
    (``disk_changes``: a 4-bit weight, a quantisation state, a large tensor): it would not
    reach the device. A layer in host RAM takes it, as the plain model does."""
    device = torch.device(device)
    where = "the GPU" if device.type == "cuda" else f"the copies on {device}"
    if change.startswith(_CAST):
        what_to_do = (
            "The disk tier reads each layer as it is stored; a disk layer's changed norms and biases (peft's "
            "prepare_model_for_kbit_training casts them to float32) stay on the device, but not a 4-bit weight, a "
            f"quantisation state, or tensors of more than 1/{SHARE} of the layer's bytes. Keep the layers in host "
            "RAM: raise host_budget or leave it unset (a layer in host RAM takes the cast, and trains as the plain "
            "model does)."
        )
    elif change.startswith(_KEPT):
        return (
            f"{name} is read from disk each time (host_budget): {change} could not be taken. A disk layer keeps its "
            f"changed norms and biases on the device, up to 1/{SHARE} of the layer's bytes, and takes their changes "
            "between passes: change them between passes (not during a forward) and within that share, or keep the "
            "layers in host RAM (raise host_budget or leave it unset)."
        )
    else:
        what_to_do = "Change or merge weights only of layers in host RAM: raise host_budget or leave it unset."
    return (
        f"{name} is read from disk each time (host_budget: the checkpoint's files, or the NF4 layer cache): "
        f"{change} would not reach {where}. {what_to_do}"
    )
