"""The pyg_attention adapter: TransformerConv, GATConv and GATv2Conv graph classifiers.

Captured maps equal a softmax over incoming edges computed by hand; a batch of graphs gives
what each graph gives alone; padded nodes score 0; the model is restored exactly after an
error mid-forward; AH / AH+LN relevance is conserved in float64 on bias-free layers.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("torch_geometric")

from captum_transformers import (AttentionGradCAM, AttentionRollout, ConservativeLRP, GenericAttention,  # noqa: E402
                                 RawAttention, get_adapter)
from captum_transformers.adapters.graph.pyg_attention import PyGAttentionAdapter  # noqa: E402
from captum_transformers.capture.trace import CaptureSpec  # noqa: E402
from captum_transformers.errors import CaptureError, InputError  # noqa: E402
from captum_transformers.methods.catalog import METHOD_FACTORIES, PACKAGE_METHOD_NAMES  # noqa: E402
from captum_transformers.propagation.rules.rule_set import RuleSet  # noqa: E402
from captum_transformers.engine.runner import run_trace
from pyg_models import graph_classifier, graphs  # noqa: E402
from restore import assert_same, raising_after, snapshot  # noqa: E402

KINDS = ["TransformerConv", "GATConv", "GATv2Conv"]
# The methods whose math applies to PyG layers (the identity-softmax rule sets and AttnLRP are
# refused on GAT layers: see the refusal tests; TransformerRelevance's normalised adds run per
# graph: tests/test_pyg_transformer_relevance.py).
APPLIES = {
    "TransformerConv": ["raw-attention", "rollout", "grad-cam", "generic-attention", "gradient-x-input",
                        "conservative-lrp-ah", "conservative-lrp", "attn-lrp", "partial-lrp", "lrp",
                        "attention-flow", "transformer-relevance"],
    "GATConv": ["raw-attention", "rollout", "grad-cam", "generic-attention", "gradient-x-input",
                "conservative-lrp-ah", "conservative-lrp", "attention-flow"],
}
APPLIES["GATv2Conv"] = APPLIES["GATConv"]
TARGETS = [0, 1, 1]
RELEVANCE_METHODS = {"gradient-x-input", "conservative-lrp-ah", "conservative-lrp", "attn-lrp", "lrp"}


def _hand_softmax_maps(model, x, edge_index, batch):
    """The first layer's maps (B, H, N_max, N_max) from the papers' equations, graph by graph:
    TransformerConv alpha_ij = softmax_j(q_i . k_j / sqrt(C)); GAT alpha_ij = softmax_j(
    LeakyReLU(a_s . W x_j + a_t . W x_i)); GATv2 alpha_ij = softmax_j(a . LeakyReLU(W_l x_j +
    W_r x_i)); GAT layers add self-loops."""
    conv = model.convs[0]
    hidden = model.encode(x)
    heads = conv.heads
    sizes = torch.bincount(batch)
    size = int(sizes.max())
    maps = torch.zeros(len(sizes), heads, size, size, dtype=x.dtype)
    starts = sizes.cumsum(0) - sizes
    kind = type(conv).__name__
    if kind in ("GATConv", "GATv2Conv"):
        loops = torch.arange(x.shape[0])
        edge_index = torch.cat([edge_index, torch.stack([loops, loops])], dim=1)
    for g in range(len(sizes)):
        nodes = range(int(starts[g]), int(starts[g] + sizes[g]))
        for head in range(heads):
            for i in nodes:
                incoming = [j for j, t in edge_index.t().tolist() if t == i]
                scores = []
                for j in incoming:
                    if kind == "TransformerConv":
                        q = conv.lin_query(hidden[i]).view(heads, -1)[head]
                        k = conv.lin_key(hidden[j]).view(heads, -1)[head]
                        scores.append(float(q @ k) / math.sqrt(conv.out_channels))
                    elif kind == "GATv2Conv":  # a . LeakyReLU(W_l x_j + W_r x_i)
                        left = conv.lin_l(hidden).view(-1, heads, conv.out_channels)
                        right = conv.lin_r(hidden).view(-1, heads, conv.out_channels)
                        mixed = torch.nn.functional.leaky_relu(left[j, head] + right[i, head], conv.negative_slope)
                        scores.append(float(mixed @ conv.att[0, head]))
                    else:
                        w = conv.lin(hidden).view(-1, heads, conv.out_channels)
                        score = float(w[j, head] @ conv.att_src[0, head] + w[i, head] @ conv.att_dst[0, head])
                        scores.append(score if score > 0 else conv.negative_slope * score)
                weights = torch.softmax(torch.tensor(scores, dtype=x.dtype), 0)
                for j, weight in zip(incoming, weights):
                    maps[g, head, i - int(starts[g]), j - int(starts[g])] += weight
    return maps


@pytest.mark.parametrize("kind", KINDS)
def test_captured_maps_equal_a_hand_computed_softmax(kind):
    model = graph_classifier(kind)
    _, (x, edge_index, batch) = graphs()
    adapter = get_adapter(model)
    trace = run_trace(adapter, model, (x,), (edge_index, batch), None, CaptureSpec(forward_reduce=lambda probs: probs))
    captured = trace.records[0].forward_value
    with torch.no_grad():
        expected = _hand_softmax_maps(model, x, edge_index, batch)
    torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-6)
    real = trace.layout.token_mask
    row_sums = captured.sum(-1)  # every real target's incoming weights sum to 1
    torch.testing.assert_close(row_sums[real[:, None, :].expand_as(row_sums)], torch.ones(int(real.sum()) * 2))
    assert (row_sums[~real[:, None, :].expand_as(row_sums)] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_batch_of_graphs_equals_graphs_one_at_a_time_and_padding_scores_zero(kind):
    model = graph_classifier(kind)
    singles, (x, edge_index, batch) = graphs()
    for name in APPLIES[kind]:
        explainer = METHOD_FACTORIES[name](model)
        tokens = explainer.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS,
                                     return_tokens=True)
        mapped = explainer.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
        assert tokens.shape == (3, 5) and mapped.shape == x.shape and torch.isfinite(tokens).all(), name
        assert tokens.abs().sum() > 0, name
        for g, (gx, gedges) in enumerate(singles):
            alone = explainer.attribute(gx, additional_forward_args=(gedges, torch.zeros(len(gx), dtype=torch.long)),
                                        target=TARGETS[g], return_tokens=True)
            torch.testing.assert_close(tokens[g:g + 1, :len(gx)], alone, rtol=1e-4, atol=1e-6, msg=name)
            assert (tokens[g, len(gx):] == 0).all(), name  # padded nodes score 0
            rows = batch == g
            if name in RELEVANCE_METHODS:  # relevance per feature; a node's score is their sum
                torch.testing.assert_close(mapped[rows].sum(-1), tokens[g, :len(gx)], msg=name)
            else:  # each node's row of x gets its node's score over every feature
                torch.testing.assert_close(mapped[rows], tokens[g, :len(gx), None].expand(-1, x.shape[1]), msg=name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", ["AH", "AH+LN"])
def test_conservative_lrp_conserves_the_logit_in_float64_on_bias_free_layers(kind, variant):
    model = graph_classifier(kind, bias=False).double()
    for conv in model.convs:
        if hasattr(conv, "lin_skip"):
            conv.lin_skip.bias = None
    _, (x, edge_index, batch) = graphs()
    x = x.double()
    lrp = ConservativeLRP(model, variant=variant)
    relevance, delta = lrp.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS,
                                     return_convergence_delta=True)
    assert relevance.shape == x.shape
    assert delta.abs().max() < 1e-12, delta
    tokens = lrp.attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS, return_tokens=True)
    logits = model(x, edge_index, batch)[torch.arange(3), TARGETS]
    torch.testing.assert_close(tokens.sum(-1), logits.detach(), rtol=0, atol=1e-12)
    # Not a plain gradient: the AH gate changes the map (the test could fail).
    plain = ConservativeLRP(model, variant="GI").attribute(x, additional_forward_args=(edge_index, batch),
                                                           target=TARGETS, return_tokens=True)
    assert not torch.allclose(plain, tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_unchanged_under_rules(kind):
    model = graph_classifier(kind)
    _, (x, edge_index, batch) = graphs()
    before = model(x, edge_index, batch)
    adapter = get_adapter(model)
    with torch.enable_grad(), adapter.propagation(model, RuleSet.AH_LN):
        during = model(x, edge_index, batch)
    assert torch.equal(before, during)


def _hook_counts(model):
    return {name: tuple(len(getattr(m, attr)) for attr in ("_propagate_forward_hooks", "_message_forward_hooks",
                                                            "_forward_pre_hooks", "_forward_hooks"))
            for name, m in model.named_modules() if hasattr(m, "_propagate_forward_hooks")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", [GenericAttention, AttentionRollout, ConservativeLRP])
def test_exact_restore_after_an_error_mid_forward(kind, method):
    model = graph_classifier(kind)
    _, (x, edge_index, batch) = graphs()
    with torch.no_grad():
        before_output = model(x, edge_index, batch)
    before, hooks = snapshot(model), _hook_counts(model)
    with raising_after(model.convs[1], KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            method(model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    assert_same(before, snapshot(model))
    assert _hook_counts(model) == hooks
    with torch.no_grad():
        assert torch.equal(before_output, model(x, edge_index, batch))


@pytest.mark.parametrize("name", ["transformer-relevance", "partial-lrp", "lrp"])
def test_identity_softmax_rule_sets_are_refused_on_gat_layers(name):
    # On TransformerConv they apply (tests/test_pyg_identity_softmax.py).
    model = graph_classifier("GATConv")
    _, (x, edge_index, batch) = graphs()
    with pytest.raises(CaptureError, match="identity rule.*TransformerConv layers only|normalises residual adds"):
        METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)


def test_attn_lrp_is_refused_on_gat_layers():
    model = graph_classifier("GATConv")
    _, (x, edge_index, batch) = graphs()
    with pytest.raises(CaptureError, match="GAT layers"):
        METHOD_FACTORIES["attn-lrp"](model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)


def test_max_pooling_is_refused_unless_the_readout_is_given():
    model = graph_classifier("TransformerConv", pool="max")
    _, (x, edge_index, batch) = graphs()
    with pytest.raises(CaptureError, match="weighs them unequally"):
        GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    # LRP reads relevance at the nodes: no readout needed.
    assert ConservativeLRP(model).attribute(x, additional_forward_args=(edge_index, batch),
                                            target=TARGETS).shape == x.shape
    with pytest.raises(InputError, match="readout"):
        PyGAttentionAdapter(readout="max")


def test_add_pooling_is_detected_and_scales_no_ranking():
    mean = graph_classifier("TransformerConv", pool="mean")
    add = graph_classifier("TransformerConv", pool="add")
    _, (x, edge_index, batch) = graphs()
    rollout_mean = AttentionRollout(mean).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    rollout_add = AttentionRollout(add).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    torch.testing.assert_close(rollout_mean, rollout_add)  # same weights, same maps: same rows


def test_node_level_outputs_and_bad_batches_are_refused():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()

    class NodeLevel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, edge_index, batch=None):
            return self.inner.head(self.inner.nodes(x, edge_index))  # one row per node

    with pytest.raises(CaptureError, match="one row per node"):
        RawAttention(NodeLevel(), adapter=PyGAttentionAdapter(readout="mean")).attribute(
            x, additional_forward_args=(edge_index, batch), target=[(0, 0), (3, 1), (8, 1)])
    with pytest.raises(InputError, match="one node per graph"):
        RawAttention(NodeLevel()).attribute(x, additional_forward_args=(edge_index, batch))
    with pytest.raises(InputError, match="not a node of graph 1"):
        RawAttention(NodeLevel()).attribute(x, additional_forward_args=(edge_index, batch),
                                            target=[(0, 0), (1, 1), (8, 1)])
    crossing = edge_index.clone()
    crossing[0, 0] = x.shape[0] - 1  # an edge from the last graph into the first
    with pytest.raises(InputError, match="different graphs"):
        RawAttention(model).attribute(x, additional_forward_args=(crossing, batch))
    with pytest.raises(InputError, match="node features"):
        RawAttention(model).attribute(x[None], additional_forward_args=(edge_index, batch))


def test_training_mode_attention_dropout_is_refused():
    model = graph_classifier("GATConv")
    for conv in model.convs:
        conv.dropout = 0.5
    model.train()
    _, (x, edge_index, batch) = graphs()
    with pytest.raises(CaptureError, match="training mode"):
        AttentionGradCAM(model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)


def test_every_package_method_either_explains_or_refuses_clearly():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    for name in PACKAGE_METHOD_NAMES:
        try:
            out = METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch),
                                                          target=TARGETS)
        except CaptureError as error:
            assert name not in APPLIES["TransformerConv"] and "rule" in str(error)
        else:
            assert name in APPLIES["TransformerConv"] and out.shape == x.shape


class NodeClassifier(torch.nn.Module):
    """The graph classifier's layers with a per-node head (a node-level task)."""

    def __init__(self, kind):
        super().__init__()
        self.inner = graph_classifier(kind)

    def forward(self, x, edge_index, batch=None):
        return self.inner.head(self.inner.nodes(x, edge_index))


@pytest.mark.parametrize("kind", ["TransformerConv", "GATConv"])
def test_node_level_models_explain_one_node_per_graph(kind):
    # float64: batch equals single is exact math, and float32 LRP (alpha-beta) rounds apart by up
    # to 7e-5 of the map's largest value on some CPUs' kernels.
    model = NodeClassifier(kind).double().eval()
    singles, (x, edge_index, batch) = graphs()
    singles, x = [(gx.double(), gedges) for gx, gedges in singles], x.double()
    nodes = [1, 5, 10]  # one per graph (sizes 3, 5, 4)
    pairs = [(node, TARGETS[g]) for g, node in enumerate(nodes)]
    positions = [1, 2, 2]
    for name in APPLIES[kind]:
        explainer = METHOD_FACTORIES[name](model)
        tokens = explainer.attribute(x, additional_forward_args=(edge_index, batch), target=pairs, return_tokens=True)
        assert tokens.abs().sum() > 0, name
        for g, (gx, gedges) in enumerate(singles):
            alone = explainer.attribute(gx, additional_forward_args=(gedges, torch.zeros(len(gx), dtype=torch.long)),
                                        target=(positions[g], TARGETS[g]), return_tokens=True)
            torch.testing.assert_close(tokens[g:g + 1, :len(gx)], alone, rtol=1e-4, atol=1e-6, msg=name)
            assert (tokens[g, len(gx):] == 0).all(), name
    # The explained row is the node: raw attention is the last layer's row of that node.
    trace = run_trace(get_adapter(model), model, (x,), (edge_index, batch), pairs,
                                     CaptureSpec(forward_reduce=lambda probs: probs.mean(1)))
    raw = RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=pairs,
                                        return_tokens=True)
    last = trace.records[-1].forward_value
    torch.testing.assert_close(raw, last[torch.arange(3), torch.tensor(positions)])
    # LRP: each graph's relevance sums to its node's logit on a bias-free model (conservation).
    bias_free = NodeClassifier(kind)
    bias_free.inner = graph_classifier(kind, bias=False).double()
    for conv in bias_free.inner.convs:
        conv.root_weight = False
    _, delta = ConservativeLRP(bias_free.eval()).attribute(x.double(), additional_forward_args=(edge_index, batch),
                                                           target=pairs, return_convergence_delta=True)
    assert delta.abs().max() < 1e-12


def test_other_message_passing_layers_are_refused_unless_ignored():
    import torch_geometric.nn as pyg

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = graph_classifier("TransformerConv")
            self.gcn = pyg.GCNConv(8, 8)

        def forward(self, x, edge_index, batch=None):
            hidden = self.gcn(self.inner.encode(x), edge_index)  # mixes nodes outside any attention map
            for conv in self.inner.convs:
                hidden = conv(hidden, edge_index)
            return self.inner.head(pyg.global_mean_pool(hidden, batch))

    model = Mixed().eval()
    _, (x, edge_index, batch) = graphs()
    with pytest.raises(CaptureError, match=r"\['gcn'\].*ignore_message_passing=True"):
        AttentionRollout(model).attribute(x, additional_forward_args=(edge_index, batch))
    ignoring = AttentionRollout(model, adapter=PyGAttentionAdapter(ignore_message_passing=True))
    assert ignoring.attribute(x, additional_forward_args=(edge_index, batch)).shape == x.shape
    assert ConservativeLRP(model).attribute(x, additional_forward_args=(edge_index, batch),
                                            target=TARGETS).shape == x.shape  # LRP goes through every layer


def test_threads_see_the_plain_model_while_another_explains():
    import threading

    model = graph_classifier("GATConv")
    _, (x, edge_index, batch) = graphs()
    with torch.no_grad():
        expected = model(x, edge_index, batch)
    alone = GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    outputs, maps, stop = [], [], threading.Event()

    def infer():
        while not stop.is_set():
            with torch.no_grad():
                outputs.append(model(x, edge_index, batch))

    def explain():
        for _ in range(5):
            maps.append(ConservativeLRP(model).attribute(x, additional_forward_args=(edge_index, batch),
                                                         target=TARGETS))
            maps.append(GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch),
                                                          target=TARGETS))

    reader = threading.Thread(target=infer)
    reader.start()
    explainer = threading.Thread(target=explain)
    explainer.start()
    explainer.join()
    stop.set()
    reader.join()
    assert outputs and all(torch.equal(out, expected) for out in outputs)
    assert all(torch.equal(m, alone) for m in maps[1::2])


@pytest.mark.parametrize("name", ["generic-attention", "grad-cam", "conservative-lrp", "attn-lrp"])
def test_a_frozen_model_gets_the_trainable_models_map(name):
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    trainable = METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch),
                                                        target=TARGETS)
    model.requires_grad_(False)
    frozen = METHOD_FACTORIES[name](model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    torch.testing.assert_close(frozen, trainable, rtol=0, atol=0)
    assert not any(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_maps_follow_the_float32_maps(dtype):
    _, (x, edge_index, batch) = graphs()
    model, reference = graph_classifier("TransformerConv").to(dtype), graph_classifier("TransformerConv")
    for name in ("rollout", "generic-attention", "conservative-lrp", "attn-lrp"):
        half = METHOD_FACTORIES[name](model).attribute(x.to(dtype), additional_forward_args=(edge_index, batch),
                                                       target=TARGETS, return_tokens=True)
        full = METHOD_FACTORIES[name](reference).attribute(x, additional_forward_args=(edge_index, batch),
                                                           target=TARGETS, return_tokens=True)
        assert half.dtype == torch.float32  # the package's rule: float32 maps for half-precision models
        assert torch.corrcoef(torch.stack([half.flatten(), full.flatten()]))[0, 1] > 0.99, name


def test_a_compiled_model_gives_the_uncompiled_maps_and_star_args_are_refused():
    model = graph_classifier("GATConv")
    _, (x, edge_index, batch) = graphs()
    expected = GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    compiled = torch.compile(model, backend="eager")
    with warnings.catch_warnings():  # the package's one-time note: compiled parts run as their originals
        warnings.simplefilter("ignore")
        maps = GenericAttention(compiled).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
    assert torch.equal(maps, expected)

    class StarArgs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, *args):
            return self.inner(*args)

    with pytest.raises(InputError, match=r"\*args"):
        GenericAttention(StarArgs()).attribute(x, additional_forward_args=(edge_index, batch), target=TARGETS)
