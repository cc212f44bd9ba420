"""The ``layerstream`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="layerstream", description="Stream decoder layers from host memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="LoRA-train a tiny streamed model on the embedded data (no download)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
