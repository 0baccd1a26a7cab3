"""What a PyG attention layer call records while a model is explained.

The supported layers (``TransformerConv``, ``GATConv``, ``GATv2Conv``: :func:`layer_key` and
where each keeps ``alpha``), the graphs of the batch being explained and the nodes surviving
its pools (context variables the adapter's forward sets: :func:`current_graphs`,
:func:`surviving_nodes`), and the two hooks each layer gets during a capture: the pre-hook
tapping its node features (:func:`tapped_input`) and the ``propagate`` hook recording
``alpha`` as per-graph maps (:func:`recording`). Shared by :mod:`.pyg_attention` and
:mod:`.pyg_gps`; the hooks are registered through :mod:`..capture.patching`, never here.
"""
from __future__ import annotations

import contextvars
from typing import Optional

import torch
from torch import nn

from ...capture.recorder import Recorder
from ...capture.trace import Block
from ...errors import CaptureError
from .nodes import GraphBatch
from .pooling import SurvivingNodes
from .pyg_softmax_rule import rerouted_alpha
from .pyg_transformer_alpha import this_call_alpha

# Layer class (dotted key) -> where alpha is found after propagate: recomputed from this call's
# message (never the module's _alpha field, which another thread's forward may overwrite), or
# a propagate kwarg.
_LAYERS = {
    "torch_geometric.nn.conv.transformer_conv.TransformerConv": ("message", None),
    "torch_geometric.nn.conv.gat_conv.GATConv": ("kwarg", "alpha"),
    "torch_geometric.nn.conv.gatv2_conv.GATv2Conv": ("kwarg", "alpha"),
}

# The graphs of the batch being explained, set around each forward in this context.
GRAPHS: contextvars.ContextVar[Optional[GraphBatch]] = contextvars.ContextVar("captum_transformers_pyg_graphs",
                                                                                 default=None)
# The original node of each node of the current node list (node-dropping pools), per forward.
NODES: contextvars.ContextVar[Optional[SurvivingNodes]] = contextvars.ContextVar("captum_transformers_pyg_nodes",
                                                                                    default=None)


def layer_key(module: nn.Module) -> Optional[str]:
    """The dotted key of ``module``'s class (or base) among the supported layers, or None."""
    for base in type(module).__mro__:
        key = f"{base.__module__}.{base.__qualname__}"
        if key in _LAYERS:
            return key
    return None


def surviving_nodes() -> Optional[SurvivingNodes]:
    """The pools followed in this context's forward (None outside one)."""
    return NODES.get()


def current_graphs() -> GraphBatch:
    graphs = GRAPHS.get()
    if graphs is None:
        raise CaptureError("A PyG attention layer ran outside an explanation's forward pass.")
    return graphs


def tapped_input(block: Block, recorder: Recorder):
    """A pre-hook connecting the layer's node features to the recorder's anchor, refusing
    bipartite inputs (attention dropout in training mode: the rule of ``capture.stochastic_layers``)."""
    module = block.module

    def hook(_module, args, kwargs):
        nodes = args[0] if args else kwargs.get("x")
        if not isinstance(nodes, torch.Tensor):
            raise CaptureError(f"{block.name!r} ({type(module).__name__}) was called with bipartite node features "
                               f"({type(nodes).__name__}); the pyg_attention adapter explains one node set per graph.")
        if surviving_nodes() is not None:
            surviving_nodes().layer_nodes(block.name, nodes.shape[0])  # refused if not the followed node list
        tapped = recorder.connect(nodes)
        if args:
            return (tapped, *args[1:]), kwargs
        return args, {**kwargs, "x": tapped}

    return hook


def recording(block: Block, recorder: Optional[Recorder]):
    """A propagate hook that reads ``alpha`` and the edges used: recorded as per-graph maps
    (``recorder``), or, without one, given a zero gradient (the AH gate)."""
    where, name = _LAYERS[layer_key(block.module)]
    module = block.module

    def hook(_module, inputs, _out):
        edge_index, _size, kwargs = inputs
        alpha = this_call_alpha(module) if where == "message" else kwargs.get(name)
        alpha = rerouted_alpha(module) if rerouted_alpha(module) is not None else alpha  # identity softmax rule
        if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2:
            raise CaptureError(f"{block.name!r} propagated over a {type(edge_index).__name__}; the pyg_attention "
                               "adapter reads edge_index tensors (2, E), not sparse adjacency matrices.")
        if not isinstance(alpha, torch.Tensor):
            raise CaptureError(f"{block.name!r} ({type(module).__name__}) kept no attention weights to record.")
        if recorder is None:
            if alpha.requires_grad:
                alpha.register_hook(torch.zeros_like)  # AH: the softmax output is a constant of A V
            return None
        alpha = alpha if alpha.dim() == 2 else alpha.unsqueeze(-1)
        graphs = current_graphs()
        nodes = surviving_nodes()
        if nodes is not None:  # after a node-dropping pool: the batch's node numbers
            edge_index = nodes.place(edge_index)
        places = graphs.edge_places(edge_index, getattr(module, "flow", "source_to_target"))
        if recorder.spec.forward_reduce is None and not recorder.spec.needs_gradient:
            # Nothing reads the map (a relevance pass records only that attention ran): no dense copy.
            size = graphs.max_nodes
            recorder.record(block, alpha.new_zeros(()).expand(graphs.num_graphs, alpha.shape[1], size, size),
                            key_valid=graphs.node_mask())
            return None
        probs = graphs.dense_edges(places, alpha.detach())
        recorder.record(block, probs, grad_tensor=alpha,
                        grad_view=lambda grad: graphs.dense_edges(places, grad, accumulate=False),
                        key_valid=graphs.node_mask())
        return None

    return hook
