"""The ``captum-transformers`` command line: ``explain``, ``attribute``, ``benchmark`` and ``explore``.

``python -m captum_transformers`` with no arguments runs ``explain`` on the built-in model;
``explain --prompt TEXT`` explains a language model's generation token by token
(``generation_explain``).
Errors a user can fix (unknown model or method, a model folder without config.json or
weights, unreachable hub, unreadable image, target out of range, an unknown --device, an
--out that is a file or cannot be written) print one line saying what to do and exit with
status 2, never a traceback; --out is checked before any work runs.

While a command runs, the two lines torch logs when torchao is imported (transformers imports
it with its model classes: torchao registers two Enum classes as pytree constants, which torch
calls deprecated) are held back (``torchao_import_noise_held``): they say nothing about the
command. Any other record of that logger, and that message for anything but torchao's
classes, is shown as before.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Iterator, List, Optional

from ..errors import CaptumTransformersError


def build_parser() -> argparse.ArgumentParser:
    from . import attribute, benchmark, explain, explore

    parser = argparse.ArgumentParser(prog="captum-transformers",
                                     description="Class-specific Transformer explanations as Captum attributions.")
    subparsers = parser.add_subparsers(dest="command", metavar="{explain,attribute,benchmark,explore}")
    explain.add_parser(subparsers)
    attribute.add_parser(subparsers)
    benchmark.add_parser(subparsers)
    explore.add_parser(subparsers)
    return parser


#: The logger and message template of torch's warning on an Enum registered as a pytree constant
#: (``torch.utils._pytree._private_register_pytree_node``), which torchao's import triggers.
_PYTREE_LOGGER = "torch.utils._pytree"
_ENUM_CONSTANT_WARNING = "%s is an Enum subclass and is now natively supported by torch.compile"


class _TorchaoEnumWarning(logging.Filter):
    """Drops the pytree-constant warning about an Enum class of torchao, and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str) or not record.msg.startswith(_ENUM_CONSTANT_WARNING):
            return True
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        module = getattr(args[0], "__module__", "") if args else ""
        return not (isinstance(module, str) and (module == "torchao" or module.startswith("torchao.")))


@contextlib.contextmanager
def torchao_import_noise_held() -> Iterator[None]:
    """While inside, torch's warning that torchao registers Enum classes as pytree constants (logged
    on torchao's import, two lines) is dropped; every other record is shown."""
    logger, held = logging.getLogger(_PYTREE_LOGGER), _TorchaoEnumWarning()
    logger.addFilter(held)
    try:
        yield
    finally:
        logger.removeFilter(held)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage or input error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["explain", *argv]
    args = parser.parse_args(argv)
    try:
        with torchao_import_noise_held():
            return args.run(args)
    except CaptumTransformersError as error:
        print(f"captum-transformers {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"captum-transformers {args.command}: interrupted", file=sys.stderr)
        return 130
