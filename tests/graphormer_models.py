"""Tiny Graphormers from configs and small random graphs, shared by the Graphormer tests."""
from __future__ import annotations

import random
from typing import Dict, List

import torch


def config(**overrides):
    from captum_transformers.models import GraphormerConfig

    values = dict(num_classes=3, num_hidden_layers=2, embedding_dim=16, ffn_embedding_dim=24, num_attention_heads=4,
                  num_atoms=1100, num_edges=600, num_in_degree=12, num_out_degree=12, num_spatial=512,
                  num_edge_dis=6, multi_hop_max_dist=4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    values.update(overrides)
    return GraphormerConfig(**values)


def model(seed: int = 0, dtype=torch.float32, **overrides):
    from captum_transformers.models import GraphormerForGraphClassification

    torch.manual_seed(seed)
    built = GraphormerForGraphClassification(config(**overrides)).to(dtype).eval()
    # Non-zero encodings everywhere (HF init leaves the padding rows at 0, which stay 0).
    with torch.no_grad():
        for name, parameter in built.named_parameters():
            if "graph_attn_bias" in name or "virtual" in name:
                parameter.normal_(0.0, 0.5)
                if "spatial_pos_encoder" in name or "edge_encoder" in name:
                    parameter[0].zero_()
    return built


def random_graph(num_nodes: int, seed: int, num_features: int = 2, num_edge_features: int = 2,
                 connected: bool = True) -> Dict[str, torch.Tensor]:
    """An undirected random graph (both directions stored, PyG-style), a ring when
    ``connected`` plus random chords; node and edge features in [0, 5)."""
    rng = random.Random(seed)
    pairs = set()
    if connected:
        pairs |= {(i, (i + 1) % num_nodes) for i in range(num_nodes)} if num_nodes > 1 else set()
    for _ in range(num_nodes):
        i, j = rng.randrange(num_nodes), rng.randrange(num_nodes)
        if i != j:
            pairs.add((i, j))
    directed = sorted({p for i, j in pairs for p in ((i, j), (j, i))})
    edge_index = torch.tensor(directed, dtype=torch.long).t().reshape(2, -1)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 5, (num_nodes, num_features), generator=generator)
    edge_attr = torch.randint(0, 5, (edge_index.shape[1], num_edge_features), generator=generator)
    return {"x": x, "edge_index": edge_index, "edge_attr": edge_attr}


def graphs(sizes=(5, 3, 7), seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    return [random_graph(n, seed + k) for k, n in enumerate(sizes)]


def batch(graph_list, **collator_options):
    """``(input_nodes, the other inputs by name)`` for ``attribute(nodes, forward_kwargs=rest)``."""
    from captum_transformers.models import GraphormerCollator

    collated = GraphormerCollator(**collator_options)(graph_list)
    collated.pop("labels", None)
    return collated.pop("input_nodes"), collated
