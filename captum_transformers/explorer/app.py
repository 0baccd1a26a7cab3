"""The explorer as one ASGI app: the page that serves the given workspace, picked from ``PAGES``.

``PAGES`` lists each page with the workspace types it serves, most specific first (a
``LoadingGenerationWorkspace`` is also a ``LoadingWorkspace``); a workspace no page names (a
list of classifier workspaces, one per model) goes to the last page, the classifier's. The
pages' routes are in ``pages/classifier/app.py``, ``pages/generation/app.py`` and
``pages/store/app.py`` (a corpus job's store: ``StoreIndex``).

Example::

    >>> app = create_app(workspace, token="a-long-random-session-token")
    >>> # uvicorn.run(app, host="127.0.0.1", port=8765)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from .loading import LoadingWorkspace
from .pages.classifier.workspace import Workspace
from .pages.generation.sources import LoadingGenerationWorkspace
from .pages.generation.workspace import GenerationWorkspace
from .pages.store.index import StoreIndex
from .security import DEFAULT_MAX_BODY_BYTES, LOCAL_HOSTS


def _classifier_app(workspace, token, allowed_hosts, benchmark, max_body_bytes, methods, warm):
    from .pages.classifier.app import create_classifier_app

    return create_classifier_app(workspace, token, allowed_hosts, benchmark, max_body_bytes, methods, warm)


def _generation_app(workspace, token, allowed_hosts, benchmark, max_body_bytes, methods, warm):
    from .pages.generation.app import create_generation_app

    # the generation page shows no benchmark curves and has no default view to warm
    return create_generation_app(workspace, token, allowed_hosts, max_body_bytes, methods)


def _store_app(index, token, allowed_hosts, benchmark, max_body_bytes, methods, warm):
    from .pages.store.app import create_store_app

    # the store page runs no model: no methods, no benchmark, nothing to warm
    return create_store_app(index, token, allowed_hosts, max_body_bytes)


@dataclass(frozen=True)
class Page:
    """One page: its ``name``, the workspace types it serves, and ``create(workspace, token,
    allowed_hosts, benchmark, max_body_bytes, methods, warm)`` building its ASGI app (Starlette
    is imported only then)."""

    name: str
    serves: Tuple[type, ...]
    create: Callable[..., Any]


#: Which page serves which workspace, most specific first; the last page takes any other.
PAGES: Tuple[Page, ...] = (
    Page("store", (StoreIndex,), _store_app),
    Page("generation", (GenerationWorkspace, LoadingGenerationWorkspace), _generation_app),
    Page("classifier", (Workspace, LoadingWorkspace, list, tuple), _classifier_app),
)


def page_for(workspace) -> Page:
    """The page of ``PAGES`` that serves ``workspace`` (the last one when none names its type)."""
    return next((page for page in PAGES if isinstance(workspace, page.serves)), PAGES[-1])


def create_app(workspace, token: str, allowed_hosts=LOCAL_HOSTS, benchmark: Optional[Dict[str, Any]] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, methods: Optional[Sequence[str]] = None,
               warm: bool = True):
    """The explorer of ``workspace`` as an ASGI app wrapped in ``SecurityMiddleware``: the page
    ``page_for(workspace)`` serves it.

    ``workspace``: a classifier ``Workspace``, a ``LoadingWorkspace`` still building one (the
    API then answers ``/api/session`` with 200 ``{"state": "loading", "seconds": ...}`` and the other
    routes with 503 until it is ready), or a list of
    Workspaces, one per model, chosen by ``?model=<index>`` on API calls; or a
    ``GenerationWorkspace`` (or ``LoadingGenerationWorkspace``) for the generation page.
    ``benchmark``: aggregate curves (``benchmark_curves(path)``) shown beside the per-example
    ones (classifier page); ``methods``: the catalog names offered (default: those that can
    explain the model); ``warm``: compute the classifier page's default view in the background
    as soon as the workspace is ready, so that the first page finds it cached.
    """
    return page_for(workspace).create(workspace, token, allowed_hosts, benchmark, max_body_bytes, methods, warm)
