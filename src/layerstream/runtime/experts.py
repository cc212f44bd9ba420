"""Copies by need: a streamed mixture-of-experts layer copies only the experts its router
chose.

``ExpertsByNeed`` is a component of ``StreamRuntime`` (``runtime.experts``). At each pass
start it decides from the pass's tokens whether routed layers copy by need
(``decisions.experts.copy_by_need``). While they do, a layer's copy into its slot leaves
out the byte ranges of its expert stacks (``load_ranges``), and a hook that runs before
each experts module's forward (after the router) copies the rows of the chosen experts the
slot does not hold yet, on the compute stream, before the experts read them. Rows of
experts nobody chose are never copied and never read.

The rows a slot holds, per experts module, are kept by the slot pool
(``SlotPool.rows_present``) beside its owner, so that a slot kept across passes (the ring keeps the first layers for the next
forward) is completed with the rows the new pass chooses, and any copy of a whole region
makes the slot whole again. Where the experts call does not read by expert (another
implementation, an adapter merged into the stack, a hook added after this one that may
change the choice), the hook copies every row still missing first; so does code that
reads or writes whole stacks inside the layer's call (a PEFT merge: ``complete``). Window layers are whole on the device and are left alone.

Exactness: the experts compute from the same bytes as a resident layer, for every row they
read, so the result is the resident one bit for bit; a row left out by mistake holds
another layer's bytes and changes the output (the tests' negative control).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..decisions import experts as decide
from ..modules import experts as stacks_of
from ..modules import packed_experts


class ExpertsByNeed:
    """The routed layers' expert stacks, whether this pass copies them by need, and the
    hooks that copy the chosen rows.

    Collaborators, passed in: the layer records (where each stack's host rows are) and the
    slot pool (which slot a bound tensor lives in, and the rows it holds).
    """

    def __init__(self, records, pool, enabled: bool = True):
        self.records = records
        self.pool = pool
        self.enabled = enabled
        self.stacks: Dict[int, List[stacks_of.ExpertStacks]] = {}
        self._holes: Dict[int, List[Tuple[int, int]]] = {}
        self._hooks: Dict[int, object] = {}  # id(experts module) -> its hook's handle
        self.by_need = False  # this pass copies expert rows by need
        self.visits = 0  # experts calls of streamed layers
        self.experts_copied = 0  # expert rows copied (one per expert, all its stacks together)
        for record in records:
            self.restack(record)

    def restack(self, record) -> None:
        """Find the layer's expert stacks again (at streaming, and after its tensors were
        laid out anew in the host store)."""
        self.stacks.pop(record.index, None)
        self._holes.pop(record.index, None)
        found = stacks_of.find(record)
        if not found:
            return
        self.stacks[record.index] = found
        holes = [
            (record.entries[p].offset, record.entries[p].offset + record.entries[p].nbytes)
            for stack in found
            if stack.by_need
            for p in stack.positions
        ]
        if holes and self.enabled:
            self._holes[record.index] = holes
        for stack in found:
            if id(stack.module) not in self._hooks:
                hook = self._hook(record.index)
                # before a packed module's own hook, which dequantises the rows this one copies
                first = packed_experts.packed_of(stack.module) is not None
                self._hooks[id(stack.module)] = stack.module.register_forward_pre_hook(
                    hook, with_kwargs=True, prepend=first
                )

    def start_pass(self, hidden: Optional[torch.Tensor]) -> None:
        """Decide for the pass that starts with ``hidden`` (batch x seq x hidden)."""
        routed = [stack for index in self._holes for stack in self.stacks[index] if stack.by_need]
        if not routed or hidden is None or hidden.dim() < 2:
            self.by_need = False
            return
        tokens = hidden.numel() // hidden.shape[-1]
        self.by_need = decide.copy_by_need(tokens, routed[0].top_k, routed[0].experts)

    def load_ranges(self, index: int) -> Optional[List[Tuple[int, int]]]:
        """The byte ranges a copy of layer ``index`` takes (None: its whole region)."""
        holes = self._holes.get(index)
        if holes is None or not self.by_need:
            return None
        return decide.ranges_outside(self.records[index].nbytes, holes)

    def loaded_whole(self, index: int) -> None:
        """A whole copy of layer ``index`` went into a slot: its experts count as copied."""
        for stack in self.stacks.get(index, ()):
            self.experts_copied += stack.experts

    def _hook(self, index: int):
        def before_experts(module: nn.Module, args: tuple, kwargs: dict):
            for stack in self.stacks.get(index, ()):
                if stack.module is module:
                    self._complete(self.records[index], stack, module, args, kwargs)

        return before_experts

    def _complete(self, record, stack, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Copy into the slot the rows of the experts this call reads that it lacks, and tell
        a packed module (``packed_experts``) to dequantise only those where it reads no other.

        Whether this call reads only the chosen rows is decided from the call itself (its
        tokens, as ``start_pass`` decides for a pass), not from the pass under way: a layer's
        recompute in backward may come after a pass of another size, and must compute on the
        stacks its forward computed on (a packed module's stacks of only the chosen rows)."""
        reads_chosen = stack.by_need and self.enabled and _few_tokens(stack, args) and self._last_hook(module)
        chosen = _chosen_rows(module, stack, args, kwargs) if reads_chosen else None
        packed = packed_experts.packed_of(module)
        if packed is not None:
            packed.rows = chosen  # None: every row
        tensors = [_bound(module, record.entries[p].name) for p in stack.positions]
        slot = self.pool.slot_of_pointer(tensors[0].data_ptr())
        if slot is None:  # in the window: whole
            return
        self.visits += 1
        present = self.pool.rows_present[slot]
        if present is None or not stack.by_need:
            return
        held = present.setdefault(id(module), set())  # each stack's own rows
        wanted = chosen if chosen is not None else range(stack.experts)
        missing = [row for row in wanted if row not in held]
        if not missing:
            return
        with torch.no_grad():
            for tensor, position in zip(tensors, stack.positions):
                host, slot_rows = record.arena_views[position], _unversioned(tensor)
                for first, past in decide.runs(missing):
                    slot_rows[first:past].copy_(host[first:past], non_blocking=True)
                    self.pool.h2d_bytes += host[first:past].numel() * host.element_size()
        if self.pool.cuda:  # a later pass on another stream waits for these rows, as for a load
            self.pool.ready[slot].record(torch.cuda.current_stream(self.pool.device))
        held.update(missing)
        self.experts_copied += len(missing)

    def _last_hook(self, module: nn.Module) -> bool:
        """Whether this runtime's hook is the last before the module's forward: a hook added
        after it may change which experts the forward reads (then every row is copied)."""
        handle = self._hooks.get(id(module))
        ids = list(module._forward_pre_hooks)
        if handle is None or handle.id not in ids:
            return False
        later = [module._forward_pre_hooks[i] for i in ids[ids.index(handle.id) + 1 :]]
        return all(packed_experts.keeps_choice(hook) for hook in later)

    def complete(self, index: int, slot: int) -> None:
        """Copy every row layer ``index`` lacks in ``slot``: before code other than the
        experts' forward reads or writes whole stacks there (a PEFT merge inside the call)."""
        present = self.pool.rows_present[slot]
        if present is None or index not in self._holes:
            return
        record = self.records[index]
        raw = _unversioned(self.pool.buffers[slot])
        with torch.no_grad():
            for begin, end in self._holes[index]:
                raw[begin:end].copy_(record.host_region[begin:end], non_blocking=True)
                self.pool.h2d_bytes += end - begin
        if self.pool.cuda:
            self.pool.ready[slot].record(torch.cuda.current_stream(self.pool.device))
        for stack in self.stacks[index]:
            if stack.by_need:
                self.experts_copied += stack.experts - len(present.get(id(stack.module), ()))
        self.pool.rows_present[slot] = None

    def stats(self) -> dict:
        return {"expert_visits": self.visits, "experts_copied": self.experts_copied}

    def close(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self.stacks = {}
        self._holes = {}


def _bound(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor the experts module computes with under ``name`` now (PEFT's adapter on
    the stack moves it into a parametrization's ``original``; a packed stack is a buffer)."""
    if nn.utils.parametrize.is_parametrized(module, name):
        return module.parametrizations[name].original
    if name in module._buffers:
        return module._buffers[name]
    return module._parameters[name]


def _unversioned(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as ``tensor`` under a version counter of its own.

    Every binding of a slot is a view of one buffer and shares its version counter, so an
    in-place copy through one of them would tell autograd that the weights this layer's
    attention saved a moment ago were modified, and its backward would refuse them. The
    rows written here are rows nothing has read yet."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _few_tokens(stack, args: tuple) -> bool:
    """Whether the experts call of these arguments (hidden states first, a row per token)
    carries few enough tokens to copy by need (``decide.copy_by_need``)."""
    hidden = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1 else None
    if hidden is None:
        return False
    tokens = hidden.numel() // max(hidden.shape[-1], 1)
    return decide.copy_by_need(tokens, stack.top_k, stack.experts)


def _chosen_rows(module: nn.Module, stack, args: tuple, kwargs: dict) -> List[int]:
    """The rows this experts call reads: the chosen experts where it reads by expert, else
    all of them."""
    everything = list(range(stack.experts))
    if not stacks_of.reads_only_chosen(module):
        return everything
    chosen = stacks_of.chosen(args, kwargs)
    if chosen is None:
        return everything
    rows = torch.unique(chosen).tolist()  # waits for the router: the price of copying by need
    return [row for row in rows if 0 <= row < stack.experts]
