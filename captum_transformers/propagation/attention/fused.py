r"""Rule sets that a fused attention kernel can carry, as gradient scalings of its operands.

A fused kernel (``F.scaled_dot_product_attention``) computes ``O = softmax(s Q K^T + M) V``
and differentiates it plainly, keeping only Q, K, V, O and the row statistics. Some LRP rule
sets change that backward pass only by constants per operand, so plain differentiation of the
fused kernel over operands whose gradient is scaled (identity forward) gives exactly the
rule's backward pass, with nothing of size (B, H, Q, K) kept:

* the AH rule (Ali et al., ICML 2022; ``attention_gate="constant"``): ``y = [A]_const V``.
  ``A`` is a function of Q and K only, so a constant gate is the same kernel over detached
  queries and keys: ``sdpa(Q.detach(), K.detach(), V)``. The softmax and product rules then
  never see a relevance-carrying map (``[A]_const`` times ``V`` has one such operand);
* AttnLRP (Achtibat et al., ICML 2024; ``matmul="uniform"``, ``softmax="gradient"``): the
  uniform rule halves both gradients of ``A V``, the softmax keeps its Jacobian (linear in
  the incoming gradient), and the uniform rule halves both gradients of ``Q K^T`` again:

  .. math:: g_V = \tfrac12\,A^\top g_O, \qquad
            g_Q = \tfrac12 \cdot \tfrac12\, s\, J_{\mathrm{softmax}}(g_O V^\top)\, K, \qquad
            g_K = \tfrac14\, s\, J_{\mathrm{softmax}}(g_O V^\top)^\top Q,

  i.e. the plain gradients scaled by 1/4, 1/4 and 1/2 (each half only where both operands of
  that product carry relevance, as the product's rule Function decides);
* plain gradients (``matmul="gradient"``, ``softmax="gradient"``): the kernel as it is.

The identity rule on the softmax (``softmax="identity"``, Chefer et al.) needs the scores
themselves and is not a scaling: :func:`fused_operands` answers None and the caller runs the
explicit attention of :mod:`attention_core`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the backward pass multiplies the gradient by a constant."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def scaled_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` unchanged, whose gradient is multiplied by ``factor`` (1: ``tensor`` itself).

    Example::

        >>> q = scaled_gradient(q, 0.25)   # the uniform rule twice on the way to the queries
    """
    if factor == 1.0 or not tensor.requires_grad:
        return tensor
    return _ScaledGradient.apply(tensor, factor)


def fusable(rules) -> bool:
    """Whether :func:`fused_operands` carries ``rules`` (a RuleSet, or None for plain gradients)."""
    return rules is None or rules.attention_gate == "constant" or rules.softmax == "gradient"


def fused_operands(rules, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, extras_carry: bool = False
                   ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float]]]:
    """``(query, key, value, extras_factor)`` such that plain differentiation of
    ``softmax(s Q K^T + M) V`` over them is the backward pass of ``rules`` (a
    :class:`~captum_transformers.propagation.rules.rule_set.RuleSet`, or None for plain gradients), or
    None when the rules are no scaling of the operands (the softmax identity rule).
    ``extras_carry``: something else added to the scores (a position bias) requires grad.

    ``extras_factor`` is what the gradient of anything else added to the scores (a position
    bias) must be multiplied by (:func:`scaled_gradient`); None when the map is a constant (the
    AH rule): the caller must detach it.

    Example::

        >>> q, k, v, _ = fused_operands(RuleSet.ATTN_LRP, q, k, v)
        >>> out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    if rules is None:
        return query, key, value, 1.0
    if rules.attention_gate == "constant":
        return query.detach(), key.detach(), value, None
    if rules.softmax != "gradient":
        return None
    if rules.matmul != "uniform":
        return query, key, value, 1.0
    # The product's uniform rule halves only where both of its operands carry relevance.
    map_carries = query.requires_grad or key.requires_grad or extras_carry
    output_half = 0.5 if (value.requires_grad and map_carries) else 1.0
    scores_half = 0.5 if (query.requires_grad and key.requires_grad) else 1.0
    return (scaled_gradient(query, output_half * scores_half), scaled_gradient(key, output_half * scores_half),
            scaled_gradient(value, output_half), output_half)
