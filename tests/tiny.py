"""Tiny random-weight causal LMs of every supported family, and a training harness
that runs the same steps on a streamed and a resident copy of one model."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import layerstream

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral"]

_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_EXTRA = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "mistral": dict(sliding_window=8),
    "gemma2": dict(sliding_window=8),
    "gemma3_text": dict(sliding_window=8),
}


def routed_design(family: str, experts: int) -> dict:
    """tiny_model's overrides for the routed-expert designs of recent mixtures, ``experts``
    experts with 2 chosen per token and every layer routed: shared experts beside the routed
    ones (GLM-4.5, DeepSeek-V3 with its latent attention, dots.llm1), Qwen3-Next's linear
    attention beside full attention, ERNIE-4.5's frozen expert-score bias, Granite-MoE."""
    grouped = dict(
        n_routed_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
    )
    designs = {
        "glm4_moe": dict(grouped, partial_rotary_factor=0.5),
        "deepseek_v3": dict(
            grouped,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,  # latent attention: as many as the heads
        ),
        "dots1": grouped,
        "qwen3_next": dict(
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            full_attention_interval=2,
        ),
        "granitemoe": dict(num_local_experts=experts, num_experts_per_tok=2),
        "ernie4_5_moe": dict(moe_num_experts=experts, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=0),
    }
    return designs[family]


def tiny_config(family: str = "llama", layers: int = 5, **overrides):
    values = dict(_COMMON, num_hidden_layers=layers, **_EXTRA.get(family, {}))
    values.update(overrides)
    return AutoConfig.for_model(family, **values)


def tiny_model(
    family: str = "llama", layers: int = 5, seed: int = 0, dtype=torch.float32, attn: Optional[str] = None, **overrides
):
    torch.manual_seed(seed)
    config = tiny_config(family, layers, **overrides)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.to(dtype)


# twice tiny_model's widths: the checkpoints that are quantised to NF4 or split into shards
WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)


def save_model_of(config, directory, dtype=torch.float32, seed: int = 0, shard: Optional[str] = None, **kwargs) -> Path:
    """The one way the tests write a tiny checkpoint: ``config``'s model with seeded random
    weights in ``dtype``, as transformers' ``save_pretrained`` writes it (``kwargs``: the
    model's, e.g. ``attn_implementation``). ``shard``: a ``max_shard_size`` that splits it
    into several shards with an index (checked: more than two)."""
    directory = Path(directory)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **kwargs).to(dtype)
    model.save_pretrained(directory, **({} if shard is None else {"max_shard_size": shard}))
    if shard is not None:
        assert len(list(directory.glob("*.safetensors"))) > 2, "the test needs several shards"
    return directory


def save_tiny(
    directory,
    family: str = "llama",
    layers: int = 5,
    dtype=torch.float32,
    wide: bool = False,
    shard: Optional[str] = None,
    **overrides,
) -> Path:
    """A tiny model's checkpoint on disk (``tiny_model(family, layers, dtype=dtype,
    **overrides)``'s weights, ``WIDE`` widths where ``wide``), through ``save_model_of``."""
    config = tiny_config(family, layers, **(WIDE if wide else {}), **overrides)
    return save_model_of(config, directory, dtype=dtype, shard=shard)


# gpt-oss's published config.json states its MXFP4 quantisation so (openai/gpt-oss-20b, -120b)
MXFP4_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def save_mxfp4_gpt_oss(
    directory, layers: int = 3, seed: int = 0, scales=(114, 122), experts: int = 4, **overrides
) -> Path:
    """A tiny gpt-oss checkpoint as gpt-oss is published: every tensor in bf16 but the expert
    projections, which are MXFP4. Each projection ``[experts, in, out]`` is stored transposed
    as ``*_blocks`` (uint8 ``[experts, out, in / 32, 16]``: 32 FP4 values per block, two per
    byte, any byte a valid pair) and ``*_scales`` (uint8 ``[experts, out, in / 32]``: one E8M0
    exponent per block, biased by 127; drawn from ``scales``, both ends included, so values are
    at most 6 x 2^-5, of the size of the other weights: larger experts would drown attention's
    share of the residual stream in bf16 rounding, and a test could not see it), and
    config.json has a ``quantization_config`` as published. The blocks and scales are seeded
    random bytes; the other weights ``save_model_of``'s."""
    values = dict(WIDE, num_local_experts=experts, num_experts_per_tok=2, sliding_window=8)
    config = tiny_config("gpt_oss", layers, **{**values, **overrides})
    directory = save_model_of(config, directory, dtype=torch.bfloat16, seed=seed)
    return mxfp4_experts(directory, seed, scales)


def mxfp4_experts(directory, seed: int = 0, scales=(114, 122)) -> Path:
    """A gpt-oss checkpoint saved by ``save_pretrained`` (one file) made MXFP4 as published:
    its expert projections replaced by seeded random blocks and scales (see
    ``save_mxfp4_gpt_oss``) and an MXFP4 ``quantization_config`` in config.json."""
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        blocks = (experts, outputs, inputs // 32)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (*blocks, 16), dtype=torch.uint8, generator=generator)
        tensors[f"{name}_scales"] = torch.randint(
            scales[0], scales[1] + 1, blocks, dtype=torch.uint8, generator=generator
        )
    save_file(tensors, path, metadata={"format": "pt"})
    saved = json.loads((directory / "config.json").read_text())
    saved["quantization_config"] = dict(MXFP4_QUANTIZATION)
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    return directory


def lora_config(**overrides) -> LoraConfig:
    # init_lora_weights=False: LoRA B starts non-zero, so LoRA paths change the output
    values = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    values.update(overrides)
    return LoraConfig(**values)


def batch(vocab: int = 96, size: int = 2, seq: int = 12, seed: int = 1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (size, seq), generator=gen)
    return ids.to(device)


@dataclass
class Trace:
    losses: List[torch.Tensor] = field(default_factory=list)
    logits: List[torch.Tensor] = field(default_factory=list)
    grads: List[Dict[str, torch.Tensor]] = field(default_factory=list)


def train_steps(
    model,
    steps: int,
    device="cpu",
    seq: int = 12,
    accumulation: int = 1,
    lr: float = 1e-2,
    batch_size: int = 2,
    autocast: Optional[torch.dtype] = None,
) -> Trace:
    """AdamW on the trainable tensors; records loss, logits and every gradient per step.

    ``autocast`` wraps each forward (not backward or the optimizer step), as the Trainer
    does: one autocast context across optimizer steps would reuse its cached casts of
    the adapters after the optimizer changed them."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    trace = Trace()
    model.train()
    vocab = model.config.vocab_size
    for step in range(steps):
        for micro in range(accumulation):
            ids = batch(vocab, size=batch_size, seq=seq, seed=100 * step + micro, device=device)
            with torch.autocast(
                torch.device(device).type, dtype=autocast or torch.bfloat16, enabled=autocast is not None
            ):
                out = model(input_ids=ids, labels=ids)
            (out.loss / accumulation).backward()
        trace.losses.append(out.loss.detach().cpu())
        trace.logits.append(None if out.logits is None else out.logits.detach().cpu())  # a chunked loss has none
        trace.grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return trace


def assert_traces_equal(a: Trace, b: Trace) -> None:
    assert len(a.losses) == len(b.losses)
    for step, (la, lb) in enumerate(zip(a.losses, b.losses)):
        assert torch.equal(la, lb), f"loss differs at step {step}: {la} vs {lb}"
        assert (a.logits[step] is None) == (b.logits[step] is None), f"logits at step {step}"
        if a.logits[step] is not None:
            assert torch.equal(a.logits[step], b.logits[step]), f"logits differ at step {step}"
        assert a.grads[step].keys() == b.grads[step].keys()
        for name in a.grads[step]:
            assert torch.equal(a.grads[step][name], b.grads[step][name]), f"gradient of {name} differs at step {step}"


def peft_pair(family="llama", layers=5, dtype=torch.float32, attn=None, lora=None, **model_overrides):
    """Two identical PEFT models (non-zero LoRA B): one to stream, one resident."""
    base = tiny_model(family, layers, dtype=dtype, attn=attn, **model_overrides)
    resident = get_peft_model(copy.deepcopy(base), lora_config(**(lora or {})))
    streamed = get_peft_model(base, lora_config(**(lora or {})))
    streamed.load_state_dict(resident.state_dict())
    return streamed, resident


def stream(model, device="cpu", **config):
    """Stream ``model`` the way the tests of the streaming machinery need it: two slots, no
    VRAM budget unless one is given (on a GPU a tiny model would otherwise move into the
    resident window whole after its first step and stream no more), and the long-sequence
    settings off unless given (under the small budgets some tests give, "auto" would turn
    them on, and the parity tests compare with the plain model)."""
    config.setdefault("slots", 2)
    config.setdefault("prefetch", 1)
    config.setdefault("vram_budget", None)
    config.setdefault("offload_activations", False)
    config.setdefault("loss_chunk_tokens", None)
    config.setdefault("mlp_tile_tokens", None)
    config.setdefault("stream_embeddings", False)  # "auto" streams them under a small budget
    layerstream.stream_model(model, device=device, **config)
    return model.to(device)


def scale_mlp_outputs(model):
    """A trainable scale on each MLP's output: an op after the MLP that saves its input, as
    a norm on the MLP's output does (Gemma's post-feedforward norm), so a checkpoint's
    recompute runs the MLP again."""
    from layerstream.modules.discovery import find_decoder_layers

    for layer in find_decoder_layers(model)[1]:
        mlp = layer.mlp
        mlp.out_scale = torch.nn.Parameter(torch.full((1,), 1.5))
        mlp.register_forward_hook(lambda module, args, out: out * module.out_scale)
    return model


def nf4_pair(
    tmp_path,
    family="llama",
    layers=5,
    dtype=torch.bfloat16,
    nested=True,
    device="cpu",
    compute_dtype=None,
    **model_overrides,
):
    """A streamed and a resident QLoRA model loaded from the same files by transformers
    with BitsAndBytesConfig (NF4), each wrapped by PEFT (lora.Linear4bit), same adapters.
    The weights are quantised from ``dtype`` and computed in ``compute_dtype`` (default
    ``dtype``).

    Both are quantised on the host, so their packed bytes are identical; on CUDA the
    resident one is then moved to the GPU (the streamed one still needs ``stream``)."""
    from transformers import BitsAndBytesConfig

    directory = tmp_path / f"{family}-{layers}-{str(dtype)[6:]}-{nested}"
    if not directory.exists():
        save_tiny(directory, family, layers, dtype=dtype, wide=True, **model_overrides)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_compute_dtype=compute_dtype or dtype,
    )

    def load():
        return AutoModelForCausalLM.from_pretrained(directory, quantization_config=quant, dtype=dtype, device_map="cpu")

    resident = get_peft_model(load(), lora_config())
    streamed = get_peft_model(load(), lora_config())
    adapters = {k: v for k, v in resident.state_dict().items() if "lora_" in k}
    streamed.load_state_dict(adapters, strict=False)
    if device != "cpu":
        resident.to(device)
    return streamed, resident


def portable_cpu_nf4(model):
    """bitsandbytes repacks CPU 4-bit weights in place for AVX512-BF16 inference; a streamed
    weight cannot be rewritten, so a resident reference must run the portable CPU path too."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def nearest_valid_victim(self, needed_at, position, phase, keep, target=None):
    """An eviction policy that is valid (never evicts a layer needed before the one being
    fetched) but differs from the planner's: it takes the owner needed soonest. Layers
    then come back into other slots in backward than they had in forward."""
    best_slot, best_distance = None, None
    for slot in self._candidates(phase, target):
        owner = self.owner[slot]
        if owner is None:
            return slot
        if owner in keep:
            continue
        distance = self._distance(owner, position, phase)
        if distance > needed_at and (best_distance is None or distance < best_distance):
            best_slot, best_distance = slot, distance
    return best_slot


def corrupt_copies(runtime, source_for):
    """Negative controls: make the slot pool copy ``source_for(layer, slot)`` (a host region,
    or None for the layer's own) instead of the layer's bytes."""
    pool = runtime.pool
    original = pool.load

    def load(record, slot, compute=None, source=None):
        return original(record, slot, compute, source_for(record.index, slot))

    pool.load = load


def data_parallel_losses(model, steps: int = 4, global_batch: int = 4, rank: int = 0, world: int = 1, device="cpu"):
    """AdamW steps on this rank's share of each global batch; the losses averaged over the
    ranks (an all-reduce when ``world`` > 1), so one process and several compare directly."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step in range(steps):
        ids = batch(96, size=global_batch, seq=10, seed=step).to(device)
        share = global_batch // world
        mine = ids[rank * share : (rank + 1) * share]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
    return losses


def trainer_losses(model, out, steps=4, accumulation=1, callbacks=(), seq=12, vocab=90):
    """The HF Trainer's logged losses over ``steps`` steps of batch 2 (``accumulation``
    micro-batches each), on rows of ``seq`` tokens below ``vocab``, writing to ``out``."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = [[3 + (i * 7 + j) % vocab for j in range(seq)] for i in range(64)]
    data = Dataset.from_list([{"input_ids": row, "labels": row} for row in rows])
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        report_to=[],
        max_steps=steps,
        logging_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation,
        save_strategy="no",
        learning_rate=1e-2,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]
