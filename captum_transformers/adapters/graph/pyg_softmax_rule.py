r"""The identity rule for the softmax of PyG's ``TransformerConv`` (Chefer et al.'s rule sets:
``RuleSet.LRP`` of TransformerLRP and PartialLRP).

The rule: the relevance of the attention weights goes to their scores unchanged,
``R(s_e) = R(alpha_e)``; in gradient x input form ``g_s = g_alpha * alpha / s``. For
``torch.softmax`` the operation rules install it by intercepting the call
(:mod:`~captum_transformers.propagation.rules.operations`). PyG's ``softmax(src, index)`` is a
Python function made of scatter operations (max, exp, scatter-sum, divide), which no
torch-function interception sees as one softmax. But ``TransformerConv.message`` hands its
inputs and its output to a message forward hook, and its scores are a plain function of them:

    s_e = <q_i, k_j> / sqrt(C)      alpha = softmax over each target's incoming edges of s
    m_e = v_j * alpha_e

So a hook (:func:`identity_softmax`, installed through
:func:`~captum_transformers.model_state.patching.message_passing_hook`, per context and removed
on exit) recomputes ``s`` from ``q_i, k_j`` (under the active operation rules: the product
``q_i * k_j`` gets the rule set's product rule, as the layer's own product does), joins it to
``alpha`` (the scatter softmax of ``s``, this call's own values) by :class:`IdentityRelevance` (forward: ``alpha`` itself; backward:
``g * alpha / s``; the plain softmax gradient when a pass asks for it) and returns
``m = v_j * alpha`` computed again from that. The layer's own ``alpha`` and ``m`` leave the
gradient path; the returned message is checked to be bit-identical to the layer's (else the
explanation is refused). The recomputed ``alpha`` is what the adapter then records as the
layer's map, so a gradient read at the maps (PartialLRP) reads it on the rule's path.

Refused (an error says why): a layer with edge features (``edge_dim``: the hook would have to
run ``lin_edge`` a second time), and GAT layers (their scores multiply node features by a
parameter vector; their product rule is refused anyway, see :mod:`.pyg_attention`).

Example::

    >>> relevance = TransformerLRP(model).attribute(x, additional_forward_args=(edge_index, batch), target=labels)
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from ...model_state import patching
from ...capture.trace import Block
from ...errors import CaptureError
from ...propagation.rules.operations import IdentityRelevance
from .pyg_transformer_alpha import TRANSFORMER_CONV, refuse_unless_layer_message, transformer_scores

# The alpha of each layer on the rule's gradient path, per forward, in this context.
_REROUTED: contextvars.ContextVar[Optional[Dict[int, torch.Tensor]]] = contextvars.ContextVar(
    "captum_transformers_pyg_identity_softmax", default=None)


def rerouted_alpha(module: nn.Module) -> Optional[torch.Tensor]:
    """The alpha of ``module``'s last call that carries the identity rule (None outside the rule)."""
    rerouted = _REROUTED.get()
    return None if rerouted is None else rerouted.get(id(module))


def refuse_identity_softmax(blocks: List[Block], layer_key, rule_name: str) -> None:
    """Refuse layers whose softmax the identity rule cannot reach (see the module docstring)."""
    others = [f"{b.name} ({type(b.module).__name__})" for b in blocks if layer_key(b.module) != TRANSFORMER_CONV]
    if others:
        raise CaptureError(
            f"The rule set {rule_name} passes relevance through the softmax by the identity rule, which is routed "
            f"to PyG's scatter softmax on TransformerConv layers only; {others} compute their scores otherwise. Use "
            "ConservativeLRP (AH, AH+LN) or the attention methods (GenericAttention, AttentionRollout, "
            "AttentionGradCAM, RawAttention) on this model."
        )
    with_edges = [b.name for b in blocks if getattr(b.module, "lin_edge", None) is not None]
    if with_edges:
        raise CaptureError(
            f"The rule set {rule_name} routes the identity softmax rule through the TransformerConv messages, but "
            f"{with_edges} take edge features (edge_dim), whose projection enters the scores inside the message; "
            "that case is not supported. Use ConservativeLRP (AH, AH+LN) or the attention methods on this model."
        )


@contextlib.contextmanager
def identity_softmax(blocks: List[Block]) -> Iterator[None]:
    """While entered (this context only), every TransformerConv of ``blocks`` passes relevance
    through its softmax by the identity rule (the module docstring); removed on exit."""
    from torch_geometric.utils import softmax as scatter_softmax

    rerouted: Dict[int, torch.Tensor] = {}
    token = _REROUTED.set(rerouted)
    try:
        with contextlib.ExitStack() as stack:
            for block in blocks:
                stack.enter_context(patching.message_passing_hook(block.module, "message",
                                                                  _message_hook(block, rerouted, scatter_softmax)))
            yield
    finally:
        _REROUTED.reset(token)


def _message_hook(block: Block, rerouted: Dict[int, torch.Tensor], scatter_softmax):
    module = block.module

    def hook(_module, inputs, out):
        kwargs = inputs[0]
        if not torch.is_grad_enabled():
            return None
        scores, _ = transformer_scores(module, kwargs)  # no edge term: edge_dim layers are refused above
        value = kwargs["value_j"]
        index, ptr, size = kwargs["index"], kwargs["ptr"], kwargs["size_i"]
        # This call's alpha from its own arguments, never the module's _alpha field, which a
        # forward of the same model in another thread may overwrite (see .pyg_transformer_alpha).
        alpha = scatter_softmax(scores.detach(), index, ptr, size)
        # Forward: the layer's alpha, bit for bit; backward: g * alpha / s (the plain softmax
        # gradient, recomputed from s, when a pass asks for the plain gradient).
        ruled = IdentityRelevance.apply(scores, [alpha.detach()],
                                        lambda s: scatter_softmax(s, index, ptr, size))
        message = value * ruled.view(-1, module.heads, 1)
        refuse_unless_layer_message(block, message, out, "so the identity softmax rule cannot be applied",
                                    "Call model.eval(), or use ConservativeLRP.")
        rerouted[id(module)] = ruled
        return message

    return hook
