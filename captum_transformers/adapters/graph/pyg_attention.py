"""PyG's sparse attention layers: ``TransformerConv``, ``GATConv``, ``GATv2Conv``.

Mechanism. Each layer computes one attention weight per edge, ``alpha`` (E, H), a softmax
over the incoming edges of each target node (self-loops included where the layer adds
them), and aggregates ``out_i = sum_j alpha_ij v_j``. Inside :meth:`PyGAttentionAdapter.capture`:

1. a forward pre-hook taps the layer's node input through :meth:`Recorder.connect`, so the
   gradient reaches every ``alpha`` even in a frozen model;
2. a ``propagate`` forward hook (:func:`~captum_transformers.model_state.patching.message_passing_hook`,
   reversible and per context) reads the edges the layer really used and ``alpha``:
   ``TransformerConv``'s is recomputed from this call's message arguments
   (:mod:`.pyg_transformer_alpha`; its ``_alpha`` field is shared with other threads),
   ``GATConv`` and ``GATv2Conv`` pass it to ``propagate`` (after their attention dropout);
3. ``alpha`` becomes per-graph (B, H, N_max, N_max) maps (:mod:`.graph_nodes`: row = target,
   column = source, real rows summing to 1); its gradient (E, H) is laid out the same way.

The explained rows follow the graph readout (:mod:`.graph_readout`), observed on the
explained forward by two probe gradients through the head (never read from source text): the
nodes each graph's pooling reads, equally weighted (a mean or add pooling, a mean over a
subset of nodes, a root node), or given as ``readout=``; a pooling that weighs nodes unequally
(max, sort) or mixes them before pooling (attention pooling) is refused. A node-level model
(one output row per node) explains one node per graph, named by a ``(node, class)`` target
pair; its row is that node.

LRP. Under a constant attention gate (AH, AH+LN) the gradient reaching ``alpha`` is zeroed
(the softmax output is a constant of ``A V``); norms and per-operation rules are installed as
for every adapter. The identity-softmax rule sets (PartialLRP, TransformerLRP) reach
``TransformerConv``'s scatter softmax through its messages (:mod:`.pyg_softmax_rule`); on GAT
layers they are refused. ``GATConv`` /
``GATv2Conv`` under the uniform product rule (AttnLRP) are refused too: their attention
scores multiply activations by a parameter vector, which that rule would halve as if both
carried relevance.

Example::

    >>> model = Net(TransformerConv(16, 16, heads=2))      # forward(x, edge_index, batch)
    >>> maps = GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch),
    ...                                          target=labels)                 # like x
    >>> nodes = GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch),
    ...                                           target=labels, return_tokens=True)  # (B, N_max)
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...capture.recorder import Recorder
from ...capture.targets import select_targets
from ...capture.trace import TOKENS, Block, InputSpan, StreamLayouts, TokenLayout
from ...errors import CaptureError, InputError
from ...propagation.rules.operations import operation_rules
from ...propagation.rules.rule_set import RuleSet, find_norms, norm_rules
from ..base import Adapter
from .refusal import MESSAGE_PASSING, class_keys
from .inputs import refuse_empty_graphs, refuse_graph_target_count, refuse_unexplainable_graphs
from .nodes import GraphBatch, batch_argument
from .pooling import SurvivingNodes, following_pools
from .readout import READOUTS, ReadoutProbe, node_targets, uniform_weights
from .pyg_layer_hooks import GRAPHS, NODES, current_graphs, layer_key, recording, surviving_nodes, tapped_input
from .pyg_softmax_rule import identity_softmax, refuse_identity_softmax
from .pyg_transformer_alpha import recomputed_alpha
from ..relevance_reading import RelevanceReading, RelevanceResult

_GAT_LIKE = ("torch_geometric.nn.conv.gat_conv.GATConv", "torch_geometric.nn.conv.gatv2_conv.GATv2Conv")
# PyG norms whose scale depends on the data (statistics over a graph); BatchNorm in eval mode
# (running statistics), GraphSizeNorm and MeanSubtractionNorm are linear and need no rule.
_STATISTICS_NORMS = {"LayerNorm", "GraphNorm", "InstanceNorm", "PairNorm", "MessageNorm", "DiffGroupNorm",
                     "HeteroLayerNorm"}

# Per forward: [whether the output is per node, whether the explained rows must be known].
_OUTPUT: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("captum_transformers_pyg_output",
                                                                          default=None)


class PyGAttentionAdapter(Adapter):
    """Adapter for models built from PyG ``TransformerConv``, ``GATConv`` and ``GATv2Conv``.

    Call the model as ``model(x, edge_index, batch)`` (any forward whose ``batch`` argument
    is PyG's batch vector; without one the nodes form one graph). Node features ``x`` (N, F)
    are the explained input: attributions come back shaped like ``x`` (each node's score
    repeated over its features), or as (B, N_max) per-graph node scores with
    ``return_tokens=True``, 0 at padding. The output holds one row of scores per graph, or one
    per node (then ``target=[(node, class), ...]``, one pair per graph).

    Args:
        readout: ``"mean"`` or ``"add"`` pooling (the explained rows: every node of the
            graph, equally weighted); ``"node"``: one output row per node (needed only when
            every graph has one node); ``None`` (default): a per-node output is node-level, a
            per-graph one's readout is observed on the run (:mod:`.graph_readout`; refused
            when it weighs or mixes nodes in a way that cannot be known).
        batch_argument: the name of the forward argument holding the batch vector.
        ignore_message_passing: let the attention-chain methods explain the attention layers
            alone when the model also mixes nodes through other message-passing layers
            (GCNConv, GINConv...), which no map shows (default False: refused).

    Example::

        >>> adapter = PyGAttentionAdapter(readout="mean")
        >>> scores = AttentionRollout(model, adapter=adapter).attribute(
        ...     x, additional_forward_args=(edge_index, batch), return_tokens=True)
    """

    name = "pyg_attention"
    #: The LRP methods read relevance at the node features (per feature) unless tokens are asked for.
    relevance_at_inputs = True
    #: The inputs are a batch of graphs, checked in scored_forward (graph_inputs): keyword tensors such
    #: as edge_attr are per edge, not per example, so the methods' per-example checks do not apply.
    graph_inputs = True
    families = "models built from torch_geometric TransformerConv / GATConv / GATv2Conv (graph readouts)"

    def __init__(self, readout: Optional[str] = None, batch_argument: str = "batch",
                 ignore_message_passing: bool = False) -> None:
        if readout is not None and readout not in READOUTS:
            raise InputError(f"readout must be None, 'mean', 'add' or 'node', got {readout!r}; max and attention "
                             "poolings read nodes unequally, which these attention maps cannot follow.")
        self.readout = readout
        self.batch_argument = batch_argument
        self.ignore_message_passing = bool(ignore_message_passing)
        # The rows follow the readout; the token-sequence row check (ReadRows) does not apply.
        self.query_rows_choice = "mean"

    # -- sites ----------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> List[Block]:
        return [Block(name, module) for name, module in model.named_modules() if layer_key(module) is not None]

    def first_layer(self, model: nn.Module) -> nn.Module:
        return self.blocks(model)[0].module

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(recomputed_alpha(self.blocks(model)))
            stack.enter_context(following_pools(model, surviving_nodes))
            for block in self.blocks(model):
                stack.enter_context(patching.forward_hook(block.module, tapped_input(block, recorder), pre=True,
                                                          with_kwargs=True))
                stack.enter_context(patching.message_passing_hook(block.module, "propagate",
                                                                  recording(block, recorder)))
            yield

    def refuse_rules(self, model: nn.Module, blocks: List[Block], rules: RuleSet, graph_adds: bool = False) -> None:
        """Refuse the rules PyG's sparse attention layers (``blocks``), its graph norms or a graph
        batch cannot follow. ``graph_adds``: normalised adds run per graph (:meth:`propagation`);
        they are then refused only in layers that add per-edge tensors."""
        if rules.norm != "gradient":
            found = {id(site.module) for site in find_norms(model)}
            graph_norms = [name for name, module in model.named_modules()
                           if type(module).__module__.startswith("torch_geometric.nn.norm")
                           and type(module).__name__ in _STATISTICS_NORMS and id(module) not in found]
            if graph_norms:
                raise CaptureError(
                    f"The rule set {rules.name} holds each norm's scale constant, but the PyG norms {graph_norms} "
                    "normalise by statistics over a whole graph (or its nodes' neighbourhoods), which the norm rule "
                    "does not recognise: their relevance would follow the plain gradient. Use ConservativeLRP("
                    "variant='AH') or GI on this model, or per-node norms (torch.nn.LayerNorm, PyG LayerNorm with "
                    "mode='node')."
                )
        if rules.softmax != "gradient":
            refuse_identity_softmax(blocks, layer_key, rules.name)
        gat = [b.name for b in blocks if layer_key(b.module) in _GAT_LIKE]
        if rules.matmul != "gradient" and gat:
            raise CaptureError(
                f"The rule set {rules.name} halves every product of two relevance-carrying tensors, but the GAT "
                f"layers {gat} score edges by multiplying node features with a parameter vector, which the rule would "
                "halve too. Use ConservativeLRP (AH, AH+LN) on GAT models, or AttnLRP on TransformerConv models."
            )
        if rules.add != "gradient" and not graph_adds:
            raise CaptureError(
                f"The rule set {rules.name} normalises residual adds per example, but the examples of a graph batch "
                "are node sets of different sizes in one node list, not a batch dimension. Use ConservativeLRP, "
                "AttnLRP or the attention methods on graph models."
            )
        # Per-edge adds (GAT's alpha_i + alpha_j, TransformerConv's key_j + edge features) have an
        # edge per row, whose graph the per-graph normalisation does not know.
        edge_adds = [b.name for b in blocks if layer_key(b.module) in _GAT_LIKE
                     or getattr(b.module, "lin_edge", None) is not None]
        if rules.add != "gradient" and edge_adds:
            raise CaptureError(
                f"The rule set {rules.name} normalises adds per graph, but the layers {edge_adds} add per-edge "
                "tensors (GAT's source and target scores, TransformerConv's edge features), whose rows are edges, "
                "not nodes. Use ConservativeLRP or AttnLRP on this model, or TransformerConv without edge_dim."
            )

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        self.refuse_rules(model, self.blocks(model), rules, graph_adds=True)
        with contextlib.ExitStack() as stack:
            if rules.attention_gate != "gradient":
                stack.enter_context(recomputed_alpha(self.blocks(model)))
                for block in self.blocks(model):
                    stack.enter_context(patching.message_passing_hook(block.module, "propagate",
                                                                      recording(block, None)))
            if rules.softmax == "identity":
                stack.enter_context(identity_softmax(self.blocks(model)))
            stack.enter_context(norm_rules(model, rules))
            # Normalised adds sum per graph: the rows of the model's first input are the batch's nodes.
            stack.enter_context(operation_rules(model, rules, groups=_graph_of_each_node))
            yield

    # -- the forward: the graphs of the batch are known around it -------------------
    def scored_forward(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                       additional_forward_args: Sequence[Any], forward_kwargs: Optional[dict], target: Any,
                       recorder: Recorder, contexts: Sequence[Any] = ()):
        nodes = inputs[0]
        if nodes.dim() != 2 or not nodes.is_floating_point():
            raise InputError(f"The explained input of a PyG model is its node features x (N, F), floating point; got "
                             f"{nodes.dtype} of shape {tuple(nodes.shape)}. Pass (edge_index, batch) as "
                             "additional_forward_args.")
        batch = batch_argument(model, (*inputs, *additional_forward_args), forward_kwargs, self.batch_argument)
        graphs = GraphBatch.of(batch, nodes.shape[0])
        refuse_empty_graphs(graphs)
        self.check_graphs(graphs)
        token = GRAPHS.set(graphs)
        nodes_token = NODES.set(SurvivingNodes(graphs.num_nodes))
        state = _OUTPUT.get()
        rows_matter = state[1] if state is not None else False
        output = _OUTPUT.set([False, rows_matter])
        # The nodes a graph-level score reads are observed on this forward (graph_readout),
        # unless the readout is given or every graph has one node.
        probe = ReadoutProbe() if rows_matter and self.readout is None and graphs.max_nodes > 1 else None
        # Without gradients (raw attention, rollout) only what follows each attention layer is
        # recorded for the probe; the explained score is then read again with gradients.
        segments = probe is not None and not torch.is_grad_enabled()
        if probe is not None:
            contexts = (*contexts, probe.watch((b.module for b in self.blocks(model)), lambda: NODES.get().ids,
                                               segments=segments))
        try:
            streams, logits, scores, index = super().scored_forward(
                model, inputs, additional_forward_args, forward_kwargs, target, recorder, contexts)
            if probe is not None and not _OUTPUT.get()[0]:
                with torch.enable_grad():
                    read = self.resolve_target(model, logits, target)[0] if segments else scores
                    streams = _with_weights(streams, probe.read_weights(read, graphs))
            return streams, logits, scores, index
        finally:
            _OUTPUT.reset(output)
            NODES.reset(nodes_token)
            GRAPHS.reset(token)

    def check_graphs(self, graphs: GraphBatch) -> None:
        """Refuse a batch of graphs the model's layers cannot take (none for sparse layers)."""

    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        graphs = current_graphs()
        mask = graphs.node_mask()
        rows = torch.arange(graphs.max_nodes, device=mask.device).expand(graphs.num_graphs, -1)
        # Every node, 1 / n (a given mean or add readout); replaced by the observed readout's
        # weights after the forward when the readout is not given (scored_forward).
        layout = TokenLayout(graphs.max_nodes, rows, mask, query_weights=uniform_weights(graphs))
        spans = (InputSpan(TOKENS, nodes=(graphs.graph, graphs.position)),) + (None,) * (len(inputs) - 1)
        return StreamLayouts({TOKENS: layout}, (TOKENS,), spans)

    def unseen_message_passing(self, model: nn.Module) -> List[str]:
        """Message-passing layers that mix nodes outside every attention map (refused by the
        attention-chain methods unless ``ignore_message_passing``)."""
        seen = {id(sub) for block in self.blocks(model) for sub in block.module.modules()}
        return [name for name, module in model.named_modules()
                if id(module) not in seen and MESSAGE_PASSING in class_keys(module)]

    # -- hooks of the pass runner ----------------------------------------------------
    def refuse_trace(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                     forward_kwargs: Optional[dict], rules: Optional[RuleSet]) -> None:
        """A batch of graphs refused in graph words, and message passing outside every attention
        map (unless ``ignore_message_passing``), before the token checks."""
        if inputs:
            refuse_unexplainable_graphs(inputs[0], additional_forward_args, forward_kwargs)
        unseen = self.unseen_message_passing(model)
        if unseen and not self.ignore_message_passing:
            raise CaptureError(
                f"The message-passing layers {unseen} mix nodes along edges outside every attention map, so the "
                "attention-chain methods would explain the model without them. Use an LRP method (ConservativeLRP, "
                f"AttnLRP), which propagates through every layer, or pass adapter={type(self).__name__}("
                "ignore_message_passing=True) to explain the attention layers alone."
            )

    @contextlib.contextmanager
    def trace_context(self, model: nn.Module) -> Iterator[None]:
        """A trace checks its explained rows against the readout (observed on the forward)."""
        token = _OUTPUT.set([False, True])
        try:
            yield
        finally:
            _OUTPUT.reset(token)

    def refuse_relevance(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                         additional_forward_args: Sequence[Any], forward_kwargs: Optional[dict],
                         rules: RuleSet) -> None:
        """A batch of graphs refused in graph words before the token checks."""
        if inputs:
            refuse_unexplainable_graphs(inputs[0], additional_forward_args, forward_kwargs)

    def relevance_reading(self, model: nn.Module, at: str, messages: Optional[list] = None) -> RelevanceReading:
        """Gradient x Input at the node features ``x``: per feature, shaped like x
        (``at="inputs"``, what the LRP methods return by default for this adapter), or summed
        over each node's features (``at="tokens"``, (B, N_max) per graph). Read at the node
        features, not at the first layer's input as for token models: they are the graph's
        input, as pixels are an image's, and the node scores stay the sums of the feature map.

        ``messages``: a list that receives, per attention call, ``(block name, edge_index the
        layer used (2, E'), relevance of each edge's message (E',))``, the message relevance
        ``R_e = m_e . dy/dm_e`` under the same rules (see :mod:`captum_transformers.integrations.pyg.edges`)."""
        return NodeFeatures(self.blocks(model), at, messages)

    def logits(self, model: nn.Module, output: Any, layout: TokenLayout, causal: bool) -> torch.Tensor:
        """One row per graph (a graph readout, checked when the explained rows matter), or one
        per node (``readout="node"``, or found so: returned as (G, N_max, C) per graph)."""
        scores = super().logits(model, output, layout, causal)
        graphs, state = current_graphs(), _OUTPUT.get()
        rows = scores.shape[0] if scores.dim() else None
        per_node = rows == graphs.num_nodes and (rows != graphs.num_graphs or self.readout == "node")
        if per_node and self.readout in ("mean", "add"):
            raise CaptureError(f"The model returned one row per node {tuple(scores.shape)}, but the adapter was told "
                               f"its readout is a {self.readout} pooling; pass readout='node' (or None).")
        if per_node:
            state[0] = True
            return graphs.dense_nodes_of(scores)
        if rows != graphs.num_graphs or self.readout == "node":
            raise CaptureError(
                f"The model returned scores of shape {tuple(scores.shape)} for a batch of {graphs.num_graphs} graphs "
                f"({graphs.num_nodes} nodes); expected one row per graph (a graph readout) or one per node "
                "(node-level). Check the batch argument."
            )
        return scores

    def resolve_target(self, model: nn.Module, logits: torch.Tensor, target: Any):
        if not _OUTPUT.get()[0]:
            refuse_graph_target_count(target, current_graphs())
            return super().resolve_target(model, logits, target)
        return select_targets(logits, node_targets(current_graphs(), target))

    def rows_for_target(self, model: nn.Module, streams: StreamLayouts, index: torch.Tensor) -> StreamLayouts:
        """Node-level outputs: each graph's explained row is its target node (``index[:, 0]``)."""
        if not _OUTPUT.get()[0]:
            return streams
        layout = streams.layouts[TOKENS]
        rows = index[:, :1].to(device=layout.query_rows.device, dtype=torch.long)
        return StreamLayouts({TOKENS: TokenLayout(layout.num_tokens, rows, layout.token_mask)}, streams.explained,
                             streams.inputs)


class NodeFeatures(RelevanceReading):
    """Relevance at a graph batch's node features (:meth:`PyGAttentionAdapter.relevance_reading`):
    ``x * dy/dx`` per feature (``at="inputs"``) or per node, (B, N_max) per graph
    (``at="tokens"``); with ``messages``, each attention call's message relevance too."""

    def __init__(self, blocks: List[Block], at: str, messages: Optional[list]) -> None:
        self.blocks = blocks
        self.at = at
        self.messages = messages
        self.kept: List[list] = []

    def contexts(self) -> List[Any]:
        contexts = []
        if self.messages is not None:
            for block in self.blocks:
                contexts.append(patching.message_passing_hook(block.module, "message", _kept_message(block, self.kept)))
                contexts.append(patching.message_passing_hook(block.module, "propagate", _kept_edges(self.kept)))
        return contexts

    def leaves(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        return [inputs[0]] + [out for _, out, _ in self.kept]

    def result(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...], grads: Sequence[Optional[torch.Tensor]],
               scores: torch.Tensor, index: torch.Tensor) -> RelevanceResult:
        graphs = _last_graphs(streams)
        leaf = inputs[0]
        grad, *message_grads = grads
        for (name, out, edges), g in zip(self.kept, message_grads):
            product = out.detach() * (torch.zeros_like(out) if g is None else g)
            self.messages.append((name, edges, product.reshape(product.shape[0], -1).sum(-1)))
        dtype = torch.promote_types(leaf.dtype, torch.float32)
        grad = torch.zeros((), dtype=dtype, device=leaf.device) if grad is None else grad.to(dtype)
        product = leaf.detach().to(dtype) * grad
        per_node = product.reshape(product.shape[0], -1).sum(-1)
        tokens = graphs.dense_nodes(per_node)
        total = tokens.sum(-1)
        layout = streams.layouts[TOKENS]
        if self.at == "tokens":
            return RelevanceResult(tokens, None, layout, scores, index, total, {TOKENS: tokens}, streams)
        per_input = (product,) + tuple(torch.zeros(t.shape, device=t.device) for t in inputs[1:])
        return RelevanceResult(None, per_input, layout, scores, index, total)


def _with_weights(streams: StreamLayouts, weights: torch.Tensor) -> StreamLayouts:
    """``streams`` with the explained nodes weighted by ``weights`` (B, N_max)."""
    layout = streams.layouts[TOKENS]
    weighted = TokenLayout(layout.num_tokens, layout.query_rows, layout.token_mask,
                           query_weights=weights.to(layout.query_rows.device))
    return StreamLayouts({TOKENS: weighted}, streams.explained, streams.inputs)


def _last_graphs(streams: StreamLayouts) -> GraphBatch:
    graph, position = streams.inputs[0].nodes
    counts = streams.layouts[TOKENS].token_mask.sum(-1)
    return GraphBatch(graph, position, counts)


def _kept_message(block: Block, kept: List[list]):
    """A message hook keeping each call's messages (E', ...) for their relevance."""

    def hook(module, _inputs, out):
        if getattr(module, "decomposed_layers", 1) != 1:
            raise CaptureError(f"{block.name!r} splits its messages over decomposed_layers="
                               f"{module.decomposed_layers}; edge relevance needs them whole (set it to 1).")
        kept.append([block.name, out, None])

    return hook


def _kept_edges(kept: List[list]):
    """A propagate hook pairing the call's messages with the edges the layer used."""

    def hook(_module, inputs, _out):
        if kept and kept[-1][2] is None:
            nodes = surviving_nodes()
            kept[-1][2] = inputs[0] if nodes is None else nodes.place(inputs[0])  # the batch's node numbers

    return hook


def _graph_of_each_node() -> Optional[torch.Tensor]:
    """(N,) the graph of each node of the batch being explained (None outside a forward)."""
    graphs = GRAPHS.get()
    return None if graphs is None else graphs.graph
