"""The normalised addition rule of Chefer et al. (CVPR 2021, Sec. 3.2) as an autograd Function;
the operation-rule mode (:mod:`.operation_rules`) puts it on ``u + v`` under ``add="normalized"``."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from ...errors import CaptureError
from ..backward_switch import SWITCH
from ..backward_switch import plain_requested as _plain
from .linear import safe_divide
from .own_output import in_place_targets, own_output, saved_tensors


class NormalizedAdd(torch.autograd.Function):
    r"""``u + v`` whose backward pass normalises relevance per example (Chefer et al., CVPR 2021,
    Sec. 3.2): with :math:`S_u = \sum R_u`, :math:`S_v = \sum R_v` and :math:`S = S_u + S_v`,

    .. math:: \bar R_u = R_u \frac{|S_u|}{|S_u| + |S_v|} \frac{S}{S_u}

    (and :math:`\bar R_v` alike), so both operands together keep the relevance of the sum and
    each keeps its share. In gradient x input form the gradient of each operand is scaled by its
    factor. ``batch_dim`` is the dimension of the examples (None: the whole tensor is one
    example); an operand shared by the batch (a (1, ...) position embedding) gets the sum over
    examples. ``groups`` (optional, one example index per position of ``batch_dim``) makes
    several positions one example: the nodes of a graph in a PyG batch's flat node list, or the
    rows of hidden states flattened to (batch * tokens, features) (:class:`ExampleRows`), so
    each example's sums run over its own rows, as if it were explained alone; ``examples``
    (optional) is the number of examples, which spares reading it from ``groups`` (a device
    synchronisation). Under a plain backward switch both operands get the plain gradient.

    Example::

        >>> out = NormalizedAdd.apply(u, v, 0, torch.add, (u, v), {})
        >>> out = NormalizedAdd.apply(h, skip, 0, torch.add, (h, skip), {}, graph_of_node)  # per graph
    """

    @staticmethod
    def forward(ctx, a, b, batch_dim, func, args, kwargs, groups=None, examples=None):
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
        ctx.groups, ctx.examples = groups, examples
        ctx.switch = SWITCH.get()
        return output

    @staticmethod
    def backward(ctx, grad):
        a, *kept = saved_tensors(ctx, "normalised add")
        if _plain(ctx):
            return grad.sum_to_size(a.shape), grad.sum_to_size(ctx.second_shape), None, None, None, None, None, None
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
                size = ctx.examples if ctx.examples is not None else int(groups.max()) + 1
                total = total.new_zeros(size).index_add_(0, groups, total)[groups]
            if batch_dim is not None:
                shape[batch_dim] = -1
            return total.reshape(shape)

        s_a, s_b = per_example(a), per_example(b)
        s = s_a + s_b
        share_a = safe_divide(s_a.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_a)
        share_b = safe_divide(s_b.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_b)
        # An operand shared by the batch (a (1, ...) position embedding) gets the sum over examples.
        g_a, g_b = (g * share_a).sum_to_size(a.shape), (g * share_b).sum_to_size(ctx.second_shape)
        return g_a.to(grad.dtype), g_b.to(grad.dtype), None, None, None, None, None, None

    @staticmethod
    def keep_before_overwrite(node) -> None:
        """The model is about to update the sum in place (:func:`.own_output.keep_outputs_overwritten_by`):
        where the backward pass would read ``v`` back from the kept sum, keep ``v`` now."""
        if keeps_its_sum(node):
            a = node.saved_tensors[0]
            with torch.no_grad():
                node.second = _second_operand(node, a.detach())


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


def keep_sums_overwritten_by(func, args: tuple, kwargs: dict) -> None:
    """Before an operation that writes into a tensor (``x += y``, ``x.mul_(y)``, ``x[i] = y``,
    ``out=x``, ``inplace=True``) runs: if that tensor (or the tensor it views) is the sum of a
    :class:`NormalizedAdd` not yet differentiated, keep that add's second operand now."""
    for tensor in in_place_targets(func, args, kwargs):
        if tensor.grad_fn is not None and keeps_its_sum(tensor.grad_fn):
            NormalizedAdd.keep_before_overwrite(tensor.grad_fn)


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


# Operations whose result is a reshape of their first operand (row-major order).
_RESHAPES = frozenset({"view", "reshape", "flatten", "view_as", "reshape_as", "unflatten"})
# Operations whose result has, along its first axis, the rows of their operands (elementwise
# arithmetic and activations, casts and copies, a linear layer on the last axis, row-wise
# norms, new tensors like an operand): a row keeps its example. Reordering or mixing
# operations (transpose, flip, roll, sort, cumsum, matmul with the rows on the right) are not
# here, and their results have no known example per row.
_ROW_WISE = frozenset({
    "add", "sub", "mul", "div", "true_divide", "neg", "where", "pow", "exp", "sqrt", "rsqrt", "square", "abs",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__neg__",
    "__pow__", "sigmoid", "tanh", "silu", "gelu", "relu", "mish", "softplus", "dropout", "to", "float", "double",
    "half", "bfloat16", "type", "type_as", "clone", "contiguous", "zeros_like", "ones_like", "empty_like",
    "full_like", "linear", "layer_norm", "rms_norm", "chunk", "split", "masked_fill", "clamp"})
_SELECTIONS = frozenset({"__getitem__", "index_select"})


class ExampleRows:
    """Which example each row of a forward's tensors belongs to, where a model flattens its
    hidden states (B, N, D) to (B * N, D) rows (OPT around its feed-forward block, every
    mixture-of-experts block before its routing): the normalised add rule then normalises each
    example over its own rows (:class:`NormalizedAdd`'s ``groups``), as if it were explained
    alone, where it otherwise finds no axis of the examples.

    Followed by behaviour, through the operations the rule mode sees (:meth:`observe`):

    * a reshape (``view``, ``reshape``, ``flatten``) whose first axis merges the batch axis of
      a (B, ...) tensor with the ones after it (R = B * M rows, R > B): in row-major order the
      rows of example e are e * M ... (e + 1) * M - 1. A (B, N, ...) tensor with N == B is left
      alone: its first axis could be the tokens' (a sequence-first layout), not the examples'.
    * row-wise operations (:data:`_ROW_WISE`: elementwise arithmetic, casts, linear layers on the
      last axis, ``zeros_like``...) keep the rows' examples; an in-place update (MoE's
      ``index_add_`` into ``zeros_like(hidden)``) keeps its target's.
    * a selection of rows by an index tensor (``hidden[token_idx]``, ``index_select``: an expert's
      tokens) keeps each selected row's example, so adds inside an expert are per example too.

    Any other operation leaves its result without examples: an add of such rows is refused as
    before (:func:`~captum_transformers.engine.runner.refuse_batch_mixing_adds`). Only followed
    for a batch of two or more examples (with one, every sum is over the one example).
    """

    def __init__(self, batch_size: Optional[int]):
        self.batch_size = batch_size
        self.active = batch_size is not None and batch_size > 1
        self._groups = WeakTensorKeyDictionary()  # tensor -> (groups (rows,), rows per example or None)
        self._blocks: dict = {}  # (rows per example, device) -> groups, shared by all tensors of that layout

    def groups_of(self, tensor: Any) -> Optional[torch.Tensor]:
        """The example of each row of ``tensor`` (a long tensor (rows,)), None where unknown."""
        if not isinstance(tensor, torch.Tensor):
            return None
        known = self._groups.get(tensor)
        return None if known is None else known[0]

    def add_groups(self, a: torch.Tensor, b: torch.Tensor) -> Optional[torch.Tensor]:
        """The example of each row of the add ``a + b`` (equal shapes), None where neither
        operand's rows are known or they disagree."""
        if not self.active or a.dim() == 0 or a.shape != b.shape:
            return None
        ga, gb = self.groups_of(a), self.groups_of(b)
        if ga is not None and gb is not None and ga is not gb and not torch.equal(ga, gb):
            return None
        return ga if ga is not None else gb

    def _blocks_of(self, per_example: int, device) -> torch.Tensor:
        key = (per_example, device)
        groups = self._blocks.get(key)
        if groups is None:
            groups = torch.arange(self.batch_size, device=device).repeat_interleave(per_example)
            self._blocks[key] = groups
        return groups

    def _tag(self, result: Any, groups: torch.Tensor, per_example: Optional[int]) -> None:
        if isinstance(result, torch.Tensor) and result.dim() and result.shape[0] == groups.shape[0]:
            self._groups[result] = (groups, per_example)

    def follow(self, source: Any, result: Any) -> None:
        """``result`` has the rows of ``source`` (a module applied row by row: an activation)."""
        known = self._groups.get(source) if self.active and isinstance(source, torch.Tensor) else None
        if known is not None:
            self._tag(result, *known)

    def observe(self, func, args: tuple, kwargs: dict, result: Any) -> None:
        """Record the examples of the rows of ``func(*args, **kwargs) = result``."""
        name = getattr(func, "__name__", "")
        if name in _RESHAPES:
            self._reshaped(args, result)
        elif not self._groups:
            return
        elif name in _ROW_WISE:
            if name == "where" and len(args) < 3:
                return  # where(condition): the indices of its true entries
            known = None
            for value in (*args, *kwargs.values()):
                found = self._groups.get(value) if isinstance(value, torch.Tensor) else None
                if found is not None:
                    if known is not None and found[0] is not known[0]:
                        return  # rows of two layouts: none is kept
                    known = found
            if known is not None:
                for item in result if isinstance(result, (tuple, list)) else (result,):
                    self._tag(item, *known)
        elif name in _SELECTIONS and args and isinstance(args[0], torch.Tensor):
            self._selected(name, args, kwargs, result)

    def _reshaped(self, args: tuple, result: Any) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not isinstance(result, torch.Tensor) or result.dim() == 0 \
                or result.numel() != x.numel() or x.dim() == 0:
            return
        batch, rows = self.batch_size, result.shape[0]
        known = self._groups.get(x)
        example_major = (known is not None and known[1] is not None) or (
            known is None and x.dim() >= 2 and x.shape[0] == batch and x.shape[1] != batch
            and not isinstance(x, nn.Parameter))
        if example_major and rows > batch and rows % batch == 0:
            self._tag(result, self._blocks_of(rows // batch, result.device), rows // batch)
        elif known is not None and rows == x.shape[0]:  # (R, H, d) -> (R, H * d): the same rows
            self._tag(result, *known)

    def _selected(self, name: str, args: tuple, kwargs: dict, result: Any) -> None:
        known = self._groups.get(args[0])
        if known is None:
            return
        index = args[1] if len(args) > 1 else None
        if name == "index_select":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
            if dim != 0:
                if isinstance(dim, int):
                    self._tag(result, *known)
                return
        elif isinstance(index, tuple) and index and isinstance(index[0], slice) and index[0] == slice(None):
            self._tag(result, *known)  # x[:, ...]: every row, in order
            return
        if isinstance(index, torch.Tensor) and index.dim() == 1 and (
                index.dtype == torch.long or index.dtype == torch.int32 or index.dtype == torch.bool):
            groups = known[0][index.to(known[0].device)]
            self._tag(result, groups, None)
