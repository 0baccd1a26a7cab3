"""The fused softmax attention of attention_core against the same attention written as
separate operations (each under its own rule Function, keeping the scores and the map).

1. Forward outputs are bit-identical, with or without rules.
2. Every gradient (query, key, value, a position bias) equals the separate operations' in
   float64: plainly, under each rule set, and with the map also used outside the product.
3. The observer receives the map and the gradient a hook on the separate map receives;
   across two backward passes through one graph (the relevance, then the plain gradient)
   the deferred first gradient equals the one the first pass gave.
4. Only Q, K, V (and the extras) are kept for the backward pass: no (B, H, Q, K) tensor.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import RuleSet
from captum_transformers.propagation.attention.core import softmax_attention
from captum_transformers.propagation.backward_switch import switchable_backward
from captum_transformers.propagation.rules.operations import OperationRules

B, H, Q, K, D = 2, 6, 5, 6, 4
RULES = [None, RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP]


def _tensors(dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()  # noqa: E731
    query, key, value = make(B, H, Q, D), make(B, H, K, D), make(B, H, K, D)
    bias = make(1, H, Q, K)
    mask = torch.zeros(B, 1, 1, K, dtype=dtype)
    mask[1, ..., -2:] = torch.finfo(dtype).min  # the second example's last two keys are padding
    return query, key, value, bias, mask


def _scores(query, key, bias, mask):
    return torch.matmul(query, key.transpose(-1, -2)) * 0.5 + bias + mask


def _separate(query, key, value, bias, mask, softmax_dtype):
    probs = torch.softmax(_scores(query, key, bias, mask), dim=-1, dtype=softmax_dtype).to(query.dtype)
    return torch.matmul(probs, value), probs


def _fused(query, key, value, bias, mask, softmax_dtype, observer=None):
    return softmax_attention(_scores, query, key, value, bias, mask, softmax_dtype=softmax_dtype, observer=observer)


def _run(attention, rules, tensors, softmax_dtype=None, use_probs=False, observer=None):
    """Output, probs and the gradients of a weighted sum of the output (and of the map)."""
    query, key, value, bias, mask = tensors
    kwargs = {"observer": observer} if observer is not None else {}
    if rules is None:
        output, probs = attention(query, key, value, bias, mask, softmax_dtype, **kwargs)
    else:
        with OperationRules(rules, B):
            output, probs = attention(query, key, value, bias, mask, softmax_dtype, **kwargs)
    weights = torch.linspace(-1, 2, output.numel(), dtype=output.dtype).reshape(output.shape)
    score = (output * weights).sum()
    if use_probs:
        score = score + (probs * probs.detach()).sum()
    grads = torch.autograd.grad(score, (query, key, value, bias))
    return output.detach(), probs.detach(), grads


@pytest.mark.parametrize("rules", RULES, ids=lambda r: "plain" if r is None else r.name)
@pytest.mark.parametrize("softmax_dtype", [None, torch.float32], ids=["same-dtype", "float32-softmax"])
@pytest.mark.parametrize("use_probs", [False, True], ids=["product-only", "map-used-outside"])
def test_fused_attention_equals_separate_operations(rules, softmax_dtype, use_probs):
    tensors = _tensors()
    fused = _run(_fused, rules, tensors, softmax_dtype, use_probs)
    separate = _run(_separate, rules, tensors, softmax_dtype, use_probs)
    assert torch.equal(fused[0], separate[0]) and torch.equal(fused[1], separate[1])  # bit-identical forward
    for got, expected in zip(fused[2], separate[2]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert all(g.abs().max() > 1e-6 for g in fused[2])  # every operand, the bias too, gets a gradient
    if rules is RuleSet.CHEFER:  # the rules change the gradients, so the comparison can fail
        plain = _run(_fused, None, tensors, softmax_dtype, use_probs)
        assert not torch.allclose(plain[2][0], fused[2][0], rtol=1e-3)


class _Observer:
    def __init__(self, deferred=False):
        self.wanted, self.deferred = True, deferred
        self.calls = []

    def __call__(self, probs, grad):
        self.calls.append(("now", probs.clone(), grad.clone()))

    def defer(self):
        self.calls.append(("defer",))

    def first(self, probs, grad):
        self.calls.append(("first", probs.clone(), grad.clone()))

    def second(self, probs, grad):
        self.calls.append(("second", probs.clone(), grad.clone()))


def _hooked_map_gradient(rules, tensors):
    """The gradient reaching the map of the separate operations (a tensor hook)."""
    seen = []

    def separate(query, key, value, bias, mask, softmax_dtype):
        output, probs = _separate(query, key, value, bias, mask, softmax_dtype)
        probs.register_hook(lambda grad: seen.append(grad.clone()))
        return output, probs

    _run(separate, rules, tensors)
    return seen[0]


@pytest.mark.parametrize("rules", [None, RuleSet.CHEFER], ids=["plain", "Chefer2021"])
def test_observer_receives_the_map_and_its_gradient(rules):
    tensors = _tensors()
    observer = _Observer()
    _, probs, _ = _run(_fused, rules, tensors, observer=observer)
    (kind, seen_probs, seen_grad), = observer.calls
    assert kind == "now"
    assert torch.equal(seen_probs, probs)
    torch.testing.assert_close(seen_grad, _hooked_map_gradient(rules, tensors), rtol=1e-12, atol=1e-14)


def test_two_passes_defer_the_first_gradient_and_pair_it_with_the_second():
    """Relevance pass (rules) then plain pass through one graph: the first pass only defers;
    the second hands over the first pass's gradient at the map, then its own."""
    query, key, value, bias, mask = tensors = _tensors()
    observer = _Observer(deferred=True)
    with switchable_backward() as switch, OperationRules(RuleSet.CHEFER, B):
        output, _ = _fused(*tensors, None, observer=observer)
    weights = torch.linspace(-1, 2, output.numel(), dtype=output.dtype).reshape(output.shape)
    relevance_grads = torch.autograd.grad((output * weights).sum(), (query, key, value, bias), retain_graph=True)
    assert [call[0] for call in observer.calls] == ["defer"]
    observer.deferred = False
    with switch.plain_gradient():
        plain_grads = torch.autograd.grad((output * weights).sum(), (query, key, value, bias))
    assert [call[0] for call in observer.calls] == ["defer", "first", "second"]
    torch.testing.assert_close(observer.calls[1][2], _hooked_map_gradient(RuleSet.CHEFER, tensors),
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(observer.calls[2][2], _hooked_map_gradient(None, tensors), rtol=1e-12, atol=1e-14)
    for got, expected in zip(relevance_grads, _run(_separate, RuleSet.CHEFER, tensors)[2]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    for got, expected in zip(plain_grads, _run(_separate, None, tensors)[2]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def _saved_storages(function) -> dict:
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return storages


@pytest.mark.parametrize("rules", [None, RuleSet.CHEFER], ids=["plain", "Chefer2021"])
def test_keeps_no_attention_map_for_the_backward_pass(rules):
    query, key, value, bias, mask = tensors = _tensors()

    def forward(attention):
        def run():
            if rules is None:
                attention(*tensors, None)
            else:
                with OperationRules(rules, B):
                    attention(*tensors, None)
        return run

    fused = _saved_storages(forward(_fused))
    assert set(fused) == {t.untyped_storage().data_ptr() for t in tensors}
    assert B * H * Q * K in _saved_storages(forward(_separate)).values()  # the reference does keep a map
    assert B * H * Q * K not in fused.values()


def test_without_gradients_it_is_the_two_operations():
    query, key, value, bias, mask = (t.detach() for t in _tensors())
    output, probs = softmax_attention(_scores, query, key, value, bias, mask)
    expected = _separate(query, key, value, bias, mask, None)
    assert torch.equal(output, expected[0]) and torch.equal(probs, expected[1])
    assert output.grad_fn is None


def _scores_by_hand(query, key, mask):
    scores = torch.matmul(query, key.transpose(-1, -2))
    return (scores * 0.5 + mask) if torch.is_grad_enabled() else scores.mul_(0.5).add_(mask)


_scores_by_hand.plain_gradient = lambda g, query, key: (torch.matmul(g.mul_(0.5), key),
                                                        torch.matmul(g.transpose(-1, -2), query))


@pytest.mark.parametrize("softmax_dtype", [None, torch.float32], ids=["same-dtype", "float32-softmax"])
def test_a_scores_function_differentiated_by_hand_gives_autograds_gradients(softmax_dtype):
    """A scores function carrying ``plain_gradient`` (S = scale Q K^T + a constant mask) is
    recomputed without a graph and differentiated by hand in the plain backward pass: the
    gradients and the map's gradient handed to the observer are autograd's, to 1e-12."""
    query, key, value, _, mask = _tensors()
    calls = []

    class Observer:
        wanted, deferred = True, False

        def __call__(self, probs, grad):
            calls.append((probs.clone(), grad.clone()))

    weights = torch.linspace(-1, 2, B * H * Q * D, dtype=torch.float64).reshape(B, H, Q, D)
    output, _ = softmax_attention(_scores_by_hand, query, key, value, mask, softmax_dtype=softmax_dtype,
                                  observer=Observer())
    fused = torch.autograd.grad((output * weights).sum(), (query, key, value))
    expected_output, probs = _separate(query, key, value, torch.zeros(()), mask, softmax_dtype)
    probs.retain_grad()
    (expected_output * weights).sum().backward(inputs=[query, key, value, probs])
    assert torch.equal(output, expected_output)
    for mine, theirs in zip(fused, (query.grad, key.grad, value.grad)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
    (seen_probs, seen_grad), = calls
    torch.testing.assert_close(seen_probs, probs.detach(), rtol=0, atol=1e-15)
    torch.testing.assert_close(seen_grad, probs.grad, rtol=0, atol=1e-12)


def test_a_hand_gradient_is_not_used_where_an_extra_needs_a_gradient():
    """A bias that needs its gradient takes autograd's path: its gradient is returned."""
    query, key, value, bias, mask = _tensors()

    def scores(query, key, bias):
        return torch.matmul(query, key.transpose(-1, -2)) * 0.5 + bias

    scores.plain_gradient = lambda g, query, key: pytest.fail("the hand gradient ignores the bias")
    output, _ = softmax_attention(scores, query, key, value, bias)
    (g_bias,) = torch.autograd.grad(output.sum(), (bias,))
    assert g_bias.abs().sum() > 0


@pytest.mark.parametrize("rules", RULES, ids=lambda r: "plain" if r is None else r.name)
def test_grouped_keys_are_kept_unrepeated_and_get_their_groups_gradient(rules):
    """``kv_groups=G``: keys and values with H / G heads, repeated inside the Function. Its output and
    every gradient (the keys' and values' summed over each group's G heads, as the repetition's
    backward pass sums them) equal the attention over keys and values repeated outside it, and the
    graph keeps the H / G heads only (a GQA Llama kept all H repeats per layer before)."""
    from captum_transformers.propagation.attention.chunk_products import repeat_heads
    groups = 3
    query, _, _, bias, mask = _tensors()
    generator = torch.Generator().manual_seed(1)
    key, value = (torch.randn(B, H // groups, K, D, generator=generator, dtype=torch.float64).requires_grad_()
                  for _ in range(2))
    weights = torch.linspace(-1, 2, B * H * Q * D, dtype=torch.float64).reshape(B, H, Q, D)

    def attend(grouped_inside):
        def run():
            keys, values = (key, value) if grouped_inside else (repeat_heads(key, groups), repeat_heads(value, groups))
            output, probs = softmax_attention(_scores, query, keys, values, bias, mask,
                                              kv_groups=groups if grouped_inside else 1)
            return output, probs
        if rules is None:
            output, probs = run()
        else:
            with OperationRules(rules, B):
                output, probs = run()
        return output, probs, torch.autograd.grad((output * weights).sum(), (query, key, value, bias))

    inside, outside = attend(True), attend(False)
    assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])
    for got, expected in zip(inside[2], outside[2]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert all(g.abs().max() > 1e-6 for g in inside[2])

    def forward():
        if rules is None:
            softmax_attention(_scores, query, key, value, bias, mask, kv_groups=groups)
        else:
            with OperationRules(rules, B):
                softmax_attention(_scores, query, key, value, bias, mask, kv_groups=groups)

    kept = _saved_storages(forward)
    assert key.untyped_storage().data_ptr() in kept and value.untyped_storage().data_ptr() in kept
    assert B * H * K * D not in kept.values()  # no repeated keys or values
