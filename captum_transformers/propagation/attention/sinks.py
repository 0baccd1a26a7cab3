r"""Attention sinks: a learned logit per head appended to every row of the scores as an extra
softmax column, then dropped (GPT-OSS, DeepSeek-V4, MiMo-V2-Flash, HunYuan-V4, Flint, the OpenAI
privacy filter, Granite SWA pass it as ``s_aux``):

.. math:: A_{qk} = \frac{\exp(S_{qk} - m_q)}{\sum_{k'} \exp(S_{qk'} - m_q) + \exp(s_h - m_q)},
          \qquad m_q = \max(\max_k S_{qk}, s_h),

so each row of the map sums to ``1 - p_sink``, the share the sink absorbs (:func:`sink_share`),
and ``O = A V`` as usual (the sink's value is zero). :func:`sink_softmax` computes ``A`` as HF's
eager kernels do: the column concatenated, the row maximum subtracted, the softmax taken, the column
dropped.

The backward passes need nothing more. The sink's gradient is zero on every token (its column
receives no gradient from ``O``), so on the map's ``K`` columns the softmax Jacobian is
``g_S = A \odot (g_A - \sum_k A_k g_{A,k})`` with the sink-included ``A``, which is what
``torch._softmax_backward_data`` computes from ``A``; the identity rule's ``g_S = (A / S) g_A``
likewise. Under AttnLRP the sink column is an input of the softmax (its relevance ``s_h g_s``
stays with the sink: a parameter, no token) but not of the map. The sinks are held constant:
:func:`constant_sinks` refuses sinks computed from the input (per-query sinks, Inkling2), whose
gradient would reach the tokens.

Example::

    >>> probs = sink_softmax(scores, module.sinks, torch.float64)   # (B, H, Q, K), rows sum to 1 - p_sink
    >>> share = sink_share(probs)                                    # (B, H, Q)
"""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import UnsupportedModelError
from ...capture.row_chunks import softmax_in_place


def constant_sinks(sinks: Optional[torch.Tensor], heads: int, owner: str) -> Optional[torch.Tensor]:
    """``sinks`` as the constant (H,) logits the kernel applies (detached, no copy), or None for
    None; refused by name where they are not one logit per head of a constant tensor (``owner``:
    the attention module's class name, for the message)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise UnsupportedModelError(
            f"{owner} passes attention sinks of type {type(sinks).__name__} to its attention kernel; the "
            "captum_transformers kernel applies a floating-point tensor of one logit per head. This model is not "
            "supported by the HuggingFace adapter.")
    if sinks.grad_fn is not None or sinks.numel() != heads:
        made = " computed from its input" if sinks.grad_fn is not None else ""
        raise UnsupportedModelError(
            f"{owner} passes attention sinks of shape {tuple(sinks.shape)}{made} to its attention kernel; the captum_transformers kernel applies one constant logit per head "
            f"({heads} heads, as GPT-OSS's learned sinks), since per-query sinks made from the hidden states "
            "(Inkling2) would carry relevance and gradient to the tokens that it does not propagate. This model is "
            "not supported by the HuggingFace adapter.")
    return sinks.detach().reshape(heads)


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """The map ``A`` (B, H, Q, K) of scores ``S`` (B, H, Q, K) with the (H,) sink logits appended to
    each row as a softmax column and dropped, as HF's eager kernels compute it (see the module
    docstring), in ``dtype`` (None: the promoted type of scores and sinks). Contiguous; differentiable
    in ``scores`` (the row maximum is held constant: the softmax does not depend on it)."""
    column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, column], dim=-1)  # promoted as the eager kernels' cat promotes
    peak = combined.detach().amax(dim=-1, keepdim=True)
    if torch.is_grad_enabled() and combined.requires_grad:
        probs = torch.softmax(combined - peak, dim=-1, dtype=dtype)
    else:
        probs = softmax_in_place(combined.sub_(peak), dtype)
    return probs[..., :-1].contiguous()


def attention_softmax(scores_fn, scores: torch.Tensor, dtype: Optional[torch.dtype], in_place: bool = False
                      ) -> torch.Tensor:
    """``softmax(scores, dim=-1, dtype)`` for the scores function ``scores_fn``: with its sinks
    (``scores_fn.sinks``, (H,) logits, see :func:`sink_softmax`) where it carries some; otherwise in
    the scores' buffer where ``in_place`` (:func:`~captum_transformers.capture.row_chunks.softmax_in_place`)."""
    sinks = getattr(scores_fn, "sinks", None)
    if sinks is not None:
        return sink_softmax(scores, sinks, dtype)
    if in_place:
        return softmax_in_place(scores, dtype)
    return torch.softmax(scores, dim=-1, dtype=dtype)


def sink_share(probs: torch.Tensor) -> torch.Tensor:
    """Per row of an attention map (..., Q, K): ``1 - sum_k A_qk``, the probability mass the
    attention sink absorbed (0 for a model without sinks, up to rounding). A map whose rows were
    renormalised or cut to some keys does not give it.

    Example::

        >>> sink_share(trace.records[-1].probs)   # (B, H, Q)
    """
    return 1 - probs.sum(dim=-1, dtype=torch.promote_types(probs.dtype, torch.float32))
