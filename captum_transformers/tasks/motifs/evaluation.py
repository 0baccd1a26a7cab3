"""The motifs task's metrics per method, fed one batch of graphs at a time.

* node AUROC of the node scores against the motif's nodes (:class:`NodeAUROC`);
* AUAC and AU-MSE over nodes (:class:`NodeActivation`, :class:`NodePruning`, Ali et al.'s
  activation and pruning, nodes masked by zeroing their features and removing their edges);
* PyG's fidelity (``torch_geometric.explain.metric.fidelity``, "model" explanations) of a hard
  mask keeping each graph's ``MOTIF_NODES`` highest-scoring nodes: fid+ (the prediction changes
  without them) and fid- (it changes with only them);
* the class-specific share on two-motif graphs (:class:`ClassSpecificity`): each method explains
  "house" and "cycle" on the same graph; the share of positive relevance on the explained motif.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

from ...adapters.graph.nodes import GraphBatch
from ...errors import CaptureError
from ...evaluation import ClassSpecificity
from ...evaluation.accumulator import Accumulator, exact_sum
from ...evaluation.graphs.node_perturbation import NodeActivation, NodeAUROC, NodePruning
from ...evaluation.results import ScalarResult
from .graphs import MOTIF_NODES


class Fidelity(Accumulator):
    """PyG's fidelity (fid+ or fid-) of per-graph top-k node masks, averaged over graphs."""

    def __init__(self, model, method: str, sign: str, k: int = MOTIF_NODES) -> None:
        super().__init__()
        from torch_geometric.explain import Explainer

        from ...integrations.pyg import TransformerExplainer

        self.explainer = Explainer(model, TransformerExplainer(method), explanation_type="model",
                                   node_mask_type="object",
                                   model_config=dict(mode="multiclass_classification", task_level="graph",
                                                     return_type="raw"))
        self.sign, self.k = sign, k
        self._add_state("sum", exact=True)
        self._add_state("count")

    def update(self, x, edge_index, batch, scores, predicted) -> None:
        from torch_geometric.explain import Explanation
        from torch_geometric.explain.metric import fidelity

        graphs = GraphBatch.of(batch, x.shape[0])
        dense = graphs.dense_nodes(scores.to(torch.float64)).masked_fill(~graphs.node_mask(), -float("inf"))
        top = dense.topk(min(self.k, dense.shape[1]), dim=1).indices
        hard = torch.zeros_like(dense).scatter_(1, top, 1.0)[graphs.graph, graphs.position]
        explanation = Explanation(node_mask=hard[:, None].to(x.dtype), x=x, edge_index=edge_index, target=predicted)
        explanation.batch = batch
        explanation._model_args = ["batch"]
        positive, negative = fidelity(self.explainer, explanation)
        value = positive if self.sign == "plus" else negative
        self._add("sum", exact_sum(torch.tensor([value * graphs.num_graphs], dtype=torch.float64)))
        self._add("count", torch.tensor(graphs.num_graphs))

    def compute(self) -> ScalarResult:
        count = int(self._state["count"].item())
        return ScalarResult(name=f"fidelity_{self.sign}", value=float(self._value("sum")) / count, count=count)


def motif_metrics(model, method_names, fidelity: bool = True) -> Dict[str, List[Accumulator]]:
    """The metrics per method. ``fidelity=False`` leaves PyG's fidelity out: it masks node
    features and keeps every edge, which says nothing about a model that reads the structure
    alone (the built-in Graphormer: zeroing every node feature changes none of its 200 test
    predictions, through its degree and distance encodings)."""
    forward = lambda x, edge_index, batch: model(x, edge_index, batch)  # noqa: E731
    fidelities = lambda name: [Fidelity(model, name, "plus"), Fidelity(model, name, "minus")] if fidelity else []  # noqa: E731
    return {name: [NodeAUROC(), NodeActivation(forward), NodePruning(forward), *fidelities(name), ClassSpecificity()]
            for name in method_names}


#: How a model takes one batch of graphs for ``attribute``: ``arguments(data, device)`` -> keyword arguments.
AttributeArguments = Callable[[Any, torch.device], Dict[str, Any]]


def pyg_arguments(data, device) -> Dict[str, Any]:
    """A PyG model's ``attribute`` arguments: the node features explained, edges and batch passed on."""
    return dict(inputs=data.x.to(device), additional_forward_args=(data.edge_index.to(device), data.batch.to(device)))


def node_scores(explainer, data, target, device, arguments: AttributeArguments) -> torch.Tensor:
    """The explainer's float64 node scores (N,) of the graphs of ``data`` for ``target``, in the flat
    batch's node order (every adapter of a graph model returns them (B, N_max) per graph)."""
    tokens = explainer.attribute(**arguments(data, device), target=target,
                                 return_tokens=True).detach().to(torch.float64).cpu()
    graphs = GraphBatch.of(data.batch, data.x.shape[0])
    if tokens.shape != (graphs.num_graphs, graphs.max_nodes):
        raise CaptureError(f"node scores of shape {tuple(tokens.shape)} for {graphs.num_graphs} graphs of at most "
                         f"{graphs.max_nodes} nodes; expected ({graphs.num_graphs}, {graphs.max_nodes}).")
    return tokens[graphs.graph, graphs.position]


def update_motif_metrics(model, explainers, metrics, data, pairs, explain: str, device,
                         arguments: AttributeArguments = pyg_arguments) -> None:
    """Explain one batch of single-motif graphs (``data``) and two-motif graphs (``pairs``).

    ``model(x, edge_index, batch)`` gives the logits (the metrics' forward); ``arguments`` turns
    a batch of graphs into the explainers' ``attribute`` arguments (default: a PyG model's)."""
    with torch.no_grad():
        predicted = model(data.x.to(device), data.edge_index.to(device), data.batch.to(device)).argmax(-1).cpu()
    target = data.labels if explain == "label" else predicted
    pair_graphs = GraphBatch.of(pairs.batch, pairs.x.shape[0])
    house = pair_graphs.dense_nodes((pairs.motif == 0).double())[..., None]
    cycle = pair_graphs.dense_nodes((pairs.motif == 1).double())[..., None]
    classes = torch.zeros(pairs.num_graphs, dtype=torch.long)
    for name, explainer in explainers.items():
        auroc, activation, pruning, *fidelities, specificity = metrics[name]
        scores = node_scores(explainer, data, target.to(device), device, arguments)
        auroc.update(scores, data.node_truth, data.batch)
        activation.update(data.x, data.edge_index, data.batch, scores, data.labels)
        pruning.update(data.x, data.edge_index, data.batch, scores)
        for fidelity in fidelities:
            fidelity.update(data.x, data.edge_index, data.batch, scores, predicted)
        for_house = pair_graphs.dense_nodes(node_scores(explainer, pairs, classes.to(device), device,
                                                         arguments))[..., None]
        for_cycle = pair_graphs.dense_nodes(node_scores(explainer, pairs, (classes + 1).to(device), device,
                                                         arguments))[..., None]
        specificity.update(for_house, for_cycle, house, cycle)
