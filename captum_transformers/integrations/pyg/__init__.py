"""The PyG bridge: edge relevance of graph attention layers and an ``ExplainerAlgorithm``
running every method of the package under ``torch_geometric.explain.Explainer``."""
from .edges import EdgeRelevance, edge_relevance

__all__ = ["EdgeRelevance", "edge_relevance", "TransformerExplainer"]


def __getattr__(name):  # torch_geometric is imported only when the explainer is asked for
    if name == "TransformerExplainer":
        from .explainer import TransformerExplainer

        return TransformerExplainer
    raise AttributeError(name)
