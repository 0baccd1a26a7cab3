"""TransformerExplainer: every method under PyG's Explainer, batched, equal to the Captum path."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_geometric")

from torch_geometric.explain import Explainer  # noqa: E402
from torch_geometric.explain.metric import fidelity  # noqa: E402

from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.integrations.pyg import TransformerExplainer, edge_relevance  # noqa: E402
from captum_transformers.integrations.pyg.edges import VARIANTS  # noqa: E402
from captum_transformers.methods.catalog import METHOD_FACTORIES  # noqa: E402
from pyg_models import graph_classifier, graphs  # noqa: E402
from test_pyg_attention import APPLIES  # noqa: E402

MODEL_CONFIG = dict(mode="multiclass_classification", task_level="graph", return_type="raw")


def _explainer(model, method, node_mask_type="attributes", **options):
    return Explainer(model, TransformerExplainer(method, **options), explanation_type="model",
                     node_mask_type=node_mask_type, edge_mask_type="object", model_config=MODEL_CONFIG)


@pytest.mark.parametrize("method", APPLIES["GATConv"])
def test_the_pyg_explainer_path_equals_the_captum_path(method, tmp_path):
    model = graph_classifier("GATConv")
    _, (x, edge_index, batch) = graphs()
    explainer = _explainer(model, method)
    explanation = explainer(x, edge_index, batch=batch)
    predicted = model(x, edge_index, batch).argmax(-1)
    captum = METHOD_FACTORIES[method](model).attribute(x, additional_forward_args=(edge_index, batch),
                                                       target=predicted)
    torch.testing.assert_close(explanation.node_mask, captum, rtol=0, atol=0)
    assert explanation.edge_mask.shape == (edge_index.shape[1],) and torch.isfinite(explanation.edge_mask).all()
    positive, negative = fidelity(explainer, explanation)
    assert 0.0 <= positive <= 1.0 and 0.0 <= negative <= 1.0
    path = tmp_path / "graph.png"
    explanation.visualize_graph(str(path), backend="networkx")
    assert path.stat().st_size > 0


def test_node_objects_and_lrp_edges():
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs()
    explanation = _explainer(model, "conservative-lrp", node_mask_type="object")(x, edge_index, batch=batch)
    predicted = model(x, edge_index, batch).argmax(-1)
    expected = edge_relevance(model, x, edge_index, batch=batch, target=predicted, rules=VARIANTS["AH+LN"])
    torch.testing.assert_close(explanation.edge_mask, expected.edge_mask)
    torch.testing.assert_close(explanation.node_mask[:, 0], expected.nodes.sum(-1))
    tokens = _explainer(model, "rollout", node_mask_type="object")(x, edge_index, batch=batch).node_mask
    assert tokens.shape == (x.shape[0], 1)


def test_node_level_explanations_equal_the_captum_path():
    from test_pyg_attention import NodeClassifier

    model = NodeClassifier("TransformerConv").eval()
    _, (x, edge_index, batch) = graphs()
    for method in ("generic-attention", "conservative-lrp"):
        explainer = Explainer(model, TransformerExplainer(method), explanation_type="model",
                              node_mask_type="attributes", edge_mask_type="object",
                              model_config=dict(mode="multiclass_classification", task_level="node",
                                                return_type="raw"))
        index = torch.tensor([10, 1, 5])  # one node of each graph, in any order
        explanation = explainer(x, edge_index, index=index, batch=batch)
        predicted = model(x, edge_index, batch).argmax(-1)
        pairs = [(node, int(predicted[node])) for node in (1, 5, 10)]
        captum = METHOD_FACTORIES[method](model).attribute(x, additional_forward_args=(edge_index, batch),
                                                           target=pairs)
        torch.testing.assert_close(explanation.node_mask, captum, rtol=0, atol=0)
        with pytest.raises(InputError, match="exactly one node of each"):
            explainer(x, edge_index, index=torch.tensor([1, 2, 5]), batch=batch)


def test_unsupported_settings_are_refused():
    model = graph_classifier("GATConv")
    with pytest.raises(InputError, match="task_level=edge"):
        Explainer(model, TransformerExplainer("rollout"), explanation_type="model", node_mask_type="object",
                  model_config=dict(mode="multiclass_classification", task_level="edge", return_type="raw"))
    with pytest.raises(InputError, match="CaptumExplainer"):
        TransformerExplainer("saliency")


def test_gps_models_under_the_explainer():
    from captum_transformers.adapters.graph.pyg_gps import PyGGPSAdapter
    from pyg_models import gps_classifier

    model = gps_classifier()
    _, (x, edge_index, batch) = graphs()
    predicted = model(x, edge_index, batch).argmax(-1)
    for method, options in (("conservative-lrp-ah", {}),
                            ("rollout", {"adapter": PyGGPSAdapter(ignore_local_branch=True)})):
        explanation = _explainer(model, method, **options)(x, edge_index, batch=batch)
        captum = METHOD_FACTORIES[method](model, **options).attribute(x, additional_forward_args=(edge_index, batch),
                                                                      target=predicted)
        torch.testing.assert_close(explanation.node_mask, captum, rtol=0, atol=0)
        assert explanation.edge_mask.shape == (edge_index.shape[1],)
