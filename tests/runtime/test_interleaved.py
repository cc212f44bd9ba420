"""Training interleaved with evaluation and generation, as a Trainer with eval_strategy
and a generation callback does: every phase change leaves the streamed model exact."""

import torch

from tiny import assert_traces_equal, batch, peft_pair, stream, train_steps


def _rounds(model, device, rounds=3):
    outputs = []
    ids = batch(96, size=2, seq=6, seed=7, device=device)
    kwargs = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    for _ in range(rounds):
        outputs.append(train_steps(model, 2, device))
        model.eval()
        with torch.no_grad():
            outputs.append(model(input_ids=batch(96, size=3, seq=9, seed=11, device=device)).logits.cpu())
        outputs.append(model.generate(input_ids=ids, **kwargs).cpu())
        model.train()
    return outputs


def test_training_evaluation_and_generation_interleaved_stay_exact(device):
    attn = "eager" if device == "cuda" else None
    streamed, resident = peft_pair("llama", layers=5, attn=attn)
    stream(streamed, device, slots=2, prefetch=1)
    resident.to(device)
    for got, expected in zip(_rounds(streamed, device), _rounds(resident, device)):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, expected)
        else:
            assert_traces_equal(got, expected)
