"""The streamed embedding's lookup, done on the host: the rows a forward's ids name.

``F.embedding``'s forward is a gather of rows (padding_idx, scale_grad_by_freq and sparse
change only its backward; a streamed embedding refuses max_norm), so the rows gathered on
the host and copied to the GPU are bit for bit the resident lookup. Where the ends' store is
pinned, the rows are gathered straight into page-locked memory from torch's caching host
allocator, which keeps a block until the copies reading it have run: the copy to the GPU is
then asynchronous and at the pinned rate, where from ordinary memory CUDA first waits for the
stream and stages the rows through a buffer of its own.
"""

from __future__ import annotations

import torch

from ..system.log import get_logger
from ..units import GiB

logger = get_logger("layerstream.runtime.embeddings", main_process_only=False)  # this rank's host memory

_warned = False


def gather_rows(weight: torch.Tensor, ids: torch.Tensor, pinned: bool) -> torch.Tensor:
    """The rows of ``weight`` that ``ids`` name, shaped ``ids.shape + (dim,)``, in page-locked
    memory where ``pinned`` (in ordinary memory, said once, where the host has none left)."""
    global _warned
    flat = ids.reshape(-1)
    shape = (flat.numel(), weight.shape[1])
    rows = None
    if pinned:
        try:
            rows = torch.empty(shape, dtype=weight.dtype, pin_memory=True)
        except RuntimeError as exc:  # cudaHostAlloc failed: no page-locked memory left
            if not _warned:
                _warned = True
                logger.warning(
                    "layerstream: the streamed embedding's rows (%.2f GiB) could not be page-locked (%s); "
                    "they are gathered into ordinary host memory, whose copy to the GPU is slower and "
                    "waits for the stream.",
                    shape[0] * shape[1] * weight.element_size() / GiB,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
    if rows is None:
        rows = torch.empty(shape, dtype=weight.dtype)
    torch.index_select(weight, 0, flat, out=rows)
    return rows.view(*ids.shape, weight.shape[1])
