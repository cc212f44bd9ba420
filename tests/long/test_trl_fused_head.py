"""TRL's fused log-prob head computes the loss of TRL >= 1.16's trainers (SFT, DPO, GRPO,
RLOO, KTO) instead of the model's forward: a loss_chunk_tokens setting is said to be
bypassed and the summary names TRL's loss, the memory planner counts TRL's footprint, and
a streamed head reaches TRL's kernel as a device copy, not as its host weight."""

from pathlib import Path

import pytest
import trl.trainer.utils as trl_utils
from datasets import Dataset
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

import layerstream
from layerstream import data as embedded
from layerstream.commands import cli
from layerstream.commands.train_config import TrainConfigError, load
from layerstream.long import trl_head
from layerstream.plan import LOSS_LOGIT_COPIES, plan_for_model
from layerstream.plan.long_settings import LONG_ORDER

from tiny import peft_pair, stream, tiny_model

ROOT = Path(__file__).resolve().parents[2]
SFT_ROWS = [{"input_ids": [3, 4, 5, 6, 7, 8, 9, 10]}] * 8
DPO_ROWS = [{"prompt": "Q: hi\nA:", "chosen": " yes", "rejected": " no."}] * 4


def _losses(trainer) -> list:
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _arguments(config_class, out, device, steps=2):
    return config_class(
        output_dir=str(out),
        use_cpu=device == "cpu",
        report_to=[],
        max_steps=steps,
        logging_steps=1,
        per_device_train_batch_size=4,
        save_strategy="no",
        learning_rate=1e-2,
    )


def _sft(model, out, device="cpu", steps=2) -> list:
    args = _arguments(SFTConfig, out, device, steps)
    data, tokenizer = Dataset.from_list(SFT_ROWS), embedded.byte_tokenizer()
    return _losses(SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer))


def _trl_head_records(caplog) -> list:
    """The warnings layerstream's TRL integration gave (the summary's lines are others)."""
    return [r for r in caplog.records if r.name == "layerstream.long.trl_head"]


def _spy_on_trls_kernel(monkeypatch) -> list:
    """Where TRL's fused forward hands its kernel the hidden states and the head weight:
    (hidden device, weight device, weight data pointer) per call."""
    calls, kernel = [], trl_utils._ChunkedLogProbFunction

    class Spy:
        @staticmethod
        def apply(hidden, weight, *rest):
            calls.append((hidden.device.type, weight.device.type, weight.data_ptr()))
            return kernel.apply(hidden, weight, *rest)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Spy)
    return calls


def test_loss_chunk_tokens_under_trl_sft_is_said_to_be_bypassed(tmp_path, caplog):
    model, _ = peft_pair("llama", layers=4)
    stream(model, loss_chunk_tokens=4)
    with caplog.at_level("WARNING", logger="layerstream"):
        _sft(model, tmp_path, steps=1)
    bypassed = [r.getMessage() for r in _trl_head_records(caplog)]
    assert len(bypassed) == 1 and "loss_chunk_tokens=4 is not applied" in bypassed[0]
    loss_line = caplog.text.split("  loss         ")[1].splitlines()[0]
    assert loss_line.startswith("TRL's fused log-prob head") and "loss_chunk_tokens=4 is not applied" in loss_line


def test_under_label_smoothing_trls_sft_loss_is_said_to_run_on_full_logits(tmp_path, caplog):
    """TRL's SFTTrainer computes a label-smoothed loss from the model's own forward, asked
    for without labels, and runs its fused head under no_grad for the metrics: the summary
    and the warning say so, and the planner counts the full logits (the same run without
    smoothing is TRL's fused loss: control)."""
    model, _ = peft_pair("llama", layers=4)
    stream(model, loss_chunk_tokens=4)
    args = _arguments(SFTConfig, tmp_path, "cpu", steps=1)
    args.label_smoothing_factor = 0.1
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(SFT_ROWS), processing_class=embedded.byte_tokenizer()
    )
    with caplog.at_level("WARNING", logger="layerstream"):
        _losses(trainer)
    said = [r.getMessage() for r in _trl_head_records(caplog)]
    assert len(said) == 1 and "from the model's full logits" in said[0] and "loss_chunk_tokens=4" in said[0]
    loss_line = caplog.text.split("  loss         ")[1].splitlines()[0]
    assert loss_line.startswith("the trainer's own loss (label smoothing")
    assert not trl_head.installed(model) and trl_head.metrics_only(model)
    assert not plan_for_model(model, seq=8, batch=4).trl_fused_head
    _sft(model, tmp_path / "again", steps=1)  # a later trainer of the same model, without smoothing
    assert trl_head.installed(model) and plan_for_model(model, seq=8, batch=4).trl_fused_head
    plain, _ = peft_pair("llama", layers=4)
    stream(plain)
    _sft(plain, tmp_path / "control", steps=1)
    assert trl_head.installed(plain) and plan_for_model(plain, seq=8, batch=4).trl_fused_head


def test_loss_chunk_tokens_left_at_auto_under_trl_is_not_said_to_be_bypassed(tmp_path, caplog):
    model, _ = peft_pair("llama", layers=4)
    defaults = {name: getattr(layerstream.StreamConfig(device="cpu"), name) for name in LONG_ORDER}
    assert set(defaults.values()) == {"auto"}
    stream(model, vram_budget="2GiB", **defaults)  # as a user's run has them
    with caplog.at_level("WARNING", logger="layerstream"):
        _sft(model, tmp_path, steps=1)
    assert not _trl_head_records(caplog), "a setting the user never gave is said to be bypassed"
    assert "is not applied" not in caplog.text
    assert "  loss         TRL's fused log-prob head" in caplog.text


def test_loss_chunk_tokens_under_trl_dpo_is_said_to_be_bypassed(tmp_path, caplog):
    model, _ = peft_pair("llama", layers=4, vocab_size=300)  # the byte tokenizer's ids
    stream(model, loss_chunk_tokens=4)
    args, data = _arguments(DPOConfig, tmp_path, "cpu", steps=1), Dataset.from_list(DPO_ROWS)
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=embedded.byte_tokenizer())
    with caplog.at_level("WARNING", logger="layerstream"):
        _losses(trainer)
    assert any("loss_chunk_tokens=4 is not applied" in r.getMessage() for r in _trl_head_records(caplog))
    assert "  loss         TRL's fused log-prob head" in caplog.text


def test_the_summary_names_layerstreams_chunked_loss_where_it_runs():
    model, _ = peft_pair("llama", layers=4)
    stream(model, loss_chunk_tokens=4)
    assert "  loss         layerstream's chunked loss, 4 tokens at a time" in layerstream.get_runtime(model).summary()
    trl_utils.add_fused_lm_head(model.get_base_model())
    assert "  loss         TRL's fused log-prob head" in layerstream.get_runtime(model).summary()


def test_trls_fused_loss_computes_with_the_fetched_head_copy_not_the_host_weight(tmp_path, monkeypatch):
    calls = _spy_on_trls_kernel(monkeypatch)
    streamed, resident = peft_pair("llama", layers=4)
    plain = _sft(resident, tmp_path / "plain")
    own = resident.get_base_model().lm_head.weight.data_ptr()
    assert calls and all(ptr == own for _, _, ptr in calls), "a resident head hands TRL its own weight"
    calls.clear()
    stream(streamed, stream_embeddings=True)
    runtime = layerstream.get_runtime(streamed)
    before = runtime.stats()["head_copies"]
    got = _sft(streamed, tmp_path / "streamed")
    host = streamed.get_base_model().lm_head.weight
    assert host.device.type == "cpu" and host.data_ptr() == runtime.embeddings._host[id(host)][1]
    assert calls and all(ptr != host.data_ptr() for _, _, ptr in calls), "TRL computed with the host weight"
    assert runtime.stats()["head_copies"] - before == len(calls), "one fetch per fused call"
    assert "the streamed head is fetched to the device for it" in runtime.summary()
    assert len(plain) == 2 and got == plain


@pytest.mark.gpu
def test_on_cuda_trls_fused_loss_runs_on_the_gpu_with_the_streamed_head(tmp_path, monkeypatch):
    calls = _spy_on_trls_kernel(monkeypatch)
    streamed, resident = peft_pair("llama", layers=4)
    plain = _sft(resident.to("cuda"), tmp_path / "plain", device="cuda")
    assert calls and all(call[:2] == ("cuda", "cuda") for call in calls)
    calls.clear()
    stream(streamed, device="cuda", stream_embeddings=True)
    got = _sft(streamed, tmp_path / "streamed", device="cuda")
    assert streamed.get_base_model().lm_head.weight.device.type == "cpu", "the head streams"
    assert calls and all(call[:2] == ("cuda", "cuda") for call in calls), f"TRL's loss ran on {calls}"
    assert len(plain) == 2 and got == plain


def test_the_planner_counts_trls_fused_loss_where_a_trl_trainer_added_it():
    model = tiny_model("llama", layers=2)
    own = plan_for_model(model, seq=64, batch=2, loss_chunk_tokens=8)
    assert not own.trl_fused_head and own.loss_chunk_tokens == 8
    assert own.loss_bytes == LOSS_LOGIT_COPIES * 8 * 96 * 4
    trl_utils.add_fused_lm_head(model)
    fused = plan_for_model(model, seq=64, batch=2, loss_chunk_tokens=8)
    assert fused.trl_fused_head and fused.loss_chunk_tokens is None, "loss_chunk_tokens does not apply"
    assert fused.loss_bytes == trl_head.footprint_bytes(128, 32, 4) != own.loss_bytes


def test_layerstream_plan_with_trls_fused_head_offers_no_loss_chunk(capsys):
    shape = str(ROOT / "configs" / "shapes" / "llama-3.1-8b.json")
    args = ["plan", "--model", shape, "--vram-budget", "24GiB", "--quantization", "nf4", "--seq", "32768"]
    assert cli.main(args + ["--offload-activations", "--trl-fused-head"]) == 0
    out = capsys.readouterr().out
    assert "loss: TRL's fused head" in out and "\n  both " in out and "loss_chunk_tokens=" not in out
    cli.main(args + ["--offload-activations"])
    assert "loss_chunk_tokens=512" in capsys.readouterr().out, "without TRL's head a loss chunk is an option"


def test_the_tiles_the_planner_counts_are_trls():
    from trl.kernels import chunked_logprob

    assert trl_head.TOKEN_TILE == chunked_logprob.TOKEN_CHUNK_SIZE
    assert trl_head.VOCAB_TILE == trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE


def test_layerstream_train_plans_trls_loss_not_the_full_logits(tmp_path):
    """`layerstream train` runs TRL's SFTTrainer: 8B QLoRA at 32,768 tokens fits 24 GiB with
    TRL's fused loss, where the full fp32 logits alone would take 47 GiB."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {{name: meta-llama/Llama-3.1-8B, config: {ROOT / 'configs/shapes/llama-3.1-8b.json'}, "
        "dtype: bfloat16, quantization: nf4}\n"
        "stream: {device: cpu, vram_budget: 24GiB, slots: 3, offload_activations: true, mlp_tile_tokens: 4096}\n"
        "training: {max_length: 32768, per_device_train_batch_size: 1}\n"
    )
    load(str(config), [f"training.output_dir={tmp_path / 'never'}"])
    too_long = config.read_text().replace("max_length: 32768", "max_length: 262144")
    config.write_text(too_long)
    with pytest.raises(TrainConfigError) as error:
        load(str(config), [f"training.output_dir={tmp_path / 'never'}"])
    assert "does not fit" in str(error.value) and "loss_chunk_tokens" not in str(error.value)


def test_layerstream_train_says_trl_computes_the_loss_a_config_chunks(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="layerstream"):
        code = cli.main(
            [
                "train",
                str(ROOT / "configs" / "default.yaml"),
                "--set",
                f"training.output_dir={tmp_path}",
                "--set",
                "training.max_steps=1",
                "--set",
                "training.eval_strategy=no",
                "--set",
                "stream.device=cpu",
                "--set",
                "stream.loss_chunk_tokens=64",
            ]
        )
    assert code == 0
    assert any("loss_chunk_tokens=64 is not applied" in r.getMessage() for r in _trl_head_records(caplog))
    assert "  loss         TRL's fused log-prob head" in caplog.text


def test_a_model_without_trls_head_is_not_taken_for_one():
    model = tiny_model("llama", layers=2)
    model.forward = model.forward  # an instance forward of the model's own
    assert not trl_head.installed(model)
    trl_utils.add_fused_lm_head(model)
    assert trl_head.installed(model)


BYTE_VOCAB = 260  # layerstream.data.byte_tokenizer's ids


def _distill(student, out, rows, device="cpu") -> list:
    from trl import DistillationConfig, DistillationTrainer

    teacher = tiny_model("llama", layers=2, seed=9, vocab_size=BYTE_VOCAB).requires_grad_(False).to(device)
    tokenizer = embedded.byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = DistillationConfig(
        output_dir=str(out),
        use_cpu=device == "cpu",
        report_to=[],
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=4,
        save_strategy="no",
        learning_rate=1e-2,
        seed=7,
        max_completion_length=6,
        log_completions=False,
    )
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    return _losses(trainer)


@pytest.mark.parametrize("recognised", [True, False], ids=["fetched", "control-host-weight"])
def test_trls_distillation_loss_computes_with_the_fetched_head_copy(tmp_path, monkeypatch, recognised):
    """TRL's DistillationTrainer reads the student head's weight itself and moves the hidden
    states to its device: a streamed head hands it a device copy (on a GPU the host weight
    would put the loss on the host). Control: unrecognised, the host weight itself reaches
    the kernel, which the assertion catches."""
    import trl.trainer.distillation_trainer as distillation

    seen, kernel = [], distillation._chunked_divergence_loss

    def spy(student_hidden, teacher_hidden, student_weight, *args, **kwargs):
        seen.append(student_weight.data_ptr())
        return kernel(student_hidden, teacher_hidden, student_weight, *args, **kwargs)

    monkeypatch.setattr(distillation, "_chunked_divergence_loss", spy)
    if not recognised:
        monkeypatch.setattr(trl_head, "_READ_HEAD_WEIGHT", set())
    rows = [{"prompt": "Q: hi\nA:", "completion": " yes" + "!" * i} for i in range(8)]
    streamed, resident = peft_pair("llama", layers=3, vocab_size=BYTE_VOCAB)
    plain = _distill(resident, tmp_path / "plain", rows)
    stream(streamed, stream_embeddings=True)
    seen.clear()
    got = _distill(streamed, tmp_path / "streamed", rows)
    host = streamed.get_base_model().lm_head.weight
    assert seen and got == plain and len(plain) == 2
    handed_host = any(ptr == host.data_ptr() for ptr in seen)
    assert handed_host is not recognised, "the kernel got the host weight" if recognised else "control"


@pytest.mark.gpu
def test_on_cuda_trls_distillation_loss_runs_on_the_gpu_with_the_streamed_head(tmp_path, monkeypatch):
    import trl.trainer.distillation_trainer as distillation

    seen, kernel = [], distillation._chunked_divergence_loss

    def spy(student_hidden, teacher_hidden, student_weight, *args, **kwargs):
        seen.append((student_hidden.device.type, student_weight.device.type))
        return kernel(student_hidden, teacher_hidden, student_weight, *args, **kwargs)

    monkeypatch.setattr(distillation, "_chunked_divergence_loss", spy)
    rows = [{"prompt": "Q: hi\nA:", "completion": " yes" + "!" * i} for i in range(8)]
    streamed, resident = peft_pair("llama", layers=3, vocab_size=BYTE_VOCAB)
    plain = _distill(resident.to("cuda"), tmp_path / "plain", rows, device="cuda")
    stream(streamed, device="cuda", stream_embeddings=True)
    seen.clear()
    got = _distill(streamed, tmp_path / "streamed", rows, device="cuda")
    assert streamed.get_base_model().lm_head.weight.device.type == "cpu", "the head streams"
    assert seen and all(call == ("cuda", "cuda") for call in seen), f"TRL's distillation loss ran on {seen}"
    assert len(plain) == 2 and got == plain
