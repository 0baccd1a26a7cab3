"""A workspace built in a background thread, so that the page is served (and says the model
is loading) while torch models, weights and data load: the command prints its URL as soon as
the server listens.

Example::

    >>> loading = LoadingWorkspace(lambda: builtin_workspace(48))
    >>> loading.get()        # raises StillLoading until the workspace is built, then returns it
"""
from __future__ import annotations

import threading
import time
import traceback
from typing import Callable, Optional

from ..errors import CaptumTransformersError


class StillLoading(Exception):
    """The workspace is not built yet (the API answers 503 with the seconds spent so far)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the model is still loading ({seconds:.1f} s)")
        self.seconds = seconds


class LoadingWorkspace:
    """Runs ``build()`` once in a daemon thread; ``get()`` returns its workspace, raises
    ``StillLoading`` before that, or re-raises the error ``build()`` raised. ``on_done(error)``
    is called once the build ends (``None`` on success)."""

    def __init__(self, build: Callable[[], object],
                 on_done: Optional[Callable[[Optional[BaseException]], None]] = None) -> None:
        self.started = time.time()
        self.name = "(loading)"
        self.error: Optional[BaseException] = None
        self._workspace = None
        self._build, self.on_done = build, on_done
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="captum-explorer-loading").start()

    def _run(self) -> None:
        try:
            self._workspace = self._build()
            self.name = getattr(self._workspace, "name", self.name)
        except CaptumTransformersError as error:
            self.error = error
        except Exception as error:  # unexpected: keep the traceback for whoever reads the console
            traceback.print_exc()
            self.error = error
        finally:
            self._done.set()
            if self.on_done is not None:
                self.on_done(self.error)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the build ended; returns whether it did within ``timeout``."""
        return self._done.wait(timeout)

    def get(self):
        if not self._done.is_set():
            raise StillLoading(time.time() - self.started)
        if self.error is not None:
            raise self.error
        return self._workspace
