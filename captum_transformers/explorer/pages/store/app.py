"""The explorer's store page and its JSON API (Starlette), for a corpus job's store.

Routes (every ``/api/`` route needs the session token; the same ``SecurityMiddleware`` as the
other pages)::

    GET /api/session            {"page": "store", "name", "kind", "rows", "sorts", "has_text", "targets",
                                 "max_limit", "manifest": {method, model_class, dtype, ...}, "state": "ready"}
    GET /api/rows?q=&sort=&order=&target=&offset=&limit=
                                {"matched", "offset", "limit", "rows": [{"row_id", "target", "score",
                                 "length", "text"}]}
    GET /api/rows/{row_id}      the row whole, with its map (``StoreIndex.row``)

Nothing here runs a model: the page reads what the job wrote.
"""
from __future__ import annotations

from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ....errors import InputError
from ...http import page_app
from ...security import DEFAULT_MAX_BODY_BYTES, LOCAL_HOSTS, SecurityMiddleware
from .index import StoreIndex


def _integer(request: Request, name: str, default: Optional[int]) -> Optional[int]:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"{name}={raw[:40]!r}: expected an integer.") from None


def create_store_app(index: Any, token: str, allowed_hosts=LOCAL_HOSTS,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The store page of ``index`` (a :class:`StoreIndex`) as an ASGI app behind ``SecurityMiddleware``."""
    if not isinstance(index, StoreIndex):
        raise InputError(f"create_store_app takes a StoreIndex, received {type(index).__name__}.")

    async def session(request: Request) -> Response:
        return JSONResponse({**index.session(), "state": "ready"})

    async def rows(request: Request) -> Response:
        params = request.query_params
        return JSONResponse(index.query(q=params.get("q", ""), sort=params.get("sort", "row_id"),
                                        order=params.get("order", "asc"), target=_integer(request, "target", None),
                                        offset=_integer(request, "offset", 0), limit=_integer(request, "limit", 50)))

    async def row(request: Request) -> Response:
        try:
            row_id = int(request.path_params["row_id"])
        except ValueError:
            raise InputError(f"row {request.path_params['row_id'][:40]!r}: expected a row id.") from None
        return JSONResponse(index.row(row_id))

    app = page_app("store.html", [
        Route("/api/session", session),
        Route("/api/rows", rows),
        Route("/api/rows/{row_id}", row),
    ])
    return SecurityMiddleware(app, token, allowed_hosts, max_body_bytes)
