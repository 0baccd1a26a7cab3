"""The nodes a graph-level score reads are found from the run, never from the source text.

Each model below has the same two TransformerConv layers (tests/pyg_models.py) and another
readout. The truth for RawAttention is the last layer's head-mean map, its rows weighted as
the readout weighs the nodes; the adapter must give that, or refuse.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

pyg = pytest.importorskip("torch_geometric.nn")

from captum_transformers import AttentionRollout, ConservativeLRP, GenericAttention, RawAttention  # noqa: E402
from captum_transformers.adapters.graph.pyg_attention import PyGAttentionAdapter  # noqa: E402
from captum_transformers.capture.trace import CaptureSpec  # noqa: E402
from captum_transformers.errors import CaptureError  # noqa: E402
from captum_transformers.engine.runner import run_trace
from pyg_models import GraphClassifier, graph_classifier, graphs  # noqa: E402

SIZES = (3, 5, 4)


def _first_nodes(batch):
    """The first node of every graph (PyG's ptr[:-1]), from the batch vector."""
    counts = torch.bincount(batch)
    return counts.cumsum(0) - counts


class DeadBranchRoot(GraphClassifier):
    """Names global_mean_pool in a comment and in a branch that never runs; reads each graph's first node."""

    pool_by_mean = False

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        if self.pool_by_mean:  # global_mean_pool(hidden, batch) would read every node
            return self.head(pyg.global_mean_pool(hidden, batch))
        return self.head(hidden[_first_nodes(batch)])


class SubsetMean(GraphClassifier):
    """A mean over the nodes at even positions of each graph."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        position = torch.arange(len(batch)) - _first_nodes(batch)[batch]
        keep = position % 2 == 0
        return self.head(pyg.global_mean_pool(hidden[keep], batch[keep], size=int(batch.max()) + 1))


class SoftmaxGatedAdd(GraphClassifier):
    """A gated add pooling: sum_i softmax_i(gate(h_i)) h_i over each graph's nodes."""

    def __init__(self, kind):
        super().__init__(kind)
        self.gate = nn.Linear(self.head.in_features, 1)

    def forward(self, x, edge_index, batch=None):
        from torch_geometric.utils import softmax

        hidden = self.nodes(x, edge_index)
        return self.head(pyg.global_add_pool(softmax(self.gate(hidden), batch) * hidden, batch))


class ReluThenMean(GraphClassifier):
    """Per-node operations (LayerNorm, ReLU) between the last attention layer and a mean pooling."""

    def __init__(self, kind):
        super().__init__(kind)
        self.norm = nn.LayerNorm(self.head.in_features)

    def forward(self, x, edge_index, batch=None):
        return self.head(pyg.global_mean_pool(torch.relu(self.norm(self.nodes(x, edge_index))), batch))


def _model(cls, seed=0):
    torch.manual_seed(seed)
    return cls("TransformerConv").eval()


def _raw_truth(model, weights):
    """The last layer's head-mean map, rows weighted by ``weights`` (B, N_max)."""
    _, (x, edge_index, batch) = graphs(SIZES)
    adapter = PyGAttentionAdapter(readout="mean")
    trace = run_trace(adapter, model, (x,), (edge_index, batch), None, CaptureSpec(forward_reduce=lambda probs: probs))
    last = trace.records[-1].forward_value.mean(1).to(torch.float64)
    return torch.einsum("bi,bij->bj", weights, last)


def _raw(model, **options):
    _, (x, edge_index, batch) = graphs(SIZES)
    return RawAttention(model, **options).attribute(x, additional_forward_args=(edge_index, batch),
                                                    return_tokens=True)


def _weights(rows_per_graph):
    weights = torch.zeros(len(SIZES), max(SIZES), dtype=torch.float64)
    for graph, rows in enumerate(rows_per_graph):
        weights[graph, rows] = 1.0 / len(rows)
    return weights


def test_the_truth_formula_matches_a_plain_mean_pool():
    model = graph_classifier("TransformerConv")
    expected = _raw_truth(model, _weights([range(n) for n in SIZES]))
    torch.testing.assert_close(_raw(model).to(torch.float64), expected)


def test_a_pooling_named_in_a_comment_or_a_dead_branch_is_not_the_readout_the_root_node_is():
    model = _model(DeadBranchRoot)
    expected = _raw_truth(model, _weights([[0]] * len(SIZES)))
    torch.testing.assert_close(_raw(model).to(torch.float64), expected)
    _, (x, edge_index, batch) = graphs(SIZES)
    generic = GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0],
                                                return_tokens=True)
    assert torch.isfinite(generic).all()


def test_a_mean_over_a_subset_of_nodes_reads_that_subset():
    model = _model(SubsetMean)
    expected = _raw_truth(model, _weights([range(0, n, 2) for n in SIZES]))
    torch.testing.assert_close(_raw(model).to(torch.float64), expected)
    assert not torch.allclose(expected, _raw_truth(model, _weights([range(n) for n in SIZES])))


@pytest.mark.parametrize("method", [RawAttention, AttentionRollout, GenericAttention])
def test_a_softmax_gated_add_pool_is_refused(method):
    model = _model(SoftmaxGatedAdd)
    _, (x, edge_index, batch) = graphs(SIZES)
    with pytest.raises(CaptureError, match="gated pooling|nodes of graph 0 are mixed"):
        method(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0])
    # LRP needs no readout.
    assert ConservativeLRP(model).attribute(x, additional_forward_args=(edge_index, batch),
                                            target=[0, 1, 0]).shape == x.shape


def test_per_node_layers_before_a_mean_pool_keep_uniform_rows():
    model = _model(ReluThenMean)
    expected = _raw_truth(model, _weights([range(n) for n in SIZES]))
    torch.testing.assert_close(_raw(model).to(torch.float64), expected)


def test_a_max_pool_is_refused_for_weighing_nodes_unequally():
    model = graph_classifier("TransformerConv", pool="max")
    _, (x, edge_index, batch) = graphs(SIZES)
    with pytest.raises(CaptureError, match="weighs them unequally"):
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))


def test_a_model_defined_without_source_is_explained_like_the_same_model_with_source():
    namespace = {"GraphClassifier": GraphClassifier, "pyg": pyg}
    exec(textwrap.dedent("""
        class Exec(GraphClassifier):
            def forward(self, x, edge_index, batch=None):
                return self.head(pyg.global_mean_pool(self.nodes(x, edge_index), batch))
    """), namespace)
    defined = _model(namespace["Exec"])
    reference = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs(SIZES)
    for method in (RawAttention, AttentionRollout, GenericAttention):
        found = method(defined).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0],
                                          return_tokens=True)
        expected = method(reference).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0],
                                               return_tokens=True)
        torch.testing.assert_close(found, expected, rtol=0, atol=0)


def test_a_graph_wide_norm_between_the_last_attention_and_the_pooling_is_refused_unless_the_readout_is_given():
    """PyG's LayerNorm (graph mode) in GPS normalises each node by statistics of its whole graph:
    the pooled node states mix the attention outputs of every node."""
    from captum_transformers.adapters.graph.pyg_gps import PyGGPSAdapter
    from pyg_models import gps_classifier

    model = gps_classifier(norm="layer_norm")
    _, (x, edge_index, batch) = graphs(SIZES)
    with pytest.raises(CaptureError, match="are mixed"):
        RawAttention(model, adapter=PyGGPSAdapter(ignore_local_branch=True)).attribute(
            x, additional_forward_args=(edge_index, batch))
    stated = RawAttention(model, adapter=PyGGPSAdapter(readout="mean", ignore_local_branch=True)).attribute(
        x, additional_forward_args=(edge_index, batch), return_tokens=True)
    assert torch.isfinite(stated).all()
    # Batch norm in eval mode is per node: the mean pooling is found.
    per_node = gps_classifier()
    found = RawAttention(per_node, adapter=PyGGPSAdapter(ignore_local_branch=True)).attribute(
        x, additional_forward_args=(edge_index, batch), return_tokens=True)
    given = RawAttention(per_node, adapter=PyGGPSAdapter(readout="mean", ignore_local_branch=True)).attribute(
        x, additional_forward_args=(edge_index, batch), return_tokens=True)
    torch.testing.assert_close(found, given, rtol=0, atol=0)


class SigmoidGatedAdd(GraphClassifier):
    """A gated add pooling with a gate per node: sum_i sigmoid(w . h_i) h_i."""

    def __init__(self, kind):
        super().__init__(kind)
        self.gate = nn.Linear(self.head.in_features, 1)

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        return self.head(pyg.global_add_pool(torch.sigmoid(self.gate(hidden)) * hidden, batch))


class MaskedAdd(GraphClassifier):
    """An add pooling over the even positions, as a product with a constant 0/1 column."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        position = torch.arange(len(batch)) - _first_nodes(batch)[batch]
        return self.head(pyg.global_add_pool(hidden * (position % 2 == 0).float()[:, None], batch))


@pytest.mark.parametrize("method", [RawAttention, GenericAttention])
def test_a_per_node_gate_before_the_pooling_is_refused(method):
    model = _model(SigmoidGatedAdd)
    _, (x, edge_index, batch) = graphs(SIZES)
    with pytest.raises(CaptureError, match="gated pooling"):
        method(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0])


def test_a_constant_mask_before_the_pooling_reads_the_masked_subset():
    model = _model(MaskedAdd)
    expected = _raw_truth(model, _weights([range(0, n, 2) for n in SIZES]))
    torch.testing.assert_close(_raw(model).to(torch.float64), expected)


class NeighbourMixing(GraphClassifier):
    """Hand-written message passing after the last attention layer: z_i = h_i + 3 * sum_{j -> i} h_j."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        source, target = edge_index
        return self.head(pyg.global_mean_pool(hidden.index_add(0, target, 3 * hidden[source]), batch))


def _isolated_first_nodes():
    """Two graphs (4 and 3 nodes) whose node 0 has no edge: 1-2, 2-3 and 1-2, both directions."""
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    edge_index = torch.tensor([[1, 2, 2, 3, 5, 6], [2, 1, 3, 2, 6, 5]])
    return x, edge_index, torch.tensor([0, 0, 0, 0, 1, 1, 1])


@pytest.mark.parametrize("method", [RawAttention, GenericAttention])
def test_mixing_between_nodes_after_the_last_attention_layer_is_refused_when_the_first_node_is_isolated(method):
    """The mixing check once sent a cotangent from each graph's first read node only: an
    isolated first node hid the mixing of all the others (a uniform map was returned)."""
    model = _model(NeighbourMixing)
    x, edge_index, batch = _isolated_first_nodes()
    with pytest.raises(CaptureError, match="nodes of graph 0 are mixed: the attention output of its node [123]"):
        method(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1])
    # The same graphs through a mean pooling of the attention outputs are explained.
    plain = _model(GraphClassifier)
    assert torch.isfinite(method(plain).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1],
                                                  return_tokens=True)).all()


class LastTwoSwapped(GraphClassifier):
    """Each graph's last two nodes trade their attention outputs before a mean pooling: a
    mixing between two nodes that are neither first nor connected to the first."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        counts = torch.bincount(batch)
        last = counts.cumsum(0) - 1
        order = torch.arange(len(batch))
        order[last], order[last - 1] = last - 1, last
        return self.head(pyg.global_mean_pool(hidden[order] * 0.5 + hidden * 0.5, batch))


def test_any_two_mixed_nodes_are_found_not_only_those_next_to_the_first():
    model = _model(LastTwoSwapped)
    _, (x, edge_index, batch) = graphs(SIZES)
    with pytest.raises(CaptureError, match="are mixed"):
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))


def test_the_mixing_codes_tell_every_ordered_pair_of_positions_apart_in_few_passes():
    from captum_transformers.adapters.graph.readout import _separating_codes

    for count in (2, 3, 7, 25, 40):
        codes = _separating_codes(count)
        apart = (codes[:, None, :] & ~codes[None, :, :]).any(dim=2)
        assert apart.logical_or(torch.eye(count, dtype=torch.bool)).all()
        assert codes.shape[1] <= 2 * max(1, (count - 1).bit_length())


GATE_SPELLINGS = {
    "broadcast": lambda h, g: h * g,
    "expand_as": lambda h, g: h * g.expand_as(h),
    "expand": lambda h, g: g.expand(-1, h.shape[1]) * h,
    "broadcast_to": lambda h, g: h * torch.broadcast_to(g, h.shape),
    "repeat": lambda h, g: h * g.repeat(1, h.shape[1]),
    "view": lambda h, g: h * g.view(-1).unsqueeze(-1),
    "contiguous": lambda h, g: h * g.expand_as(h).contiguous(),
    "einsum": lambda h, g: torch.einsum("nc,n->nc", h, g.squeeze(-1)),
    "transposed": lambda h, g: (h.t() * g.t()).t(),
    "reshaped_after": lambda h, g: (h * g).reshape(h.shape[0], -1),
    "mul": lambda h, g: torch.mul(h, g.repeat(1, h.shape[1]).to(torch.float64).to(h.dtype)),
}


class SpelledGate(GraphClassifier):
    """sum_i sigmoid(w . h_i) h_i, the product spelled in one of GATE_SPELLINGS."""

    spelling = "broadcast"

    def __init__(self, kind):
        super().__init__(kind)
        self.gate = nn.Linear(self.head.in_features, 1)

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        gated = GATE_SPELLINGS[self.spelling](hidden, torch.sigmoid(self.gate(hidden)))
        return self.head(pyg.global_add_pool(gated, batch))


@pytest.mark.parametrize("spelling", sorted(GATE_SPELLINGS))
def test_a_per_node_gate_is_refused_however_the_product_is_spelled(spelling):
    model = _model(SpelledGate)
    model.spelling = spelling
    _, (x, edge_index, batch) = graphs(SIZES)
    with pytest.raises(CaptureError, match="gated pooling"):
        GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0])


class ChannelGate(GraphClassifier):
    """A gate per node and channel (GLU-like, h_i * sigmoid(W h_i)): a per-node layer, read as such."""

    def __init__(self, kind):
        super().__init__(kind)
        self.gate = nn.Linear(self.head.in_features, self.head.in_features)

    def forward(self, x, edge_index, batch=None):
        hidden = self.nodes(x, edge_index)
        return self.head(pyg.global_mean_pool(hidden * torch.sigmoid(self.gate(hidden)), batch))


def test_a_gate_per_channel_is_a_per_node_layer_not_a_gated_pooling():
    model = _model(ChannelGate)
    expected = _raw_truth(model, _weights([range(n) for n in SIZES]))
    torch.testing.assert_close(_raw(model).to(torch.float64), expected)
