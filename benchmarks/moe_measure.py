"""Measuring a mixture-of-experts model's training steps and token steps (moe.py's pieces):
step timing with the device synchronised, greedy decoding timed token step by token step,
which experts each layer's router chose, and the copy bounds those choices give."""

from __future__ import annotations

import statistics
import time

import torch

from common import greedy_tokens, pinned_bandwidth

GiB = 1 << 30


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_to_device_gbps(dry_run: bool) -> float:
    """Pinned host-to-device GB/s, measured now (a host-to-host copy on the CPU)."""
    if not dry_run and torch.cuda.is_available():
        gbps = pinned_bandwidth()
        torch.cuda.empty_cache()  # its buffers' blocks, out of the caps measured after it
        return gbps
    src, dst = torch.ones(16 << 20), torch.empty(16 << 20)
    start = time.perf_counter()
    dst.copy_(src)
    return src.numel() * src.element_size() / max(time.perf_counter() - start, 1e-9) / 1e9


def peaks() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else None,
    }


class RoutedExperts:
    """Which experts each decoder layer's router chose, call by call: a hook before each
    experts module's forward reads its second argument (the chosen indices; the same in
    Qwen3-MoE, Mixtral and gpt-oss) and marks them in a device mask, without a sync."""

    def __init__(self, layers):
        self.calls: dict = {}
        self.experts: dict = {}  # layer -> (experts, bytes per expert as the store holds them)
        self.handles = []
        for index, layer in enumerate(layers):
            module = getattr(getattr(layer, "mlp", None), "experts", None)
            params = list(module.parameters()) if module is not None else []
            if not params:
                continue
            count = params[0].shape[0]
            self.experts[index] = (count, sum(p.numel() * p.element_size() for p in params) // count)
            self.handles.append(module.register_forward_pre_hook(self._hook(index, count)))
        self.reset()

    def _hook(self, index: int, count: int):
        def mark(module, args):
            chosen = args[1]
            mask = torch.zeros(count, dtype=torch.bool, device=chosen.device)
            mask[chosen.reshape(-1)] = True
            self.calls[index].append(mask)

        return mark

    def reset(self) -> None:
        self.calls = {index: [] for index in self.experts}

    def distinct(self, skip_first: bool = False) -> dict:
        """layer -> experts chosen in each call (the first call left out: a prefill)."""
        return {i: [int(m.sum()) for m in calls[1 if skip_first else 0 :]] for i, calls in self.calls.items()}

    def share(self) -> float | None:
        """The mean share of a layer's experts one call chose."""
        shares = [n / self.experts[i][0] for i, counts in self.distinct().items() for n in counts]
        return statistics.mean(shares) if shares else None


def counter_delta(before: dict, after: dict, name: str):
    if before.get(name) is None or after.get(name) is None:
        return None
    return after[name] - before[name]


def per_visit(copied, visits):
    return copied / visits if copied is not None and visits else None


def train_steps(model, ids, steps: int, warmup: int, at_timed_steps=None):
    """Step times (seconds) of the timed steps, every step's loss, and the peaks over all of
    them, of AdamW steps on the trainable parameters; ``at_timed_steps()`` is called once the
    warm-up steps are done."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    model.train()
    times, losses = [], []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for index in range(warmup + steps):
        synchronize()
        if index == warmup and at_timed_steps is not None:
            at_timed_steps()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times[warmup:], losses, peaks()


class StepClock:
    """A stopping criterion that stops nothing: it notes when each token step ended, and calls
    ``after_prefill()`` once the first one (the prompt's) has."""

    def __init__(self, after_prefill=None):
        self.marks, self.after_prefill = [], after_prefill

    def __call__(self, input_ids, scores, **kwargs):
        synchronize()
        self.marks.append(time.perf_counter())
        if len(self.marks) == 1 and self.after_prefill is not None:
            self.after_prefill()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def decode_steps(model, batch, prompt_tokens, new_tokens, device, vocab, after_prefill=None) -> tuple:
    """Greedy generation of ``new_tokens`` after a random prompt of ``prompt_tokens``: each
    token step's time after the prefill (seconds) and the peaks (``StepClock`` for
    ``after_prefill``)."""
    from transformers import StoppingCriteriaList

    model.eval()
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).to(device)
    clock = StepClock(after_prefill)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model.generate(**greedy_tokens(ids, new_tokens), stopping_criteria=StoppingCriteriaList([clock]))
    return [b - a for a, b in zip(clock.marks, clock.marks[1:])], peaks()


def streamed_layer_bytes(runtime) -> dict:
    """layer -> bytes of its region, for the layers that stream (not the window's)."""
    window = set(runtime.window)
    return {r.index: r.nbytes for r in runtime.records if r.index not in window}


def by_need_bound_s(routing: RoutedExperts, layer_bytes: dict, slots: int, gbps: float) -> float:
    """One token step's copies if each copied layer brought its non-expert bytes and only the
    experts its router chose, the ``slots`` smallest layers held from the step before."""
    chosen = routing.distinct(skip_first=True)
    per_layer = []
    for index, nbytes in layer_bytes.items():
        if index in routing.experts and chosen[index]:
            count, expert = routing.experts[index]
            nbytes += (statistics.mean(chosen[index]) - count) * expert
        per_layer.append(nbytes)
    return sum(sorted(per_layer)[min(slots, len(per_layer)) :]) / (gbps * 1e9)
