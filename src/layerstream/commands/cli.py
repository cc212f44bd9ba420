"""The ``layerstream`` command."""

from __future__ import annotations

import argparse
import sys


def _plan_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "plan",
        help="predict GPU memory, host RAM and copy time of streamed LoRA training",
        description="Predict whether streamed LoRA training of a model fits a GPU, from its "
        "config alone (no weights, no GPU). Exits 0 when it fits, 1 when it does not.",
    )


def _add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    """The planner's own flags (the model, the step's shape, LoRA, the host-device bandwidth)
    and, from StreamConfig's settings, the flags of the settings a plan takes (same names,
    help and defaults as ``layerstream run``'s: ``request.PLAN_SETTINGS``)."""
    from ..plan import DEFAULT_BANDWIDTH_GBPS, QUANTIZATIONS
    from ..plan.request import PLAN_SETTINGS

    plan.add_argument("--model", help="hub id, local model directory, or path to a config.json file")
    plan.add_argument(
        "--seq", type=int, default=None, help="tokens per sequence (needed unless --max-seq or --measure-disk)"
    )
    plan.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    plan.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="frozen weights as stored: none (--dtype) or nf4 (bitsandbytes)",
    )
    plan.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="weight and compute dtype (default bfloat16)",
    )
    plan.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (default 16; 0: none)")
    plan.add_argument(
        "--lora-targets",
        default="all-linear",
        help="PEFT target_modules: all-linear (default) or names, e.g. q_proj,v_proj",
    )
    plan.add_argument(
        "--bandwidth",
        type=float,
        default=DEFAULT_BANDWIDTH_GBPS,
        help=f"pinned host->device GB/s (default {DEFAULT_BANDWIDTH_GBPS:g}, measured "
        "on the team's H200; pass your own)",
    )
    plan.add_argument(
        "--reserve", default="1GiB", help="GPU memory kept free for the CUDA context and allocator (default 1GiB)"
    )
    plan.add_argument(
        "--trl-fused-head",
        action="store_true",
        help="TRL's trainers (>= 1.16) compute the loss with their fused log-prob head: plan its "
        "footprint instead of the logits (--loss-chunk-tokens does not apply then)",
    )
    plan.add_argument(
        "--max-seq",
        action="store_true",
        help="also find the longest sequence that fits, with and without each long-sequence option",
    )
    from .disk import add_disk_arguments

    add_disk_arguments(plan)
    settings = plan.add_argument_group(
        "StreamConfig settings", "planned as a run takes them (layerstream run's flags); the vram_budget is required"
    )
    add_setting_flags(settings, PLAN_SETTINGS)


def _plan_settings(args, parser: argparse.ArgumentParser) -> dict:
    """The setting flags' values as StreamConfig takes them (``config.parse_setting``, as
    ``layerstream run`` parses its own), with both budgets in bytes."""
    from ..config import parse_setting
    from ..decisions.disk import resolve_host_budget
    from ..plan.request import PLAN_SETTINGS
    from ..tiers.store import host_memory

    values = {name: parse_setting(name, getattr(args, name), flag_name(name)) for name in PLAN_SETTINGS}
    if not isinstance(values["vram_budget"], int):
        parser.error(
            f"--vram-budget {args.vram_budget}: give the GPU memory to plan for, e.g. 16GiB (the plan measures "
            "no GPU, and needs a budget)"
        )
    if values["host_budget"] == "auto":
        values["host_budget"] = resolve_host_budget("auto", host_memory())
    return values


def _run_plan(args, parser: argparse.ArgumentParser) -> int:
    from ..plan import (
        comparison,
        format_comparison,
        format_host_check,
        format_plan,
        load_config,
        make_plan,
        max_seq,
        request_for,
    )
    from ..plan.long_settings import LONG_ORDER, OFF, decide_for, plan_line
    from ..tiers.store import host_memory
    from ..units import parse_bytes
    from .disk import format_disk_term, measure_disk

    if args.measure_disk:
        return measure_disk(args, parser)
    if not args.model:
        parser.error("the following arguments are required: --model")
    if args.seq is None and not args.max_seq:
        parser.error("give --seq (tokens per sequence), or --max-seq to find the longest that fits")
    try:
        settings = _plan_settings(args, parser)
        config = load_config(args.model)
        request = request_for(
            settings,
            settings["vram_budget"],
            config=config,
            seq=args.seq or 1,
            batch=args.batch,
            quantization=args.quantization,
            dtype=args.dtype,
            lora_rank=args.lora_rank,
            lora_targets=args.lora_targets,
            bandwidth_gbps=args.bandwidth,
            reserve_bytes=parse_bytes(args.reserve),
            trl_fused_head=args.trl_fused_head,
        )
        longest = max_seq(request) if args.max_seq else None
        request = request.replace(seq=args.seq if args.seq is not None else max(longest, 1))
        plan = make_plan(request)
        rows = comparison(request, args.max_seq)
        # what a run's defaults turn on for the settings not given a value
        unset = {name: "auto" for name in LONG_ORDER if getattr(request, name) in ("auto", OFF[name])}
        auto = plan_line(decide_for(request.replace(**unset), request.vram_bytes), args.batch, request.seq)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # exits with status 2
    print(format_plan(plan))
    if settings["host_budget"] is not None:  # a disk tier: its own host terms
        try:
            print(format_disk_term(args, config, plan, settings["host_budget"]))
        except ValueError as exc:
            parser.error(str(exc))
    elif (memory := host_memory()) is not None:
        print(format_host_check(plan, memory))
    print(_decode_lines(args, config, plan))
    print()
    print(format_comparison(rows, request.seq, args.batch))
    print(auto)
    if longest is not None:
        print(f"\nlongest sequence that fits as given: {longest} tokens at batch {args.batch}")
        return 0 if longest > 0 else 1
    return 0 if plan.fits else 1


def _decode_lines(args, config, plan) -> str:
    from ..plan import layer_shapes
    from ..plan.decode import active_params, decode_term
    from ..plan.report import format_decode_term

    params = active_params(layer_shapes(config))
    return format_decode_term(plan, decode_term(plan.layer_bytes, plan.slots, plan.bandwidth_gbps, params, args.tflops))


def flag_name(setting_name: str) -> str:
    return "--" + setting_name.replace("_", "-")


def add_setting_flags(parser, names=None) -> None:
    """One flag per StreamConfig setting (those in ``names``; None: all), with its help and
    default (``config.settings``). ``parser``: a parser or one of its argument groups."""
    from ..config import FLAG, SWITCH, TRISTATE, argparse_help, setting_default_text, settings

    for setting in settings():
        if names is not None and setting.name not in names:
            continue
        kind, help_text = setting.metadata["kind"], argparse_help(setting)
        name = flag_name(setting.name)
        if kind == FLAG:
            parser.add_argument(name, dest=setting.name, action="store_true", help=help_text)
        elif kind == TRISTATE:
            parser.add_argument(
                name, dest=setting.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif kind == SWITCH:
            default = setting_default_text(setting)
            parser.add_argument(
                name,
                dest=setting.name,
                nargs="?",
                const="true",
                default=default,
                metavar="true|false|auto",
                help=f"{help_text} (default: {default}; the flag alone: true)",
            )
        else:
            default = setting_default_text(setting)
            parser.add_argument(
                name,
                dest=setting.name,
                default=default,
                metavar=kind.split(",")[0].upper(),
                help=f"{help_text} (default: {default or 'unset'})",
            )


def _run_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "run",
        help="run an unchanged training script with every model it loads or trains streamed",
        usage="layerstream run [options] (SCRIPT.py | -m MODULE | COMMAND) [its arguments]",
        description="Run a script (as `python SCRIPT.py`), a module (as `python -m MODULE`) or an installed "
        "command (as `trl sft`) with every causal-LM from_pretrained loading layer by layer "
        "into layerstream's host store and every transformers.Trainer (and subclass) "
        "streaming its model. Options before the target are layerstream's; the rest are "
        "the target's own.",
    )


def _add_run_arguments(run: argparse.ArgumentParser) -> None:
    add_setting_flags(run)
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    run.add_argument("target", nargs="?", help="SCRIPT.py or an installed command")


def split_run_arguments(parser: argparse.ArgumentParser, argv):
    """Split ``layerstream run`` arguments into layerstream's and the target's: the target
    is the first argument that is neither an option nor an option's value (``-m`` takes
    the module name with it; an option whose value is optional takes the next argument
    only when it is one of the values it accepts)."""
    from ..config import _FALSE, _TRUE

    takes_value = {option: action.nargs != 0 for action in parser._actions for option in action.option_strings}
    optional = {option for action in parser._actions if action.nargs == "?" for option in action.option_strings}
    switch_values = set(_TRUE) | set(_FALSE) | {"auto"}
    index = 0
    while index < len(argv):
        item = argv[index]
        if item == "-m":
            return argv[: index + 2], argv[index + 2 :]
        if item.startswith("-") and item != "-":
            option = item.split("=", 1)[0]
            value_follows = takes_value.get(option) and "=" not in item
            if option in optional:
                value_follows = value_follows and index + 1 < len(argv) and argv[index + 1].lower() in switch_values
            index += 2 if value_follows else 1
            continue
        return argv[: index + 1], argv[index + 1 :]
    return argv, []


def allocator_defaults() -> None:
    """Expandable segments unless the user configured torch's allocator: freed memory of one
    block shape then serves another (the resident window and the loss share memory without
    fragmenting it). Must happen before CUDA starts; the start-up summary says so."""
    import os

    import torch

    from ..config import set_default_allocator

    if torch.cuda.is_initialized():
        return  # too late to change the allocator in this process
    if set_default_allocator(os.environ):
        os.environ["LAYERSTREAM_SET_ALLOC_CONF"] = "1"


def _run_target(args, rest, parser) -> int:
    import os
    import runpy
    from importlib import metadata

    from ..config import parse_setting, settings
    from ..errors import REFUSALS, StreamConfigError
    from ..integrations import launch

    target = args.module or args.target
    if target is None:
        parser.error("name a SCRIPT.py, -m MODULE or an installed command to run")
    entry = None
    if not args.module and not os.path.isfile(target):
        found = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == target]
        if not found:
            parser.error(
                f"{target!r} is not a file, and no installed command has that name; give "
                "SCRIPT.py, -m MODULE, or a command such as trl"
            )
        entry = found[0]
    try:
        values = {s.name: parse_setting(s.name, getattr(args, s.name), flag_name(s.name)) for s in settings()}
        launch.enable(values)
    except StreamConfigError as exc:
        parser.error(str(exc))
    saved_argv, saved_path, saved_env = sys.argv, list(sys.path), dict(os.environ)
    allocator_defaults()
    _inherit(values)
    try:
        sys.argv = [target] + list(rest)
        if args.module:
            sys.path.insert(0, os.getcwd())
            missing = _missing_module(args.module)
            if missing:
                parser.error(missing)
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        elif entry is None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
        else:
            result = entry.load()()
            return int(result) if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except (*REFUSALS, OSError) as exc:
        return _refused(exc)
    finally:
        launch.disable()
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    return 0


def _missing_module(module: str) -> str:
    """Why ``python -m module`` would not start (no such module, a package without
    ``__main__``), or "" when it would."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(f"{module}.__main__") is None:
                return f"-m {module}: {module} is a package without __main__; name the module in it to run"
    except (ImportError, ValueError) as exc:  # a parent package that is not there
        return f"-m {module}: {exc}"
    if spec is None:
        return f"-m {module}: no module named {module!r} in this Python ({sys.executable}); is it installed?"
    return ""


def _refused(exc: BaseException) -> int:
    """A refusal's message alone, on stderr (it says what to do; a traceback would bury it),
    and exit status 1. An OSError only where it stands for a mistyped local path (which
    transformers sent to the hub); any other is raised again."""
    from ..checkpoints.paths import missing_directory_behind
    from ..errors import REFUSALS

    message = str(exc) if isinstance(exc, REFUSALS) else missing_directory_behind(exc)
    if message is None:
        raise exc
    print(f"layerstream: error: {message}", file=sys.stderr)
    return 1


def _inherit(values) -> None:
    """Processes the target starts (``trl sft`` and ``accelerate launch`` start the training
    script anew) stream too: the settings go in LAYERSTREAM_AUTOSTREAM, and the start-up
    hook in layerstream/_site (first on PYTHONPATH) turns them on there."""
    import json
    import os

    site = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_site")
    os.environ["LAYERSTREAM_AUTOSTREAM"] = json.dumps(
        {k: (str(v) if k == "device" and v is not None else v) for k, v in values.items()}
    )
    path = os.environ.get("PYTHONPATH", "")
    if site not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = site + (os.pathsep + path if path else "")


def _train_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "train",
        help="LoRA/QLoRA SFT from a YAML config (TRL SFTTrainer), streamed",
        description="Train as CONFIG says. The config is checked whole before anything is built or written.",
    )


def _add_train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("config", help="a YAML file, e.g. configs/default.yaml")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set training.max_steps=10",
    )


def _run_train(args, parser) -> int:
    from ..errors import REFUSALS
    from .train import TrainConfigError, load, run

    try:
        config = load(args.config, args.set)
    except TrainConfigError as exc:
        parser.error(str(exc))  # exits with status 2, before any work
    try:
        run(config)
    except (*REFUSALS, OSError) as exc:
        return _refused(exc)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="layerstream", description="Stream decoder layers from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="LoRA-train a tiny streamed model on the embedded data (no download)", add_help=False)
    plan_parser, run_parser, train_parser = _plan_parser(sub), _run_parser(sub), _train_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    # only the chosen command's options are built: building them imports torch, which
    # `layerstream --help` and a mistyped command need not wait for
    options = {
        "plan": (plan_parser, _add_plan_arguments),
        "run": (run_parser, _add_run_arguments),
        "train": (train_parser, _add_train_arguments),
    }
    if argv and argv[0] in options:
        command_parser, add_options = options[argv[0]]
        add_options(command_parser)
    if argv and argv[0] == "run":  # everything after the target belongs to the target
        ours, rest = split_run_arguments(run_parser, argv[1:])
        args = run_parser.parse_args(ours)
        return _run_target(args, rest, run_parser)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)
    elif args.command == "train":
        if rest:
            train_parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run_train(args, train_parser)
    elif args.command == "plan":
        if rest:
            plan_parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _run_plan(args, plan_parser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
