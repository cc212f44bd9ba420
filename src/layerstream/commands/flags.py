"""The flags every command derives from StreamConfig's settings, and how a command refuses."""

from __future__ import annotations

import argparse
import sys


def flag_name(setting_name: str) -> str:
    return "--" + setting_name.replace("_", "-")


def add_setting_flags(parser, names=None) -> None:
    """One flag per StreamConfig setting (those in ``names``; None: all), with its help and
    default (``config.settings``). ``parser``: a parser or one of its argument groups."""
    from ..config import SWITCH, TRISTATE, argparse_help, setting_default_text, settings

    for setting in settings():
        if names is not None and setting.name not in names:
            continue
        kind, help_text = setting.metadata["kind"], argparse_help(setting)
        name = flag_name(setting.name)
        if kind == TRISTATE:
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


def refused(exc: BaseException) -> int:
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
