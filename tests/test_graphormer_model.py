"""The package's Graphormer and its collator against slow references written from the paper
(Ying et al., NeurIPS 2021, Eq. 5-7) and from plain-Python graph search."""
from __future__ import annotations

import collections
import math

import pytest
import torch

pytest.importorskip("transformers")

from captum_transformers.errors import InputError  # noqa: E402
from captum_transformers.models import GraphormerCollator, GraphormerForGraphClassification  # noqa: E402
from graphormer_models import batch, config, graphs, model, random_graph  # noqa: E402


# -- collator -----------------------------------------------------------------------------
def _bfs(num_nodes, edges):
    """Hop distances from every node (None: unreachable), plain Python."""
    out = collections.defaultdict(list)
    for i, j in edges:
        out[i].append(j)
    table = []
    for source in range(num_nodes):
        seen = {source: 0}
        queue = collections.deque([source])
        while queue:
            node = queue.popleft()
            for nxt in out[node]:
                if nxt not in seen:
                    seen[nxt] = seen[node] + 1
                    queue.append(nxt)
        table.append([seen.get(target) for target in range(num_nodes)])
    return table


def _floyd_path(num_nodes, edges):
    """Floyd-Warshall's recorded intermediate node per pair (the last strict improvement) and
    the recursive path expansion, as nested Python lists: 4.x's choice among tied paths."""
    inf = 510
    dist = [[0 if i == j else inf for j in range(num_nodes)] for i in range(num_nodes)]
    for i, j in edges:
        if i != j:
            dist[i][j] = 1
    via = [[-1] * num_nodes for _ in range(num_nodes)]
    for k in range(num_nodes):
        for i in range(num_nodes):
            for j in range(num_nodes):
                if dist[i][k] + dist[k][j] < dist[i][j]:
                    dist[i][j] = dist[i][k] + dist[k][j]
                    via[i][j] = k

    def inner(i, j):
        k = via[i][j]
        return [] if k == -1 else inner(i, k) + [k] + inner(k, j)

    return lambda i, j: [i] + inner(i, j) + [j]


def _directed_graph(num_nodes, seed, num_features=3):
    """Directed, possibly disconnected; every edge gets a unique id as its first feature."""
    import random

    rng = random.Random(seed)
    edges = sorted({(rng.randrange(num_nodes), rng.randrange(num_nodes)) for _ in range(2 * num_nodes)})
    edges = [(i, j) for i, j in edges if i != j]
    edge_index = torch.tensor(edges, dtype=torch.long).t().reshape(2, -1)
    edge_attr = torch.stack([torch.arange(len(edges)), torch.randint(0, 3, (len(edges),))], dim=1)
    return {"x": torch.randint(0, 7, (num_nodes, num_features)), "edge_index": edge_index, "edge_attr": edge_attr}, edges


def test_collator_matches_python_bfs_and_path_search():
    cases = [_directed_graph(n, seed) for seed, n in enumerate((6, 1, 9, 4, 8))]
    collated = GraphormerCollator(spatial_pos_max=4)([graph for graph, _ in cases])
    width = max(graph["x"].shape[0] for graph, _ in cases)
    assert collated["input_nodes"].shape == (len(cases), width, 3)
    for b, (graph, edges) in enumerate(cases):
        n = graph["x"].shape[0]
        distance = _bfs(n, edges)
        path = _floyd_path(n, edges)
        edge_id = {edge: e for e, edge in enumerate(edges)}
        assert torch.equal(collated["input_nodes"][b, :n], graph["x"] + torch.tensor([3, 515, 1027]))
        assert not collated["input_nodes"][b, n:].any()
        for i in range(n):
            assert collated["in_degree"][b, i] == sum(1 for s, _ in edges if s == i) + 1
            for j in range(n):
                d = distance[i][j]
                assert collated["spatial_pos"][b, i, j] == (511 if d is None else d + 1)
                blocked = collated["attn_bias"][b, 1 + i, 1 + j] == float("-inf")
                assert bool(blocked) == (d is None or d + 1 >= 4)
                hops = collated["input_edges"][b, i, j]
                if d is None or d == 0:
                    assert not hops.any()
                    continue
                # Feature 0 decodes the edge of each hop: a walk i -> j of exactly d edges ...
                walk = [edges[int(h) - 3] for h in hops[:d, 0]]
                assert walk[0][0] == i and walk[-1][1] == j
                assert all(a[1] == b_[0] for a, b_ in zip(walk, walk[1:]))
                # ... the one 4.x's Floyd-Warshall records, with 0 beyond it.
                nodes = path(i, j)
                assert [edge_id[(p, q)] + 3 for p, q in zip(nodes, nodes[1:])] == hops[:d, 0].tolist()
                assert not hops[d:].any()
        assert not collated["spatial_pos"][b, n:].any() and not collated["spatial_pos"][b, :, n:].any()
        assert not collated["in_degree"][b, n:].any()
    assert torch.equal(collated["in_degree"], collated["out_degree"])


def test_collator_accepts_pyg_data_and_refuses_float_features():
    data_module = pytest.importorskip("torch_geometric.data")
    graph = random_graph(5, 3)
    from_dict = GraphormerCollator()([graph])
    from_data = GraphormerCollator()([data_module.Data(**graph)])
    assert from_dict.keys() == from_data.keys()
    assert all(torch.equal(from_dict[key], from_data[key]) for key in from_dict)
    with pytest.raises(InputError, match="integer features"):
        GraphormerCollator()([{**graph, "x": graph["x"].float()}])
    with pytest.raises(InputError, match="edge_index"):
        GraphormerCollator()([{**graph, "edge_index": graph["edge_index"] + 10}])


# -- forward ------------------------------------------------------------------------------
def _layer_norm(x, norm):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def _reference_logits(net, graph, spatial_pos_max=20):
    """One graph, no padding, from the paper's equations with explicit loops over heads,
    pairs and path hops; the path and distances from the Python Floyd-Warshall above."""
    cfg = net.config
    encoder = net.encoder.graph_encoder
    features, bias_module = encoder.graph_node_feature, encoder.graph_attn_bias
    x, edge_index, edge_attr = graph["x"], graph["edge_index"], graph["edge_attr"]
    n, heads = x.shape[0], cfg.num_attention_heads
    edges = [tuple(e) for e in edge_index.t().tolist()]
    edge_row = {edge: e for e, edge in enumerate(edges)}
    distance, path = _bfs(n, edges), _floyd_path(n, edges)
    degree = [sum(1 for s, _ in edges if s == i) for i in range(n)]
    offsets = 512 * torch.arange(x.shape[1])
    # Eq. 5: node features summed, plus degree embeddings; the graph token first.
    h = [features.graph_token.weight[0]]
    for i in range(n):
        h.append(features.atom_encoder.weight[x[i] + offsets + 3].sum(0) + features.in_degree_encoder.weight[degree[i] + 1]
                 + features.out_degree_encoder.weight[degree[i] + 1])
    h = torch.stack(h)
    # Eq. 6-7: the bias per head and pair.
    virtual = bias_module.graph_token_virtual_distance.weight[0]
    hop_matrices = bias_module.edge_dis_encoder.weight.reshape(-1, heads, heads)
    bias = torch.zeros(heads, n + 1, n + 1, dtype=h.dtype)
    bias[:, 0, :] += virtual[:, None]
    bias[:, 1:, 0] += virtual[:, None]
    for i in range(n):
        for j in range(n):
            d = distance[i][j]
            spatial = 511 if d is None else d + 1
            bias[:, 1 + i, 1 + j] += bias_module.spatial_pos_encoder.weight[spatial]
            if spatial >= spatial_pos_max:  # unreachable pairs (511) too, as 4.x
                bias[:, 1 + i, 1 + j] = float("-inf")
            if d is None or d == 0:
                continue
            nodes = path(i, j)
            used = min(d, cfg.multi_hop_max_dist)
            total = torch.zeros(heads, dtype=h.dtype)
            for hop in range(used):
                e = edge_row[(nodes[hop], nodes[hop + 1])]
                embedded = bias_module.edge_encoder.weight[edge_attr[e] + offsets + 3].mean(0)
                total = total + embedded @ hop_matrices[hop]
            bias[:, 1 + i, 1 + j] += total / used
    scale = (cfg.embedding_dim // heads) ** -0.5
    for layer in encoder.layers:
        attention = layer.self_attn
        branch = _layer_norm(h, layer.self_attn_layer_norm) if cfg.pre_layernorm else h
        q, k, v = (proj(branch).reshape(n + 1, heads, -1).transpose(0, 1)
                   for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
        heads_out = []
        for head in range(heads):
            probs = torch.softmax(q[head] @ k[head].T * scale + bias[head], dim=-1)
            heads_out.append(probs @ v[head])
        h = h + attention.out_proj(torch.cat(heads_out, dim=-1))
        h = h if cfg.pre_layernorm else _layer_norm(h, layer.self_attn_layer_norm)
        branch = _layer_norm(h, layer.final_layer_norm) if cfg.pre_layernorm else h
        h = h + layer.fc2(torch.nn.functional.gelu(layer.fc1(branch)))
        h = h if cfg.pre_layernorm else _layer_norm(h, layer.final_layer_norm)
    head = net.encoder
    token = _layer_norm(torch.nn.functional.gelu(head.lm_head_transform_weight(h[0])), head.layer_norm)
    return net.classifier.classifier(token) + net.classifier.lm_output_learned_bias


@pytest.mark.parametrize("pre_layernorm", [False, True], ids=["post-LN", "pre-LN"])
def test_forward_equals_per_graph_reference(pre_layernorm):
    net = model(seed=1, dtype=torch.float64, pre_layernorm=pre_layernorm, multi_hop_max_dist=2)
    graph_list = graphs((6, 3, 8), seed=4) + [_directed_graph(5, 11, num_features=2)[0]]
    nodes, rest = batch(graph_list, spatial_pos_max=4)
    with torch.no_grad():
        logits = net(nodes, **rest).logits
        for b, graph in enumerate(graph_list):
            expected = _reference_logits(net, graph, spatial_pos_max=4)
            torch.testing.assert_close(logits[b], expected, rtol=1e-10, atol=1e-10)


def test_save_and_load_round_trip_with_4x_key_names(tmp_path):
    net = model(seed=2, pre_layernorm=True, encoder_normalize_before=True)
    nodes, rest = batch(graphs())
    net.save_pretrained(tmp_path)
    loaded = GraphormerForGraphClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.model_type == "graphormer" and loaded.config.pre_layernorm
    with torch.no_grad():
        assert torch.equal(net(nodes, **rest).logits, loaded(nodes, **rest).logits)
    # The key names of transformers 4.x's GraphormerForGraphClassification (read from its source),
    # for a pre-LN encoder with emb_layer_norm and 2 layers: a state dict under them loads strictly.
    layer = ["self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
             "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.out_proj.weight",
             "self_attn.out_proj.bias", "self_attn_layer_norm.weight", "self_attn_layer_norm.bias", "fc1.weight",
             "fc1.bias", "fc2.weight", "fc2.bias", "final_layer_norm.weight", "final_layer_norm.bias"]
    encoder = ["graph_node_feature.atom_encoder.weight", "graph_node_feature.in_degree_encoder.weight",
               "graph_node_feature.out_degree_encoder.weight", "graph_node_feature.graph_token.weight",
               "graph_attn_bias.edge_encoder.weight", "graph_attn_bias.edge_dis_encoder.weight",
               "graph_attn_bias.spatial_pos_encoder.weight", "graph_attn_bias.graph_token_virtual_distance.weight",
               "emb_layer_norm.weight", "emb_layer_norm.bias", "final_layer_norm.weight", "final_layer_norm.bias"]
    encoder += [f"layers.{i}.{name}" for i in range(2) for name in layer]
    keys = [f"encoder.graph_encoder.{name}" for name in encoder]
    keys += ["encoder.lm_head_transform_weight.weight", "encoder.lm_head_transform_weight.bias",
             "encoder.layer_norm.weight", "encoder.layer_norm.bias", "classifier.lm_output_learned_bias",
             "classifier.classifier.weight"]
    state = net.state_dict()
    assert sorted(state) == sorted(keys)
    fresh = GraphormerForGraphClassification(config(pre_layernorm=True, encoder_normalize_before=True)).eval()
    fresh.load_state_dict({key: state[key].clone() for key in keys}, strict=True)
    with torch.no_grad():
        assert torch.equal(net(nodes, **rest).logits, fresh(nodes, **rest).logits)


def test_unsupported_options_are_refused():
    with pytest.raises(NotImplementedError, match="q_noise"):
        model(q_noise=0.1)
    assert math.isclose(config().hidden_size, 16)
