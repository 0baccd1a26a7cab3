"""AttentionFlow (Abnar & Zuidema, ACL 2020) and its exact maximum flow.

1. ``max_flow`` equals the minimum cut found by brute force (max-flow min-cut theorem) on
   small layered and general graphs, and a flow computed by hand.
2. ``AttentionFlow`` on a tiny BERT equals the authors' definition written out (heads averaged,
   residual added, rows normalised, flows normalised) with brute-force minimum cuts, padding
   left out of the graph; batch == single; rows sum to 1.
3. Graphs above the size limit are refused with a clear error.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from captum_transformers import AttentionFlow, InputError  # noqa: E402
from captum_transformers.methods.catalog import CLASS_AGNOSTIC, METHOD_NAMES, build_method  # noqa: E402
from captum_transformers.methods.math.max_flow import layered_capacity, max_flow  # noqa: E402
from hf_models import CASES  # noqa: E402


def _min_cut(capacity: np.ndarray, source: int, sink: int) -> float:
    """The smallest total capacity of edges leaving a node set that holds the source and not
    the sink, over every such set (brute force)."""
    nodes = capacity.shape[0]
    others = [v for v in range(nodes) if v not in (source, sink)]
    best = float("inf")
    for chosen in itertools.product((False, True), repeat=len(others)):
        inside = np.zeros(nodes, dtype=bool)
        inside[source] = True
        inside[[v for v, keep in zip(others, chosen) if keep]] = True
        best = min(best, float(capacity[inside][:, ~inside].sum()))
    return best


def _row_stochastic(rng, layers, tokens):
    maps = []
    for _ in range(layers):
        a = rng.random((tokens, tokens))
        a = a / a.sum(1, keepdims=True) + np.eye(tokens)
        maps.append(a / a.sum(1, keepdims=True))
    return maps


# == 1. the algorithm ============================================================================
def test_max_flow_equals_the_brute_force_minimum_cut_on_layered_graphs():
    rng = np.random.default_rng(0)
    for layers, tokens in ((1, 3), (2, 3), (3, 3), (2, 4)):
        capacity = layered_capacity(_row_stochastic(rng, layers, tokens))
        for source in range(layers * tokens, (layers + 1) * tokens):
            for sink in range(tokens):
                assert abs(max_flow(capacity, source, sink) - _min_cut(capacity, source, sink)) <= 1e-14


def test_max_flow_equals_the_brute_force_minimum_cut_on_general_graphs():
    # Cycles and edges in both directions: augmenting paths must use reverse residual edges.
    rng = np.random.default_rng(1)
    for _ in range(20):
        capacity = rng.random((7, 7)) * (rng.random((7, 7)) < 0.5)
        np.fill_diagonal(capacity, 0)
        assert abs(max_flow(capacity, 0, 6) - _min_cut(capacity, 0, 6)) <= 1e-14


def test_max_flow_by_hand():
    # Two layers, two tokens. Flow from the top token 0 to input token 0: 0.6 -> 0.5 through
    # token 0 of the middle (0.5) and 0.4 -> 0.25 through token 1 (0.25): 0.75. To input 1:
    # min(0.6, 0.5) + min(0.4, 0.75) = 0.9.
    lower = np.array([[0.5, 0.5], [0.25, 0.75]])
    upper = np.array([[0.6, 0.4], [0.1, 0.9]])
    capacity = layered_capacity([lower, upper])
    assert max_flow(capacity, 4, 0) == pytest.approx(0.75, abs=1e-15)
    assert max_flow(capacity, 4, 1) == pytest.approx(0.9, abs=1e-15)


# == 2. the method ==============================================================================
def _reference(model, ids, mask, row):
    """The authors' attention flow for one example, written out, with brute-force cuts."""
    output = model(ids, attention_mask=mask, output_attentions=True)
    real = mask[0].nonzero().squeeze(1)
    maps = []
    for attention in output.attentions:
        fused = attention[0].double().mean(0)[real][:, real].detach().numpy()
        fused = fused + np.eye(len(real))
        maps.append(fused / fused.sum(1, keepdims=True))
    capacity = layered_capacity(maps)
    top = len(maps) * len(real)
    flows = np.array([_min_cut(capacity, top + row, sink) for sink in range(len(real))])
    expected = torch.zeros(ids.shape[1], dtype=torch.float64)
    expected[real] = torch.from_numpy(flows / flows.sum())
    return expected


def test_attention_flow_equals_the_written_out_definition_with_padding():
    spec = CASES["bert"]
    model = spec.model("eager")
    ids = torch.randint(3, 99, (2, 3), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 3, dtype=torch.long)
    mask[1, 2] = 0
    flow = AttentionFlow(model).attribute(ids, forward_kwargs={"attention_mask": mask}, return_tokens=True)
    for example in range(2):
        expected = _reference(model, ids[example:example + 1], mask[example:example + 1], row=0)
        torch.testing.assert_close(flow[example].double(), expected, rtol=1e-5, atol=1e-6)
    assert flow[1, 2] == 0
    torch.testing.assert_close(flow.sum(-1).double(), torch.ones(2, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    single = AttentionFlow(model).attribute(ids[1:, :2], return_tokens=True)
    torch.testing.assert_close(flow[1, :2], single[0], rtol=1e-5, atol=1e-7)
    # Not the rollout: the flow saturates paths where rollout multiplies them.
    rollout = build_method("rollout", model).attribute(ids, forward_kwargs={"attention_mask": mask},
                                                       return_tokens=True)
    assert (rollout - flow).abs().max() > 1e-3


def test_catalog_builds_it_by_name_only_on_request():
    spec = CASES["vit"]
    model = spec.model("eager")
    x, _ = spec.inputs(batch=1)
    assert isinstance(build_method("attention-flow", model), AttentionFlow)
    assert "attention-flow" not in METHOD_NAMES and "attention-flow" in CLASS_AGNOSTIC
    maps = [build_method("attention-flow", model).attribute(x, target=t, return_tokens=True) for t in (0, 1)]
    torch.testing.assert_close(maps[0], maps[1])  # class-agnostic by construction
    assert torch.isfinite(maps[0]).all() and (maps[0] > 0).all()


@pytest.mark.parametrize("case", ["timm_vit", "torch_mha_encoder"])
def test_other_adapters_give_normalised_flows_zero_at_padding(case):
    from lrp_models import CONSERVATION_CASES

    model, x, kwargs, _ = CONSERVATION_CASES[case]()
    flow = AttentionFlow(model).attribute(x, forward_kwargs=kwargs, return_tokens=True)
    torch.testing.assert_close(flow.sum(-1), torch.ones(flow.shape[0], dtype=flow.dtype), rtol=1e-10, atol=1e-10)
    if kwargs:  # the nn.TransformerEncoder case pads example 1 from position 5
        assert (flow[1, 5:] == 0).all() and (flow[1, :5] > 0).all()


# == 3. the size limit ==========================================================================
def test_graphs_above_the_limit_are_refused():
    spec = CASES["bert"]
    model = spec.model("eager")
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(InputError, match=r"\(2 \+ 1\) x 6 = 18 nodes, above max_graph_nodes=17"):
        AttentionFlow(model, max_graph_nodes=17).attribute(ids, return_tokens=True)
    AttentionFlow(model, max_graph_nodes=18).attribute(ids, return_tokens=True)
    with pytest.raises(InputError, match="max_graph_nodes must be an integer"):
        AttentionFlow(model, max_graph_nodes=1.5)
