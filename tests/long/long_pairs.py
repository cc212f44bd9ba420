"""What the long-sequence tests share: the tiny pair (streamed and resident, with the same
loss chunks and MLP tiles), its sizes, a FLOP counter and rows with prompts to ignore."""

import torch

from layerstream.long import chunked_loss, tiled_mlp

from tiny import (
    batch,
    peft_pair,
    stream,
)

STEPS = 4
SEQ = 24  # 2 x 24 tokens: 10 loss chunks of 5 tokens, 4 MLP tiles of 13
CHUNK, TILE = 5, 13


def long_pair(stream_embeddings=False, lora=None, chunk=CHUNK, tile=TILE, layers=5, device="cpu"):
    streamed, resident = peft_pair(layers=layers, lora=lora)
    options = {"loss_chunk_tokens": chunk, "mlp_tile_tokens": tile}
    stream(streamed, device, slots=2, prefetch=1, stream_embeddings=stream_embeddings, **options)
    resident.to(device)
    if chunk is not None:
        chunked_loss.apply(resident, chunk)
    if tile is not None:
        tiled_mlp.apply(resident, tile)
    return streamed, resident


class MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """The FLOPs of every matrix product dispatched (torch's own flop formulas)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        from torch.utils.flop_counter import flop_registry

        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            shapes = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, args)
            out_shape = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, out)
            self.flops += formula(*shapes, **(kwargs or {}), out_val=out_shape)
        return out


def step_flops(model) -> int:
    ids = batch(96, size=2, seq=SEQ)
    with MatmulFlops() as counted:
        model(input_ids=ids, labels=ids).loss.backward()
    return counted.flops


def token_rows(rows=8, seq=SEQ):
    ids = [batch(96, size=1, seq=seq, seed=i)[0] for i in range(rows)]
    out = []
    for i, row in enumerate(ids):
        labels = row.clone()
        labels[: 3 + i % 5] = -100  # prompts of different lengths: num_items_in_batch matters
        out.append({"input_ids": row, "labels": labels})
    return out
