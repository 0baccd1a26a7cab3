r"""The rule-carrying backward pass of :mod:`.attention_core`'s attention, a few query rows at a time.

TransformerRelevance (Chefer et al., CVPR 2021) differentiates one graph twice: first under the
LRP rules (its relevance at each map, ``R_A = A \odot g^{LRP}_A``), then plainly (``\nabla A``),
and fuses ``E_h[(\nabla A \odot R_A)^+]`` once both are known. Where the map is streamed into the
explained rows (:mod:`~captum_transformers.capture.row_stream`, ``paired=True``), the first
pass keeps only ``g_O`` (as it does for whole maps) and runs here, chunk by chunk: for each chunk
``c`` of query rows, the scores ``S_c`` are recomputed under the rules of the forward, then

.. math:: g_{A_c} = \tfrac12\, g_{O_c} V^\top, \quad g_V \mathrel{+}= \tfrac12 A_c^\top g_{O_c}, \quad
          g_{S_c} = \frac{A_c}{S_c}\, g_{A_c} \ (\text{identity rule}),

and ``(g_{Q_c}, g_K^{(c)})`` by autograd through the recomputed scores (``g_K = \sum_c g_K^{(c)}``;
the halving is the uniform product rule, applied where both operands carry relevance). Every rule
acts on one score at a time, so the chunks' gradients are the rows of the whole map's. No
(B, H, Q, K) tensor is made; the second (plain) pass hands both passes' gradients per chunk.

Example::

    >>> # inside _SoftmaxAttention.backward, for the deferring pass of a streamed pair:
    >>> grads = rules_backward_in_row_chunks(ctx, g_output, None, query, key, value, extras)
"""
from __future__ import annotations

import torch

from ...capture.row_chunks import row_chunks, rows_of
from .chunk_products import halves_map_gradient, map_gradient
from .recomputed_softmax import owns_buffer, recompute_under_rules, scores_gradient
from .sinks import attention_softmax


def rules_backward_in_row_chunks(ctx, g_output, g_probs_outside, query, key, value, extras):
    """The backward pass of ``O = softmax(S(Q, K)) V`` under the forward's rules, chunk by chunk
    of query rows; keeps ``g_O`` for the pass that pairs with it (``ctx.first_pass``). Extras
    (masks) must not require gradients. Returns the autograd Function's gradients."""
    if g_output is None:
        g_output = torch.zeros((*query.shape[:-1], value.shape[-1]), dtype=value.dtype, device=value.device)
    num_queries = query.shape[-2]
    halved = halves_map_gradient(ctx)
    identity = ctx.mode.rules.softmax == "identity"
    g_query = torch.zeros_like(query) if query.requires_grad else None
    g_key = torch.zeros_like(key) if key.requires_grad else None
    g_value = torch.zeros_like(value)
    for rows, q_rows, keys, values, extras_rows, stop in row_chunks(ctx.scores_fn, query, key, value, extras):
        leaves = [q_rows.detach().requires_grad_(query.requires_grad), keys.detach().requires_grad_(key.requires_grad),
                  *[e.detach() for e in extras_rows]]
        scores = recompute_under_rules(ctx.scores_fn, leaves, ctx.mode, ctx.switch)
        soft = attention_softmax(ctx.scores_fn, scores.detach(), ctx.softmax_dtype)
        probs = soft.to(query.dtype)
        g_rows = g_output[..., rows, :]
        outside = None if g_probs_outside is None else rows_of(g_probs_outside, rows, num_queries)[..., :stop]
        g_probs = map_gradient(values, g_rows, outside, halved)
        part = torch.matmul(probs.transpose(-1, -2), g_rows)
        g_value[..., :stop, :].add_(part.mul_(0.5) if halved else part)
        g_scores = scores_gradient(soft, scores.detach(), g_probs.to(soft.dtype), -1, identity=identity,
                                   owned=owns_buffer(scores))
        del soft, probs, g_probs, part
        wanted = [leaf for leaf in leaves[:2] if leaf.requires_grad]
        grads = iter(torch.autograd.grad(scores, wanted, g_scores.to(scores.dtype), allow_unused=True)
                     if wanted else ())
        del scores, g_scores
        for leaf, target, where in ((leaves[0], g_query, rows), (leaves[1], g_key, slice(0, stop))):
            if not leaf.requires_grad:
                continue
            grad = next(grads)
            if grad is not None:
                target[..., where, :].add_(grad)
    ctx.first_pass = (g_output, g_probs_outside)
    ctx.observer.defer()
    g_value = g_value.sum_to_size(value.shape) if value.requires_grad else None
    return (None, None, None, None, None, None, g_query, g_key, g_value, *[None for _ in extras])
