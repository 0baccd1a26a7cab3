"""The Graphormer adapter: captured maps, batches of graphs of different sizes, padding,
exact restore, conservation of the AH+LN rules and unchanged forwards under every rule set."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from captum_transformers import CaptureSpec, ConservativeLRP, RuleSet, get_adapter  # noqa: E402
from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.methods.catalog import PACKAGE_METHOD_NAMES, build_method  # noqa: E402
from captum_transformers.models import graphormer as package  # noqa: E402
from captum_transformers.engine.runner import run_relevance, run_trace
from graphormer_models import batch, graphs, model  # noqa: E402
from restore import assert_same, raising_after, snapshot  # noqa: E402

SIZES = (5, 3, 7)
TARGETS = [0, 2, 1]


def _attention_inputs(net):
    """Forward pre-hooks keeping each attention call's query, bias and padding."""
    seen = []

    def keep(module, args, kwargs):
        seen.append((module, kwargs["query"], kwargs["attn_bias"], kwargs["key_padding_mask"]))

    handles = [m.register_forward_pre_hook(keep, with_kwargs=True) for m in net.modules()
               if isinstance(m, package.GraphormerMultiheadAttention)]
    return seen, handles


@pytest.mark.parametrize("pre_layernorm", [False, True], ids=["post-LN", "pre-LN"])
def test_captured_maps_equal_a_hand_computed_softmax(pre_layernorm):
    net = model(seed=3, dtype=torch.float64, pre_layernorm=pre_layernorm)
    nodes, rest = batch(graphs(SIZES))
    seen, handles = _attention_inputs(net)
    try:
        with torch.no_grad():
            net(nodes, **rest)
    finally:
        for handle in handles:
            handle.remove()
    trace = run_trace(get_adapter(net), net, (nodes,), (), TARGETS, CaptureSpec(forward_reduce=lambda probs: probs),
                                   forward_kwargs=rest)
    assert len(trace.records) == len(seen) == 2
    for record, (module, query, bias, padding) in zip(trace.records, seen):
        tokens, graphs_in_batch, _ = query.shape
        heads = module.num_heads
        x = query.transpose(0, 1)  # (B, T, C)
        q = (x @ module.q_proj.weight.T + module.q_proj.bias) * module.head_dim ** -0.5
        k = x @ module.k_proj.weight.T + module.k_proj.bias
        q = q.view(graphs_in_batch, tokens, heads, -1).transpose(1, 2)
        k = k.view(graphs_in_batch, tokens, heads, -1).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + bias
        scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
        expected = scores.exp() / scores.exp().sum(-1, keepdim=True)
        torch.testing.assert_close(record.forward_value, expected, rtol=1e-12, atol=1e-12)
    # The explained row is the graph token; padded nodes are masked.
    assert trace.layout.query_rows.eq(0).all()
    assert trace.layout.token_mask.tolist() == [[True] * (1 + n) + [False] * (max(SIZES) - n) for n in SIZES]


@pytest.mark.parametrize("name", PACKAGE_METHOD_NAMES)
def test_batch_equals_graphs_one_at_a_time_and_padding_scores_zero(name):
    net = model(seed=4)
    graph_list = graphs(SIZES)
    nodes, rest = batch(graph_list)
    explainer = build_method(name, net)
    maps = explainer.attribute(nodes, target=TARGETS, forward_kwargs=rest)
    tokens = explainer.attribute(nodes, target=TARGETS, forward_kwargs=rest, return_tokens=True)
    # Node scores (B, N_max), as the PyG adapters give them: the graph token is left out.
    assert maps.shape == nodes.shape and tokens.shape == (len(SIZES), max(SIZES))
    assert torch.isfinite(tokens).all()
    # The input map holds each node's score over its features.
    assert torch.equal(maps, tokens[:, :, None].expand_as(maps))
    for b, (graph, n) in enumerate(zip(graph_list, SIZES)):
        assert torch.equal(tokens[b, n:], torch.zeros_like(tokens[b, n:]))  # exactly 0
        if name != "grad-cam":  # its ReLU may clear a whole map of an untrained model
            assert tokens[b, :n].abs().sum() > 0
        single_nodes, single_rest = batch([graph])
        single = explainer.attribute(single_nodes, target=TARGETS[b], forward_kwargs=single_rest,
                                     return_tokens=True)
        assert single.shape == (1, n)
        torch.testing.assert_close(tokens[b:b + 1, :n], single, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", PACKAGE_METHOD_NAMES)
def test_exact_restore_after_an_error_mid_forward(name):
    net = model(seed=5)
    nodes, rest = batch(graphs(SIZES))
    with torch.no_grad():
        before_output = net(nodes, **rest).logits
    before = snapshot(net)
    explainer = build_method(name, net)
    with raising_after(get_adapter(net).blocks(net)[-1].module, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            explainer.attribute(nodes, target=TARGETS, forward_kwargs=rest)
    assert_same(before, snapshot(net))
    with torch.no_grad():
        assert torch.equal(before_output, net(nodes, **rest).logits)


def _without_biases(net):
    with torch.no_grad():
        for name, parameter in net.named_parameters():
            if name.endswith(".bias") or name.endswith("lm_output_learned_bias"):
                parameter.zero_()
    return net


@pytest.mark.parametrize("options", [dict(), dict(pre_layernorm=True), dict(encoder_normalize_before=True)],
                         ids=["post-LN", "pre-LN", "embedding-LN"])
def test_ah_ln_conserves_relevance_on_a_bias_free_graphormer(options):
    # Non-zero spatial, edge and virtual-distance encodings: they enter only the (constant) probabilities.
    net = _without_biases(model(seed=6, dtype=torch.float64, activation_fn="relu", **options))
    nodes, rest = batch(graphs(SIZES))
    relevance, delta = ConservativeLRP(net).attribute(nodes, target=TARGETS, forward_kwargs=rest,
                                                      return_tokens=True, return_convergence_delta=True)
    logits = net(nodes, **rest).logits.detach()
    chosen = logits[torch.arange(len(SIZES)), torch.tensor(TARGETS)]
    assert chosen.abs().min() > 1e-3
    # The graph token (a learned embedding, not a node) takes its share: with the nodes the
    # tokens sum to the logit. return_tokens gives the nodes alone; the adapter's result all tokens.
    every_token = run_relevance(get_adapter(net), net, (nodes,), (), TARGETS, RuleSet.AH_LN, forward_kwargs=rest).tokens
    assert relevance.shape == (len(SIZES), max(SIZES)) and every_token.shape == (len(SIZES), 1 + max(SIZES))
    assert torch.equal(relevance, every_token[:, 1:])
    torch.testing.assert_close(every_token.sum(-1), chosen, rtol=0, atol=1e-12)
    assert delta.abs().max() < 1e-12
    # The test can fail: plain Gradient x Input on the same model does not conserve.
    _, gi_delta = ConservativeLRP(net, variant="GI").attribute(nodes, target=TARGETS, forward_kwargs=rest,
                                                               return_tokens=True, return_convergence_delta=True)
    assert gi_delta.abs().max() > 1e-6


@pytest.mark.parametrize("rules", [RuleSet.GRADIENT, RuleSet.AH, RuleSet.AH_LN, RuleSet.CHEFER, RuleSet.LRP,
                                   RuleSet.ATTN_LRP], ids=lambda rules: rules.name)
@pytest.mark.parametrize("pre_layernorm", [False, True], ids=["post-LN", "pre-LN"])
def test_forward_is_bit_identical_under_every_rule_set(rules, pre_layernorm):
    net = model(seed=7, pre_layernorm=pre_layernorm)
    nodes, rest = batch(graphs(SIZES))
    with torch.no_grad():
        plain = net(nodes, **rest).logits
    adapter = get_adapter(net)
    with torch.enable_grad(), adapter.propagation(net, rules):
        ruled = net(nodes, **rest).logits
    assert torch.equal(plain, ruled)


class _LoggingAttention(package.GraphormerMultiheadAttention):
    """Stands for transformers 4.x's attention class: another class of the same name and
    attributes, whose own forward the adapter must not run while explaining."""

    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)


_LoggingAttention.__name__ = _LoggingAttention.__qualname__ = "GraphormerMultiheadAttention"


def test_a_4x_graphormer_found_by_dotted_key_runs_the_package_attention():
    from captum_transformers.adapters.graph.graphormer import MODEL_KEYS

    assert "transformers.models.deprecated.graphormer.modeling_graphormer.GraphormerPreTrainedModel" in MODEL_KEYS
    foreign_base = type("GraphormerPreTrainedModel", (nn.Module,),
                        {"__module__": "transformers.models.deprecated.graphormer.modeling_graphormer"})
    reference = model(seed=8)
    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    # Its methods must look like transformers' own, or the foreign-patch guard refuses them.
    forward.__module__ = foreign_base.__module__
    foreign_class = type("GraphormerForGraphClassification", (foreign_base,),
                         {"__module__": foreign_base.__module__, "forward": forward})
    foreign = foreign_class()
    foreign.inner = model(seed=8)
    for parent in list(foreign.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, package.GraphormerMultiheadAttention):
                replacement = _LoggingAttention(foreign.inner.config)
                replacement.load_state_dict(child.state_dict())
                setattr(parent, child_name, replacement)
    foreign.eval()
    assert get_adapter(foreign).name == "graphormer"
    nodes, rest = batch(graphs(SIZES))
    for name in ("transformer-relevance", "lrp", "conservative-lrp"):
        _LoggingAttention.calls = 0
        expected = build_method(name, reference).attribute(nodes, target=TARGETS, forward_kwargs=rest)
        got = build_method(name, foreign).attribute(nodes, target=TARGETS, forward_kwargs=rest)
        assert _LoggingAttention.calls == 0
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)
    with torch.no_grad():
        foreign(nodes, **rest)
    assert _LoggingAttention.calls == 2  # outside explanations the model's own forward runs


def test_training_mode_and_bare_encoders_are_refused():
    net = model(seed=9, attention_dropout=0.1)  # active dropout in training mode (tests/test_train_mode.py)
    nodes, rest = batch(graphs(SIZES))
    with pytest.raises(InputError, match="eval"):
        build_method("generic-attention", net.train()).attribute(nodes, target=TARGETS, forward_kwargs=rest)
    with pytest.raises(InputError, match="without logits"):
        build_method("generic-attention", net.eval().encoder).attribute(nodes, target=TARGETS, forward_kwargs=rest)


def test_other_inputs_by_position_equal_inputs_by_name():
    net = model(seed=10)
    nodes, rest = batch(graphs(SIZES))
    by_name = build_method("generic-attention", net).attribute(nodes, target=TARGETS, forward_kwargs=rest)
    order = ("input_edges", "attn_bias", "in_degree", "out_degree", "spatial_pos", "attn_edge_type")
    by_position = build_method("generic-attention", net).attribute(
        nodes, target=TARGETS, additional_forward_args=tuple(rest[key] for key in order))
    assert torch.equal(by_name, by_position)


@pytest.mark.parametrize("name", ["generic-attention", "conservative-lrp"])
def test_the_collator_output_is_a_mapping_input(name):
    from captum_transformers.models import GraphormerCollator

    net = model(seed=11)
    graph_list = [{**graph, "y": torch.tensor([label])} for graph, label in zip(graphs(SIZES), TARGETS)]
    collated = GraphormerCollator()(graph_list)  # labels included: the model computes a loss too
    nodes, rest = batch(graph_list)
    explainer = build_method(name, net)
    expected = explainer.attribute(nodes, target=TARGETS, forward_kwargs=rest)
    assert torch.equal(explainer.attribute(collated, target=TARGETS), expected)


def test_the_docs_example_runs():
    pytest.importorskip("torch_geometric")
    import pathlib

    text = (pathlib.Path(__file__).parent.parent / "docs" / "graphs.md").read_text()
    namespace: dict = {}
    section = text.split("## Graphormer\n", 1)[1]
    exec(section.split("```python\n")[1].split("```")[0], namespace)  # noqa: S102 - our own documentation
    assert namespace["node_scores"].shape == (2, 3) and namespace["node_scores"][1, 2] == 0
    assert namespace["tokens"].shape == (2, 3) and namespace["tokens"][1, 2] == 0


class _MeanPooled(nn.Module):
    """A user's head reading the mean of the node states, not the graph token."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, input_nodes, **rest):
        states = self.net.encoder(input_nodes, **rest).last_hidden_state
        real = (input_nodes[:, :, 0] != 0).to(states.dtype)[..., None]
        return self.net.classifier((states[:, 1:] * real).sum(1) / real.sum(1))


def test_a_head_that_pools_the_nodes_is_refused_not_explained_at_the_graph_token():
    net = model(seed=12)
    nodes, rest = batch(graphs(SIZES))
    for name in ("generic-attention", "transformer-relevance", "grad-cam"):
        with pytest.raises(InputError, match="depends on the last layer's tokens"):
            build_method(name, _MeanPooled(net).eval()).attribute(nodes, target=TARGETS, forward_kwargs=rest)
    build_method("generic-attention", net).attribute(nodes, target=TARGETS, forward_kwargs=rest)  # graph token: fine


@pytest.mark.parametrize("name", ["generic-attention", "transformer-relevance", "lrp", "conservative-lrp"])
def test_threads_explaining_and_running_one_graphormer_do_not_interfere(name):
    import sys
    import threading

    net = model(seed=13)
    nodes, rest = batch(graphs(SIZES))
    explainer = build_method(name, net)
    expected = explainer.attribute(nodes, target=TARGETS, forward_kwargs=rest, return_tokens=True)
    with torch.no_grad():
        clean = net(nodes, **rest).logits
    before = snapshot(net)
    results, errors, done = [], [], threading.Event()
    barrier = threading.Barrier(3)

    def explain():
        try:
            barrier.wait(timeout=60)
            for _ in range(2):
                results.append(explainer.attribute(nodes, target=TARGETS, forward_kwargs=rest, return_tokens=True))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            done.set()

    def bystander():
        try:
            barrier.wait(timeout=60)
            for _ in range(200):
                with torch.no_grad():
                    assert torch.equal(net(nodes, **rest).logits, clean)
                if done.is_set():
                    break
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=job) for job in (explain, explain, bystander)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert len(results) == 4 and all(torch.equal(maps, expected) for maps in results)
    assert_same(before, snapshot(net))
