"""``layerstream run``: an unchanged script, module or command, with every model it loads streamed."""

from __future__ import annotations

import argparse
import sys

from .flags import add_setting_flags, flag_name, refused


def add_parser(sub) -> argparse.ArgumentParser:
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


def add_arguments(run: argparse.ArgumentParser) -> None:
    add_setting_flags(run)
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m does")
    run.add_argument("target", nargs="?", help="SCRIPT.py or an installed command")


def split_run_arguments(parser: argparse.ArgumentParser, argv):
    """Split ``layerstream run`` arguments into layerstream's and the target's: the target
    is the first argument that is neither an option nor an option's value (``-m`` takes
    the module name with it; an option whose value is optional takes the next argument
    only when it is one of the values it accepts)."""
    index = _target_index(parser, argv)
    if index is None:
        return argv, []
    if argv[index] == "-m":
        return argv[: index + 2], argv[index + 2 :]
    return argv[: index + 1], argv[index + 1 :]


def _target_index(parser: argparse.ArgumentParser, argv):
    """Where the target (SCRIPT.py, COMMAND, or ``-m``) starts in ``argv``, or None."""
    from ..config import _FALSE, _TRUE

    takes_value = {option: action.nargs != 0 for action in parser._actions for option in action.option_strings}
    optional = {option for action in parser._actions if action.nargs == "?" for option in action.option_strings}
    switch_values = set(_TRUE) | set(_FALSE) | {"auto"}
    index = 0
    while index < len(argv):
        item = argv[index]
        if item == "-m":
            return index
        if item.startswith("-") and item != "-":
            option = item.split("=", 1)[0]
            value_follows = takes_value.get(option) and "=" not in item
            if option in optional:
                value_follows = value_follows and index + 1 < len(argv) and argv[index + 1].lower() in switch_values
            index += 2 if value_follows else 1
            continue
        return index
    return None


def parse_run_arguments(parser: argparse.ArgumentParser, argv):
    """(layerstream's options, the target's arguments). The options are parsed without the
    target: argparse would give a SCRIPT.py that follows a switch whose value is optional
    (``--offload-activations train.py``) to the switch."""
    index = _target_index(parser, argv)
    if index is None or argv[index] == "-m":
        ours, rest = split_run_arguments(parser, argv)
        return parser.parse_args(ours), rest
    args = parser.parse_args(argv[:index])
    args.target = argv[index]
    return args, argv[index + 1 :]


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


def run(args, rest, parser) -> int:
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
            runpy.run_path(os.path.abspath(target), run_name="__main__")  # __file__ absolute, as python gives it
        else:
            result = entry.load()()
            return int(result) if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            # sys.exit("message"): the script's own message, which python prints on every
            # rank as it exits, so not one of layerstream's (those go through its logger)
            sys.stderr.write(f"{code}\n")
        return code if isinstance(code, int) else (0 if code is None else 1)
    except (*REFUSALS, OSError) as exc:
        return refused(exc)
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
