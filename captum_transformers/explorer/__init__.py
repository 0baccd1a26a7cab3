"""A local web app to explore explanations: ``captum-transformers explore``.

``workspace`` holds the model, one batch and cached maps; ``app`` the Starlette routes;
``security`` the token, Host allowlist, CSP and body bounds; ``server`` starts uvicorn;
``method_arguments`` turns the method catalog into form fields; ``curves`` the per-example
deletion/insertion curves; ``export`` the self-contained HTML view; ``static/`` the page.
Needs the ``explorer`` extra (Starlette, uvicorn) to serve.
"""
from .sources import builtin_workspace, loaded_workspace
from .workspace import Workspace

__all__ = ["Workspace", "builtin_workspace", "loaded_workspace"]
