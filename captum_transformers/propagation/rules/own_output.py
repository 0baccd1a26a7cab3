"""A rule Function's output as a tensor of its own, so that a model may update it in place.

A rule Function's forward runs the operation itself (``F.linear``, ``einsum``, a slice of a
product), and many operations return a *view* of a temporary: ``F.linear`` with a bias on a 3-D
input returns its 2-D ``addmm`` result viewed back to 3-D, ``einsum`` a permuted product. autograd
marks a view returned by a custom Function as made inside it and refuses any in-place update of it
("Output 0 of LinearAlphaBeta is a view and is being modified inplace"), which models do: RoCBERT's
``embedding_in += token_type_embeddings`` after a linear layer, Funnel's ``positional_attn *=
cls_mask`` after an einsum, LongT5's ``scores += position_bias`` after a product.

Where nothing else can see that temporary, :func:`own_output` returns the same memory as a tensor
without a base (``detach``: no copy, the same version counter), which autograd treats as the
Function's own output: an update in place is then recorded on top of the rule, exactly as on the
out-of-place twin's output. A view of one of the operation's *operands* is returned as it is: an
update of it would change that operand too, which the rule cannot follow; the rule mode refuses it
by name (:data:`VIEW_UPDATE_REFUSAL`).

Example::

    >>> output = own_output(func(*args, **kwargs), args, kwargs)   # inside a rule Function's forward
"""
from __future__ import annotations

from typing import Any, Iterable, List

import torch

from ...errors import CaptureError

#: The RuntimeError autograd raises for an in-place update of a view made inside a custom Function.
VIEW_UPDATE_REFUSAL = "was created inside a custom Function"


def _views_an_operand(base: torch.Tensor, args: Iterable[Any], kwargs: dict) -> bool:
    """Whether ``base`` (the root of a view: a view of a view has its root as ``_base``) is one of
    the operands or the root they view."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            if _views_an_operand(base, value, {}):
                return True
        elif isinstance(value, torch.Tensor) and (value is base or value._base is base):
            return True
    return False


def own_output(output: Any, args: Iterable[Any] = (), kwargs: dict = None) -> Any:
    """``output`` itself where it is no view; a view of a temporary of the operation as the same
    memory without a base (``detach``: no copy, the same version counter, so an update of a tensor
    a rule saved is still seen); a view of one of the operands ``args`` / ``kwargs`` as it is."""
    base = output._base if isinstance(output, torch.Tensor) else None
    if base is None or _views_an_operand(base, args, kwargs or {}):
        return output
    return output.detach()


def saved_tensors(ctx, rule: str) -> tuple:
    """``ctx.saved_tensors`` of the rule Function ``rule``, or a :class:`CaptureError` naming the
    rule where the model updated one of them in place after the rule kept it (its input, or its
    output: the rule would read values the forward pass did not have)."""
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        raise CaptureError(
            f"The model changed a tensor in place after the {rule} rule kept it for the backward pass (its input "
            "or its output, e.g. with +=, *= or masked_fill_), so the rule would read values the forward pass did "
            "not have. Make that update out of place in the model, or explain it with rules that do not keep that "
            "tensor (plain gradients, or another rule set).") from None


_IN_PLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ipow__",
                               "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"})


def in_place_targets(func, args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """The tensors ``func(*args, **kwargs)`` writes into (``x += y``, ``x.mul_(y)``, ``x[i] = y``,
    ``out=x``, ``inplace=True``), each with the tensor it views (``_base``) where it is a view."""
    name = getattr(func, "__name__", "")
    candidates = []
    if (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS or kwargs.get("inplace") is True:
        candidates.append(args[0] if args else None)
    candidates.append(kwargs.get("out"))
    targets = []
    for target in candidates:
        if isinstance(target, torch.Tensor):
            targets.append(target)
            if target._base is not None:
                targets.append(target._base)
    return targets


def keep_outputs_overwritten_by(func, args: tuple, kwargs: dict) -> None:
    """Before an operation that writes into a tensor runs: if that tensor (or the tensor it
    views) is the output of a rule Function that reads it (or its sum) in the backward pass,
    let that Function keep what it needs now (its ``keep_before_overwrite(node)``), so that the
    update is followed exactly as on the out-of-place twin (``y = y * mask``), not refused.

    Example::

        >>> keep_outputs_overwritten_by(torch.Tensor.__imul__, (y, mask), {})  # XLM's tensor *= mask
    """
    for tensor in in_place_targets(func, args, kwargs):
        node = tensor.grad_fn
        keep = getattr(getattr(type(node), "_forward_cls", None), "keep_before_overwrite", None)
        if keep is not None:
            keep(node)
