"""PyG ``GPSConv``: global multi-head attention beside a local message-passing branch.

Each ``GPSConv`` computes ``h = MLP(norm(x + MPNN(x)) + norm(x + MHA(to_dense_batch(x))))``:
its ``nn.MultiheadAttention`` mixes every node of a graph with every other (the dense batch,
padded to the largest graph, with a key padding mask), while the local branch (a GINConv, a
GatedGraphConv...) sends messages along the edges, in parallel. The attention maps are the
dense (B, H, N_max, N_max) maps the methods chain, recorded as by the ``torch_mha`` adapter.

The local branch is invisible to the attention-chain methods (raw attention, rollout,
Grad-CAM, GenericAttention, TransformerRelevance): chaining the global maps alone explains a
model the GPS layer is not. They are refused unless the user opts in with
``ignore_local_branch=True`` (the maps then describe the global branch only). The LRP methods
(ConservativeLRP, AttnLRP...) propagate through both branches: their relevance is a modified
gradient of the whole model, read at the node features.

Example::

    >>> adapter = PyGGPSAdapter(ignore_local_branch=True)
    >>> scores = AttentionRollout(gps_model, adapter=adapter).attribute(
    ...     x, additional_forward_args=(edge_index, batch), return_tokens=True)    # (B, N_max)
    >>> relevance = ConservativeLRP(gps_model).attribute(x, additional_forward_args=(edge_index, batch))
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...capture.recorder import Recorder
from ...capture.trace import Block
from ...errors import CaptureError, InputError
from ...propagation.rules.rule_set import RuleSet
from .nodes import GraphBatch
from .pooling import following_pools
from .pyg_attention import PyGAttentionAdapter
from .pyg_layer_hooks import layer_key, recording, surviving_nodes, tapped_input
from .pyg_softmax_rule import identity_softmax
from .pyg_transformer_alpha import recomputed_alpha
from ..torch_mha import TorchMHAAdapter, recording_forward

GPS_KEY = "torch_geometric.nn.conv.gps_conv.GPSConv"


def _is_gps(module: nn.Module) -> bool:
    return any(f"{base.__module__}.{base.__qualname__}" == GPS_KEY for base in type(module).__mro__)


class PyGGPSAdapter(PyGAttentionAdapter):
    """Adapter for models built from PyG ``GPSConv`` layers (with ``attn_type="multihead"``),
    alone or next to ``TransformerConv`` / ``GATConv`` / ``GATv2Conv`` layers.

    Args:
        readout: as for :class:`PyGAttentionAdapter` (mean or add pooling; None: observed on the run).
        ignore_local_branch: let the attention-chain methods explain the global attention
            alone, ignoring each GPS layer's local message-passing branch (default False:
            refused, since the maps do not show what that branch contributes).
        batch_argument: the name of the forward argument holding PyG's batch vector.
        ignore_message_passing: as for :class:`PyGAttentionAdapter`, for message-passing
            layers outside the GPS layers.
    """

    name = "pyg_gps"
    families = "models built from torch_geometric GPSConv (multi-head global attention)"

    def __init__(self, readout: Optional[str] = None, ignore_local_branch: bool = False,
                 batch_argument: str = "batch", ignore_message_passing: bool = False) -> None:
        super().__init__(readout, batch_argument, ignore_message_passing)
        self.ignore_local_branch = bool(ignore_local_branch)

    def unseen_message_passing(self, model: nn.Module) -> List[str]:
        """As for sparse attention models, GPS local branches aside (``ignore_local_branch``)."""
        local = {id(sub) for module in model.modules() if _is_gps(module) and module.conv is not None
                 for sub in module.conv.modules()}
        named = dict(model.named_modules())
        return [name for name in super().unseen_message_passing(model) if id(named[name]) not in local]

    def blocks(self, model: nn.Module) -> List[Block]:
        """Each GPS layer's global attention, and sparse attention layers outside GPS local branches."""
        local = {id(sub) for module in model.modules() if _is_gps(module) and module.conv is not None
                 for sub in module.conv.modules()}
        found = []
        for name, module in model.named_modules():
            if _is_gps(module):
                if not isinstance(module.attn, nn.MultiheadAttention):
                    raise CaptureError(f"{name!r} uses {type(module.attn).__name__} attention (linear attention: no "
                                       "softmax map exists); only attn_type='multihead' GPS layers are explained.")
                found.append(Block(f"{name}.attn" if name else "attn", module.attn))
            elif layer_key(module) is not None and id(module) not in local:
                found.append(Block(name, module))
        return found

    def check_graphs(self, graphs: GraphBatch) -> None:
        """A batch vector out of order is refused before the forward: ``to_dense_batch`` places
        nodes by counting, so its dense rows would not be the nodes the layout names."""
        if graphs.num_nodes and bool((graphs.graph[1:] < graphs.graph[:-1]).any()):
            raise InputError("GPSConv's to_dense_batch needs the batch vector sorted by graph (as PyG's Batch "
                             "builds it); sort the nodes by graph first.")

    def _local_branches(self, model: nn.Module) -> List[str]:
        return [name or "the top level" for name, module in model.named_modules()
                if _is_gps(module) and module.conv is not None]

    def refuse_trace(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                     forward_kwargs: Optional[dict], rules: Optional[RuleSet]) -> None:
        """GPS local branches, unseen by the attention-chain methods, are refused unless
        ``ignore_local_branch``; then the refusals of every PyG attention model."""
        local = self._local_branches(model)
        if local and not self.ignore_local_branch:
            raise CaptureError(
                f"The GPS layers {local} add a local message-passing branch beside their global attention; the "
                "attention-chain methods see only the attention maps, so their explanation would leave that branch "
                "out. Use an LRP method (ConservativeLRP, AttnLRP), which propagates through both branches, or pass "
                "adapter=PyGGPSAdapter(ignore_local_branch=True) to explain the global attention alone."
            )
        super().refuse_trace(model, inputs, additional_forward_args, forward_kwargs, rules)

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patching.mha_fastpath_disabled(model))
            stack.enter_context(recomputed_alpha(self.blocks(model)))
            stack.enter_context(following_pools(model, surviving_nodes))
            for block in self.blocks(model):
                if isinstance(block.module, nn.MultiheadAttention):
                    stack.enter_context(patching.forward_hook(block.module, _unpooled(block), pre=True))
                    stack.enter_context(patching.instance_forward(
                        block.module, lambda original, block=block: recording_forward(original, block, recorder)))
                else:
                    stack.enter_context(patching.forward_hook(block.module, tapped_input(block, recorder), pre=True,
                                                              with_kwargs=True))
                    stack.enter_context(patching.message_passing_hook(block.module, "propagate",
                                                                      recording(block, recorder)))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        """Both branches: the attention gate and per-operation rules of the ``torch_mha``
        adapter (global attention, norms, linear layers, the local MPNN's operations) and the
        gate on sparse attention layers, wherever they sit (local branches included)."""
        sparse = [Block(name, module) for name, module in model.named_modules() if layer_key(module) is not None]
        self.refuse_rules(model, sparse, rules)
        with contextlib.ExitStack() as stack:
            stack.enter_context(TorchMHAAdapter().propagation(model, rules))
            if rules.softmax == "identity" and sparse:  # TransformerConv in a local branch (others refused above)
                stack.enter_context(identity_softmax(sparse))
            if rules.attention_gate != "gradient":
                stack.enter_context(recomputed_alpha(sparse))
                for block in sparse:
                    stack.enter_context(patching.message_passing_hook(block.module, "propagate",
                                                                      recording(block, None)))
            yield


def _unpooled(block: Block):
    """A pre-hook refusing a GPS attention call after a node-dropping pool: its dense batch is
    built from the pooled batch vector, whose rows are not the batch's nodes."""

    def hook(_module, _args):
        nodes = surviving_nodes()
        if nodes is not None and nodes.ids is not None:
            raise CaptureError(f"{block.name!r} runs after a node-dropping pool (TopKPooling, SAGPooling); its dense "
                               "attention over the kept nodes cannot be placed on the batch's nodes. Explain it with "
                               "an LRP method (ConservativeLRP, AttnLRP), which reads relevance at the node features.")
        return None

    return hook
