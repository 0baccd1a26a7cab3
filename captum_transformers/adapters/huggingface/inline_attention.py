"""HuggingFace models whose attention is written inline: LXMERT and VisualBERT.

These models never go through ``AttentionInterface``: each attention module computes
``A = softmax(Q K^T / sqrt(d) + M)`` itself and then calls its own dropout child,
``self.dropout(A)``, before ``A V``. So the dropout's *input* is the softmax output, the
very tensor autograd differentiates (in eval mode the dropout is the identity), and a
forward hook on that child observes every attention map without changing one operation.

Mechanism, inside :meth:`InlineAttentionAdapter.capture` (only :mod:`~captum_transformers.model_state.patching`
hooks, removed on exit or on an exception):

1. a forward pre-hook on each attention module taps its query input through
   :meth:`Recorder.connect` (gradients then reach the maps of frozen models) and notes the
   additive mask it received (padding keys: ``-inf``, ``-10000`` or ``finfo.min``);
2. a forward hook on its dropout child records ``A`` with the call's (query, key) streams;
3. pre-hooks on the embedding modules note which tensors enter which stream, so every
   user input maps back onto its tokens (:class:`~captum_transformers.capture.trace.InputSpan`).

Streams (Chefer et al., ICCV 2021, Sec. 3-4: bi-modal self- and co-attention):

* LXMERT: ``"text"`` and ``"image"``. Language layers and ``lang_self_att`` are
  ``("text", "text")``; relational layers and ``visn_self_att`` ``("image", "image")``;
  the co-attention module ``x_layers.k.visual_attention`` runs twice per cross layer,
  language queries over vision keys ``("text", "image")`` first, then vision queries over
  language keys ``("image", "text")``. The output reads the text CLS token.
  Inputs ``(input_ids, visual_feats, visual_pos)`` (the model's positional order) map to
  the text tokens, the image regions, and nothing (box coordinates are not tokens).
* VisualBERT: one stream ``"tokens"`` over ``[text tokens; visual tokens]``. ``input_ids``
  (or ``inputs_embeds``) is tokens ``0:t``, ``visual_embeds`` tokens ``t:t+i``. The
  model's second positional argument is ``attention_mask``, so pass ``visual_embeds`` by
  name: ``attribute(input_ids, forward_kwargs={"visual_embeds": v, "attention_mask": m})``;
  its tokens are then in ``return_tokens=True``'s scores. To get a map shaped like
  ``visual_embeds`` too, wrap the model so ``visual_embeds`` is positional (any
  ``nn.Module`` whose forward passes the tensors through unchanged is found and mapped).

Propagation rules (:meth:`InlineAttentionAdapter.propagation`) cover every preset; the
forward pass stays bit-identical. Token relevance (``ConservativeLRP`` and the other
relevance methods at ``"tokens"``) is read at the input of each stream's first layer: for
LXMERT the first language layer (text) and the first relational layer (image regions), so
the two sum to the explained output under conservative rules.

Example::

    >>> from captum_transformers import GenericAttention
    >>> text, regions, boxes = GenericAttention(lxmert_vqa).attribute(
    ...     (input_ids, visual_feats, visual_pos), target=answer,
    ...     forward_kwargs={"attention_mask": mask})          # boxes: zeros
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...errors import CaptureError, InputError
from ...propagation.rules.operations import operation_rules
from ...propagation.rules.rule_set import RuleSet, gate, norm_rules
from ...capture.trace import Block, InputSpan, StreamLayouts, Streams, TokenLayout
from ..base import Adapter
from ...capture.recorder import Recorder

TEXT, IMAGE, TOKENS = "text", "image", "tokens"
# Additive masks below this block the key: -inf, -10000 (older BERT code) and finfo.min all do.
_BLOCKED_BELOW = -1e3


@dataclasses.dataclass(frozen=True)
class InlineFamily:
    """One model family with inline attention, as data.

    ``attention``: class name of the modules computing ``softmax(Q K^T / sqrt(d) + M) V``;
    ``dropout``: their child applied to the probabilities; ``query`` / ``context`` / ``mask``:
    forward arguments holding the queries, the keys (None: the queries) and the additive mask.
    ``sites``: (path segment, stream pairs); a module whose dotted name contains the segment
    gets those pairs, cycled over its calls (first match wins). ``entries``: (module class,
    argument, stream, segment): the argument's tokens are the ``segment``-th part of ``stream``
    (stream None: an input without tokens). ``explained``: streams whose rows the output reads.
    """

    attention: str
    sites: Tuple[Tuple[str, Tuple[Streams, ...]], ...]
    entries: Tuple[Tuple[str, str, Optional[str], int], ...]
    explained: Tuple[str, ...]
    streams: Tuple[str, ...]
    # (stream, layer list): token relevance of the stream is read at the list's first layer.
    first_layers: Tuple[Tuple[str, str], ...] = ()
    dropout: str = "dropout"
    query: str = "hidden_states"
    context: Optional[str] = None
    mask: str = "attention_mask"


FAMILIES: Dict[str, InlineFamily] = {
    "lxmert": InlineFamily(
        attention="LxmertAttention",
        context="context",
        sites=(
            # The co-attention module: language queries first, then vision queries (LxmertXLayer.cross_att).
            ("visual_attention", ((TEXT, IMAGE), (IMAGE, TEXT))),
            ("lang_self_att", ((TEXT, TEXT),)),
            ("visn_self_att", ((IMAGE, IMAGE),)),
            ("r_layers", ((IMAGE, IMAGE),)),
            ("layer", ((TEXT, TEXT),)),
        ),
        entries=(
            ("LxmertEmbeddings", "input_ids", TEXT, 0),
            ("LxmertEmbeddings", "inputs_embeds", TEXT, 0),
            ("LxmertVisualFeatureEncoder", "visual_feats", IMAGE, 0),
            ("LxmertVisualFeatureEncoder", "visual_pos", None, 0),
        ),
        explained=(TEXT,),
        streams=(TEXT, IMAGE),
        # Module order (layer, x_layers, r_layers) is not call order (layer, r_layers, x_layers).
        first_layers=((TEXT, "layer"), (IMAGE, "r_layers")),
    ),
    "visual_bert": InlineFamily(
        attention="VisualBertSelfAttention",
        sites=(("layer", ((TOKENS, TOKENS),)),),
        entries=(
            ("VisualBertEmbeddings", "input_ids", TOKENS, 0),
            ("VisualBertEmbeddings", "inputs_embeds", TOKENS, 0),
            ("VisualBertEmbeddings", "visual_embeds", TOKENS, 1),
        ),
        explained=(TOKENS,),
        streams=(TOKENS,),
    ),
}

# Where each head reads its class scores: (output field, position in the tuple of return_dict=False).
_SCORES: Dict[str, Tuple[str, int]] = {
    "LxmertForQuestionAnswering": ("question_answering_score", 0),
    "LxmertForPreTraining": ("question_answering_score", 2),
    "VisualBertForQuestionAnswering": ("logits", 0),
    "VisualBertForVisualReasoning": ("logits", 0),
}
# Heads that pool another token than the first: VisualBERT's VQA head gathers the token
# before the last real text token (``attention_mask.sum(1) - 2``, as in its original code).
_ROWS: Dict[str, str] = {"VisualBertForQuestionAnswering": "before_last_text"}


def _pretrained(model: nn.Module) -> nn.Module:
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise CaptureError(f"{type(model).__name__} contains no transformers PreTrainedModel.")


def _key_valid(mask: Any) -> Optional[torch.Tensor]:
    """Non-padding keys (B, K) from an additive (B, 1, Q, K) mask, read at the last query row."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    row = mask[:, 0, -1, :]
    return row if row.dtype == torch.bool else row > _BLOCKED_BELOW


@dataclasses.dataclass
class _Entries:
    """What the embedding modules received during one capture: per stream, the length of
    each segment, and each tensor that entered with its (stream, segment). The tensors are
    held (not their ids) so an input is matched by identity, never by a recycled id."""

    lengths: Dict[str, Dict[int, int]] = dataclasses.field(default_factory=dict)
    tensors: List[Tuple[torch.Tensor, Optional[str], int]] = dataclasses.field(default_factory=list)


class InlineAttentionAdapter(Adapter):
    """Adapter for LXMERT (co-attention, streams ``"text"`` and ``"image"``) and VisualBERT
    (one stream ``"tokens"`` over text and visual tokens), whose attention is inline.

    Supported heads (score field): ``LxmertForQuestionAnswering`` and ``LxmertForPreTraining``
    with ``task_qa`` (``question_answering_score``), ``VisualBertForQuestionAnswering`` and
    ``VisualBertForVisualReasoning`` (``logits``); any wrapper whose forward returns a tensor.
    Call ``model.eval()`` first: in training mode the recorded maps are those before dropout
    while the model uses the dropped ones.
    """

    name = "inline_attention"
    families = "transformers models with inline attention (LXMERT, VisualBERT)"

    def __init__(self) -> None:
        # Per capture, the embedding entries (read by stream_layouts after the forward pass).
        self._entries: "weakref.WeakKeyDictionary[Recorder, _Entries]" = weakref.WeakKeyDictionary()

    # -- sites ----------------------------------------------------------------------
    def family(self, model: nn.Module) -> InlineFamily:
        config = _pretrained(model).config
        family = FAMILIES.get(getattr(config, "model_type", ""))
        if family is None:
            raise CaptureError(
                f"The {self.name} adapter knows the model types {sorted(FAMILIES)}; got "
                f"{getattr(config, 'model_type', None)!r} ({type(model).__name__}). Use adapter='huggingface'."
            )
        if getattr(config, "bypass_transformer", False):
            raise CaptureError(
                "VisualBERT with bypass_transformer=True attends over the text alone, then over text and visual "
                "tokens in one extra layer: sequences of two lengths, which this adapter does not map. Explain a "
                "model with bypass_transformer=False."
            )
        return family

    def _streams_of(self, family: InlineFamily, name: str) -> Tuple[Streams, ...]:
        parts = name.split(".")
        for segment, pairs in family.sites:
            if segment in parts:
                return pairs
        raise CaptureError(f"Attention module {name!r} matches no stream rule of the {self.name} adapter.")

    def blocks(self, model: nn.Module) -> List[Block]:
        family = self.family(model)
        blocks = []
        for name, module in model.named_modules():
            if type(module).__name__ != family.attention:
                continue
            pairs = self._streams_of(family, name)
            kind = "self" if all(q == k for q, k in pairs) else "cross"
            blocks.append(Block(name, module, kind, pairs[0] if len(pairs) == 1 else None))
        if not blocks:
            raise CaptureError(f"{type(model).__name__} has no {family.attention} module to observe.")
        return blocks

    def first_layers(self, model: nn.Module) -> Dict[Optional[str], nn.Module]:
        family = self.family(model)
        if not family.first_layers:
            return super().first_layers(model)
        modules = dict(model.named_modules())
        layers = {}
        for stream, layer_list in family.first_layers:
            found = [name for name in modules if name.split(".")[-2:] == [layer_list, "0"]]
            if not found:
                raise CaptureError(
                    f"{type(model).__name__} has no {layer_list!r} layers, where the {stream} tokens enter the "
                    f"model alone; read relevance at the inputs instead (relevance_at='inputs')."
                )
            layers[stream] = modules[found[0]]
        return layers

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        family = self.family(model)
        entries = _Entries()
        self._entries[recorder] = entries
        with contextlib.ExitStack() as stack:
            for block in self.blocks(model):
                dropout = getattr(block.module, family.dropout, None)
                if not isinstance(dropout, nn.Module):
                    raise CaptureError(
                        f"{block.name!r} ({type(block.module).__name__}) has no {family.dropout!r} child module; "
                        "this transformers version computes attention differently from what the adapter expects."
                    )
                call = _Call(block, self._streams_of(family, block.name), family, recorder)
                stack.enter_context(patching.forward_hook(block.module, call.before, pre=True, with_kwargs=True))
                stack.enter_context(patching.forward_hook(dropout, call.after))
            for module in model.modules():
                rows = [row for row in family.entries if row[0] == type(module).__name__]
                if rows:
                    stack.enter_context(patching.forward_hook(module, _entry_hook(module, rows, entries),
                                                              pre=True, with_kwargs=True))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        """The rules on the inline attention: the AH gate returns the dropout's output
        detached (the same values), so ``A V`` treats ``A`` as a constant; norms get their
        rule by probing; per-operation rules (softmax identity, alpha-beta linears, uniform
        products, normalised adds) see the inline ``softmax`` / ``matmul`` / ``+`` directly."""
        family = self.family(model)
        with contextlib.ExitStack() as stack:
            if rules.attention_gate != "gradient":
                for block in self.blocks(model):
                    stack.enter_context(patching.forward_hook(
                        getattr(block.module, family.dropout), lambda module, args, output: gate(output, rules)))
            stack.enter_context(norm_rules(model, rules))
            stack.enter_context(operation_rules(model, rules))
            yield

    # -- layout ---------------------------------------------------------------------
    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        family = self.family(model)
        entries = self._entries.get(recorder)
        if entries is None or not entries.lengths:
            raise CaptureError(
                f"No embedding module of {type(model).__name__} ran during the capture, so the {self.name} adapter "
                "cannot tell which tokens are text and which are visual."
            )
        batch = recorder.sites[0].batch_size
        device = inputs[0].device
        head = type(_pretrained(model)).__name__
        layouts = {}
        for stream in family.streams:
            segments = entries.lengths.get(stream, {})
            num_tokens = sum(segments.values())
            observed = recorder.stream_length(stream)
            if observed != num_tokens:
                raise CaptureError(
                    f"The {stream!r} stream entered with {num_tokens} tokens ({segments}) but its attention saw "
                    f"{observed}."
                )
            mask = recorder.stream_mask(stream)
            rows = torch.zeros(batch, 1, dtype=torch.long, device=device)
            if _ROWS.get(head) == "before_last_text" and stream in family.explained:
                if mask is None:
                    raise InputError(f"{head} pools the token before its last real text token, found from "
                                     "attention_mask: pass forward_kwargs={'attention_mask': mask}.")
                rows = (mask[:, :segments.get(0, 0)].sum(dim=1) - 2).to(device=device, dtype=torch.long)[:, None]
            layouts[stream] = TokenLayout(num_tokens, rows, mask)
        spans = tuple(self._span(entries, tensor) for tensor in inputs)
        return StreamLayouts(layouts, family.explained, spans)

    @staticmethod
    def _span(entries: _Entries, tensor: torch.Tensor) -> Optional[InputSpan]:
        """The tokens an input holds: found by identity with what entered an embedding module."""
        found = next(((stream, segment) for entered, stream, segment in entries.tensors if entered is tensor), None)
        if found is None or found[0] is None:
            return None
        stream, segment = found
        lengths = entries.lengths[stream]
        start = sum(length for index, length in lengths.items() if index < segment)
        return InputSpan(stream, start, start + lengths[segment])

    def logits(self, model: nn.Module, output: Any, layout: TokenLayout, causal: bool) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return super().logits(model, output, layout, causal)
        pretrained = _pretrained(model)
        head = type(pretrained).__name__
        if head not in _SCORES:
            raise InputError(
                f"{head} returns no class scores this adapter knows; supported heads are {sorted(_SCORES)}. Wrap "
                "the model in an nn.Module whose forward returns the score tensor to explain."
            )
        field, position = _SCORES[head]
        if head == "LxmertForPreTraining" and not pretrained.config.task_qa:
            raise InputError("LxmertForPreTraining has no answer scores with config.task_qa=False; use a model "
                             "built with task_qa=True or LxmertForQuestionAnswering.")
        value = output[position] if isinstance(output, (tuple, list)) else getattr(output, field, None)
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{head}'s output has no tensor {field!r}; got {type(output).__name__}.")
        return value


class _Call:
    """The hooks of one attention module: tap the queries and note the mask before it runs,
    record the probabilities entering its dropout."""

    def __init__(self, block: Block, pairs: Tuple[Streams, ...], family: InlineFamily, recorder: Recorder):
        self.block, self.pairs, self.recorder = block, pairs, recorder
        self.signature = inspect.signature(block.module.forward)
        self.family = family
        self.calls = 0
        self.pending: List[Tuple[Optional[torch.Tensor], Streams, Optional[tuple]]] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        bound = self.signature.bind(*args, **kwargs)
        family = self.family
        query = bound.arguments.get(family.query)
        # LXMERT's co-attention alternates its query stream: language first, then vision. Both
        # directions of one cross layer read the layer's inputs: one group, applied together.
        streams = self.pairs[self.calls % len(self.pairs)]
        group = (self.block.name, self.calls // len(self.pairs)) if len(self.pairs) > 1 else None
        self.calls += 1
        self.pending.append((_key_valid(bound.arguments.get(family.mask)), streams, group))
        if not isinstance(query, torch.Tensor):
            return None
        tapped = self.recorder.connect(query)
        if tapped is query:
            return None
        if family.context is not None and bound.arguments.get(family.context) is query:
            bound.arguments[family.context] = tapped  # self-attention passes one tensor twice
        bound.arguments[family.query] = tapped
        return bound.args, bound.kwargs

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self.pending:
            return  # the dropout ran outside its attention module's forward
        key_valid, streams, group = self.pending.pop()
        probs = args[0]
        self.recorder.record(self.block, probs, key_valid=key_valid, streams=streams, group=group)


def _entry_hook(module: nn.Module, rows: List[Tuple[str, str, Optional[str], int]], entries: _Entries):
    signature = inspect.signature(module.forward)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        arguments = signature.bind(*args, **kwargs).arguments
        for _, argument, stream, segment in rows:
            tensor = arguments.get(argument)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
                continue
            entries.tensors.append((tensor, stream, segment))
            if stream is not None:
                entries.lengths.setdefault(stream, {})[segment] = tensor.shape[1]
        return None

    return hook
