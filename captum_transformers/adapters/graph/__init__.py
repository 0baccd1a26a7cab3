"""Graph models: PyG's attention layers (TransformerConv, GAT, GATv2, GPSConv) and Graphormer, with
the graph bookkeeping (nodes, pooling, readouts, refusals) they share.
"""
from .graphormer import GraphormerAdapter
from .pyg_attention import PyGAttentionAdapter
from .pyg_gps import PyGGPSAdapter

__all__ = ["GraphormerAdapter", "PyGAttentionAdapter", "PyGGPSAdapter"]
