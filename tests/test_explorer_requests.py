"""Malformed requests get a 400 naming what was received and what was expected, never a 500:
deeply nested bodies, digits other than ASCII 0-9 in example keys and ``?model=``, arguments
outside the range their method accepts (caught with the request, not inside the job)."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from captum_transformers.explorer.app import create_app  # noqa: E402
from explorer_workspaces import image_workspace  # noqa: E402

TOKEN = "test-token-0123456789abcdef"
HEADERS = {"X-Explorer-Token": TOKEN}


@pytest.fixture(scope="module")
def client():
    # raise_server_exceptions=False: an unhandled error shows as the 500 a browser would get
    return TestClient(create_app(image_workspace(), TOKEN, allowed_hosts=("testserver",), warm=False),
                      raise_server_exceptions=False)


def post(client, body: bytes, path="/api/explain"):
    return client.post(path, headers={**HEADERS, "Content-Type": "application/json"}, content=body)


@pytest.mark.parametrize("depth", [20, 5000])
def test_deeply_nested_bodies_are_refused(client, depth):
    body = b'{"methods": ' + b"[" * depth + b"]" * depth + b', "targets": {"0": 0}}'
    response = post(client, body)
    assert response.status_code == 400, response.text
    assert "levels deep" in response.json()["error"]


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "+1", " 1", "", "1" * 40])
def test_example_keys_other_than_ascii_digits_are_refused(client, key):
    response = client.post("/api/explain", headers=HEADERS,
                           json={"methods": [{"name": "rollout"}], "targets": {key: 0}})
    assert response.status_code == 400, response.text
    assert "digits 0-9" in response.json()["error"]


@pytest.mark.parametrize("model", ["\u00b2", "\u0661", "-1", "1"])
def test_model_index_other_than_an_ascii_index_in_range_is_refused(client, model):
    response = client.get("/api/session", headers=HEADERS, params={"model": model})
    assert response.status_code == 400, response.text
    assert "expected an index 0 to 0" in response.json()["error"]


def test_ascii_keys_and_model_zero_still_work(client):
    assert client.get("/api/session", headers=HEADERS, params={"model": "0"}).status_code == 200
    response = client.post("/api/explain", headers=HEADERS, json={"methods": [{"name": "rollout"}], "targets": {"1": 0}})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("arguments, expected", [
    ({"discard_ratio": 1.0}, "discard_ratio=1.0 is outside [0.0, 1.0)"),
    ({"discard_ratio": -0.1}, "discard_ratio=-0.1 is outside [0.0, 1.0)"),
])
def test_rollout_discard_ratio_outside_its_range_is_refused_with_the_request(client, arguments, expected):
    response = client.post("/api/explain", headers=HEADERS,
                           json={"methods": [{"name": "rollout", "arguments": arguments}], "targets": {"0": 0}})
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]


def test_non_ascii_content_length_is_refused():
    """"\u00b2".isdigit() is True but int() refuses it: the middleware must answer 413, not fail."""
    import asyncio

    from captum_transformers.explorer.security import SecurityMiddleware

    async def app(scope, receive, send):  # never reached
        raise AssertionError("the request went past the middleware")

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/api/explain",
             "headers": [(b"host", b"127.0.0.1"), (b"x-explorer-token", TOKEN.encode()),
                         (b"content-type", b"application/json"), (b"content-length", "\u00b2".encode("latin-1"))]}
    asyncio.run(SecurityMiddleware(app, TOKEN)(scope, receive, send))
    assert sent[0]["status"] == 413
