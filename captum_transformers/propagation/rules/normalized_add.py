"""The normalised addition rule of Chefer et al. (CVPR 2021, Sec. 3.2) as an autograd Function;
the operation-rule mode (:mod:`.operation_rules`) puts it on ``u + v`` under ``add="normalized"``."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import CaptureError
from ..backward_switch import SWITCH
from ..backward_switch import plain_requested as _plain
from .linear import safe_divide
from .own_output import own_output, saved_tensors


class NormalizedAdd(torch.autograd.Function):
    r"""``u + v`` whose backward pass normalises relevance per example (Chefer et al., CVPR 2021,
    Sec. 3.2): with :math:`S_u = \sum R_u`, :math:`S_v = \sum R_v` and :math:`S = S_u + S_v`,

    .. math:: \bar R_u = R_u \frac{|S_u|}{|S_u| + |S_v|} \frac{S}{S_u}

    (and :math:`\bar R_v` alike), so both operands together keep the relevance of the sum and
    each keeps its share. In gradient x input form the gradient of each operand is scaled by its
    factor. ``batch_dim`` is the dimension of the examples (None: the whole tensor is one
    example); an operand shared by the batch (a (1, ...) position embedding) gets the sum over
    examples. ``groups`` (optional, one example index per position of ``batch_dim``) makes
    several positions one example: the nodes of a graph in a PyG batch's flat node list, so
    each graph's sums run over its own nodes, as if it were explained alone. Under a plain
    backward switch both operands get the plain gradient.

    Example::

        >>> out = NormalizedAdd.apply(u, v, 0, torch.add, (u, v), {})
        >>> out = NormalizedAdd.apply(h, skip, 0, torch.add, (h, skip), {}, graph_of_node)  # per graph
    """

    @staticmethod
    def forward(ctx, a, b, batch_dim, func, args, kwargs, groups=None):
        output = own_output(func(*args, **kwargs), args, kwargs)  # a model may update it in place
        # Kept: ``u`` and the sum, not ``v`` (recomputed as ``sum - u``): the next operation keeps the
        # sum anyway (a norm, the attention after RoPE), so a residual add holds no activation of
        # its own (TransformerRelevance at 2k tokens: 1.44x -> 1.27x the plain forward + backward).
        # An in-place change of the sum that the rule mode sees keeps ``v`` first (keep_sums_overwritten_by);
        # any other is refused in the backward pass (its version counter moved), never read.
        # (The same tensors are kept when checkpointing recomputes the add in the backward pass.)
        # In half precision ``sum - u`` would move ``v`` by half a unit of the sum (5e-4 relative in
        # float16), enough to flip a near-zero S_v's sign and the branch with it: ``v`` is kept.
        ctx.second, ctx.second_shape, ctx.sum = None, b.shape, None
        if output.dtype in (torch.float16, torch.bfloat16):
            ctx.save_for_backward(a, b)
        else:
            ctx.save_for_backward(a)
            ctx.sum = output.detach()
            ctx.sum_version = ctx.sum._version
        ctx.batch_dim = batch_dim
        ctx.groups = groups
        ctx.switch = SWITCH.get()
        return output

    @staticmethod
    def backward(ctx, grad):
        a, *kept = saved_tensors(ctx, "normalised add")
        if _plain(ctx):
            return grad.sum_to_size(a.shape), grad.sum_to_size(ctx.second_shape), None, None, None, None, None
        b = kept[0] if kept else ctx.second if ctx.second is not None else _second_operand(ctx, a)
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
            if ctx.groups is not None:  # one sum per group (graph), read back at each of its positions
                groups = ctx.groups.to(total.device)
                total = total.new_zeros(int(groups.max()) + 1).index_add_(0, groups, total)[groups]
            if batch_dim is not None:
                shape[batch_dim] = -1
            return total.reshape(shape)

        s_a, s_b = per_example(a), per_example(b)
        s = s_a + s_b
        share_a = safe_divide(s_a.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_a)
        share_b = safe_divide(s_b.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_b)
        # An operand shared by the batch (a (1, ...) position embedding) gets the sum over examples.
        g_a, g_b = (g * share_a).sum_to_size(a.shape), (g * share_b).sum_to_size(ctx.second_shape)
        return g_a.to(grad.dtype), g_b.to(grad.dtype), None, None, None, None, None


def keeps_its_sum(node) -> bool:
    """Whether the autograd ``node`` is a :class:`NormalizedAdd` that reads its kept sum (whose
    buffer must then not be reused in place)."""
    return getattr(type(node), "_forward_cls", None) is NormalizedAdd and node.sum is not None and node.second is None


def _second_operand(ctx, a: torch.Tensor) -> torch.Tensor:
    """``v = (u + v) - u`` from the kept sum, refused if the sum was changed in place since."""
    if ctx.sum._version != ctx.sum_version:
        raise CaptureError(
            "The normalised add rule reads the sum u + v of an add in the backward pass, but the model changed that "
            "sum in place afterwards by an operation the rule mode did not see, so v cannot be recovered. Use a rule "
            "set with plain adds (ConservativeLRP, AttnLRP) on this model, or report the model.")
    return ctx.sum - a


_IN_PLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ipow__",
                               "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"})


def keep_sums_overwritten_by(func, args: tuple, kwargs: dict) -> None:
    """Before an operation that writes into a tensor (``x += y``, ``x.mul_(y)``, ``x[i] = y``,
    ``out=x``, ``inplace=True``) runs: if that tensor (or the tensor it views) is the sum of a
    :class:`NormalizedAdd` not yet differentiated, keep that add's second operand now."""
    name = getattr(func, "__name__", "")
    targets = []
    if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS or kwargs.get("inplace") is True:
        targets.append(args[0] if args else None)
    targets.append(kwargs.get("out"))
    for target in targets:
        if not isinstance(target, torch.Tensor):
            continue
        for tensor in (target, target._base):
            node = None if tensor is None else tensor.grad_fn
            if node is not None and keeps_its_sum(node):
                a = node.saved_tensors[0]
                with torch.no_grad():
                    node.second = _second_operand(node, a.detach())


def row_groups(groups: torch.Tensor, tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The example of each row of an add's operand ``tensor``, given each batch row's example
    ``groups`` (a PyG batch: each node's graph): ``groups`` for a tensor of the batch's rows
    (nodes), None (a row per example) for a tensor of examples (pooled graphs); anything else
    (edges, nodes a pooling dropped) is refused."""
    examples = int(groups.max()) + 1 if groups.numel() else 0
    if tensor.dim() and tensor.shape[0] == groups.shape[0]:
        return groups
    if tensor.dim() and tensor.shape[0] == examples:
        return None
    raise CaptureError(
        f"The normalised add rule normalises per example, here the {examples} graphs of {groups.shape[0]} nodes, but "
        f"it reached an add of tensors of shape {tuple(tensor.shape)}, whose rows are neither nodes nor graphs (edges, "
        "or nodes a pooling dropped). Use a rule set with plain adds (ConservativeLRP, AttnLRP) on this model.")
