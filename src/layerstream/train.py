"""`layerstream train CONFIG.yaml`: LoRA/QLoRA SFT driven by a YAML config, on TRL's SFTTrainer.

The whole config is checked before anything is built or written: unknown keys, values
out of range, a missing or malformed dataset each stop the run with a message naming
the key or line, and no output directory is created.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from .config import StreamConfig, config_from_settings, resolve_device, settings, setting_default_text
from .errors import StreamConfigError, TrainConfigError

SECTIONS: Dict[str, Dict[str, Any]] = {
    "model": {"name": "embedded-tiny", "layers": 6, "hidden_size": 128, "dtype": "float32",
              "quantization": "none", "trust_remote_code": False, "config": None},
    "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
    "data": {"path": "embedded", "eval_rows": 0},
    # every StreamConfig setting, under its own name (config.settings); device "auto": CUDA when there is one
    "stream": {**{s.name: setting_default_text(s) for s in settings()}, "device": "auto"},
    "training": {},  # any TRL SFTConfig / transformers TrainingArguments field
}
# keys of earlier configs, and what they are now
_RENAMED = {"vram": "stream.vram_budget (the resident window is on by default; 'none' streams every layer)",
            "resident_window": "stream.vram_budget (the resident window is on whenever there is a budget; "
                               "'none' streams every layer)"}
DTYPES = ("float32", "bfloat16", "float16")


def _training_fields() -> set:
    from trl import SFTConfig

    return {f.name for f in dataclasses.fields(SFTConfig)}


def load(path: str, overrides: Optional[List[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Read and validate a config; ``overrides`` are ``section.key=value`` strings."""
    source = Path(path)
    if not source.is_file():
        raise TrainConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(source.read_text()) or {}
    except yaml.YAMLError as exc:
        raise TrainConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TrainConfigError(f"{path}: the top level must be a mapping of sections")
    for item in overrides or []:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot:
            raise TrainConfigError(f"override {item!r}: write section.key=value, e.g. training.max_steps=10")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    shape = (raw.get("model") or {}).get("config") if isinstance(raw.get("model"), dict) else None
    if isinstance(shape, str) and not Path(shape).is_absolute():
        raw["model"]["config"] = str(source.parent / shape)  # relative to the YAML file
    return validate(raw, str(path))


def validate(raw: Dict[str, Any], where: str = "config") -> Dict[str, Dict[str, Any]]:
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise TrainConfigError(f"{where}: unknown section(s) {sorted(unknown)}; sections are {sorted(SECTIONS)}")
    config: Dict[str, Dict[str, Any]] = {}
    training_fields = _training_fields()
    for section, defaults in SECTIONS.items():
        values = raw.get(section) or {}
        if not isinstance(values, dict):
            raise TrainConfigError(f"{where}: section {section!r} must be a mapping")
        known = training_fields if section == "training" else set(defaults)
        bad = set(values) - known
        renamed = sorted(key for key in bad if section == "stream" and key in _RENAMED)
        if renamed:
            raise TrainConfigError(f"{where}: stream.{renamed[0]} is now {_RENAMED[renamed[0]]}")
        if bad:
            hint = "any SFTConfig / TrainingArguments field" if section == "training" else sorted(known)
            raise TrainConfigError(f"{where}: unknown key(s) {sorted(bad)} in {section!r}; known: {hint}")
        config[section] = {**defaults, **values}
    model, lora, data = config["model"], config["lora"], config["data"]
    if model["dtype"] not in DTYPES:
        raise TrainConfigError(f"{where}: model.dtype={model['dtype']!r}; use one of {DTYPES}")
    if model["quantization"] not in ("none", "nf4"):
        raise TrainConfigError(f"{where}: model.quantization={model['quantization']!r}; use none or nf4")
    if model["name"] == "embedded-tiny" and model["quantization"] != "none":
        raise TrainConfigError(f"{where}: the embedded tiny model is not quantised; set model.quantization: none")
    for key in ("r", "alpha"):
        if not isinstance(lora[key], int) or lora[key] < 1:
            raise TrainConfigError(f"{where}: lora.{key}={lora[key]!r} must be an integer >= 1")
    if not 0.0 <= float(lora["dropout"]) < 1.0:
        raise TrainConfigError(f"{where}: lora.dropout={lora['dropout']!r} must be in [0, 1)")
    try:
        stream_config(config, where)
    except StreamConfigError as exc:
        raise TrainConfigError(f"{where}: stream: {exc}") from None
    training = training_arguments(config)
    try:
        from trl import SFTConfig

        SFTConfig(**training)
    except (ValueError, TypeError) as exc:
        raise TrainConfigError(f"{where}: training: {exc}") from None
    config["rows"] = read_rows(data["path"])
    if not isinstance(data["eval_rows"], int) or not 0 <= data["eval_rows"] < len(config["rows"]):
        raise TrainConfigError(f"{where}: data.eval_rows={data['eval_rows']!r} must be in 0..{len(config['rows']) - 1}")
    check_fits(config, where)
    return config


def _vram_budget(config, where: str) -> Optional[int]:
    """stream.vram_budget in bytes now ("auto": what the GPU has for this run; None on the
    host or with "none")."""
    return stream_config(config, where).budget_bytes()


def model_config(config, tokenizer=None):
    """The transformers config of the model the run trains (read before any weights).
    ``tokenizer``: the embedded model's, when the caller already built it."""
    model = config["model"]
    if model["name"] == "embedded-tiny":
        from . import embedded

        return embedded.tiny_config(tokenizer or embedded.byte_tokenizer(), model["layers"], model["hidden_size"])
    from .plan import load_config

    return load_config(model["config"] or model["name"])


_FLAG_TO_KEY = (("--quantization ", "model.quantization: "), ("--slots ", "stream.slots: "),
                ("--stream-embeddings (StreamConfig(stream_embeddings=True))", "stream.stream_embeddings: true"),
                ("--seq to ", "training.max_length to "), ("--batch to ", "training.per_device_train_batch_size to "))


def _config_names(advice: str) -> str:
    """The planner's advice names `layerstream plan` flags; name the config keys instead."""
    for flag, key in _FLAG_TO_KEY:
        advice = advice.replace(flag, key)
    return advice


def check_fits(config, where: str = "config") -> None:
    """Refuse, before anything is loaded or written, a run the memory planner says will
    not fit in stream.vram_budget even when streamed; the message carries the planner's advice."""
    from . import plan

    stream = stream_config(config, where)
    budget = stream.budget_bytes()
    if budget is None:
        return
    training = training_arguments(config)
    seq = int(training.get("max_length") or 1024)  # SFTConfig's default max_length
    batch = int(training.get("per_device_train_batch_size") or 8)
    targets = config["lora"]["target_modules"]
    targets = targets if isinstance(targets, str) else ",".join(targets)
    try:
        memory = plan.make_plan(model_config(config), seq=seq, batch=batch, vram_bytes=budget,
                                quantization=config["model"]["quantization"], dtype=config["model"]["dtype"],
                                lora_rank=config["lora"]["r"],
                                slots=None if "slots" in stream.automatic else stream.slots,
                                lora_targets=targets, stream_embeddings=stream.stream_embeddings)
    except (ValueError, OSError) as exc:
        raise TrainConfigError(
            f"{where}: cannot plan this run: {exc}. Point model.config at the model's config.json "
            "to plan without the hub") from None
    if not memory.fits:
        advice = "\n".join(f"  - {_config_names(line)}" for line in memory.advice)
        raise TrainConfigError(
            f"{where}: this run does not fit in {budget / 2**30:.1f} GiB of GPU memory even when streamed: "
            f"the planner predicts a peak of {memory.peak_vram_bytes / 2**30:.2f} GiB plus "
            f"{memory.reserve_bytes / 2**30:.1f} GiB reserve at batch {batch} x {seq} tokens "
            f"with {memory.slots} slots. What would make it fit:\n{advice}")


def training_arguments(config) -> Dict[str, Any]:
    """The SFTConfig keyword arguments, with layerstream's defaults filled in."""
    training = dict(config["training"])
    training.setdefault("output_dir", "outputs/layerstream-train")
    training.setdefault("report_to", "none")
    if stream_config(config).device.type == "cpu":
        training.setdefault("use_cpu", True)
    return training


def _device(config):
    """stream.device as a torch device ("auto": CUDA when there is one); a bad value
    raises StreamConfigError, which validate() reports under the stream section."""
    import torch

    device = config["stream"]["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(device)


def stream_config(config, where: str = "config") -> StreamConfig:
    """The StreamConfig of a config's stream section, each key parsed as the other surfaces
    parse their flags (``config.parse_setting``)."""
    values = {k: v for k, v in config["stream"].items() if k != "device"}
    return config_from_settings(values, lambda name: f"stream.{name}", device=_device(config))


def read_rows(path: str) -> List[str]:
    """Training texts from a JSON-lines file of {instruction, response} or {text} rows."""
    from .embedded import data_path

    source = data_path() if path == "embedded" else Path(path)
    if not source.is_file():
        raise TrainConfigError(f"dataset file {source} does not exist (data.path)")
    texts = []
    for number, line in enumerate(source.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrainConfigError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row, dict) and isinstance(row.get("instruction"), str) and isinstance(row.get("response"), str):
            texts.append(f"Q: {row['instruction']}\nA: {row['response']}")
        else:
            raise TrainConfigError(
                f"{source}:{number}: each row needs a 'text' string, or 'instruction' and 'response' strings")
    if not texts:
        raise TrainConfigError(f"dataset file {source} has no rows")
    return texts


def run(config: Dict[str, Dict[str, Any]]):
    """Build, stream and train as the (validated) config says; returns the trainer."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from trl import SFTConfig, SFTTrainer

    from . import api, embedded
    from .loading import from_pretrained

    model_section, lora = config["model"], config["lora"]
    dtype = getattr(torch, model_section["dtype"])
    stream = stream_config(config)
    if model_section["name"] == "embedded-tiny":
        from transformers import AutoModelForCausalLM

        tokenizer = embedded.byte_tokenizer()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(config, tokenizer), dtype=dtype)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_section["name"],
                                                  trust_remote_code=model_section["trust_remote_code"])
        quantization = None if model_section["quantization"] == "none" else model_section["quantization"]
        model = from_pretrained(model_section["name"], quantization=quantization, torch_dtype=dtype,
                                stream=stream, trust_remote_code=model_section["trust_remote_code"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = get_peft_model(model, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                             target_modules=lora["target_modules"]))
    if not api.is_streamed(model):
        api.stream_model(model, stream)
    rows = config["rows"]
    held = config["data"]["eval_rows"]
    train = Dataset.from_list([{"text": t} for t in rows[: len(rows) - held]])
    evaluation = Dataset.from_list([{"text": t} for t in rows[len(rows) - held:]]) if held else None
    args = SFTConfig(**training_arguments(config))
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                         processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return trainer
