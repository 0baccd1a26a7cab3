"""The ``captum-transformers`` command line: ``explain``, ``benchmark`` and ``explore``.

``python -m captum_transformers`` with no arguments runs ``explain`` on the built-in model;
``explain --prompt TEXT`` explains a language model's generation token by token
(``generation_explain``).
Errors a user can fix (unknown model or method, a model folder without config.json or
weights, unreachable hub, unreadable image, target out of range, an unknown --device, an
--out that is a file or cannot be written) print one line saying what to do and exit with
status 2, never a traceback; --out is checked before any work runs.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..errors import CaptumTransformersError


def build_parser() -> argparse.ArgumentParser:
    from . import benchmark, explain, explore

    parser = argparse.ArgumentParser(prog="captum-transformers",
                                     description="Class-specific Transformer explanations as Captum attributions.")
    subparsers = parser.add_subparsers(dest="command", metavar="{explain,benchmark,explore}")
    explain.add_parser(subparsers)
    benchmark.add_parser(subparsers)
    explore.add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage or input error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["explain", *argv]
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CaptumTransformersError as error:
        print(f"captum-transformers {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"captum-transformers {args.command}: interrupted", file=sys.stderr)
        return 130
