"""PyG graph models: hook dictionaries shared with other threads, and readout weights of nodes
whose state is constant.

1. While a ``TransformerConv`` model is explained, a plain forward of it in another thread may
   be iterating the layer's PyG hook dictionaries (``propagate`` walks
   ``_message_forward_hooks.values()`` etc., calling each hook). The explanation must never
   add or remove an entry of a dictionary such a thread may be iterating (it died with
   ``RuntimeError: OrderedDict mutated during iteration``). The interleaving is forced, not
   timed: a hook of the user's parks the other thread inside that iteration until the whole
   explanation (hooks installed and removed) has run.
2. A node with no incoming edge aggregates nothing in ``TransformerConv(root_weight=False)``:
   its state after the last attention layer is constant (a ReLU of it has zero gradient), yet
   a mean readout still counts it, with weight 1/n. The readout probe must weigh what the head
   weighs, as the hand-computed mean readout does.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn

pyg = pytest.importorskip("torch_geometric.nn")

from captum_transformers import AttentionRollout, ConservativeLRP, GenericAttention, RawAttention  # noqa: E402
from captum_transformers.adapters.graph.pyg_attention import PyGAttentionAdapter  # noqa: E402
from captum_transformers.capture.trace import CaptureSpec  # noqa: E402
from captum_transformers.engine.runner import run_trace  # noqa: E402
from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.methods.lrp import TransformerLRP  # noqa: E402
from captum_transformers.model_state import patching  # noqa: E402
from pyg_models import graph_classifier, graphs  # noqa: E402
from restore import assert_same, raising_after, snapshot  # noqa: E402

WAIT_S = 60  # a bound on every wait, so a broken interleaving fails instead of hanging

METHODS = {
    "RawAttention": lambda m: RawAttention(m),
    "AttentionRollout": lambda m: AttentionRollout(m),
    "GenericAttention": lambda m: GenericAttention(m),
    "ConservativeLRP": lambda m: ConservativeLRP(m, variant="AH"),
    "TransformerLRP": lambda m: TransformerLRP(m),
}

REGISTER = {
    "message": lambda conv, hook: conv.register_message_forward_hook(hook),
    "propagate": lambda conv, hook: conv.register_propagate_forward_hook(hook),
    "propagate_pre": lambda conv, hook: conv.register_propagate_forward_pre_hook(hook),
}

PYG_HOOK_DICTS = ("_propagate_forward_pre_hooks", "_propagate_forward_hooks", "_message_forward_pre_hooks",
                  "_message_forward_hooks", "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
                  "_edge_update_forward_pre_hooks", "_edge_update_forward_hooks")


def _hook_dicts(model):
    """{(module name, dict name): (the dict object, its items)} of every PyG layer."""
    return {(name, attr): (getattr(m, attr), list(getattr(m, attr).items()))
            for name, m in model.named_modules() if hasattr(m, "_propagate_forward_hooks") for attr in PYG_HOOK_DICTS}


class Parked:
    """A user's hook of ``kind`` on every attention layer that, in the bystander thread only,
    stops the first time it runs (inside PyG's loop over that hook dictionary) until
    :meth:`resume`; a second user hook of the same kind follows it, so the loop has an entry
    still to visit."""

    def __init__(self, model, kind):
        self.model, self.kind = model, kind
        self.bystander = None
        self.parked, self.resumed = threading.Event(), threading.Event()
        self.calls = {"park": 0, "count": 0}
        self.handles = []
        for conv in model.convs:
            self.handles.append(REGISTER[kind](conv, self._park))
            self.handles.append(REGISTER[kind](conv, self._count))

    def _park(self, *_):
        if threading.current_thread() is self.bystander:
            self.calls["park"] += 1
            if not self.parked.is_set():
                self.parked.set()
                assert self.resumed.wait(WAIT_S), "the explaining thread never resumed the bystander"
        return None

    def _count(self, *_):
        if threading.current_thread() is self.bystander:
            self.calls["count"] += 1
        return None

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("kind", ["message", "propagate", "propagate_pre"])
@pytest.mark.parametrize("method", list(METHODS))
def test_a_plain_forward_parked_inside_a_pyg_hook_loop_survives_an_explanation(kind, method):
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs((3, 5, 4), seed=0)
    _, other = graphs((6, 2), seed=7)
    explain = lambda: METHODS[method](model).attribute(  # noqa: E731
        x, additional_forward_args=(edge_index, batch), target=[0, 1, 0], return_tokens=True)
    with torch.no_grad():
        plain_alone = model(*other)
    alone = explain()
    parked = Parked(model, kind)
    found, errors = {}, []

    def bystander():
        try:
            with torch.no_grad():
                found["plain"] = model(*other)
        except BaseException as error:  # noqa: B902 - reported by the main thread
            errors.append(error)

    thread = threading.Thread(target=bystander)
    parked.bystander = thread
    try:
        thread.start()
        assert parked.parked.wait(WAIT_S), "the bystander never reached the user's hook"
        raced = explain()  # the bystander sits inside PyG's loop over this hook dictionary meanwhile
    finally:
        parked.resumed.set()
        thread.join(WAIT_S)
        parked.remove()
    assert not thread.is_alive()
    assert not errors, f"the plain forward in the other thread died: {errors[0]!r}"
    assert torch.equal(found["plain"], plain_alone)  # the model's own behaviour, bit for bit
    assert parked.calls == {"park": 2, "count": 2}  # both user hooks ran once per layer, nothing else
    assert torch.equal(raced, alone)


def test_the_hook_dictionary_a_thread_iterates_is_never_changed_and_comes_back_as_it_was():
    """The explanation works on its own copies of a layer's hook dictionaries: no key of a
    dictionary found is added or removed while the layer runs in the explanation (the user's
    hooks there are only wrapped in place, which no iteration notices), and afterwards each is
    the layer's dictionary again, with the user's own hooks."""
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs((3, 5, 4), seed=0)
    handles = [conv.register_message_forward_hook(lambda *_: None) for conv in model.convs]
    handles += [conv.register_propagate_forward_hook(lambda *_: None) for conv in model.convs]
    before = _hook_dicts(model)
    during = []

    def look(_module, _inputs, _out):
        during.append({key: list(found) for key, (found, _) in before.items()})

    handles.append(model.convs[1].register_aggregate_forward_hook(look))
    before = _hook_dicts(model)
    GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0])
    assert during and all(seen == {key: [k for k, _ in items] for key, (_, items) in before.items()} for seen in during)
    after = _hook_dicts(model)
    for key, (found, items) in before.items():
        assert after[key][0] is found and after[key][1] == items, key
    for handle in handles:
        handle.remove()


def test_exact_restore_of_the_pyg_hook_dictionaries_after_an_error_mid_forward():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs((3, 5, 4), seed=0)
    before, dicts = snapshot(model), _hook_dicts(model)
    with raising_after(model.convs[1], RuntimeError("boom")), pytest.raises(RuntimeError, match="boom"):
        TransformerLRP(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1, 0])
    assert_same(before, snapshot(model))
    after = _hook_dicts(model)
    for key, (found, items) in dicts.items():
        assert after[key][0] is found and after[key][1] == items, key


def test_message_passing_hook_runs_only_in_its_context_and_names_a_wrong_kind_or_module():
    conv = graph_classifier("TransformerConv").convs[0]
    found = conv._message_forward_hooks
    calls = []
    with patching.message_passing_hook(conv, "message", lambda *_: calls.append(threading.current_thread())):
        assert conv._message_forward_hooks is not found and isinstance(conv._message_forward_hooks, OrderedDict)
        assert len(found) == 0  # the dictionary found was never written
        conv(torch.randn(4, 8), torch.tensor([[0, 1, 2], [1, 2, 3]]))
        other = threading.Thread(target=lambda: conv(torch.randn(4, 8), torch.tensor([[0, 1], [1, 2]])))
        other.start()
        other.join()
    assert calls == [threading.current_thread()]
    assert conv._message_forward_hooks is found and len(found) == 0
    with pytest.raises(InputError, match="kind must be one of"):
        with patching.message_passing_hook(conv, "aggregate_pre", lambda *_: None):
            pass
    with pytest.raises(InputError, match="Linear.*not a torch_geometric MessagePassing"):
        with patching.message_passing_hook(nn.Linear(2, 2), "message", lambda *_: None):
            pass


def test_a_hook_registered_on_the_copy_meanwhile_is_reported_when_dropped():
    conv = graph_classifier("TransformerConv").convs[0]
    found = conv._propagate_forward_hooks
    with pytest.warns(UserWarning, match="registered on .*TransformerConv.*while it was explained"):
        with patching.message_passing_hook(conv, "propagate", lambda *_: None):
            conv.register_propagate_forward_hook(lambda *_: None)
    assert conv._propagate_forward_hooks is found and len(found) == 0


# -- 2. readout weights of a node whose state after the last attention layer is constant --------

class ReluTransformerNet(nn.Module):
    """Node encoder, two ``TransformerConv(root_weight=False)`` layers each followed by a ReLU
    (PyG's usual ``conv(x, edge_index).relu()``), a mean readout, a linear head."""

    def __init__(self, channels=8):
        super().__init__()
        self.encode = nn.Linear(3, channels)
        self.convs = nn.ModuleList([pyg.TransformerConv(channels, channels // 2, heads=2, root_weight=False)
                                    for _ in range(2)])
        self.head = nn.Linear(channels, 2)

    def forward(self, x, edge_index, batch=None):
        hidden = self.encode(x)
        for conv in self.convs:
            hidden = conv(hidden, edge_index).relu()
        return self.head(pyg.global_mean_pool(hidden, batch))


def _source_less_graphs():
    """Two graphs, 5 and 4 nodes. In the first, node 4 only sends (no incoming edge); in the
    second, node 8 has no edge at all. Both aggregate nothing in every layer."""
    x = torch.randn(9, 3, generator=torch.Generator().manual_seed(1))
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 4, 5, 6, 7], [1, 2, 3, 0, 0, 2, 6, 7, 5]])
    return x, edge_index, torch.tensor([0] * 5 + [1] * 4)


def _mean_readout_truth(model, x, edge_index, batch, method):
    """By hand: the last layer's head-mean maps (rollout: their product with the first layer's,
    Abnar & Zuidema's 0.5 A + 0.5 I per layer, rows renormalised), rows weighted 1/n over every
    node of each graph, as global_mean_pool weighs them."""
    trace = run_trace(PyGAttentionAdapter(readout="mean"), model, (x,), (edge_index, batch), None,
                      CaptureSpec(forward_reduce=lambda probs: probs))
    maps = [record.forward_value.mean(1).to(torch.float64) for record in trace.records]
    counts = torch.bincount(batch)
    mask = torch.arange(int(counts.max()))[None, :] < counts[:, None]
    weights = mask.to(torch.float64) / counts[:, None].to(torch.float64)
    if method is RawAttention:
        return torch.einsum("bi,bij->bj", weights, maps[-1])
    eye = torch.diag_embed(mask.to(torch.float64))
    rollout = eye
    for layer in maps:
        mixed = 0.5 * layer + 0.5 * eye
        mixed = mixed / mixed.sum(-1, keepdim=True).clamp(min=1e-30)
        rollout = mixed @ rollout
    return torch.einsum("bi,bij->bj", weights, rollout)


def test_the_source_less_nodes_state_is_constant_and_its_relu_has_no_gradient():
    """The premise: the probe's gradient at the last attention output is zero at those nodes."""
    torch.manual_seed(0)
    model = ReluTransformerNet().eval()
    x, edge_index, batch = _source_less_graphs()
    hidden = model.encode(x)
    hidden = model.convs[0](hidden, edge_index).relu()
    last = model.convs[1](hidden, edge_index)
    assert (last[[4, 8]] == 0).all()
    (grad,) = torch.autograd.grad(model.head(pyg.global_mean_pool(last.relu(), batch)).sum(), last)
    assert (grad[[4, 8]] == 0).all() and (grad[[0, 1, 2, 3, 5, 6, 7]] != 0).any(dim=1).all()


@pytest.mark.parametrize("method", [RawAttention, AttentionRollout])
def test_a_node_with_no_incoming_edge_keeps_its_mean_readout_weight(method):
    torch.manual_seed(0)
    model = ReluTransformerNet().eval()
    x, edge_index, batch = _source_less_graphs()
    found = method(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    given = method(model, adapter=PyGAttentionAdapter(readout="mean")).attribute(
        x, additional_forward_args=(edge_index, batch), return_tokens=True)
    expected = _mean_readout_truth(model, x, edge_index, batch, method)
    torch.testing.assert_close(given.to(torch.float64), expected, rtol=1e-5, atol=1e-6)  # the truth formula
    torch.testing.assert_close(found.to(torch.float64), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(found, given, rtol=0, atol=0)


def test_a_gradient_method_reads_the_same_weights_as_the_given_mean_readout():
    torch.manual_seed(0)
    model = ReluTransformerNet().eval()
    x, edge_index, batch = _source_less_graphs()
    found = GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=[0, 1],
                                              return_tokens=True)
    given = GenericAttention(model, adapter=PyGAttentionAdapter(readout="mean")).attribute(
        x, additional_forward_args=(edge_index, batch), target=[0, 1], return_tokens=True)
    torch.testing.assert_close(found, given, rtol=0, atol=0)


class ReluRootReadout(ReluTransformerNet):
    """Reads each graph's first node after a ReLU; the second graph's first node has no edge."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.encode(x)
        for conv in self.convs:
            hidden = conv(hidden, edge_index).relu()
        counts = torch.bincount(batch)
        return self.head(hidden[counts.cumsum(0) - counts])


def test_a_root_readout_whose_root_has_no_incoming_edge_reads_that_root():
    torch.manual_seed(0)
    model = ReluRootReadout().eval()
    x = torch.randn(9, 3, generator=torch.Generator().manual_seed(1))
    edge_index = torch.tensor([[0, 1, 2, 3, 6, 7, 8], [1, 2, 3, 0, 7, 8, 6]])  # node 5 (graph 1's root): no edge
    batch = torch.tensor([0] * 5 + [1] * 4)
    found = RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    trace = run_trace(PyGAttentionAdapter(readout="mean"), model, (x,), (edge_index, batch), None,
                      CaptureSpec(forward_reduce=lambda probs: probs))
    last = trace.records[-1].forward_value.mean(1)
    torch.testing.assert_close(found[0], last[0, 0], rtol=0, atol=0)
    assert (found[1] == 0).all()  # the root's row is empty: it attends to nothing


class ReluThenWhereAdd(ReluTransformerNet):
    """An add pooling over a constant subset written with ``torch.where`` after the ReLU: the
    source-less node 4 is in the subset (read, with its constant state), node 1 is not."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.encode(x)
        for conv in self.convs:
            hidden = conv(hidden, edge_index).relu()
        keep = torch.tensor([True, False, True, True, True, True, False, True, True])
        return self.head(pyg.global_add_pool(torch.where(keep[:, None], hidden, 0.0), batch))


def test_a_constant_mask_after_the_relu_reads_its_subset_source_less_node_included():
    torch.manual_seed(0)
    model = ReluThenWhereAdd().eval()
    x, edge_index, batch = _source_less_graphs()
    found = RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    trace = run_trace(PyGAttentionAdapter(readout="mean"), model, (x,), (edge_index, batch), None,
                      CaptureSpec(forward_reduce=lambda probs: probs))
    last = trace.records[-1].forward_value.mean(1).to(torch.float64)
    weights = torch.tensor([[1 / 4, 0, 1 / 4, 1 / 4, 1 / 4], [1 / 3, 0, 1 / 3, 1 / 3, 0]], dtype=torch.float64)
    torch.testing.assert_close(found.to(torch.float64), torch.einsum("bi,bij->bj", weights, last),
                               rtol=1e-5, atol=1e-6)


class ConstantlyWeighted(ReluTransformerNet):
    """An add pooling of node states times constant, unequal weights per node."""

    def forward(self, x, edge_index, batch=None):
        hidden = self.encode(x)
        for conv in self.convs:
            hidden = conv(hidden, edge_index)
        weights = torch.linspace(0.5, 1.5, len(batch))
        return self.head(pyg.global_add_pool(hidden * weights[:, None], batch))


def test_constant_unequal_node_weights_before_the_pooling_are_refused():
    from captum_transformers.errors import CaptureError

    torch.manual_seed(0)
    model = ConstantlyWeighted().eval()
    x, edge_index, batch = _source_less_graphs()
    with pytest.raises(CaptureError, match="weighs them unequally"):
        RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch))
