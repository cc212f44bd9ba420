"""Dequantising packed MXFP4 experts: transformers' arithmetic value for value (every byte
under every exponent), by rows and in groups, to the dtype the installed transformers gives."""

import pytest
import torch
from packed_models import dequantised_model, logits_of, packed_model
from transformers import AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import layerstream
from layerstream.modules import packed_experts


def test_dequantising_a_group_of_experts_at_a_time_gives_transformers_whole_result(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (5, 64, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 132, (5, 64, 2), dtype=torch.uint8, generator=generator)
    whole = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    monkeypatch.setattr(packed_experts, "GROUP_BYTES", 2 * 64 * 64 * 2)  # two experts a group
    assert torch.equal(packed_experts.dequantise_with_torch(blocks, scales, torch.bfloat16), whole)
    assert not torch.equal(packed_experts.dequantise_with_torch(blocks, scales.flip(0), torch.bfloat16), whole)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_a_model_no_longer_streamed_dequantises_to_the_dtype_it_is_cast_to(checkpoint, implementation):
    """After unstream_model a cast is the model's to make: ``float()`` dequantises in float32,
    as the reference's cast bf16 Parameters hold them."""
    reference, model = dequantised_model(checkpoint).float(), packed_model(checkpoint)
    layerstream.unstream_model(model)
    model.float()
    for each in (reference, model):
        each.set_experts_implementation(implementation)
    assert torch.equal(logits_of(model), logits_of(reference))


def test_a_float32_model_dequantises_to_the_dtype_this_transformers_gives_its_experts(checkpoint, device, monkeypatch):
    """transformers 5.17's dequantising load gives the experts bfloat16 whatever the model's
    dtype (its ``dequantize_convertops`` takes no dtype); newer releases give them the
    model's. A float32 model keeps its experts packed and dequantises them to the dtype the
    installed transformers gives them, and the older behaviour is staged too, by giving
    transformers' module the older function. Negative control: the model's own dtype under
    the older function changes the logits."""
    from transformers.integrations import mxfp4 as transformers_mxfp4

    def older(blocks, scales, *unused):  # 5.17's: no dtype, so convert_moe_packed_tensors' default
        return torch.nn.Parameter(convert_moe_packed_tensors(blocks, scales))

    stream = layerstream.StreamConfig(device=device, slots=2)
    for staged in (False, True):
        if staged:
            monkeypatch.setattr(transformers_mxfp4, "dequantize_convertops", older)
        reference = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
        ).to(device)
        given = reference.model.layers[0].mlp.experts.gate_up_proj.dtype
        assert given == torch.bfloat16 or not staged
        model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=stream).to(device)
        assert packed_experts.packed_of(model.model.layers[0].mlp.experts).dtype == given
        assert torch.equal(logits_of(model), logits_of(reference))
    monkeypatch.setattr(packed_experts, "dequantised_dtype", lambda dtype: dtype)
    model = layerstream.from_pretrained(checkpoint, dtype=torch.float32, stream=stream).to(device)
    assert not torch.equal(logits_of(model), logits_of(reference))


def test_a_transformers_without_the_dequantising_function_is_said_and_the_load_dtype_kept(monkeypatch, caplog):
    from transformers.integrations import mxfp4 as transformers_mxfp4

    monkeypatch.delattr(transformers_mxfp4, "dequantize_convertops")
    assert packed_experts.dequantised_dtype(torch.float32) == torch.float32
    assert "no mxfp4.dequantize_convertops" in caplog.text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantise_gives_transformers_values_for_every_byte_and_exponent(device, dtype, monkeypatch):
    """layerstream dequantises with transformers' arithmetic but not its function: every one
    of the 256 bytes under every one of the 256 exponents (zeros, subnormals, infinities and
    NaN among them), in groups of two experts, whole, by rows and compacted, equals
    ``convert_moe_packed_tensors``' output bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # 4 experts x 128 outputs x 8 blocks of 16 bytes (256 inputs): block b has exponent b % 256
    # and bytes 16 * (b // 256) + 0..15, so each exponent meets each byte once
    monkeypatch.setattr(packed_experts, "GROUP_BYTES", 2 * 256 * 128 * dtype.itemsize)
    block = torch.arange(4 * 128 * 8)
    scales = (block % 256).to(torch.uint8).view(4, 128, 8).to(device)
    blocks = (16 * (block // 256)[:, None] + torch.arange(16)).to(torch.uint8).view(4, 128, 8, 16).to(device)
    pairs = {(e, v) for e, row in zip(scales.flatten().tolist(), blocks.view(-1, 16).tolist()) for v in row}
    assert len(pairs) == 256 * 256
    reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = packed_experts.dequantise(blocks, scales, dtype)
    assert ours.shape == reference.shape == (4, 256, 128) and ours.dtype == dtype
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours.view(bits), reference.view(bits))
    rows = [3, 0, 1]
    assert torch.equal(
        packed_experts.dequantise(blocks, scales, dtype, rows)[rows].view(bits), reference[rows].view(bits)
    )
    compact = packed_experts.dequantise(blocks, scales, dtype, rows, compact=True)
    assert torch.equal(compact.view(bits), reference[[0, 1, 3]].view(bits))
    # control: the byte's halves in the other order give other values
    swapped = packed_experts.dequantise((blocks << 4) | (blocks >> 4), scales, dtype)
    assert not torch.equal(swapped.view(bits), reference.view(bits))


def test_dequantise_takes_rows_as_a_router_gives_them_and_refuses_rows_out_of_range():
    """Rows as the router's index tensor gives them (repeated, any shape) count each expert
    once, as the same rows as ints do; an index past the last expert is refused, not read."""
    blocks = torch.randint(0, 256, (4, 8, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 134, (4, 8, 2), dtype=torch.uint8)
    as_ints = packed_experts.dequantise(blocks, scales, torch.float32, [1, 3], compact=True)
    as_tensor = packed_experts.dequantise(
        blocks, scales, torch.float32, torch.tensor([[3, 1], [1, 3], [3, 3]]), compact=True
    )
    assert as_tensor.shape == as_ints.shape == (2, 64, 8)
    assert torch.equal(as_tensor, as_ints)
    assert not torch.equal(as_ints[0], as_ints[1])  # control: the two rows differ
    for wrong in ([4], [-1], torch.tensor([0, 7])):
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            packed_experts.dequantise(blocks, scales, torch.float32, wrong)


def _every_byte_under_every_exponent(device):
    """4 experts x 128 outputs x 8 blocks of 16 bytes: block b has exponent b % 256 and bytes
    16 * (b // 256) + 0..15, so each exponent meets each byte once."""
    block = torch.arange(4 * 128 * 8)
    scales = (block % 256).to(torch.uint8).view(4, 128, 8).to(device)
    blocks = (16 * (block // 256)[:, None] + torch.arange(16)).to(torch.uint8).view(4, 128, 8, 16).to(device)
    return blocks, scales


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_gpu_the_kernel_dequantises_and_gives_torch_ops_bits(dtype, monkeypatch):
    """On CUDA a call takes the one-pass kernel, and its stacks (whole, by rows, compacted)
    equal the torch ops' bit for bit, every byte under every exponent; swapped halves differ."""
    from layerstream.modules import mxfp4_kernel

    blocks, scales = _every_byte_under_every_exponent("cuda")
    assert mxfp4_kernel.usable(blocks, dtype), "no Triton on this CUDA machine: the kernel would not run"
    launches = []
    launch = mxfp4_kernel.dequantise
    monkeypatch.setattr(
        mxfp4_kernel, "dequantise", lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs)
    )
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    cases = ((None, False), ([3, 0, 1], False), ([3, 0, 1], True), ([2], True))
    for rows, compact in cases:
        kernel = packed_experts.dequantise(blocks, scales, dtype, rows, compact=compact)
        torch_ops = packed_experts.dequantise_with_torch(blocks, scales, dtype, rows, compact=compact)
        chosen = slice(None) if rows is None or compact else sorted(rows)
        assert torch.equal(kernel[chosen].view(bits), torch_ops[chosen].view(bits)), (rows, compact)
    assert len(launches) == len(cases), "a call did not take the kernel"
    swapped = packed_experts.dequantise((blocks << 4) | (blocks >> 4), scales, dtype)
    assert not torch.equal(swapped.view(bits), packed_experts.dequantise(blocks, scales, dtype).view(bits))
    assert packed_experts._kernel_failed is None


def test_blocks_and_scales_that_do_not_match_are_refused_before_either_way_runs(monkeypatch):
    """Scales of other experts than the blocks' would be read past their end by the kernel:
    refused, naming both shapes, and not taken for a kernel failure."""
    from layerstream.modules import mxfp4_kernel

    blocks, scales = _every_byte_under_every_exponent("cpu")
    monkeypatch.setattr(packed_experts, "_kernel_failed", None)
    monkeypatch.setattr(mxfp4_kernel, "usable", lambda blocks, dtype: True)
    for wrong_blocks, wrong_scales in ((blocks, scales[:1]), (blocks[..., 0], scales), (blocks[..., :8], scales)):
        with pytest.raises(ValueError, match="do not match"):
            packed_experts.dequantise(wrong_blocks, wrong_scales, torch.bfloat16)
    assert packed_experts._kernel_failed is None


def test_a_kernel_that_fails_is_said_once_and_torch_ops_dequantise_from_then_on(monkeypatch, caplog):
    """A Triton that cannot build or launch the kernel: one warning, the same values from
    torch ops, and no second attempt; running out of memory stays the caller's to handle."""
    from layerstream.modules import mxfp4_kernel

    blocks, scales = _every_byte_under_every_exponent("cpu")
    expected = packed_experts.dequantise_with_torch(blocks, scales, torch.bfloat16)
    attempts = []

    def failing(*args, **kwargs):
        attempts.append(args)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(packed_experts, "_kernel_failed", None)
    monkeypatch.setattr(mxfp4_kernel, "usable", lambda blocks, dtype: True)
    monkeypatch.setattr(mxfp4_kernel, "dequantise", failing)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            assert torch.equal(packed_experts.dequantise(blocks, scales, torch.bfloat16), expected)
    assert len(attempts) == 1 and caplog.text.count("MXFP4 dequantising kernel failed") == 1
    monkeypatch.setattr(packed_experts, "_kernel_failed", None)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(mxfp4_kernel, "dequantise", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        packed_experts.dequantise(blocks, scales, torch.bfloat16)
    assert packed_experts._kernel_failed is None
