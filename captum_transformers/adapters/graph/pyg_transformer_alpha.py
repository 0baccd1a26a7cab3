r"""``TransformerConv``'s attention weights as THIS thread's forward computed them.

``TransformerConv.message`` keeps its ``alpha`` in the instance field ``_alpha`` until its
forward returns. That field belongs to the module, not to a call: a plain inference call of
the same model in another thread overwrites it between this thread's message and the
``propagate`` hook that reads it, and the explanation would chain another graph's weights
(measured: RawAttention off by 0.12, ConservativeLRP by 3e-2, other runs failing with errors
naming the wrong cause). So the field is never read.

Instead a message forward hook (:func:`~captum_transformers.model_state.patching.message_passing_hook`,
called only in the explaining context) recomputes ``alpha`` from the message's own arguments,
which are this call's: ``s_e = <q_i, k_j + W_e e_ij> / sqrt(C)``, ``alpha = softmax`` over each
target's incoming edges (PyG's scatter softmax, the layer's own function), and returns the
message ``(v_j + W_e e_ij) * alpha`` built from it. The returned message is checked to be
the layer's (else refused): bit for bit on the CPU and under deterministic algorithms, within a
few units of rounding on CUDA, whose atomic scatter sums change order from call to call; the
forward goes on with the recomputed message, so it is the one the maps describe. The recomputed
``alpha`` is on the gradient path (the layer's own leaves it), so its gradient is the one the
methods read. It is kept per context (:data:`_ALPHA`) for the ``propagate`` hook of the same call.

Example::

    >>> with recomputed_alpha(blocks):           # TransformerConv blocks
    ...     model(x, edge_index, batch)            # propagate hooks read this_call_alpha(conv)
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Dict, FrozenSet, Iterator, List, Optional

import torch
from torch import nn

from ...model_state import patching
from ...capture.trace import Block
from ...errors import CaptureError
from .refusal import class_keys

TRANSFORMER_CONV = "torch_geometric.nn.conv.transformer_conv.TransformerConv"

# Per context: id(module) -> the alpha its last message computed in this context.
_ALPHA: contextvars.ContextVar[Optional[Dict[int, torch.Tensor]]] = contextvars.ContextVar(
    "captum_transformers_pyg_transformer_alpha", default=None)
# Per context: ids of the TransformerConv layers whose message is already hooked.
_HOOKED: contextvars.ContextVar[FrozenSet[int]] = contextvars.ContextVar(
    "captum_transformers_pyg_transformer_alpha_hooked", default=frozenset())


def is_transformer_conv(module: nn.Module) -> bool:
    return TRANSFORMER_CONV in class_keys(module)


def this_call_alpha(module: nn.Module) -> Optional[torch.Tensor]:
    """The alpha ``module``'s last message computed in this context (None outside)."""
    kept = _ALPHA.get()
    return None if kept is None else kept.get(id(module))


def transformer_scores(module: nn.Module, kwargs: dict):
    """``(scores (E, H), the edge term added to the values or None)`` of a TransformerConv
    message, from its arguments, as ``TransformerConv.message`` computes them."""
    query, key = kwargs["query_i"], kwargs["key_j"]
    edge = kwargs.get("edge_attr")
    if getattr(module, "lin_edge", None) is not None:
        if edge is None:
            raise CaptureError(f"{type(module).__name__} has edge_dim set but was called without edge_attr; pass "
                               "the edge features (one row per edge).")
        edge = module.lin_edge(edge).view(-1, module.heads, module.out_channels)
        key = key + edge
    return (query * key).sum(dim=-1) / math.sqrt(module.out_channels), edge


@contextlib.contextmanager
def recomputed_alpha(blocks: List[Block]) -> Iterator[None]:
    """While entered (this context only), each TransformerConv of ``blocks`` hands its alpha to
    :func:`this_call_alpha` from its message's own arguments (the module docstring)."""
    from torch_geometric.utils import softmax as scatter_softmax

    kept, token = _ALPHA.get(), None
    if kept is None:
        kept = {}
        token = _ALPHA.set(kept)
    # A layer already hooked by an enclosing context (capture, then propagation, of one
    # explanation) is not hooked again: one recomputation per call.
    hooked = _HOOKED.get()
    fresh = [b for b in blocks if is_transformer_conv(b.module) and id(b.module) not in hooked]
    hooked_token = _HOOKED.set(hooked | {id(b.module) for b in fresh})
    try:
        with contextlib.ExitStack() as stack:
            for block in fresh:
                stack.enter_context(patching.message_passing_hook(
                    block.module, "message", _message_hook(block, kept, scatter_softmax)))
            yield
    finally:
        _HOOKED.reset(hooked_token)
        if token is not None:
            _ALPHA.reset(token)


#: Units of rounding (the dtype's eps, relative to the largest value) a recomputed message may
#: differ by where exact equality is not required: a few, as a different summation order gives.
ROUNDING_UNITS = 8


def exact_message_required(tensor: torch.Tensor) -> bool:
    """Whether a recomputed message must equal the layer's bit for bit: on the CPU, and wherever
    deterministic algorithms are enabled. Elsewhere (CUDA) PyG's softmax sums each target's
    edges with an atomic ``scatter_add_``, in an order that changes from call to call, so the
    recomputed alpha may differ from the layer's by a rounding step for nodes with 3+ edges
    (measured on one H200, float32: every message of the motif model and of a 2,000-node graph
    with 40 edges into each node differed, by at most 2.5e-7 of the largest value, about 2
    units of rounding; with deterministic algorithms, none did)."""
    return tensor.device.type == "cpu" or torch.are_deterministic_algorithms_enabled()


def refuse_unless_layer_message(block: Block, message: torch.Tensor, out: torch.Tensor, consequence: str,
                                fix: str) -> None:
    """A message recomputed from the hook's arguments must be the layer's own: bit for bit where
    :func:`exact_message_required`, else within :data:`ROUNDING_UNITS` units of rounding of the
    dtype (relative to the values and to the largest one; the hook returns the recomputed
    message, so the forward stays consistent with the maps). Otherwise (a changed
    ``TransformerConv.message``, attention dropout in training mode) the explanation would
    describe another computation: ``CaptureError`` naming the largest difference."""
    if torch.equal(message, out):
        return
    if message.shape != out.shape or message.dtype != out.dtype:
        raise CaptureError(
            f"{block.name!r}: the TransformerConv message recomputed from its arguments has shape "
            f"{tuple(message.shape)} and dtype {message.dtype}, the layer's {tuple(out.shape)} and {out.dtype} (a "
            f"changed TransformerConv.message), {consequence}; refusing rather than explaining another computation. "
            f"{fix}")
    exact = exact_message_required(out) or not out.is_floating_point()
    scale = float(out.detach().abs().max()) if out.numel() else 0.0
    if not exact:
        eps = torch.finfo(out.dtype).eps
        tolerance = ROUNDING_UNITS * eps
        if torch.allclose(message, out, rtol=tolerance, atol=tolerance * scale):
            return
    difference = float((message.detach() - out.detach()).abs().max())
    relative = difference / scale if scale else float("inf")
    allowed = ("bit-for-bit equality is required on the CPU and under torch.use_deterministic_algorithms" if exact
               else f"{ROUNDING_UNITS} units of rounding of {out.dtype} "
                    f"({ROUNDING_UNITS * torch.finfo(out.dtype).eps:.1e} relative) are allowed on this device")
    raise CaptureError(
        f"{block.name!r}: the TransformerConv message recomputed from its arguments differs from the layer's by up to "
        f"{difference:.3g} ({relative:.2g} of the largest value, {scale:.3g}; {allowed}), {consequence}; refusing "
        "rather than explaining another computation. Likely causes: attention dropout in training mode, or a changed "
        "or patched TransformerConv.message (a difference of a few units of rounding off the CPU comes from the order "
        f"of PyG's atomic sums). {fix}")


def _message_hook(block: Block, kept: Dict[int, torch.Tensor], scatter_softmax):
    module = block.module

    def hook(_module, inputs, out):
        kwargs = inputs[0]
        scores, edge = transformer_scores(module, kwargs)
        alpha = scatter_softmax(scores, kwargs["index"], kwargs["ptr"], kwargs["size_i"])
        value = kwargs["value_j"] if edge is None else kwargs["value_j"] + edge
        message = value * alpha.view(-1, module.heads, 1)
        refuse_unless_layer_message(block, message, out, "so its attention weights cannot be read",
                                    "Call model.eval().")
        kept[id(module)] = alpha
        return message

    return hook
