"""Small configs for every architecture: a generic shrinker, and a table of per-family overrides.

:func:`shrink_config_dict` rewrites a config's ``to_dict()`` by attribute name, whatever the
family calls its sizes (``hidden_size`` / ``d_model`` / ``n_embd`` / ``dim``, ...): width 32,
4 heads of 8 (key/value heads keep the family's kind: as many as the query heads, one, or 2),
feed-forward 64, 2 layers (encoder and decoder too), vocabulary 128, 64 positions, 4 experts
with 2 per token, a sliding window of 4, every dropout 0, special token ids inside the
vocabulary (a missing pad id set to 0). Per-layer lists (``layer_types``, ...) are cut to the
layer count keeping each kind of layer that occurs (Gemma 3: one sliding and one full layer),
RoPE settings kept with their lengths fitted (:func:`_small_rope`). Sub-configs
(``text_config``, ``encoder``, ...) are shrunk the same way. What the generic rules cannot
build is a row of :data:`OVERRIDES` (values set after the generic rules) or of
:data:`CONFIG_BUILDERS` (the whole config written by hand).

:func:`small_config` adds what the head needs (:func:`head_settings`) and the override row;
:func:`build_model` makes the model: seeded, eager attention, float64, eval mode.
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 64, 2
VOCAB, POSITIONS, EXPERTS, TOP_K, WINDOW, NUM_LABELS = 128, 64, 4, 2, 4, 3
SEED = 0

LAYER_NAMES = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
               "num_decoder_layers", "num_encoder_layers")
HEAD_NAMES = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
              "decoder_attention_heads")
KV_HEAD_NAMES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")

# Attribute name -> its small value (set where the attribute exists and holds an int).
_SIZES: Dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "embedding_size",
                     "embedding_dim", "word_embed_proj_dim", "attention_hidden_size"), WIDTH),
    **dict.fromkeys(HEAD_NAMES, HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "d_head", "kv_channels", "attention_head_size", "v_head_dim",
                     "qk_head_dim"), HEAD_DIM),
    "qk_rope_head_dim": HEAD_DIM // 2, "qk_nope_head_dim": HEAD_DIM // 2, "kv_lora_rank": 16, "q_lora_rank": 16,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "d_inner",
                     "n_inner", "hidden_dim", "feed_forward_size", "ffn_hidden_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), WIDTH),
    **dict.fromkeys(LAYER_NAMES, LAYERS),
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions",
                     "max_target_positions"), POSITIONS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "num_selected_experts"),
                    TOP_K),
    "rotary_dim": HEAD_DIM // 2, "pooler_hidden_size": WIDTH,
    **dict.fromkeys(("sliding_window", "attention_window"), WINDOW),
}
# Attribute name -> an upper bound (the family's value if smaller).
_CAPS: Dict[str, int] = {"n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
_DROPOUT = re.compile(r"dropout|pdrop|drop_rate|layerdrop|drop_path")
_DROPPED_KEYS = ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "id2label",
                 "label2id", "_attn_implementation_autoset", "_attn_implementation_internal")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kv_heads(value: int, original_heads: Optional[int]) -> int:
    """Key/value heads of the same kind as the family's: all heads (MHA), one (MQA), or 2 (GQA)."""
    if original_heads is not None and value == original_heads:
        return HEADS
    return 1 if value == 1 else KV_HEADS


def cut_layer_list(values: List[Any], layers: int = LAYERS) -> List[Any]:
    """The first ``layers`` entries of a per-layer list, each distinct kind of entry kept where
    there is room (``[sliding x5, full, ...]`` -> ``[sliding, full]``), in their order."""
    firsts = sorted({values.index(v) for v in values})
    chosen = firsts[:layers]
    for index in range(len(values)):
        if len(chosen) >= layers:
            break
        if index not in chosen:
            chosen.append(index)
    return [values[i] for i in sorted(chosen)]


def _remap_token_ids(config: Dict[str, Any]) -> None:
    """Every ``*_token_id(s)`` outside the vocabulary moved to the top of it (distinct ids from
    ``VOCAB - 1`` down, the same old id always to the same new one); a ``pad_token_id`` of None
    becomes 0 (decoder classifiers find the last token from it, as the test models do)."""
    if "pad_token_id" in config and config["pad_token_id"] is None:
        config["pad_token_id"] = 0
    moved: Dict[int, int] = {}

    def inside(token: Any) -> Any:
        if not _is_int(token) or 0 <= token < VOCAB:
            return token
        if token not in moved:
            moved[token] = VOCAB - 1 - len(moved)
        return moved[token]

    for key, value in config.items():
        if key.endswith(("_token_id", "_token_ids")):
            config[key] = [inside(v) for v in value] if isinstance(value, list) else inside(value)


def _original_layers(config: Mapping[str, Any]) -> Optional[int]:
    return next((config[name] for name in LAYER_NAMES if _is_int(config.get(name))), None)


def _is_sub_config(value: Any) -> bool:
    return isinstance(value, dict) and any(key in value for key in (*_SIZES, "model_type"))


def _small_rope(rope: Dict[str, Any]) -> Dict[str, Any]:
    """RoPE settings kept, with their lengths made to fit: ``original_max_position_embeddings``
    below the 64 positions, LongRoPE factor lists of the rotary half-width, an M-RoPE section
    summing to it; a dict per layer type is shrunk per entry."""
    small = dict(rope)
    half = max(1, int(HEAD_DIM * float(rope.get("partial_rotary_factor") or 1.0)) // 2)
    for key, value in rope.items():
        if isinstance(value, dict):
            small[key] = _small_rope(value)
        elif key == "original_max_position_embeddings" and _is_int(value):
            small[key] = min(value, POSITIONS // 2)
        elif key in ("short_factor", "long_factor") and isinstance(value, list):
            small[key] = value[:half]
        elif key == "mrope_section" and isinstance(value, list) and value:
            small[key] = [half - len(value) + 1] + [1] * (len(value) - 1)
    return small


def _is_layer_index(key: Any) -> bool:
    return _is_int(key) or (isinstance(key, str) and key.isdigit())


def _small_value(key: str, value: Any, layers: Optional[int], heads: Optional[int]) -> Any:
    """The small value of one config attribute (``layers``, ``heads``: the family's counts)."""
    if _is_sub_config(value):
        return shrink_config_dict(value)
    if key in KV_HEAD_NAMES and (value is None or _is_int(value)):
        return HEADS if value is None else _kv_heads(value, heads)
    if key in ("head_dim", "vocab_size") and value is None:
        return _SIZES[key]
    if key in _SIZES and _is_int(value):
        return _SIZES[key]
    if key in _CAPS and _is_int(value):
        return min(value, _CAPS[key])
    if isinstance(value, float) and _DROPOUT.search(key):
        return 0.0
    if key == "rope_parameters" and isinstance(value, dict):
        return _small_rope(value)
    if isinstance(value, list) and layers and len(value) == layers and layers > LAYERS:
        return [_SIZES[key] if key in _SIZES and _is_int(v) else v for v in cut_layer_list(value)]
    if isinstance(value, dict) and value and all(_is_layer_index(k) for k in value):
        return {k: v for k, v in value.items() if int(k) < LAYERS}  # settings per layer index
    return value


def shrink_config_dict(config: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of a config's ``to_dict()`` with the small sizes of this module (see the module
    docstring); nested sub-config dicts are shrunk too."""
    layers = _original_layers(config)
    heads = next((config[name] for name in HEAD_NAMES if _is_int(config.get(name))), None)
    small = {key: _small_value(key, value, layers, heads) for key, value in config.items() if key not in _DROPPED_KEYS}
    if _is_int(config.get("head_dim")) and config.get("head_dim") == config.get("qk_rope_head_dim"):
        small["head_dim"] = small["qk_rope_head_dim"]  # DeepSeek-style MLA: head_dim is the rotary part
    _remap_token_ids(small)
    return small


def _merge(config: Dict[str, Any], override: Mapping[str, Any]) -> Dict[str, Any]:
    """``config`` with ``override`` set into it; a dict value merges into a sub-config dict."""
    merged = dict(config)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# Hand-written sizes of the families the generic rules cannot build (values set after them).
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 8, "mamba_n_groups": 1}
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # Funnel: three pooling blocks of 4 layers by default; one layer per block, two blocks.
    "funnel": {"block_sizes": [1, 1], "block_repeats": [1, 1], "num_decoder_layers": 1},
    # Reformer: chunked attention and axial positions must tile the sequence; no LSH.
    "reformer": {"attn_layers": ["local", "local"], "axial_pos_shape": [4, 16], "axial_pos_embds_dim": [16, 16],
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_hashes": 1},
    # Hybrid state-space families: Mamba heads that tile mamba_expand * width, one attention layer.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_dt_rank": 8},
    "bamba": {**_MAMBA, "attn_layer_indices": [1]},
    "mamba2": {"head_dim": 16, "state_size": 16, "n_groups": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # Layer-count bookkeeping of looped / shared-cache families.
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
    # Per-layer embeddings over 262144 ids by default (1 GB in float64).
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
    "deepseek_v2": {"num_experts_per_tok": TOP_K},  # None by default: top-k of the router
    "xmod": {"default_language": "en_XX"},  # adapters per language: one must be chosen
    # Block-sparse attention switches itself to full attention on the short inputs measured here, replacing its
    # modules during the forward pass: built with the attention it runs (block-sparse is refused by name).
    "bigbird_pegasus": {"attention_type": "original_full"},
    # Recurrent-only first layers: their cache cannot tell a sequence length.
    # (Their default layer lists hold no attention layer in the first two: one of each kind kept.)
    "granitemoehybrid": {**_MAMBA, "use_cache": False, "layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"use_cache": False, "block_types": ["recurrent", "attention"], "lru_width": WIDTH},
    # Hybrids whose state-space / linear-attention sizes the generic names miss: at their defaults (Falcon-H1:
    # 128 Mamba heads, chunks of 256) Integrated Gradients' 50 scaled copies of the batch took over 22 GB.
    "falcon_h1": {**_MAMBA, "mamba_d_ssm": _MAMBA["mamba_n_heads"] * _MAMBA["mamba_d_head"]},
    "nemotron_h": {"ssm_state_size": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "chunk_size": 8},
    "kimi_linear": {"linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS},
    # (and its routing groups must divide the experts)
    "bailing_hybrid": {"linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS, "num_expert_group": 1},
    # M-RoPE over two axes needs a rotated width that is a multiple of 4.
    "neomme": {"head_dim": 16},
}


def _encoder_decoder_config():
    """``EncoderDecoderModel``: a shrunk BERT encoder and a shrunk BERT decoder with cross-attention."""
    from transformers import BertConfig, EncoderDecoderConfig

    bert = shrink_config_dict(BertConfig().to_dict())
    bert.pop("model_type", None)
    encoder = BertConfig(**bert)
    decoder = BertConfig(**{**bert, "is_decoder": True, "add_cross_attention": True})
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0  # ids below the drawn ones
    return config


# Families whose config is written by hand (no ``AutoConfig.for_model(model_type)`` default).
CONFIG_BUILDERS: Dict[str, Callable[[], Any]] = {"encoder-decoder": _encoder_decoder_config}


def default_config(model_type: str, class_name: str):
    """``AutoConfig.for_model(model_type)``'s default, or its sub-config of the class the model
    takes (``Llama4ForCausalLM`` reads the text config of the multimodal ``llama4`` config)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    wanted = getattr(model_class(class_name), "config_class", None)
    if wanted is None or isinstance(default, wanted):
        return default
    for name in getattr(default, "sub_configs", {}):
        sub = getattr(default, name, None)
        if isinstance(sub, wanted):
            return sub
    return default


def head_settings(config: Mapping[str, Any], head: Optional[str]) -> Dict[str, Any]:
    """What the head (an :data:`~.entries.HEADS` name) needs of the config: 3 labels for the
    classification heads, 2 (start, end) for question answering; a causal LM head of an encoder
    family (``BertLMHeadModel``) is built as a decoder (``is_decoder=True``), as transformers asks;
    an encoder-decoder without a decoder start id gets the pad id (T5-style classifiers shift
    ``input_ids`` right themselves, from it)."""
    settings: Dict[str, Any] = {}
    if config.get("is_encoder_decoder") and config.get("decoder_start_token_id") is None:
        settings["decoder_start_token_id"] = config.get("pad_token_id") or 0
    if head in ("sequence-classification", "token-classification", "image-classification", "audio-classification"):
        settings["num_labels"] = NUM_LABELS
    elif head == "question-answering":
        settings["num_labels"] = 2
    elif head == "causal-lm" and "is_decoder" in config and not config.get("is_encoder_decoder"):
        settings["is_decoder"] = True
    return settings


def small_config(model_type: str, class_name: str, head: Optional[str] = None):
    """The small config of ``class_name`` (of ``model_type``): :data:`CONFIG_BUILDERS`' if it has
    one, else :func:`default_config` shrunk, with the head's settings and the :data:`OVERRIDES`
    row on top (image and audio heads: the sizes of :func:`.media.shrink_media` and its
    ``MEDIA_OVERRIDES`` row instead)."""
    if model_type in CONFIG_BUILDERS:
        return CONFIG_BUILDERS[model_type]()
    default = default_config(model_type, class_name)
    values = shrink_config_dict(default.to_dict())
    override = OVERRIDES.get(model_type, {})
    if head in ("image-classification", "audio-classification"):
        from .media import MEDIA_OVERRIDES, shrink_media

        values, override = shrink_media(values), MEDIA_OVERRIDES.get(model_type, {})
    values = _merge(values, {**head_settings(values, head), **override})
    values.pop("model_type", None)
    return type(default)(**values)


def model_class(class_name: str):
    """The transformers model class called ``class_name``."""
    import transformers

    return getattr(transformers, class_name)


_MODALITY_WORDS = ("vision", "audio", "speech", "image", "video", "visual", "acoustic", "codec")
_MODALITY_INPUTS = ("pixel_values", "input_features", "input_values", "audio_values", "visual_feats",
                    "pixel_values_videos")


def not_text_reason(config, class_name: str) -> Optional[str]:
    """Why ``class_name`` is no text model (None if it is one): its input is not ``input_ids``
    (pixels, audio features), its forward takes image or audio inputs, or its config holds a
    vision / audio sub-config."""
    cls = model_class(class_name)
    main_input = getattr(cls, "main_input_name", "input_ids")
    if main_input != "input_ids":
        return f"not a text model (input {main_input})"
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    inputs = [name for name in _MODALITY_INPUTS if name in parameters]
    if inputs:
        return f"not a text model (takes {', '.join(inputs)})"
    towers = [name for name in getattr(config, "sub_configs", {}) if any(w in name for w in _MODALITY_WORDS)]
    return f"not a text model ({', '.join(towers)})" if towers else None


def build_model(config, class_name: str, seed: int = SEED) -> torch.nn.Module:
    """``class_name`` from ``config`` (:func:`small_config`): random weights (``seed``), eager
    attention (and eager mixture-of-experts kernels, where the model lets them be chosen:
    ``grouped_mm`` refuses float64), float64, eval mode."""
    torch.manual_seed(seed)
    cls = model_class(class_name)
    implementations = {"attn_implementation": "eager"}
    if getattr(cls, "_can_set_experts_implementation", lambda: False)():
        implementations["experts_implementation"] = "eager"  # grouped_mm takes no float64
    return cls._from_config(config, **implementations).double().eval()
