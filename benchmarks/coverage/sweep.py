"""The resumable sweep: a JSON results file, filled entry by entry by worker subprocesses.

The parent process (:func:`sweep`) owns the results file. It hands the pending entries to a
worker (``coverage_harness.py --worker TASKS --progress EVENTS``), which judges them one by one
(:func:`~.harness.run_entry`, a SIGALRM limit per method) and appends one JSON line per event
to the progress file; the parent merges each line into the results and rewrites the file
(atomically), so partial results survive anything. A worker that prints nothing for
``stall_timeout`` seconds (stuck outside Python) is killed: the methods of its entry left
without a verdict are ``timed out``, a worker that dies leaves them ``failed``, and a fresh
worker takes the rest. Entries whose every requested method has a verdict are skipped: a
second run resumes.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .entries import Entry

SCHEMA = "captum_transformers.coverage/1"
HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coverage_harness.py")


# -- the results file ---------------------------------------------------------------------
def versions() -> Dict[str, str]:
    """The versions the results were measured with."""
    import torch
    import transformers

    import captum_transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "captum_transformers": getattr(captum_transformers, "__version__", "?"),
            "commit": package_commit(), "python": platform.python_version()}


def package_commit() -> str:
    """The repository's commit (short), ``+`` if the package's files differ from it; ``?`` outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=os.path.dirname(HARNESS), capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "../captum_transformers")
    except (OSError, subprocess.SubprocessError):
        return "?"
    return (commit + ("+" if dirty else "")) if commit else "?"


def load_results(path: Optional[str]) -> Dict[str, Any]:
    """The results in ``path``, or an empty results dict (with the versions) if there is none."""
    if path and os.path.exists(path):
        with open(path) as handle:
            results = json.load(handle)
        if results.get("schema") != SCHEMA:
            raise SystemExit(f"{path} is not a coverage results file (schema {results.get('schema')!r}).")
        return results
    return {"schema": SCHEMA, **versions(), "entries": {}}


def save_results(results: Dict[str, Any], path: Optional[str]) -> None:
    """Write ``results`` to ``path`` atomically (nothing for ``path`` None)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        json.dump(results, handle, indent=0, sort_keys=True)
    os.chmod(handle.name, 0o644)  # a temporary file is private; the results are not
    os.replace(handle.name, path)


def entry_record(results: Dict[str, Any], entry: Entry) -> Dict[str, Any]:
    """The results' record of ``entry`` (created empty)."""
    return results["entries"].setdefault(entry.key, {"model_type": entry.model_type, "head": entry.head,
                                                     "class": entry.class_name, "info": {}, "cells": {}})


def missing_methods(results: Dict[str, Any], entry: Entry, methods: Sequence[str]) -> List[str]:
    """The methods of ``methods`` without a verdict for ``entry``."""
    cells = results["entries"].get(entry.key, {}).get("cells", {})
    return [name for name in methods if name not in cells]


def apply_event(results: Dict[str, Any], entries: Dict[str, Entry], event: Dict[str, Any]) -> None:
    """Merge one worker event (``info`` or ``cell``) into ``results``."""
    record = entry_record(results, entries[event["key"]])
    if event["event"] == "info":
        record["info"].update(event["info"])
    elif event["event"] == "cell":
        record["cells"][event["method"]] = event["verdict"]


# -- the worker -----------------------------------------------------------------------------
def work(tasks: Iterable[Tuple[Entry, List[str]]], emit, method_timeout: Optional[float],
         entry_timeout: Optional[float]) -> None:
    """Judge each ``(entry, methods)`` task, calling ``emit(event)`` for every result."""
    from .harness import run_entry

    for entry, methods in tasks:
        emit({"event": "start", "key": entry.key})
        for name, value in run_entry(entry, methods, method_timeout, entry_timeout):
            if name == "info":
                emit({"event": "info", "key": entry.key, "info": value})
            else:
                emit({"event": "cell", "key": entry.key, "method": name, "verdict": value.as_dict()})


def worker_main(tasks_path: str, progress_path: str, method_timeout: Optional[float],
                entry_timeout: Optional[float]) -> None:
    """The worker process: the tasks of ``tasks_path`` judged, events appended to ``progress_path``."""
    import torch

    torch.set_num_threads(1)
    with open(tasks_path) as handle:
        tasks = [(Entry(**t["entry"]), t["methods"]) for t in json.load(handle)]
    with open(progress_path, "a") as progress:
        def emit(event):
            progress.write(json.dumps(event) + "\n")
            progress.flush()

        work(tasks, emit, method_timeout, entry_timeout)


# -- the parent -----------------------------------------------------------------------------
def forget(results: Dict[str, Any], kinds: Iterable[str], keys: Optional[Iterable[str]] = None) -> List[str]:
    """Drop from ``results`` every cell whose verdict is one of ``kinds`` (they run again), in the
    entries ``keys`` (None: every entry; a sweep restricted by ``--only`` leaves the others' cells
    alone); the keys of the entries touched."""
    kinds = set(kinds)
    keys = None if keys is None else set(keys)
    touched = []
    for key, record in results["entries"].items():
        if keys is not None and key not in keys:
            continue
        dropped = [m for m, verdict in record["cells"].items() if verdict["kind"] in kinds]
        for method in dropped:
            del record["cells"][method]
        if dropped:
            touched.append(key)
    return touched


def pending_tasks(results: Dict[str, Any], entries: Sequence[Entry],
                  methods: Sequence[str]) -> List[Tuple[Entry, List[str]]]:
    """``(entry, the methods it still lacks)`` of every entry not complete in ``results``."""
    return [(entry, missing) for entry in entries if (missing := missing_methods(results, entry, methods))]


def _close_entry(results: Dict[str, Any], entry: Entry, methods: Sequence[str], kind: str, detail: str) -> None:
    """Give every method of ``entry`` still without a verdict the verdict ``kind``."""
    record = entry_record(results, entry)
    for name in missing_methods(results, entry, methods):
        record["cells"][name] = {"kind": kind, "detail": detail}


def sweep(entries: Sequence[Entry], methods: Sequence[str], out: Optional[str], method_timeout: float = 60,
          entry_timeout: float = 120, stall_timeout: Optional[float] = None, in_process: bool = False,
          redo: Iterable[str] = (), log=print) -> Dict[str, Any]:
    """Judge every method of ``methods`` on every entry not yet in ``out``; return the results.

    ``in_process``: judge in this process (no worker, no stall limit; tests and debugging).
    ``redo``: verdict kinds to judge again (e.g. ``["does not build", "timed out"]``).
    """
    results = load_results(out)
    results.update(versions())
    by_key = {entry.key: entry for entry in entries}
    forget(results, redo, by_key)
    tasks = pending_tasks(results, entries, methods)
    log(f"{len(tasks)} of {len(entries)} entries to run, {len(methods)} methods")
    if in_process:
        def emit(event):
            apply_event(results, by_key, event)
            if event["event"] == "cell":
                save_results(results, out)

        work(tasks, emit, method_timeout, entry_timeout)
        return results
    stall = stall_timeout or method_timeout + 60
    while tasks:
        _run_worker(tasks, results, by_key, methods, out, method_timeout, entry_timeout, stall, log)
        tasks = pending_tasks(results, entries, methods)
    return results


class EventReader:
    """The complete JSON lines appended to a progress file since the last read."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0

    def new_events(self) -> List[Dict[str, Any]]:
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(complete)
        return [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]


def _start_worker(tasks, method_timeout, entry_timeout) -> Tuple[subprocess.Popen, str, EventReader]:
    """A worker process over ``tasks``, its folder (tasks, events, log) and its event reader."""
    folder = tempfile.mkdtemp(prefix="coverage_worker_")
    tasks_path, progress_path = os.path.join(folder, "tasks.json"), os.path.join(folder, "events.jsonl")
    with open(tasks_path, "w") as handle:
        json.dump([{"entry": vars(entry), "methods": missing} for entry, missing in tasks], handle)
    open(progress_path, "w").close()
    command = [sys.executable, HARNESS, "--worker", tasks_path, "--progress", progress_path,
               "--method-timeout", str(method_timeout), "--entry-timeout", str(entry_timeout)]
    with open(os.path.join(folder, "worker.log"), "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    return process, folder, EventReader(progress_path)


def _run_worker(tasks, results, by_key, methods, out, method_timeout, entry_timeout, stall, log) -> None:
    """One worker over ``tasks`` until it finishes, dies or stalls; the entry it was on is closed."""
    process, folder, reader = _start_worker(tasks, method_timeout, entry_timeout)
    current, last_event = None, time.monotonic()
    while True:
        events = reader.new_events()
        for event in events:
            last_event = time.monotonic()
            if event["event"] == "start":
                if current is not None:
                    log(f"  {current}")
                current = event["key"]
            apply_event(results, by_key, event)
        if events:
            save_results(results, out)
        code = process.poll()
        if code is not None and not events:
            break
        if code is None and time.monotonic() - last_event > stall:
            process.kill()
            process.wait()
            code = "killed"
            break
        time.sleep(0.5)
    _after_worker(code, current, results, by_key, methods, stall, folder, log)
    save_results(results, out)


def _after_worker(code, current, results, by_key, methods, stall, folder, log) -> None:
    """Close the entry a stalled or dead worker was on; remove the folder of a worker that finished."""
    if current is None and code != 0:
        raise SystemExit(f"the worker failed before any entry (exit code {code}); see {folder}/worker.log")
    if code == "killed":
        _close_entry(results, by_key[current], methods, "timed out", f"worker stalled {stall:g} s and was killed")
    elif code != 0:
        how = f"killed by signal {-code} (9: the out-of-memory killer?)" if code < 0 else f"exit code {code}"
        _close_entry(results, by_key[current], methods, "failed", f"the worker process died ({how})")
    if current is not None:
        log(f"  {current}" + ("" if code == 0 else f" (worker {code}; log in {folder})"))
    if code == 0:
        shutil.rmtree(folder, ignore_errors=True)  # kept, with the worker's log, when it died or stalled
