"""The ``layerstream`` command: its subcommands' parsers, built only for the command given.

Each subcommand lives in its own module (``plan``, ``run``, ``train``, ``demo``); this one
chooses among them."""

from __future__ import annotations

import argparse
import sys

from . import plan as plan_command
from . import run as run_command
from .flags import refused


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
    from ..errors import REFUSALS, TrainConfigError
    from .train import run
    from .train_config import load

    try:
        config = load(args.config, args.set)
    except TrainConfigError as exc:
        parser.error(str(exc))  # exits with status 2, before any work
    try:
        run(config)
    except (*REFUSALS, OSError) as exc:
        return refused(exc)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="layerstream", description="Stream decoder layers from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="LoRA-train a tiny streamed model on the embedded data (no download)", add_help=False)
    plan_parser, run_parser, train_parser = (
        plan_command.add_parser(sub),
        run_command.add_parser(sub),
        _train_parser(sub),
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    # only the chosen command's options are built: building them imports torch, which
    # `layerstream --help` and a mistyped command need not wait for
    options = {
        "plan": (plan_parser, plan_command.add_arguments),
        "run": (run_parser, run_command.add_arguments),
        "train": (train_parser, _add_train_arguments),
    }
    if argv and argv[0] in options:
        command_parser, add_options = options[argv[0]]
        add_options(command_parser)
    if argv and argv[0] == "run":  # everything after the target belongs to the target
        args, rest = run_command.parse_run_arguments(run_parser, argv[1:])
        return run_command.run(args, rest, run_parser)
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
        return plan_command.run(args, plan_parser)
    return 0


if __name__ == "__main__":
    sys.exit(main())
