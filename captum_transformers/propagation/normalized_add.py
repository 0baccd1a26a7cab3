"""The normalised addition rule of Chefer et al. (CVPR 2021, Sec. 3.2) as an autograd Function;
the operation-rule mode (:mod:`.operation_rules`) puts it on ``u + v`` under ``add="normalized"``."""
from __future__ import annotations

import torch

from .backward_switch import _SWITCH
from .backward_switch import plain_requested as _plain
from .linear_rule import safe_divide


class NormalizedAdd(torch.autograd.Function):
    r"""``u + v`` whose backward pass normalises relevance per example (Chefer et al., CVPR 2021,
    Sec. 3.2): with :math:`S_u = \sum R_u`, :math:`S_v = \sum R_v` and :math:`S = S_u + S_v`,

    .. math:: \bar R_u = R_u \frac{|S_u|}{|S_u| + |S_v|} \frac{S}{S_u}

    (and :math:`\bar R_v` alike), so both operands together keep the relevance of the sum and
    each keeps its share. In gradient x input form the gradient of each operand is scaled by its
    factor. ``batch_dim`` is the dimension of the examples (None: the whole tensor is one
    example); an operand shared by the batch (a (1, ...) position embedding) gets the sum over
    examples. Under a plain backward switch both operands get the plain gradient.

    Example::

        >>> out = NormalizedAdd.apply(u, v, 0, torch.add, (u, v), {})
    """

    @staticmethod
    def forward(ctx, a, b, batch_dim, func, args, kwargs):
        output = func(*args, **kwargs)
        ctx.save_for_backward(a, b)
        ctx.batch_dim = batch_dim
        ctx.switch = _SWITCH.get()
        return output

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        if _plain(ctx):
            return grad.sum_to_size(a.shape), grad.sum_to_size(b.shape), None, None, None, None
        dtype = torch.promote_types(grad.dtype, torch.float32)
        g = grad.to(dtype)
        batch_dim = ctx.batch_dim

        def per_example(operand):
            """``sum(operand * g)`` per example, shaped to broadcast against ``g``: one dot
            product per example, without materialising the relevance ``operand * g``."""
            operand = operand.to(dtype)
            shape = [1] * g.dim()
            if operand.shape != g.shape:  # a batch-shared operand: materialise the broadcast product
                product = operand * g
                total = product.movedim(batch_dim, 0).reshape(g.shape[batch_dim], -1).sum(1) \
                    if batch_dim is not None else product.sum().reshape(1)
            elif batch_dim is None:
                total = torch.dot(operand.reshape(-1), g.reshape(-1)).reshape(1)
            else:
                total = torch.linalg.vecdot(operand.movedim(batch_dim, 0).reshape(g.shape[batch_dim], -1),
                                            g.movedim(batch_dim, 0).reshape(g.shape[batch_dim], -1))
            if batch_dim is not None:
                shape[batch_dim] = -1
            return total.reshape(shape)

        s_a, s_b = per_example(a), per_example(b)
        s = s_a + s_b
        share_a = safe_divide(s_a.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_a)
        share_b = safe_divide(s_b.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_b)
        # An operand shared by the batch (a (1, ...) position embedding) gets the sum over examples.
        g_a, g_b = (g * share_a).sum_to_size(a.shape), (g * share_b).sum_to_size(b.shape)
        return g_a.to(grad.dtype), g_b.to(grad.dtype), None, None, None, None
