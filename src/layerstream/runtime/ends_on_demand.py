"""stream_embeddings="auto": the embedding and head move to host memory at the first
training step whose memory plan needs it, and stay there.

``EndsOnDemand`` is a component of ``StreamRuntime``. ``LongSettingsPolicy`` asks it whether
the ends may stream (``possible``) as it plans a step with "auto" settings, whether they can
move now (``can_move``, changing nothing) when its decision turns ``stream_embeddings`` on,
and has it move them (``move``) at the start of that step, once the step passed its own
checks. Moving them is what ``stream_model(stream_embeddings=True)`` does at stream time
(``embeddings.stream_embeddings``), later: the weights are copied into a host store of their
own (from the GPU too, whose memory goes back), the modules' classes are swapped, and from
then on each forward copies them in. The arithmetic is the same before and after: the
streamed embedding and head run the resident kernels on a device copy of the same values,
so every step equals the resident model's.

Where the ends cannot stream (a trainable end, a module the streamed code cannot step into,
too little host memory), "auto" leaves them where they are, says why once, and plans the
step without them.
"""

from __future__ import annotations

from typing import Optional

from ..errors import HostMemoryError, StreamingError
from ..system.log import get_logger
from ..tiers.store import check_host_memory

logger = get_logger("layerstream.runtime.core")


class EndsOnDemand:
    """Whether and when the ends of ``runtime``'s model stream under stream_embeddings="auto"."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.refused: Optional[str] = None  # why they cannot stream, once found out

    def possible(self) -> bool:
        """Whether a step's plan may count on streaming the ends: not yet streamed and not
        found unable to (``can_move`` checks before a decision counts on it)."""
        return self.runtime.embeddings is None and self.refused is None

    def can_move(self) -> bool:
        """Whether the ends can move now, changing nothing; False, said once, where not."""
        try:
            self._check()
        except (StreamingError, HostMemoryError) as exc:
            self._refuse(exc)
            return False
        return True

    def move(self) -> None:
        """Move the ends to host memory now: at the start of a step whose decision counts on
        it, once its own checks passed (a step refused before it runs moves nothing)."""
        from .embeddings import stream_embeddings

        runtime = self.runtime
        if runtime.embeddings is not None or self.refused is not None:
            return
        try:
            self._check()  # the model may have changed since the decision
        except (StreamingError, HostMemoryError) as exc:
            self._refuse(exc)
            return
        runtime.embeddings = stream_embeddings(runtime.model, runtime)
        logger.warning(
            "layerstream: stream_embeddings='auto' moved the embedding and head to host memory (%.2f GiB) for "
            "the rest of the run: the long-sequence settings alone left this step over the memory plan's limit. "
            "Each step now copies them in (stream_embeddings=False keeps them on the GPU).",
            runtime.embeddings.host_bytes / 2**30,
        )

    def _check(self) -> None:
        """What stream_model(stream_embeddings=True) checks before it copies, and host memory."""
        from .embeddings import find_ends

        runtime = self.runtime
        found = find_ends(runtime.model)
        trained = [name for name, weight in found.weights() if weight.requires_grad]
        if trained:
            raise StreamingError(f"{trained[0]} trains, and a streamed end stays frozen in host memory")
        sizes = [weight.numel() * weight.element_size() for _, weight in found.weights()]
        on_host = all(weight.device.type == "cpu" for _, weight in found.weights())
        check_host_memory(
            max(sizes) if on_host else sum(sizes),  # one end at a time on the host, all of them from a GPU
            runtime.store.host_bytes + sum(sizes),
            bool(runtime.config.pin),
            "moving the embedding and head to host memory (stream_embeddings='auto')",
        )

    def _refuse(self, exc: Exception) -> None:
        self.refused = str(exc)
        logger.warning(
            "layerstream: stream_embeddings='auto' would move the embedding and head to host memory for a "
            "step's memory, but they stay where they are: %s. Steps are planned without it.",
            exc,
        )
