r"""Graphormer (Ying et al., "Do Transformers Really Perform Bad for Graph Representation?",
NeurIPS 2021) for transformers-5 users, with the module names and state-dict keys of
transformers 4.x's ``GraphormerForGraphClassification`` (4.42-4.57 kept it under
``models/deprecated/graphormer``; transformers 5 removed it), so checkpoints saved there load.

The model, per graph with nodes ``v_1..v_n`` and a graph token ``v_0`` (Sec. 3.1-3.2):

.. math::
    h_i^{(0)} = \sum_f x_{\mathrm{atom}}(v_i, f) + z^-_{\deg^-(v_i)} + z^+_{\deg^+(v_i)}, \qquad
    h_0^{(0)} = g \\
    A_{ij} = \frac{(h_i W_Q)(h_j W_K)^\top}{\sqrt{d}} + b_{\phi(v_i, v_j)} + c_{ij}, \qquad
    c_{ij} = \frac{1}{N} \sum_{n=1}^{N} \bar x_{e_n} W^E_n

``b`` is the spatial encoding (one learned scalar per head and shortest-path distance
``phi``), ``c`` the edge encoding (the mean over the shortest path's edges ``e_n`` of their
embedded features times a per-hop ``H x H`` matrix, ``N`` the path length, at most
``multi_hop_max_dist`` hops), and the graph token's row and column get a learned "virtual
distance" ``t`` instead of ``b``. All three are per-head *additive* terms of the scores:
nothing in them depends on the hidden states. Each layer is post-LN by default
(``pre_layernorm=False``): ``h = LN(h + MHA(h))``, ``h = LN(h + FFN(h))``; pre-LN applies the
norms to the branch inputs. The graph token's last hidden state feeds the head.

Like the 4.x code (itself fairseq's), hidden states are sequence-first ``(T, B, C)`` with
``T = 1 + N_max``, the attention probabilities are ``(B * H, T, T)`` from
``bmm(q, k^T) + bias``, masked at padding keys, softmax, then the ``attention_dropout_module``
child, then ``bmm(probs, v)``: the dropout child's input is every attention map, which is
where :mod:`captum_transformers.adapters.graph.graphormer` observes it. Two 4.x behaviours kept for
checkpoint compatibility: ``attn_bias`` is added twice (it only holds 0 or ``-inf``), and a
pre-LN encoder's ``final_layer_norm`` exists but is not applied.

Inputs (made by :class:`~captum_transformers.models.graph_collator.GraphormerCollator`), all
integer indices shifted by one so that 0 is padding: ``input_nodes`` (B, N, F),
``input_edges`` (B, N, N, D, Fe), ``attn_bias`` (B, N+1, N+1) float, ``in_degree`` /
``out_degree`` (B, N), ``spatial_pos`` (B, N, N), ``attn_edge_type`` (B, N, N, Fe).

Example::

    >>> from captum_transformers.models import GraphormerConfig, GraphormerForGraphClassification
    >>> config = GraphormerConfig(num_classes=2, num_hidden_layers=2, embedding_dim=32, ffn_embedding_dim=32,
    ...                           num_attention_heads=4)
    >>> model = GraphormerForGraphClassification(config).eval()
    >>> logits = model(**batch).logits              # batch = GraphormerCollator()(graphs)
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

try:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.activations import ACT2FN
    from transformers.modeling_outputs import BaseModelOutputWithNoAttention, SequenceClassifierOutput
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("captum_transformers.models.graphormer needs transformers: pip install "
                      "'captum_transformers[hf]'.") from error


class GraphormerConfig(PretrainedConfig):
    """The 4.x configuration fields, with the same names and defaults (``model_type="graphormer"``).

    ``num_atoms`` / ``num_edges``: node / edge feature vocabulary (after the collator's offsets);
    ``num_in_degree`` / ``num_out_degree`` / ``num_spatial`` / ``num_edge_dis``: sizes of the
    degree, distance and per-hop tables; ``multi_hop_max_dist``: hops of a path the edge
    encoding averages; ``edge_type``: ``"multi_hop"`` (path edges, Eq. 7) or any other value
    (only direct edges, ``attn_edge_type``); ``pre_layernorm``: pre-LN instead of post-LN.
    ``q_noise > 0`` (quantisation noise in training) is not implemented and refused.
    """

    model_type = "graphormer"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, num_classes: int = 1, num_atoms: int = 512 * 9, num_edges: int = 512 * 3,
                 num_in_degree: int = 512, num_out_degree: int = 512, num_spatial: int = 512,
                 num_edge_dis: int = 128, multi_hop_max_dist: int = 5, spatial_pos_max: int = 1024,
                 edge_type: str = "multi_hop", max_nodes: int = 512, share_input_output_embed: bool = False,
                 num_hidden_layers: int = 12, embedding_dim: int = 768, ffn_embedding_dim: int = 768,
                 num_attention_heads: int = 32, dropout: float = 0.1, attention_dropout: float = 0.1,
                 activation_dropout: float = 0.1, layerdrop: float = 0.0, encoder_normalize_before: bool = False,
                 pre_layernorm: bool = False, apply_graphormer_init: bool = False, activation_fn: str = "gelu",
                 embed_scale: Optional[float] = None, freeze_embeddings: bool = False,
                 num_trans_layers_to_freeze: int = 0, traceable: bool = False, q_noise: float = 0.0,
                 qn_block_size: int = 8, kdim: Optional[int] = None, vdim: Optional[int] = None, bias: bool = True,
                 self_attention: bool = True, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2,
                 **kwargs):
        self.num_classes, self.num_atoms, self.num_edges = num_classes, num_atoms, num_edges
        self.num_in_degree, self.num_out_degree, self.num_spatial = num_in_degree, num_out_degree, num_spatial
        self.num_edge_dis, self.multi_hop_max_dist, self.spatial_pos_max = num_edge_dis, multi_hop_max_dist, spatial_pos_max
        self.edge_type, self.max_nodes, self.share_input_output_embed = edge_type, max_nodes, share_input_output_embed
        self.num_hidden_layers, self.embedding_dim, self.hidden_size = num_hidden_layers, embedding_dim, embedding_dim
        self.ffn_embedding_dim, self.num_attention_heads = ffn_embedding_dim, num_attention_heads
        self.dropout, self.attention_dropout, self.activation_dropout = dropout, attention_dropout, activation_dropout
        self.layerdrop, self.encoder_normalize_before, self.pre_layernorm = layerdrop, encoder_normalize_before, pre_layernorm
        self.apply_graphormer_init, self.activation_fn, self.embed_scale = apply_graphormer_init, activation_fn, embed_scale
        self.freeze_embeddings, self.num_trans_layers_to_freeze = freeze_embeddings, num_trans_layers_to_freeze
        self.traceable, self.q_noise, self.qn_block_size = traceable, q_noise, qn_block_size
        self.kdim, self.vdim, self.bias, self.self_attention = kdim, vdim, bias, self_attention
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)


def _check_supported(config: GraphormerConfig) -> None:
    unsupported = []
    if config.q_noise > 0:
        unsupported.append(f"q_noise={config.q_noise} (quantisation noise)")
    if config.freeze_embeddings:
        unsupported.append("freeze_embeddings=True")
    if (config.kdim or config.embedding_dim) != config.embedding_dim or \
            (config.vdim or config.embedding_dim) != config.embedding_dim or not config.self_attention:
        unsupported.append("kdim / vdim other than embedding_dim, or self_attention=False")
    if config.embedding_dim % config.num_attention_heads:
        unsupported.append(f"embedding_dim={config.embedding_dim} not divisible by "
                           f"num_attention_heads={config.num_attention_heads}")
    if unsupported:
        raise NotImplementedError(f"This Graphormer does not implement {', '.join(unsupported)} (neither did "
                                  "transformers 4.x's for inference); use the defaults.")


class GraphormerGraphNodeFeature(nn.Module):
    """Token embeddings (B, 1 + N, C): the graph token, then per node the sum of its feature
    embeddings and its in- and out-degree embeddings (Eq. 5)."""

    def __init__(self, config: GraphormerConfig):
        super().__init__()
        hidden, pad = config.hidden_size, config.pad_token_id
        self.num_heads, self.num_atoms = config.num_attention_heads, config.num_atoms
        self.atom_encoder = nn.Embedding(config.num_atoms + 1, hidden, padding_idx=pad)
        self.in_degree_encoder = nn.Embedding(config.num_in_degree, hidden, padding_idx=pad)
        self.out_degree_encoder = nn.Embedding(config.num_out_degree, hidden, padding_idx=pad)
        self.graph_token = nn.Embedding(1, hidden)

    def forward(self, input_nodes: torch.Tensor, in_degree: torch.Tensor, out_degree: torch.Tensor) -> torch.Tensor:
        nodes = (self.atom_encoder(input_nodes).sum(dim=-2) + self.in_degree_encoder(in_degree)
                 + self.out_degree_encoder(out_degree))
        graph_token = self.graph_token.weight.unsqueeze(0).expand(input_nodes.shape[0], -1, -1)
        return torch.cat([graph_token, nodes], dim=1)


class GraphormerGraphAttnBias(nn.Module):
    """The per-head additive score bias (B, H, 1 + N, 1 + N): spatial encoding ``b_phi``
    between nodes, virtual distance ``t`` on the graph token's row and column, edge encoding
    ``c_ij`` (Eq. 6-7), plus the collator's ``attn_bias`` (0, or ``-inf`` beyond
    ``spatial_pos_max``)."""

    def __init__(self, config: GraphormerConfig):
        super().__init__()
        heads = self.num_heads = config.num_attention_heads
        self.multi_hop_max_dist = config.multi_hop_max_dist
        self.edge_encoder = nn.Embedding(config.num_edges + 1, heads, padding_idx=0)
        self.edge_type = config.edge_type
        if self.edge_type == "multi_hop":
            # One H x H matrix per hop, stored flat as (num_edge_dis * H * H, 1) like 4.x.
            self.edge_dis_encoder = nn.Embedding(config.num_edge_dis * heads * heads, 1)
        self.spatial_pos_encoder = nn.Embedding(config.num_spatial, heads, padding_idx=0)
        self.graph_token_virtual_distance = nn.Embedding(1, heads)

    def edge_encoding(self, spatial_pos: torch.Tensor, input_edges: torch.Tensor,
                      attn_edge_type: torch.Tensor) -> torch.Tensor:
        """``c`` (B, H, N, N): the mean over a shortest path's first hops of each hop's edge
        embedding (mean over edge features) times that hop's matrix ``W^E_n``."""
        heads = self.num_heads
        if self.edge_type != "multi_hop":
            return self.edge_encoder(attn_edge_type).mean(-2).permute(0, 3, 1, 2)
        # Path length N: spatial_pos is distance + 1 (0 padding); distance 0 and padding count as 1.
        hops = torch.where(spatial_pos > 1, spatial_pos - 1, torch.ones_like(spatial_pos))
        if self.multi_hop_max_dist > 0:
            hops = hops.clamp(0, self.multi_hop_max_dist)
            input_edges = input_edges[:, :, :, : self.multi_hop_max_dist, :]
        per_hop = self.edge_encoder(input_edges).mean(-2)  # (B, N, N, D, H)
        depth = per_hop.shape[-2]
        matrices = self.edge_dis_encoder.weight.reshape(-1, heads, heads)[:depth]  # (D, H, H)
        flat = per_hop.permute(3, 0, 1, 2, 4).reshape(depth, -1, heads)
        mixed = torch.bmm(flat, matrices).reshape(depth, *per_hop.shape[:3], heads).permute(1, 2, 3, 0, 4)
        return (mixed.sum(-2) / hops.to(mixed.dtype).unsqueeze(-1)).permute(0, 3, 1, 2)

    def forward(self, input_nodes: torch.Tensor, attn_bias: torch.Tensor, spatial_pos: torch.Tensor,
                input_edges: torch.Tensor, attn_edge_type: torch.Tensor) -> torch.Tensor:
        heads = self.num_heads
        bias = attn_bias.unsqueeze(1).repeat(1, heads, 1, 1)
        spatial = self.spatial_pos_encoder(spatial_pos).permute(0, 3, 1, 2)
        virtual = self.graph_token_virtual_distance.weight.view(1, heads, 1)
        edges = self.edge_encoding(spatial_pos, input_edges, attn_edge_type)
        # Same additions, in the same order, as 4.x's in-place updates.
        nodes = bias[:, :, 1:, 1:] + spatial
        column = bias[:, :, 1:, 0] + virtual
        row = bias[:, :, 0, :] + virtual
        nodes = nodes + edges
        lower = torch.cat([column.unsqueeze(-1), nodes], dim=-1)
        return torch.cat([row.unsqueeze(2), lower], dim=2) + attn_bias.unsqueeze(1)


class GraphormerMultiheadAttention(nn.Module):
    r"""Self-attention with an additive per-head bias:
    ``A = softmax(q k^T / sqrt(d) + bias)`` masked at padding keys, ``O = A v W_O``, on
    sequence-first (T, B, C) states; probabilities (B * H, T, T) enter ``attention_dropout_module``."""

    # Sequence-first, as ``nn.MultiheadAttention(batch_first=False)`` says it (read by explainers).
    batch_first = False

    def __init__(self, config: GraphormerConfig):
        super().__init__()
        dim = self.embedding_dim = config.embedding_dim
        self.kdim = self.vdim = dim
        self.qkv_same_dim = True
        self.num_heads = config.num_attention_heads
        self.attention_dropout_module = nn.Dropout(p=config.attention_dropout, inplace=False)
        self.head_dim = dim // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = True
        self.k_proj = nn.Linear(dim, dim, bias=config.bias)
        self.v_proj = nn.Linear(dim, dim, bias=config.bias)
        self.q_proj = nn.Linear(dim, dim, bias=config.bias)
        self.out_proj = nn.Linear(dim, dim, bias=config.bias)

    def forward(self, query: torch.Tensor, key: Optional[torch.Tensor], value: Optional[torch.Tensor],
                attn_bias: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[torch.Tensor] = None,
                before_softmax: bool = False, need_head_weights: bool = False):
        length, batch, dim = query.shape
        heads, head_dim = self.num_heads, self.head_dim
        # Keys and values come from the query states, as in 4.x (self-attention only).
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(query)
        v = self.v_proj(query)
        q = q.contiguous().view(length, batch * heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(length, batch * heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(length, batch * heads, head_dim).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2))
        # In place, as in 4.x: under every LRP rule set the bias then takes the plain
        # gradient x input share of the scores' relevance (see adapters/graphormer.py).
        if attn_bias is not None:
            scores += attn_bias.reshape(batch * heads, length, length)
        if attn_mask is not None:
            scores += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            blocked = key_padding_mask.to(torch.bool)[:, None, None, :]
            scores = scores.view(batch, heads, length, length).masked_fill(blocked, float("-inf"))
            scores = scores.view(batch * heads, length, length)
        if before_softmax:
            return scores, v
        probs_float = torch.softmax(scores, dim=-1)
        probs = self.attention_dropout_module(probs_float.type_as(scores))
        attended = torch.bmm(probs, v).transpose(0, 1).contiguous().view(length, batch, dim)
        output = self.out_proj(attended)
        weights = None
        if need_weights or need_head_weights:
            weights = probs_float.view(batch, heads, length, length).transpose(1, 0)
            if not need_head_weights:
                weights = weights.mean(dim=0)
        return output, weights


class GraphormerGraphEncoderLayer(nn.Module):
    """``h = LN(h + Dropout(MHA(h)))``, ``h = LN(h + Dropout(FFN(h)))`` (post-LN), or the
    norms on the branch inputs (``pre_layernorm=True``)."""

    def __init__(self, config: GraphormerConfig) -> None:
        super().__init__()
        dim = self.embedding_dim = config.embedding_dim
        self.num_attention_heads, self.pre_layernorm = config.num_attention_heads, config.pre_layernorm
        self.dropout_module = nn.Dropout(p=config.dropout, inplace=False)
        self.activation_dropout_module = nn.Dropout(p=config.activation_dropout, inplace=False)
        self.activation_fn = ACT2FN[config.activation_fn]
        self.self_attn = GraphormerMultiheadAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, config.ffn_embedding_dim)
        self.fc2 = nn.Linear(config.ffn_embedding_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, input_nodes: torch.Tensor, self_attn_bias: Optional[torch.Tensor] = None,
                self_attn_mask: Optional[torch.Tensor] = None, self_attn_padding_mask: Optional[torch.Tensor] = None):
        hidden = input_nodes
        branch = self.self_attn_layer_norm(hidden) if self.pre_layernorm else hidden
        branch, weights = self.self_attn(query=branch, key=branch, value=branch, attn_bias=self_attn_bias,
                                         key_padding_mask=self_attn_padding_mask, need_weights=False,
                                         attn_mask=self_attn_mask)
        hidden = hidden + self.dropout_module(branch)
        if not self.pre_layernorm:
            hidden = self.self_attn_layer_norm(hidden)
        branch = self.final_layer_norm(hidden) if self.pre_layernorm else hidden
        branch = self.activation_dropout_module(self.activation_fn(self.fc1(branch)))
        hidden = hidden + self.dropout_module(self.fc2(branch))
        if not self.pre_layernorm:
            hidden = self.final_layer_norm(hidden)
        return hidden, weights


class GraphormerGraphEncoder(nn.Module):
    """Embeddings, the attention bias, then the layers over (T, B, C) states; returns the
    states after every layer (the embeddings first) and the graph token's last state."""

    def __init__(self, config: GraphormerConfig):
        super().__init__()
        _check_supported(config)
        self.dropout_module = nn.Dropout(p=config.dropout, inplace=False)
        self.layerdrop, self.embedding_dim = config.layerdrop, config.embedding_dim
        self.apply_graphormer_init, self.traceable = config.apply_graphormer_init, config.traceable
        self.graph_node_feature = GraphormerGraphNodeFeature(config)
        self.graph_attn_bias = GraphormerGraphAttnBias(config)
        self.embed_scale = config.embed_scale
        self.quant_noise = None
        self.emb_layer_norm = nn.LayerNorm(self.embedding_dim) if config.encoder_normalize_before else None
        if config.pre_layernorm:
            # Kept for 4.x checkpoints; 4.x never applies it, and neither does this model.
            self.final_layer_norm = nn.LayerNorm(self.embedding_dim)
        self.layers = nn.ModuleList([GraphormerGraphEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        for layer in self.layers[: config.num_trans_layers_to_freeze]:
            for parameter in layer.parameters():
                parameter.requires_grad = False

    def forward(self, input_nodes: torch.Tensor, input_edges: torch.Tensor, attn_bias: torch.Tensor,
                in_degree: torch.Tensor, out_degree: torch.Tensor, spatial_pos: torch.Tensor,
                attn_edge_type: torch.Tensor, perturb: Optional[torch.Tensor] = None, last_state_only: bool = False,
                token_embeddings: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None):
        batch = input_nodes.shape[0]
        # A node is padding when its first feature index is 0; the graph token never is.
        padding = torch.cat([torch.zeros(batch, 1, dtype=torch.bool, device=input_nodes.device),
                             input_nodes[:, :, 0].eq(0)], dim=1)
        bias = self.graph_attn_bias(input_nodes, attn_bias, spatial_pos, input_edges, attn_edge_type)
        hidden = token_embeddings if token_embeddings is not None else \
            self.graph_node_feature(input_nodes, in_degree, out_degree)
        if perturb is not None:
            hidden = torch.cat([hidden[:, :1], hidden[:, 1:] + perturb], dim=1)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.emb_layer_norm is not None:
            hidden = self.emb_layer_norm(hidden)
        hidden = self.dropout_module(hidden).transpose(0, 1)
        states: List[torch.Tensor] = [] if last_state_only else [hidden]
        drops = torch.rand(len(self.layers)) if self.training and self.layerdrop > 0 else None
        for index, layer in enumerate(self.layers):
            if drops is not None and drops[index] <= self.layerdrop:
                continue  # LayerDrop (training only)
            hidden, _ = layer(hidden, self_attn_padding_mask=padding, self_attn_mask=attn_mask, self_attn_bias=bias)
            if not last_state_only:
                states.append(hidden)
        if last_state_only:
            states = [hidden]
        return (torch.stack(states) if self.traceable else states), hidden[0]


class GraphormerDecoderHead(nn.Module):
    def __init__(self, embedding_dim: int, num_classes: int):
        super().__init__()
        self.lm_output_learned_bias = nn.Parameter(torch.zeros(1))
        self.classifier = nn.Linear(embedding_dim, num_classes, bias=False)
        self.num_classes = num_classes

    def forward(self, input_nodes: torch.Tensor, **unused) -> torch.Tensor:
        return self.classifier(input_nodes) + self.lm_output_learned_bias


class GraphormerPreTrainedModel(PreTrainedModel):
    """Base class of the Graphormer models: their config class, weight initialisation and
    ``from_pretrained`` / ``save_pretrained`` with transformers 4.x's state-dict names."""

    config_class = GraphormerConfig
    base_model_prefix = "graphormer"
    main_input_name = "input_nodes"

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, GraphormerDecoderHead):
            with torch.no_grad():
                module.lm_output_learned_bias.zero_()


class GraphormerModel(GraphormerPreTrainedModel):
    """The encoder and 4.x's output transform ``LN(act(W h))`` on every token (B, T, C)."""

    def __init__(self, config: GraphormerConfig):
        super().__init__(config)
        self.max_nodes = config.max_nodes
        self.graph_encoder = GraphormerGraphEncoder(config)
        self.share_input_output_embed = config.share_input_output_embed
        self.lm_output_learned_bias = None
        self.load_softmax = not getattr(config, "remove_head", False)
        self.lm_head_transform_weight = nn.Linear(config.embedding_dim, config.embedding_dim)
        self.activation_fn = ACT2FN[config.activation_fn]
        self.layer_norm = nn.LayerNorm(config.embedding_dim)
        self.post_init()

    def forward(self, input_nodes: torch.Tensor, input_edges: torch.Tensor, attn_bias: torch.Tensor,
                in_degree: torch.Tensor, out_degree: torch.Tensor, spatial_pos: torch.Tensor,
                attn_edge_type: torch.Tensor, perturb: Optional[torch.Tensor] = None, masked_tokens: None = None,
                return_dict: Optional[bool] = None, **unused):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if masked_tokens is not None:
            raise NotImplementedError("masked_tokens is not implemented (neither was it in transformers 4.x).")
        states, _ = self.graph_encoder(input_nodes, input_edges, attn_bias, in_degree, out_degree, spatial_pos,
                                       attn_edge_type, perturb=perturb)
        hidden = self.layer_norm(self.activation_fn(self.lm_head_transform_weight(states[-1].transpose(0, 1))))
        if not return_dict:
            return hidden, states
        return BaseModelOutputWithNoAttention(last_hidden_state=hidden, hidden_states=states)


class GraphormerForGraphClassification(GraphormerPreTrainedModel):
    """Graph classification (or regression with ``num_classes=1``) from the graph token."""

    def __init__(self, config: GraphormerConfig):
        super().__init__(config)
        self.encoder = GraphormerModel(config)
        self.embedding_dim, self.num_classes = config.embedding_dim, config.num_classes
        self.classifier = GraphormerDecoderHead(self.embedding_dim, self.num_classes)
        self.is_encoder_decoder = True
        self.post_init()

    def forward(self, input_nodes: torch.Tensor, input_edges: torch.Tensor, attn_bias: torch.Tensor,
                in_degree: torch.Tensor, out_degree: torch.Tensor, spatial_pos: torch.Tensor,
                attn_edge_type: torch.Tensor, labels: Optional[torch.Tensor] = None,
                return_dict: Optional[bool] = None, **unused):
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        encoded = self.encoder(input_nodes, input_edges, attn_bias, in_degree, out_degree, spatial_pos,
                               attn_edge_type, return_dict=True)
        logits = self.classifier(encoded.last_hidden_state)[:, 0, :].contiguous()
        loss = None
        if labels is not None:
            loss = _loss(logits, labels, self.num_classes)
        if not return_dict:
            return tuple(x for x in (loss, logits, encoded.hidden_states) if x is not None)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=encoded.hidden_states)


def _loss(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """4.x's losses: MSE (one output), cross-entropy (one label per graph), else summed BCE;
    NaN labels are skipped."""
    known = ~torch.isnan(labels.float())
    if num_classes == 1:
        return nn.functional.mse_loss(logits[known].squeeze(), labels[known].squeeze().float())
    if labels.dim() == 1:
        return nn.functional.cross_entropy(logits[known].view(-1, num_classes), labels[known].view(-1).long())
    return nn.functional.binary_cross_entropy_with_logits(logits[known], labels[known].float(), reduction="sum")


__all__ = ["GraphormerConfig", "GraphormerModel", "GraphormerForGraphClassification", "GraphormerPreTrainedModel"]
