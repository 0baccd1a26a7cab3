"""Running the explorer: bind (127.0.0.1 unless told otherwise), print the URL with the
session token, serve with uvicorn, blocking or in a background thread.

Example::

    >>> server = start(workspace, port=0, blocking=False)   # port 0: any free port
    >>> print(server.url)                                   # http://127.0.0.1:PORT/?token=...
    >>> server.stop()
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from ..errors import InputError
from .loading import LoadingWorkspace
from .security import LOCAL_HOSTS, host_name, new_token

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = (LOOPBACK, "localhost", "::1")


def check_host(host: str, allow_remote: bool) -> None:
    """Refuse a listening address other than loopback unless ``allow_remote`` says so."""
    if host not in LOOPBACK_NAMES and not allow_remote:
        raise InputError(f"--host {host!r} would expose the explorer beyond this machine; add --allow-remote to do "
                         "it on purpose (anyone who has the printed URL can then run the model).")


def check_port(port: int) -> None:
    """Refuse a port outside 0..65535 (0 asks the system for any free port) before anything
    binds: the socket layer would raise ``OverflowError`` deep inside the server."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InputError(f"--port {port!r}: expected a port from 0 to 65535 (0: any free port, the printed URL says "
                         "which), e.g. --port 8765.")


def require_explorer_extra() -> None:
    """Refuse, naming the install command, when Starlette or uvicorn is missing (the module
    itself imports neither, so that this check runs before any import fails)."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InputError("the explorer needs Starlette and uvicorn: pip install 'captum_transformers[explorer]'.") \
            from None


def _allowed_name(extra: str) -> str:
    """An ``--allowed-host`` as the host a ``Host`` header must carry (a port given is dropped:
    any port is taken), or an ``InputError`` when it is not one host name or address."""
    name = host_name(extra) if isinstance(extra, str) else None
    if name is None:
        raise InputError(f"--allowed-host {extra!r}: expected one host name or address, optionally with a port "
                         "(e.g. --allowed-host explorer.example.org, or [fd00::1] for an IPv6 address); give each "
                         "name as its own --allowed-host.")
    return name


def _machine_names() -> set:
    """This machine's host name, fully qualified name and their addresses."""
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    for name in list(names):
        try:
            names.update(socket.gethostbyname_ex(name)[2])
        except OSError:
            pass
    return names


@dataclass
class RunningExplorer:
    """A started explorer: its URL (with the token), the uvicorn server and its thread."""

    url: str
    token: str
    host: str
    port: int
    server: Any
    thread: Optional[threading.Thread]

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)


def start(workspace, host: str = LOOPBACK, port: int = 8765, blocking: bool = True,
          benchmark: Optional[Dict[str, Any]] = None, token: Optional[str] = None, quiet: bool = False,
          allow_remote: bool = False, methods: Optional[Sequence[str]] = None,
          extra_hosts: Sequence[str] = (), warm: bool = True) -> RunningExplorer:
    """Serve ``workspace`` (a ``Workspace``, or a ``LoadingWorkspace`` still building one: the
    URL is printed at once and the page shows the loading) with ``methods`` (default: those
    that can explain its model); when a blocking server's workspace fails to load, the server
    stops and the error is raised.
    ``extra_hosts``: more names the ``Host`` header may carry (a proxy's, a DNS name).
    Another host than loopback needs ``allow_remote=True`` and warns:
    the token is then the only thing between the network and the model."""
    require_explorer_extra()
    import uvicorn

    from .app import create_app

    check_port(port)
    check_host(host, allow_remote)
    extras = {_allowed_name(name) for name in extra_hosts}  # before anything binds
    if host not in LOOPBACK_NAMES:
        print(f"WARNING: the explorer listens on {host}, reachable from other machines; anyone with the URL "
              "(its token) can run the model.", file=sys.stderr)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port} ({error.strerror}); choose another --port.") from None
    port = sock.getsockname()[1]
    token = token or new_token()
    allowed = set(LOCAL_HOSTS) | {host.lower(), f"[{host.lower()}]"} | extras
    if host not in LOOPBACK_NAMES:
        allowed |= _machine_names()  # how other machines address this one
        print(f"requests must name one of these hosts (add more with --allowed-host): {', '.join(sorted(allowed))}",
              file=sys.stderr)
    app = create_app(workspace, token, allowed_hosts=allowed, benchmark=benchmark, methods=methods,
                     warm=warm)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/?token={token}"
    if not quiet:
        if isinstance(workspace, LoadingWorkspace):
            what = "loading the model"
        elif isinstance(workspace, (list, tuple)):
            what = ", ".join(w.name for w in workspace)
        else:
            what = workspace.name
        print(f"captum-transformers explorer ({what}): open {url}", flush=True)
    if isinstance(workspace, LoadingWorkspace):
        stop_if_failed = workspace.on_done

        def on_done(error):
            if stop_if_failed is not None:
                stop_if_failed(error)
            if error is not None and blocking:
                server.should_exit = True  # the command reports the error and exits 2

        workspace.on_done = on_done
        if workspace.wait(0):  # it ended before the hook was set
            on_done(workspace.error)
    if blocking:
        server.run(sockets=[sock])
        if isinstance(workspace, LoadingWorkspace) and workspace.error is not None:
            raise workspace.error
        return RunningExplorer(url, token, host, port, server, None)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="captum-explorer-server")
    thread.start()
    deadline = time.time() + 10
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    return RunningExplorer(url, token, host, port, server, thread)
