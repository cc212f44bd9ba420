"""stream_embeddings="auto": the embedding and head move to host memory at the first
training step whose memory plan needs it, and come back to the GPU once a measured step
leaves room for them.

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

The plan that moves them keeps a margin and is cautious at long lengths; the resident
window then measures what the steps really use. Where that leaves room for the ends, they
come back (``bring_back``, asked by the window before it grows): the ends are copied in at
every step, in the open (the head twice: 4 GiB for an 8B Llama-3 in float32), where the
window's layers are copied behind compute, so the room goes to the ends first. Steps no
longer than the one measured then keep them on the GPU; a longer one is planned again, and
may move them again.

Where the ends cannot stream (a trainable end, a module the streamed code cannot step into,
too little host memory), "auto" leaves them where they are, says why once, and plans the
step without them.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decisions.disk import size_text
from ..errors import HostMemoryError, StreamingError
from ..system.log import get_logger
from ..tiers.store import check_host_memory

logger = get_logger("layerstream.runtime.core")


class EndsOnDemand:
    """Whether and when the ends of ``runtime``'s model stream under stream_embeddings="auto"."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.refused: Optional[str] = None  # why they cannot stream, once found out
        self.moved = False  # this component moved them (not stream_embeddings=True)
        self.back_up_to = 0  # steps of at most this many tokens were measured to fit them on the GPU
        self.returns = 0
        self.device_bytes = 0  # what the ends brought back hold on the GPU now (0: not back)

    def possible(self, tokens: int) -> bool:
        """Whether the plan of a step of ``tokens`` tokens may count on streaming the ends:
        not yet streamed, not found unable to (``can_move`` checks before a decision counts
        on it), and no measured step as long fitted them on the GPU."""
        return self.runtime.embeddings is None and self.refused is None and tokens > self.back_up_to

    def back_for(self, tokens: int) -> bool:
        """Whether the ends are on the GPU because measured steps of at least ``tokens``
        tokens left room for them (``bring_back``), where a plan would stream them."""
        return self.returns > 0 and self.runtime.embeddings is None and tokens <= self.back_up_to

    def can_move(self) -> bool:
        """Whether the ends can move now, changing nothing; False, said once, where not."""
        try:
            self._check()
        except (StreamingError, HostMemoryError) as exc:
            self._refuse(exc)
            return False
        return True

    def move(self, tokens: int) -> None:
        """Move the ends to host memory now: at the start of a step of ``tokens`` tokens whose
        decision counts on it, once its own checks passed (a step refused before it runs
        moves nothing)."""
        from .embeddings import find_ends, stream_embeddings

        runtime = self.runtime
        if not self.possible(tokens):
            return
        try:
            self._check()  # the model may have changed since the decision
        except (StreamingError, HostMemoryError) as exc:
            self._refuse(exc)
            return
        # they come back only to the device they left, the one they run on (never to the host)
        home = {weight.device for _, weight in find_ends(runtime.model).weights()}
        runtime.embeddings = stream_embeddings(runtime.model, runtime)
        self.moved = home == {runtime.device}
        self.device_bytes = 0
        if self.returns:  # a step longer than any measured: said once, at the first move
            logger.info("layerstream: stream_embeddings='auto' moved the embedding and head to host memory again")
            return
        logger.warning(
            "layerstream: stream_embeddings='auto' moved the embedding and head to host memory (%.2f GiB): the "
            "long-sequence settings alone left this step over the memory plan's limit. Each step now copies them "
            "in, until a measured step leaves room for them on the GPU (stream_embeddings=False keeps them there).",
            runtime.embeddings.host_bytes / 2**30,
        )

    def bring_back(self, room: int, tokens: int) -> None:
        """At a training-step boundary before a step no longer than the longest measured
        (``tokens`` tokens), with ``room`` bytes that the measured steps leave free under
        the limit and its margin: where this component moved the ends and they fit in that
        room, copy them back to the GPU and stream them no more (``device_bytes`` says what
        they hold there)."""
        runtime, ends = self.runtime, self.runtime.embeddings
        if ends is None or not self.moved or room < ends.host_bytes:
            return
        try:
            copies = ends.copies_out(runtime.device)  # the model is not changed before all are made
        except torch.OutOfMemoryError:
            self.moved = False  # the measurement was wrong about this memory: they stay for good
            logger.warning(
                "layerstream: stream_embeddings='auto' keeps the embedding and head in host memory: "
                "the GPU had no room for them after all."
            )
            return
        nbytes = ends.host_bytes
        ends.restore(copies)
        ends.close()
        runtime.embeddings = None
        self.moved = False
        self.back_up_to = max(self.back_up_to, tokens)
        self.returns += 1
        self.device_bytes = nbytes
        log = logger.warning if self.returns == 1 else logger.info
        log(
            "layerstream: stream_embeddings='auto' brought the embedding and head back to the GPU (%s): the "
            "measured steps of up to %d tokens leave room for them. Steps no longer than that stop copying them in.",
            size_text(nbytes),
            self.back_up_to,
        )

    def send_away(self) -> bool:
        """After an out-of-memory error with no window layer left to give up: the ends that
        ``bring_back`` returned go to host memory again, for the rest of the run (the
        measurement that brought them was wrong about this memory). False where they are
        not back, or cannot move."""
        from .embeddings import stream_embeddings

        runtime = self.runtime
        if not self.device_bytes or runtime.embeddings is not None:
            return False
        try:
            self._check()
        except (StreamingError, HostMemoryError) as exc:
            self._refuse(exc)
            return False
        runtime.embeddings = stream_embeddings(runtime.model, runtime)
        self.device_bytes, self.moved, self.back_up_to = 0, False, 0  # moved=False: they never come back
        logger.warning(
            "layerstream: out of memory with the embedding and head back on the GPU and no window layer to give "
            "up: stream_embeddings='auto' moved them to host memory again, for the rest of the run."
        )
        return True

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
