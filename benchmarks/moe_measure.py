"""Measuring a mixture-of-experts model's training steps and token steps (moe.py's pieces):
TRL's SFTTrainer steps on the in-memory model, timed by capped.py's step callback (the
loss users train this model with: TRL's fused log-prob head, which never holds the full
logits), greedy decoding timed token step by token step, which experts each layer's router
chose, and the copy bounds those choices give."""

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
            # MXFP4 stacks kept packed are buffers (gpt-oss as published)
            params += [b for n, b in module.named_buffers() if n.endswith(("_blocks", "_scales"))]
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

        mark._layerstream_keeps_choice = True  # it reads the choice only: copies by need stay on
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


def failed(row: dict, error: BaseException) -> dict:
    """A row whose run raised (out of memory under the cap, say): said, not dropped."""
    print(f"moe: {row['case']} {row['kind']} failed: {error!r}", flush=True)
    said = f"{type(error).__name__}: {error}"[:2000]
    return dict(row, trained=False, out_of_memory="out of memory" in said.lower(), error=said)


def finish(row: dict) -> None:
    """Ratios of a row, where its figures are there."""
    if row.get("step_s"):
        if row.get("copy_bound_s") is not None:
            row["fraction_of_copy_bound"] = row["copy_bound_s"] / row["step_s"]
        if row.get("resident_step_s") and row.get("speed_vs_resident") is None:
            row["speed_vs_resident"] = row["resident_step_s"] / row["step_s"]
    if row.get("decode_ms"):
        row["fraction_of_copy_bound"] = row["copy_bound_ms"] / row["decode_ms"]
        row["fraction_of_by_need_bound"] = row["by_need_copy_bound_ms"] / row["decode_ms"]
        if row.get("resident_decode_ms"):
            row["speed_vs_resident"] = row["resident_decode_ms"] / row["decode_ms"]


def counter_delta(before: dict, after: dict, name: str):
    if before.get(name) is None or after.get(name) is None:
        return None
    return after[name] - before[name]


def per_visit(copied, visits):
    return copied / visits if copied is not None and visits else None


def at_step(step: int, fn):
    """A Trainer callback that calls ``fn()`` as step ``step`` (counted from 0) begins."""
    from transformers import TrainerCallback

    class AtStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                fn()

    return AtStep()


def token_rows(rows: int, tokens: int, vocab: int):
    """``rows`` rows of exactly ``tokens`` random token ids, tokenized as SFTTrainer takes
    them (an ``input_ids`` column: it adds labels and truncates nothing)."""
    from datasets import Dataset

    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    return Dataset.from_dict({"input_ids": ids.tolist()})


def sft_trainer(model, data, steps: int, tokens: int, output_dir: str, use_cpu: bool, callbacks: list):
    """TRL's SFTTrainer on the in-memory model as a user sets it up: its defaults (the fused
    log-prob head, gradient checkpointing), bf16, batch 1, ``max_length`` ``tokens``."""
    from trl import SFTConfig, SFTTrainer

    from layerstream.data import byte_tokenizer

    config = SFTConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=1,
        max_length=tokens,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=True,
        use_cpu=use_cpu,
        seed=0,
    )
    return SFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=byte_tokenizer(), callbacks=callbacks
    )


def sft_steps(model, data, case, device: str, output_dir: str, at_timed_steps=None):
    """Step times (seconds) of the timed steps of ``case`` (after its warm-up steps), every
    step's logged loss, and the peaks over all of them, of SFTTrainer steps on ``data``;
    ``at_timed_steps()`` is called as the first timed step begins."""
    from capped import step_times_class

    clock = step_times_class()()
    callbacks = [at_step(case.warmup, at_timed_steps)] if at_timed_steps is not None else []
    steps = case.warmup + case.steps
    trainer = sft_trainer(model, data, steps, case.tokens, output_dir, device == "cpu", callbacks + [clock])
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [entry["loss"] for entry in clock.logs if "loss" in entry]
    return clock.times[case.warmup :], losses, peaks()


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
    # TRL's SFTTrainer turns the config's output_router_logits on for the load-balancing
    # loss; generating with it on, transformers 5.17 computes that loss from the new tokens'
    # router logits against the whole attention mask and fails at batch > 1 (8 against
    # 8 x 129). Decoding needs no router loss: off for the call, as it was before training.
    config = model.config.get_text_config()
    router_logits = getattr(config, "output_router_logits", None)
    if router_logits:
        config.output_router_logits = False
    try:
        with torch.no_grad():
            model.generate(**greedy_tokens(ids, new_tokens), stopping_criteria=StoppingCriteriaList([clock]))
    finally:
        if router_logits:
            config.output_router_logits = router_logits
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


def trainable_state(model) -> dict:
    """A copy of the trainable parameters (the adapters), by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, state: dict) -> None:
    """The adapters back as ``trainable_state`` copied them: the next run starts where the
    first did."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
