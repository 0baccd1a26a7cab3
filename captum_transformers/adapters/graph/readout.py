"""Which nodes a graph model's output reads: the graph readout, found from the run itself,
or the explained node.

Graph-level models pool each graph's nodes; the explained rows of the attention maps are the
nodes the pooling reads, with the weights it gives them. Nothing is read from the model's
source text (a pooling in a branch that never runs, or named in a comment, is not a readout;
a model defined by ``exec`` has no source). The readout is observed on the explained
forward, by two probe gradients from the explained scores back to the last attention layer's
output ``H`` (:class:`ReadoutProbe`, through the head only; with ``retain_graph`` so the
method's own backward pass still runs; a forward without gradients records only what follows
each attention layer, from its output made a leaf):

1. the nodes the score reads are those the head weighs: the non-zero rows of its gradient at
   the pooling input ``Z``, the head's weight on each node's own state. Walking the autograd
   graph from the scores, ``Z`` is the first tensor that has one row per node (closer to the
   scores, tensors have one row per graph), followed back through products with constants
   (a 0/1 mask, constant weights), which are part of the readout; ``H`` itself when the head
   pools it directly or through such products only. A node whose state is constant is still
   read: with no incoming edge, ``TransformerConv(root_weight=False)`` gives it a zero state,
   whose ReLU has zero gradient at ``H``, but a mean pooling counts it (weight ``1 / n``). A
   node a constant mask zeroes is not read; a node whose row of ``H`` the score reads along
   another path than ``Z`` is refused. Accepted when, in every graph, the rows of the gradient
   at ``Z`` of the read nodes are bit-identical: a mean or add pooling (all nodes), a mean over
   a subset of nodes (the subset), a root-node readout (one node); each read node then has
   weight ``1 / |read|``. Unequal rows (a max or sort pooling, unequal constant weights) are
   refused: how the readout weighs its nodes is not known.
2. ``Z`` must take each node's row from that node's row of ``H`` only, for every node: each
   position in a graph has a distinct code of ``m`` bits (no code inside another), and for
   each bit the cotangent of the rows whose bit is 1, sent from ``Z`` back to ``H``, must
   reach only such rows (``m`` backward passes through the head: 7 for graphs of up to 35
   nodes). A gate computed over the graph's nodes (attention pooling, a softmax gate), a
   graph-wide norm, or message passing between the last attention layer and the pooling mixes
   nodes and is refused, also where a graph's first node has no edge.
3. A pooling input made as a product with one scalar per node that carries a gradient (a
   gate ``sigmoid(w . h_i) * h_i``, seen as the product's factors in the autograd graph) is
   refused too, however the product is spelled (broadcast, ``expand``, ``repeat``, ``view``,
   a transpose, an ``einsum``: operations that only reshape or copy are followed back): the
   pooling weighs each node by its gate.

Other operations on each node alone between ``H`` and the pooling (norms per node,
activations, an MLP) are part of that node's row, as a token model's per-token layers are.
A user-given ``readout="mean"`` or ``"add"`` skips the probe: every node of the graph, weight
``1 / n`` (an add pooling scales a graph's map by a constant).

Node-level models return one row of scores per node; each graph of the batch explains one of
its nodes, named with its class as a ``(node, class)`` target pair (``node`` indexes the flat
node list ``x``), so examples stay graphs: two explained nodes of one graph would share one
backward pass. Their explained row is that node.

Example::

    >>> probe = ReadoutProbe()                       # around the explained forward: probe.watch(blocks)
    >>> weights = probe.read_weights(scores, graphs)  # (B, N_max): 1/n at the nodes a mean pool reads
    >>> node_targets(GraphBatch.of(batch), [(3, 1), (9, 0)])   # node 3 of graph 0, node 9 of graph 1
    [(3, 1), (2, 0)]
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...errors import CaptureError, InputError
from .nodes import GraphBatch

READOUTS = ("mean", "add", "node")
_HINT = ("If the readout is a mean or add pooling over every node of each graph, pass "
         "adapter=PyGAttentionAdapter(readout='mean') (or 'add'); the LRP methods (ConservativeLRP, AttnLRP) need no "
         "readout.")


class ReadoutProbe:
    """The nodes a graph-level score reads and their weights, from the run itself (module
    docstring): the last attention layer's output is kept by :meth:`watch`, the two probe
    gradients are taken by :meth:`read_weights` after the forward."""

    def __init__(self) -> None:
        self.output: Optional[torch.Tensor] = None
        self.node_ids: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def watch(self, modules: Iterable[nn.Module], node_ids: Callable[[], Optional[torch.Tensor]] = lambda: None,
              segments: bool = False) -> Iterator[None]:
        """Forward hooks keeping the output of the last call of any of ``modules``, and the
        batch's node number of each of its rows then (``node_ids()``; None: all, in order;
        after a node-dropping pool, the kept nodes: :mod:`.graph_pooling`).

        ``segments`` (a forward without gradients, for the methods that take none): only what
        follows each of ``modules`` is recorded for the probe, from its output made a leaf
        (gradients on after each call, off inside the next); the grad mode is restored on exit."""
        def keep(_module, _args, output):
            tensor = output[0] if isinstance(output, (tuple, list)) and output else output
            if not isinstance(tensor, torch.Tensor):
                return None
            if segments and tensor.is_floating_point():
                torch.set_grad_enabled(True)
                tensor = tensor.detach().requires_grad_()
                output = (tensor, *output[1:]) if isinstance(output, tuple) else (
                    [tensor, *output[1:]] if isinstance(output, list) else tensor)
            self.output, self.node_ids = tensor, node_ids()
            return output if segments else None

        def no_grad_inside(_module, _args):
            torch.set_grad_enabled(False)
            return None

        mode = torch.is_grad_enabled()
        try:
            with contextlib.ExitStack() as stack:
                for module in modules:
                    if segments:
                        stack.enter_context(patching.forward_hook(module, no_grad_inside, pre=True))
                    stack.enter_context(patching.forward_hook(module, keep))
                yield
        finally:
            torch.set_grad_enabled(mode)

    def read_weights(self, scores: torch.Tensor, graphs: GraphBatch) -> torch.Tensor:
        """(B, N_max) weights of each graph's nodes in its score (summing to 1 per graph), or
        :class:`CaptureError` when the readout cannot be known."""
        hidden = self.output
        if hidden is None or not scores.requires_grad or not hidden.requires_grad:
            raise CaptureError("Which nodes the graph-level score reads could not be observed (the explained score or "
                               f"the last attention layer's output carries no gradient). {_HINT}")
        ids = (torch.arange(graphs.num_nodes, device=graphs.graph.device) if self.node_ids is None
               else self.node_ids.to(graphs.graph.device))
        rows = _node_rows(hidden, graphs, ids.shape[0])
        if rows is None:
            raise CaptureError(f"The last attention layer's output has shape {tuple(hidden.shape)}, neither one row per "
                               f"node ({ids.shape[0]}) nor (graphs, nodes, ...) = ({graphs.num_graphs}, "
                               f"{graphs.max_nodes}, ...), so the nodes the score reads cannot be placed. {_HINT}")
        pooled_node, pooled_grad, hidden_grad = self._pooling_input(scores, hidden, ids.shape[0])
        # The nodes read: those the head weighs, the non-zero rows of the gradient at the pooling
        # input (a node whose state is constant, one with no incoming edge, is still counted by a
        # mean: its gradient at H may be 0 behind a ReLU, its weight at Z is 1/n), or at H (a node
        # read along another path too is refused below); a node a constant mask zeroes is not
        # read. Their weights: equal rows of the gradient at the pooling input.
        grad = rows(hidden_grad) if pooled_node is None else pooled_grad
        grad = grad.reshape(grad.shape[0], -1)
        read = rows(hidden_grad).reshape(ids.shape[0], -1).ne(0).any(dim=1) | grad.ne(0).any(dim=1)
        graph_of, position_of = graphs.graph[ids].to(grad.device), graphs.position[ids].to(grad.device)
        # Per graph, its first read node; every read node's row must equal that node's (bit for bit).
        rows_count = grad.shape[0]
        candidates = torch.where(read, torch.arange(rows_count, device=grad.device), rows_count)
        first = torch.full((graphs.num_graphs,), rows_count, device=grad.device).scatter_reduce(
            0, graph_of, candidates, reduce="amin")
        empty = (first == rows_count).nonzero().flatten().tolist()
        if empty:
            raise CaptureError(f"The score of graph {empty[0]} reads none of its nodes at the last attention layer's "
                               "output, so no node of it can be explained.")
        # (a read node with no gradient at Z is read along another path: not a pooling of Z either)
        unequal = read & (~(grad == grad[first[graph_of]]).all(dim=1) | grad.eq(0).all(dim=1))
        if bool(unequal.any()):
            graph = int(graph_of[unequal.nonzero()[0, 0]])
            nodes = ((graph_of == graph) & read).nonzero().flatten()
            raise CaptureError(
                f"The score of graph {graph} reads its nodes {nodes.tolist()} through a readout that weighs them "
                "unequally (e.g. a max, sort or attention pooling: the gradient at the pooled node states differs "
                "from node to node), so which rows of the attention maps explain it is not known. " + _HINT)
        counts = torch.bincount(graph_of[read], minlength=graphs.num_graphs).to(torch.float64)
        weights = torch.zeros(graphs.num_graphs, graphs.max_nodes, dtype=torch.float64, device=grad.device)
        weights[graph_of[read], position_of[read]] = 1.0 / counts[graph_of[read]]
        if pooled_node is not None:
            self._refuse_mixing(scores, hidden, rows, pooled_node, pooled_grad, graph_of, position_of)
        return weights

    def _pooling_input(self, scores: torch.Tensor, hidden: torch.Tensor, num_rows: int):
        """``(autograd node and output index of Z, dscore/dZ, dscore/dH)``; the node is None when
        no tensor with one row per node lies between ``H`` and the scores, or only constant
        masks do (Z is H).

        Z is the per-node tensor nearest to the scores, followed back through products with
        constants (a 0/1 mask, constant weights: :func:`_before_constant_factors`), which belong
        to the readout: the gradient at Z is then the head's weight on each node's own state,
        zero where a mask drops the node, unequal where constants weigh nodes unequally."""
        depth = _depths(scores.grad_fn, stop=hidden.grad_fn)
        seen: List[Tuple[int, Any, int, torch.Tensor]] = []
        shapes: Dict[Tuple[int, int], torch.Size] = {}  # (id(node), output) -> shape, for every node run
        handles = []
        for node, level in depth.items():
            if not node.next_functions and "AccumulateGrad" in node.name():
                continue  # a leaf (a parameter, or H itself made a leaf): never the pooling input
            def prehook(grad_outputs, node=node, level=level):
                for k, grad in enumerate(grad_outputs):
                    if isinstance(grad, torch.Tensor):
                        shapes[(id(node), k)] = grad.shape
                    if isinstance(grad, torch.Tensor) and grad.dim() >= 1 and grad.shape[0] == num_rows:
                        seen.append((level, node, k, grad.detach()))
                return None
            handles.append(node.register_prehook(prehook))
        try:
            (hidden_grad,) = torch.autograd.grad(scores.sum(), hidden, retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        if hidden_grad is None:
            raise CaptureError("The explained score does not depend on the last attention layer's output, so no node "
                               "of the attention maps explains it.")
        if not seen:
            return None, None, hidden_grad
        nearest = min(level for level, *_ in seen)
        found = {(id(node), k): (node, k, grad) for level, node, k, grad in seen if level == nearest}
        if len(found) != 1:
            raise CaptureError(f"The score reads {len(found)} different per-node tensors at once (e.g. two poolings "
                               f"of different node states), so how it weighs the nodes is not known. {_HINT}")
        node, k, grad = next(iter(found.values()))
        self._refuse_gate(node, k, shapes, num_rows)
        per_node = {(id(n), i): g for _, n, i, g in seen}
        walked = _before_constant_factors(node, k, per_node, hidden)
        if walked is None:
            return None, None, hidden_grad
        if walked[:2] != (node, k):
            node, k, grad = walked
            self._refuse_gate(node, k, shapes, num_rows)
        return (node, k), grad, hidden_grad

    @staticmethod
    def _refuse_gate(node, k: int, shapes: dict, num_rows: int) -> None:
        """Refuse a pooling input made as a product with one scalar per node that carries a
        gradient (a gate computed from the node states, ``sigmoid(w . h_i) * h_i``): the pooling
        then weighs each node by its gate, which the attention rows cannot carry. However it is
        spelled: Z and each factor are followed back through operations that only reshape, copy
        or repeat values (``expand``, ``view``, ``repeat``, ``permute``, an ``einsum`` without a
        sum, ...) to the product and to the operation that computed the factor; a factor computed
        as one value per node (``num_rows`` values in all) is a gate."""
        product, out = _through_shape_ops(node, k)
        if product is None or ("Mul" not in product.name() and "Product" not in product.name()):
            return
        shape = shapes.get((id(product), out))
        if shape is None or math.prod(shape) <= num_rows:
            return  # one value per node: a scalar per node scaled, not node states gated
        for child, index in product.next_functions:
            source, index = _through_shape_ops(child, index)
            factor = shapes.get((id(source), index)) if source is not None else None
            if factor is not None and math.prod(factor) == num_rows and max(factor, default=0) == num_rows:
                raise CaptureError(
                    "The pooled node states are each multiplied by one scalar per node computed from the node states "
                    f"(a gated pooling: {source.name()} gives {tuple(factor)} values for {num_rows} nodes, reaching "
                    f"the product {product.name()} through reshapes or copies only), so the readout weighs the nodes "
                    f"by their gates, which the rows of the attention maps cannot carry. {_HINT}")

    def _refuse_mixing(self, scores, hidden, rows, pooled_node, pooled_grad, graph_of: torch.Tensor,
                       position_of: torch.Tensor) -> None:
        """Each row of Z must come from the same row of H only. Every position in a graph gets a
        distinct code of ``m`` bits, all with ``m // 2`` ones (:func:`_separating_codes`), so for
        any two positions ``p != q`` some bit is 1 in ``p``'s code and 0 in ``q``'s; for each bit,
        the cotangent of the rows whose bit is 1, sent from Z back to H, must reach only such
        rows. Any node whose pooled state reads another node's attention output at another
        position (in its graph, or in another graph) shows up, in ``m`` backward passes through
        the head only (7 for graphs of up to 35 nodes, whatever the batch size); mixing only
        between nodes at the same position of different graphs is not looked for. One
        cotangent per graph, as before, missed a node with no edge to the one chosen."""
        node, k = pooled_node
        count = pooled_grad.shape[0]
        live = pooled_grad.reshape(count, -1).ne(0).any(dim=1)
        if not bool(live.any()) or int(position_of.max()) < 1:
            return
        positions = position_of.to(pooled_grad.device)
        # (the cached table is never written)
        codes = _separating_codes(int(positions.max()) + 1).to(pooled_grad.device)[positions]
        shape = (count,) + (1,) * (pooled_grad.dim() - 1)
        zero = torch.zeros((), dtype=pooled_grad.dtype, device=pooled_grad.device)
        for part in codes.unbind(dim=1):
            if not bool((live & part).any()):
                continue
            grad = self._sent_back(scores, hidden, node, k, torch.where(part.view(shape), pooled_grad, zero))
            if grad is None:
                return
            reached = rows(grad).reshape(count, -1).ne(0).any(dim=1).to(part.device) & ~part
            if bool(reached.any()):
                row = int(reached.nonzero()[0, 0])
                graph, position = int(graph_of[row]), int(position_of[row])
                raise CaptureError(
                    f"Between the last attention layer and the readout, the nodes of graph {graph} are mixed: the "
                    f"attention output of its node {position} reaches the pooled state of another node (message "
                    "passing, a gate computed over the graph's nodes as in attention pooling, or a graph-wide norm), "
                    f"so which rows of the attention maps explain the score is not known. {_HINT}")

    @staticmethod
    def _sent_back(scores, hidden, node, k, cotangent) -> Optional[torch.Tensor]:
        """The gradient at H of ``cotangent`` placed at Z (output ``k`` of autograd ``node``)."""
        def replace(grad_outputs):
            return tuple(cotangent.to(g.dtype) if i == k and isinstance(g, torch.Tensor) else g
                         for i, g in enumerate(grad_outputs))

        handle = node.register_prehook(replace)
        try:
            (grad,) = torch.autograd.grad(scores.sum(), hidden, retain_graph=True, allow_unused=True)
        finally:
            handle.remove()
        return grad


@functools.lru_cache(maxsize=16)
def _separating_codes(count: int) -> torch.Tensor:
    """(count, m) booleans: a distinct code per row, each with ``m // 2`` ones, ``m`` the least
    with ``C(m, m // 2) >= count``. No code is inside another, so every ordered pair of rows is
    told apart by some column (1 for the first, 0 for the second): Sperner's bound, the fewest
    columns that can do so."""
    width = 1
    while math.comb(width, width // 2) < count:
        width += 1
    ones = torch.tensor(list(itertools.islice(itertools.combinations(range(width), width // 2), count)),
                        dtype=torch.long).reshape(count, width // 2)
    return torch.zeros(count, width, dtype=torch.bool).scatter_(1, ones, True)


# Autograd nodes of operations that only reshape, copy, repeat or re-type their one input: a
# value reaching a product through them is still the value that was computed before them.
_SHAPE_ONLY = ("ExpandBackward", "ViewBackward", "UnsafeViewBackward", "ReshapeAliasBackward", "UnsqueezeBackward",
               "SqueezeBackward", "RepeatBackward", "PermuteBackward", "TransposeBackward", "TBackward",
               "NumpyTBackward", "CloneBackward", "AliasBackward", "ToCopyBackward", "ExpandAsBackward")


def _through_shape_ops(node, output: int):
    """``(node, output)`` followed back through :data:`_SHAPE_ONLY` nodes to the first other one."""
    for _ in range(256):
        if node is None or node.name().rstrip("0123456789") not in _SHAPE_ONLY:
            break
        inputs = [(child, index) for child, index in node.next_functions if child is not None]
        if len(inputs) != 1:
            break
        node, output = inputs[0]
    return node, output


# Autograd nodes of element-wise operations that scale or zero the one input carrying a
# gradient by constants, -> the saved constant for that input's position (None: not a scaling).
_CONSTANT_FACTORS = {"MulBackward0": ("_saved_other", "_saved_self"), "DivBackward0": ("_saved_other", None),
                     "WhereBackward0": ("_saved_condition", "_saved_condition"),
                     "MaskedFillBackward0": ("_saved_mask",)}


def _before_constant_factors(node, output: int, per_node: Dict[Tuple[int, int], torch.Tensor], hidden: torch.Tensor):
    """The pooling input Z (``output`` of autograd ``node``) followed back through products
    with constants of one value per node: a 0/1 mask (``h * mask[:, None]``,
    ``torch.where(mask[:, None], h, 0)``, ``masked_fill``) or constant weights
    (``h / counts[:, None]``), the readout's own, while their input still has one row per node
    (its gradient is in ``per_node``, by ``(id(node), output)``). A constant varying within a
    node's row (dropout's mask) is a per-node layer, not followed. Returns ``(node, output,
    gradient)`` of the tensor reached, or None when it is ``hidden`` (H)."""
    grad = per_node[(id(node), output)]
    for _ in range(256):
        saved = _CONSTANT_FACTORS.get(node.name())
        inputs = [(position, child, index) for position, (child, index) in enumerate(node.next_functions)
                  if child is not None]
        if saved is None or len(inputs) != 1 or inputs[0][0] >= len(saved) or saved[inputs[0][0]] is None:
            break  # not a scaling, or a product of two computed tensors (a gate, refused; or node states)
        position, child, index = inputs[0]
        try:
            factor = getattr(node, saved[position])
        except (AttributeError, RuntimeError):  # not saved by this torch, or already freed
            break
        if not _one_value_per_node(factor, grad.shape):
            break
        if (child is hidden.grad_fn and index == hidden.output_nr) or getattr(child, "variable", None) is hidden:
            return None
        if (id(child), index) not in per_node:
            break
        node, output = child, index
        grad = per_node[(id(node), output)]
    return node, output, grad


def _one_value_per_node(factor: Any, shape: torch.Size) -> bool:
    """Whether ``factor`` (broadcast to ``shape``, one row per node) is constant within each row."""
    if not isinstance(factor, torch.Tensor):
        return factor is not None
    try:
        values = factor.detach().expand(shape).reshape(shape[0], -1)
    except RuntimeError:
        return False
    return bool((values == values[:, :1]).all())


def _node_rows(hidden: torch.Tensor, graphs: GraphBatch, num_rows: int):
    """A function giving a tensor shaped like ``hidden`` as one row per node of the layer's
    node list (``num_rows``), or None."""
    if hidden.dim() >= 1 and hidden.shape[0] == num_rows:
        return lambda tensor: tensor
    if num_rows != graphs.num_nodes:
        return None
    if hidden.dim() >= 2 and tuple(hidden.shape[:2]) == (graphs.num_graphs, graphs.max_nodes):
        return lambda tensor: tensor[graphs.graph.to(tensor.device), graphs.position.to(tensor.device)]
    return None


def _depths(root, stop) -> dict:
    """Breadth-first distance from ``root`` of every autograd node before ``stop`` (excluded,
    not walked through)."""
    depth = {}
    frontier = [root] if root is not None and root is not stop else []
    level = 0
    while frontier:
        following = []
        for node in frontier:
            if node in depth:
                continue
            depth[node] = level
            for child, _ in node.next_functions:
                if child is not None and child is not stop and child not in depth:
                    following.append(child)
        frontier, level = following, level + 1
    return depth


def uniform_weights(graphs: GraphBatch) -> torch.Tensor:
    """(B, N_max): ``1 / n`` at each real node (a given mean or add readout)."""
    mask = graphs.node_mask()
    return mask.to(torch.float64) / graphs.counts.clamp(min=1)[:, None].to(torch.float64)


def node_targets(graphs: GraphBatch, target: Any) -> List[tuple]:
    """``(position in its graph, class)`` per graph from ``(node, class)`` pairs, one per graph
    in graph order (a single pair for one graph, a list of pairs, or a (G, 2) tensor)."""
    hint = ("A node-level model explains one node per graph: pass target=[(node, class), ...] with one pair per "
            f"graph of the batch ({graphs.num_graphs}), in graph order, node indexing x.")
    if target is None:
        raise InputError(f"The model returns one row per node; which node to explain is not known. {hint}")
    if isinstance(target, torch.Tensor):
        if target.dim() != 2 or target.shape[1] != 2 or target.is_floating_point():
            raise InputError(f"target tensor of shape {tuple(target.shape)}: expected (G, 2) integer pairs. {hint}")
        target = [tuple(pair) for pair in target.tolist()]
    elif isinstance(target, tuple) and len(target) == 2 and all(isinstance(v, int) for v in target):
        target = [target]
    if not isinstance(target, (list, tuple)) or not all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                       for v in pair) for pair in target):
        raise InputError(f"target={target!r} is not a list of (node, class) pairs. {hint}")
    if len(target) != graphs.num_graphs:
        raise InputError(f"{len(target)} (node, class) pairs for {graphs.num_graphs} graphs. {hint}")
    local = []
    for graph, (node, cls) in enumerate(target):
        if not 0 <= node < graphs.num_nodes or int(graphs.graph[node]) != graph:
            raise InputError(f"target pair {graph} names node {node}, which is not a node of graph {graph}. {hint}")
        local.append((int(graphs.position[node]), cls))
    return local
