"""The explorer's generation page and its JSON API (Starlette), for a causal language model.

Routes (every ``/api/`` route needs the session token; the same ``SecurityMiddleware`` as the
classifier page: Host allowlist, CSP without inline script, bounded JSON bodies)::

    GET  /                       the page (static/generation.html)
    GET  /api/session            {"page": "generation", "model", "methods" (catalog with fields),
                                  "samples", "scores", "bounds": {"max_prompt_tokens", "max_new_tokens",
                                  "work_budget"}, "defaults": {"method", "max_new_tokens"}}
                                 (200 {"state": "loading", "seconds"} while the model loads)
    POST /api/generate           {"prompt", "max_new_tokens", "methods": [{"name", "arguments"}],
                                  "score": "logit" | "log_prob" | "contrast", "contrast": foil}
                                 -> a job (done at once when cached): {"id", "state", "done", "total",
                                  "results": [{"method", "arguments", "result": <result_to_dict>}], ...}
    GET  /api/jobs/{id}          the job, as above
    POST /api/jobs/{id}/cancel   stop it at its next torch operation
    POST /api/generate/export    the body of /api/generate -> {"filename", "html"}: the view as one
                                 self-contained HTML file (no script)

A prompt over ``max_prompt_tokens`` tokens, ``max_new_tokens`` over its bound and a request
whose methods x new tokens x ``n_steps`` exceed ``WORK_BUDGET`` are answered 400 with a
message naming the bound and the fix. The greedy answer of a prompt is generated once, then
every method explains those same tokens (``GenerationWorkspace``).

Example::

    >>> app = create_generation_app(GenerationWorkspace(model, tokenizer), token="a-long-random-session-token")
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ....errors import CaptumTransformersError, InputError
from ...explaining import available_methods
from ...http import ModelBusy, json_body, loading_state, page_app, parse_methods, shown
from ...jobs import Jobs
from ...loading import StillLoading
from ...method_arguments import WORK_BUDGET, method_catalog
from ...security import DEFAULT_MAX_BODY_BYTES, LOCAL_HOSTS, SecurityMiddleware
from .sources import LoadingGenerationWorkspace
from .workspace import SCORES, GenerationWorkspace, check_generation_work

#: The method the page opens with (the first offered if it is not).
DEFAULT_METHOD = "attn-lrp"


def generation_session(workspace: GenerationWorkspace, methods: Sequence[str]) -> Dict[str, Any]:
    """What the page needs to draw its controls (see the module docstring)."""
    return {"page": "generation", "model": workspace.name, "methods": method_catalog(methods),
            "samples": list(workspace.samples), "scores": list(SCORES),
            "bounds": {"max_prompt_tokens": workspace.max_prompt_tokens, "max_new_tokens": workspace.max_new_tokens,
                       "work_budget": WORK_BUDGET},
            "defaults": {"method": DEFAULT_METHOD if DEFAULT_METHOD in methods else methods[0],
                         "max_new_tokens": workspace.default_new_tokens}}


def job_payload(state: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A job's state with each method's result under ``"result"`` (the job runner keys its
    outputs by example; a generation job has one request, example 0)."""
    if state is None:
        return None
    results = [{"method": entry["method"], "arguments": entry["arguments"], "result": entry["maps"]["0"]}
               for entry in state["results"]]
    return {**state, "results": results}


def create_generation_app(workspace, token: str, allowed_hosts=LOCAL_HOSTS,
                          max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, methods: Optional[Sequence[str]] = None):
    """The generation page of ``workspace`` (a ``GenerationWorkspace``, or a
    ``LoadingGenerationWorkspace`` still building one) as an ASGI app wrapped in
    ``SecurityMiddleware``; ``methods``: the catalog names offered (default: those that can
    explain the model)."""
    source = workspace if isinstance(workspace, LoadingGenerationWorkspace) else None
    if source is None and not isinstance(workspace, GenerationWorkspace):
        raise InputError(f"create_generation_app takes a GenerationWorkspace, received {type(workspace).__name__}.")
    ready: Dict[str, Any] = {}
    lock = threading.Lock()

    def context():
        """``(workspace, jobs, offered methods, session payload)`` once the workspace exists."""
        try:
            current = source.get() if source is not None else workspace
        except (StillLoading, CaptumTransformersError):
            raise
        except Exception as error:  # an unexpected failure while loading: say what it was
            raise InputError(f"the model could not be loaded ({type(error).__name__}: {error}).") from None
        with lock:
            if not ready:
                offered = list(methods) if methods is not None else available_methods(current.model)
                ready.update(workspace=current, jobs=Jobs(current), methods=offered,
                             session=generation_session(current, offered))
        return ready["workspace"], ready["jobs"], ready["methods"], ready["session"]

    def parsed(body: Dict[str, Any]):
        current, jobs, offered, _ = context()
        requests = parse_methods(body.get("methods"), offered)
        request = current.check_request(body)
        check_generation_work(requests, request.max_new_tokens)
        return current, jobs, requests, {0: request}

    async def get_session(request: Request) -> Response:
        try:
            session = context()[3]
        except StillLoading as error:  # the page's poll: a state to show, not an error
            return JSONResponse(loading_state(error))
        return JSONResponse({**session, "state": "ready"})

    async def generate(request: Request) -> Response:
        _, jobs, requests, targets = parsed(await json_body(request))
        return JSONResponse(job_payload(jobs.submit(requests, targets)))

    async def job(request: Request) -> Response:
        state = job_payload(context()[1].read(request.path_params["job_id"]))
        if state is None:
            return JSONResponse({"error": "no such job (finished jobs are kept for a while only)."}, status_code=404)
        return JSONResponse(state)

    async def cancel_job(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        state = job_payload(context()[1].cancel(job_id))
        if state is None:
            return JSONResponse({"error": f"no job {shown(job_id)} (finished jobs are kept for a while only; ids "
                                          "look like job-7)."}, status_code=404)
        return JSONResponse(state)

    def _export_sync(body: Dict[str, Any]) -> Dict[str, Any]:
        from .export import generation_html

        current, jobs, requests, targets = parsed(body)
        running = jobs.busy()
        if running is not None and not all(current.cached(m, a, targets) for m, a in requests):
            raise ModelBusy(f"the model is busy with {running['id']}; this export needs results not computed yet. "
                            f"Cancel that job (the page's Cancel button, or POST api/jobs/{running['id']}/cancel) or "
                            "export again when it ends.")
        results = {method: current.explain(method, arguments, targets)[0] for method, arguments in requests}
        return {"filename": "captum_transformers_generation.html", "html": generation_html(current.name, results)}

    async def export(request: Request) -> Response:
        from starlette.concurrency import run_in_threadpool

        return JSONResponse(await run_in_threadpool(_export_sync, await json_body(request)))

    app = page_app("generation.html", [
        Route("/api/session", get_session),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/generate/export", export, methods=["POST"]),
        Route("/api/jobs/{job_id}", job),
        Route("/api/jobs/{job_id}/cancel", cancel_job, methods=["POST"]),
    ])
    if source is None:
        context()  # a ready workspace: build the session now, so that its errors surface here
    return SecurityMiddleware(app, token, allowed_hosts, max_body_bytes)
