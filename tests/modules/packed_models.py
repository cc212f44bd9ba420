"""The tiny gpt-oss models the packed-experts tests compare: the packed one layerstream loads
and the dequantised reference transformers loads, and a LoRA step on either."""

from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, Mxfp4Config

import layerstream

from tiny import batch, lora_config

LAYERS, ROUTED = 3, 16


CPU = layerstream.StreamConfig(device="cpu", slots=2)


ROOT = Path(__file__).resolve().parents[2]


def dequantised_model(checkpoint, device="cpu"):
    """The reference: transformers' own load, dequantising MXFP4 to bf16 (as it does without
    its kernels; asked explicitly, so a GPU machine with Triton does the same)."""
    dequantise = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, quantization_config=dequantise).to(
        device
    )


def packed_model(checkpoint, device="cpu"):
    stream = layerstream.StreamConfig(device=device, slots=2)
    return layerstream.from_pretrained(checkpoint, dtype=torch.bfloat16, stream=stream).to(device)


def logits_of(model):
    with torch.no_grad():
        return model(input_ids=batch(96, seq=12, device=model.device)).logits


def lora_step_results(model, steps: int = 2, size: int = 2, seq: int = 12, config=None):
    """Losses and every LoRA gradient of a few AdamW steps of attention LoRA (non-zero B,
    TRL's default dropout; ``config``: other LoraConfig values), seeded alike."""
    torch.manual_seed(0)
    values = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.05)
    peft = get_peft_model(model, lora_config(**{**values, **(config or {})}))
    peft.train()
    optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    ids = batch(96, size=size, seq=seq, device=peft.device)
    losses, grads = [], []
    torch.manual_seed(1)
    for _ in range(steps):
        loss = peft(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in peft.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads
