"""Explanation requests run in one background thread, with progress the page can poll.

A job is a list of ``(method, arguments)`` to explain over the same ``{example: target}``;
each method is one ``Workspace.explain`` call (one ``attribute`` call for the examples not
cached). The page polls ``GET /api/jobs/{id}`` and shows ``done / total`` methods and the
method running now. Jobs run one at a time (explanations of one model are serialised anyway
by ``capture.exclusive``); finished jobs are kept up to ``KEPT_JOBS``.
"""
from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Tuple

from ..errors import CaptumTransformersError

KEPT_JOBS = 64


class Jobs:
    """Submit explanation jobs against one workspace and read their state."""

    def __init__(self, workspace) -> None:
        self.workspace = workspace
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="captum-explorer")
        self._jobs: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit(self, requests: List[Tuple[str, Mapping[str, Any]]], targets: Mapping[int, int],
               background: bool = False) -> Dict[str, Any]:
        """Start a job (or finish it at once when every map is cached); returns its state.
        ``background``: always queue it (a warm-up nobody waits for)."""
        job_id = f"job-{next(self._ids)}"
        state = {"id": job_id, "state": "running", "done": 0, "total": len(requests), "running": None,
                 "results": [], "error": None, "started": time.time(), "seconds": None}
        with self._lock:
            self._jobs[job_id] = state
            while len(self._jobs) > KEPT_JOBS:
                self._jobs.popitem(last=False)
        cached = [] if background else [self.workspace.cached(method, arguments, targets)
                                        for method, arguments in requests]
        if not background and all(len(found) == len(targets) for found in cached):
            self._run(state, requests, targets)  # cache hit: answer in the same request
        else:
            self._executor.submit(self._run, state, requests, targets)
        return self.read(job_id)

    def _run(self, state: Dict[str, Any], requests, targets) -> None:
        try:
            for method, arguments in requests:
                with self._lock:
                    state["running"] = method
                maps = self.workspace.explain(method, arguments, targets)
                with self._lock:
                    state["results"].append({"method": method, "arguments": dict(arguments),
                                             "maps": {str(i): m for i, m in maps.items()}})
                    state["done"] += 1
            final = "done"
        except CaptumTransformersError as error:
            final, state["error"] = "error", str(error)
        except Exception as error:  # an unexpected failure: say what it was, keep serving
            traceback.print_exc()
            final, state["error"] = "error", f"{type(error).__name__}: {error}"
        with self._lock:
            state["state"], state["running"] = final, None
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
        self._executor.shutdown(wait=False, cancel_futures=True)
