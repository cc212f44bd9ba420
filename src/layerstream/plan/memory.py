"""The memory model of one streamed LoRA training step: the plan (``MemoryPlan``), built
from the shapes (``shapes``) and the adapters (``lora``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from ..checkpoints import mxfp4
from ..config import auto_slots, offload_device_layers, offloaded_layers
from ..decisions.schedule import usable_backward_slots
from ..decisions.window import margin_bytes
from ..long import trl_head
from ..system.memory_limits import lockable_bytes
from ..tiers.store import region_bytes
from ..units import GiB, aligned, arena_sizes
from .lora import lora_adapters, plan_notes
from .request import AUTO, PlanRequest
from .shapes import (
    ADAMW_STATES,
    BACKWARD_SLOTS_MAX,
    LOSS_LOGIT_COPIES,
    _check_quantization,
    _text_config,
    eager_scores_bytes,
    ends_host_bytes,
    head_bytes,
    layer_bytes,
    layer_shapes,
    model_shape,
    parse_dtype,
    resident_bytes,
)
from .working_set import layer_working_bytes


# -- the plan -----------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    """Predicted memory and copy cost of one streamed LoRA training step. Bytes are ints."""

    model_type: str
    num_layers: int
    seq: int
    batch: int
    quantization: str
    dtype: str
    lora_rank: int
    lora_targets: str
    # streamed layers
    layer_bytes: List[int]
    max_layer_bytes: int
    host_store_bytes: int
    # resident on the GPU for the whole step
    resident_bytes: int
    lora_params: int
    lora_bytes: int  # adapter weights (in the adapters' dtype)
    lora_grad_bytes: int
    optimizer_bytes: int
    slots: int
    slots_auto: bool
    slot_bytes: int
    backward_slots: int  # extra slots, late backward to early next forward (the loss's memory)
    # activations
    boundary_bytes: int  # one hidden state per layer boundary (checkpointing keeps these)
    layer_working_bytes: int  # one layer's recompute + backward
    loss_bytes: int  # logits in fp32 and their gradients
    # totals
    peak_vram_bytes: int
    vram_bytes: int
    reserve_bytes: int
    host_ram_bytes: int  # peak: model loaded by transformers, then stream_model
    host_steady_bytes: int  # the store alone, after model.to(device)
    loader_store_bytes: int  # arenas as layerstream.from_pretrained allocates them
    loader_ram_bytes: int  # peak: layerstream.from_pretrained, then LoRA
    # copies
    layers_copied_per_step: int
    copy_bytes_per_step: int
    bandwidth_gbps: float
    copy_seconds_per_step: float
    fits: bool
    # stream_embeddings: embedding and head on the host, the head copied in for the loss
    stream_embeddings: bool = False
    head_copy_bytes: int = 0  # the transient device copy of the head weight (loss phase)
    ends_host_bytes: int = 0  # the embedding and head weights in host memory
    ends_copy_bytes_per_step: int = 0  # two head copies and the embedding rows (in copy_bytes_per_step)
    # long sequences: each None/False is off
    offload_activations: bool = False  # checkpointed inputs in host memory but ~2 layers'
    activation_host_bytes: int = 0  # their host arena (in host_steady_bytes and the RAM peaks)
    loss_chunk_tokens: Optional[int] = None  # the head and loss run this many tokens at a time
    mlp_tile_tokens: Optional[int] = None  # the MLP runs this many tokens at a time
    trl_fused_head: bool = False  # TRL's fused log-prob head computes the loss (no loss chunks then)
    adapter_dtype: str = "float32"  # the LoRA weights', their gradients' and AdamW states' dtype
    vocab_size: int = 0  # the head's outputs (the loss chunk's default depends on it)
    residual_dtype: Optional[str] = None  # the embeddings' and residual stream's, where wider than dtype
    head_cast_bytes: int = 0  # the loss's copy of a wider head in the compute dtype (in loss_bytes)
    advice: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def locked_host_bytes(self) -> int:
        """What a run loaded by ``layerstream.from_pretrained`` (``loader_ram_bytes``'s)
        page-locks: the layer store, the ends' store where they stream, the offloaded inputs."""
        return self.loader_store_bytes + self.ends_host_bytes + self.activation_host_bytes

    def host_holds(self, available: int, total: int) -> bool:
        """Whether a host with ``available`` of ``total`` bytes free holds the run: the
        loader's peak fits what is available, and the page-locked bytes what may be locked
        (``lockable_bytes``, as the store and the offloader refuse beyond it)."""
        return self.loader_ram_bytes <= available and self.locked_host_bytes <= lockable_bytes(total)

    @property
    def static_bytes(self) -> int:
        """What lives on the GPU for the whole step."""
        return (
            self.resident_bytes
            + self.slot_bytes
            + self.lora_bytes
            + self.lora_grad_bytes
            + self.optimizer_bytes
            + self.boundary_bytes
        )

    @property
    def loss_phase_bytes(self) -> int:
        """The loss, and the head weight copied in for it when the head streams."""
        return self.loss_bytes + self.head_copy_bytes

    @property
    def activation_bytes(self) -> int:
        """What grows with batch x seq: boundary states plus the larger transient phase."""
        return self.boundary_bytes + max(self.loss_bytes, self.layer_working_bytes)

    @property
    def needed_bytes(self) -> int:
        return self.peak_vram_bytes + self.reserve_bytes

    @property
    def headroom_bytes(self) -> int:
        """Budget left after the peak and the reserve (negative: the shortfall)."""
        return self.vram_bytes - self.needed_bytes

    @property
    def window_layers(self) -> int:
        """Layers a ``vram_budget`` of this plan's budget keeps on the GPU for good (the
        resident window), as the runtime sizes it when its steps use what this plan
        predicts: whole layers in the headroom less the window's margin."""
        if not self.fits:
            return 0
        return window_size(self.headroom_bytes - margin_bytes(self.vram_bytes), self.max_layer_bytes, self.num_layers)

    def window_copies(self) -> Tuple[int, int]:
        """(layers, bytes) copied per step with that window; its layers are the ones
        ``schedule.spread_resident`` picks."""
        from ..decisions.schedule import spread_resident

        kept = set(spread_resident(self.num_layers, self.window_layers))
        streamed = [size for index, size in enumerate(self.layer_bytes) if index not in kept]
        return _copies(streamed, self.slots, usable_backward_slots(self.backward_slots, len(streamed), self.slots))

    @property
    def largest_tokens(self) -> int:
        """The most batch x seq tokens whose activations fit beside everything else
        (activations grow linearly with tokens); 0 when there is no room."""
        per_token = self.activation_bytes / (self.batch * self.seq)
        room = self.vram_bytes - self.reserve_bytes - (self.peak_vram_bytes - self.activation_bytes)
        return int(room // per_token) if room > 0 else 0

    @property
    def largest_batch(self) -> int:
        """The largest batch at this seq that fits; 0 when not even one sequence does."""
        return self.largest_tokens // self.seq


def window_size(headroom_bytes: int, largest_layer_bytes: int, num_layers: int) -> int:
    """How many layers the resident window holds: whole largest layers in the headroom a
    VRAM budget leaves after the planned peak and the reserve (StreamRuntime uses it too)."""
    return int(min(num_layers, max(0, headroom_bytes // max(largest_layer_bytes, 1))))


def _copies(sizes: Sequence[int], slots: int, backward_slots: int = 0) -> Tuple[int, int]:
    """Layers and bytes copied per steady-state training step. Forward starts with the
    first ``slots + backward_slots`` layers left in slots by the previous backward;
    backward starts with the ``slots`` last layers left by forward (backward slots are
    empty at the loss). Every other visit copies its layer."""
    layers = len(sizes)
    kept_forward = min(layers, slots + backward_slots)
    kept_backward = min(layers, slots)
    return (
        (layers - kept_forward) + (layers - kept_backward),
        sum(sizes[kept_forward:]) + sum(sizes[: layers - kept_backward]),
    )


def backward_slot_count(
    loss_phase_bytes: int, working_bytes: int, lora_bytes: int, slot_bytes: int, streamed_layers: int, slots: int
) -> int:
    """How many backward slots fit in memory the loss phase needs and the rest of the
    step does not: the loss phase less one layer's recompute and backward, the adapters'
    gradients and the optimizer's temporaries (two more adapter-sized tensors) that come
    while backward slots hold layers. None when a layer's working set, not the loss, sets
    the peak (the memory would raise it); never more than ``usable_backward_slots``."""
    room = loss_phase_bytes - working_bytes - 3 * lora_bytes
    if room <= 0 or slot_bytes <= 0:
        return 0
    return usable_backward_slots(int(min(BACKWARD_SLOTS_MAX, room // slot_bytes)), streamed_layers, slots)


def loader_arena_bytes(sizes: Sequence[int], arena_bytes: int) -> int:
    """Host bytes of the arenas ``layerstream.from_pretrained`` allocates (HostStore.add)."""
    return sum(arena_sizes(list(sizes), arena_bytes))


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_arguments(request: PlanRequest) -> None:
    """Refuse a request no plan can be made of, naming the field."""
    if not isinstance(request.offload_activations, bool):
        raise ValueError(f"offload_activations must be True or False, got {request.offload_activations!r}")
    for name in ("loss_chunk_tokens", "mlp_tile_tokens"):
        if getattr(request, name) is not None:
            _positive_int(name, getattr(request, name))
    for name in ("seq", "batch", "vram_bytes"):
        _positive_int(name, getattr(request, name))
    lora_rank = request.lora_rank
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an integer >= 0 (0: no adapters), got {lora_rank!r}")
    outputs = request.head_outputs
    if outputs is not None and (isinstance(outputs, bool) or not isinstance(outputs, int) or outputs < 0):
        raise ValueError(f"head_outputs must be None (a causal LM's head) or an integer >= 0, got {outputs!r}")
    if not request.bandwidth_gbps > 0:
        raise ValueError(f"bandwidth_gbps must be > 0, got {request.bandwidth_gbps!r}")
    if request.reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be >= 0, got {request.reserve_bytes!r}")
    slots = request.slots
    if slots != AUTO:
        if isinstance(slots, bool) or not isinstance(slots, int):
            raise ValueError(f"slots must be an integer >= 2 or 'auto', got {slots!r}")
        if slots < 2:
            raise ValueError(f"slots={slots}: streaming needs at least 2 slots")
    backward_slots = request.backward_slots
    if backward_slots != AUTO and (
        isinstance(backward_slots, bool) or not isinstance(backward_slots, int) or backward_slots < 0
    ):
        raise ValueError(f"backward_slots must be an integer >= 0 or 'auto', got {backward_slots!r}")
    if not isinstance(request.stream_embeddings, bool):
        raise ValueError(f"stream_embeddings must be True or False, got {request.stream_embeddings!r}")


def _build(request: PlanRequest) -> MemoryPlan:
    """A plan without advice (advice itself is computed from alternative plans), of a
    request whose long-sequence settings are decided (``long_settings.resolve_auto``)."""
    _check_arguments(request)
    config = _text_config(request.config)
    seq, batch, vram_bytes, reserve_bytes = request.seq, request.batch, request.vram_bytes, request.reserve_bytes
    quantization, lora_rank, lora_targets = request.quantization, request.lora_rank, request.lora_targets
    slots, backward_slots, stream_embeddings = request.slots, request.backward_slots, request.stream_embeddings
    offload_activations, mlp_tile_tokens = request.offload_activations, request.mlp_tile_tokens
    loss_chunk_tokens, trl_fused_head = request.loss_chunk_tokens, request.trl_fused_head
    _check_quantization(quantization)
    dtype = parse_dtype(request.dtype)
    elem = dtype.itemsize
    # the embeddings', head's and residual stream's dtype (float32 after peft's
    # prepare_model_for_kbit_training), where it differs from the compute dtype
    residual_dtype = dtype if request.residual_dtype is None else parse_dtype(request.residual_dtype)
    residual_elem = residual_dtype.itemsize
    model_type = getattr(config, "model_type", "") or "unknown"

    shapes = layer_shapes(config, dtype)
    # what a layer holds: its 4-bit weights packed, the rest (norms, an MoE's expert stacks and
    # router) in the residual stream's dtype, as prepare_model_for_kbit_training casts them
    sizes = layer_bytes(config, quantization, residual_dtype, request.double_quant)
    adapted, lora_params = lora_adapters(
        config, shapes, lora_targets, lora_rank, dtype, request.lora_parameters, request.lora_rank_pattern
    )
    tokens = batch * seq
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)

    resident = resident_bytes(config, residual_dtype, stream_embeddings)
    all_resident = resident_bytes(config, residual_dtype)  # on the host until model.to(device), streamed or not
    head_copy = head_bytes(config, residual_dtype) if stream_embeddings else 0
    # the ends' host store: each matrix at the store's alignment
    ends_host = ends_host_bytes(config, residual_dtype) if stream_embeddings else 0
    end_matrix = head_copy  # the largest end matrix copied into the ends' store as they move
    if request.head_outputs is not None:  # not the causal LM's head: a classifier's score, or none
        resident, all_resident, ends_host, end_matrix = _other_head(
            config, residual_dtype, stream_embeddings, request.head_outputs, resident, all_resident
        )
        head_copy, vocab = 0, request.head_outputs  # no head streams; its logits are that narrow
    ends_copies = 2 * head_copy + (tokens * hidden * residual_elem if stream_embeddings else 0)
    adapter_dtype = parse_dtype(request.adapter_dtype)
    adapter_elem = adapter_dtype.itemsize
    lora_bytes = lora_grads = lora_params * adapter_elem  # gradients take the adapters' dtype
    optimizer = lora_params * adapter_elem * ADAMW_STATES  # AdamW's states take it too
    # with offload_activations the checkpointed inputs are in host memory but a few
    # (config.offload_device_layers says which)
    on_device = offload_device_layers(len(shapes)) if offload_activations else len(shapes)
    boundary = on_device * tokens * hidden * residual_elem
    activation_host = (
        offloaded_layers(len(shapes)) * aligned(tokens * hidden * residual_elem) if offload_activations else 0
    )
    working = max(
        layer_working_bytes(
            config,
            shape,
            layer,
            tokens,
            elem,
            quantization == "nf4",
            mlp_tile_tokens,
            adapter_elem=adapter_elem,
            lora_dropout=request.lora_dropout,
            autocast=request.autocast,
            residual_elem=residual_elem,
        )
        for shape, layer in zip(shapes, adapted)
    )
    # a head wider than the compute dtype is cast for its matmul: autocast's copy of all of it,
    # or TRL's of one vocabulary tile at a time
    if trl_fused_head:  # its own tiles, whatever loss_chunk_tokens says
        loss, loss_chunk_tokens = trl_head.footprint_bytes(tokens, hidden, elem, residual_elem), None
        head_cast = trl_head.VOCAB_TILE * hidden * elem if residual_elem != elem else 0
    else:
        loss = LOSS_LOGIT_COPIES * (min(tokens, loss_chunk_tokens) if loss_chunk_tokens else tokens) * vocab * 4
        head_cast = vocab * hidden * elem if request.autocast and residual_elem != elem else 0
    loss += head_cast
    max_layer = max(sizes)
    # everything but the slots; gradients are counted for the whole step (they outlive
    # backward when gradients accumulate over micro-batches)
    fixed = resident + lora_bytes + lora_grads + optimizer + boundary + max(loss + head_copy, working)

    slots_auto = slots == AUTO
    if slots_auto:
        # what StreamConfig(slots="auto") takes, with the room the budget leaves the slots
        slots = auto_slots(vram_bytes - reserve_bytes - fixed, max_layer)
    peak = fixed + slots * max_layer
    if backward_slots == AUTO:
        backward_slots = backward_slot_count(loss + head_copy, working, lora_bytes, max_layer, len(sizes), slots)
    else:
        backward_slots = usable_backward_slots(backward_slots, len(sizes), slots)
    copied_layers, copied_bytes = _copies(sizes, slots, backward_slots)
    copied_bytes += ends_copies
    store = sum(sizes)
    loader_store = loader_arena_bytes(sizes, request.arena_bytes)
    # transformers' own load (then stream_model) dequantises experts layerstream's loader keeps in MXFP4
    loaded_sizes = sizes
    if any(shape.dequantised for shape in shapes):
        loaded_sizes = layer_bytes(mxfp4.dequantised_config(config), quantization, residual_dtype, request.double_quant)
    loaded_store, loaded_layer = sum(loaded_sizes), max(loaded_sizes)
    unquantised = max(layer_bytes(config, "none", dtype)) if quantization != "none" else max_layer

    notes = plan_notes(shapes, adapted, lora_targets, quantization)
    eager = eager_scores_bytes(config, batch, seq, elem)
    if eager:
        notes.append(
            f"{model_type}'s attention runs eager in transformers (no SDPA path): each layer's "
            f"recompute also keeps its attention scores, about {eager / GiB:.2f} GiB at batch {batch} "
            f"x {seq} tokens, which this plan does not count yet (not measured on a GPU): keep that "
            "much more of the budget free"
        )

    return MemoryPlan(
        model_type=model_type,
        num_layers=len(sizes),
        seq=seq,
        batch=batch,
        quantization=quantization,
        dtype=str(dtype).removeprefix("torch."),
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        layer_bytes=sizes,
        max_layer_bytes=max_layer,
        host_store_bytes=store,
        resident_bytes=resident,
        lora_params=lora_params,
        lora_bytes=lora_bytes,
        lora_grad_bytes=lora_grads,
        optimizer_bytes=optimizer,
        slots=slots,
        slots_auto=slots_auto,
        slot_bytes=slots * max_layer,
        backward_slots=backward_slots,
        boundary_bytes=boundary,
        layer_working_bytes=working,
        loss_bytes=loss,
        peak_vram_bytes=peak,
        vram_bytes=vram_bytes,
        reserve_bytes=reserve_bytes,
        # stream_model copies the loaded layers into its arenas one at a time (each
        # layer's own memory is freed once it is copied) and page-locks afterwards, so
        # at the peak the store and one loaded layer (or one embedding matrix, copied into
        # the ends' store the same way) coexist; embeddings, head and adapters are on the
        # host too until model.to(device)
        host_ram_bytes=loaded_store + max(loaded_layer, end_matrix) + all_resident + lora_bytes + activation_host,
        host_steady_bytes=loaded_store + ends_host + activation_host,
        # from_pretrained loads the resident part, then one layer at a time (unquantised,
        # then packed); PEFT's adapters come after loading, on the host until .to(device)
        loader_store_bytes=loader_store,
        loader_ram_bytes=loader_store + all_resident + max(unquantised, lora_bytes, end_matrix) + activation_host,
        layers_copied_per_step=copied_layers,
        copy_bytes_per_step=copied_bytes,
        bandwidth_gbps=float(request.bandwidth_gbps),
        copy_seconds_per_step=copied_bytes / (request.bandwidth_gbps * 1e9),
        fits=peak + reserve_bytes <= vram_bytes,
        notes=notes,
        stream_embeddings=stream_embeddings,
        head_copy_bytes=head_copy,
        ends_host_bytes=ends_host,
        ends_copy_bytes_per_step=ends_copies,
        offload_activations=offload_activations,
        activation_host_bytes=activation_host,
        loss_chunk_tokens=loss_chunk_tokens,
        mlp_tile_tokens=mlp_tile_tokens,
        trl_fused_head=trl_fused_head,
        adapter_dtype=str(adapter_dtype).removeprefix("torch."),
        vocab_size=vocab,
        residual_dtype=str(residual_dtype).removeprefix("torch.") if residual_elem != elem else None,
        head_cast_bytes=head_cast,
    )


def _other_head(config, residual_dtype, stream_embeddings, outputs: int, resident: int, all_resident: int) -> tuple:
    """(resident, all resident, ends' host store, the end matrix copied as they move) of a
    model whose head is not the causal LM's that the config builds: its own ``outputs``-wide
    head instead of the vocabulary-wide one (a tied one took nothing of its own), and only the
    embedding streams (``find_ends`` finds no output embeddings)."""
    shape = model_shape(config, residual_dtype)
    lm_head = 0 if shape.tied else shape.head.nbytes
    own_head = int(config.hidden_size) * outputs * parse_dtype(residual_dtype).itemsize
    # streamed, ``resident`` holds neither the embedding nor an untied causal head already
    resident += own_head if stream_embeddings else own_head - lm_head
    if not stream_embeddings:
        return resident, all_resident + own_head - lm_head, 0, 0
    embedding = shape.embedding.nbytes
    return resident, all_resident + own_head - lm_head, region_bytes([embedding]), embedding


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"
