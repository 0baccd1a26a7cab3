"""Which original nodes an attention layer sees after node-dropping pools (``TopKPooling``,
``SAGPooling``) between attention layers.

A node-selecting pool returns the kept nodes as a new node list, renumbered ``0..N'-1``, with
``perm`` (N',) naming the node of its input list each one is, and an ``edge_index`` over the
new numbers. A later attention layer's edges index that new list; placed as if they indexed
the batch's original nodes, its maps would land on the wrong nodes (or outside a graph, an
all-zero map). So the pools are observed at run time, by forward hooks on the model's
``torch_geometric.nn.pool`` modules (:func:`~captum_transformers.model_state.patching.forward_hook`,
per context): :class:`SurvivingNodes` composes their ``perm`` into the original node of every
node of the current list (each pool's input must have that list's length: two pools on
parallel branches, both fed the same nodes, are refused), and the attention layers place their edges through it (dropped
nodes get zero rows and columns in the later maps).

Refused with the reason (:class:`CaptureError`): pools that merge or re-cluster nodes
(``EdgePooling``, ``ASAPooling``, ``ClusterPooling``, ``PANPooling``, ``MemPooling``: a new
node is no one original node); a pool whose input is not the current node list (pools on
parallel branches fed the same nodes); an attention layer called on a node list whose size is neither
the batch's nor the last pool's (a node subset made otherwise, e.g. by indexing); GPS layers
after a pool (their dense batch is built from the pooled batch vector).

Example::

    >>> nodes = SurvivingNodes(num_nodes=12)
    >>> nodes.pooled("pool", pool, pool(x, edge_index, batch=batch), x)   # keeps 6 nodes
    >>> nodes.layer_nodes("convs.1", 6)                                   # their original numbers (6,)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...errors import CaptureError
from .refusal import class_keys

POOL_PACKAGE = "torch_geometric.nn.pool."
#: Pools that keep a subset of their input nodes and return it as ``perm`` (output[4]).
SELECTING = ("torch_geometric.nn.pool.topk_pool.TopKPooling", "torch_geometric.nn.pool.sag_pool.SAGPooling")


def node_pools(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The model's modules from ``torch_geometric.nn.pool`` (named), the parts of a pool (its
    ``select`` and ``connect`` modules) left to the pool."""
    found: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}.") or not outer for outer, _ in found)
        if not inside and any(key.startswith(POOL_PACKAGE) for key in class_keys(module)):
            found.append((name, module))
    return found


class SurvivingNodes:
    """For one forward: the original node (index into the batch's ``x``) of every node of the
    current node list, composed from the pools seen so far (``None``: no pool yet)."""

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = num_nodes
        self.ids: Optional[torch.Tensor] = None
        self.last_pool: Optional[str] = None

    def pooled(self, name: str, module: nn.Module, output: Any, x: Any = None) -> None:
        """A pool's call (``x``: its input node features): compose its ``perm``, or refuse a pool
        that merges nodes, or one whose input is not the current node list (two pools on
        parallel branches, both fed the same nodes: composing the second's ``perm`` with the
        first's would place its nodes wrongly)."""
        if not any(key in SELECTING for key in class_keys(module)):
            raise CaptureError(
                f"{name!r} ({type(module).__name__}) pools the nodes of each graph into new nodes that are no one "
                "original node (merged or clustered), so the attention maps after it cannot be placed on the input's "
                "nodes. Explain the layers before the pooling (a model ending at it), or use an LRP method "
                "(ConservativeLRP, AttnLRP), which reads relevance at the node features.")
        perm = output[4] if isinstance(output, (tuple, list)) and len(output) > 4 else None
        if not isinstance(perm, torch.Tensor) or perm.dim() != 1 or perm.is_floating_point():
            raise CaptureError(f"{name!r} ({type(module).__name__}) returned no node permutation (perm) where PyG's "
                               "pools return it (output[4]); the nodes it kept cannot be followed.")
        current = torch.arange(self.num_nodes, device=perm.device) if self.ids is None else self.ids
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] != current.shape[0]:
            before = ("the batch's node list" if self.last_pool is None else
                      f"the node list after {self.last_pool!r}, which kept {current.shape[0]} of the batch's "
                      f"{self.num_nodes} nodes,")
            raise CaptureError(
                f"{name!r} ({type(module).__name__}) was called on {x.shape[0]} nodes, but {before} has "
                f"{current.shape[0]}: its input is not the node list the explanation follows (e.g. two pools on "
                "parallel branches, both fed the same nodes), so which original nodes it keeps cannot be followed. "
                "Chain the pools (each fed the previous one's output), or use an LRP method (ConservativeLRP, "
                "AttnLRP), which reads relevance at the node features.")
        if perm.numel() and int(perm.max()) >= current.shape[0]:
            raise CaptureError(f"{name!r} kept node {int(perm.max())} of a node list of {current.shape[0]} nodes; its "
                               "input is not the node list the explanation follows (pools on different branches "
                               "cannot be followed).")
        self.ids = current.to(perm.device)[perm]
        self.last_pool = name

    def layer_nodes(self, name: str, count: int) -> Optional[torch.Tensor]:
        """The original nodes of an attention layer's ``count`` input nodes (None: all, in order)."""
        if self.ids is None:
            if count != self.num_nodes:
                raise CaptureError(
                    f"The attention layer {name!r} was called on {count} nodes, but the batch has {self.num_nodes} "
                    "nodes and no PyG node pool (TopKPooling, SAGPooling) ran before it, so which nodes it sees is "
                    "not known and its maps cannot be placed on the graphs' nodes. Pass the whole node list to the "
                    "attention layers, or select nodes with a TopKPooling / SAGPooling module.")
            return None
        if count != self.ids.shape[0]:
            raise CaptureError(
                f"The attention layer {name!r} was called on {count} nodes, but the last node pool kept "
                f"{self.ids.shape[0]} of the batch's {self.num_nodes} nodes, so which nodes it sees is not known.")
        return self.ids

    def place(self, edge_index: torch.Tensor) -> torch.Tensor:
        """``edge_index`` over the current node list, renumbered as the batch's original nodes."""
        return edge_index if self.ids is None else self.ids.to(edge_index.device)[edge_index]


@contextlib.contextmanager
def following_pools(model: nn.Module, nodes: Callable[[], Optional[SurvivingNodes]]) -> Iterator[None]:
    """Forward hooks (this context only) handing every pool call of ``model`` to ``nodes()``."""
    with contextlib.ExitStack() as stack:
        for name, module in node_pools(model):
            def hook(module, args, kwargs, output, name=name):
                surviving = nodes()
                if surviving is not None:
                    surviving.pooled(name, module, output, args[0] if args else kwargs.get("x"))
                return None
            stack.enter_context(patching.forward_hook(module, hook, with_kwargs=True))
        yield
