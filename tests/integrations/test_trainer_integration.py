"""The Trainer paths: an unchanged script under `layerstream run`, StreamingArguments
flags, and a streamed model handed to a Trainer; stats reach log_history."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

import layerstream
from layerstream.commands import cli
from layerstream.integrations import launch

from tiny import peft_pair

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_trainer.py")
STAT_KEYS = {
    "layerstream/h2d_gbps",
    "layerstream/stall_fraction",
    "layerstream/layer_loads",
    "layerstream/peak_resident_layers",
    "layerstream/alloc_retries",
}


def _script_args(out):
    return [
        "--output_dir",
        str(out),
        "--max_steps",
        "6",
        "--logging_steps",
        "2",
        "--report_to",
        "none",
        "--use_cpu",
        "--save_strategy",
        "no",
        "--per_device_train_batch_size",
        "4",
    ]


def _history(out):
    return json.loads((Path(out) / "trainer_state.json").read_text())["log_history"]


def _losses(history):
    return [entry["loss"] for entry in history if "loss" in entry]


@pytest.fixture(autouse=True)
def _no_auto_stream_left_over():
    yield
    launch.disable()


def test_unchanged_script_under_the_launcher_matches_the_plain_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT] + _script_args(tmp_path / "plain"))
    runpy.run_path(SCRIPT, run_name="__main__")
    assert cli.main(["run", "--slots", "2", "--device", "cpu", SCRIPT] + _script_args(tmp_path / "streamed")) == 0
    plain, streamed = _history(tmp_path / "plain"), _history(tmp_path / "streamed")
    assert len(_losses(plain)) == 3 and _losses(streamed) == _losses(plain)
    logged = [entry for entry in streamed if "loss" in entry]
    assert all(STAT_KEYS <= set(entry) for entry in logged)
    assert sum(entry["layerstream/layer_loads"] for entry in logged) > 0
    assert not any(key.startswith("layerstream/") for entry in plain for key in entry)


def test_streaming_arguments_carry_backward_slots_and_refuse_bad_ones():
    parser = HfArgumentParser((layerstream.StreamingArguments,))
    (streaming,) = parser.parse_args_into_dataclasses(
        ["--layer_stream_backward_slots", "1", "--layer_stream_device", "cpu"]
    )
    assert streaming.to_config().backward_slots == 1
    (streaming,) = parser.parse_args_into_dataclasses(["--layer_stream_device", "cpu"])
    assert streaming.to_config().backward_slots == "auto"
    with pytest.raises(layerstream.StreamConfigError, match="layer_stream_backward_slots"):
        parser.parse_args_into_dataclasses(["--layer_stream_backward_slots", "some", "--layer_stream_device", "cpu"])


def test_streaming_settings_without_layer_stream_are_checked_and_said_not_ignored(caplog):
    """Without --layer_stream nothing streams: a bad value is refused all the same, and good
    ones are said to take no effect unless the script passes them on itself."""
    parser = HfArgumentParser((layerstream.StreamingArguments,))
    with pytest.raises(layerstream.StreamConfigError, match="layer_stream_loss_chunk_tokens must be an integer"):
        parser.parse_args_into_dataclasses(["--layer_stream_loss_chunk_tokens", "abc"])
    with caplog.at_level("WARNING", logger="layerstream"):
        (streaming,) = parser.parse_args_into_dataclasses(["--layer_stream_slots", "3"])
    assert not streaming.layer_stream
    assert "--layer_stream_slots given without --layer_stream" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="layerstream"):
        parser.parse_args_into_dataclasses([])
    assert "without --layer_stream" not in caplog.text  # control: the defaults say nothing


def test_streaming_arguments_flags_stream_the_trainers_model(tmp_path):
    (streaming,) = HfArgumentParser((layerstream.StreamingArguments,)).parse_args_into_dataclasses(
        ["--layer_stream", "--layer_stream_slots", "2", "--layer_stream_device", "cpu"]
    )
    assert streaming.layer_stream
    model, _ = peft_pair("llama", layers=3)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    Trainer(model=model, args=args)
    assert layerstream.is_streamed(model)
    assert layerstream.get_runtime(model).config.slots == 2


def test_a_streamed_model_handed_to_a_trainer_gets_the_stats_callback(tmp_path):
    model, _ = peft_pair("llama", layers=3)
    layerstream.stream_model(model, device="cpu", slots=2)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = Trainer(model=model, args=args)
    assert any(isinstance(cb, layerstream.StreamStatsCallback) for cb in trainer.callback_handler.callbacks)


def test_launcher_flags_are_validated_before_the_script_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--slots", "2", "--prefetch", "2", "--device", "cpu", SCRIPT, "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "prefetch=2 with slots=2" in capsys.readouterr().err
    assert not (tmp_path / "trainer_state.json").exists()


def test_resuming_a_streamed_run_gives_the_uninterrupted_losses(tmp_path):
    def run(out, *extra):
        args = [
            "--output_dir",
            str(out),
            "--max_steps",
            "6",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
            "--use_cpu",
            "--per_device_train_batch_size",
            "4",
            "--save_steps",
            "3",
            *extra,
        ]
        assert cli.main(["run", "--slots", "2", "--device", "cpu", SCRIPT] + args) == 0

    run(tmp_path / "whole")
    whole = _losses(_history(tmp_path / "whole"))
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / "adapter_model.safetensors").exists(), "the adapter checkpoint was saved"
    run(tmp_path / "resumed", "--resume_from_checkpoint", str(checkpoint))
    resumed = _losses(_history(tmp_path / "resumed"))
    assert len(whole) == 6 and resumed[-3:] == whole[-3:]


SFT_SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_sft.py")


def test_unchanged_trl_sft_script_under_the_launcher_matches_the_plain_run(tmp_path, monkeypatch):

    def args(out):
        return [
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
            "--use_cpu",
            "--per_device_train_batch_size",
            "4",
            "--save_strategy",
            "no",
        ]

    monkeypatch.setattr(sys, "argv", [SFT_SCRIPT] + args(tmp_path / "plain"))
    runpy.run_path(SFT_SCRIPT, run_name="__main__")
    assert cli.main(["run", "--slots", "2", "--device", "cpu", SFT_SCRIPT] + args(tmp_path / "streamed")) == 0
    plain, streamed = _history(tmp_path / "plain"), _history(tmp_path / "streamed")
    assert len(_losses(plain)) == 4 and _losses(streamed) == _losses(plain)
    assert all(STAT_KEYS <= set(entry) for entry in streamed if "loss" in entry)


def test_custom_accelerate_loop_streamed_matches_plain():
    example = runpy.run_path(str(Path(SCRIPT).parent / "train_accelerate.py"))
    plain = example["main"](["--steps", "6", "--cpu"])
    streamed = example["main"](["--steps", "6", "--cpu", "--stream", "--slots", "2"])
    assert len(plain) == 6 and streamed == plain


def test_evaluation_during_training_and_accumulation_match_the_plain_run(tmp_path, monkeypatch):
    def args(out):
        return [
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--logging_steps",
            "2",
            "--report_to",
            "none",
            "--use_cpu",
            "--save_strategy",
            "no",
            "--per_device_train_batch_size",
            "2",
            "--gradient_accumulation_steps",
            "2",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "2",
            "--per_device_eval_batch_size",
            "8",
        ]

    monkeypatch.setattr(sys, "argv", [SCRIPT] + args(tmp_path / "plain"))
    runpy.run_path(SCRIPT, run_name="__main__")
    assert cli.main(["run", "--slots", "2", "--device", "cpu", SCRIPT] + args(tmp_path / "streamed")) == 0
    plain, streamed = _history(tmp_path / "plain"), _history(tmp_path / "streamed")

    def evals(history):
        return [entry["eval_loss"] for entry in history if "eval_loss" in entry]

    assert len(evals(plain)) == 2 and evals(streamed) == evals(plain)
    assert _losses(streamed) == _losses(plain)
    assert all(STAT_KEYS <= set(entry) for entry in streamed if "eval_loss" in entry)


def test_training_writes_the_residency_timeline_of_one_step(tmp_path, caplog):
    from datasets import Dataset

    model, _ = peft_pair("llama", layers=5)
    layerstream.stream_model(model, device="cpu", slots=2)
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7, 8], "labels": [3, 4, 5, 6, 7, 8]}] * 16)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=3,
        per_device_train_batch_size=4,
        save_strategy="no",
    )
    with caplog.at_level("WARNING", logger="layerstream"):
        Trainer(model=model, args=args, train_dataset=data).train()
    assert "predicted    peak VRAM" in caplog.text and "GiB at batch 4 x 512 tokens" in caplog.text
    trace = json.loads((tmp_path / "layerstream-trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    computes = [(e["cat"], e["args"]["layer"]) for e in spans if e["cat"] in ("forward", "backward")]
    assert computes == [("forward", i) for i in range(5)] + [("backward", i) for i in reversed(range(5))], (
        "exactly one step: every layer forward, then recomputed in reverse"
    )
    copies = [e for e in spans if e["cat"] == "copy"]
    assert len(copies) == 2 * (5 - 2), "a steady-state step copies all but the turnaround layers, twice"
    holds = [e for e in spans if e["cat"] == "hold"]
    assert {e["args"]["slot"] for e in holds} == {0, 1}
    for compute in (e for e in spans if e["cat"] in ("forward", "backward")):
        slot_holds = [
            h
            for h in holds
            if h["args"]["slot"] == compute["args"]["slot"] and h["ts"] <= compute["ts"] <= h["ts"] + h["dur"]
        ]
        assert slot_holds and all(h["args"]["layer"] == compute["args"]["layer"] for h in slot_holds), (
            "a layer computes only while its slot holds it"
        )
    png = (tmp_path / "layerstream-timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert not layerstream.get_runtime(model).timeline_active


def test_a_process_that_sees_several_gpus_is_told_to_launch_one_per_gpu(tmp_path, monkeypatch):
    """The Trainer would wrap the model in nn.DataParallel; that must stop with advice."""
    model, _ = peft_pair("llama", layers=3)
    layerstream.stream_model(model, device="cpu", slots=2)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(layerstream.StreamingError, match="accelerate launch --num_processes N"):
        Trainer(model=model, args=args)


def test_full_model_checkpoints_of_a_streamed_model_hold_every_weight(tmp_path):
    """Without PEFT, with the head trained and the decoder layers frozen (so they stream),
    the Trainer's checkpoint is the whole model: it loads back equal to the trained one."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from tiny import tiny_model

    model = tiny_model("llama", layers=4, tie_word_embeddings=False)
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith("lm_head")
    before = model.lm_head.weight.detach().clone()
    layerstream.stream_model(model, device="cpu", slots=2)
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7, 8], "labels": [3, 4, 5, 6, 7, 8]}] * 8)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=2,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        learning_rate=1e-2,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    assert not torch.equal(model.lm_head.weight, before), "the head must have trained"
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-2")
    ours, theirs = model.state_dict(), saved.state_dict()
    assert list(ours) == list(theirs)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_mixed_precision_training_matches_the_plain_run(tmp_path, monkeypatch, precision, device):
    """Autocast (bf16, or fp16 with loss scaling) through the Trainer: streamed equals plain."""

    def args(out):
        extra = ["--use_cpu"] if device == "cpu" else []
        return [
            "--output_dir",
            str(out),
            "--max_steps",
            "4",
            "--logging_steps",
            "1",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--per_device_train_batch_size",
            "4",
            precision,
            *extra,
        ]

    monkeypatch.setattr(sys, "argv", [SCRIPT] + args(tmp_path / "plain"))
    runpy.run_path(SCRIPT, run_name="__main__")
    assert cli.main(["run", "--slots", "2", "--device", device, SCRIPT] + args(tmp_path / "streamed")) == 0
    plain, streamed = _losses(_history(tmp_path / "plain")), _losses(_history(tmp_path / "streamed"))
    assert len(plain) == 4 and streamed == plain


@pytest.mark.parametrize("use_vllm", [True, False], ids=["vllm", "transformers-generate"])
def test_vllm_generation_is_refused_for_a_streamed_model_before_the_trainer_starts(tmp_path, use_vllm):
    """TRL's online trainers with use_vllm=True would load a full copy of the weights into
    vLLM; the refusal comes in the Trainer's __init__, before vLLM starts or a step runs.
    (The Trainer itself: TRL's GRPOTrainer first checks that vLLM is installed.)"""
    from trl import GRPOConfig

    model, _ = peft_pair("llama", layers=3)
    layerstream.stream_model(model, device="cpu", slots=2)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, use_vllm=use_vllm)
    if use_vllm:
        with pytest.raises(layerstream.StreamingError, match="use_vllm=True.*Set use_vllm=False"):
            Trainer(model=model, args=args)
    else:
        Trainer(model=model, args=args)


@pytest.mark.parametrize(
    "dtype, bf16, refused",
    [(torch.float32, True, True), (torch.float32, False, False), (torch.bfloat16, True, False)],
    ids=["float32-bf16", "float32-no-bf16", "bfloat16-bf16"],
)
def test_continuous_batching_that_would_cast_the_streamed_weights_is_refused_at_init(tmp_path, dtype, bf16, refused):
    """TRL's GRPO and RLOO with use_transformers_continuous_batching=True and bf16 cast the
    whole model to bfloat16 before each generate (trl 1.16), which streamed weights of
    another dtype refuse: said in the Trainer's __init__, naming what to change, rather than
    at the first step's generation. A model loaded in bfloat16, or bf16=False, is let through."""
    from trl import GRPOConfig

    model, _ = peft_pair("llama", layers=3, dtype=dtype)
    layerstream.stream_model(model, device="cpu", slots=2)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        bf16=bf16,
        use_transformers_continuous_batching=True,
    )
    if refused:
        with pytest.raises(
            layerstream.StreamingError, match="continuous_batching=True with bf16=True.*--dtype bfloat16"
        ):
            Trainer(model=model, args=args)
    else:
        Trainer(model=model, args=args)


class _GeneratingTrainer(Trainer):
    """As an online RL trainer does: generate inside the training step, then train."""

    generate_tokens = 0

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.generate_tokens:
            with torch.no_grad():
                model.generate(
                    input_ids=inputs["input_ids"][:, :3],
                    attention_mask=torch.ones_like(inputs["input_ids"][:, :3]),
                    max_new_tokens=self.generate_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
        return super().compute_loss(model, inputs, *args, **kwargs)


def _generating_run(tmp_path, generate_tokens):
    from datasets import Dataset

    model, _ = peft_pair("llama", layers=4)
    layerstream.stream_model(model, device="cpu", slots=2)
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7, 8], "labels": [3, 4, 5, 6, 7, 8]}] * 8)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, logging_steps=1, save_strategy="no"
    )
    trainer = _GeneratingTrainer(model=model, args=args, train_dataset=data)
    trainer.generate_tokens = generate_tokens
    if hasattr(trainer, "generate_hook"):  # a test's probe on the model's forwards
        trainer.generate_hook(model)
    at_start = layerstream.get_runtime(model).stats()["layer_loads"]
    trainer.train()
    loads = layerstream.get_runtime(model).stats()["layer_loads"] - at_start
    return [e for e in trainer.state.log_history if "loss" in e], loads


def test_generation_inside_a_training_step_is_logged_apart_from_training(tmp_path):
    plain, _ = _generating_run(tmp_path / "plain", 0)
    generating, loads = _generating_run(tmp_path / "generating", 4)
    assert all("layerstream/generate_layer_loads" not in entry for entry in plain)
    # every copy is counted once, as training's or as generation's
    split = sum(e["layerstream/layer_loads"] + e["layerstream/generate_layer_loads"] for e in generating)
    assert split == loads
    for without, entry in zip(plain, generating):
        # training copies what it did without generation, give or take the two slots generation left filled
        assert abs(entry["layerstream/layer_loads"] - without["layerstream/layer_loads"]) <= 2
        assert entry["layerstream/generate_calls"] == 1
        # four new tokens: a prefill and three decoding steps, each visiting the four streamed layers
        assert entry["layerstream/generate_layer_loads"] >= 4 * 4 - 2
        assert entry["layerstream/generate_seconds"] > 0
        assert entry["layerstream/generate_window_layers"] == 0


def test_the_allocators_retries_are_logged_for_training_and_generation_apart(tmp_path, monkeypatch):
    """The CUDA allocator's retries (a stand-in counter here: 1 at each forward under
    no_grad, generation's, and 100 at each forward with grad, training's) are logged as
    training's and as generation's, each interval's own."""
    from layerstream.runtime import report

    count = {"retries": 0}
    monkeypatch.setattr(report, "alloc_retries", lambda device: count["retries"])

    def bump(module, args):
        count["retries"] += 100 if torch.is_grad_enabled() else 1

    monkeypatch.setattr(
        _GeneratingTrainer,
        "generate_hook",
        lambda self, model: model.get_input_embeddings().register_forward_pre_hook(bump),
        raising=False,
    )
    generating, _ = _generating_run(tmp_path, 4)
    assert [e["layerstream/alloc_retries"] for e in generating] == [100, 100]
    # four new tokens: a prefill and three decoding steps
    assert [e["layerstream/generate_alloc_retries"] for e in generating] == [4, 4]


def test_the_logged_bandwidth_is_the_intervals_own_not_a_difference_of_running_figures():
    """Only some copies are timed, and ``h2d_seconds`` scales the process's timed copies to
    all of its bytes: where the second interval's copies ran faster than the first's, the
    difference of those running figures came out negative and the log said 0.0 GB/s. The
    interval's own timed copies give its bandwidth."""
    from layerstream.integrations import trainer as integration

    def counters(total, timed, timed_seconds):
        scaled = timed_seconds * total / timed
        return dict(
            h2d_bytes=total,
            h2d_seconds=scaled,
            h2d_timed_bytes=timed,
            h2d_timed_seconds=timed_seconds,
            layer_loads=0,
            peak_resident_layers=0,
            window_layers=0,
            oom_retries=0,
            alloc_retries=0,
            stall_seconds=0.0,
            expert_visits=0,
            experts_copied=0,
            disk_layers=0,
        )

    class Runtime:
        readings = iter(
            [
                counters(total=10e9, timed=1e9, timed_seconds=1.0),  # 1 GB/s so far: 10 s scaled
                # 1 GB more, timed, in 0.01 s (100 GB/s): the scaled figure falls to 5.6 s
                counters(total=11e9, timed=2e9, timed_seconds=1.01),
            ]
        )
        device = "cpu"

        class pool:
            cuda = False

        def stats(self):
            return next(self.readings)

        class long_settings:
            @staticmethod
            def decisions_said():
                return []

    window = integration._LogWindow(Runtime())
    assert window.figures()["layerstream/h2d_gbps"] == pytest.approx(100.0)


def test_the_summarys_predicted_peak_is_the_plan_of_what_auto_turns_on():
    """Before the first pass no offloader runs; the predicted peak is still the plan of the
    step as "auto" decides it, offloading included, as the step's own decision says."""
    import re
    import types

    from layerstream.integrations.trainer import predicted_vram

    model, _ = peft_pair("llama", layers=4)
    auto = dict(offload_activations="auto", mlp_tile_tokens="auto", loss_chunk_tokens="auto")
    layerstream.stream_model(model, device="cpu", slots=2, vram_budget="1GiB", **auto)
    runtime = layerstream.get_runtime(model)
    seq = 2_000_000
    line = predicted_vram(model, types.SimpleNamespace(per_device_train_batch_size=1, max_length=seq))
    decision = runtime.long_settings.decision(seq)
    assert dict(decision.on).get("offload_activations") is True
    predicted = float(re.search(r"peak VRAM ([0-9.]+) GiB", line).group(1))
    planned = runtime.memory_plan(1, seq, offload=True)
    assert planned.needed_bytes == decision.needed  # the step's own plan
    assert predicted == pytest.approx(planned.peak_vram_bytes / 2**30, abs=0.006)
    without = runtime.memory_plan(1, seq, offload=False).peak_vram_bytes / 2**30
    assert without - predicted > 0.2, "the control: the plan without offloading is larger"


def test_the_start_up_prediction_plans_the_ends_moving_but_only_a_step_moves_them(tmp_path, caplog):
    """The start-up summary plans the script's max_length, where "auto" would move the
    embedding and head (stream_embeddings left at its default): the prediction says so, but
    nothing moves until a step needs it, and these 6-token steps never do."""
    from datasets import Dataset

    model, _ = peft_pair("llama", layers=4)
    layerstream.stream_model(model, device="cpu", slots=2, vram_budget="2GiB")  # the steps themselves fit
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7, 8], "labels": [3, 4, 5, 6, 7, 8]}] * 4)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, per_device_train_batch_size=1
    )
    args.max_length = 2_000_000  # as TRL's configs carry it
    with caplog.at_level("WARNING", logger="layerstream"):
        Trainer(model=model, args=args, train_dataset=data).train()
    predicted = next(line for line in caplog.text.splitlines() if "predicted    peak VRAM" in line)
    assert "stream_embeddings" in predicted and "embeddings   resident (stream_embeddings=auto" in caplog.text
    assert "moved the embedding and head" not in caplog.text
    assert layerstream.get_runtime(model).embeddings is None


def test_generation_inside_a_step_has_the_window_that_the_step_before_left_room_for(tmp_path):
    """An online RL step generates before its training pass: the window sized after a step's
    backward is there for the next step's generation, not only for its training pass (one
    step later). Under a budget planned on the CPU, the window grows after the first step,
    and the second step's generation and training both run with it."""
    from datasets import Dataset

    from layerstream.plan import plan_for_model

    model, _ = peft_pair("llama", layers=4)
    budget = plan_for_model(model, 6, 1, slots=2).needed_bytes + 10 * 2**30
    layerstream.stream_model(model, device="cpu", slots=2, vram_budget=budget)
    data = Dataset.from_list([{"input_ids": [3, 4, 5, 6, 7, 8], "labels": [3, 4, 5, 6, 7, 8]}] * 8)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=1,
    )
    trainer = _GeneratingTrainer(model=model, args=args, train_dataset=data)
    trainer.generate_tokens = 4
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    training = [e["layerstream/window_layers"] for e in logged]
    generation = [e["layerstream/generate_window_layers"] for e in logged]
    assert training[0] == 0 and training[1] == 4, training
    assert generation == [0, 4, 4], "the second step's generation had the window its training had"
