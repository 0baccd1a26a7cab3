"""Every method of the package as a PyG ``ExplainerAlgorithm``.

``TransformerExplainer(method, **options)`` plugs into ``torch_geometric.explain.Explainer``,
so PyG's thresholds, fidelity metrics and ``visualize_graph`` work with any method, on a whole
batch of graphs in one call (``batch=`` passed to the explainer as to the model).

Masks (per-graph or per-node targets are the explainer's):

Node-level tasks (``task_level="node"``): ``index`` names the explained node, one per graph
of the batch (one node for one graph), explained for its target class.

* ``node_mask_type="attributes"``: the method's attribution shaped like ``x`` (N, F), the
  Captum path's ``attribute(x, additional_forward_args=(edge_index,), forward_kwargs=...)``
  exactly; ``"object"``: one score per node (N, 1): its node score (attention methods) or the
  sum of its features' relevance (LRP methods).
* ``edge_mask_type="object"``: for the LRP methods (ConservativeLRP's variants, AttnLRP) on
  models with sparse attention layers, the edge relevance of their rule set summed over layers
  (:mod:`.edges`: the relevance of the message along each edge, conserved layer by layer);
  otherwise (the attention methods, which score nodes and not edges; GPS models, whose global
  attention sends no per-edge messages) the mean of the two endpoints' node scores: a view of
  the node map on the edges, not an edge attribution.

Example::

    >>> from torch_geometric.explain import Explainer
    >>> explainer = Explainer(model, TransformerExplainer("generic-attention"), explanation_type="model",
    ...                       node_mask_type="attributes", edge_mask_type="object",
    ...                       model_config=dict(mode="multiclass_classification", task_level="graph",
    ...                                         return_type="raw"))
    >>> explanation = explainer(x, edge_index, batch=batch)      # every graph of the batch
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch_geometric.explain import Explanation
from torch_geometric.explain.algorithm import ExplainerAlgorithm
from torch_geometric.explain.config import ExplanationType, MaskType, ModelMode, ModelTaskLevel

from ...adapters.graph.nodes import GraphBatch
from ...adapters.graph.pyg_layer_hooks import layer_key
from ...errors import InputError
from ...methods.catalog import CAPTUM_BASELINES, METHOD_FACTORIES, resolve_method_names
from ...methods.lrp import RuleGradientXInput
from .edges import edge_relevance


class TransformerExplainer(ExplainerAlgorithm):
    """A method of the package (a catalog name such as ``"generic-attention"`` or
    ``"conservative-lrp"``, or a method class) as a PyG explainer algorithm; ``options`` go to
    the method (e.g. ``variant="AH"``, ``adapter=PyGAttentionAdapter(readout="mean")``)."""

    def __init__(self, method: Union[str, Callable], **options: Any) -> None:
        super().__init__()
        if isinstance(method, str):
            (method,) = resolve_method_names([method])
            if method in CAPTUM_BASELINES:
                raise InputError(f"{method!r} is Captum's own method; PyG's CaptumExplainer runs it on graphs.")
            factory = METHOD_FACTORIES[method]
        elif callable(method):
            factory = method
        else:
            raise InputError(f"method must be a catalog name or a method class, got {type(method).__name__}.")
        self.method_name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        self.factory = factory
        self.options = options

    def supports(self) -> bool:
        config, model = self.explainer_config, self.model_config
        problems = []
        if config.node_mask_type not in (None, MaskType.object, MaskType.attributes):
            problems.append(f"node_mask_type={config.node_mask_type.value} (use 'attributes' or 'object')")
        if config.edge_mask_type not in (None, MaskType.object):
            problems.append(f"edge_mask_type={config.edge_mask_type.value} (use 'object')")
        if model.task_level not in (ModelTaskLevel.graph, ModelTaskLevel.node):
            problems.append(f"task_level={model.task_level.value} (graph- or node-level tasks)")
        if model.mode != ModelMode.multiclass_classification:
            problems.append(f"mode={model.mode.value} (multiclass_classification: one score column per class)")
        if problems:
            raise InputError(f"TransformerExplainer({self.method_name!r}) does not support "
                             + "; ".join(problems) + ".")
        return config.explanation_type in (ExplanationType.model, ExplanationType.phenomenon)

    def forward(self, model: torch.nn.Module, x: torch.Tensor, edge_index: torch.Tensor, *, target: torch.Tensor,
                index: Optional[Union[int, torch.Tensor]] = None, **kwargs: Any) -> Explanation:
        if self.model_config.task_level == ModelTaskLevel.node:
            target = _node_pairs(index, target, kwargs.get("batch"), x.shape[0])
        elif index is not None:
            raise InputError("index= names the explained node of a node-level task; this explainer was configured "
                             "with task_level='graph'.")
        if isinstance(x, dict):
            raise InputError("TransformerExplainer explains homogeneous graphs (x a tensor), not heterogeneous ones.")
        method = self.factory(model, **self.options)
        config = self.explainer_config
        edge_mask = None
        if isinstance(method, RuleGradientXInput) and any(layer_key(m) for m in model.modules()):
            with method.stochastic_rule():  # the method's allow_stochastic holds on this path too
                relevance = edge_relevance(model, x, edge_index, target=target, rules=method.rules,
                                           adapter=method.adapter, **kwargs)
            attributes, edge_mask = relevance.nodes, relevance.edge_mask
            node_scores = attributes.reshape(attributes.shape[0], -1).sum(-1)
        elif isinstance(method, RuleGradientXInput):  # no sparse attention layer (GPS): no messages to read
            attributes = method.attribute(x, target=target, additional_forward_args=(edge_index,),
                                          forward_kwargs=kwargs)
            node_scores = attributes.reshape(attributes.shape[0], -1).sum(-1)
        else:
            graphs = GraphBatch.of(kwargs.get("batch"), x.shape[0])
            tokens = method.attribute(x, target=target, additional_forward_args=(edge_index,), forward_kwargs=kwargs,
                                      return_tokens=True)
            node_scores = tokens[graphs.graph, graphs.position]
            # The Captum path's input-shaped map: each node's score over its features.
            attributes = node_scores[:, None].expand(x.shape).contiguous()
        if edge_mask is None:
            edge_mask = (node_scores[edge_index[0]] + node_scores[edge_index[1]]) / 2
        node_mask = None
        if config.node_mask_type == MaskType.attributes:
            node_mask = attributes.detach()
        elif config.node_mask_type == MaskType.object:
            node_mask = node_scores.detach()[:, None]
        return Explanation(node_mask=node_mask,
                           edge_mask=edge_mask.detach() if config.edge_mask_type == MaskType.object else None)


def _node_pairs(index, target: torch.Tensor, batch, num_nodes: int) -> list:
    """(node, class) target pairs from PyG's ``index`` (one explained node per graph) and its
    per-node ``target``."""
    if index is None:
        raise InputError("A node-level explanation needs index= (the explained node, one per graph of the batch).")
    nodes = [int(index)] if isinstance(index, int) or (isinstance(index, torch.Tensor) and index.dim() == 0) \
        else [int(i) for i in index]
    graphs = GraphBatch.of(batch, num_nodes)
    order = sorted(nodes, key=lambda node: int(graphs.graph[node]))
    if [int(graphs.graph[node]) for node in order] != list(range(graphs.num_graphs)):
        raise InputError(f"index={nodes} must name exactly one node of each of the {graphs.num_graphs} graphs: "
                         "nodes of one graph share a backward pass; explain them in separate calls.")
    return [(node, int(target[node])) for node in order]
