"""The long-sequence settings at the runtime level: what each step runs with.

``LongSettingsPolicy`` is a component of ``StreamRuntime`` (``runtime.long_settings``).
loss_chunk_tokens, mlp_tile_tokens and offload_activations left at "auto" are decided per
token count by the memory plan (``plan.long_settings``), once: a token count no larger than
one that needed none of them is not planned again, and one that needed some keeps its
decision. Applying a decision adds no work per layer visit:

- the chunked loss is mixed into the model's class at stream time, and a forward pre-hook
  on the model sets, once per call, the chunk that call takes (0: the model's own forward);
- the tiled MLP is mixed into the MLPs' class once a step first needs it; each MLP looks
  its tile up by its input's token count, so a step's recompute runs as its forward did
  even when a step of another length ran in between;
- offloading is ``OffloadPolicy``'s, asked once per training pass with this decision;
- stream_embeddings left at "auto" is the last resort (``plan.long_settings``): a decision
  that turns it on has ``EndsOnDemand`` check that the ends can move, and the step's start
  (``start_step``, once the step passed its checks) move them to host memory; the step and
  later ones are planned with them streamed, until a measured step leaves room for them
  on the GPU (``EndsOnDemand.bring_back``): steps no longer than it then keep them there.

What was turned on, and why, is said once per set of settings turned on (padded batches
bring a new length at nearly every step): in the log at the step's start, and in the
summary.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..config import OFFLOAD_AUTO_MARGIN, StreamConfig
from ..decisions.disk import size_text
from ..errors import StreamingError
from ..long import adapter_inputs, chunked_loss, tiled_mlp
from ..long.tiles import TilesByLength
from ..modules.discovery import unwrap_peft
from ..modules.layer import registrations
from ..plan.long_settings import (
    AUTO,
    ENDS,
    LONG_ORDER,
    NOTHING,
    OFF,
    LongDecision,
    decide_for,
    describe,
    setting_text,
)
from ..plan.model import model_plan_request
from ..system.log import get_logger
from .ends_on_demand import EndsOnDemand
from .offload_policy import OffloadPolicy

logger = get_logger("layerstream.runtime.core")


def _input_tokens(args, kwargs) -> int:
    """batch x seq of a causal LM call (input_ids or inputs_embeds); 0 when not found."""
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args:
        inputs = args[0]
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return 0
    return int(inputs.shape[0]) * int(inputs.shape[1])


def _autocast_now() -> bool:
    """Whether autocast is on as PEFT's LoRA layers see it (``torch.is_autocast_enabled()``,
    CUDA's): then they feed the adapters without casting their input."""
    return torch.is_autocast_enabled()


class LongSettingsPolicy:
    """The long-sequence settings of a streamed model: applied, decided per token count
    where left at "auto", said, and planned with.

    Collaborators, passed in: the model, the runtime's config (the runtime hands a new one
    whenever it replaces it), its ``OffloadPolicy`` (whether an offloader is there for "auto"
    to turn on) and its ``EndsOnDemand`` (whether the embeddings stream, which the plan
    counts, or may be made to).
    """

    def __init__(self, model: torch.nn.Module, config: StreamConfig, offload: OffloadPolicy, ends: EndsOnDemand):
        self.model = model
        self.config = config
        self.offload = offload
        self.ends = ends
        # what the settings left at "auto" have decided and said
        self._decided: Dict[int, LongDecision] = {}  # tokens -> decision with some on
        self._plain_up_to = 0  # the most tokens decided to need none: fewer are not planned
        self._tiles = TilesByLength()  # tokens -> MLP tile (the MLPs and norms read it)
        self._tiled = False  # the MLPs' class takes tiles
        self._tiles_possible = False  # the MLPs are ones tiled_mlp can tile
        self._chunked: Optional[torch.nn.Module] = None  # the model whose loss the hook chunks when a step needs it
        self._hook = None  # the hook's handle
        self._said: set = set()  # the sets of settings said on
        self._reported: List[Tuple[int, int, LongDecision]] = []  # (batch, seq, decision)
        self._said_unplanned = False
        # a training call came without labels (label smoothing, a compute_loss of the trainer's
        # own, ORPO, CPO): the model computes no loss, so there is none to chunk, and the full
        # logits are the trainer's; from then on the plan counts them and no chunk is turned on
        self._unlabelled = False
        self._adapters_at = 0  # modules.layer.registrations() when adapter_inputs last looked
        # whether training passes run under autocast, as the last one seen started (None:
        # none seen; the plan then reads the state of the moment)
        self.autocast: Optional[bool] = None

    # -- at stream time, at unstream ------------------------------------------------------
    def install(self, model: torch.nn.Module) -> None:
        """An explicit loss chunk or MLP tile is applied now; "auto" is made ready: the same
        code runs on a resident model (``chunked_loss.apply``, ``tiled_mlp.apply``)."""
        config = self.config
        if config.loss_chunk_tokens not in (None, AUTO):
            chunked_loss.apply(model, config.loss_chunk_tokens)
        if config.mlp_tile_tokens not in (None, AUTO):
            tiled_mlp.apply(model, config.mlp_tile_tokens)
        if config.loss_chunk_tokens == AUTO and self._chunkable(model):
            self._chunked = unwrap_peft(model)
            chunked_loss.set_tokens(self._chunked, 0)
            self._hook = self._chunked.register_forward_pre_hook(self._before_model_call, with_kwargs=True)
        if config.mlp_tile_tokens == AUTO:
            self._tiles_possible = self._tileable(model)

    @property
    def loss_chunks_possible(self) -> bool:
        """Whether loss_chunk_tokens="auto" can chunk this model's loss (its forward was
        checked at stream time); False for an explicit setting too."""
        return self._chunked is not None and not self._unlabelled

    @property
    def called_without_labels(self) -> bool:
        """Whether a training call came without labels (its trainer's loss, on full logits)."""
        return self._unlabelled

    @staticmethod
    def _chunkable(model) -> bool:
        try:
            chunked_loss.apply(model, 1)
        except (StreamingError, OSError, TypeError) as exc:  # OSError, TypeError: no source to read
            logger.info("layerstream: loss_chunk_tokens='auto' stays off for this model: %s", exc)
            return False
        return True

    @staticmethod
    def _tileable(model) -> bool:
        try:
            tiled_mlp.mlps(model)
        except StreamingError as exc:
            logger.info("layerstream: mlp_tile_tokens='auto' stays off for this model: %s", exc)
            return False
        return True

    def remove(self, model: torch.nn.Module) -> None:
        """Undo ``install``: the model's own loss and MLPs run again."""
        if self._hook is not None:
            self._hook.remove()
        if self.config.loss_chunk_tokens is not None:
            chunked_loss.remove(model)
        if self.config.mlp_tile_tokens is not None:
            tiled_mlp.remove(model)

    def forget_decisions(self) -> None:
        """Decide again from the next step (a setting changed); what was said stays said. A
        pass under way recomputes with the tiles it began with (``tiles_of_pass``)."""
        self._decided.clear()
        self._plain_up_to = 0
        self._tiles.clear()

    def tiles_of_pass(self) -> Optional[Dict[int, int]]:
        """The tiles a training pass starting now takes, for its recompute to replay
        (``replaying``): empty while none is decided (the MLPs may take tiles by a later
        pass, before this one's backward); None where mlp_tile_tokens is not "auto"."""
        return self._tiles.snapshot() if self._tiles_possible else None

    def replaying(self, tiles: Optional[Dict[int, int]]):
        """Around a recompute: the MLPs and norms tile as its forward did (``tiles_of_pass``)."""
        return self._tiles.replaying(tiles)

    @property
    def embeddings_streamed(self) -> bool:
        return self.ends.runtime.embeddings is not None

    # -- deciding ---------------------------------------------------------------------------
    def decision(self, tokens: int) -> LongDecision:
        """What the settings left at "auto" are for a step of ``tokens`` tokens."""
        if tokens <= self._plain_up_to:
            return NOTHING
        decision = self._decided.get(tokens)
        if decision is not None:
            return decision
        decision = self._decide(tokens)
        if ENDS in decision.names and not self.ends.can_move():
            decision = self._decide(tokens)  # planned with the ends where they stay
        if not decision.on:
            self._plain_up_to = tokens
            return decision
        self._decided[tokens] = decision
        tile = decision.value("mlp_tile_tokens")
        if tile:
            self._tiles[tokens] = tile
            if not self._tiled:
                tiled_mlp.apply_per_length(self.model, self._tiles)
                self._tiled = True
        return decision

    def _auto_settings(self, tokens: int) -> Dict[str, object]:
        """The settings as the plan takes them: "auto" for those left at it that this model
        and run can take, off for the other "auto" ones, the explicit values as given."""
        config = self.config
        possible = {
            "loss_chunk_tokens": self.loss_chunks_possible,
            "mlp_tile_tokens": self._tiles_possible,
            "offload_activations": self.offload.offloader is not None,
        }
        values = {}
        for name in LONG_ORDER:
            value = getattr(config, name)
            values[name] = OFF[name] if value == AUTO and not possible[name] else value
        ends_auto = config.stream_embeddings == AUTO and self.ends.possible(tokens)
        values[ENDS] = AUTO if ends_auto else self.embeddings_streamed
        return values

    def _decide(self, tokens: int) -> LongDecision:
        settings = self._auto_settings(tokens)
        if AUTO not in settings.values():
            return NOTHING
        budget = self.config.budget_bytes()
        if budget is None:
            return NOTHING
        try:
            return decide_for(self.plan_request(1, tokens, **settings), budget)
        except ValueError as exc:
            if not self._said_unplanned:
                self._said_unplanned = True
                logger.warning(
                    "layerstream: the long-sequence settings left at 'auto' stay off: the step cannot be planned (%s)",
                    exc,
                )
            return NOTHING

    def start_step(self, decision: LongDecision) -> None:
        """A training step that ``decision`` planned passed its checks and runs: the ends
        move now where it counts on them (not when a step is only planned or refused)."""
        if ENDS in decision.names:
            self.ends.move(decision.tokens)
        tiles = self._tiles if self._tiled else self.config.mlp_tile_tokens
        if (self._tiled or isinstance(tiles, int)) and self._adapters_at != registrations():
            self._adapters_at = registrations()  # adapters may have come since the tiles were set up
            adapter_inputs.apply(self.model, tiles)

    def pass_starts(self) -> None:
        """A training pass starts: note whether it runs under autocast (what each LoRA
        projection keeps for backward depends on it), before its decision is planned."""
        self.autocast = _autocast_now()

    def settings_for(self, tokens: int) -> Dict[str, object]:
        """The value of each long-sequence setting for a step of ``tokens`` tokens: as given,
        or what "auto" decided (off: None, or False for offloading)."""
        config = self.config
        auto = [name for name in LONG_ORDER if getattr(config, name) == AUTO]
        decision = self.decision(tokens) if auto else NOTHING
        return {
            name: (decision.value(name) or OFF[name]) if name in auto else getattr(config, name) for name in LONG_ORDER
        }

    def _before_model_call(self, module, args, kwargs) -> None:
        """The model's forward pre-hook: the loss chunk of this call, from its token count."""
        tokens = _input_tokens(args, kwargs)
        chunk = 0
        if tokens and torch.is_grad_enabled():
            self.pass_starts()
            if kwargs.get("labels") is None and self.loss_chunks_possible:
                self._without_labels(tokens)
            chunk = self.decision(tokens).value("loss_chunk_tokens") or 0
        chunked_loss.set_tokens(module, chunk)

    def _without_labels(self, tokens: int) -> None:
        """A training call without labels: the trainer computes the loss from the full logits,
        so loss_chunk_tokens="auto" cannot chunk it. Decided again without loss chunks (the
        MLP tiles, offloading or the ends make up for them where they can), and said once."""
        self._unlabelled = True
        self.forget_decisions()
        logger.warning(
            "layerstream: loss_chunk_tokens='auto' stays off: the model is called without labels for training "
            "(%d tokens), so the trainer computes its loss from the full logits (label smoothing, its own "
            "compute_loss, ORPO, CPO); the memory plan counts them.",
            tokens,
        )

    def say(self, shape: Tuple[int, int], offloading: bool) -> None:
        """At the start of a training pass of ``shape`` (batch, seq), once offloading is
        settled (``offloading``: the pass offloads): what "auto" turned on for it and why,
        unless that set of settings was said before."""
        batch, seq = shape
        decision = self._decided.get(batch * seq)
        if decision is None:
            return
        offloaded = offloading or "offload_activations" not in decision.names
        names = tuple(name for name in decision.names if offloaded or name != "offload_activations")
        if not names or names in self._said:
            return
        self._said.add(names)
        self._reported.append((batch, seq, decision))
        logger.warning(describe(decision, batch, seq, offloaded))

    def summary_line(self) -> str:
        """The summary's line: how each long-sequence setting is set, and what "auto" turned
        on so far, once per set of settings turned on, with the plan's numbers."""
        config = self.config
        lines = [", ".join(f"{name}={getattr(config, name)}" for name in LONG_ORDER)]
        if any(getattr(config, name) == AUTO for name in LONG_ORDER):
            if config.vram_budget is None:
                lines[0] += " (auto: off without a vram_budget)"
            elif not self._reported:
                lines[0] += (
                    f" (auto: decided per step length from the memory plan, on where a step needs more than "
                    f"{100 - round(100 * OFFLOAD_AUTO_MARGIN)}% of vram_budget; none on yet)"
                )
        for batch, seq, decision in self._reported:
            turned = ", ".join(setting_text(name, value) for name, value in decision.on)
            lines.append(
                f"auto turned on {turned} at batch {batch} x {seq} tokens: the plan needs "
                f"{size_text(decision.needed_without)} without, {size_text(decision.needed)} with them, "
                f"against {size_text(decision.limit)} kept under"
            )
        return "\n               ".join(lines)

    def decisions_said(self) -> List[Tuple[int, int, LongDecision]]:
        """(batch, seq, decision) of each set of settings "auto" turned on, as said, in order."""
        return list(self._reported)

    # -- the plan of this model ------------------------------------------------------------
    def plan_request(self, batch: int, seq: int, vram_bytes: int = 1 << 50, backward_slots=0, **settings):
        """The planner's request for this model streamed as it is; ``settings``: the
        long-sequence settings to plan with."""
        return model_plan_request(
            self.model,
            seq,
            batch,
            vram_bytes,
            slots=self.config.slots,
            stream_embeddings=settings.pop(ENDS, self.embeddings_streamed),
            backward_slots=backward_slots,
            autocast=self.autocast if self.autocast is not None else _autocast_now(),
            **settings,
        )

    def memory_plan(
        self, batch: int, seq: int, vram_bytes: int, backward_slots: int, offload: bool, ends: Optional[bool] = None
    ):
        """The memory planner's plan of this model streamed as it is, with the loss chunk and
        MLP tile a step of batch x seq tokens takes (``StreamRuntime.memory_plan`` says whether
        the pass offloads); ``ends``: planned streamed or not, whatever they are now."""
        from ..plan import make_plan

        settings = self.settings_for(batch * seq)
        settings["offload_activations"] = offload
        # the ends as this step runs: streamed, or about to move for it
        tokens = batch * seq
        settings[ENDS] = (
            ends
            if ends is not None
            else self.embeddings_streamed or (ENDS in self.decision(tokens).names and self.ends.possible(tokens))
        )
        return make_plan(self.plan_request(batch, seq, vram_bytes, backward_slots, **settings))
