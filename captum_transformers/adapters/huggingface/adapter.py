"""HuggingFace transformers models, through the attention-function registry.

Inside :meth:`HuggingFaceAdapter.capture` (and :meth:`~HuggingFaceAdapter.propagation`) the
model's configs point at the explicit kernel of :mod:`.hf_kernel`, so eager, sdpa and flash
models all become the same explicit computation while captured. This module knows the
models: their attention blocks and token streams (one sequence; CLIP's two towers;
encoder and decoder), the explained rows, the input spans, targets and output fields.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...compat import checkpointing
from ...model_state import module_walk
from ...errors import CaptureError, InputError
from ...propagation.rules.operations import operation_rules
from ...propagation.rules.routers import router_rules
from ...propagation.rules.rule_set import RuleSet, norm_rules
from ...capture.trace import CONTEXT, Block, InputSpan, StreamLayouts, Streams, TokenLayout
from ..base import Adapter
from .kernel import ATTENTION_KEY, SDPA_KEY, active_recorder, active_rules, block_kind
from .kernel_keys import capture_key, propagation_key
from .inline_text import gated as inline_gated, inline_blocks, observed as inline_observed
from .audio_inputs import strided_input_fields
from .compressed_keys import refuse_compressed_keys
from .kept_logits import kept_logit_positions
from .position_padding import learned_position_table, warn_left_padding_without_positions
from ..query_rows import (MEAN_AFTER_FIRST, QUERY_ROWS_HINT, QueryRows, checked_query_rows, chosen_rows,
                          config_pooled_rows, refuse_masked_explained_rows)
from ...capture.recorder import Recorder
from ...capture.targets import span_scores, target_width
from ..relevance_reading import LayerInputs, ModuleOutputs, RelevanceReading

# Per-architecture quirks are rows of data. prefix: tokens before the patch grid;
# rows: classifier token positions; "eos": CLIP text pools at the end-of-text token;
# frames: the encoder's input is audio features (B, mel bins, frames) that a strided convolution
# turns into tokens along the last axis (Whisper: two frames per token).
_MODEL_TYPE_QUIRKS: Dict[str, Dict[str, Any]] = {
    "vit": {"prefix": 1},
    "deit": {"prefix": 2},
    "clip_vision_model": {"prefix": 1},
    "clip_text_model": {"rows": "eos"},
    "whisper": {"frames": "last"},
}
# Waveform classifiers of the wav2vec2 family: the mean of the last layer's frames, over the real
# frames of the padding mask they derive from the samples' attention_mask (the encoder attends
# over the same frames, so the adapter's token mask is that mask).
_WAVEFORM_CLASSIFIERS = frozenset({
    "Wav2Vec2ForSequenceClassification", "HubertForSequenceClassification", "Data2VecAudioForSequenceClassification",
    "SEWForSequenceClassification", "SEWDForSequenceClassification", "UniSpeechForSequenceClassification",
    "UniSpeechSatForSequenceClassification", "Wav2Vec2BertForSequenceClassification",
    "Wav2Vec2ConformerForSequenceClassification", "WavLMForSequenceClassification",
})
# Heads that read more than one token: their rows are averaged (AST: (CLS + distillation token) / 2).
_CLASS_ROWS: Dict[str, Tuple[int, ...]] = {
    "DeiTForImageClassificationWithTeacher": (0, 1),
    "ASTForAudioClassification": (0, 1),
}
# Heads that average every real token of the last layer (no CLS token; Siglip 2 over its unpadded
# patches; Whisper's audio classifier over every encoder frame, the padding to 30 s included):
# explained at all rows, equally weighted (query_rows="mean").
_MEAN_POOLING_HEADS = frozenset({
    "SiglipForImageClassification", "Siglip2ForImageClassification", "IJepaForImageClassification",
    "WhisperForAudioClassification", *_WAVEFORM_CLASSIFIERS,
})
# Heads that average the tokens after the CLS token (rows 1..N-1, equally weighted).
_MEAN_AFTER_FIRST_HEADS = frozenset({"CLIPForImageClassification", "MetaClip2ForImageClassification"})
# Heads whose input no weighting of the last layer's rows describes (rows of data): class name -> why
# (Adapter.rows_refusal). Refused by the methods that weigh the last layer's rows unless the caller
# chooses them (query_rows); the relevance methods explain them.
_UNWEIGHTED_POOLING: Dict[str, str] = {
    "Dinov2ForImageClassification": "feeds its linear classifier the concatenation [CLS token, mean of the patch "
                                    "tokens], so each class weighs the two parts with its own weights",
    "Dinov2WithRegistersForImageClassification": "feeds its linear classifier the concatenation [CLS token, mean of "
                                                 "the patch tokens after the registers], so each class weighs the "
                                                 "two parts with its own weights",
}
# Heads that score every token (rows of data): the head class's name ends with the key, and the
# target index's entry at the value is the explained token's position. Question answering's
# start and end scores are read as one (B, 2, N) tensor: target (0, i) is the start score of
# token i, (1, i) its end score.
_TOKEN_LEVEL_HEADS: Dict[str, int] = {
    "ForTokenClassification": 0, "ForMaskedLM": 0, "ForQuestionAnswering": 1,
    "ForQuestionAnsweringSimple": 1,  # XLM, FlauBERT: start / end scores
    "WithLMHeadModel": 0,             # XLM, FlauBERT: a masked LM (config.causal=False) scoring every position
}
# Streams by module path, for models with more than one token sequence. The first
# component of a block's dotted path found in _STREAM_COMPONENTS names its query stream
# ("text_model.encoder.layers.0.self_attn" -> "text"; "model.decoder.layers.0.encoder_attn"
# -> "decoder"); a cross-attention block's keys come from _CROSS_KEY_STREAMS[query stream].
# A model whose blocks all query one stream keeps the single "tokens" stream.
_STREAM_COMPONENTS: Dict[str, str] = {
    "text_model": "text",     # CLIP-style dual encoders
    "vision_model": "image",
    "encoder": "encoder",     # encoder-decoders: BART, mBART, Marian, Pegasus, T5, EncoderDecoderModel
    "decoder": "decoder",
    "text_encoder": "encoder",  # SeamlessM4T (v2) text-to-text
    "text_decoder": "decoder",
}
_CROSS_KEY_STREAMS: Dict[str, str] = {"decoder": "encoder"}
# Models whose layers read more of the token ids than the hidden states entering the first layer
# (model type -> the modules embedding the ids): token relevance is read at their outputs
# (relevance_reading.ModuleOutputs). Gemma 3n: AltUp-stacked embeddings and per-layer embeddings; Gemma 4:
# per-layer embeddings.
_EMBEDDING_READINGS: Dict[str, Tuple[str, ...]] = {
    "gemma3n_text": ("embed_tokens", "embed_tokens_per_layer"),
    "gemma3n": ("embed_tokens", "embed_tokens_per_layer"),
    "gemma4_text": ("embed_tokens", "embed_tokens_per_layer"),  # per-layer embeddings of the ids
    "gemma4": ("embed_tokens", "embed_tokens_per_layer"),
}
# Models whose layers take channels-first hidden states (B, D, N) (model types, a row each):
# SqueezeBERT's convolutional layers; their token relevance is read with the tokens last.
_CHANNELS_FIRST_LAYERS = frozenset({"squeezebert"})
# Models whose forward overwrites its recurrent state in place when it returns a cache, leaving no
# gradient of its scores (model types, a row each): RWKV. Gradient methods call them with
# use_cache=False unless the caller sets it (one forward pass reads no cache; the scores are equal).
_IN_PLACE_CACHE_MODEL_TYPES = frozenset({"rwkv"})
# Encoder-decoder classifiers given input_ids alone run the decoder over the ids shifted right and
# read one decoder row, found from input_ids (rows of data, by model type): "last eos": the last
# eos_token_id of each row (BART-style heads; every row must hold the same number of them);
# "after last real": one past the last non-pad token, clamped to the decoder's length (T5Gemma).
_DECODER_CLASSIFIER_ROWS: Dict[str, str] = {
    **dict.fromkeys(("bart", "mbart", "plbart", "mvp", "bigbird_pegasus", "led", "t5", "mt5", "umt5"), "last eos"),
    **dict.fromkeys(("t5gemma", "t5gemma2"), "after last real"),
}
# Causal LM families whose every token mixer is causal by construction (recurrences, causal
# convolutions, causally masked attention), by config.model_type: where the adapter captures no
# attention in them, a token target still names the last real token's next-token logit.
_CAUSAL_BY_CONSTRUCTION = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "diffllama", "granitemoehybrid",
    "bamba", "jamba", "zamba", "zamba2", "falcon_h1", "nemotron_h", "lfm2", "lfm2_moe", "bailing_hybrid",
    "deepseek_v4",  # causal sliding windows, compressed entries visible once their window closed
})
# transformers' SequenceSummary heads (XLNet, XLM, FlauBERT, ELECTRA, ConvBERT, RoFormer): the
# rows their summary_type pools, without the attention mask (the heads ignore it).
_SUMMARY_ROWS: Dict[str, QueryRows] = {"last": -1, "first": 0, "mean": "mean"}
# Heads explained at their next-token position (a target is a token id there).
_NEXT_TOKEN_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_OUTPUT_FIELDS = ("logits", "logits_per_image", "image_embeds", "text_embeds", "pooler_output")
# Output fields that hold scores a target indexes; the other fields hold features.
_SCORE_FIELDS = ("logits", "logits_per_image")


def _summary_rows(module: nn.Module) -> Optional[QueryRows]:
    """The rows a ``...SequenceSummary`` head pools by its ``summary_type`` (XLNet's "last": the
    last column, whatever the mask says; XLM's "first"; "mean" of every column, padding
    included, as the head computes it), or None (another module, or ``cls_index``: positions the
    caller passes)."""
    if not type(module).__name__.endswith("SequenceSummary"):
        return None
    return _SUMMARY_ROWS.get(getattr(module, "summary_type", None))


def _token_axis(model: nn.Module) -> Optional[int]:
    """Where a token-level head's target index holds the token position (``_TOKEN_LEVEL_HEADS``), or None."""
    name = type(model).__name__
    return next((axis for suffix, axis in _TOKEN_LEVEL_HEADS.items() if name.endswith(suffix)), None)


def pretrained_model(model: nn.Module) -> nn.Module:
    """The first transformers ``PreTrainedModel`` in ``model`` (``model`` itself, or a module of a
    user wrapper); a ``CaptureError`` when it holds none."""
    from transformers import PreTrainedModel

    for module in module_walk.modules(model):
        if isinstance(module, PreTrainedModel):
            return module
    raise CaptureError(f"{type(model).__name__} contains no transformers PreTrainedModel.")


def _sub_config(model: nn.Module, name: str) -> Any:
    """``config.<name>`` of a composite model (CLIP's text_config), else the config itself."""
    config = pretrained_model(model).config
    sub = getattr(config, name, None)
    return config if sub is None else sub


@contextlib.contextmanager
def gradient_checkpointing_off(model: nn.Module) -> Iterator[None]:
    """Layers with gradient checkpointing run plainly while captured: a checkpointed layer re-runs
    its forward in the backward pass, outside the capture, with another attention kernel
    (torch raises CheckpointError). Each module's own flag is restored on exit. Under
    :func:`~captum_transformers.compat.checkpointing.keep_gradient_checkpointing` the layers stay
    checkpointed, recomputed under the explanation's rules instead."""
    with contextlib.ExitStack() as stack:
        for module in module_walk.modules(model):
            # The instance's flag, else its class's (transformers' layers declare it there): no
            # failing nn.Module.__getattr__ lookup on every other module.
            if vars(module).get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing", False)) is True:
                if checkpointing.kept() and callable(vars(module).get("_gradient_checkpointing_func")):
                    # Kept on (opt-in): the recomputation runs under the explanation's rules.
                    stack.enter_context(patching.instance_function(module, "_gradient_checkpointing_func",
                                                                   checkpointing.explained_checkpoint(module, model)))
                    continue
                stack.enter_context(patching.flag(module, "gradient_checkpointing", False))  # this thread only
        yield


def takes_decoder_inputs(model: nn.Module) -> bool:
    """True for a seq2seq model called directly (its forward names ``decoder_input_ids``);
    DETR (also ``is_encoder_decoder``) and user wrappers are called positionally."""
    try:
        parameters = inspect.signature(type(model).forward).parameters  # the instance forward may be wrapped
    except (TypeError, ValueError):
        return False
    return "decoder_input_ids" in parameters and "decoder_inputs_embeds" in parameters


# Attention modules whose class name does not say "Attention" (rows of data): LongCat-Flash's
# Multi-head Latent Attention sublayers, ``LongcatFlashMLA`` (two per decoder layer).
_ATTENTION_CLASS_SUFFIXES = ("MLA",)


def _named_attention(module: nn.Module) -> bool:
    name = type(module).__name__
    return "Attention" in name or name.endswith(_ATTENTION_CLASS_SUFFIXES)


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is an innermost attention module: its class name holds "Attention" (or ends
    in a suffix of ``_ATTENTION_CLASS_SUFFIXES``) and no child's does (BERT's ``BertSelfAttention``,
    not the ``BertAttention`` around it)."""
    return _named_attention(module) and not any(_named_attention(c) for c in module.children())


class HuggingFaceAdapter(Adapter):
    """Adapter for transformers >= 5 models that dispatch through ``AttentionInterface``.

    Tested: BERT, DistilBERT, RoBERTa, ViT, DeiT (plain and distilled), CLIP vision and
    text towers, GPT-2 and Llama-style decoders (causal masks, grouped-query attention),
    with padding masks; CLIP's dual encoder; BART, T5 and ViT-to-GPT-2 encoder-decoders. Text families
    whose attention is written inline (BLOOM, Falcon, MPT, GPT-Neo, RoFormer, DeBERTa, XLM, ...:
    :mod:`.inline_text`) are observed at their softmax; the multimodal inline families (LXMERT,
    VisualBERT) have an adapter of their own (:mod:`.inline_attention`). Every architecture of the
    auto mappings is measured in ``docs/coverage.md``.

    Models with several token streams (named from module paths, :attr:`stream_components`):

    * CLIP dual encoder (``CLIPModel``), streams ``"text"`` and ``"image"``. Inputs
      ``(input_ids, pixel_values)``, the text mask by keyword. The explained score of example
      ``i`` is ``logits_per_image[i, target[i]]``: image ``i`` against text ``target[i]``.
      ``target=None`` means each image's own text (the diagonal, not the arg-max), and a
      target must be a permutation of the texts: text ``j``'s map is its share of the one
      similarity that reads it, returned in row ``j`` of the ``input_ids`` attribution.
      A method's ``start_layer`` counts layers per tower.
    * Encoder-decoders (BART, mBART, Marian, Pegasus, T5), streams ``"encoder"`` and
      ``"decoder"``. Inputs ``(input_ids, decoder_input_ids)``: the second input is passed
      to the model by keyword (``decoder_inputs_embeds`` when it is floating point); masks
      go in ``forward_kwargs`` (``attention_mask``, ``decoder_attention_mask``) or the
      encoder mask in ``additional_forward_args``. The explained score is the next-token
      logit at the last real decoder position, so ``target`` is the id of the generated
      token to explain; to explain an earlier generated token, truncate
      ``decoder_input_ids`` to the tokens before it. The attributions are (source
      relevance, decoder-prefix relevance). A ViT encoder's pixel input
      (``VisionEncoderDecoderModel``) is mapped through its patch grid, and Whisper's audio
      features ``(input_features, decoder_input_ids)`` (B, mel bins, frames) through its frames:
      each encoder token's score upsampled linearly over the frames it covers (two), the same
      at every mel bin.

    The explained rows follow the model's head where the model says it: the CLS token of
    ``*ForSequenceClassification`` / ``*ForImageClassification``, DeiT's CLS and distillation
    tokens, every patch token (equally weighted) of the heads that mean-pool them (Siglip,
    Siglip 2, I-JEPA), CLIP text's end-of-text token, a causal model's last real token. A head the adapter
    cannot see, e.g. a user's ``nn.Module`` that mean-pools ``BertModel``'s hidden states (the
    usual sentence-encoder use of MiniLM), still gets the CLS row by default: nothing in the
    forward pass tells which rows the user's code reads. Say it with ``query_rows``. Methods
    that take the gradient at the last attention output (Grad-CAM, GenericAttention,
    TransformerRelevance, PartialLRP) see which rows the score reads and refuse a default
    that leaves some out; forward-only methods cannot (see ``docs/explained-tokens.md``).

    Args:
        query_rows: which token(s) explain the output of a one-sequence model. ``None``
            (default): as described above; ``"mean"``: all real tokens, equally weighted
            (mean pooling); ``"last"``: the last real token; an int: that position (negative
            counts from the end).

    A bare encoder (``BertModel``, a CLIP tower with projection) returns features, not class
    scores: with ``target=None`` it raises :class:`InputError` instead of explaining the
    arg-max feature. Wrap it with the head whose score you explain, or pass a target.

    Example::

        >>> GenericAttention(bart).attribute((source_ids, prefix_ids), target=next_id,
        ...                                  forward_kwargs={"attention_mask": source_mask})
        >>> pooled = MeanPoolingClassifier(BertModel(config))           # the user's head
        >>> GenericAttention(pooled, adapter=HuggingFaceAdapter(query_rows="mean")).attribute(ids, target=1)
    """

    name = "huggingface"
    families = ("transformers models using AttentionInterface (BERT, DistilBERT, RoBERTa, ViT, DeiT, CLIP towers "
                "and dual encoder, GPT-2, Llama-style, BART, T5) or inline softmax attention (BLOOM, Falcon, MPT, "
                "GPT-Neo, RoFormer, DeBERTa, XLM, ...)")
    # Overridable per subclass: path component -> query stream; query stream -> key stream
    # of its cross-attention; stream set -> the method building its layouts.
    stream_components: Mapping[str, str] = _STREAM_COMPONENTS
    cross_key_streams: Mapping[str, str] = _CROSS_KEY_STREAMS
    layout_builders: Mapping[frozenset, str] = {
        frozenset({"text", "image"}): "dual_encoder_layouts",
        frozenset({"encoder", "decoder"}): "encoder_decoder_layouts",
    }

    def __init__(self, query_rows: QueryRows = None) -> None:
        self.query_rows_choice = checked_query_rows(query_rows)
        # Per capture: True where an encoder-decoder ran its decoder over the source shifted right
        # (given input_ids alone), read by encoder_decoder_layouts.
        self._shifted_source: "weakref.WeakKeyDictionary[Recorder, bool]" = weakref.WeakKeyDictionary()

    def blocks(self, model: nn.Module) -> List[Block]:
        # Asked several times per explanation: found once per walk of the modules.
        return list(module_walk.per_walk(model, ("blocks", type(self)), lambda: self._find_blocks(model)))

    def _find_blocks(self, model: nn.Module) -> List[Block]:
        found = [(name, m, block_kind(m, name)) for name, m in module_walk.named_modules(model) if is_attention_module(m)]
        streams = [self.block_streams(name, kind) for name, _, kind in found]
        if len({s[0] for s in streams if s is not None}) < 2:
            streams = [None] * len(found)  # one sequence: the default "tokens" stream
        return [Block(name, m, kind, s) for (name, m, kind), s in zip(found, streams)]

    def block_streams(self, name: str, kind: str) -> Optional[Streams]:
        """(query stream, key stream) of the block at dotted path ``name``: the first path
        component in :attr:`stream_components` names the query stream; None if none does."""
        for part in name.split("."):
            stream = self.stream_components.get(part)
            if stream is not None:
                return (stream, stream) if kind == "self" else (stream, self.cross_key_streams.get(stream, CONTEXT))
        return None

    def query_streams(self, model: nn.Module) -> frozenset:
        """The query streams of ``model``'s blocks (empty for one-sequence models)."""
        return frozenset(b.streams[0] for b in self.blocks(model) if b.streams is not None)

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        blocks = {id(b.module): b for b in self.blocks(model)}
        # Inline attention (BLOOM, Falcon, RoFormer, ... : inline_text.FAMILIES) is observed in its
        # own modules; such a model keeps the eager masks its inline code adds to the scores.
        inline = inline_blocks(blocks.values())
        key = ATTENTION_KEY if inline else capture_key(recorder, blocks.values(), model)
        with active_recorder(recorder, blocks), patching.hf_attention_implementation(model, key), \
                gradient_checkpointing_off(model), inline_observed(inline, recorder):
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        inline = inline_blocks(self.blocks(model))
        key = ATTENTION_KEY if inline else propagation_key(model, rules)
        with active_rules(rules), patching.hf_attention_implementation(model, key), \
                gradient_checkpointing_off(model), norm_rules(model, rules), operation_rules(model, rules), \
                router_rules(model, rules), inline_gated(inline, rules):
            yield

    def relevance_reading(self, model: nn.Module, at: str, messages: Optional[list] = None) -> RelevanceReading:
        """At ``"tokens"``, models of ``_EMBEDDING_READINGS`` are read at the outputs of the
        modules embedding their ids, those of ``_CHANNELS_FIRST_LAYERS`` at their first layer's
        (B, D, N) input with the tokens last; others as every adapter (the first layer's input)."""
        model_type = getattr(pretrained_model(model).config, "model_type", "")
        if at == "tokens" and messages is None and model_type in _CHANNELS_FIRST_LAYERS:
            return LayerInputs(self.first_layers(model), lambda hidden: hidden.transpose(1, 2))
        names = _EMBEDDING_READINGS.get(model_type)
        if at != "tokens" or messages is not None or names is None:
            return super().relevance_reading(model, at, messages)
        found = {name.rsplit(".", 1)[-1]: module for name, module in module_walk.named_modules(model)
                 if name.rsplit(".", 1)[-1] in names and "vision" not in name and "audio" not in name}
        if set(found) != set(names):
            raise CaptureError(
                f"{type(model).__name__} embeds its token ids in the modules {list(names)}, where its token relevance "
                f"is read, but only {sorted(found)} were found. Read relevance at the inputs (relevance_at='inputs')."
            )
        return ModuleOutputs([found[name] for name in names])

    def _quirks(self, model: nn.Module) -> Dict[str, Any]:
        return _MODEL_TYPE_QUIRKS.get(getattr(pretrained_model(model).config, "model_type", ""), {})

    def num_prefix_tokens(self, model: nn.Module) -> Optional[int]:
        return self._quirks(model).get("prefix")

    def patch_size(self, model: nn.Module):
        config = pretrained_model(model).config
        size = getattr(config, "patch_size", None)
        if isinstance(size, int):
            return (size, size)
        return super().patch_size(model)

    def rows_refusal(self, model):
        if self.query_rows_choice is not None:
            return None  # the caller chose the rows
        for module in module_walk.modules(model):
            reason = _UNWEIGHTED_POOLING.get(type(module).__name__)
            if type(module).__name__ in _WAVEFORM_CLASSIFIERS and getattr(module.config, "use_weighted_layer_sum",
                                                                           False):
                reason = ("pools a learned weighted sum of every layer's hidden states (config.use_weighted_layer_sum="
                          "True), so its score reads the frames of all layers, not of the last one")
            if reason is not None:
                return (f"{type(module).__name__} {reason}: no one row, nor one weighting of rows, is what it reads, "
                        "so the methods that weigh the last layer's rows (raw attention, rollout, attention flow, "
                        "Grad-CAM, GenericAttention, TransformerRelevance) cannot explain it as it is. Explain the "
                        "CLS token (adapter=HuggingFaceAdapter(query_rows=0)) or the patches (query_rows='mean') on "
                        "purpose, or use the relevance methods (AttnLRP, LRP, ConservativeLRP, GradientXInput) or "
                        "Captum's IntegratedGradients, which propagate through the head.")
        return None

    def query_rows(self, model, inputs, recorder, num_tokens, num_prefix, token_mask):
        batch = recorder.sites[0].batch_size
        device = inputs[0].device
        if self.query_rows_choice is not None:
            return chosen_rows(self.query_rows_choice, num_tokens, token_mask, batch, device)
        config = getattr(model, "config", None)  # the head's own config (a user's wrapper has its own head)
        pooled = None if config is None else config_pooled_rows(getattr(config, "model_type", ""),
                                                                type(model).__name__, config)
        if pooled is not None:  # a head pooling as its config says (EuroBERT's classifier_pooling)
            return chosen_rows(pooled, num_tokens, token_mask, batch, device)
        for module in module_walk.modules(model):
            name = type(module).__name__
            rows = _CLASS_ROWS.get(name)
            if rows is not None:
                return torch.tensor(rows, device=device).expand(batch, -1)
            if name in _MEAN_POOLING_HEADS:
                return chosen_rows("mean", num_tokens, token_mask, batch, device)
            if name in _MEAN_AFTER_FIRST_HEADS:
                return chosen_rows(MEAN_AFTER_FIRST, num_tokens, token_mask, batch, device)
            summary = _summary_rows(module)
            if summary is not None:  # XLNet / XLM-style heads pool a fixed column, padding or not
                return chosen_rows(summary, num_tokens, None, batch, device)
        if self._quirks(model).get("rows") == "eos":
            return self._eos_rows(model, inputs[0])
        return super().query_rows(model, inputs, recorder, num_tokens, num_prefix, token_mask)

    @staticmethod
    def _eos_rows(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.is_floating_point() or input_ids.dim() != 2:
            raise InputError(
                f"The CLIP text tower pools at the end-of-text token, found from input_ids; got an input of shape "
                f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}. Pass input_ids as the first input."
            )
        eos = _sub_config(model, "text_config").eos_token_id
        ids = input_ids.to(torch.int)
        position = ids.argmax(dim=-1) if eos == 2 else (ids == eos).int().argmax(dim=-1)
        return position.to(torch.long).unsqueeze(1)

    # -- several streams ------------------------------------------------------------------
    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        """One ``"tokens"`` stream for one-sequence models; otherwise the layouts built by the
        method :attr:`layout_builders` names for the model's set of query streams."""
        refuse_compressed_keys(recorder)  # DeepSeek-V4's compressed KV entries: keys that are no tokens
        names = frozenset(site.streams[0] for site in recorder.sites)
        if len(names) < 2:
            single = super().stream_layouts(model, inputs, recorder)
            num_tokens = single.layouts[single.explained[0]].num_tokens
            frames = self._frame_grid(model, inputs[0], num_tokens)
            fields, order, prefix = strided_input_fields(model, pretrained_model(model).config, inputs[0], num_tokens)
            if frames is None and fields is None:
                return single
            return dataclasses.replace(single, inputs=(InputSpan(single.explained[0], prefix, None, frames,
                                                                 fields=fields, field_order=order),)
                                       + single.inputs[1:])
        if self.query_rows_choice is not None:
            raise InputError(
                f"query_rows={self.query_rows_choice!r} chooses the explained rows of one token sequence, but "
                f"{type(model).__name__} has the streams {sorted(names)}, whose explained rows the adapter sets "
                "(CLIP: end-of-text and CLS tokens; encoder-decoders: the last real decoder token). Use "
                "HuggingFaceAdapter() without query_rows, or explain one tower of the model."
            )
        builder = self.layout_builders.get(names)
        if builder is None:
            raise CaptureError(
                f"{type(model).__name__} has attention over the streams {sorted(names)}, for which the {self.name} "
                f"adapter knows no layout (known: {[sorted(k) for k in self.layout_builders]}). Subclass "
                "HuggingFaceAdapter and add a layout builder, or explain one tower of the model."
            )
        return getattr(self, builder)(model, inputs, recorder)

    def dual_encoder_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                             recorder: Recorder) -> StreamLayouts:
        """CLIP: the text tower read at each text's end-of-text token, the image tower at its
        CLS token (row 0) in front of the patch grid. ``input_ids`` map onto the text
        stream, ``pixel_values`` onto the image's patch grid."""
        ids = next((t for t in inputs if not t.is_floating_point() and t.dim() == 2), None)
        if ids is None:
            raise InputError(
                f"A dual text-image encoder is explained from inputs (input_ids, pixel_values); got inputs of shapes "
                f"{[tuple(t.shape) for t in inputs]} and dtypes {[str(t.dtype) for t in inputs]}. Pass input_ids (and "
                "pixel_values) as inputs and the text attention mask in forward_kwargs."
            )
        num_text = recorder.stream_length("text")
        num_image = recorder.stream_length("image")
        batch = recorder.sites[0].batch_size
        text = TokenLayout(num_text, self._eos_rows(model, ids), recorder.stream_mask("text"))
        pixels = next((t for t in inputs if t.is_floating_point() and t.dim() == 4), None)
        vision = _sub_config(model, "vision_config")
        patch = getattr(vision, "patch_size", None)
        patch = (patch, patch) if isinstance(patch, int) else self.patch_size(model)
        size = tuple(pixels.shape[-2:]) if pixels is not None else (vision.image_size, vision.image_size)
        grid = (size[0] // patch[0], size[1] // patch[1])
        prefix = num_image - grid[0] * grid[1]
        if prefix != 1:
            raise CaptureError(
                f"The image tower attends over {num_image} tokens but an image of {size[0]}x{size[1]} with patch size "
                f"{patch} gives a {grid[0]}x{grid[1]} grid plus one CLS token. Check the image size."
            )
        image = TokenLayout(num_image, torch.zeros(batch, 1, dtype=torch.long, device=ids.device), None, prefix, grid)
        spans = tuple(InputSpan("text") if t is ids else InputSpan("image", prefix, None, grid) if t is pixels
                      else None for t in inputs)
        return StreamLayouts({"text": text, "image": image}, ("text", "image"), spans)

    def encoder_decoder_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                                recorder: Recorder) -> StreamLayouts:
        """Encoder-decoders: the decoder read at its last real token (the next-token position),
        as a causal decoder, or at the row a sequence classifier pools (:meth:`_decoder_rows`);
        the encoder is reached through cross-attention (its row 0 is a placeholder, never read).
        Input 0 maps onto the encoder, input 1 onto the decoder.

        A model given input_ids alone runs its decoder over them shifted right by one (a start
        token first) with no mask of its own: decoder position ``i`` holds source token ``i - 1``,
        so the decoder's real positions are the source's (right padding; a causal decoder row
        never reads a later one), and the source mask is the decoder's: its real positions are
        those the example alone, its padding cut, has. A model that masks its decoder itself keeps
        its mask."""
        batch = recorder.sites[0].batch_size
        device = inputs[0].device
        encoder_mask = recorder.stream_mask("encoder")
        decoder_mask = recorder.stream_mask("decoder")
        num_decoder = recorder.stream_length("decoder")
        num_encoder = recorder.stream_length("encoder")
        if ((decoder_mask is None or bool(decoder_mask.all())) and encoder_mask is not None
                and num_decoder == num_encoder and self._shifted_source.get(recorder, False)):
            # A model that masks its decoder itself (T5Gemma: the pad ids) keeps its own mask: its head
            # may read the shifted-in last token, a row the source mask calls padding.
            decoder_mask = encoder_mask
        grid, prefix = self._image_grid(model, inputs[0], num_encoder)
        frames = self._frame_grid(model, inputs[0], num_encoder)
        layouts = {
            "encoder": TokenLayout(num_encoder, torch.zeros(batch, 1, dtype=torch.long, device=device), encoder_mask,
                                   prefix, grid),
            "decoder": TokenLayout(num_decoder, self._decoder_rows(model, inputs[0], num_decoder, decoder_mask),
                                   decoder_mask),
        }
        spans = (InputSpan("encoder", prefix, None, grid or frames), InputSpan("decoder"))[: len(inputs)]
        spans += (None,) * (len(inputs) - len(spans))
        return StreamLayouts(layouts, ("decoder",), spans)

    def _decoder_rows(self, model: nn.Module, source: torch.Tensor, num_decoder: int,
                      decoder_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The decoder row (B, 1) the explained score reads: the last real decoder token (the
        next-token position), or, for a sequence classifier, the row its head pools
        (``_DECODER_CLASSIFIER_ROWS``), found from the source ids as the head finds it."""
        batch, device = source.shape[0], source.device
        rule = _DECODER_CLASSIFIER_ROWS.get(getattr(pretrained_model(model).config, "model_type", ""))
        if rule is None or not type(model).__name__.endswith("ForSequenceClassification"):
            return chosen_rows("last", num_decoder, decoder_mask, batch, device)
        if source.is_floating_point() or source.dim() != 2:
            raise InputError(
                f"{type(model).__name__} classifies from the decoder row that input_ids mark ({rule}), so the "
                f"explained row is found from input_ids; got a first input of shape {tuple(source.shape)} and dtype "
                f"{source.dtype}. Pass input_ids as the first input."
            )
        config = pretrained_model(model).config
        positions = torch.arange(source.shape[1], device=device)
        if rule == "last eos":
            marked = source == config.eos_token_id
            counts = marked.sum(dim=1)
            if bool((counts == 0).any()) or bool((counts != counts[0]).any()):
                raise InputError(
                    f"{type(model).__name__} pools the decoder row of each example's last eos token "
                    f"(eos_token_id={config.eos_token_id}), and every example must hold the same number of them; "
                    f"the rows hold {counts.tolist()}. End every row with the eos token (the tokenizer does), "
                    "or explain the examples one at a time."
                )
            rows = torch.where(marked, positions, -1).amax(dim=1)
        else:
            real = source != config.pad_token_id
            rows = (torch.where(real, positions, 0).amax(dim=1) + 1).clamp(max=num_decoder - 1)
        if bool((rows >= num_decoder).any()):
            raise InputError(
                f"{type(model).__name__} reads decoder rows {rows.tolist()} (found from input_ids), but the decoder "
                f"runs over {num_decoder} tokens. Pass decoder_input_ids as long as input_ids, or none (the model "
                "then shifts input_ids)."
            )
        return rows.to(torch.long).unsqueeze(1)

    def _frame_grid(self, model: nn.Module, features: torch.Tensor, num_tokens: int) -> Optional[Tuple[int, int]]:
        """The (1, tokens) grid of audio features (B, mel bins, frames) of a model whose quirks
        say so (Whisper), its tokens along the frames: an :class:`InputSpan` with it maps each
        token's score onto its frames (upsampled linearly, the same at every mel bin), as an
        image's patch scores onto its pixels. None for other inputs and models."""
        if self._quirks(model).get("frames") != "last" or features.dim() != 3 or not features.is_floating_point():
            return None
        frames = features.shape[-1]
        if frames % num_tokens:
            raise CaptureError(
                f"The audio encoder attends over {num_tokens} tokens, which do not divide the {frames} frames of the "
                f"input features of shape {tuple(features.shape)} (expected (batch, mel bins, frames) with a whole "
                "number of frames per token). Pass the features the model's feature extractor makes, or "
                "return_tokens=True for the token scores."
            )
        return (1, num_tokens)

    def _image_grid(self, model: nn.Module, pixels: torch.Tensor, num_tokens: int):
        """(grid, prefix tokens) of an image input to an encoder (VisionEncoderDecoder's ViT);
        (None, 0) for token inputs."""
        if pixels.dim() != 4 or not pixels.is_floating_point():
            return None, 0
        patch = self.patch_size(model)
        grid = None if patch is None else (pixels.shape[-2] // patch[0], pixels.shape[-1] // patch[1])
        if grid is None or not 0 <= num_tokens - grid[0] * grid[1] <= 2:
            raise CaptureError(
                f"The encoder attends over {num_tokens} tokens, which do not form the patch grid of an image of shape "
                f"{tuple(pixels.shape)} (patch size {patch}) with at most two prefix tokens. Image inputs of "
                "encoder-decoders are mapped for ViT-style encoders only; explain the token sequences instead."
            )
        return grid, num_tokens - grid[0] * grid[1]

    def kept_logits(self, model, inputs, additional_forward_args, forward_kwargs):
        """A causal LM's logits at the explained position only (``logits_to_keep``)."""
        return kept_logit_positions(model, inputs, additional_forward_args, forward_kwargs, self.query_rows_choice)

    def captured_forward(self, model, inputs, additional_forward_args, forward_kwargs, recorder, contexts=(),
                         keep_logits=None):
        """Notes, for the layouts, whether an encoder-decoder derives its decoder sequence from
        the source (one input, no decoder ids, embeddings or mask given)."""
        decoder_keys = ("decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask")
        self._shifted_source[recorder] = (len(inputs) == 1 and takes_decoder_inputs(model)
                                          and not any(k in (forward_kwargs or {}) for k in decoder_keys))
        return super().captured_forward(model, inputs, additional_forward_args, forward_kwargs, recorder, contexts,
                                        keep_logits)

    def call_model(self, model, inputs, additional_forward_args, forward_kwargs):
        """An encoder-decoder given inputs ``(input_ids, decoder_input_ids)`` gets the second
        by keyword (positionally it would land on ``attention_mask``). A left-padded batch
        without ``position_ids`` for a model with learned absolute positions is warned about
        (:func:`warn_left_padding_without_positions`)."""
        warn_left_padding_without_positions(
            model, forward_kwargs,
            module_walk.per_walk(model, ("learned_positions",), lambda: learned_position_table(model)))
        if len(inputs) != 2 or not takes_decoder_inputs(model):
            return super().call_model(model, inputs, additional_forward_args, forward_kwargs)
        keyword = "decoder_inputs_embeds" if inputs[1].is_floating_point() else "decoder_input_ids"
        given = [k for k in ("decoder_input_ids", "decoder_inputs_embeds") if k in (forward_kwargs or {})]
        if given:
            raise InputError(
                f"The decoder sequence was given twice: as the second input and as forward_kwargs {given}. Pass "
                "inputs=(input_ids, decoder_input_ids), or inputs=input_ids with decoder_input_ids in forward_kwargs "
                "(then the decoder prefix gets no attribution)."
            )
        return model(inputs[0], *additional_forward_args, **{**(forward_kwargs or {}), keyword: inputs[1]})

    def gradient_forward_kwargs(self, model, forward_kwargs):
        if getattr(getattr(model, "config", None), "model_type", None) not in _IN_PLACE_CACHE_MODEL_TYPES \
                or "use_cache" in (forward_kwargs or {}):
            return forward_kwargs
        return {**(forward_kwargs or {}), "use_cache": False}

    def resolve_target(self, model, logits, target):
        """CLIP's dual encoder (``logits_per_image``, images x texts): ``None`` explains each
        image with its own text, and any target must pair the images with the texts one to
        one (a permutation), so each text tower map explains exactly one similarity."""
        batch = logits.shape[0]
        paired = logits.dim() == 2 and logits.shape[1] == batch and {"text", "image"} <= self.query_streams(model)
        if not paired:
            try:
                return super().resolve_target(model, logits, target)
            except InputError as error:
                if _token_axis(model) is not None or not type(model).__name__.endswith(_NEXT_TOKEN_HEADS):
                    raise
                raise InputError(
                    f"{error} {type(model).__name__} scores every position and is explained at its next-token "
                    "position (the last real token; an encoder-decoder's last real decoder token), so the target is "
                    "a token id there. To explain the token at position p, pass the tokens before p (an "
                    "encoder-decoder: decoder_input_ids up to p, or target=(p, token) for its decoder row p)."
                ) from None
        if target is None:
            target = list(range(batch))
        scores, index = super().resolve_target(model, logits, target)
        chosen = index[:, 0].tolist()
        if sorted(chosen) != list(range(batch)):
            repeated = sorted({j for j in chosen if chosen.count(j) > 1})
            raise InputError(
                f"target={chosen} pairs the {batch} images with texts {chosen}, which is not a permutation of "
                f"range({batch}): texts {repeated} are chosen by several images and "
                f"{sorted(set(range(batch)) - set(chosen))} by none, so the text tower's map of a text would mix "
                f"several similarities. Pass target=list(range({batch})) (or None) to explain each image with its own "
                "text, or any permutation; explain other pairs in separate calls."
            )
        return scores, index

    def next_token_rows(self, model, inputs, forward_kwargs):
        """A causal LM of a family whose token mixing is causal by construction
        (``_CAUSAL_BY_CONSTRUCTION``: Mamba, RWKV, RecurrentGemma, whose recurrences attend over
        nothing the adapter sees) given (B, N) ids reads its next token at each row's last real
        token (by ``forward_kwargs["attention_mask"]``); None for any other model or input."""
        config = getattr(model, "config", None)
        if (getattr(config, "model_type", None) not in _CAUSAL_BY_CONSTRUCTION
                or not type(model).__name__.endswith(_NEXT_TOKEN_HEADS) or len(inputs) != 1
                or inputs[0].dim() != 2 or inputs[0].is_floating_point()):
            return None
        mask = (forward_kwargs or {}).get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != inputs[0].shape):
            return None
        return chosen_rows("last", inputs[0].shape[1], mask, inputs[0].shape[0], inputs[0].device)[:, 0]

    def target_names_position(self, model, target):
        """An encoder-decoder LM head (``...ForConditionalGeneration``: BART, T5) given a
        ``(decoder position, token)`` target: the logit of that token at that decoder row (BART
        as a masked LM: called with ``input_ids`` alone, decoder row p reconstructs source token
        p, as transformers' fill-mask pipeline reads it)."""
        return (type(model).__name__.endswith("ForConditionalGeneration") and takes_decoder_inputs(model)
                and target_width(target) == 2)

    def rows_for_target(self, model, streams, index):
        """Token-level heads (``_TOKEN_LEVEL_HEADS``: token classification, masked LM, question
        answering) and encoder-decoder LM heads given a (position, token) target
        (:meth:`target_names_position`): each example's explained row is its target's token,
        ``index[:, axis]``, unless ``query_rows`` chose the rows; a padded target token is refused."""
        axis = _token_axis(model)
        if axis is None and index.shape[1] == 2 and self.target_names_position(model, (0, 0)):
            axis = 0
        if axis is None or self.query_rows_choice is not None or len(streams.explained) != 1:
            return streams
        # One sequence, or an encoder-decoder's decoder (its heads score every decoder token).
        layout = streams.layouts[streams.explained[0]]
        rows = index[:, axis:axis + 1].to(device=layout.query_rows.device, dtype=torch.long)
        rows = torch.where(rows < 0, rows + layout.num_tokens, rows)
        refuse_masked_explained_rows(rows, None, layout.token_mask)
        layouts = dict(streams.layouts)
        layouts[streams.explained[0]] = dataclasses.replace(layout, query_rows=rows, query_weights=None)
        return StreamLayouts(layouts, streams.explained, streams.inputs)

    def check_output(self, model, output, target):
        """A ModelOutput with no score field (a bare encoder: ``pooler_output``, ``image_embeds``,
        ``last_hidden_state``) holds features: refused with ``target=None``, whose arg-max
        would explain whichever feature happens to be largest."""
        if target is not None or isinstance(output, (torch.Tensor, tuple, list)):
            return
        if not hasattr(output, "items") or any(isinstance(getattr(output, field, None), torch.Tensor)
                                               for field in _SCORE_FIELDS):
            return
        fields = [name for name, value in output.items() if isinstance(value, torch.Tensor)]
        raise InputError(
            f"{type(model).__name__} returned {type(output).__name__} with the fields {fields}: hidden features, not "
            "class scores, and no target was given, so there is no score to explain (the arg-max of a feature vector "
            "is not a prediction). Wrap the encoder in an nn.Module with the head whose score you explain (e.g. "
            "mean pooling + linear) and explain that; or pass target=<feature index> to explain one feature. "
            + QUERY_ROWS_HINT
        )

    def logits(self, model, output, layout, causal):
        """The score tensor: a field of the output (``_OUTPUT_FIELDS``), or, for extractive
        question answering, ``start_logits`` and ``end_logits`` stacked as (B, 2, N)."""
        spans = span_scores(output)
        if spans is not None:
            return spans
        if not isinstance(output, (torch.Tensor, tuple, list)):
            for field in _OUTPUT_FIELDS:
                value = output.get(field) if isinstance(output, Mapping) else getattr(output, field, None)
                if isinstance(value, torch.Tensor):
                    output = value
                    break
            else:
                raise InputError(
                    f"{type(output).__name__} has none of the fields {_OUTPUT_FIELDS}; wrap the model so that its "
                    "forward returns the score tensor to explain. " + QUERY_ROWS_HINT
                )
        # A token-level head of a causal model (GPT-2, Llama token classifiers) scores every
        # position: its target names the position, so no next-token position is picked.
        return super().logits(model, output, layout, causal and _token_axis(model) is None)
