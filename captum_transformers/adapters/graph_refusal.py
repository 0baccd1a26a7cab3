"""Graph models that no adapter explains yet, refused before any adapter can take them.

A PyG ``GPSConv`` holds an ``nn.MultiheadAttention`` over the nodes of a batch of graphs, so
the MRO lookup would hand the model to the ``torch_mha`` adapter, which treats node 0 as a
CLS token and the node-feature input as token ids: an explanation that looks valid and is
wrong (an all-zero map over the node features). Until graphs have their own adapter, any
model containing a torch_geometric attention layer is refused.

Classes are named by dotted key, so torch_geometric is never imported here.

Example::

    >>> graph_model_reason(nn.Sequential(GPSConv(16, GINConv(mlp), heads=2)))
    'GPSConv (torch_geometric.nn.conv.gps_conv.GPSConv) at 0'
"""
from __future__ import annotations

from typing import Optional

from torch import nn

# Attention over graph nodes: every adapter would misread the nodes as a token sequence.
_GRAPH_ATTENTION = (
    "torch_geometric.nn.conv.gps_conv.GPSConv",
    "torch_geometric.nn.conv.transformer_conv.TransformerConv",
    "torch_geometric.nn.conv.gat_conv.GATConv",
    "torch_geometric.nn.conv.gatv2_conv.GATv2Conv",
)
# A message-passing layer is refused only when it wraps an nn.MultiheadAttention.
_MESSAGE_PASSING = "torch_geometric.nn.conv.message_passing.MessagePassing"


def _keys(module: nn.Module):
    return {f"{base.__module__}.{base.__qualname__}" for base in type(module).__mro__}


def graph_model_reason(model: nn.Module) -> Optional[str]:
    """Which torch_geometric attention layer ``model`` contains (name and class), or None."""
    for name, module in model.named_modules():
        keys = _keys(module)
        known = next((key for key in _GRAPH_ATTENTION if key in keys), None)
        if known is None and _MESSAGE_PASSING in keys and any(
                isinstance(sub, nn.MultiheadAttention) for sub in module.modules()):
            known = _MESSAGE_PASSING
        if known is not None:
            return f"{type(module).__name__} ({known}) at {name or 'the top level'}"
    return None
