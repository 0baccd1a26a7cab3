"""Graph models that no built-in adapter explains, refused before any adapter can take them.

A PyG ``GPSConv`` holds an ``nn.MultiheadAttention`` over the nodes of a batch of graphs, so
the MRO lookup would hand the model to the ``torch_mha`` adapter, which treats node 0 as a
CLS token and the node-feature input as token ids: an explanation that looks valid and is
wrong (an all-zero map over the node features). Refused here:

* a message-passing layer wrapping an ``nn.MultiheadAttention`` (other than ``GPSConv``);
* linear attention (``SGFormerAttention``, ``PolynormerAttention``, ``PerformerAttention``):
  ``softmax(Q K^T)`` is never formed, so there is no attention map to read;
* the layers the ``pyg_attention`` adapter explains (``TransformerConv``, ``GATConv``,
  ``GATv2Conv``) and ``GPSConv`` (the ``pyg_gps`` adapter), when another built-in adapter is
  asked for.

Classes are named by dotted key, so torch_geometric is never imported here.

Example::

    >>> graph_model_reason(nn.Sequential(GPSConv(16, GINConv(mlp), heads=2)), "torch_mha")
    'GPSConv (torch_geometric.nn.conv.gps_conv.GPSConv) at 0: the nodes of a graph batch ...'
"""
from __future__ import annotations

from typing import Optional, Set

from torch import nn

#: GPSConv, explained by the pyg_gps adapter.
GPS = ("torch_geometric.nn.conv.gps_conv.GPSConv",)
_LINEAR_ATTENTION = (
    "torch_geometric.nn.attention.sgformer.SGFormerAttention",
    "torch_geometric.nn.attention.polynormer.PolynormerAttention",
    "torch_geometric.nn.attention.performer.PerformerAttention",
)
#: The layers the pyg_attention adapter explains.
PYG_ATTENTION = (
    "torch_geometric.nn.conv.transformer_conv.TransformerConv",
    "torch_geometric.nn.conv.gat_conv.GATConv",
    "torch_geometric.nn.conv.gatv2_conv.GATv2Conv",
)
# A message-passing layer is refused when it wraps an nn.MultiheadAttention.
MESSAGE_PASSING = "torch_geometric.nn.conv.message_passing.MessagePassing"

_WHY = {
    "hidden_mha": "an nn.MultiheadAttention inside a message-passing layer mixes nodes in a way no built-in adapter "
                  "knows (the built-in adapters would read the nodes as a token sequence, node 0 as a CLS token)",
    "linear": "it is linear attention: softmax(Q K^T) is never formed, so there is no attention map to read (use a "
              "gradient method such as Captum's IntegratedGradients on the node features)",
    "other_adapter": "the nodes of a graph batch are not a token sequence; explain it with the {} adapter "
                     "(the default for this layer) instead",
}


def class_keys(module: nn.Module) -> Set[str]:
    """The dotted names of ``module``'s class and its bases: matched against dotted keys, so that
    recognising a torch_geometric layer needs no import of torch_geometric."""
    return {f"{base.__module__}.{base.__qualname__}" for base in type(module).__mro__}


def graph_model_reason(model: nn.Module, adapter_name: Optional[str] = None) -> Optional[str]:
    """Why ``model`` cannot be explained by the built-in adapter ``adapter_name`` (None: the one
    the lookup chose), naming the graph layer (name, class and path), or None."""
    for name, module in model.named_modules():
        keys = class_keys(module)
        where = f"{type(module).__name__} ({{}}) at {name or 'the top level'}"
        known = next((key for key in _LINEAR_ATTENTION if key in keys), None)
        if known is not None:
            return f"{where.format(known)}: {_WHY['linear']}"
        known = next((key for key in GPS if key in keys), None)
        if known is not None:
            if adapter_name not in (None, "pyg_gps"):
                return f"{where.format(known)}: {_WHY['other_adapter'].format('pyg_gps')}"
            continue
        if MESSAGE_PASSING in keys and not keys & set(PYG_ATTENTION) and any(
                isinstance(sub, nn.MultiheadAttention) for sub in module.modules()):
            return f"{where.format(MESSAGE_PASSING)}: {_WHY['hidden_mha']}"
        known = next((key for key in PYG_ATTENTION if key in keys), None)
        if known is not None and adapter_name not in (None, "pyg_attention", "pyg_gps"):
            return f"{where.format(known)}: {_WHY['other_adapter'].format('pyg_attention')}"
    return None
