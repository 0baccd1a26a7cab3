"""Explanation requests run in one background thread, with progress the page can poll and a
cancel the page can send.

A job is a list of ``(method, arguments)`` to explain over the same ``{example: target}``;
each method is one ``Workspace.explain`` call (one ``attribute`` call for the examples not
cached). The page polls ``GET /api/jobs/{id}`` and shows ``done / total`` methods and the
method running now. Jobs run one at a time (explanations of one model are serialised anyway
by ``capture.exclusive``); one waiting behind another says which (``queued_behind``), so the
page can say so. Finished jobs are kept up to ``KEPT_JOBS`` (the oldest finished one is
dropped first; an unfinished job is never dropped, so it can always be polled and cancelled,
and ``busy()`` always knows it). At most ``MAX_UNFINISHED_JOBS`` jobs may be queued or running
at once: one more is refused with ``TooManyJobs`` (429), which bounds the work queued on the
model (each job is within ``WORK_BUDGET``). A job answered from the cache at once is never refused.

**Cancelling** (``cancel(id)``, ``POST /api/jobs/{id}/cancel``): a job not started yet ends
at once; a running one stops at the next torch operation it runs (inside the forward pass
it is in: one of Integrated Gradients' internal batches, or a method's single pass; see
``Workspace.explain(should_stop=...)``), or between two methods, and ends in state
``"cancelled"`` with the methods it finished. Nothing is cached from the method it stopped in. The request that starts a job is
answered at once either way: a long job never holds up other requests (``/api/session``,
polling, cancelling, maps already cached); the page cancels the job it no longer shows.
"""
from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..errors import CaptumTransformersError
from .method_arguments import MAX_UNFINISHED_JOBS, WORK_BUDGET
from .explaining import Cancelled

#: Finished jobs kept (their maps can still be read); unfinished ones are kept until they end.
KEPT_JOBS = 64
FINISHED = ("done", "error", "cancelled")


class TooManyJobs(Exception):
    """A job was submitted while ``MAX_UNFINISHED_JOBS`` jobs of the model were unfinished
    (answered 429): queued work stays bounded, and no unfinished job is dropped to make room."""


class Jobs:
    """Submit explanation jobs against one workspace, read their state and cancel them."""

    def __init__(self, workspace) -> None:
        self.workspace = workspace
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="captum-explorer")
        self._jobs: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
        self._stops: Dict[str, threading.Event] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._running: Optional[str] = None  # the job the worker thread runs now

    def submit(self, requests: List[Tuple[str, Mapping[str, Any]]], targets: Mapping[int, int],
               background: bool = False) -> Dict[str, Any]:
        """Start a job (or finish it at once when every map is cached); returns its state.
        ``background``: always queue it (a warm-up nobody waits for)."""
        cached = [] if background else [self.workspace.cached(method, arguments, targets)
                                        for method, arguments in requests]
        at_once = not background and all(len(found) == len(targets) for found in cached)
        state = {"id": None, "state": "running", "done": 0, "total": len(requests), "running": None,
                 "results": [], "error": None, "started": time.time(), "seconds": None, "queued_behind": None}
        stop = threading.Event()
        with self._lock:
            unfinished = [key for key, known in self._jobs.items() if known["state"] not in FINISHED]
            if not at_once and len(unfinished) >= MAX_UNFINISHED_JOBS:
                raise TooManyJobs(
                    f"{len(unfinished)} jobs of this model are unfinished (queued or running: "
                    f"{', '.join(unfinished)}); the limit is {MAX_UNFINISHED_JOBS} at once (each within the work "
                    f"budget of {WORK_BUDGET} model passes). Cancel one (the page's Cancel button, or POST "
                    f"api/jobs/{unfinished[-1]}/cancel) or wait until one ends, then ask again.")
            job_id = state["id"] = f"job-{next(self._ids)}"
            self._jobs[job_id] = state
            self._stops[job_id] = stop
            self._drop_old_finished()
        if at_once:
            self._run(state, requests, targets, stop, worker=False)  # cache hit: answered here, no model run
        else:
            with self._lock:
                state["queued_behind"] = self._running or self._last_queued(job_id)
            self._executor.submit(self._run, state, requests, targets, stop)
        return self.read(job_id)

    def _drop_old_finished(self) -> None:
        """Drop the oldest finished jobs beyond ``KEPT_JOBS`` (called under the lock); an
        unfinished job is never dropped: it must stay cancellable and visible to ``busy()``."""
        finished = [key for key, known in self._jobs.items() if known["state"] in FINISHED]
        for dropped in finished[:max(0, len(finished) - KEPT_JOBS)]:
            del self._jobs[dropped]
            self._stops.pop(dropped, None)

    def _last_queued(self, job_id: str) -> Optional[str]:
        """The newest unfinished job submitted before ``job_id`` (called under the lock)."""
        earlier = [key for key, state in self._jobs.items() if key != job_id and state["state"] == "running"]
        return earlier[-1] if earlier else None

    def cancel(self, job_id: str) -> Optional[Dict[str, Any]]:
        """Ask ``job_id`` to stop (see the module docstring); its state, or ``None`` if unknown.
        Cancelling a finished job changes nothing."""
        with self._lock:
            state, stop = self._jobs.get(job_id), self._stops.get(job_id)
            if state is None:
                return None
            if state["state"] == "running" and stop is not None:
                stop.set()
                state["cancel_requested"] = True
                if job_id != self._running and state["running"] is None and state["done"] == 0:
                    self._finish(state, "cancelled")  # not started: nothing to wait for
        return self.read(job_id)

    def busy(self) -> Optional[Dict[str, Any]]:
        """The job the worker runs now (its state), or ``None`` when it is idle."""
        with self._lock:
            running = self._running
        return self.read(running) if running is not None else None

    def _run(self, state: Dict[str, Any], requests, targets, stop: threading.Event, worker: bool = True) -> None:
        with self._lock:
            if state["state"] != "running":  # cancelled while it waited
                return
            if worker:
                self._running = state["id"]
            state["queued_behind"] = None
        try:
            for method, arguments in requests:
                if stop.is_set():
                    raise Cancelled()
                with self._lock:
                    state["running"] = method
                maps = self.workspace.explain(method, arguments, targets, should_stop=stop.is_set)
                with self._lock:
                    state["results"].append({"method": method, "arguments": dict(arguments),
                                             "maps": {str(i): m for i, m in maps.items()}})
                    state["done"] += 1
            final = "done"
        except Cancelled:
            final = "cancelled"
        except CaptumTransformersError as error:
            final, state["error"] = "error", str(error)
        except Exception as error:  # an unexpected failure: say what it was, keep serving
            traceback.print_exc()
            final, state["error"] = "error", f"{type(error).__name__}: {error}"
        with self._lock:
            self._finish(state, final)
            if self._running == state["id"]:
                self._running = None

    @staticmethod
    def _finish(state: Dict[str, Any], final: str) -> None:
        state["state"], state["running"], state["queued_behind"] = final, None, None
        state["seconds"] = time.time() - state["started"]

    def read(self, job_id: str) -> Dict[str, Any] | None:
        with self._lock:
            state = self._jobs.get(job_id)
            if state is None:
                return None
            return {key: (list(value) if key == "results" else value) for key, value in state.items()}

    def wait(self, job_id: str, timeout: float = 60.0) -> Dict[str, Any] | None:
        """Block until the job is no longer running (tests and the notebook export)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.read(job_id)
            if state is None or state["state"] != "running":
                return state
            time.sleep(0.01)
        return self.read(job_id)

    def close(self) -> None:
        with self._lock:
            for job_id, state in self._jobs.items():
                if state["state"] == "running":
                    self._stops[job_id].set()
        self._executor.shutdown(wait=False, cancel_futures=True)
