"""The explorer's safety rules as one ASGI middleware, applied to every request.

1. **Host allowlist**: a request carries exactly one ``Host`` header, and it is exactly one
   ``host`` or ``host:port`` whose host names the address the server listens on (``127.0.0.1``,
   ``localhost``, ``[::1]`` by default, plus an explicitly bound host and ``--allowed-host``
   names; letters compared case-blind), so a web page elsewhere cannot reach the API through
   DNS rebinding. A list (``127.0.0.1:8765, evil.com``), whitespace inside or around it,
   userinfo (``user@``), a path, a trailing dot, an unbracketed IPv6 literal or a port that is
   not 1 to 5 digits up to 65535 is refused like an unknown host: 400.
2. **Session token** on ``/api/``: the ``X-Explorer-Token`` header must equal the token
   printed at start (compared in constant time). Otherwise 403. The page and its static files
   carry no data and need no token; the page reads the token once from its URL.
3. **Bounded, JSON-only bodies**: a body over ``max_body_bytes`` is refused with 413 (by its
   ``Content-Length``, and counted as it arrives, chunked or not); a POST whose
   ``Content-Type`` is not ``application/json`` gets 415.
4. **Headers on every answer**: ``Content-Security-Policy: default-src 'self'`` (no inline
   script or style, no other origin), no framing, no MIME sniffing, no referrer.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Iterable, Optional

CONTENT_SECURITY_POLICY = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)
TOKEN_HEADER = "x-explorer-token"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
DEFAULT_MAX_BODY_BYTES = 64 * 1024


def new_token() -> str:
    """A fresh session token (32 random bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


#: One ``host[:port]`` and nothing else: a name or IPv4 address (letters, digits, ``.``, ``-``,
#: ``_``), or an IPv6 literal in brackets; then at most one ``:`` and 1 to 5 digits.
_HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::([0-9]{1,5}))?")


def host_name(host: str) -> Optional[str]:
    """The host of a ``Host`` header that is exactly one ``host[:port]`` (lower case; IPv6
    literals keep their brackets), else ``None``: lists, whitespace, userinfo, paths, an empty
    or out-of-range port."""
    found = _HOST_HEADER.fullmatch(host)
    if found is None or (found.group(2) is not None and int(found.group(2)) > 65535):
        return None
    return found.group(1).lower()


class SecurityMiddleware:
    """See the module docstring. ``allowed_hosts`` are host names without ports."""

    def __init__(self, app, token: str, allowed_hosts: Iterable[str] = LOCAL_HOSTS,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if not token or len(token) < 16:
            raise ValueError("the explorer needs a session token of at least 16 characters.")
        self.app, self.token = app, token
        self.allowed_hosts = frozenset(host.lower() for host in allowed_hosts)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        hosts = [value.decode("latin-1") for key, value in scope["headers"] if key.lower() == b"host"]

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                existing = {key.lower() for key, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [
                    (key, value) for key, value in SECURITY_HEADERS if key not in existing]
            await send(message)

        if len(hosts) != 1 or host_name(hosts[0]) not in self.allowed_hosts:
            received = f"{len(hosts)} Host headers" if len(hosts) != 1 else f"Host: {hosts[0][:80]!r}"
            return await _refuse(send_with_headers, 400, f"Host header not allowed (received {received}): the explorer "
                                 "answers only requests with one Host header that is exactly one host[:port] of the "
                                 "host it listens on (see --allowed-host); open the URL it printed.")
        path = scope.get("path", "")
        if path.startswith("/api/"):
            given = headers.get(TOKEN_HEADER, "")
            if not secrets.compare_digest(given.encode(), self.token.encode()):
                return await _refuse(send_with_headers, 403, "missing or wrong session token: open the URL the "
                                     "explorer printed at start (it carries ?token=...).")
        length = headers.get("content-length")
        if length is not None and (not (length.isascii() and length.isdecimal()) or int(length) > self.max_body_bytes):
            return await _refuse(send_with_headers, 413, f"request body over {self.max_body_bytes} bytes.")
        if scope.get("method") == "POST" and headers.get("content-type", "").split(";")[0].strip() != \
                "application/json":
            return await _refuse(send_with_headers, 415, "the explorer's API takes JSON bodies only "
                                 "(Content-Type: application/json).")
        if scope.get("method") not in ("POST", "PUT", "PATCH", "DELETE"):
            return await self.app(scope, receive, send_with_headers)
        # Read the whole body here, counting it (a chunked body has no Content-Length, and a
        # Content-Length may understate it): past the bound the request is refused, never read on.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return await _refuse(send_with_headers, 413, f"request body over {self.max_body_bytes} bytes.")
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_headers)


async def _refuse(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
