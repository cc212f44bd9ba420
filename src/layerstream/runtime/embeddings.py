"""The model's two ends, the input embedding and the output head, kept in host memory.

Why: with the decoder layers streamed, the embedding and an untied head are the largest
weights left on the GPU (Llama-3-70B: 2 x 2.1 GB of bf16), and each is touched only once
per forward. ``StreamConfig(stream_embeddings=True)`` keeps both in (pinned) host memory:

- The embedding lookup is a gather, that is a copy of rows. The ids come to the host (one
  device-to-host sync per forward), the rows are gathered there (into page-locked memory
  when the store is pinned, so their copy is asynchronous), and only the rows are copied to
  the device: bit for bit the resident lookup.
- The head's weight is copied to the device for the forward (``HeadLinear``) and dropped
  after it; backward copies it again and computes the input's gradient with the kernel
  autograd runs for ``F.linear``, so the gradient is bit for bit a resident head's. No
  device copy outlives the call: the cost is one head of transient device memory and
  two head copies per training step. A head tied to the embedding streams from the
  embedding's single host copy. TRL's fused loss, which reads the head's weight itself
  instead of calling the head, is handed a device copy too (``trl_head``).
- Both stay the model's own module objects (hooks registered on them run, e.g. PEFT's
  ``enable_input_require_grads``). Their class is swapped for a subclass that replaces
  ``nn.Embedding.forward`` / ``nn.Linear.forward`` *below* any forward of the module's
  own class (Gemma3's scaled embedding then multiplies the rows on the device), and
  whose ``_apply`` hides the host weight from ``.to()``/``.cuda()``.
- The weights must be frozen: their gradients would have nowhere to live.
- transformers reads a model's device from its first parameter, the embedding weight,
  which now lives on the host; ``generate`` then moves its inputs there. Each
  transformers model in the module tree gets a class whose ``device`` is the device
  the model computes on.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import StreamingError
from ..long import chunked_loss, trl_head
from ..modules import discovery, nf4, swap
from ..modules.aliases import storage_owners
from ..modules.discovery import unwrap_peft
from ..system.log import get_logger
from ..tiers.store import HostStore, LayerRecord, set_data
from ..units import GiB
from . import ends_in_place
from .ends_rows import gather_rows

logger = get_logger(__name__)

_FIX = (
    "freeze it (PEFT does, unless modules_to_save or target_modules name it), or stream "
    "with stream_embeddings=False to keep it trainable on the GPU"
)


@dataclass
class Ends:
    """The input embedding and the output head of a model, with their module names."""

    embedding: nn.Embedding
    embedding_name: str
    head: Optional[nn.Linear]
    head_name: Optional[str]

    @property
    def tied(self) -> bool:
        return self.head is not None and self.head.weight is self.embedding.weight

    def weights(self) -> List[Tuple[str, nn.Parameter]]:
        """(qualified name, weight) of each weight that streams, the shared one once."""
        out = [(f"{self.embedding_name}.weight", self.embedding.weight)]
        if self.head is not None and not self.tied:
            out.append((f"{self.head_name}.weight", self.head.weight))
        return out


class _Reached(Exception):
    """Raised by the streamed forward while a module's class is being probed."""


class _Probe:
    def embed(self, module, ids):
        raise _Reached

    def head(self, module, x):
        raise _Reached


class _WeightStaysOnHost:
    """``model.to(...)`` and friends skip a streamed end's weight, which lives in host
    memory, after the ends have checked the call."""

    def _apply(self, fn, recurse=True):
        self._layerstream_ends.check_apply(fn)
        with swap.tensors_hidden([(self._parameters, {"weight"})]):
            return super()._apply(fn, recurse)


class StreamedEmbedding(_WeightStaysOnHost, nn.Embedding):
    """What replaces ``nn.Embedding`` under the module's own class while it streams."""

    replaces = nn.Embedding

    def forward(self, input):
        return self._layerstream_ends.embed(self, input)


class StreamedHead(_WeightStaysOnHost, nn.Linear):
    """What replaces ``nn.Linear`` under the head's own class while it streams."""

    replaces = nn.Linear

    def forward(self, input):
        return self._layerstream_ends.head(self, input)


def _swap(module: nn.Module, replacement: type, ends) -> None:
    swap.swap_in(module, replacement)
    object.__setattr__(module, "_layerstream_ends", ends)


def _make_plain(module: nn.Module, replacement: type) -> None:
    swap.swap_out(module, replacement)
    module.__dict__.pop("_layerstream_ends", None)


class ComputeDevice:
    """Mixed in front of a transformers model's class while its embedding streams:
    ``device`` (the first parameter's, in transformers) is where the model computes."""

    @property
    def device(self) -> torch.device:
        return self._layerstream_ends.device

    def get_output_embeddings(self):
        """The head; to TRL's fused loss, which reads the head's weight itself instead of
        calling the head, a stand-in holding a device copy of the weight (``trl_head``)."""
        head, ends = super().get_output_embeddings(), self._layerstream_ends
        if head is not None and head is ends.found.head and trl_head.reads_head_itself(sys._getframe(1)):
            return trl_head.DeviceHead(head, ends.head_weight)
        return head


def _transformers_models(model: nn.Module) -> List[nn.Module]:
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


def _swap_device(model: nn.Module, ends) -> List[nn.Module]:
    swapped = _transformers_models(model)
    for module in swapped:
        _swap(module, ComputeDevice, ends)
    return swapped


# -- finding and checking -------------------------------------------------------------------
def _wrapper_hint(module: nn.Module) -> str:
    if hasattr(module, "base_layer") or hasattr(module, "modules_to_save"):
        return (
            " PEFT wraps it (its target_modules or modules_to_save name it), so it would be "
            "trained; leave it out of the PEFT config, or stream with stream_embeddings=False."
        )
    return " Stream with stream_embeddings=False."


def trainables_chosen(model: nn.Module) -> bool:
    """Whether what trains has been chosen: some parameter that could train is frozen (by
    PEFT or by hand). Fresh from from_pretrained none is (bitsandbytes' 4-bit weights,
    frozen as loaded, cannot train, and statistics a class freezes as it builds them say
    nothing), and PEFT freezes the embedding and head later; once it is chosen, an
    embedding or head that still requires grad is meant to train."""
    return discovery.trainables_chosen(model, lambda p: p.dtype.is_floating_point and not nf4.is_4bit_param(p))


def _check_weight(name: str, weight: torch.Tensor, chosen: bool) -> None:
    if weight.device.type == "meta":
        raise StreamingError(
            f"{name} is on the meta device (no weights loaded). Load real weights before stream_model."
        )
    if weight.device.type not in ("cpu", "cuda"):
        raise StreamingError(
            f"{name} is on {weight.device}; stream_embeddings copies the embedding and head into host "
            "memory from the CPU or a CUDA GPU. Load the model on the CPU (or a CUDA GPU) first."
        )
    if not weight.dtype.is_floating_point or nf4.is_4bit_param(weight):
        raise StreamingError(
            f"{name} is quantised ({type(weight).__name__}, {weight.dtype}); "
            "stream_embeddings streams unquantised weights only. Stream with stream_embeddings=False."
        )
    if weight.requires_grad and chosen:
        raise StreamingError(
            f"{name} requires grad, but stream_embeddings keeps it in host memory, frozen "
            f"(its gradient would have nowhere to live): {_FIX}."
        )


def _probe(module: nn.Module, replacement: type, dummy: torch.Tensor, name: str, base: str) -> None:
    """Refuse a module whose own forward never reaches ``base.forward``: its lookup or
    matmul would read the host weight where the streamed code cannot step in."""
    _swap(module, replacement, _Probe())
    reached, problem = False, ""
    try:
        with torch.no_grad(), chunked_loss.not_capturing():  # the chunked loss may be computing now
            module.forward(dummy)
    except _Reached:
        reached = True
    except Exception as exc:  # noqa: BLE001 - reported below
        problem = f" (it raised {type(exc).__name__}: {exc})"
    finally:
        _make_plain(module, replacement)
    if not reached:
        raise StreamingError(
            f"{name} is a {type(module).__name__} whose forward does not call {base}.forward"
            f"{problem}, so layerstream cannot move its weight to the host. Stream with "
            "stream_embeddings=False."
        )


def find_ends(model: nn.Module) -> Ends:
    """The input embedding and output head of ``model`` (plain or PEFT-wrapped), checked
    before anything is copied: bad input gets an error that says what to do. A weight that
    requires grad is refused here when the trainable set is chosen (``trainables_chosen``),
    otherwise at the first forward with autograd on."""
    chosen = trainables_chosen(model)
    inner = unwrap_peft(model)
    names = {id(m): n for n, m in model.named_modules()}
    embedding = inner.get_input_embeddings()
    if embedding is None:
        raise StreamingError(
            "stream_embeddings=True: the model has no input embedding "
            "(get_input_embeddings() is None). Stream with stream_embeddings=False."
        )
    emb_name = names.get(id(embedding), "input embedding")
    if not isinstance(embedding, nn.Embedding):
        raise StreamingError(
            f"stream_embeddings=True streams an nn.Embedding, but {emb_name} is a "
            f"{type(embedding).__name__}.{_wrapper_hint(embedding)}"
        )
    if embedding.max_norm is not None:
        raise StreamingError(
            f"{emb_name} has max_norm={embedding.max_norm}: the lookup would renormalise rows of the "
            "weight in place, on the host instead of the GPU, which is not bit for bit the same. Set "
            "max_norm=None or stream with stream_embeddings=False."
        )
    _check_weight(f"{emb_name}.weight", embedding.weight, chosen)
    try:
        head = inner.get_output_embeddings()
    except NotImplementedError:
        head = None
    head_name = names.get(id(head), "output head") if head is not None else None
    if head is not None and head.weight is not embedding.weight:
        if not isinstance(head, nn.Linear):
            raise StreamingError(
                f"stream_embeddings=True streams an nn.Linear head, but {head_name} is a "
                f"{type(head).__name__}.{_wrapper_hint(head)}"
            )
        if head.weight.data_ptr() == embedding.weight.data_ptr():
            raise StreamingError(
                f"{head_name}.weight shares memory with {emb_name}.weight without being the same "
                "Parameter; tie them (model.tie_weights()) or untie them before stream_model."
            )
        _check_weight(f"{head_name}.weight", head.weight, chosen)
        if head.bias is not None and head.bias.requires_grad and chosen:
            raise StreamingError(
                f"{head_name}.bias requires grad; the streamed head computes no gradient for its bias: {_FIX}."
            )
    found = Ends(embedding, emb_name, head, head_name)
    _probe(embedding, StreamedEmbedding, torch.zeros(1, 1, dtype=torch.long), emb_name, "nn.Embedding")
    if head is not None:
        dummy = torch.zeros(1, 1, head.in_features, dtype=head.weight.dtype)
        _probe(head, StreamedHead, dummy, head_name, "nn.Linear")
    return found


# -- the head's matmul ----------------------------------------------------------------------
def _folds(shape, strides) -> bool:
    """Whether torch.matmul folds an input of 3+ dims into one matrix (mm) rather than
    batching it (bmm): when its leading dims can merge without a copy (at::should_fold
    for a weight that needs no gradient)."""
    return all(strides[i] == strides[i + 1] * shape[i + 1] for i in range(len(shape) - 2))


def linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, shape, strides) -> torch.Tensor:
    """The gradient autograd gives the input of ``F.linear(x, weight, bias)`` when the
    weight needs none; ``shape``/``strides`` are x's.

    at::linear runs ``mm`` (``addmm`` with a bias) on x folded to a matrix, or ``bmm``
    when matmul cannot fold it. Their backward for the input is mm_mat1_backward,
    ``grad @ weight`` (``(weight.t() @ grad.t()).t()`` for a column-major input), and
    ``grad.bmm(weight expanded)``. Running the same kernel on the same operands keeps the
    result bit for bit what a resident head's backward gives.
    """
    out_features, in_features = weight.shape
    if len(shape) >= 3 and not _folds(shape, strides):
        batch = math.prod(shape[:-2])
        grad3d = grad.reshape(batch, shape[-2], out_features)
        return grad3d.bmm(weight.expand(batch, out_features, in_features)).reshape(shape)
    grad2d = grad.reshape(-1, out_features)
    if len(shape) >= 2 and strides[-2] == 1 and strides[-1] == grad2d.shape[0]:
        return weight.t().mm(grad2d.t()).t().reshape(shape)
    return grad2d.mm(weight).reshape(shape)


class HeadLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with a host weight that is copied to the device for the
    forward and again for the backward, and never kept: ``fetch`` makes the copy, only the
    host weight is saved (its version counter still catches in-place writes between
    forward and backward, as for a resident weight)."""

    @staticmethod
    def forward(ctx, x, host_weight, bias, fetch):
        weight = fetch(host_weight)
        # at::matmul folds a strided input (logits_to_keep's last position) into one mm or
        # batches it by whether the weight requires grad, even with grad off: the copy says
        # what the resident weight would, so generation picks the resident head's kernel
        weight.requires_grad_(host_weight.requires_grad)
        out = F.linear(x, weight, bias)  # under autocast this casts x, weight, bias as resident does
        # the value this forward used: a later ``.data`` swap of the Parameter does not reach
        # this backward (as for a resident weight); an in-place write still bumps the version
        ctx.save_for_backward(host_weight.detach())
        ctx.fetch = fetch
        ctx.compute_dtype = out.dtype
        ctx.input = (tuple(x.shape), tuple(x.stride()), x.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (host_weight,) = ctx.saved_tensors
        weight = ctx.fetch(host_weight)
        if weight.dtype != ctx.compute_dtype:  # what autocast did to the weight in forward
            weight = weight.to(ctx.compute_dtype)
        shape, strides, dtype = ctx.input
        return linear_input_grad(grad, weight, shape, strides).to(dtype), None, None, None


def _shared_elsewhere(weight: torch.Tensor) -> bool:
    """Whether another tensor holds the storage of ``weight``'s data. The count is of the
    storage's owners: the Parameter and the storage object asked here make two. Where torch
    does not offer the count, every swap counts as shared (and is refused)."""
    owners = storage_owners(weight)
    return owners is None or owners > 2


# -- the streamed ends ----------------------------------------------------------------------
class StreamedEnds:
    """The embedding and head of one streamed model: their host store, the calls that
    use it, and what they copied."""

    def __init__(self, runtime, found: Ends, records: List[LayerRecord], store: HostStore):
        self.runtime = runtime
        self.pool = runtime.pool
        self.device = runtime.device
        self.found = found
        self._hold(records, store)
        self.head_copies = 0
        self.head_h2d_bytes = 0
        self.embedding_h2d_bytes = 0
        self.models: List[nn.Module] = []  # transformers models whose device this reports
        self._hooks: List = []  # their forward pre-hooks (``watch_models``)

    @property
    def tied(self) -> bool:
        return self.found.tied

    def _hold(self, records: List[LayerRecord], store: HostStore) -> None:
        """Keep ``store`` as the ends' host copy, and where each weight's data lives in it:
        id(weight) -> (qualified name, host data pointer), what the calls check."""
        self.records, self.store = records, store
        self._host = {id(w): (n, w.data_ptr()) for n, w in self.found.weights()}

    @property
    def dtypes(self) -> set:
        """The weights' dtypes as they are now (a swap not yet adopted included), which a
        ``.to()`` must not change."""
        return {weight.dtype for _, weight in self.found.weights()}

    @property
    def host_bytes(self) -> int:
        return self.store.host_bytes

    def _check(self, weight: torch.Tensor, what: str) -> None:
        known = self._host.get(id(weight))
        if known is not None and weight.data_ptr() != known[1]:
            self._adopt(weight, what)
            known = self._host[id(weight)]
        if known is None:
            raise StreamingError(
                f"the {what} weight is no longer the one layerstream keeps in host memory (the module "
                "was copied or its weight replaced by another Parameter after stream_model). Make such "
                "changes before stream_model, or unstream_model first."
            )
        if weight.requires_grad and torch.is_grad_enabled():
            raise StreamingError(
                f"{known[0]} requires grad, but stream_embeddings keeps it in host "
                f"memory, frozen (its gradient would have nowhere to live): {_FIX}."
            )

    def _adopt(self, weight: torch.Tensor, what: str) -> None:
        """The same Parameter now holds other data: a ``.data`` swap, as PEFT's
        ``prepare_model_for_kbit_training`` casts the ends to float32. A resident model would
        compute with the new value, so it becomes the host copy (a new store, pinned as the
        old one); data put on another device is refused, since these weights stay on the host."""
        for name, swapped in self.found.weights():  # every end whose data changed, not only this one
            if swapped.data_ptr() == self._host[id(swapped)][1]:
                continue
            if swapped.device.type != "cpu":
                raise StreamingError(
                    f"the streamed weight {name} was replaced by data on {swapped.device} after "
                    "stream_model; stream_embeddings keeps it in host memory. Replace it with a host "
                    "tensor, or unstream_model first."
                )
            if _shared_elsewhere(swapped):
                raise StreamingError(
                    f"the data swapped into the streamed weight {name} after stream_model is shared "
                    "with another tensor (a view of it, a tensor still held, or the other end of the "
                    "model). layerstream would copy it into host memory of its own, and writes through "
                    "that other tensor would no longer reach the model. Swap in data of its own (e.g. "
                    ".clone()), or unstream_model first."
                )
        old = self.store
        self._hold(*_host_store(self.found, self.runtime.config))
        old.release()
        logger.warning(
            "layerstream: the streamed %s weight was replaced after stream_model (now %s, e.g. cast by "
            "prepare_model_for_kbit_training); the host copy holds the new value: %.2f GiB.",
            what,
            str(weight.dtype).replace("torch.", ""),
            self.store.host_bytes / GiB,
        )

    def embed(self, module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        self._check(weight, "input embedding")
        if module.max_norm is not None:
            raise StreamingError(
                "max_norm was set on the streamed input embedding after stream_model; unstream_model first."
            )
        rows = gather_rows(weight.detach(), ids.to("cpu"), pinned=self.pool.cuda and bool(self.runtime.config.pin))
        self.embedding_h2d_bytes += rows.numel() * rows.element_size()
        return self.pool.fetch(rows)

    def head(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        self._check(weight, "head")
        if bias is not None and bias.requires_grad and torch.is_grad_enabled():
            raise StreamingError(
                f"the streamed head's bias requires grad; the streamed head computes no gradient for its bias: {_FIX}."
            )
        if x.device != self.device:
            raise StreamingError(
                f"the streamed head computes on {self.device} but its input is on {x.device}. Move the "
                f"model's resident part with model.to('{self.device}') after stream_model."
            )
        return HeadLinear.apply(x, weight, bias, self._fetch_head)

    def head_weight(self, module: nn.Linear) -> torch.Tensor:
        """A device copy of the head's weight for a caller that runs the head's ``F.linear``
        itself (the chunked loss: one copy for all its chunks), checked as ``head`` checks."""
        self._check(module.weight, "head")
        return self._fetch_head(module.weight)

    def _fetch_head(self, host_weight: torch.Tensor) -> torch.Tensor:
        self.head_copies += 1
        self.head_h2d_bytes += host_weight.numel() * host_weight.element_size()
        return self.pool.fetch(host_weight)

    def check_apply(self, fn) -> None:
        self.runtime.check_apply(fn, self.dtypes)

    def stats(self) -> dict:
        return {
            "head_copies": self.head_copies,
            "head_h2d_bytes": self.head_h2d_bytes,
            "embedding_h2d_bytes": self.embedding_h2d_bytes,
        }

    def describe(self) -> str:
        """One summary line: what streams and what it costs."""
        head = self.found.head
        if head is None:
            what = "input embedding (the model has no output head)"
        elif self.tied:
            what = "input embedding and the head tied to it (one host copy)"
        else:
            what = "input embedding and head"
        copies = "" if head is None else "; the head is copied to the device for each forward and backward"
        return f"{what}, {self.host_bytes / GiB:.3f} GiB in host memory{copies}"

    def copies_out(self, target: torch.device) -> List[torch.Tensor]:
        """A copy of each weight on ``target``, memory of its own (``restore`` takes them)."""
        return [weight.detach().to(target, copy=True) for _, weight in self.found.weights()]

    def restore(self, copies: List[torch.Tensor]) -> None:
        """Point each weight at its copy and restore the modules' classes: assignments and
        class swaps only, each safe to make twice (an interrupted unstream_model, again)."""
        for (_, weight), copy in zip(self.found.weights(), copies):
            set_data(weight, copy)
        _make_plain(self.found.embedding, StreamedEmbedding)
        if self.found.head is not None:
            _make_plain(self.found.head, StreamedHead)
        for module in self.models:
            _make_plain(module, ComputeDevice)
        for hook in self._hooks:
            hook.remove()
        self.models, self._hooks = [], []

    def watch_models(self) -> None:
        """At each forward of a transformers model in the tree (the backbone called alone
        included, as TRL's losses call it), refuse code that goes around a streamed end
        (``ends_in_place``): a few attribute reads per forward."""
        outer = self.models[0]
        self._hooks = [m.register_forward_pre_hook(lambda *_: ends_in_place.check(self, outer)) for m in self.models]

    def close(self) -> None:
        self.store.release()


def _host_store(found: Ends, config) -> Tuple[List[LayerRecord], HostStore]:
    """The ends' weights copied into a host store of their own (pinned as ``config`` says),
    the weights pointed at it: one record each (a tied head has none of its own)."""
    records = []
    for index, (name, weight) in enumerate(found.weights()):
        module = found.embedding if index == 0 else found.head
        records.append(HostStore.plan_layer(index, name.rsplit(".", 1)[0], module, lambda t, w=weight: t is w))
    store = HostStore(config.arena_bytes, pin=bool(config.pin))
    # weights on the GPU free no host memory as they are copied: the whole store is new
    from_gpu = any(weight.device.type == "cuda" for _, weight in found.weights())
    store.build(records, new_bytes=sum(r.nbytes for r in records) if from_gpu else None)
    return records, store


def stream_embeddings(model: nn.Module, runtime) -> StreamedEnds:
    """Move ``model``'s embedding and head weights into a host store of their own (pinned
    as the runtime's config says) and swap the modules' classes."""
    found = find_ends(model)
    on_gpu = sorted({str(weight.device) for _, weight in found.weights() if weight.device.type == "cuda"})
    records, store = _host_store(found, runtime.config)
    if on_gpu:  # their GPU copies are unreferenced now (the Parameters hold host memory)
        torch.cuda.empty_cache()
        logger.warning(
            "layerstream: the embedding and head were on %s; their weights (%.2f GiB) moved into host "
            "memory (stream_embeddings) and their GPU memory was freed.",
            ", ".join(on_gpu),
            store.host_bytes / GiB,
        )
    ends = StreamedEnds(runtime, found, records, store)
    _swap(found.embedding, StreamedEmbedding, ends)
    if found.head is not None:
        _swap(found.head, StreamedHead, ends)
    ends.models = _swap_device(model, ends)
    if ends.models:
        ends.watch_models()
    return ends


def host_bytes(model: nn.Module) -> int:
    """Bytes of the embedding and (untied) head weights: what stream_embeddings=True would
    take off the GPU (0 where there is no embedding)."""
    inner = unwrap_peft(model)
    get = getattr(inner, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if embedding is None or not isinstance(getattr(embedding, "weight", None), torch.Tensor):
        return 0
    total = embedding.weight.numel() * embedding.weight.element_size()
    try:
        head = inner.get_output_embeddings()
    except NotImplementedError:
        head = None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight is not embedding.weight:
        total += weight.numel() * weight.element_size()
    return total
