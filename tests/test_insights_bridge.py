"""Captum Insights code runs on the bridge by changing its import: Captum 0.8's constructor
arguments, its CIFAR-style example (a CNN: Captum's gradient methods), a Transformer (this
package's methods, maps equal to calling them directly), serve() and render()."""
from __future__ import annotations

import inspect
import json
import time
import urllib.request

import pytest
import torch
from torch import nn

from captum_transformers.errors import InputError
from captum_transformers.integrations.insights import AttributionVisualizer, Batch, GeneralFeature, ImageFeature, TextFeature
from captum_transformers.integrations.insights import features as insights_features
from captum_transformers.methods.catalog import METHOD_NAMES, build_method
from explorer_workspaces import PAYLOAD
from tiny_models import EncoderClassifier, timm_vit_case

# Captum v0.8.0 captum/insights/attr_vis (app.py, features.py): parameter names and defaults
CAPTUM_08_SIGNATURES = {
    AttributionVisualizer: [("models", None), ("classes", None), ("features", None), ("dataset", None),
                            ("score_func", "None"), ("use_label_for_attr", "True")],
    Batch: [("inputs", None), ("labels", None), ("additional_args", "None")],
    ImageFeature: [("name", None), ("baseline_transforms", None), ("input_transforms", None),
                   ("visualization_transform", "None")],
    TextFeature: [("name", None), ("baseline_transforms", None), ("input_transforms", None),
                  ("visualization_transform", None)],
    GeneralFeature: [("name", None), ("categories", None)],
}


def test_constructors_take_captum_08_arguments():
    for cls, expected in CAPTUM_08_SIGNATURES.items():
        parameters = [p for p in inspect.signature(cls).parameters.values() if p.kind != p.KEYWORD_ONLY]
        got = [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default)) for p in parameters]
        assert got == expected, cls.__name__
    assert insights_features.ImageFeature is ImageFeature


class CifarNet(nn.Module):  # the shape of Captum Insights' example model, smaller
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 5)
        self.fc = nn.Linear(4 * 14 * 14, 10)
        self.eval()

    def forward(self, x):
        return self.fc(nn.functional.max_pool2d(self.conv(x).relu(), 2).flatten(1))


def cifar_batches():
    generator = torch.Generator().manual_seed(0)
    while True:  # Insights' example yields forever
        yield Batch(inputs=torch.rand(4, 3, 32, 32, generator=generator), labels=torch.tensor([0, 1, 2, 3]))


def insights_example(model=None, **kwargs):
    normalize = lambda x: (x - 0.5) / 0.5  # noqa: E731
    return AttributionVisualizer(
        models=[model or CifarNet()], score_func=lambda o: torch.nn.functional.softmax(o, 1),
        classes=["Plane", "Car", "Bird", "Cat", "Deer", "Dog", "Frog", "Horse", "Ship", "Truck"],
        features=[ImageFeature("Photo", baseline_transforms=[lambda x: x * 0], input_transforms=[normalize])],
        dataset=cifar_batches(), **kwargs)


def test_insights_example_serves_with_captum_gradient_methods():
    pytest.importorskip("uvicorn")
    visualizer = insights_example(examples=10)
    workspace = visualizer.workspace()
    assert len(workspace) == 10 and workspace.labels.reshape(-1).tolist() == [0, 1, 2, 3] * 2 + [0, 1]
    assert visualizer.methods() == ["integrated-gradients", "saliency"]  # a CNN: no attention to read
    port = visualizer.serve(port=0)
    try:
        token = visualizer._running.token
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/session", headers={"X-Explorer-Token": token})
        with urllib.request.urlopen(request, timeout=10) as response:
            session = json.loads(response.read())
        assert [m["name"] for m in session["methods"]] == ["integrated-gradients", "saliency"]
        assert session["classes"][0] == "Plane" and len(session["examples"]) == 10
    finally:
        visualizer.stop()
    # the model saw the transformed inputs, probabilities are score_func's
    raw = next(iter(cifar_batches())).inputs
    expected = visualizer.models[0](((raw - 0.5) / 0.5)).softmax(1)
    assert torch.allclose(workspace.probabilities[:4], expected.detach(), atol=1e-6)


def test_transformer_maps_equal_the_methods_called_directly():
    model, _, _ = timm_vit_case()
    visualizer = insights_example(model=model, examples=4)
    visualizer.classes = visualizer.classes[:5]
    visualizer._workspaces = None
    assert visualizer.methods() == list(METHOD_NAMES)
    workspace = visualizer.workspace()
    maps = workspace.explain("generic-attention", {}, {0: 1, 1: 4, 2: 0, 3: 2})
    direct = build_method("generic-attention", model).attribute(workspace.inputs[0], target=torch.tensor([1, 4, 0, 2]))
    for row in range(4):
        assert torch.allclose(torch.tensor(maps[row]["values"]).reshape(32, 32), direct[row].sum(0), atol=1e-5)


def test_what_the_explorer_cannot_show_is_refused():
    cases = [
        (dict(models=[]), "non-empty list"),
        (dict(features=[GeneralFeature("age", ["years"])]), "GeneralFeature"),
        (dict(use_label_for_attr=False), "use_label_for_attr"),
    ]
    for change, message in cases:
        arguments = dict(models=[CifarNet()], classes=list("abcdefghij"),
                         features=[ImageFeature("Photo", None, None)], dataset=cifar_batches())
        arguments.update(change)
        with pytest.raises(InputError, match=message):
            AttributionVisualizer(**arguments)
    with_args = AttributionVisualizer(models=CifarNet(), classes=list("abcdefghij"),
                                      features=ImageFeature("Photo", None, None),
                                      dataset=[Batch(torch.rand(2, 3, 32, 32), torch.tensor([0, 1]), (1,))])
    with pytest.raises(InputError, match="additional_args"):
        with_args.workspace()


def test_nonzero_baseline_is_warned_about():
    visualizer = AttributionVisualizer(models=CifarNet(), classes=list("abcdefghij"), dataset=cifar_batches(),
                                       features=ImageFeature("Photo", [lambda x: x * 0 + 1], None), examples=2)
    with pytest.warns(UserWarning, match="non-zero baseline"):
        visualizer.workspace()


def test_text_feature_tokens_and_render_escape_user_strings(monkeypatch):
    vocabulary = ["[PAD]", "[CLS]", "good", PAYLOAD, "film", "dull", "plot", "ok", "<b>x</b>", "end"]
    ids = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 8]])
    visualizer = AttributionVisualizer(
        models=EncoderClassifier().eval(), classes=["neg", PAYLOAD, "pos"], dataset=[Batch(ids, torch.tensor([0, 2]))],
        features=TextFeature("Review", None, None, lambda x: [vocabulary[i] for i in x[0].tolist()]))
    workspace = visualizer.workspace()
    assert workspace.modality == "text" and workspace.displays[0] == ["[CLS]", "good", PAYLOAD, "film"]
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda value: shown.append(value))
    visualizer.render()
    document = shown[0].data
    assert PAYLOAD not in document and "&lt;img src=x onerror=" in document and "&lt;b&gt;x&lt;/b&gt;" in document


@pytest.mark.parametrize("shown", [3, 5])
def test_text_feature_token_count_must_match_the_positions(shown):
    """One token short drew every score on its neighbour; one too many raised a RuntimeError."""
    vocabulary = ["[PAD]", "[CLS]", "good", "film", "dull", "plot", "ok", "end", "x", "y"]
    ids = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 8]])
    visualizer = AttributionVisualizer(
        models=EncoderClassifier().eval(), classes=["neg", "mid", "pos"], dataset=[Batch(ids, torch.tensor([0, 2]))],
        features=TextFeature("Review", None, None, lambda x: ([vocabulary[i] for i in x[0].tolist()] + ["extra"])[:shown]))
    with pytest.raises(InputError, match=f"gave {shown} tokens .* has 4 positions"):
        visualizer.workspace()


def test_workspace_refuses_tokens_that_do_not_match_the_positions():
    from captum_transformers.explorer.pages.classifier.workspace import Workspace

    ids, mask = torch.tensor([[1, 5, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    with pytest.raises(InputError, match="shows 4 tokens but its input has 3 unmasked positions"):
        Workspace(EncoderClassifier().eval(), (ids,), [["a", "b", "c", "d"]], "text",
                  forward_kwargs={"attention_mask": mask})
    with pytest.raises(InputError, match="shows 3 tokens but its input has 4 positions"):
        Workspace(EncoderClassifier().eval(), (ids,), [["a", "b", "c"]], "text")


def test_methods_not_offered_for_the_model_are_refused_by_the_api():
    pytest.importorskip("httpx")
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from captum_transformers.explorer.app import create_app

    visualizer = insights_example(examples=2)
    client = TestClient(create_app(visualizer.workspace(), "t" * 20, allowed_hosts=("testserver",),
                                   methods=visualizer.methods()))
    response = client.post("/api/explain", headers={"X-Explorer-Token": "t" * 20},
                           json={"methods": [{"name": "rollout"}], "targets": {"0": 1}})
    assert response.status_code == 400 and "not offered" in response.json()["error"]


def test_several_models_are_served_side_by_side():
    pytest.importorskip("httpx")
    TestClient = pytest.importorskip("starlette.testclient").TestClient
    from captum_transformers.explorer.app import create_app

    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10).eval()
    visualizer = AttributionVisualizer(models=[CifarNet(), vit], classes=list("abcdefghij"), dataset=cifar_batches(),
                                       features=ImageFeature("Photo", None, [lambda x: (x - 0.5) / 0.5]), examples=4)
    cnn_view, vit_view = visualizer.workspaces()
    client = TestClient(create_app(visualizer.workspaces(), "t" * 20, allowed_hosts=("testserver",), warm=False))
    headers = {"X-Explorer-Token": "t" * 20}
    sessions = [client.get(f"/api/session?model={i}", headers=headers).json() for i in (0, 1)]
    assert sessions[0]["models"] == sessions[1]["models"] == ["CifarNet (Photo)", "VisionTransformer (Photo)"]
    assert [m["name"] for m in sessions[0]["methods"]] == ["integrated-gradients", "saliency"]
    assert "generic-attention" in [m["name"] for m in sessions[1]["methods"]]
    assert client.get("/api/session?model=2", headers=headers).status_code == 400
    state = client.post("/api/explain?model=1", headers=headers, json={"methods": [{"name": "generic-attention"}],
                                                                        "targets": {"0": 3}}).json()
    for _ in range(400):  # the job runs in that model's own queue
        if state["state"] != "running":
            break
        time.sleep(0.02)
        state = client.get(f"/api/jobs/{state['id']}?model=1", headers=headers).json()
    direct = build_method("generic-attention", vit).attribute(vit_view.inputs[0][:1], target=torch.tensor([3]))
    values = torch.tensor(state["results"][0]["maps"]["0"]["values"]).reshape(32, 32)
    assert torch.allclose(values, direct[0].sum(0), atol=1e-5)
    document = visualizer.html(count=2)
    assert document.count("<body>") == 1 and "CifarNet (Photo)" in document and "VisionTransformer (Photo)" in document


def test_a_model_in_training_mode_is_warned_about_and_left_as_it_is():
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(3 * 32 * 32, 10))
    visualizer = AttributionVisualizer(models=model, classes=list("abcdefghij"), dataset=cifar_batches(),
                                       features=ImageFeature("Photo", None, None), examples=2)
    with pytest.warns(UserWarning, match="training mode"):
        visualizer.workspace()
    assert model.training  # never switched by the bridge
