"""Softmax attention that keeps the probabilities but not the scores for the backward pass.

The softmax identity rule of Chefer et al. (CVPR 2021) needs the softmax input; keeping it
costs one (B, H, Q, K) tensor per layer. Here the backward pass recomputes the scores from
the tensors they were made of (Q and K), under the rules that were active in the forward.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .backward_switch import _SWITCH
from .operation_rules import _ACTIVE_RULES, OperationRules, identity_ratio


class _SoftmaxOfRecomputedScores(torch.autograd.Function):
    """``softmax(scores(*tensors))`` keeping only ``tensors`` and the probabilities: the
    backward recomputes the scores (bit-identical: the same operations on the same inputs)
    under the rules and backward switch that were active in the forward, and differentiates
    them with the softmax's gradient from the kept probabilities: the identity rule's
    ``g_S = (A / S) g_A``, or the plain softmax Jacobian when the switch says so."""

    @staticmethod
    def forward(ctx, scores_fn, dim, dtype, mode, switch, *tensors):
        probs = torch.softmax(scores_fn(*tensors), dim=dim, dtype=dtype)
        ctx.scores_fn, ctx.dim, ctx.mode, ctx.switch = scores_fn, dim, mode, switch
        ctx.save_for_backward(probs, *tensors)
        return probs

    @staticmethod
    def backward(ctx, grad):
        probs, *tensors = ctx.saved_tensors
        plain = ctx.switch is not None and ctx.switch.plain
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            if plain:  # the plain gradient needs no rules
                scores = ctx.scores_fn(*leaves)
            else:
                token = _SWITCH.set(ctx.switch)
                try:
                    with OperationRules(ctx.mode.rules, ctx.mode.batch_size):
                        scores = ctx.scores_fn(*leaves)
                finally:
                    _SWITCH.reset(token)
            # The scores' values are not needed once their gradient is known (the operations
            # that make them, a product, a scaling and a mask, keep no output), so their buffer
            # takes the gradient: one (B, H, Q, K) buffer less at the peak.
            buffer, probs = scores.detach(), probs.detach()
            same_dtype = scores.dtype == probs.dtype == grad.dtype
            if plain or ctx.mode.rules.softmax != "identity":
                # What autograd computes for softmax(S, dtype=...): the Jacobian in the output's
                # dtype, then the cast back to the scores' dtype.
                g_scores = torch._softmax_backward_data(grad.to(probs.dtype), probs, ctx.dim, probs.dtype)
                if same_dtype:
                    g_scores = buffer.copy_(g_scores)
            elif same_dtype:  # the identity rule, as _IdentityRule computes it, in place
                g_scores = torch.div(probs, buffer, out=buffer).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
                g_scores.mul_(grad)
            else:
                g_scores = identity_ratio(probs, buffer).to(grad.dtype).mul_(grad)
            del buffer
            wanted = [leaf for leaf in leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(scores, wanted, g_scores.to(scores.dtype), allow_unused=True))
        return (None, None, None, None, None, *[next(grads) if leaf.requires_grad else None for leaf in leaves])


def softmax_of_recomputed_scores(scores_fn: Callable[..., torch.Tensor], *tensors: torch.Tensor, dim: int = -1,
                                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.softmax(scores_fn(*tensors), dim, dtype)``, keeping for the backward pass only
    ``tensors`` and the probabilities (which ``A V`` keeps anyway), not the scores.

    The softmax identity rule (Chefer et al. 2021) needs the softmax input ``S = Q K^T * scale
    (+ mask)``: one (B, H, Q, K) tensor per layer. Its backward recomputes ``S`` from ``Q`` and
    ``K`` (kept anyway by the product rule and the projections) under the same per-operation
    rules. Outside :func:`operation_rules` (or without gradients) it is just the softmax.
    Example::

        >>> probs = softmax_of_recomputed_scores(lambda q, k: q @ k.mT * scale, q, k, dim=-1)
    """
    mode = _ACTIVE_RULES.get()
    if mode is None or not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return torch.softmax(scores_fn(*tensors), dim=dim, dtype=dtype)
    return _SoftmaxOfRecomputedScores.apply(scores_fn, dim, dtype, mode, _SWITCH.get(), *tensors)
