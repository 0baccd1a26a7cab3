"""Rules on linear layers as autograd Functions whose forward is the layer's own and whose
backward is the rule: alpha=1, beta=0 (Chefer et al., CVPR 2021, Eq. 4-5) and LRP-gamma
(Montavon et al. 2019, as Ali et al.'s code applies it).

In gradient x input form: the backward receives ``g_out`` with ``R_out = y * g_out`` and
returns ``g_in`` with ``R_in = x * g_in``. The backward works through chunks of rows, so its
temporaries do not grow with the batch.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from ..backward_switch import SWITCH
from ..backward_switch import plain_requested as _plain
from .own_output import own_output, saved_tensors

_TINY = 1e-9


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor, tiny: float = _TINY,
                in_place: bool = False) -> torch.Tensor:
    """``a / (b + eps * sign(b))``, and 0 where ``b == 0`` (sign-aware stabiliser, ``eps = tiny``).

    ``in_place=True`` overwrites ``numerator`` with the result and ``denominator`` with the
    shifted denominator (both must be owned, same shape and dtype): it runs on every linear
    layer's output in the backward pass, where fresh buffers are costly. Example:
    ``safe_divide(torch.tensor([1., 1.]), torch.tensor([2., 0.]))`` is ``[0.5, 0.]``.
    """
    stabiliser = torch.tensor(tiny, dtype=denominator.dtype, device=denominator.device)
    nonzero = denominator != 0
    if in_place:
        shifted = denominator.add_(torch.copysign(stabiliser, denominator))
        return numerator.div_(shifted).mul_(nonzero)
    return (numerator / (denominator + torch.copysign(stabiliser, denominator))).mul_(nonzero)


def _layer_output_kept(ctx, x, weight, bias, func, args, kwargs) -> torch.Tensor:
    """The layer's own output; its input, weight and bias kept for a rule's backward, with the
    backward switch active now (the plain gradient on request). The output is not kept: the
    rule recomputes it chunk by chunk (:func:`_row_chunks`), one product more per layer instead
    of one more activation per linear layer held through the backward pass. The output is a tensor
    of its own (:func:`~.own_output.own_output`: ``F.linear`` with a bias returns a view of its 2-D
    product), which a model may update in place."""
    output = own_output(func(*args, **kwargs), args, kwargs)
    ctx.save_for_backward(x, weight, bias)
    ctx.switch = SWITCH.get()
    # A bias computed from the input (``addmm(M, x, W)`` with an activation ``M``) carries relevance
    # the rules do not split: it gets the plain gradient, so no path through it is cut.
    ctx.bias_carries = bias is not None and bias.requires_grad and bias.grad_fn is not None
    return output


def _bias_gradient(ctx, grad: torch.Tensor):
    """The plain gradient of a relevance-carrying bias (see :func:`_layer_output_kept`), else None."""
    if not ctx.bias_carries:
        return None
    bias = saved_tensors(ctx, "linear")[2]
    return grad.sum_to_size(bias.shape).to(bias.dtype)


class LinearAlphaBeta(torch.autograd.Function):
    """alpha=1, beta=0 on a linear layer. ``shared=True``: Eq. 5, one denominator
    ``z+ = W+ x+ + W- x-``; ``shared=False``: the authors' LRP baseline, Eq. 4 applied to the
    (x+, W+) and (x-, W-) pairs separately (not conservative: each pair gets all of R).

    Eq. 5 costs three matmuls, not four, through ``x+ W+ + x- W- = (x W + |x| |W|) / 2`` (with
    ``x W`` = output - bias, already known) and ``where(x >= 0, s W+, s W-) =
    (s W + sign(x) s |W|) / 2``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, shared, func, args, kwargs):
        ctx.shared = shared
        return _layer_output_kept(ctx, x, weight, bias, func, args, kwargs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = saved_tensors(ctx, "linear alpha-beta")
        if _plain(ctx):
            return grad @ weight.to(grad.dtype), None, _bias_gradient(ctx, grad), None, None, None, None
        in_dtype = x.dtype
        dtype = torch.promote_types(x.dtype, torch.float32)
        weight = weight.to(dtype)
        if ctx.shared:
            rule, weights = _alpha_beta_shared, (weight, weight.abs())
        else:
            rule, weights = _alpha_beta_separate, (weight.clamp(min=0), weight.clamp(max=0))
        bias = None if bias is None else bias.to(dtype)
        g_x = _row_chunks(rule, weights, x, bias, weight, bias, grad, dtype)
        return g_x.to(in_dtype), None, _bias_gradient(ctx, grad), None, None, None, None


def linear_rule(rules, x: torch.Tensor, weight: torch.Tensor, bias, func: Callable, args: tuple,
                kwargs: dict) -> torch.Tensor:
    """The output of the linear layer ``func(*args, **kwargs)`` (input ``x``, ``(out, in)`` weight,
    bias or None), carrying ``rules.linear`` (alpha=1/beta=0, ``"gamma"`` or
    ``"generalized_gamma"``) in its backward; the forward is ``func``'s own."""
    if rules.linear in ("gamma", "generalized_gamma"):
        return LinearGamma.apply(x, weight, bias, rules.gamma, func, args, kwargs, rules.linear == "generalized_gamma")
    return LinearAlphaBeta.apply(x, weight, bias, rules.linear == "alpha1beta0", func, args, kwargs)


# Rows per chunk of a linear rule's backward: its temporaries (a few (rows, features)
# buffers) stay near this many elements instead of growing with the batch.
_CHUNK_ELEMENTS = 1 << 20


def _bias_rows(bias, shape: tuple):
    """A bias with one row per example (``addmm(M, x, W)``) as (rows, out), to be chunked with the
    rows; a bias vector (or None) as it is."""
    if bias is not None and bias.dim() > 1:
        return bias.expand(shape).reshape(-1, shape[-1])
    return bias


def _chunk_of(bias, rows: slice):
    return bias[rows] if bias is not None and bias.dim() > 1 else bias


def _row_chunks(rule: Callable, weights: tuple, x, bias, weight, layer_bias, grad, dtype: torch.dtype) -> torch.Tensor:
    """``rule(x, weights, bias, output, grad)`` applied to chunks of rows (every leading
    dimension flattened) of a linear layer's input and output gradient, cast to ``dtype`` chunk
    by chunk and written into one gradient buffer (in ``x``'s dtype): the rules act on each row
    alone, so chunking bounds their temporaries without changing them. The layer's output
    ``y = x W^T + b`` is recomputed per chunk in ``dtype`` from ``weight`` (out, in) and
    ``layer_bias`` (``bias`` is the rule's own, LRP-gamma's ``b + gamma b+``). ``weights``
    (derived from the weight once) are shared by every chunk."""
    features_out, features_in = weights[0].shape
    rows_x, rows_grad = x.reshape(-1, features_in), grad.reshape(-1, features_out)
    shape = (*x.shape[:-1], features_out)
    bias = _bias_rows(bias, shape)
    layer_bias = _bias_rows(None if layer_bias is None else layer_bias.to(dtype), shape)

    def output_of(rows_in: torch.Tensor, rows: slice) -> torch.Tensor:
        output, added = F.linear(rows_in, weight), _chunk_of(layer_bias, rows)
        return output if added is None else output.add_(added)

    step = max(1, _CHUNK_ELEMENTS // max(features_in, features_out))
    if rows_x.shape[0] <= step:  # one chunk: no gradient buffer to copy it into
        rows_in = rows_x.to(dtype)
        return rule(rows_in, weights, bias, output_of(rows_in, slice(None)), rows_grad.to(dtype)).view(x.shape)
    g_x = torch.empty_like(rows_x)
    for start in range(0, rows_x.shape[0], step):
        rows = slice(start, start + step)
        rows_in = rows_x[rows].to(dtype)
        # The rule writes its last product into the gradient buffer where the dtypes allow.
        out = g_x[rows] if g_x.dtype == dtype else None
        chunk = rule(rows_in, weights, _chunk_of(bias, rows), output_of(rows_in, rows), rows_grad[rows].to(dtype),
                     out=out)
        if chunk is not out:
            g_x[rows] = chunk
    return g_x.view(x.shape)


def _alpha_beta_shared(x, weights, bias, output, grad, out=None) -> torch.Tensor:
    """Eq. 5 of Chefer et al. in three matmuls (see :class:`LinearAlphaBeta`);
    ``weights = (W, |W|)``; the result is written into ``out`` when given."""
    weight, magnitude = weights
    relevance = output * grad
    # 2 z+ = 2 (x+ W+ + x- W-) = x W + |x| |W|, with x W = output - bias already known.
    twice_z_pos = F.linear(x.abs(), magnitude).add_(output)
    if bias is not None:
        twice_z_pos.sub_(bias)
    # s / 2 (scaling by 2 is exact), so that g_x = where(x >= 0, s W+, s W-)
    # = s/2 W + sign(x) s/2 |W| (sign(0) = 0 is harmless: x = 0 carries no relevance).
    # Not torch.where: on CPU it is several times slower than sign and multiply-add.
    half_s = safe_divide(relevance, twice_z_pos, 2 * _TINY, in_place=True)
    signed = (half_s @ magnitude).mul_(x.sign())
    return torch.matmul(half_s, weight, out=out).add_(signed)


def _alpha_beta_separate(x, weights, bias, output, grad, out=None) -> torch.Tensor:
    """Eq. 4 applied to the (x+, W+) and (x-, W-) pairs separately (the authors' LRP baseline);
    ``weights = (W+, W-)``."""
    w_pos, w_neg = weights
    relevance = output * grad
    s_pos = safe_divide(relevance, F.linear(x.clamp(min=0), w_pos))
    s_neg = safe_divide(relevance, F.linear(x.clamp(max=0), w_neg))
    return torch.where(x >= 0, s_pos @ w_pos, s_neg @ w_neg)


class LinearGamma(torch.autograd.Function):
    """LRP-gamma on ``y = W x + b`` (Montavon et al., "Layer-Wise Relevance Propagation: An
    Overview", 2019; the ``gamma`` layers of Ali et al.'s code, ``make_p_layer``):

    .. math:: z_{ij} = x_j (w_{ij} + \\gamma w_{ij}^+), \\quad
              z_i = \\sum_j z_{ij} + b_i + \\gamma b_i^+, \\quad R_j = \\sum_i \\frac{z_{ij}}{z_i} R_i

    In gradient x input form ``g_x = W_gamma^T (R_y / z)``, ``R_y = y * g_y``, with the
    sign-aware stabiliser of :func:`safe_divide` (``z_i = 0`` passes nothing). What is conserved,
    exactly: ``sum_j R_j = sum_i R_i (z_i - b_i - gamma b_i^+) / (z_i + 1e-9 sign(z_i))``;
    without biases, ``sum_j R_j = sum_i R_i`` up to that stabiliser. ``gamma = 0`` is LRP-0
    (the plain gradient for a bias-free layer, up to the stabiliser).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, func, args, kwargs, generalized=False):
        ctx.gamma, ctx.generalized = gamma, generalized
        return _layer_output_kept(ctx, x, weight, bias, func, args, kwargs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = saved_tensors(ctx, "linear gamma")
        if _plain(ctx):
            return grad @ weight.to(grad.dtype), None, _bias_gradient(ctx, grad), None, None, None, None, None
        dtype = torch.promote_types(x.dtype, torch.float32)
        weight = weight.to(dtype)
        gamma = ctx.gamma
        w_up, w_down = weight + gamma * weight.clamp(min=0), weight + gamma * weight.clamp(max=0)
        if bias is not None:
            bias = bias.to(dtype)
        if ctx.generalized:
            rule = functools.partial(_generalized_gamma, gamma=gamma)
            g_x = _row_chunks(rule, (w_up, w_down), x, bias, weight, bias, grad, dtype)
        else:
            b_gamma = None if bias is None else bias + gamma * bias.clamp(min=0)
            g_x = _row_chunks(_gamma, (w_up,), x, b_gamma, weight, bias, grad, dtype)
        return g_x.to(x.dtype), None, _bias_gradient(ctx, grad), None, None, None, None, None


def _gamma(x, weights, bias, output, grad, out=None) -> torch.Tensor:
    """``W_gamma^T (R / z_gamma)`` for rows of a linear layer; ``weights = (W_gamma,)``,
    ``bias`` = ``b + gamma b+`` (or None); written into ``out`` when given."""
    (w_gamma,) = weights
    z_gamma = x @ w_gamma.t()
    if bias is not None:
        z_gamma.add_(bias)
    s = safe_divide(output * grad, z_gamma, _TINY, in_place=True)  # _TINY read now: tests can vary it
    return torch.matmul(s, w_gamma, out=out)


def _generalized_gamma(x, weights, bias, output, grad, gamma: float, out=None) -> torch.Tensor:
    """The generalised gamma rule (Andeol et al. 2021, as zennit's ``Gamma``): contributions
    of the output's sign are amplified. ``weights = (W + gamma W+, W + gamma W-)``, the biases
    likewise. For ``z_i > 0``: ``D_i = x+ W_up + x- W_down + b_up``, for ``z_i < 0``:
    ``D_i = x+ W_down + x- W_up + b_down`` (``|D_i| >= |z_i|``: no sign change)."""
    w_up, w_down = weights
    positive_x, negative_x = x.clamp(min=0), x.clamp(max=0)
    relevance = output * grad
    positive_z, negative_z = (output > 0).to(x.dtype), (output < 0).to(x.dtype)
    d_pos = positive_x @ w_up.t() + negative_x @ w_down.t()
    d_neg = positive_x @ w_down.t() + negative_x @ w_up.t()
    if bias is not None:
        d_pos, d_neg = d_pos + (bias + gamma * bias.clamp(min=0)), d_neg + (bias + gamma * bias.clamp(max=0))
    s_pos = safe_divide(relevance * positive_z, d_pos, _TINY)
    s_neg = safe_divide(relevance * negative_z, d_neg, _TINY)
    through_up, through_down = s_pos @ w_up + s_neg @ w_down, s_pos @ w_down + s_neg @ w_up
    return torch.where(x > 0, through_up, through_down)
