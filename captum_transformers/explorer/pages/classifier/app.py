"""The explorer's classifier page and its JSON API (Starlette), for image and text classifiers.

Routes (every ``/api/`` route needs the session token, see ``security``)::

    GET  /                    the page (static/index.html)
    GET  /static/...          its script and style sheet (shared with the generation page, ``http``)
    GET  /api/session         model, classes, method catalog with argument fields, the gallery
                              (200 {"state": "loading", "seconds"} while the model loads;
                              "state": "ready" once loaded)
    POST /api/explain         {"methods": [{"name", "arguments"}], "targets": {"<example>": class}}
                              -> a job (done at once when every map is cached)
    GET  /api/jobs/{id}       progress and maps of a job
    POST /api/jobs/{id}/cancel  stop a job at its next torch operation (state "cancelled")
    POST /api/curve           {"method", "arguments", "example", "target"} -> deletion/insertion curve
    GET  /api/benchmark       the aggregate curves of the results.json given at start (or none)
    POST /api/export          like /api/explain, answered with a self-contained HTML file as a string

A request's work (examples x ``n_steps``, summed over its methods) is bounded by
``method_arguments.WORK_BUDGET`` (400 naming it). Jobs run in a worker thread, so a long one
holds up no request: a curve or export that needs a map not cached while a job runs is
answered 409 at once (naming the job to cancel) instead of waiting for the model. At most
``method_arguments.MAX_UNFINISHED_JOBS`` jobs of a model may be queued or running: one more
is answered 429 (naming them, to cancel one or wait), so the queued work stays bounded.

Example::

    >>> app = create_classifier_app(workspace, token="a-long-random-session-token")
    >>> # uvicorn.run(app, host="127.0.0.1", port=8765)
"""
from __future__ import annotations

import base64
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ....errors import CaptumTransformersError, InputError
from ....methods.catalog import METHOD_NAMES
from ...curves import deletion_insertion
from ...explaining import available_methods
from ...http import ModelBusy, json_body, loading_state, page_app, parse_methods, shown
from ...jobs import Jobs
from ...loading import LoadingWorkspace, StillLoading
from ...method_arguments import check_work, method_catalog
from ...security import DEFAULT_MAX_BODY_BYTES, LOCAL_HOSTS, SecurityMiddleware

#: What the page shows first: these methods (those offered; else the first offered) on the
#: first examples of the batch, each for its predicted class.
DEFAULT_METHODS = ("rollout", "generic-attention")
DEFAULT_EXAMPLES = 6


def default_view(workspace, offered: Sequence[str]) -> Dict[str, Any]:
    """``{"methods": [...], "examples": [...]}``: the grid the page opens with."""
    methods = [name for name in DEFAULT_METHODS if name in offered] or list(offered[:1])
    return {"methods": methods, "examples": list(range(min(DEFAULT_EXAMPLES, len(workspace))))}


def display_payload(workspace, index: int) -> Dict[str, Any]:
    """What the page draws for one example: an RGB image as base64 bytes (H, W, 3), or tokens."""
    display = workspace.displays[index]
    if workspace.modality == "text":
        return {"tokens": [str(token) for token in display]}
    image = torch.as_tensor(display).detach().float().cpu()
    if image.dim() == 2:
        image = image.unsqueeze(0)
    if image.shape[0] == 1:
        image = image.expand(3, *image.shape[1:])
    if image.dim() != 3 or image.shape[0] != 3:
        raise InputError(f"example {index}: expected an image of shape (3, H, W) or (1, H, W) in [0, 1], received "
                         f"{tuple(image.shape)}.")
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
    return {"rgb": base64.b64encode(pixels.numpy().tobytes()).decode("ascii"), "height": int(pixels.shape[0]),
            "width": int(pixels.shape[1])}


def session_payload(workspace, benchmark: Optional[Dict[str, Any]] = None,
                    methods: Sequence[str] = METHOD_NAMES) -> Dict[str, Any]:
    """What ``GET /api/session`` answers for ``workspace`` (without the model list)."""
    examples = []
    for prediction in workspace.predictions():
        entry = {"index": prediction.index, "predicted": prediction.predicted,
                 "probability": prediction.probability, "margin": prediction.margin,
                 "labels": list(prediction.labels), "correct": prediction.correct}
        entry.update(display_payload(workspace, prediction.index))
        examples.append(entry)
    return {"model": workspace.name, "modality": workspace.modality, "classes": workspace.class_names,
            "methods": method_catalog(methods), "examples": examples, "has_benchmark": benchmark is not None,
            "defaults": default_view(workspace, methods)}


def _parse_targets(workspace, raw: Any) -> Dict[int, int]:
    if not isinstance(raw, dict) or not raw:
        raise InputError('"targets" must be a non-empty object {"<example index>": class index}.')
    if len(raw) > len(workspace):
        raise InputError(f"{len(raw)} targets for a batch of {len(workspace)} examples.")
    targets = {}
    for key, value in raw.items():
        if not _is_index(key):
            raise InputError(f"example keys must be indices written as strings of the digits 0-9, received "
                             f"{shown(key)}; write them as in {{\"0\": 3}}.")
        targets[int(key)] = value
    return workspace.check_targets(targets)


def _refuse_if_busy(workspace, jobs, requests, targets) -> None:
    """Raise ``ModelBusy`` when ``requests`` need maps not cached while a job runs: computing
    them would wait for that job (one explanation of a model at a time)."""
    running = jobs.busy()
    if running is None:
        return
    if all(len(workspace.cached(method, arguments, targets)) == len(targets) for method, arguments in requests):
        return  # everything is cached: answered without the model
    raise ModelBusy(f"the model is busy with {running['id']} ({running['running'] or 'starting'}, "
                    f"{running['done']}/{running['total']} methods done); this request needs maps not computed yet. "
                    f"Cancel that job (the page's Cancel button, or POST api/jobs/{running['id']}/cancel) or ask "
                    "again when it ends.")


def _is_index(text: Any) -> bool:
    """Whether ``text`` is a non-negative integer written in the ASCII digits 0-9 (``str.isdigit``
    also takes "²", which ``int`` refuses, and ``str.isdecimal`` other scripts' digits)."""
    return isinstance(text, str) and 0 < len(text) <= 9 and text.isascii() and text.isdecimal()


def create_classifier_app(workspace, token: str, allowed_hosts=LOCAL_HOSTS,
                          benchmark: Optional[Dict[str, Any]] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                          methods: Optional[Sequence[str]] = None, warm: bool = True):
    """The classifier page of ``workspace`` as an ASGI app (wrapped in ``SecurityMiddleware``).

    ``workspace``: a ``Workspace``, a ``LoadingWorkspace`` still building one (the API then
    answers ``/api/session`` with 200 ``{"state": "loading", "seconds": ...}`` and the other
    routes with 503 until it is ready), or a list of
    Workspaces, one per model, chosen by ``?model=<index>`` on API calls; ``benchmark``:
    aggregate curves (``benchmark_curves(path)``) shown beside the per-example ones;
    ``methods``: the catalog names offered (default: those that can explain the model);
    ``warm``: compute the page's default view in the background as soon as the workspace is
    ready, so that the first page finds it cached.
    """
    source = workspace if isinstance(workspace, LoadingWorkspace) else None
    # several workspaces (one per model, as Captum Insights' list of models): the page picks one
    # with ?model=<index> on every API call; each has its own cache, jobs and session
    workspaces = list(workspace) if isinstance(workspace, (list, tuple)) else [workspace]
    if not workspaces or (len(workspaces) > 1 and any(isinstance(w, LoadingWorkspace) for w in workspaces)):
        raise InputError("create_app takes one Workspace (or LoadingWorkspace), or a non-empty list of Workspaces.")
    ready: List[Dict[str, Any]] = [{} for _ in workspaces]
    lock = threading.Lock()

    def context(model: int = 0):
        """``(workspace, jobs, offered methods, session payload)`` of model ``model`` once it exists."""
        try:
            current = source.get() if source is not None else workspaces[model]
        except (StillLoading, CaptumTransformersError):
            raise
        except Exception as error:  # an unexpected failure while loading: say what it was
            raise InputError(f"the model could not be loaded ({type(error).__name__}: {error}).") from None
        entry = ready[model]
        with lock:
            if not entry:
                offered = list(methods) if methods is not None else available_methods(current.model)
                session = session_payload(current, benchmark, offered)
                session.update(model_index=model, models=[getattr(w, "name", "model") for w in workspaces])
                if source is not None:
                    session["models"] = [current.name]
                entry.update(workspace=current, jobs=Jobs(current), methods=offered, session=session)
                if model == 0:
                    app.state.jobs, app.state.workspace = entry["jobs"], current
                if warm:
                    view = session["defaults"]
                    predicted = {p.index: p.predicted for p in current.predictions()}
                    entry["jobs"].submit([(name, {}) for name in view["methods"]],
                                         {index: predicted[index] for index in view["examples"]}, background=True)
        return entry["workspace"], entry["jobs"], entry["methods"], entry["session"]

    def model_of(request: Request) -> int:
        raw = request.query_params.get("model", "0")
        if not _is_index(raw) or int(raw) >= len(workspaces):
            raise InputError(f"?model={shown(raw)}: expected an index 0 to {len(workspaces) - 1} written in the "
                             "digits 0-9 (the position of the model in the page's list).")
        return int(raw)

    async def get_session(request: Request) -> Response:
        try:
            session = context(model_of(request))[3]
        except StillLoading as error:  # the page's poll: a state to show, not an error
            return JSONResponse(loading_state(error))
        return JSONResponse({**session, "state": "ready"})

    async def explain(request: Request) -> Response:
        workspace, jobs, methods, _ = context(model_of(request))
        body = await json_body(request)
        requests = parse_methods(body.get("methods"), methods)
        targets = _parse_targets(workspace, body.get("targets"))
        check_work(requests, len(targets))
        return JSONResponse(jobs.submit(requests, targets))

    async def job(request: Request) -> Response:
        state = context(model_of(request))[1].read(request.path_params["job_id"])
        if state is None:
            return JSONResponse({"error": "no such job (finished jobs are kept for a while only)."}, status_code=404)
        return JSONResponse(state)

    async def cancel_job(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        state = context(model_of(request))[1].cancel(job_id)
        if state is None:
            return JSONResponse({"error": f"no job {shown(job_id)} on this model (finished jobs are kept for a while "
                                          "only; ids look like job-7)."}, status_code=404)
        return JSONResponse(state)

    def _curve_sync(body, model: int) -> Dict[str, Any]:
        workspace, jobs, methods, _ = context(model)
        requested = {"name": body.get("method"), "arguments": body.get("arguments")}
        (method, arguments), = parse_methods([requested], methods)
        targets = _parse_targets(workspace, {str(body.get("example")): body.get("target")})
        check_work([(method, arguments)], 1)
        _refuse_if_busy(workspace, jobs, [(method, arguments)], targets)
        (index, target), = targets.items()
        found = workspace.explain(method, arguments, targets)[index]
        scores = torch.tensor(found["values"]).reshape(found["shape"])
        return {"method": method, "example": index, **deletion_insertion(workspace, index, scores, target)}

    async def curve(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        body = await json_body(request)
        return JSONResponse(await run_in_threadpool(_curve_sync, body, model_of(request)))

    async def get_benchmark(request: Request) -> Response:
        return JSONResponse(benchmark or {"metrics": {}})

    def _export_sync(body, model: int) -> Dict[str, Any]:
        from .export import explorer_html

        workspace, jobs, methods, _ = context(model)
        requests = parse_methods(body.get("methods"), methods)
        targets = _parse_targets(workspace, body.get("targets"))
        check_work(requests, len(targets))
        _refuse_if_busy(workspace, jobs, requests, targets)
        maps = {method: workspace.explain(method, arguments, targets) for method, arguments in requests}
        return {"filename": "captum_transformers_explorer.html", "html": explorer_html(workspace, maps, targets)}

    async def export(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        body = await json_body(request)
        return JSONResponse(await run_in_threadpool(_export_sync, body, model_of(request)))

    app = page_app("index.html", [
        Route("/api/session", get_session),
        Route("/api/explain", explain, methods=["POST"]),
        Route("/api/jobs/{job_id}", job),
        Route("/api/jobs/{job_id}/cancel", cancel_job, methods=["POST"]),
        Route("/api/curve", curve, methods=["POST"]),
        Route("/api/benchmark", get_benchmark),
        Route("/api/export", export, methods=["POST"]),
    ])
    if source is None:
        for model in range(len(workspaces)):
            context(model)  # ready workspaces: build the sessions now, so that their errors surface here
    else:  # build it (and start the default view) as soon as the workspace is loaded
        earlier = source.on_done

        def loaded(error):
            if earlier is not None:
                earlier(error)
            if error is None:
                context()

        source.on_done = loaded
        if source.wait(0) and source.error is None:
            context()
    return SecurityMiddleware(app, token, allowed_hosts, max_body_bytes)
