"""The pyg_gps adapter: GPSConv's global attention explained, its local branch never silently left out."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("torch_geometric")

import torch_geometric.nn as pyg  # noqa: E402
from torch_geometric.utils import to_dense_batch  # noqa: E402

from captum_transformers import ConservativeLRP, GenericAttention, UnsupportedModelError, get_adapter  # noqa: E402
from captum_transformers.adapters.graph.pyg_gps import PyGGPSAdapter  # noqa: E402
from captum_transformers.capture.trace import CaptureSpec  # noqa: E402
from captum_transformers.errors import CaptureError, InputError  # noqa: E402
from captum_transformers.methods.catalog import METHOD_FACTORIES  # noqa: E402
from captum_transformers.engine.runner import run_trace
from pyg_models import CHANNELS, gps_classifier, graphs  # noqa: E402
from restore import assert_same, raising_after, snapshot  # noqa: E402

TARGETS = [0, 1, 1]
CHAIN = ["raw-attention", "rollout", "grad-cam", "generic-attention", "partial-lrp"]
LRP = ["gradient-x-input", "conservative-lrp-ah", "conservative-lrp", "attn-lrp", "lrp"]


@pytest.mark.parametrize("name", CHAIN + ["transformer-relevance"])
def test_attention_chain_methods_refuse_the_invisible_local_branch(name):
    model = gps_classifier()
    _, (x, edge_index, batch) = graphs()
    assert get_adapter(model).name == "pyg_gps"
    with pytest.raises(CaptureError, match="local message-passing branch.*ignore_local_branch=True"):
        METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)


def test_captured_maps_are_the_global_attention_over_each_graph():
    model = gps_classifier()
    _, (x, edge_index, batch) = graphs()
    adapter = PyGGPSAdapter(ignore_local_branch=True)
    trace = run_trace(adapter, model, (x,), (edge_index, batch), None, CaptureSpec(forward_reduce=lambda probs: probs))
    with torch.no_grad():
        dense, mask = to_dense_batch(model.encode(x), batch)
        _, expected = model.layers[0].attn(dense, dense, dense, key_padding_mask=~mask, need_weights=True,
                                           average_attn_weights=False)
    torch.testing.assert_close(trace.records[0].forward_value, expected)
    assert len(trace.records) == 2 and trace.layout.token_mask.equal(mask)


@pytest.mark.parametrize("name", CHAIN + LRP)
def test_batch_of_graphs_equals_graphs_one_at_a_time(name):
    # float64: batch equals single is exact math; in float32 the LRP rules round apart by up to
    # 2e-4 relative on some CPUs' kernels (the same holds for the node-level PyG test).
    model = gps_classifier().double()
    singles, (x, edge_index, batch) = graphs()
    singles, x = [(gx.double(), gedges) for gx, gedges in singles], x.double()
    adapter = PyGGPSAdapter(ignore_local_branch=True)
    explainer = METHOD_FACTORIES[name](model, adapter=adapter)
    tokens = explainer.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS, return_tokens=True)
    assert tokens.shape == (3, 5) and tokens.abs().sum() > 0
    for g, (gx, gedges) in enumerate(singles):
        alone = explainer.attribute(gx, additional_forward_args=(gedges, torch.zeros(len(gx), dtype=torch.long)),
                                    target=TARGETS[g], return_tokens=True)
        torch.testing.assert_close(tokens[g:g + 1, :len(gx)], alone, rtol=1e-4, atol=1e-6)
        assert (tokens[g, len(gx):] == 0).all()


def test_lrp_covers_both_branches():
    model = gps_classifier()
    _, (x, edge_index, batch) = graphs()
    relevance = ConservativeLRP(model, variant="GI").attribute(x, additional_forward_args=(edge_index, batch),
                                                               target=TARGETS)
    leaf = x.clone().requires_grad_()
    logits = model(leaf, edge_index, batch)[torch.arange(3), TARGETS]
    (grad,) = torch.autograd.grad(logits.sum(), leaf)
    torch.testing.assert_close(relevance, x * grad)  # the whole model's gradient, local branch included
    gated = ConservativeLRP(model, variant="AH").attribute(x, additional_forward_args=(edge_index, batch),
                                                           target=TARGETS)
    assert not torch.allclose(gated, relevance)  # the global attention's gate acts
    without_local = gps_classifier(local=False)
    without_local.load_state_dict({k: v for k, v in model.state_dict().items() if ".conv." not in k})
    other = ConservativeLRP(without_local, variant="GI").attribute(x, additional_forward_args=(edge_index, batch),
                                                                   target=TARGETS)
    assert not torch.allclose(other, relevance)  # the local branch contributes


def test_graph_wide_norms_are_refused_under_the_norm_rule():
    model = gps_classifier(norm="layer_norm")  # PyG's LayerNorm normalises over each whole graph
    _, (x, edge_index, batch) = graphs()
    with pytest.raises(CaptureError, match="PyG norms"):
        ConservativeLRP(model, variant="AH+LN").attribute(x, additional_forward_args=(edge_index, batch),
                                                          target=TARGETS)
    assert ConservativeLRP(model, variant="AH").attribute(x, additional_forward_args=(edge_index, batch),
                                                          target=TARGETS).shape == x.shape


def test_performer_attention_is_refused():
    gin = pyg.GINConv(nn.Sequential(nn.Linear(CHANNELS, CHANNELS), nn.ReLU(), nn.Linear(CHANNELS, CHANNELS)))
    model = nn.Sequential(pyg.GPSConv(CHANNELS, gin, heads=2, attn_type="performer"))
    with pytest.raises(UnsupportedModelError, match="linear attention"):
        get_adapter(model)


@pytest.mark.parametrize("method", [GenericAttention, ConservativeLRP])
def test_exact_restore_after_an_error_mid_forward(method):
    model = gps_classifier()
    _, (x, edge_index, batch) = graphs()
    with torch.no_grad():
        before_output = model(x, edge_index, batch)
    before = snapshot(model)
    with raising_after(model.layers[1], KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            method(model, adapter=PyGGPSAdapter(ignore_local_branch=True)).attribute(
                x, additional_forward_args=(edge_index, batch), target=TARGETS)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(before_output, model(x, edge_index, batch))


def test_an_unsorted_batch_is_refused():
    model = gps_classifier()
    _, (x, edge_index, batch) = graphs()
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    where = torch.empty_like(order)
    where[order] = torch.arange(x.shape[0])
    with pytest.raises(InputError, match="sorted"):
        GenericAttention(model, adapter=PyGGPSAdapter(ignore_local_branch=True)).attribute(
            x[order], additional_forward_args=(where[edge_index], batch[order]), target=TARGETS)
