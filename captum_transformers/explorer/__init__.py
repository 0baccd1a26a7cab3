"""A local web app to explore explanations: ``captum-transformers explore``.

Two pages, one subpackage each under ``pages/``: ``classifier`` (a batch of images or texts,
the methods x examples grid, curves, export) and ``generation`` (a causal LM, each generated
token explained); each has its ``workspace``, ``sources``, ``app`` (routes) and ``export``.
Shared by both: ``app`` (the table of pages and ``create_app``, which picks the page serving
a workspace), ``http`` (static files, JSON bodies, method lists, error answers), ``jobs`` (the
worker thread explanations run in), ``explaining`` (catalog methods and the stop check that
cancels a job), ``loading`` (a workspace built in the background), ``method_arguments`` (the
method catalog as form fields, and the work budget), ``security`` (the token, Host allowlist,
CSP and body bounds), ``server`` (uvicorn), ``curves`` (per-example deletion/insertion curves);
``static/`` the pages' files. Needs the ``explorer`` extra (Starlette, uvicorn) to serve.
"""
from .pages.classifier.sources import builtin_workspace, loaded_workspace
from .pages.classifier.workspace import Workspace

__all__ = ["Workspace", "builtin_workspace", "loaded_workspace"]
