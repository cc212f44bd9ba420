"""A progress bar over long per-layer work (loading, NF4 quantisation, the NF4 cache build).

Loading a 70B checkpoint layer by layer, quantising each layer, takes minutes; without a
bar it looks hung. The bar is transformers' own (``transformers.utils.logging.tqdm``), so
the switches that silence transformers' bars silence this one too
(``transformers.utils.logging.disable_progress_bar()``, ``HF_HUB_DISABLE_PROGRESS_BARS=1``),
and only the main process of a job shows it (``log.is_main_process``): one bar per job.
It counts layers and shows the bytes stored so far.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

from ..system.log import is_main_process
from ..units import GiB, MiB, gib

T = TypeVar("T")


def each_layer(items: Iterable[T], total: int, what: str, stored_bytes: Callable[[], int]) -> Iterator[T]:
    """Yield ``items`` (one per layer) while a bar named ``what`` counts them; after each
    layer's work the bar shows ``stored_bytes()``."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.tqdm(total=total, desc=f"layerstream: {what}", unit="layer", disable=not is_main_process())
    try:
        for item in items:
            yield item
            done = stored_bytes()
            bar.set_postfix_str(gib(done) if done >= GiB else f"{done / MiB:.1f} MiB", refresh=False)
            bar.update(1)
    finally:
        bar.close()
