"""One decoder layer's activation memory while backward recomputes and differentiates it:
the largest of its phases, the MLP's backward and attention's (and an untiled norm's).

Why phases: a checkpointed layer's backward first recomputes the layer, keeping what
autograd saves, then differentiates the MLP, then attention. The saved tensors of
attention are alive through both phases; the MLP's working set and attention backward's
temporaries never coexist, so adding them would count memory no moment holds (a third
too much for an 8B NF4 step under TRL's sft.py at long lengths). The allocator traces
behind these terms are in ``benchmarks/results/long-context/trace-*``; ``docs/plan.md``
has the measured peaks they are checked against.

Per token, what an allocation trace of that step shows alive (hidden ``h``, compute dtype
of ``e`` bytes, query and key/value widths ``q`` and ``kv``):

- attention's saved tensors, alive in both phases: q and k after the rotary embedding, v
  and the attention output, ``(2q + 2kv) e``; what each LoRA-adapted attention projection
  keeps (``lora_saved_bytes``); the norms: their float32 input copies untiled, or with the
  norms tiled (``long/tiled_norm``) the second norm's input in its own dtype (the first
  one's input is the layer's input, a boundary state);
- the MLP's phase adds the MLP's input (its second norm's output, which the tiled MLP
  keeps), its input gradient, the gradient arriving from the next layer (``3 h e``), and
  the MLP's activations for the tokens it holds at once (one tile when tiled): gate, up,
  the activation, the gated product and the LoRA inputs, and in a tile its down
  projection's output while the tile runs;
- attention's phase drops the second norm's saved input and what the output projection's
  adapter kept (both are differentiated before attention), and adds attention backward's
  temporaries (``attention_backward_bytes_per_token``) and the residual stream's gradient;
- between the two, the second norm's backward beside attention's saved tensors: untiled,
  float32 temporaries of tokens x hidden (``NORM_BACKWARD_WIDTHS`` of them), at long
  sequences the largest phase; tiled, the gradients arriving and the input gradients it
  hands back whole (``tiled_norm_reads``), which a float32 residual stream makes as large
  as the MLP's phase.

Per layer, NF4 projections keep their dequantised weight for the input gradient (all of
them in the MLP's phase, the attention projections' in attention's; a tiled MLP dequantises
its three once for all tiles and holds them through the tiles, ``modules/nf4_dense``,
within this count), and Parameters adapted
through PEFT's ParamWrapper keep the merged weight. Pure arithmetic: no CUDA.
"""

from __future__ import annotations

from typing import Optional

from ..modules.discovery import on_mlp_side
from .lora import LoraTargets
from .shapes import LayerShape, _attention_dims, _num_experts, _text_config

# the MLP's activations alive at its phase's peak, in mlp_width tensors per token: gate,
# up, the activation and the gated product (backward's gradients replace them as it goes)
MLP_WIDTHS = 4
# a tiled MLP's tile also holds its down projection's output while the tile runs, in
# hidden-wide tensors: the base output, PEFT's clone of it, the adapter's scaled output and
# the sum (an allocator trace of a 4,096-token tile: 0.821 GiB; this count: 0.820 GiB)
TILE_OUTPUT_WIDTHS = 4
# an untiled RMSNorm's backward makes float32 tensors of tokens x hidden beside its saved
# float32 input (the gradient through the scale, the normalised input, their product, the
# upcast's gradient): this many at once
NORM_BACKWARD_WIDTHS = 4
# a tiled norm's backward holds, for the tile it differentiates, the tile's recompute and
# its backward's float32 temporaries: this many float32 widths a tile token (a CPU trace of a
# float32 residual stream: 6 MiB more at tiles of 512 x 512, results/cpu/step-trace/)
NORM_TILE_WIDTHS = 6


def lora_saved_bytes(
    in_features: int,
    elem: int,
    adapter_elem: int,
    dropout: bool,
    autocast: bool,
    four_bit: bool = False,
    in_elem: Optional[int] = None,
    recomputed: bool = False,
) -> int:
    """Per token, what one LoRA-adapted projection keeps for backward beyond the base layer.

    ``lora_A`` keeps its input: the dropout's output when ``lora_dropout`` is above 0, plus
    the dropout's mask (a byte an element on CUDA). What that input is depends on PEFT's
    cast to the adapter's dtype: a plain projection casts whenever the dtypes differ, and
    under autocast the matmul casts back to the compute dtype (that copy is what is kept);
    a 4-bit projection (PEFT's bitsandbytes layer) does not cast under autocast at all.
    With neither a cast nor dropout the adapter keeps the projection's own input, which is
    counted once per input elsewhere, so nothing here; but an input wider than the compute
    dtype (``in_elem``: a float32 residual stream) gets autocast's own copy in each adapter.

    ``recomputed``: the dropout and ``lora_A`` run again in backward (``long/adapter_inputs``,
    the attention's adapters where the MLP is tiled), keeping only what they received: the
    projection's own input (counted elsewhere, as without dropout), or PEFT's cast of it;
    not a cast to wider adapters under autocast, which would keep more than it frees."""
    in_elem = elem if in_elem is None else in_elem
    cast = adapter_elem != in_elem and (not autocast or not four_bit)
    received = adapter_elem if cast else in_elem  # what the dropout and lora_A receive
    # a 16-bit projection's input wider than its weight under autocast stays as PEFT keeps it
    # (long/adapter_inputs: it is taken for PEFT's cast to wider adapters)
    if recomputed and dropout and not (autocast and not four_bit and received > elem):
        return in_features * received if cast else 0
    kept = elem if autocast else received
    if dropout:
        return in_features * (kept + 1)
    if autocast and received != elem:
        return in_features * elem
    return in_features * kept if cast else 0


def attention_backward_bytes_per_token(q_dim: int, kv_dim: int, elem: int) -> int:
    """Per token, what the CUDA attention kernels' backward (flash, memory-efficient)
    allocates beside the saved tensors: a float32 accumulator of dq, dq itself, the
    incoming gradient of the attention output, dk and dv, and under GQA dk and dv at the
    query heads' width before they are summed down to the key heads."""
    expanded = 2 * q_dim * elem if kv_dim != q_dim else 0
    return 4 * q_dim + (2 * q_dim + 2 * kv_dim) * elem + expanded


def norms_are_tiled(mlp_tiled: bool) -> bool:
    """Whether a layer's norms run tiled (``long/tiled_norm``): along with the MLP's tiles."""
    return mlp_tiled


def adapter_inputs_recomputed(mlp_tiled: bool) -> bool:
    """Whether the attention adapters' dropout runs again in backward, keeping only their
    inputs (``long/adapter_inputs``): along with the MLP's tiles."""
    return mlp_tiled


def tiled_norm_reads(residual_elem: int) -> int:
    """How many input gradients a tiled norm's backward hands autograd whole, one per
    operation of the norm that reads its input: a 16-bit input only through the upcast, a
    float32 one by an RMSNorm's square and its scale."""
    return 2 if residual_elem >= 4 else 1


def layer_phase_bytes(
    config,
    shape: LayerShape,
    adapted: LoraTargets,
    tokens: int,
    elem: int,
    dequantised: bool = False,
    mlp_tile_tokens: Optional[int] = None,
    adapter_elem: int = 4,
    lora_dropout: bool = False,
    autocast: bool = False,
    residual_elem: Optional[int] = None,
) -> dict:
    """Activation bytes of each phase of one layer's backward at ``tokens`` tokens: the
    MLP's, attention's and the second norm's.

    Args:
        elem: bytes per element of the compute dtype.
        dequantised: NF4 layers in training (their projections keep dequantised weights).
        mlp_tile_tokens: the sequence-tiled MLP's tile (dense layers), which also tiles the
            layers' norms.
        adapter_elem, lora_dropout, autocast: the adapters' bytes per element, whether
            their dropout is above 0, and whether the step runs under autocast: together
            what each adapted projection keeps (``lora_saved_bytes``).
        residual_elem: bytes per element of the residual stream where it is wider than the
            compute dtype (None: ``elem``). A float32 residual stream (peft's
            ``prepare_model_for_kbit_training``) keeps the norms float32, makes
            the MLP's input, its gradients and (bitsandbytes returning its input's dtype)
            the MLP's activations float32, while autocast runs attention and keeps the
            adapters' inputs in ``elem``: a CPU allocation trace of that step
            (``docs/plan.md``) shows those dtypes.
    """
    config = _text_config(config)
    hidden, heads, kv_heads, head_dim = _attention_dims(config)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    residual = elem if residual_elem is None else residual_elem
    attention_elem = elem if autocast else residual  # autocast casts q, k and v for attention
    # bitsandbytes returns its input's dtype; autocast's matmuls (an MoE's expert stacks) its own
    mlp_elem = residual if (dequantised and not shape.sparse) or not autocast else elem
    tiled = bool(mlp_tile_tokens) and not shape.sparse
    norms_tiled = norms_are_tiled(tiled)

    def input_elem(lin) -> int:
        """The dtype of a projection's input: the output projection's is attention's, the
        down projection's the MLP's activations, the others' a norm's output."""
        if lin is output_projection:
            return attention_elem
        return mlp_elem if lin is down_projection else residual

    def kept(lin) -> int:
        four_bit = dequantised and lin.quantised
        recomputed = adapter_inputs_recomputed(tiled) and not on_mlp_side(lin.name)
        return lora_saved_bytes(
            lin.in_features,
            elem,
            adapter_elem,
            lora_dropout,
            autocast,
            four_bit,
            in_elem=input_elem(lin),
            recomputed=recomputed,
        )

    attention_linears = [lin for lin in adapted.linears if not on_mlp_side(lin.name)]
    mlp_linears = [lin for lin in adapted.linears if on_mlp_side(lin.name)]
    # the output projection is the attention module's last linear (its input is attention's
    # output), whichever of them LoRA adapts
    layer_attention = [lin for lin in shape.linears if not on_mlp_side(lin.name)]
    output_name = layer_attention[-1].name if len(layer_attention) > 1 else None
    output_projection = next((lin for lin in attention_linears if lin.name == output_name), None)
    # the MLP's projection from its width back to hidden (a dense MLP's last)
    down_projection = next((lin for lin in reversed(mlp_linears) if lin.in_features == shape.mlp_width), None)
    # the adapters of q, k and v keep the first norm's output itself (no dropout, no cast, no
    # autocast copy of a wider input): once for the three
    first_inputs = [lin for lin in attention_linears if lin is not output_projection]
    raw_input = bool(first_inputs) and kept(first_inputs[0]) == 0

    saved = (2 * q_dim + 2 * kv_dim) * attention_elem + sum(kept(lin) for lin in attention_linears)
    if shape.qk_norm:
        saved += 4 * (q_dim + kv_dim)
    if raw_input:
        saved += hidden * residual  # the first norm's output, kept once for q, k and v
    second_norm = hidden * residual if norms_tiled else 4 * hidden
    # an untiled norm keeps its float32 upcast of the input: a copy unless it is float32
    first_norm_copy = 4 * hidden if not norms_tiled and residual < 4 else 0
    saved += second_norm + first_norm_copy

    mlp_per_token = MLP_WIDTHS * shape.mlp_width * mlp_elem + sum(kept(lin) for lin in mlp_linears)
    if lora_dropout and autocast and mlp_linears:
        # the adapter running at the peak holds its dropout's output in the input's dtype
        # until autocast's copy of it replaces it
        mlp_per_token += max(lin.in_features * max(0, input_elem(lin) - elem) for lin in mlp_linears)
    if tiled:  # the down projection's output, PEFT's clone and the sum; the adapter's output
        mlp_per_token += (TILE_OUTPUT_WIDTHS - 1) * hidden * mlp_elem + hidden * elem
    mlp_tokens = min(tokens, mlp_tile_tokens) if tiled else tokens
    mlp_phase_per_token = saved + 3 * hidden * residual
    if shape.sparse:
        mlp_phase_per_token += 2 * shape.top_k * hidden * residual + 2 * 4 * _num_experts(config)
    attention_phase_per_token = (
        saved
        - second_norm
        - (kept(output_projection) if output_projection is not None else 0)
        + attention_backward_bytes_per_token(q_dim, kv_dim, attention_elem)
        + hidden * residual
    )

    merged = sum(param.numel for param in adapted.params) * residual  # stacks and routers: not 4-bit
    attention_weights = mlp_weights = 0
    if dequantised:
        for lin in shape.linears:
            if lin.quantised:
                size = lin.in_features * lin.out_features * elem
                mlp_weights += size
                attention_weights += 0 if on_mlp_side(lin.name) else size
    # packed MXFP4 experts: the call's dequantised stacks, alive through the MLP's backward
    mlp_phase = tokens * mlp_phase_per_token + mlp_tokens * mlp_per_token + merged + mlp_weights + shape.dequantised
    attention_phase = tokens * attention_phase_per_token + attention_weights
    if norms_tiled:
        # the second norm's backward: the gradient arriving at its output, the residual
        # branch's, and its input gradients, each of the whole length
        reads = tiled_norm_reads(residual)
        norm_tile = mlp_tokens * NORM_TILE_WIDTHS * 4 * hidden
        norm_phase = tokens * (saved + (2 + reads) * hidden * residual) + norm_tile + attention_weights
    else:
        # an untiled norm's backward, the second norm's between the MLP's phase and
        # attention's: its float32 temporaries beside attention's saved tensors and two gradients
        norm_phase = tokens * (saved + NORM_BACKWARD_WIDTHS * 4 * hidden + 2 * hidden * elem) + attention_weights
    return {"mlp": mlp_phase, "attention": attention_phase, "norm": norm_phase}


def layer_working_bytes(*args, **kwargs) -> int:
    """Activation bytes of one layer's backward: the largest of its phases
    (``layer_phase_bytes``, which takes the same arguments)."""
    return max(layer_phase_bytes(*args, **kwargs).values())
