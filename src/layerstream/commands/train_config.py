"""What a `layerstream train` YAML config says, checked whole before anything is built or
written: unknown keys, values out of range, target modules the model lacks, a missing or
malformed dataset and a run the memory planner says cannot fit each stop the run with a
message naming the key or line, and no output directory is created. The stream section
becomes the run's one StreamConfig here (``stream_config``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from ..checkpoints.paths import looks_local
from ..config import StreamConfig, config_from_settings, resolve_device, setting_default_text, settings
from ..errors import StreamConfigError, TrainConfigError
from ..system.log import get_logger
from ..units import size

SECTIONS: Dict[str, Dict[str, Any]] = {
    "model": {
        "name": "embedded-tiny",
        "layers": 6,
        "hidden_size": 128,
        "dtype": "float32",
        "quantization": "none",
        "trust_remote_code": False,
        "config": None,
    },
    "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
    "data": {"path": "embedded", "eval_rows": 0},
    # every StreamConfig setting, under its own name (config.settings); device "auto": CUDA when there is one
    "stream": {**{s.name: setting_default_text(s) for s in settings()}, "device": "auto"},
    "training": {},  # any TRL SFTConfig / transformers TrainingArguments field
}
# keys of earlier configs, and what they are now
_RENAMED = {
    "vram": "stream.vram_budget (the resident window is on by default; 'none' streams every layer)",
    "resident_window": "stream.vram_budget (the resident window is on whenever there is a budget; "
    "'none' streams every layer)",
}
DTYPES = ("float32", "bfloat16", "float16")
# where a validated config keeps the StreamConfig its stream section became (``stream_config``)
STREAM_CONFIG = "stream_config"

logger = get_logger(__name__)


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
    """Check every section before anything is built or written, so a mistake costs a message
    naming its key rather than a traceback after the model has loaded (or an empty output directory)."""
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
    _check_model(config, raw.get("model") or {}, where)
    for key in ("r", "alpha"):
        if not _is_int(lora[key]) or lora[key] < 1:
            raise TrainConfigError(f"{where}: lora.{key}={lora[key]!r} must be an integer >= 1")
    dropout = _number(lora["dropout"])
    if dropout is None or not 0.0 <= dropout < 1.0:
        raise TrainConfigError(f"{where}: lora.dropout={lora['dropout']!r} must be a number in [0, 1)")
    lora["dropout"] = dropout
    try:
        stream = config[STREAM_CONFIG] = parse_stream_section(config, where)
    except StreamConfigError as exc:
        raise TrainConfigError(f"{where}: stream: {exc}") from None
    _check_training_types(config["training"], where)
    training = training_arguments(config)
    try:
        from trl import SFTConfig

        arguments = SFTConfig(**training)
    except (ValueError, TypeError) as exc:
        raise TrainConfigError(f"{where}: training: {exc}") from None
    _check_training_values(arguments, training, where)
    if not isinstance(data["path"], str) or not data["path"]:
        raise TrainConfigError(f"{where}: data.path={data['path']!r} must be 'embedded' or a JSON-lines file")
    config["rows"] = read_rows(data["path"])
    if not _is_int(data["eval_rows"]) or not 0 <= data["eval_rows"] < len(config["rows"]):
        raise TrainConfigError(f"{where}: data.eval_rows={data['eval_rows']!r} must be in 0..{len(config['rows']) - 1}")
    if not any(text.strip() for text in config["rows"][: len(config["rows"]) - data["eval_rows"]]):
        raise TrainConfigError(f"{where}: data.eval_rows={data['eval_rows']} leaves only empty texts to train on")
    if arguments.eval_strategy != "no" and not data["eval_rows"]:
        raise TrainConfigError(
            f"{where}: training.eval_strategy={training.get('eval_strategy')!r} evaluates on "
            "data.eval_rows, which is 0: hold out some rows, or set training.eval_strategy: no"
        )
    _check_target_modules(config, where)
    check_fits(config, stream, where)
    return config


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is an int to Python


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _number(value) -> float | None:
    """A YAML number as a float, or None. YAML 1.1 reads 1e-4 (no dot) as a string; that
    spelling is taken as the number it plainly means."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _config_errors() -> tuple:
    """What a bad model config raises: ValueError and OSError from transformers, and from the
    config validators of huggingface_hub's strict dataclasses their own error type."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (ValueError, OSError)
    return (ValueError, OSError, StrictDataclassError)


def _check_model(config, given: dict[str, Any], where: str) -> None:
    """The model section's types and paths, and the embedded model's shape: each of these
    otherwise fails only once the model is being built, or is sent to the hub as a repo id."""
    model = config["model"]
    name = model["name"]
    if not isinstance(name, str) or not name:
        raise TrainConfigError(f"{where}: model.name={name!r} must be embedded-tiny, a local directory or a hub id")
    if not isinstance(model["trust_remote_code"], bool):
        raise TrainConfigError(f"{where}: model.trust_remote_code={model['trust_remote_code']!r} must be true or false")
    shape = model["config"]
    if shape is not None and (not isinstance(shape, str) or not Path(shape).exists()):
        raise TrainConfigError(
            f"{where}: model.config={shape!r}: no such file (the model's config.json, relative to the YAML file)"
        )
    if name != "embedded-tiny":
        ignored = sorted({"layers", "hidden_size"} & set(given))
        if ignored:
            raise TrainConfigError(
                f"{where}: model.{ignored[0]} shapes the embedded tiny model only; "
                f"{name}'s own config sets its shape: remove it"
            )
        if looks_local(name):
            local = Path(name).expanduser()  # a path, never a hub id: do not ask the hub for it
            if not local.is_dir():
                raise TrainConfigError(f"{where}: model.name={name!r}: no such directory")
            if not (local / "config.json").is_file():
                raise TrainConfigError(f"{where}: model.name={name!r}: the directory holds no config.json")
            model["name"] = str(local)
        return
    for key in ("layers", "hidden_size"):
        if not _is_int(model[key]) or model[key] < 1:
            raise TrainConfigError(f"{where}: model.{key}={model[key]!r} must be an integer >= 1")
    try:
        shape = model_config(config)
    except _config_errors() as exc:
        reason = str(exc).strip().splitlines()[-1].strip().removeprefix("ValueError: ")
        raise TrainConfigError(f"{where}: model.hidden_size={model['hidden_size']}: {reason}") from None
    heads = shape.num_attention_heads
    if (model["hidden_size"] // heads) % 2:
        raise TrainConfigError(
            f"{where}: model.hidden_size={model['hidden_size']} gives each of the {heads} "
            "attention heads an odd width, which the rotary embedding cannot split: "
            f"use a multiple of {2 * heads}"
        )


def _scalar_type(annotation):
    """(int, float or bool, None allowed) for an SFTConfig field of one scalar type, else None."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) == 1 and kinds[0] in (int, float, bool):
        return kinds[0], len(kinds) < len(args)
    return None


def _check_training_types(training: dict[str, Any], where: str) -> None:
    """SFTConfig stores a value of the wrong type as given (learning_rate: fast) and the
    optimizer fails on it after the output directory exists; check scalars against the
    field types, and take YAML's false for *_strategy as "no"."""
    from trl import SFTConfig

    for key in ("save_strategy", "eval_strategy", "logging_strategy"):
        if training.get(key) is False:  # YAML 1.1 reads an unquoted `no` as false
            training[key] = "no"
        elif training.get(key) is True:
            raise TrainConfigError(
                f"{where}: training.{key}=true: YAML reads yes, on and true as a boolean; write steps, epoch or no"
            )
    fields = {f.name: f.type for f in dataclasses.fields(SFTConfig)}
    for key, value in training.items():
        scalar = _scalar_type(fields[key])
        if scalar is None or (value is None and scalar[1]):
            continue
        kind = scalar[0]
        if kind is float and _number(value) is None:
            raise TrainConfigError(f"{where}: training.{key}={value!r} must be a number")
        if kind is float and isinstance(value, str):
            training[key] = _number(value)
        elif kind is int and not _is_int(value):
            raise TrainConfigError(f"{where}: training.{key}={value!r} must be an integer")
        elif kind is bool and not isinstance(value, bool):
            raise TrainConfigError(f"{where}: training.{key}={value!r} must be true or false")


def _check_training_values(arguments, training: dict[str, Any], where: str) -> None:
    """Values SFTConfig accepts but the Trainer then fails on (or trains nothing with, yet
    saves an adapter), and an output_dir it cannot create."""
    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(arguments, key) < 1:
            raise TrainConfigError(f"{where}: training.{key}={getattr(arguments, key)!r} must be >= 1")
    if arguments.max_length is not None and arguments.max_length < 1:
        raise TrainConfigError(f"{where}: training.max_length={arguments.max_length!r} must be >= 1 tokens")
    if not arguments.learning_rate >= 0 or math.isinf(arguments.learning_rate):
        raise TrainConfigError(f"{where}: training.learning_rate={arguments.learning_rate!r} must be a number >= 0")
    if arguments.max_steps != -1 and arguments.max_steps < 1:
        raise TrainConfigError(
            f"{where}: training.max_steps={arguments.max_steps!r} must be >= 1, "
            "or -1 to train for training.num_train_epochs"
        )
    if arguments.max_steps == -1 and not arguments.num_train_epochs > 0:
        raise TrainConfigError(
            f"{where}: training.num_train_epochs={arguments.num_train_epochs!r} trains no step "
            "(training.max_steps is -1): make it > 0, or set training.max_steps"
        )
    out = training.get("output_dir")
    if out is None:
        return
    if not isinstance(out, str) or not out:
        raise TrainConfigError(f"{where}: training.output_dir={out!r} must be a directory path")
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise TrainConfigError(f"{where}: training.output_dir={out!r} is an existing file, not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise TrainConfigError(f"{where}: training.output_dir={out!r} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TrainConfigError(f"{where}: training.output_dir={out!r} cannot be written: {existing} is read-only")


def _check_target_modules(config, where: str) -> None:
    """lora.target_modules against the model's module names, on a copy built on the meta
    device (no weights), so a misspelt name stops here rather than after the model has
    loaded, and a name of which only some match does not quietly train fewer layers.
    PEFT's own helpers decide what matches and what LoRA can adapt."""
    targets = config["lora"]["target_modules"]
    if targets == "all-linear":
        return
    if not (isinstance(targets, str) and targets) and not (
        isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    ):
        raise TrainConfigError(
            f"{where}: lora.target_modules={targets!r}: write all-linear, a list of module "
            "names, e.g. [q_proj, v_proj], or one regular expression"
        )
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import check_target_module_exists

    from ..modules.meta import meta_model

    try:
        shape = model_config(config)
        model = meta_model(shape, trust_remote_code=config["model"]["trust_remote_code"])
    except (*_config_errors(), KeyError, ImportError) as exc:  # the run could not build it either
        raise TrainConfigError(
            f"{where}: cannot check lora.target_modules against the model ({exc}); point "
            "model.config at the model's config.json"
        ) from None
    modules = dict(model.named_modules())
    linear = sorted({key.rsplit(".", 1)[-1] for key, module in modules.items() if isinstance(module, torch.nn.Linear)})
    regex = isinstance(targets, str)  # PEFT matches a string as one regular expression
    each = (
        {targets: LoraConfig(target_modules=targets)}
        if regex
        else {name: LoraConfig(target_modules=[name]) for name in targets}
    )
    missing = [name for name, one in each.items() if not any(check_target_module_exists(one, key) for key in modules)]
    if missing:
        example = next(key for key, module in modules.items() if isinstance(module, torch.nn.Linear))
        hint = (
            (
                f" (one string is one regular expression over whole names such as {example}; for names, "
                "write a list: [q_proj, v_proj])"
            )
            if regex
            else ""
        )
        raise TrainConfigError(
            f"{where}: lora.target_modules: {', '.join(map(repr, missing))} matches no module "
            f"of the model{hint}; its linear layers are {linear}"
        )
    lora = LoraConfig(target_modules=targets)
    matched = {}
    for key, module in modules.items():
        if check_target_module_exists(lora, key):
            matched.setdefault(type(module).__name__, key)
    for kind, key in matched.items():
        try:
            inject_adapter_in_model(LoraConfig(target_modules=[key]), model, low_cpu_mem_usage=True)
        except ValueError:
            raise TrainConfigError(
                f"{where}: lora.target_modules={targets!r} matches {key or 'the whole model'}, "
                f"a {kind}, which LoRA cannot adapt: name single layers, e.g. {linear}"
            ) from None


def model_config(config, tokenizer=None):
    """The transformers config of the model the run trains (read before any weights).
    ``tokenizer``: the embedded model's, when the caller already built it."""
    model = config["model"]
    if model["name"] == "embedded-tiny":
        from .. import data as embedded

        return embedded.tiny_config(tokenizer or embedded.byte_tokenizer(), model["layers"], model["hidden_size"])
    from ..plan import load_config

    return load_config(model["config"] or model["name"])


_FLAG_TO_KEY = (
    ("--quantization ", "model.quantization: "),
    ("--slots ", "stream.slots: "),
    ("--stream-embeddings (StreamConfig(stream_embeddings=True))", "stream.stream_embeddings: true"),
    ("--offload-activations", "stream.offload_activations: true"),
    ("--loss-chunk-tokens ", "stream.loss_chunk_tokens: "),
    ("--mlp-tile-tokens ", "stream.mlp_tile_tokens: "),
    ("--seq to ", "training.max_length to "),
    ("--batch to ", "training.per_device_train_batch_size to "),
)


def _config_names(advice: str) -> str:
    """The planner's advice names `layerstream plan` flags; name the config keys instead."""
    for flag, key in _FLAG_TO_KEY:
        advice = advice.replace(flag, key)
    return advice


def _step_shape(config) -> tuple:
    """(tokens, sequences) of one step: training.max_length and the per-device batch."""
    training = training_arguments(config)
    seq = int(training.get("max_length") or 1024)  # SFTConfig's default max_length
    return seq, int(training.get("per_device_train_batch_size") or 8)


def _sft_trainer_adapters(config) -> dict:
    """What TRL's SFTTrainer feeds the adapters in this run, as the plan counts it: it casts
    a 4-bit model's adapters to bfloat16 (PEFT makes them float32), steps run under autocast
    with bf16 (SFTConfig's default unless fp16) or fp16, and the recipe's dropout."""
    training = config["training"]
    return {
        "adapter_dtype": "bfloat16" if config["model"]["quantization"] == "nf4" else "float32",
        "lora_dropout": config["lora"]["dropout"] > 0,
        # bf16 left unset is on unless fp16 is set; either runs the steps under autocast
        "autocast": training.get("bf16") is not False or bool(training.get("fp16")),
    }


def planned_run(config, stream: StreamConfig, where: str = "config"):
    """The memory plan of the config's run as ``layerstream train`` makes it (TRL's fused
    loss where SFTTrainer computes it; "auto" decided for this length), or None without a
    VRAM budget."""
    from .. import plan
    from ..long import trl_head

    budget = stream.budget_bytes()
    if budget is None:
        return None
    seq, batch = _step_shape(config)
    targets = config["lora"]["target_modules"]
    try:
        request = plan.request_for(
            plan.settings_of(stream),
            budget,
            config=model_config(config),
            seq=seq,
            batch=batch,
            quantization=config["model"]["quantization"],
            dtype=config["model"]["dtype"],
            lora_rank=config["lora"]["r"],
            lora_targets=targets if isinstance(targets, str) else ",".join(targets),
            trl_fused_head=trl_head.sft_trainer_fuses_head(),  # then loss_chunk_tokens does not apply
            **_sft_trainer_adapters(config),
        )
        return plan.make_plan(request)
    except (ValueError, OSError) as exc:
        raise TrainConfigError(
            f"{where}: cannot plan this run: {exc}. Point model.config at the model's config.json "
            "to plan without the hub"
        ) from None


def check_fits(config, stream: StreamConfig, where: str = "config") -> None:
    """Refuse, before anything is loaded or written, a run the memory planner says will
    not fit in stream.vram_budget even when streamed; the message carries the planner's advice.
    ``stream``: the run's StreamConfig, its settings planned as the run takes them
    (``plan.request_for``: "auto" decided for this length)."""
    memory = planned_run(config, stream, where)
    if memory is None:
        return
    budget = stream.budget_bytes()
    seq, batch = _step_shape(config)
    if not memory.fits:
        advice = "\n".join(f"  - {_config_names(line)}" for line in memory.advice)
        raise TrainConfigError(
            f"{where}: this run does not fit in {size(budget)} of GPU memory even when streamed: "
            f"the planner predicts a peak of {size(memory.peak_vram_bytes)} plus "
            f"{size(memory.reserve_bytes)} reserve at batch {batch} x {seq} tokens "
            f"with {memory.slots} slots. What would make it fit:\n{advice}"
        )


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


def parse_stream_section(config, where: str = "config") -> StreamConfig:
    """The StreamConfig of a config's stream section, each key parsed as the other surfaces
    parse their flags (``config.parse_setting``). ``validate`` makes it once and keeps it in
    the config (``stream_config``)."""
    values = {k: v for k, v in config["stream"].items() if k != "device"}
    return config_from_settings(values, lambda name: f"stream.{name}", device=_device(config))


def stream_config(config) -> StreamConfig:
    """The StreamConfig of a validated config, as ``validate`` made it."""
    return config[STREAM_CONFIG]


def read_rows(path: str) -> list[str]:
    """Training texts from a JSON-lines file of {instruction, response} or {text} rows."""
    from ..data import data_path

    source = data_path() if path == "embedded" else Path(path).expanduser()
    if source.is_dir():
        raise TrainConfigError(f"dataset file {source} is a directory (data.path): name the JSON-lines file in it")
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
                f"{source}:{number}: each row needs a 'text' string, or 'instruction' and 'response' strings"
            )
    if not texts:
        raise TrainConfigError(f"dataset file {source} has no rows")
    if not any(text.strip() for text in texts):  # SFT would train to loss 0.0 and save an adapter
        raise TrainConfigError(
            f"dataset file {source} (data.path): every text is empty or whitespace, so there is nothing to predict"
        )
    return texts
