"""The normalised add rule keeps ``u`` and the sum ``u + v``, not ``v``.

Chefer et al.'s add rule (CVPR 2021, Sec. 3.2) needs both operands' per-example relevance sums.
The sum is usually kept by the next operation anyway (a norm; the attention after RoPE), so
keeping it instead of ``v`` frees one activation per residual add (TransformerRelevance on a
2k-token Llama: 1.44x -> 1.27x the peak of a plain forward + backward, benchmarks/long_context.py).
``v`` is recomputed as ``(u + v) - u``. A sum changed in place afterwards (VisualBERT's
``embeddings += position_embeddings``) gets ``v`` kept first when the rule mode sees the write;
a write it cannot see is refused, never read.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from captum_transformers.errors import CaptureError
from captum_transformers.propagation.rules.linear import safe_divide
from captum_transformers.propagation.rules.operations import OperationRules, paused_rule_mode
from captum_transformers.propagation.rules.rule_set import RuleSet

F64 = torch.float64
RULES = dataclasses.replace(RuleSet.GRADIENT, add="normalized")


class _KeptOperands(torch.autograd.Function):
    """The rule from its definition, keeping both operands: g_u = g |S_u| / (|S_u| + |S_v|) S / S_u."""

    @staticmethod
    def forward(ctx, u, v):
        ctx.save_for_backward(u, v)
        return u + v

    @staticmethod
    def backward(ctx, grad):
        u, v = ctx.saved_tensors
        s_u = (u.expand_as(grad) * grad).flatten(1).sum(1).view(-1, *[1] * (grad.dim() - 1))
        s_v = (v.expand_as(grad) * grad).flatten(1).sum(1).view(-1, *[1] * (grad.dim() - 1))
        total = s_u.abs() + s_v.abs()
        share_u = safe_divide(s_u.abs(), total) * safe_divide(s_u + s_v, s_u)
        share_v = safe_divide(s_v.abs(), total) * safe_divide(s_u + s_v, s_v)
        return (grad * share_u).sum_to_size(u.shape), (grad * share_v).sum_to_size(v.shape)


def _operands(shared_v=False):
    torch.manual_seed(0)
    u = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    v = torch.randn(1 if shared_v else 2, 3, 4, dtype=F64, requires_grad=True)  # (1, ...): a position embedding
    return u, v, torch.randn(2, 3, 4, dtype=F64)


WRITES = {
    "none": lambda s, w: s,
    "+=": lambda s, w: s.__iadd__(w),
    "mul_": lambda s, w: s.mul_(w),
    "setitem": lambda s, w: s.__setitem__((slice(None), 0), 0.5) or s,
    "view add_": lambda s, w: (s[:, 1].add_(w[:, 1]), s)[1],
}


@pytest.mark.parametrize("shared_v", [False, True])
@pytest.mark.parametrize("write", list(WRITES))
def test_the_kept_sum_gives_the_rule_with_both_operands(write, shared_v):
    u, v, w = _operands(shared_v)
    grads = []
    for rule in ("kept sum", "both operands"):
        with OperationRules(RULES, batch_size=2):
            s = u + v if rule == "kept sum" else _KeptOperands.apply(u, v)
            s = WRITES[write](s, w)
        out = (s * torch.linspace(-1, 2, 4, dtype=F64) + s ** 2).sum()
        grads.append(torch.autograd.grad(out, (u, v)))
    for found, expected in zip(*grads):
        torch.testing.assert_close(found, expected, rtol=0, atol=1e-12)
        assert found.abs().max() > 1e-3


def test_a_write_the_rule_mode_does_not_see_is_refused():
    u, v, w = _operands()
    with OperationRules(RULES, batch_size=2):
        s = u + v
        with paused_rule_mode():
            s.add_(w)  # unseen: v can no longer be recovered from the sum
        out = (s ** 2).sum()
    with pytest.raises(CaptureError, match="changed that sum in place"):
        torch.autograd.grad(out, (u, v))


def test_two_scalars_are_one_example():
    """An add of two 0-dim tensors (a loss-like sum inside a forward) used to raise IndexError."""
    u, v = torch.tensor(2.0, dtype=F64, requires_grad=True), torch.tensor(-0.5, dtype=F64, requires_grad=True)
    with OperationRules(RULES, batch_size=1):
        s = u + v
    g_u, g_v = torch.autograd.grad(3.0 * s, (u, v))
    s_u, s_v = 2.0 * 3.0, -0.5 * 3.0  # each operand's relevance sum
    total = 1.5 * 3.0
    assert g_u.item() == pytest.approx(3.0 * abs(s_u) / (abs(s_u) + abs(s_v)) * total / s_u)
    assert g_v.item() == pytest.approx(3.0 * abs(s_v) / (abs(s_u) + abs(s_v)) * total / s_v)


def test_half_precision_keeps_both_operands():
    """In float16, ``sum - u`` is off by half a unit of the sum: v itself is kept there."""
    u, v = torch.randn(2, 3, dtype=torch.float16, requires_grad=True), torch.randn(2, 3, dtype=torch.float16,
                                                                                   requires_grad=True)
    with OperationRules(RULES, batch_size=2):
        s = u + v
    assert len(s.grad_fn.saved_tensors) == 2 and s.grad_fn.sum is None
    with OperationRules(RULES, batch_size=2):
        s32 = u.float() + v.float()
    assert len(s32.grad_fn.saved_tensors) == 1 and s32.grad_fn.sum is not None
