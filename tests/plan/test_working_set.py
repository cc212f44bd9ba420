"""What a LoRA-adapted projection keeps for backward, as the planner counts it
(``plan/working_set.lora_saved_bytes``), against what PEFT's layers really save; and the
runtime handing the planner what the model's adapters and the step are."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import bnb as peft_bnb
from torch import nn

from layerstream.api import get_runtime
from layerstream.long import adapter_inputs
from layerstream.plan import make_plan, model_plan_request
from layerstream.plan.working_set import lora_saved_bytes
from layerstream.runtime import long_settings

from tiny import peft_pair, stream, tiny_model

TOKENS, IN, OUT = 16, 64, 48
LLAMA3_8B = Path(__file__).resolve().parents[2] / "configs" / "shapes" / "llama-3.1-8b.json"


class _Projection(nn.Module):
    def __init__(self, four_bit: bool):
        super().__init__()
        if four_bit:
            import bitsandbytes as bnb

            self.proj = bnb.nn.Linear4bit(IN, OUT, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            self.proj.weight = bnb.nn.Params4bit(
                torch.randn(OUT, IN, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4"
            ).to("cpu")
            self.is_loaded_in_4bit = True  # what makes PEFT pick its bitsandbytes layer
        else:
            self.proj = nn.Linear(IN, OUT, bias=False, dtype=torch.bfloat16)


class _TorchSeeingAutocast:
    """torch, as PEFT's bitsandbytes layer sees it, with CUDA's autocast state given."""

    def __init__(self, enabled: bool):
        self._enabled = enabled

    def is_autocast_enabled(self, *args):
        return self._enabled

    def __getattr__(self, name):
        return getattr(torch, name)


def _cuda_dropout(input, p=0.5, training=True, inplace=False):
    """CUDA's fused dropout, which keeps a bool mask (the CPU's keeps one in the input's
    dtype): the planner plans GPU steps."""
    return torch.native_dropout(input, p, training)[0] if training and p > 0 else input


def _saved_by_the_adapter(
    adapter_dtype,
    dropout: float,
    autocast: bool,
    four_bit: bool,
    monkeypatch,
    input_dtype=torch.bfloat16,
    recomputed: bool = False,
) -> int:
    """Bytes of the (tokens x in) tensors autograd saves in one adapted projection's
    forward, the input itself not counted (it is the layer's, not the adapter's)."""
    torch.manual_seed(0)
    model = get_peft_model(_Projection(four_bit), LoraConfig(r=4, target_modules=["proj"], lora_dropout=dropout))
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter_dtype)
    if recomputed and dropout:  # as long/adapter_inputs sets up an attention adapter
        proj = model.base_model.model.proj
        adapter_inputs.recompute(
            proj.lora_dropout["default"], proj.lora_A["default"], TOKENS // 2, proj.base_layer, proj
        )
    x = torch.randn(TOKENS, IN, dtype=input_dtype, requires_grad=True)
    saved = {}

    def pack(tensor):
        if tuple(tensor.shape) == (TOKENS, IN) and tensor.data_ptr() != x.data_ptr():
            saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
        return tensor

    monkeypatch.setattr(nn.functional, "dropout", _cuda_dropout)
    # PEFT's 4-bit layer asks torch.is_autocast_enabled() (CUDA's) whether to cast; CUDA's
    # autocast is emulated by answering yes under the CPU's own autocast, to that module
    # alone (torch.autocast itself saves and restores that state: patched globally, it leaks)
    monkeypatch.setattr(peft_bnb, "torch", _TorchSeeingAutocast(autocast))
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()
        model.base_model.model.proj(x)
    monkeypatch.undo()
    return sum(saved.values())


@pytest.mark.parametrize("four_bit", [False, True], ids=["plain", "nf4"])
@pytest.mark.parametrize("autocast", [False, True], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.05], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_what_a_lora_projection_keeps_is_what_the_plan_counts(adapter_dtype, dropout, autocast, four_bit, monkeypatch):
    measured = _saved_by_the_adapter(adapter_dtype, dropout, autocast, four_bit, monkeypatch)
    adapter_elem = torch.empty((), dtype=adapter_dtype).element_size()
    assert measured == TOKENS * lora_saved_bytes(IN, 2, adapter_elem, dropout > 0, autocast, four_bit)


# a bf16 projection takes a float32 input only under autocast (or as 4-bit)
_INPUTS = [
    (autocast, four_bit, input_dtype)
    for autocast in (False, True)
    for four_bit in (False, True)
    for input_dtype in (torch.bfloat16, torch.float32)
    if not (input_dtype == torch.float32 and not autocast and not four_bit)
]


@pytest.mark.parametrize("autocast, four_bit, input_dtype", _INPUTS)
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_adapter_whose_dropout_is_drawn_again_keeps_what_the_plan_counts(
    adapter_dtype, autocast, four_bit, input_dtype, monkeypatch
):
    """Its input only: nothing beyond the projection's own, or PEFT's cast of it; a cast to
    wider adapters under autocast stays as PEFT keeps it (the cast would keep more)."""
    measured = _saved_by_the_adapter(adapter_dtype, 0.05, autocast, four_bit, monkeypatch, input_dtype, True)
    adapter_elem = torch.empty((), dtype=adapter_dtype).element_size()
    in_elem = torch.empty((), dtype=input_dtype).element_size()
    planned = lora_saved_bytes(IN, 2, adapter_elem, True, autocast, four_bit, in_elem=in_elem, recomputed=True)
    assert measured == TOKENS * planned
    assert measured <= _saved_by_the_adapter(adapter_dtype, 0.05, autocast, four_bit, monkeypatch, input_dtype)


@pytest.mark.parametrize("autocast", [False, True], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.05], ids=["no-dropout", "dropout"])
def test_a_float32_input_keeps_what_the_plan_counts(dropout, autocast, monkeypatch):
    """peft's prepare_model_for_kbit_training makes the norms' outputs, which q, k, v, gate
    and up take, float32 beside float32 adapters and a bf16 compute dtype: under autocast
    each adapter keeps its own bf16 copy (and the mask), without it the float32 input."""
    measured = _saved_by_the_adapter(torch.float32, dropout, autocast, True, monkeypatch, input_dtype=torch.float32)
    assert measured == TOKENS * lora_saved_bytes(IN, 2, 4, dropout > 0, autocast, True, in_elem=4)
    if autocast and not dropout:  # the control: counted as a bf16 input, it would be nothing
        assert measured == TOKENS * IN * 2 != TOKENS * lora_saved_bytes(IN, 2, 4, False, True, True)


def test_the_count_tells_dropout_a_cast_and_the_layer_kind_apart(monkeypatch):
    """The control: a count that ignored dropout, the cast or the layer kind would miss
    what PEFT keeps."""
    with_dropout = _saved_by_the_adapter(torch.bfloat16, 0.05, True, True, monkeypatch)
    assert with_dropout == TOKENS * IN * 3 != TOKENS * lora_saved_bytes(IN, 2, 2, False, True, True)
    cast = _saved_by_the_adapter(torch.float32, 0.0, False, True, monkeypatch)
    assert cast == TOKENS * IN * 4 != TOKENS * lora_saved_bytes(IN, 2, 4, False, True, True)
    plain = _saved_by_the_adapter(torch.float32, 0.0, True, False, monkeypatch)
    assert plain == TOKENS * IN * 2 != TOKENS * lora_saved_bytes(IN, 2, 4, False, True, four_bit=True)


def test_the_plan_of_a_live_model_reads_its_adapters_dtype_and_dropout():
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.05))
    request = model_plan_request(model, 64, 1)
    assert request.adapter_dtype == torch.float32 and request.lora_dropout is True
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.bfloat16)
    plain = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    assert model_plan_request(model, 64, 1).adapter_dtype == torch.bfloat16
    assert model_plan_request(plain, 64, 1).lora_dropout is False
    # half the bytes per adapter parameter: the weights, their gradients and AdamW's states
    fp32, bf16 = make_plan(model_plan_request(plain, 64, 1)), make_plan(model_plan_request(model, 64, 1))
    assert bf16.lora_bytes * 2 == fp32.lora_bytes and bf16.optimizer_bytes * 2 == fp32.optimizer_bytes


def test_a_streamed_training_pass_tells_the_plan_whether_it_runs_under_autocast(monkeypatch):
    streamed, _ = peft_pair(layers=3)
    stream(streamed)
    runtime = get_runtime(streamed)
    ids = torch.randint(3, 96, (1, 8))
    streamed(input_ids=ids, labels=ids).loss.backward()
    assert runtime.long_settings.autocast is False
    assert runtime.long_settings.plan_request(1, 8).autocast is False
    monkeypatch.setattr(long_settings, "_autocast_now", lambda: True)  # as under CUDA's autocast
    streamed(input_ids=ids, labels=ids).loss.backward()
    assert runtime.long_settings.autocast is True
    assert runtime.long_settings.plan_request(1, 8).autocast is True


def test_a_kbit_prepared_model_is_planned_with_a_float32_residual_stream(tmp_path):
    """After peft's prepare_model_for_kbit_training the embeddings are float32 while the
    4-bit layers compute (and dequantise) in bf16: the live request says both, with autocast
    or without (and the plan counts the float32 embeddings and head, not bf16 ones); a model
    left as loaded is planned in one dtype as before."""
    from peft import prepare_model_for_kbit_training

    from tiny import nf4_pair

    loaded, _ = nf4_pair(tmp_path, layers=2)
    plain = model_plan_request(loaded, 64, 1, autocast=True)
    assert plain.dtype == torch.bfloat16 and plain.residual_dtype is None
    prepared = prepare_model_for_kbit_training(loaded.base_model.model, use_gradient_checkpointing=False)
    assert prepared.get_input_embeddings().weight.dtype == torch.float32
    request = model_plan_request(prepared, 64, 1, autocast=True)
    assert request.dtype == torch.bfloat16 and request.residual_dtype == torch.float32
    without_autocast = model_plan_request(prepared, 64, 1, autocast=False)
    assert without_autocast.dtype == torch.bfloat16 and without_autocast.residual_dtype == torch.float32
    # float32 embeddings and head: twice their bf16 bytes (the rest beside them is small)
    assert make_plan(request).resident_bytes == pytest.approx(2 * make_plan(plain).resident_bytes, rel=0.01)


def test_a_prepared_moe_layer_is_planned_with_its_float32_expert_stacks(tmp_path):
    """bitsandbytes packs only nn.Linear: a MoE's fused expert stacks stay Parameters, which
    prepare_model_for_kbit_training casts to float32 with the norms. The plan's layer holds
    them at that size, not at the compute dtype's half."""
    from peft import prepare_model_for_kbit_training

    from tiny import nf4_pair

    loaded, _ = nf4_pair(tmp_path, family="mixtral", layers=2)
    prepared = prepare_model_for_kbit_training(loaded.base_model.model, use_gradient_checkpointing=False)
    experts = prepared.model.layers[0].mlp.experts
    stacks = [p for p in experts.parameters() if p.dim() == 3]
    assert stacks and all(p.dtype == torch.float32 for p in stacks)
    plan = make_plan(model_plan_request(prepared, 64, 1, autocast=True))
    assert plan.residual_dtype == "float32"
    assert plan.max_layer_bytes >= sum(p.numel() * 4 for p in stacks)


def test_the_output_projection_is_known_by_name_whichever_projections_are_adapted():
    """PEFT's default Llama targets are q_proj and v_proj: v_proj takes the norm's output, not
    attention's, so with a float32 residual stream under autocast its adapter keeps its own
    bf16 copy, as q_proj's does: adapting it beside q_proj adds that copy."""
    from layerstream.plan import PlanRequest, load_config

    config = load_config(str(LLAMA3_8B))
    base = dict(quantization="nf4", lora_rank=16, autocast=True, residual_dtype="float32", slots=3)
    working = {
        targets: make_plan(PlanRequest(config, 4096, 1, 80 << 30, lora_targets=targets, **base)).layer_working_bytes
        for targets in ("q_proj", "q_proj,v_proj")
    }
    assert working["q_proj,v_proj"] - working["q_proj"] == 4096 * 4096 * 2


def test_a_float32_norm_keeps_no_copy_of_its_input_and_a_bf16_one_does():
    """The untiled RMSNorm upcasts its input to float32 and keeps that for backward: a new
    tensor of 4 bytes an element for a bf16 input, the input itself for a float32 one (the
    plan counts the first norm's copy only below float32). Its weight is frozen, as in LoRA
    training (a trained weight would also keep the normalised input for its gradient)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kept = {}
    for dtype in (torch.bfloat16, torch.float32):
        norm = LlamaRMSNorm(64).to(dtype).requires_grad_(False)
        x = torch.randn(16, 64, dtype=dtype, requires_grad=True)
        saved = {}

        def pack(tensor, x=x, saved=saved):
            if tensor.shape == x.shape and tensor.data_ptr() != x.data_ptr():
                saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            norm(x)
        kept[dtype] = sum(saved.values())
    assert kept[torch.bfloat16] == 16 * 64 * 4 and kept[torch.float32] == 0
