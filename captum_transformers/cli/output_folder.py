"""The ``--out`` folder of a command, settled before any work runs.

A file in its place, or a folder that cannot be created or written, is an ``InputError``
at once (not after a benchmark of many minutes). A folder holding an earlier run (its
``marker`` file: ``explanations.png``, ``results.json``) is never overwritten: the run goes
to the first of ``OUT-2``, ``OUT-3``, ... that holds none, and one line says so.

Each folder is claimed by exactly one run, in one atomic step: creating the claim file
``CLAIM_FILE`` inside it with ``O_CREAT | O_EXCL`` (the folder itself is made first if
needed, ``mkdir`` tolerating that another run made it). Two runs started together with the
same ``--out`` therefore never share a folder: the one that loses goes on to ``OUT-2`` (and so
on), and so does any run that finds a folder still claimed. An existing empty folder made on
purpose is taken by one run. The claim file is removed when the run ends; one left behind by
a killed run keeps later runs out of that folder (the line printed names the file to delete).

The folder is claimed for the run, which may still fail (a model that cannot be loaded, a
device that runs out of memory): the folders it created are removed again when the run raises
before writing anything into them, so a failed run leaves nothing behind.

Example: ``with claimed_output_folder("captum_transformers_explain", "explanations.png", "explain") as out:``
gives ``captum_transformers_explain-2`` on the second run in the same directory.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from ..errors import InputError

#: The file that marks a folder as claimed by a run (removed when the run ends).
CLAIM_FILE = ".captum-transformers-run"
#: How often one candidate folder is tried again when it vanished between two steps (another run
#: that failed removed it).
_RETRIES = 8


@contextlib.contextmanager
def claimed_output_folder(requested: str, marker: str, command: str) -> Iterator[Path]:
    """The folder to write to (created if needed and claimed; see the module docstring) for the
    body of a run. The claim is released when the body ends; if the body raises, the folders
    this call created are removed again as long as they are still empty."""
    path, created = _settled(requested, marker, command)
    try:
        yield path
    except BaseException:
        _release(path)
        for folder in reversed(created):  # deepest first; a folder something was written into stays
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    else:
        _release(path)


def _settled(requested: str, marker: str, command: str) -> Tuple[Path, List[Path]]:
    """The folder claimed for the run and the folders created for it (outermost first)."""
    path = Path(requested).expanduser()
    if path.name in ("", "..") or path.name == ".":  # "." or "..": number the folder by its real name
        path = path.resolve()
    chosen, number, first_reason = path, 1, None
    while True:
        created, reason = _claim(chosen, marker, command)
        if reason is None:
            break
        first_reason = first_reason or reason
        number += 1
        chosen = path.with_name(f"{path.name}-{number}")
    if chosen != path:
        print(f"captum-transformers {command}: {path} {first_reason}; writing to {chosen} instead "
              "(give another --out to choose)", file=sys.stderr)
    return chosen, created


def _claim(folder: Path, marker: str, command: str) -> Tuple[List[Path], Optional[str]]:
    """Claim ``folder`` for this run: ``(folders created, outermost first; None)``, or ``([],
    why it is not this run's)`` when it holds an earlier run or another run claimed it first."""
    for _ in range(_RETRIES):
        _refuse_a_file(folder)
        missing = [parent for parent in folder.parents if not parent.exists()][::-1]
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise _unwritable(folder, error) from None
        try:
            folder.mkdir()
            made = True
        except FileExistsError:
            made = False
            _refuse_a_file(folder)
        except OSError as error:
            raise _unwritable(folder, error) from None
        if not made and (folder / marker).exists():
            return [], f"holds an earlier run ({marker})"
        try:
            handle = os.open(folder / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return [], (f"is in use by another run (its {CLAIM_FILE} file; delete that file if no run is writing "
                        "there)")
        except FileNotFoundError:  # another run that failed removed the folder meanwhile: try it again
            continue
        except OSError as error:
            raise _unwritable(folder, error) from None
        with os.fdopen(handle, "w") as claim:
            claim.write(f"{os.getpid()} {command}\n")
        return missing + ([folder] if made else []), None
    raise InputError(f"--out {str(folder)!r} kept vanishing while it was claimed (another program removes it); "
                     "give another --out.")


def _release(folder: Path) -> None:
    try:
        (folder / CLAIM_FILE).unlink()
    except OSError:
        pass


def _refuse_a_file(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {str(path)!r} is a file, not a folder; give a folder path (e.g. --out "
                         f"{str(path.with_suffix(''))}_out).")


def _unwritable(path: Path, error: OSError) -> InputError:
    return InputError(f"--out {str(path)!r} cannot be written ({error.strerror or type(error).__name__}); give a "
                      "folder you can write to.")
