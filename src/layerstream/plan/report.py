"""The plan as people read it: what would make it fit, how it could copy less, and the
one-screen table of ``layerstream plan``."""

from __future__ import annotations

import textwrap
from typing import List, Optional

from ..config import offload_device_layers, offloaded_layers
from ..long import trl_head
from ..system.memory_limits import lockable_bytes
from ..units import GiB
from .memory import MemoryPlan, _gib, backward_slot_count
from .shapes import LOSS_LOGIT_COPIES


def _short_dtype(name: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def speed_hints(plan: MemoryPlan) -> List[str]:
    """Ways a plan that fits could copy less per token. The copies of a micro-batch are
    a floor under its step time; at batch 1 they can exceed the compute
    (docs/performance.md: Llama-3-8B bf16 at 1 x 2048 tokens runs at 0.70x resident,
    at 4 x 2048 at 0.99x)."""
    if not plan.fits or plan.layers_copied_per_step == 0:
        return []
    hints = []
    window = plan.window_layers
    if window >= plan.num_layers:
        hints.append(
            f"every layer fits in {_gib(plan.vram_bytes)} beside the rest: with "
            f"vram_budget={_gib(plan.vram_bytes)} (StreamConfig(vram_budget=...), stream.vram_budget) "
            "the resident window keeps them all and nothing is copied per step"
        )
    elif window:
        layers, nbytes = plan.window_copies()
        hints.append(
            f"with vram_budget={_gib(plan.vram_bytes)} (StreamConfig(vram_budget=...), stream.vram_budget) "
            f"the resident window keeps {window} of {plan.num_layers} layers on the GPU: {layers} layer "
            f"copies per step instead of {plan.layers_copied_per_step}, "
            f"{nbytes / (plan.bandwidth_gbps * 1e9):.3f} s at {plan.bandwidth_gbps:g} GB/s"
        )
    backward = backward_slot_count(
        plan.loss_phase_bytes,
        plan.layer_working_bytes,
        plan.lora_bytes,
        plan.max_layer_bytes,
        plan.num_layers,
        plan.slots,
    )
    if backward > plan.backward_slots:
        hints.append(
            f"with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, {backward} backward slots "
            f"(StreamConfig(backward_slots='auto') with vram_budget=None) reuse the loss's memory outside "
            f"the loss: {backward} layer copies fewer per step, the peak unchanged"
        )
    largest = plan.largest_batch
    if largest > plan.batch:
        hints.append(
            f"every micro-batch copies the streamed layers again (forward, then backward's "
            f"recompute): batch {largest} fits at seq {plan.seq} and carries {largest / plan.batch:.0f}x "
            f"the tokens for the same copies, so raise per_device_train_batch_size before "
            f"gradient_accumulation_steps"
        )
    return hints


# -- text ---------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan) -> str:
    """The plan as a one-screen table, sizes in GiB."""
    lines = []
    width = 50

    def row(label: str, nbytes: Optional[float] = None, extra: str = "") -> None:
        value = f"{nbytes / GiB:9.2f} GiB" if nbytes is not None else " " * 13
        lines.append(f"  {label:<{width}}{value}{('  ' + extra) if extra else ''}")

    sizes = sorted(set(plan.layer_bytes))
    per_layer = f"{_gib(sizes[0])}" if len(sizes) == 1 else f"{_gib(sizes[0])} to {_gib(sizes[-1])}"
    lora = f"r={plan.lora_rank} on {plan.lora_targets}" if plan.lora_rank else "no LoRA"
    lines.append(
        f"layerstream plan: {plan.model_type}, {plan.num_layers} layers, "
        f"seq {plan.seq} x batch {plan.batch}, {plan.dtype}"
        f"{f' ({plan.residual_dtype} residual stream)' if plan.residual_dtype else ''}"
        f"{', NF4' if plan.quantization == 'nf4' else ''}, {lora}"
    )
    lines.append("")
    lines.append("GPU memory")
    if plan.stream_embeddings:
        row("final norm (embeddings and head stream)", plan.resident_bytes)
    else:
        row("embeddings, final norm, head (resident)", plan.resident_bytes)
    slots_how = "auto" if plan.slots_auto else "--slots"
    row(f"slots: {plan.slots} x {_gib(plan.max_layer_bytes)} ({slots_how})", plan.slot_bytes)
    if plan.backward_slots:
        row(
            f"backward slots: {plan.backward_slots} x {_gib(plan.max_layer_bytes)} (not at the peak)",
            plan.backward_slots * plan.max_layer_bytes,
            "outside the loss",
        )
    row(
        f"LoRA: {plan.lora_params / 1e6:.1f}M {_short_dtype(plan.adapter_dtype)} params, grads, AdamW",
        plan.lora_bytes + plan.lora_grad_bytes + plan.optimizer_bytes,
    )
    if plan.offload_activations:
        kept = offload_device_layers(plan.num_layers)
        row(f"hidden states: {kept} of {plan.num_layers} boundaries (offload_activations)", plan.boundary_bytes)
    else:
        row(f"hidden states at {plan.num_layers} layer boundaries", plan.boundary_bytes)
    # the loss and a layer's recompute happen at different moments: only the larger counts
    loss_peak = plan.loss_phase_bytes >= plan.layer_working_bytes
    chunk = f", chunks of {plan.loss_chunk_tokens} tokens" if plan.loss_chunk_tokens else ""
    what = f"fp32 logits x{LOSS_LOGIT_COPIES}{chunk}"
    if plan.trl_fused_head:
        what = f"TRL's fused head, {trl_head.TOKEN_TILE} x {trl_head.VOCAB_TILE} tile, hidden-state copies"
    if plan.head_cast_bytes:
        what += f", its {plan.dtype} head tile" if plan.trl_fused_head else f", the head's {plan.dtype} copy"
    row(f"loss: {what}" + ("" if loss_peak else " (not at the peak)"), plan.loss_bytes)
    if plan.head_copy_bytes:
        row("head weight copied in for the loss" + ("" if loss_peak else " (not at the peak)"), plan.head_copy_bytes)
    tile = f", MLP tiles of {plan.mlp_tile_tokens} tokens" if plan.mlp_tile_tokens else ""
    row(
        f"one layer's recompute + backward{tile}" + (" (not at the peak)" if loss_peak else ""),
        plan.layer_working_bytes,
    )
    row("predicted peak VRAM", plan.peak_vram_bytes)
    row("reserve: CUDA context, workspaces, fragmentation", plan.reserve_bytes)
    verdict = (
        f"fits, {_gib(plan.headroom_bytes)} to spare"
        if plan.fits
        else f"DOES NOT FIT, short by {_gib(-plan.headroom_bytes)}"
    )
    row("budget (--vram-budget)", plan.vram_bytes, verdict)
    lines.append("")
    lines.append("Host memory")
    row(f"host store: {plan.num_layers} layers of {per_layer}", plan.host_store_bytes)
    if plan.stream_embeddings:
        row("embeddings and head (--stream-embeddings)", plan.ends_host_bytes)
    if plan.offload_activations:
        row(
            f"offloaded hidden states: {offloaded_layers(plan.num_layers)} layers (--offload-activations)",
            plan.activation_host_bytes,
        )
    row(
        "host RAM needed: transformers load + stream_model",
        plan.host_ram_bytes,
        f"after .to(device): {_gib(plan.host_steady_bytes)}",
    )
    row(
        "host RAM needed: layerstream.from_pretrained",
        plan.loader_ram_bytes,
        f"after .to(device): {_gib(plan.loader_store_bytes + plan.ends_host_bytes + plan.activation_host_bytes)}",
    )
    lines.append("")
    lines.append("Copies per training step")
    timing = f"{plan.copy_seconds_per_step:.3f} s at {plan.bandwidth_gbps:g} GB/s"
    ends = plan.ends_copy_bytes_per_step
    kept_forward = plan.slots + plan.backward_slots
    how = (
        f"2 x ({plan.num_layers} - {plan.slots} slots)"
        if not plan.backward_slots
        else f"{plan.num_layers} - {kept_forward} + {plan.num_layers} - {plan.slots}"
    )
    row(
        f"{plan.layers_copied_per_step} layer copies ({how})"
        if plan.num_layers > plan.slots
        else "0 layer copies (every layer stays in a slot)",
        plan.copy_bytes_per_step - ends,
        "" if ends else timing,
    )
    if ends:
        row("2 head copies (forward, backward), embedding rows", ends)
        row("all copies", plan.copy_bytes_per_step, timing)
    for item in speed_hints(plan):
        lines.extend(textwrap.wrap(f"speed: {item}", width=88, subsequent_indent="       "))
    for note in plan.notes:
        lines.extend(textwrap.wrap(f"note: {note}", width=88, subsequent_indent="      "))
    if plan.advice:
        lines.append("")
        lines.append("To make it fit:")
        for item in plan.advice:
            lines.extend(textwrap.wrap(f"- {item}", width=88, initial_indent="  ", subsequent_indent="    "))
    return "\n".join(lines)


def format_comparison(rows, seq: int, batch: int) -> str:
    """``longest.comparison`` as a table: each option set, its peak and verdict at ``seq``,
    and the longest sequence that fits (when asked)."""
    with_max = any(longest >= 0 for _, _, longest in rows)
    lines = [f"Long-sequence options at seq {seq} x batch {batch}"]
    for label, plan, longest in rows:
        verdict = "fits" if plan.fits else "does not fit"
        host = f"host +{plan.activation_host_bytes / GiB:.2f} GiB" if plan.activation_host_bytes else ""
        tail = f"  longest seq that fits: {longest}" if with_max else ""
        lines.append(f"  {label:<30} peak {plan.peak_vram_bytes / GiB:8.2f} GiB  {verdict:<13}{host:<18}{tail}")
    return "\n".join(lines)


def format_host_check(
    plan: MemoryPlan, memory, longest: Optional[int] = None, machine: str = "this machine", disk: bool = False
) -> str:
    """One line comparing the plan's host RAM peak with layerstream.from_pretrained (the
    loader that never holds the whole model) with ``machine``'s ``(available, total)``
    bytes: the GPU verdict alone would call a step that the host cannot hold a fit.
    ``longest``: the longest sequence whose plan this host holds, said where the offloaded
    inputs take part in what it cannot hold (0: none does). ``disk``: the plan's store is a
    disk tier's (``--host-budget``), whose budget is the lever to name."""
    available, total = memory
    need = plan.loader_ram_bytes
    head = f"{machine}: {_gib(available)} of host RAM available ({_gib(total)} in all), the plan needs {_gib(need)}"
    if plan.host_holds(available, total):
        return f"{head}: fits"
    locked = need <= available  # what does not fit is the page-locked part
    if locked:
        head += (
            f", of which {_gib(plan.locked_host_bytes)} page-locked, more than the "
            f"{_gib(lockable_bytes(total))} that may be (a tenth, at least 4 GiB, stays unlocked)"
        )
    fixes = []
    if plan.activation_host_bytes:
        offloaded = f"the offloaded inputs take {_gib(plan.activation_host_bytes)}: "
        if longest:
            fixes.append(f"{offloaded}shorten --seq to {longest} tokens or fewer (the host holds those)")
        elif longest == 0:
            fixes.append(
                f"{offloaded}no length fits beside the rest (--offload-activations false keeps them on the GPU)"
            )
        else:
            fixes.append(f"{offloaded}shorten --seq")
    if disk:
        fixes.append(f"a smaller --host-budget (the tier's store and ring take {_gib(plan.loader_store_bytes)})")
    else:
        fixes.append(f"read layers from disk (--host-budget: frees up to the store's {_gib(plan.loader_store_bytes)})")
    if locked:
        fixes.append("page-lock nothing (StreamConfig(pin=False): pageable copies, slower)")
    fixes.append("run where there is more RAM")
    text = f"{head}: DOES NOT FIT; {', '.join(fixes[:-1])} or {fixes[-1]}"
    return "\n".join(textwrap.wrap(text, width=88, subsequent_indent="  ", break_on_hyphens=False))


def format_decode_term(plan: MemoryPlan, term, batch: int = 1, windowed=None) -> str:
    """Generation's lines: one token step's copies and copy bound, and the batch from which
    the frozen layers' compute hides them (``plan.decode.decode_term``); ``windowed``: the
    same term with the layers the plan's resident window keeps (``plan.window_layers``),
    which generation shares with training."""
    lines = ["", f"Generation: one token step of decoding (batch {batch} at once, every layer streamed)"]
    copies = (
        f"{term.layers_copied} layer copies (every layer, each step)"
        if term.layers_copied
        else "0 layer copies (every layer stays in a slot)"
    )
    timing = f"{term.copy_seconds * 1e3:.1f} ms at {plan.bandwidth_gbps:g} GB/s"
    lines.append(f"  {copies:<52}{_gib(term.copy_bytes):>10}  {timing}")
    if term.compute_bound_batch is not None:
        lines.append(
            f"  compute-bound from batch {term.compute_bound_batch}: 2 x {term.params / 1e9:.2f}B frozen "
            "parameters per sequence take as long as the copies"
        )
    else:
        lines.append("  --tflops T: the batch from which decoding is compute-bound rather than copy-bound")
    if windowed is not None:
        seconds = f"{windowed.copy_seconds * 1e3:.1f} ms"
        said = (
            f"with vram_budget={_gib(plan.vram_bytes)} the resident window keeps {plan.window_layers} of "
            f"{plan.num_layers} layers for generation too (from a training process's third step, or a generating "
            f"process's second call): {windowed.layers_copied} layer copies, {_gib(windowed.copy_bytes)}, {seconds}"
        )
        lines.extend(textwrap.wrap(said, width=88, initial_indent="  ", subsequent_indent="    "))
        if windowed.compute_bound_batch is not None:
            lines.append(f"  with that window, compute-bound from batch {windowed.compute_bound_batch}")
    return "\n".join(lines)
