"""The methods sit next to Captum's own: NoiseTunnel, metrics, visualization, eval loops."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from captum.attr import Attribution, NoiseTunnel, visualization
from captum.metrics import infidelity, sensitivity_max

from captum_transformers import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, GenericAttention
from hf_models import CASES

METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS]


@pytest.fixture(scope="module")
def vit():
    spec = CASES["vit"]
    return spec.model(), spec.inputs(batch=2)[0]


@pytest.mark.parametrize("method", METHODS)
def test_is_a_captum_attribution_with_logged_attribute(method, vit):
    explainer = method(vit[0])
    assert isinstance(explainer, Attribution)
    assert hasattr(type(explainer).attribute, "__wrapped__")


@pytest.mark.parametrize("method", METHODS)
def test_noise_tunnel(method, vit):
    model, x = vit
    smooth = NoiseTunnel(method(model)).attribute(x, nt_type="smoothgrad", nt_samples=3, stdevs=0.1, target=[1, 2])
    assert smooth.shape == x.shape and torch.isfinite(smooth).all()


@pytest.mark.parametrize("method", METHODS)
def test_works_under_no_grad_and_leaves_parameter_grads_alone(method, vit):
    model, x = vit
    marker = next(model.parameters())
    marker.grad = torch.full_like(marker, 7.0)
    with torch.no_grad():
        out = method(model).attribute(x, target=1)
    assert out.shape == x.shape
    assert torch.equal(marker.grad, torch.full_like(marker, 7.0))
    assert all(p.grad is None for p in list(model.parameters())[1:])
    marker.grad = None


def test_frozen_model_still_gets_gradient_maps(vit):
    model, x = vit
    model.requires_grad_(False)
    try:
        frozen = GenericAttention(model).attribute(x, target=1, return_tokens=True)
    finally:
        model.requires_grad_(True)
    torch.testing.assert_close(frozen, GenericAttention(model).attribute(x, target=1, return_tokens=True))


def test_infidelity_and_sensitivity(vit):
    model, x = vit
    explainer = GenericAttention(model)
    attributions = explainer.attribute(x, target=[0, 1])

    def perturb(inputs):
        noise = torch.randn_like(inputs) * 0.01
        return noise, inputs - noise

    score = infidelity(lambda inputs: model(inputs).logits, perturb, x, attributions, target=[0, 1], n_perturb_samples=2)
    assert score.shape == (2,) and torch.isfinite(score).all()
    sens = sensitivity_max(explainer.attribute, x, target=[0, 1], n_perturb_samples=2, perturb_radius=0.01)
    assert sens.shape == (2,) and torch.isfinite(sens).all()


def test_visualization_of_image_and_text(vit, tmp_path):
    model, x = vit
    attributions = GenericAttention(model).attribute(x, target=0)
    figure, _ = visualization.visualize_image_attr(
        attributions[0].permute(1, 2, 0).numpy(), x[0].permute(1, 2, 0).numpy(), method="heat_map",
        sign="positive", use_pyplot=False)
    figure.savefig(tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 0

    spec = CASES["bert"]
    bert = spec.model()
    ids, kwargs = spec.inputs(batch=1)
    scores = GenericAttention(bert).attribute(ids, target=1, forward_kwargs=kwargs, return_tokens=True)[0]
    record = visualization.VisualizationDataRecord(
        scores, 0.9, 1, 1, "1", scores.sum(), [f"tok{i}" for i in range(ids.shape[1])], 0.0)
    html = visualization.visualize_text([record])
    assert "tok0" in html.data


def test_tuple_inputs_return_a_tuple_of_matching_shapes():
    spec = CASES["bert"]
    model = spec.model()
    ids, kwargs = spec.inputs()
    token_types = torch.zeros_like(ids)
    out = GenericAttention(model).attribute((ids, kwargs["attention_mask"], token_types), target=0)
    assert isinstance(out, tuple) and [o.shape for o in out] == [ids.shape] * 3


def test_every_target_form_agrees():
    spec = CASES["vit"]
    model = spec.model()
    x = spec.inputs(batch=2)[0]
    explainer = GenericAttention(model)
    by_int = explainer.attribute(x, target=2, return_tokens=True)
    for target in ([2, 2], torch.tensor([2, 2]), torch.tensor(2), (2,), [(2,), (2,)]):
        torch.testing.assert_close(explainer.attribute(x, target=target, return_tokens=True), by_int)
    predicted = model(x).logits.argmax(-1)
    torch.testing.assert_close(explainer.attribute(x, return_tokens=True),
                               explainer.attribute(x, target=predicted, return_tokens=True))


@pytest.mark.parametrize("method", [pytest.param(m, id=m.__name__) for m in (*RELEVANCE_METHODS, *LRP_ATTENTION_METHODS)])
def test_noise_tunnel_with_relevance_methods(method, vit):
    model, x = vit
    smooth = NoiseTunnel(method(model)).attribute(x, nt_type="smoothgrad", nt_samples=2, stdevs=0.1, target=[1, 2])
    assert smooth.shape == x.shape and torch.isfinite(smooth).all()
    if method in RELEVANCE_METHODS:
        _, delta = NoiseTunnel(method(model)).attribute(x, nt_samples=2, stdevs=0.1, target=[1, 2],
                                                        return_convergence_delta=True)
        assert delta.shape == (4,)
