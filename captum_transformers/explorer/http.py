"""What both explorer pages serve alike over HTTP (Starlette): the shipped static files, the
favicon answer, JSON body parsing, the list of methods a request names, and the JSON answers
of errors.

Every page is one Starlette app built by ``page_app``: ``GET /`` answers its HTML file from
``static/``, ``GET /favicon.ico`` 204, ``/static/...`` the scripts and style sheets, and its
own ``/api/`` routes between them. A request body is a JSON object at most ``MAX_JSON_DEPTH``
levels deep whose text holds no lone UTF-16 surrogate (``json_body``: ``"\\ud800"`` is valid
JSON but no character; answered 400 naming the field); its ``"methods"`` a list of
``{"name", "arguments"}``, each checked against the offered methods and the method's argument
fields (``parse_methods``).
Errors are answered as JSON (``error_handlers``): 400 for a refused request, 409 while another
job holds the model (``ModelBusy``), 429 over the job limit, 503 while the model loads. The
session poll is no error while the model loads: a 200 ``{"state": "loading", "seconds"}``
(``loading_state``), and ``{"state": "ready", ...}`` once it is there.

Example::

    >>> app = page_app("index.html", [Route("/api/session", get_session)])
"""
from __future__ import annotations

import importlib.resources
import json
import re
from typing import Any, Dict, List, Sequence, Tuple

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import CaptumTransformersError, InputError
from ..methods.catalog import METHOD_NAMES
from .jobs import TooManyJobs
from .loading import StillLoading
from .method_arguments import checked_arguments

#: The most methods one request may name (every catalog method once).
MAX_METHODS_PER_REQUEST = len(METHOD_NAMES)
#: How deeply a request body may nest (the API's bodies nest 3 levels: body, methods, arguments).
MAX_JSON_DEPTH = 16


class ModelBusy(Exception):
    """A request needs the model while a job runs on it: answered 409 at once, not held."""


def static_dir():
    """The folder of the pages' files shipped inside the package."""
    return importlib.resources.files("captum_transformers").joinpath("explorer", "static")


def shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages about received values."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_methods(raw: Any, offered: Sequence[str] = METHOD_NAMES) -> List[Tuple[str, Dict[str, Any]]]:
    """A request's ``"methods"`` (a list of 1 to ``MAX_METHODS_PER_REQUEST`` objects ``{"name",
    "arguments"}``) as ``[(name, checked arguments)]``, each name one of ``offered``."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_METHODS_PER_REQUEST:
        raise InputError(f'"methods" must be a list of 1 to {MAX_METHODS_PER_REQUEST} objects {{"name", "arguments"}}.')
    parsed = []
    for entry in raw:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InputError(f'each method must be an object with a "name", received {shown(entry)}.')
        if entry["name"] not in offered:
            raise InputError(f"method {entry['name']!r} is not offered for this model; offered: {', '.join(offered)}.")
        arguments = entry.get("arguments") or {}
        if not isinstance(arguments, dict):
            raise InputError(f'"arguments" of {entry["name"]} must be an object, received {shown(arguments)}.')
        parsed.append((entry["name"], checked_arguments(entry["name"], arguments)))
    return parsed


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (counted without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (value.values() if isinstance(value, dict) else value))
    return deepest


_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(body: Dict[str, Any]) -> None:
    """Refuse a body whose text holds a lone UTF-16 surrogate: JSON lets ``"\\ud800"`` through
    (a pair of escapes is joined into one character when parsed, so only a lone half is left),
    but it is no Unicode character, and neither a tokenizer nor a UTF-8 answer can take it."""
    def refuse(text: str, where: str) -> None:
        found = _SURROGATE.search(text)
        if found is not None:
            raise InputError(f"{where} holds a lone UTF-16 surrogate, \\u{ord(found.group()):04x} at character "
                             f"{found.start()}, which is not a Unicode character (a surrogate is only valid as half "
                             "of an escaped pair such as \\ud83d\\ude00); send text that is valid UTF-8: remove "
                             "or replace that character.")

    stack = [(body, "")]
    while stack:  # the paths shown are built from keys already checked: they hold no surrogate
        value, where = stack.pop()
        if isinstance(value, dict):
            for key, child in value.items():
                refuse(key, f"a key of {where or 'the body'}")
                stack.append((child, f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(value))
        elif isinstance(value, str):
            refuse(value, f'"{where}"')


async def json_body(request: Request) -> Dict[str, Any]:
    """The request's body as a JSON object nesting at most ``MAX_JSON_DEPTH`` levels, else an ``InputError``."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:  # the parser recursed past Python's limit: nesting far too deep
        raise InputError(f"the request body nests lists or objects more than {MAX_JSON_DEPTH} levels deep; send "
                         'an object such as {"methods": [...], "targets": {...}}.') from None
    except (ValueError, UnicodeDecodeError):
        raise InputError("the request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InputError(f"the request body must be a JSON object, received a {type(body).__name__}.")
    depth = _depth(body)
    if depth > MAX_JSON_DEPTH:
        raise InputError(f"the request body nests {depth} levels deep; expected at most {MAX_JSON_DEPTH} (the API's "
                         'bodies nest 3: {"methods": [{"name", "arguments": {...}}], "targets": {...}}).')
    _refuse_lone_surrogates(body)
    return body


async def _input_error(request: Request, error: Exception) -> Response:
    return JSONResponse({"error": str(error)}, status_code=400)


async def _model_busy(request: Request, error: Exception) -> Response:
    return JSONResponse({"error": str(error), "busy": True}, status_code=409)


async def _too_many_jobs(request: Request, error: Exception) -> Response:
    return JSONResponse({"error": str(error), "too_many_jobs": True}, status_code=429)


def loading_state(error: StillLoading) -> Dict[str, Any]:
    """What ``GET /api/session`` answers (200) while the model loads: the page shows "loading the
    model..." and asks again (a 503 would be a console error in the browser on every poll)."""
    return {"state": "loading", "loading": True, "seconds": error.seconds,
            "message": f"{error}; the page asks again until it is ready."}


async def _still_loading(request: Request, error: Exception) -> Response:
    return JSONResponse({"loading": True, "seconds": error.seconds, "error": str(error)}, status_code=503)


async def no_icon(request: Request) -> Response:
    """Browsers ask for a favicon; the pages have none."""
    return Response(status_code=204)


def error_handlers() -> dict:
    """The JSON answers of every page's errors: 400 for a refused request, 409 while another job holds
    the model, 429 over the job limit, 503 while the model loads."""
    return {CaptumTransformersError: _input_error, StillLoading: _still_loading, ModelBusy: _model_busy,
            TooManyJobs: _too_many_jobs}


def page_app(html_file: str, api_routes: Sequence[Route]) -> Starlette:
    """A page's Starlette app: ``GET /`` answers ``static/<html_file>``, then the favicon route,
    ``api_routes``, and the static files under ``/static``; errors answered by ``error_handlers``."""
    async def page(request: Request) -> Response:
        return FileResponse(str(static_dir().joinpath(html_file)), media_type="text/html")

    routes = [Route("/", page), Route("/favicon.ico", no_icon), *api_routes,
              Mount("/static", app=StaticFiles(directory=str(static_dir())), name="static")]
    return Starlette(routes=routes, exception_handlers=error_handlers())
