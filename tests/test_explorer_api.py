"""The explorer's API through Starlette's TestClient: safety rules, caching, one attribute
call per batch, batch == single, curves against the model, exports as text."""
from __future__ import annotations

import json
import re
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from captum_transformers.evaluation.results import CurveResult, write_json  # noqa: E402
from captum_transformers.explorer.app import create_app
from captum_transformers.explorer.pages.classifier.benchmark import benchmark_curves  # noqa: E402
from captum_transformers.explorer.security import CONTENT_SECURITY_POLICY  # noqa: E402
from explorer_workspaces import PAYLOAD, CountingBuilder, image_workspace, text_workspace  # noqa: E402

TOKEN = "test-token-0123456789abcdef"
HEADERS = {"X-Explorer-Token": TOKEN}


def client_for(workspace, warm=False, **kwargs) -> TestClient:
    # TestClient sends Host: testserver; the allowlist is told so, like a bound host would be.
    # No warm-up by default: the tests count attribute calls.
    return TestClient(create_app(workspace, TOKEN, allowed_hosts=("testserver",), warm=warm, **kwargs))


def explain(client, methods, targets):
    response = client.post("/api/explain", headers=HEADERS, json={"methods": methods, "targets": targets})
    assert response.status_code == 200, response.text
    state = response.json()
    jobs = client.app.app.state.jobs  # the Starlette app behind the security middleware
    if state["state"] == "running":
        state = jobs.wait(state["id"])
    assert state["state"] == "done", state
    return state


@pytest.fixture(scope="module")
def counted():
    builder = CountingBuilder()
    workspace = image_workspace(builder)
    return client_for(workspace), builder, workspace


def test_api_needs_the_token(counted):
    client, _, _ = counted
    assert client.get("/api/session").status_code == 403
    assert client.get("/api/session", headers={"X-Explorer-Token": TOKEN[:-1] + "x"}).status_code == 403
    refused = client.post("/api/explain", json={"methods": [{"name": "rollout"}], "targets": {"0": 0}})
    assert refused.status_code == 403 and "token" in refused.json()["error"]
    assert client.get("/api/session", headers=HEADERS).status_code == 200
    assert client.get("/").status_code == 200  # the page itself carries no data


def test_foreign_host_is_refused(counted):
    client, _, _ = counted
    for path in ("/", "/api/session", "/static/explorer.js"):
        response = client.get(path, headers={**HEADERS, "Host": "evil.example:8765"})
        assert response.status_code == 400, path
        assert "Host" in response.json()["error"]


def test_security_headers_on_every_answer(counted):
    client, _, _ = counted
    for response in (client.get("/"), client.get("/static/explorer.js"), client.get("/api/session", headers=HEADERS),
                     client.get("/api/session"), client.get("/api/jobs/none", headers=HEADERS)):
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert CONTENT_SECURITY_POLICY.startswith("default-src 'self'")
        assert response.headers["x-content-type-options"] == "nosniff"


def test_page_has_no_inline_script_or_style():
    from captum_transformers.explorer.http import static_dir

    page = static_dir().joinpath("index.html").read_text()
    assert "<script>" not in page and "<style" not in page and "style=" not in page
    assert not re.search(r"\son[a-z]+\s*=", page, re.IGNORECASE)  # no inline event handlers
    scripts = [path for path in static_dir().iterdir() if path.name.endswith(".js")
               and not path.name.startswith(("generation", "store"))]  # theirs: test_explorer_generation.py, _store.py
    assert len(scripts) == 4 and all(f'src="static/{path.name}"' in page for path in scripts)
    # relative URLs only: behind a proxy that serves the page under a path, absolute ones miss
    assert not re.search(r'(src|href)="/', page)
    for path in scripts:
        script = path.read_text()
        assert "innerHTML" not in script and "outerHTML" not in script and "insertAdjacentHTML" not in script
        assert "eval(" not in script and "document.write" not in script
        assert not re.search(r"""api\(["'`]/""", script)


def test_oversize_and_non_json_bodies_are_refused(counted):
    client, builder, _ = counted
    before = len(builder.calls)
    big = json.dumps({"methods": [{"name": "rollout"}], "targets": {"0": 0}, "pad": "x" * 70_000})
    response = client.post("/api/explain", headers={**HEADERS, "Content-Type": "application/json"}, content=big)
    assert response.status_code == 413
    chunks = (b"x" * 10_000 for _ in range(10))  # chunked: no Content-Length to check up front
    chunked = client.post("/api/explain", headers={**HEADERS, "Content-Type": "application/json"}, content=chunks)
    assert chunked.status_code == 413
    form = client.post("/api/explain", headers=HEADERS, data={"methods": "rollout"})
    assert form.status_code == 415
    assert len(builder.calls) == before


def test_one_attribute_call_per_batch_and_cache_hits(counted):
    client, builder, workspace = counted
    before = len(builder.calls)
    targets = {"0": 1, "1": 2, "2": 0, "3": 4}
    first = explain(client, [{"name": "generic-attention", "arguments": {"start_layer": 1}}], targets)
    assert builder.calls[before:] == [("generic-attention", {"start_layer": 1}, 4)]
    again = client.post("/api/explain", headers=HEADERS, json={
        "methods": [{"name": "generic-attention", "arguments": {"start_layer": 1}}], "targets": targets}).json()
    assert again["state"] == "done"  # answered from the cache in the same request
    assert len(builder.calls) == before + 1
    assert again["results"][0]["maps"] == first["results"][0]["maps"]
    # one more target for example 0: only that example is computed, in one call
    explain(client, [{"name": "generic-attention", "arguments": {"start_layer": 1}}], {"0": 3, "1": 2})
    assert builder.calls[before + 1:] == [("generic-attention", {"start_layer": 1}, 1)]
    # another argument value is another cache entry
    explain(client, [{"name": "generic-attention", "arguments": {"start_layer": 0}}], {"0": 3})
    assert len(builder.calls) == before + 3


def test_batch_equals_single():
    workspace = image_workspace()
    targets = {0: 1, 1: 2, 2: 0, 3: 4}
    batched = workspace.explain("rollout", {"head_fusion": "max"}, targets)
    for index, target in targets.items():
        single = image_workspace().explain("rollout", {"head_fusion": "max"}, {index: target})[index]
        assert torch.allclose(torch.tensor(single["values"]), torch.tensor(batched[index]["values"]), atol=1e-5)


def test_targets_and_arguments_are_checked(counted):
    client, _, _ = counted
    cases = [
        ({"methods": [{"name": "rollout", "arguments": {"head_fusion": "median"}}], "targets": {"0": 0}}, "median"),
        ({"methods": [{"name": "rollout", "arguments": {"colour": 1}}], "targets": {"0": 0}}, "colour"),
        ({"methods": [{"name": "no-such-method"}], "targets": {"0": 0}}, "no-such-method"),
        ({"methods": [{"name": "rollout"}], "targets": {"0": 7}}, "target 7"),
        ({"methods": [{"name": "rollout"}], "targets": {"9": 0}}, "example 9"),
        ({"methods": [{"name": "rollout", "arguments": {"start_layer": 0.5}}], "targets": {"0": 0}}, "whole"),
    ]
    for body, expected in cases:
        response = client.post("/api/explain", headers=HEADERS, json=body)
        assert response.status_code == 400 and expected in response.json()["error"], (body, response.text)


def test_method_error_is_reported_not_drawn(counted):
    client, _, _ = counted
    response = client.post("/api/explain", headers=HEADERS, json={
        "methods": [{"name": "rollout", "arguments": {"start_layer": 40}}], "targets": {"0": 0}})
    state = client.app.app.state.jobs.wait(response.json()["id"])
    assert state["state"] == "error" and "start_layer" in state["error"] and not state["results"]


def test_curve_ends_agree_with_the_model(counted):
    client, _, workspace = counted
    response = client.post("/api/curve", headers=HEADERS, json={"method": "rollout", "arguments": {}, "example": 2,
                                                                   "target": 3})
    assert response.status_code == 200, response.text
    curve = response.json()
    clean = workspace.probabilities[2, 3].item()
    assert curve["x"][0] == 0.0 and curve["x"][-1] == 1.0
    assert curve["deletion"]["y"][0] == pytest.approx(clean, abs=1e-5)  # nothing removed yet
    assert curve["insertion"]["y"][-1] == pytest.approx(clean, abs=1e-5)  # everything inserted
    with torch.no_grad():
        blank = workspace.model(torch.zeros_like(workspace.inputs[0][2:3])).softmax(-1)[0, 3].item()
    assert curve["deletion"]["y"][-1] == pytest.approx(blank, abs=1e-5)
    assert curve["insertion"]["y"][0] == pytest.approx(blank, abs=1e-5)


def test_session_gallery_and_text_payloads():
    client = client_for(text_workspace())
    session = client.get("/api/session", headers=HEADERS).json()
    assert session["modality"] == "text" and session["classes"][1] == PAYLOAD
    assert session["examples"][0]["tokens"][2] == PAYLOAD  # user data travels as data, unchanged
    assert {e["correct"] for e in session["examples"]} <= {True, False}
    names = [m["name"] for m in session["methods"]]
    assert "rollout" in names and "integrated-gradients" in names
    state = explain(client, [{"name": "rollout"}], {"0": 0, "1": 2})
    assert state["results"][0]["maps"]["0"]["values"][0] == 0.0  # [CLS] is special: shown, scored 0
    curve = client.post("/api/curve", headers=HEADERS, json={"method": "rollout", "example": 0, "target": 2}).json()
    workspace = client.app.app.state.workspace
    assert curve["deletion"]["y"][0] == pytest.approx(workspace.probabilities[0, 2].item(), abs=1e-5)
    with torch.no_grad():  # every token but [CLS] replaced by id 0
        emptied = workspace.model(torch.tensor([[1, 0, 0, 0]])).softmax(-1)[0, 2].item()
    assert curve["deletion"]["y"][-1] == pytest.approx(emptied, abs=1e-5)
    assert curve["insertion"]["y"][0] == pytest.approx(emptied, abs=1e-5)
    assert curve["insertion"]["y"][-1] == pytest.approx(workspace.probabilities[0, 2].item(), abs=1e-5)


def test_html_export_escapes_user_strings():
    client = client_for(text_workspace())
    response = client.post("/api/export", headers=HEADERS, json={"methods": [{"name": "rollout"}],
                                                                 "targets": {"0": 1, "1": 0}})
    assert response.status_code == 200, response.text
    document = response.json()["html"]
    assert PAYLOAD not in document and "<b>bold</b>" not in document
    assert "&lt;img src=x onerror=" in document and "&lt;b&gt;bold&lt;/b&gt;" in document
    image = client_for(image_workspace()).post("/api/export", headers=HEADERS, json={
        "methods": [{"name": "rollout"}], "targets": {"0": 1}}).json()["html"]
    assert image.count("data:image/png;base64,") == 2 and "<script" not in image


def test_benchmark_curves_from_results_json(tmp_path):
    path = tmp_path / "results.json"
    write_json([("rollout", CurveResult("perturbation_positive", (0.0, 0.5), (1.0, 0.2), 30.0, 8)),
                ("rollout", CurveResult("auac", (0.0, 1.0), (0.2, 0.8), 0.5, 3))], path)
    curves = benchmark_curves(path)
    assert set(curves["metrics"]) == {"perturbation_positive", "auac"}
    assert curves["metrics"]["auac"]["rollout"]["y"] == [0.2, 0.8]
    client = client_for(image_workspace(), benchmark=curves)
    assert client.get("/api/benchmark", headers=HEADERS).json()["metrics"]["auac"]["rollout"]["auc"] == 0.5
    write_json([], tmp_path / "empty.json")
    with pytest.raises(Exception, match="no curve results"):
        benchmark_curves(tmp_path / "empty.json")


def test_every_catalog_method_draws_through_the_api():
    from captum_transformers.methods.catalog import METHOD_NAMES

    client = client_for(image_workspace())
    methods = [{"name": name, "arguments": {"n_steps": 4} if name == "integrated-gradients" else {}}
               for name in METHOD_NAMES]
    state = explain(client, methods, {"0": 1, "3": 2})
    assert [r["method"] for r in state["results"]] == list(METHOD_NAMES)
    flat = set()
    for result in state["results"]:
        for found in result["maps"].values():
            assert found["shape"] == [32, 32], result["method"]
            # an all-zero map is flagged (the page writes "nothing to draw"), never drawn as a blank heat map
            assert found["all_zero"] == (not any(found["values"])), result["method"]
            if found["all_zero"]:
                flat.add(result["method"])
    assert flat <= {"grad-cam"}  # ReLU'd gradient x attention of this random model's last layer


def test_numbers_are_bounded_and_hosts_can_be_added():
    client = client_for(image_workspace())
    response = client.post("/api/explain", headers=HEADERS, json={
        "methods": [{"name": "integrated-gradients", "arguments": {"n_steps": 10 ** 9}}], "targets": {"0": 0}})
    assert response.status_code == 400 and "outside" in response.json()["error"]
    proxied = TestClient(create_app(image_workspace(), TOKEN, allowed_hosts=("testserver", "explorer.lab")))
    assert proxied.get("/api/session", headers={**HEADERS, "Host": "explorer.lab:443"}).status_code == 200
    assert proxied.get("/api/session", headers={**HEADERS, "Host": "explorer.lab.evil:443"}).status_code == 400


def test_png_encoder_round_trips_and_colours_are_signed():
    Image = pytest.importorskip("PIL.Image")
    import io

    import numpy as np

    from captum_transformers.explorer.pages.classifier.export import diverging, png_bytes

    rgb = torch.randint(0, 256, (5, 7, 3), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    decoded = torch.from_numpy(np.array(Image.open(io.BytesIO(png_bytes(rgb))).convert("RGB")))
    assert torch.equal(decoded, rgb)
    red, white, blue = diverging(torch.tensor([2.0, 0.0, -2.0])).tolist()
    assert white == [1.0, 1.0, 1.0] and red[0] == 1.0 > red[2] and blue[2] == 1.0 > blue[0]


def test_page_works_under_a_path_prefix():
    """A proxy serving the explorer under /proxy/8765/ (Jupyter's server proxy, a remote
    notebook) strips the prefix; the page's relative URLs then reach the same routes."""
    client = client_for(image_workspace())
    page = client.get("/").text
    for reference in re.findall(r'(?:src|href)="([^"]+)"', page):
        assert client.get("/" + reference).status_code == 200, reference


def test_the_api_answers_while_the_model_loads():
    import threading

    from captum_transformers.explorer.loading import LoadingWorkspace

    gate = threading.Event()
    builder = CountingBuilder()
    loading = LoadingWorkspace(lambda: gate.wait(10) and image_workspace(builder))
    client = client_for(loading, warm=True)
    assert client.get("/").status_code == 200  # the page is there at once
    waiting = client.get("/api/session", headers=HEADERS)
    assert waiting.status_code == 200 and waiting.json()["loading"] is True  # a state, not an error
    assert waiting.json()["state"] == "loading"
    assert client.post("/api/explain", headers=HEADERS, json={"methods": [{"name": "rollout"}],
                                                              "targets": {"0": 1}}).status_code == 503
    gate.set()
    assert loading.wait(10)
    for _ in range(200):  # the default view starts as soon as the model is loaded, before any request
        if len(builder.calls) == 2:
            break
        time.sleep(0.05)
    assert [call[0] for call in builder.calls] == ["rollout", "generic-attention"]
    assert client.get("/api/session", headers=HEADERS).json()["model"] == "tiny timm ViT"
    explain(client, [{"name": "rollout"}], {"0": 1})

    def broken():
        raise RuntimeError("weights file truncated")

    failed = LoadingWorkspace(broken)
    failed.wait(10)
    response = client_for(failed).get("/api/session", headers=HEADERS)
    assert response.status_code == 400 and "weights file truncated" in response.json()["error"]


def test_the_default_view_is_computed_before_the_page_asks():
    builder = CountingBuilder()
    client = client_for(image_workspace(builder), warm=True)
    session = client.get("/api/session", headers=HEADERS).json()
    assert session["defaults"] == {"methods": ["rollout", "generic-attention"], "examples": [0, 1, 2, 3]}
    jobs = client.app.app.state.jobs
    assert jobs.wait("job-1")["state"] == "done"  # the warm-up
    calls = len(builder.calls)
    assert calls == 2
    targets = {str(e["index"]): e["predicted"] for e in session["examples"]}
    state = client.post("/api/explain", headers=HEADERS, json={
        "methods": [{"name": name} for name in session["defaults"]["methods"]], "targets": targets}).json()
    assert state["state"] == "done" and len(builder.calls) == calls  # answered from the cache


def test_unsigned_maps_are_not_labelled_for_or_against_the_class():
    """An unsigned map (rollout, GenericAttention, ...) has no direction: the page and the export
    must not read its red as 'for the class'; signed methods keep red = for, blue = against."""
    from captum_transformers.methods.catalog import SIGNED_METHODS

    client = client_for(text_workspace())
    session = client.get("/api/session", headers=HEADERS).json()
    signed = {m["name"]: m["signed"] for m in session["methods"]}
    assert signed["rollout"] is False and signed["generic-attention"] is False and signed["saliency"] is False
    assert signed["attn-lrp"] is True and signed["integrated-gradients"] is True
    assert {name for name, s in signed.items() if s} == SIGNED_METHODS & set(signed)
    document = client.post("/api/export", headers=HEADERS, json={
        "methods": [{"name": "rollout"}, {"name": "gradient-x-input"}], "targets": {"0": 1}}).json()["html"]
    rollout_row = document[document.index("<td>rollout"):document.index("<td>gradient-x-input")]
    assert "unsigned: darker = more relevant, no direction" in rollout_row and "red for" not in rollout_row
    assert "signed: red for, blue against" in document[document.index("<td>gradient-x-input"):]
