"""The ``--out`` folder of a command, settled before any work runs.

A file in its place, or a folder that cannot be created or written, is an ``InputError``
at once (not after a benchmark of many minutes). A folder holding an earlier run (its
``marker`` file: ``explanations.png``, ``results.json``) is never overwritten: the run goes
to the first of ``OUT-2``, ``OUT-3``, ... that holds none, and one line says so.

The folder is claimed for the run, which may still fail (a model that cannot be loaded, a
device that runs out of memory): the folders it created are removed again when the run raises
before writing anything into them, so a failed run leaves nothing behind.

Example: ``with claimed_output_folder("captum_transformers_explain", "explanations.png", "explain") as out:``
gives ``captum_transformers_explain-2`` on the second run in the same directory.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Iterator, List, Tuple

from ..errors import InputError


@contextlib.contextmanager
def claimed_output_folder(requested: str, marker: str, command: str) -> Iterator[Path]:
    """The folder to write to (created if needed; see the module docstring) for the body of a
    run: if the body raises, the folders this call created are removed again as long as they
    are still empty."""
    path, created = _settled(requested, marker, command)
    try:
        yield path
    except BaseException:
        for folder in reversed(created):  # deepest first; a folder something was written into stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _settled(requested: str, marker: str, command: str) -> Tuple[Path, List[Path]]:
    """The folder to write to and the folders created for it (outermost first)."""
    path = Path(requested).expanduser()
    if path.name in ("", "..") or path.name == ".":  # "." or "..": number the folder by its real name
        path = path.resolve()
    chosen = path
    number = 1
    while _holds_earlier_run(chosen, marker):
        number += 1
        chosen = path.with_name(f"{path.name}-{number}")
    if chosen != path:
        print(f"captum-transformers {command}: {path} holds an earlier run ({marker}); writing to {chosen} instead "
              "(give another --out to choose)", file=sys.stderr)
    created = [folder for folder in (chosen, *chosen.parents) if not folder.exists()][::-1]
    _check_writable(chosen)
    return chosen, created


def _holds_earlier_run(path: Path, marker: str) -> bool:
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {str(path)!r} is a file, not a folder; give a folder path (e.g. --out "
                         f"{str(path.with_suffix(''))}_out).")
    return (path / marker).exists()


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise InputError(f"--out {str(path)!r} cannot be written ({error.strerror or type(error).__name__}); give a "
                         "folder you can write to.") from None
