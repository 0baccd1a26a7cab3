"""Text models whose attention is written inline, observed inside the HuggingFace adapter.

About thirty transformers text families compute ``A = softmax(Q K^T / sqrt(d) + M)`` in their
attention module's own forward instead of calling ``AttentionInterface``, so the adapter's
kernel never sees them. Each such family is a row of :data:`FAMILIES` (which modeling module,
which attention classes, where the softmax runs over ``(B * H, Q, K)`` and which attribute
holds ``H``, which instances or arguments are refused). For every module of a row:

* :func:`observed` (inside :meth:`HuggingFaceAdapter.capture`) runs its forward under a
  torch-function mode scoped to that call, which catches the one ``softmax`` over the last
  axis and records its output, the very tensor the model multiplies with ``V`` (dropout in
  eval mode is the identity; functional dropout, a dropout child, none at all: the same
  observation point). The query input is tapped through :meth:`Recorder.connect`, so
  gradients reach the maps of frozen models.
* The mask is read where the model applied it, in the softmax input: a key is real when some
  head and query of the call gives it a score above :data:`BLOCKED_BELOW` (``-inf``,
  ``finfo.min`` and the ``-1e4`` of older code all block). A self-attention call is causal
  when every (earlier query, later key) pair of real tokens is blocked in every head, so the
  adapter reads a causal LM at its last real token whatever the family calls its flag
  (``is_decoder``, ``causal``, a causal-only decoder).
* :func:`gated` (inside :meth:`HuggingFaceAdapter.propagation`) returns the caught softmax
  output through the rules' attention gate (detached under the AH gate, so ``A V`` treats
  ``A`` as a constant); the per-operation rules of :func:`operation_rules` see the inline
  ``softmax`` / ``matmul`` / ``+`` themselves. The forward stays bit-identical.

Families whose attention is not softmax attention over the input sequence are refused by
name (:data:`REFUSED`, :func:`refuse_unobservable`): block-sparse, sliding-window, local blocks
with global tokens (Pegasus-X), Nystrom, LSH, pooling, mixed convolution heads, prompt tokens
(CPM-Ant); XLNet's two-stream (``target_mapping``) and memory calls are refused per call.

Example::

    >>> GenericAttention(BloomForCausalLM(config).eval()).attribute(ids, target=next_id,
    ...                                                           forward_kwargs={"attention_mask": mask})
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from typing import Any, Callable, FrozenSet, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...capture.recorder import Recorder
from ...capture.trace import Block
from ...errors import CaptureError, UnsupportedModelError
from ...model_state import patching
from ...propagation.rules.rule_set import RuleSet, gate

# Scores below this block the key: -inf, finfo.min and -1e4 (OpenAI GPT's causal mask) all do.
BLOCKED_BELOW = -1e3
_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax)
# Casts a family applies to the map right after a float32 softmax (``.to(dtype)``, ``.type_as(x)``).
_CASTS = (torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.type, torch.Tensor.double, torch.Tensor.float,
          torch.Tensor.half, torch.Tensor.bfloat16)


@dataclasses.dataclass(frozen=True)
class InlineTextFamily:
    """One text family with inline softmax attention, as data.

    ``module``: its modeling module; ``attention``: class names of the modules computing
    ``softmax(Q K^T + M) V``; ``heads``: the attribute holding the number of heads where the
    softmax runs over ``(B * H, Q, K)`` (BART-style code), None where it runs over
    ``(B, H, Q, K)``; ``refused_instances``: (test on the module, why) refused before the
    forward; ``refused_arguments``: (forward argument, why) refused when the call passes it;
    ``causal_decoder``: the self-attention of its decoder (a block under a ``decoder`` path) must
    be causal, else the call is refused with ``causal_decoder`` as the reason.
    """

    name: str
    module: str
    attention: Tuple[str, ...]
    heads: Optional[str] = None
    refused_instances: Tuple[Tuple[Callable[[nn.Module], bool], str], ...] = ()
    refused_arguments: Tuple[Tuple[str, str], ...] = ()
    causal_decoder: Optional[str] = None
    # Why the family's scores move with the padding (a position bias measured from the padded end):
    # softmax ignores a shift, but the identity rule of softmax (LRP, TransformerRelevance) does not.
    padding_shifts_scores: Optional[str] = None
    # The mask leaves each query its own key, padding included (XLNet's non-target mask): a key is
    # real when a query at another position sees it (padding keys are seen by themselves alone).
    self_seen_keys: bool = False
    # The module dispatches through AttentionInterface (the kernel records its map) but sets no
    # ``is_causal`` flag though its self-attention gets a causal mask (BigBird-Pegasus's decoder): the
    # row only tells the kernel, per call, that a self-attention whose mask blocks every later key is causal.
    causal_by_mask: bool = False


_CAUSAL_DECODER = "its decoder self-attention ran without a causal mask"


def _modeling(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


FAMILIES: Tuple[InlineTextFamily, ...] = (
    InlineTextFamily("BLOOM", _modeling("bloom"), ("BloomAttention",)),  # ALiBi, causal
    InlineTextFamily("Falcon", _modeling("falcon"), ("FalconAttention",)),  # ALiBi or rotary, causal
    InlineTextFamily("GPT-Neo", _modeling("gpt_neo"), ("GPTNeoSelfAttention",)),  # global and local layers
    InlineTextFamily("MPT", _modeling("mpt"), ("MptAttention",), padding_shifts_scores=(
        "MPT's ALiBi bias is measured from the end of the padded sequence, so padding adds a constant to a "
        "padded example's scores: softmax ignores it, but the identity rule of softmax passes relevance in "
        "proportion to the scores, so that example's map would depend on its padding (up to 20% measured)")),
    InlineTextFamily("Megatron-BERT", _modeling("megatron_bert"), ("MegatronBertSelfAttention",)),
    InlineTextFamily("RoFormer", _modeling("roformer"), ("RoFormerSelfAttention",)),
    InlineTextFamily("RemBERT", _modeling("rembert"), ("RemBertSelfAttention",)),
    InlineTextFamily("MPNet", _modeling("mpnet"), ("MPNetSelfAttention",)),
    InlineTextFamily("TAPAS", _modeling("tapas"), ("TapasSelfAttention",)),
    InlineTextFamily("SqueezeBERT", _modeling("squeezebert"), ("SqueezeBertSelfAttention",)),
    InlineTextFamily("XLM", _modeling("xlm"), ("MultiHeadAttention",)),
    InlineTextFamily("FlauBERT", _modeling("flaubert"), ("MultiHeadAttention",)),
    InlineTextFamily("OpenAI GPT", _modeling("openai"), ("Attention",)),
    InlineTextFamily("I-BERT", _modeling("ibert"), ("IBertSelfAttention",), refused_instances=(
        (lambda module: bool(getattr(module, "quant_mode", False)),
         "quant_mode=True: its integer softmax approximation (IntSoftmax) is no softmax these methods read; "
         "explain a model built with quant_mode=False"),)),
    InlineTextFamily("LUKE", _modeling("luke"), ("LukeSelfAttention",), refused_arguments=(
        ("entity_hidden_states", "entity inputs: its attention runs over words and entities, tokens that are not "
                                 "the input_ids; explain the words alone (no entity_ids)"),)),
    InlineTextFamily("DeBERTa", _modeling("deberta"), ("DisentangledSelfAttention",), refused_instances=(
        (lambda module: getattr(module, "head_weights_proj", None) is not None,
         "talking_head=True: a linear map mixes the heads' probabilities after the softmax, so no map is what "
         "multiplies the values; explain a model built with talking_head=False"),)),
    InlineTextFamily("DeBERTa-v2", _modeling("deberta_v2"), ("DisentangledSelfAttention",)),
    InlineTextFamily("FSMT", _modeling("fsmt"), ("Attention",), heads="num_heads", causal_decoder=(
        _CAUSAL_DECODER + ": FSMT builds that mask only when called with use_cache=False (transformers 5.x), so "
        "every decoder position saw the later ones and no next-token score is explained by its prefix; call it "
        "with forward_kwargs={'use_cache': False} (in float32: transformers cannot build the mask in float64)")),
    InlineTextFamily("MVP", _modeling("mvp"), ("MvpAttention",), heads="num_heads", causal_decoder=_CAUSAL_DECODER,
                     refused_arguments=(
        ("attn_prompt", "use_prompt=True: learned prompt keys are prepended to every layer's keys, tokens that "
                        "are not the input's; explain a model built with use_prompt=False"),)),
    InlineTextFamily("TrOCR", _modeling("trocr"), ("TrOCRAttention",), heads="num_heads",
                     causal_decoder=_CAUSAL_DECODER),
    InlineTextFamily("GPT-NeoX-Japanese", _modeling("gpt_neox_japanese"), ("GPTNeoXJapaneseAttention",)),
    InlineTextFamily("BigBird (attention_type='original_full')", _modeling("big_bird"), ("BigBirdSelfAttention",)),
    # Sequence-first (len, batch, ...) states, but the softmax runs over (B, H, Q, K) scores ac + bd + ef.
    InlineTextFamily("XLNet", _modeling("xlnet"), ("XLNetRelativeAttention",), self_seen_keys=True, refused_arguments=(
        ("g", "two-stream attention: with target_mapping the query stream g attends over the content stream "
              "through a second softmax per layer, for the permuted factorisation order's targets, not the input's "
              "tokens; call it without target_mapping (the content stream alone)"),
        ("mems", "memory from earlier segments: its keys run over the cached mems and the input, tokens that are "
                 "not the input's; call it without mems"))),
    InlineTextFamily("BigBird-Pegasus (attention_type='original_full')", _modeling("bigbird_pegasus"),
                     ("BigBirdPegasusSelfAttention",)),  # the encoder's full self-attention
    InlineTextFamily("BigBird-Pegasus decoder", _modeling("bigbird_pegasus"), ("BigBirdPegasusDecoderAttention",),
                     causal_by_mask=True),
    # One attention class for the encoder, the decoder and cross-attention; the decoder's calls get
    # the causal mask transformers builds (create_causal_mask) but no flag.
    InlineTextFamily("NLLB-MoE", _modeling("nllb_moe"), ("NllbMoeAttention",), causal_by_mask=True),
    # Encoders of images and audio written the same way (the rows serve them as they serve text):
    # Data2Vec-Vision (BEiT's attention with its relative position bias) and SEW-D (DeBERTa-v2's).
    InlineTextFamily("Data2Vec-Vision", "transformers.models.data2vec.modeling_data2vec_vision",
                     ("Data2VecVisionSelfAttention",)),
    InlineTextFamily("SEW-D", _modeling("sew_d"), ("DisentangledSelfAttention",)),
)


@dataclasses.dataclass(frozen=True)
class Refused:
    """A family with inline attention that is not softmax attention over the input sequence:
    ``module`` and ``attention`` ("" for any class of the module) name its attention modules."""

    name: str
    module: str
    attention: str
    why: str


REFUSED: Tuple[Refused, ...] = (
    Refused("BigBird (attention_type='block_sparse')", _modeling("big_bird"), "BigBirdBlockSparseAttention",
            "block-sparse attention: each query block attends to a few random, sliding and global key blocks, so "
            "its eager maps are not the softmax the model computes per block; build the model with "
            "attention_type='original_full'"),
    Refused("Longformer", _modeling("longformer"), "",
            "sliding-window attention with global tokens: each token attends to a window of keys (its eager maps "
            "are (window,) rows, not maps over the sequence)"),
    Refused("LED", _modeling("led"), "LEDEncoderSelfAttention",
            "Longformer sliding-window attention with global tokens in the encoder"),
    Refused("LongT5 local", _modeling("longt5"), "LongT5LocalAttention",
            "local attention in the encoder: blocks of tokens attend to their own and the neighbouring blocks "
            "(its eager maps are (blocks, block, 3 blocks) windows, not maps over the sequence)"),
    Refused("LongT5 transient-global", _modeling("longt5"), "LongT5TransientGlobalAttention",
            "transient-global attention in the encoder: local windows plus keys that are sums of blocks of tokens "
            "(side tokens that are not input tokens)"),
    # Nystromformer and YOSO (no softmax map over the tokens) are refused before any capture, by
    # family (adapters/unsupported.py: NotSoftmaxAttentionError).
    Refused("Funnel Transformer", _modeling("funnel"), "",
            "attention with pooled queries that shortens the sequence between blocks (and upsamples it again)"),
    Refused("ConvBERT", _modeling("convbert"), "",
            "mixed heads: half the heads are span-based dynamic convolutions, which no attention map describes"),
    Refused("CPM-Ant", _modeling("cpmant"), "",
            "config.prompt_length learned prompt tokens are prepended to the input and attended to in every layer, "
            "so its maps run over tokens that are not the input's (the huggingface adapter's layout has no such "
            "text prefix); besides, its mask lets every token see every other one (context=1 throughout), so "
            "CpmAntForCausalLM's next-token scores are not causal, and it takes padding as left padding of id 0 "
            "(attention_mask is ignored)"),
    Refused("BigBird-Pegasus (attention_type='block_sparse')", _modeling("bigbird_pegasus"),
            "BigBirdPegasusBlockSparseAttention",
            "block-sparse attention: each query block attends to a few random, sliding and global key blocks; on "
            "short inputs the model switches itself to full attention, replacing its attention modules during the "
            "forward pass, which the adapter cannot follow. Build the model with attention_type='original_full' (or "
            "call model.model.encoder.set_attention_type('original_full') first)"),
    Refused("Pegasus-X", _modeling("pegasus_x"), "PegasusXGlobalLocalAttention",
            "local block attention with global tokens: each input token attends to its block of config.block_size "
            "tokens (staggered by half a block every other layer) and to config.num_global_tokens learned global "
            "tokens, which are no input tokens and carry their own hidden states through the encoder, so its maps "
            "run over tokens that are not the input's"),
)


def _is(module: nn.Module, modeling: str, names: Iterable[str]) -> bool:
    cls = type(module)
    return cls.__module__ == modeling and (not names or cls.__name__ in names)


def refuse_unobservable(blocks: Iterable[Block]) -> None:
    """Raise :class:`UnsupportedModelError` naming the family when an attention module of
    ``blocks`` belongs to a row of :data:`REFUSED`."""
    for block in blocks:
        for row in REFUSED:
            if _is(block.module, row.module, (row.attention,) if row.attention else ()):
                raise UnsupportedModelError(
                    f"{block.name!r} ({type(block.module).__name__}) is {row.name} attention, which the huggingface "
                    f"adapter does not explain: {row.why}. These methods chain softmax maps over one token "
                    "sequence; explain a model with plain softmax attention, or pass adapter=YourAdapter() that "
                    "describes this attention."
                )


def inline_blocks(blocks: Iterable[Block]) -> List[Tuple[Block, InlineTextFamily]]:
    """The blocks whose attention is inline, each with its family row; refused families
    (:data:`REFUSED`) and refused instances raise :class:`UnsupportedModelError`."""
    blocks = list(blocks)
    refuse_unobservable(blocks)
    found = []
    for block in blocks:
        family = next((row for row in FAMILIES if _is(block.module, row.module, row.attention)), None)
        if family is None:
            continue
        for refused, why in family.refused_instances:
            if refused(block.module):
                raise UnsupportedModelError(f"{block.name!r} ({family.name}) is refused: {why}.")
        found.append((block, family))
    return found


# The recorder of the capture in this context, and the rules of the propagation context.
_RECORDING: contextvars.ContextVar[Optional[Recorder]] = contextvars.ContextVar(
    "captum_transformers_inline_recorder", default=None)
_GATING: contextvars.ContextVar[Optional[RuleSet]] = contextvars.ContextVar(
    "captum_transformers_inline_rules", default=None)
# Ids of the modules whose forward is wrapped in this context (capture and propagation share one wrapper).
_WRAPPED: contextvars.ContextVar[FrozenSet[int]] = contextvars.ContextVar(
    "captum_transformers_inline_wrapped", default=frozenset())


@contextlib.contextmanager
def observed(found: List[Tuple[Block, InlineTextFamily]], recorder: Recorder) -> Iterator[None]:
    """Inside: every inline attention call of ``found`` reports its map to ``recorder``. Replayed
    and streamed maps are declined (the dense path): they need the kernel's own computation."""
    if not found:
        yield
        return
    for plan in (getattr(recorder.spec, "replay", None), getattr(recorder.spec, "row_stream", None)):
        if plan is not None:
            plan.decline(f"inline attention ({found[0][1].name}): the maps are recorded as the model computes them")
    with _set_while_wrapped(_RECORDING, recorder, found):
        yield


@contextlib.contextmanager
def gated(found: List[Tuple[Block, InlineTextFamily]], rules: RuleSet) -> Iterator[None]:
    """Inside: every inline attention map of ``found`` reaches ``A V`` through ``rules``' gate."""
    found = [(block, family) for block, family in found if not family.causal_by_mask]  # the kernel's rules
    if not found:
        yield
        return
    with _set_while_wrapped(_GATING, rules, found):
        yield


@contextlib.contextmanager
def _set_while_wrapped(variable: contextvars.ContextVar, value: Any,
                       found: List[Tuple[Block, InlineTextFamily]]) -> Iterator[None]:
    """``variable`` set to ``value`` while the modules of ``found`` run wrapped."""
    token = variable.set(value)
    try:
        with _wrapped(found):
            yield
    finally:
        variable.reset(token)


@contextlib.contextmanager
def _wrapped(found: List[Tuple[Block, InlineTextFamily]]) -> Iterator[None]:
    wrapped = _WRAPPED.get()
    with contextlib.ExitStack() as stack:
        for block, family in found:
            if id(block.module) not in wrapped:
                stack.enter_context(patching.instance_forward(block.module, _forward_maker(block, family)))
        token = _WRAPPED.set(wrapped | {id(block.module) for block, _ in found})
        try:
            yield
        finally:
            _WRAPPED.reset(token)


def _forward_maker(block: Block, family: InlineTextFamily) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            recorder, rules = _RECORDING.get(), _GATING.get()
            if family.causal_by_mask:
                return _flagging_causal(original, signature, block, args, kwargs) if recorder is not None \
                    else original(*args, **kwargs)
            if recorder is None and rules is None:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            for argument, why in family.refused_arguments:
                if bound.arguments.get(argument) is not None:
                    raise UnsupportedModelError(f"{block.name!r} ({family.name}) was called with {argument!r}, which "
                                                f"the huggingface adapter refuses: {why}.")
            if recorder is not None:
                _tap_query(bound, signature, recorder)
            catcher = _SoftmaxCatcher(block, family, recorder, rules)
            with catcher:
                output = original(*bound.args, **bound.kwargs)
            catcher.finish()
            if catcher.calls == 0:
                raise CaptureError(
                    f"{block.name!r} ({type(block.module).__name__}, {family.name}) ran without a softmax over its "
                    "keys, where this transformers version was expected to compute one; its attention cannot be "
                    "observed. Check the transformers version (the adapter is tested with 5.x)."
                )
            return output

        return forward

    return make


def _flagging_causal(original: Callable, signature: inspect.Signature, block: Block, args: tuple, kwargs: dict):
    """One call of a :attr:`InlineTextFamily.causal_by_mask` module: a self-attention call whose
    4-D mask blocks every (query, later key) pair of real tokens runs with ``is_causal=True``, the
    flag the kernel reads; the module computes as before (its attention never reads the flag)."""
    arguments = signature.bind(*args, **kwargs).arguments
    mask = arguments.get("attention_mask")
    if block.kind != "self" or arguments.get("key_value_states") is not None or not isinstance(mask, torch.Tensor) \
            or mask.dim() != 4 or getattr(block.module, "is_causal", False):
        return original(*args, **kwargs)
    blocked = ~mask if mask.dtype == torch.bool else mask.detach() <= BLOCKED_BELOW
    if not _causal(blocked, _keys_seen(blocked, False)):
        return original(*args, **kwargs)
    with patching.attributes(block.module, is_causal=True):
        return original(*args, **kwargs)


def _tap_query(bound: inspect.BoundArguments, signature: inspect.Signature, recorder: Recorder) -> None:
    """Tap the first floating-point tensor argument (the hidden states the queries come from)."""
    for name in signature.parameters:
        value = bound.arguments.get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bound.arguments[name] = recorder.connect(value)
            return


class _SoftmaxCatcher(TorchFunctionMode):
    """Scoped to one attention call: catches the one softmax over the keys (and the dtype cast
    right after it, where the model takes the softmax in float32: BLOOM, MPT, XLM), records the
    map the model goes on with and returns it through the gate."""

    def __init__(self, block: Block, family: InlineTextFamily, recorder: Optional[Recorder],
                 rules: Optional[RuleSet]):
        super().__init__()
        self.block, self.family, self.recorder, self.rules = block, family, recorder, rules
        self.calls = 0
        # (scores, the map in the graph, what the model got) until the call ends or casts the map.
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pending is not None and func in _CASTS and args and args[0] is self.pending[2]:
            scores, probs, _ = self.pending
            cast = func(probs, *args[1:], **kwargs)
            self.pending = (scores, cast, gate(cast, self.rules))
            return self.pending[2]
        output = func(*args, **kwargs)
        if func not in _SOFTMAX:
            return output
        self.calls += 1
        scores = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        expected = 3 if self.family.heads is not None else 4
        if self.calls > 1 or scores.dim() != expected or dim not in (-1, scores.dim() - 1):
            raise CaptureError(
                f"{self.block.name!r} ({type(self.block.module).__name__}, {self.family.name}) computed a softmax of "
                f"shape {tuple(scores.shape)} over dim {dim} (call {self.calls}); the adapter expects one softmax over "
                f"the keys of {'(B * H, Q, K)' if expected == 3 else '(B, H, Q, K)'} scores per call. This "
                "transformers version computes the attention differently from what the adapter knows."
            )
        self._refuse_shifted_scores(scores)
        self.pending = (scores, output, gate(output, self.rules))
        return self.pending[2]

    def _refuse_shifted_scores(self, scores: torch.Tensor) -> None:
        """A padded batch under the identity softmax rule, for a family whose scores move with padding."""
        why = self.family.padding_shifts_scores
        if why is None or self.rules is None or self.rules.softmax != "identity":
            return
        padded = bool((scores.detach() <= BLOCKED_BELOW).all(dim=-2).any())  # a key no query sees: padding
        if padded:
            raise CaptureError(
                f"{self.block.name!r} ({self.family.name}) under the {self.rules.name!r} rules (identity rule of "
                f"softmax) on a padded batch: {why}. Explain padded examples one at a time (padding cut), or use "
                "AttnLRP, ConservativeLRP or GenericAttention, whose rules a shift does not move."
            )

    def finish(self) -> None:
        """Record the caught map (at the end of the call: a cast may follow the softmax)."""
        if self.pending is not None and self.recorder is not None:
            self._record(*self.pending[:2])
        self.pending = None

    def _record(self, scores: torch.Tensor, probs: torch.Tensor) -> None:
        block, recorder = self.block, self.recorder
        grad_view = None
        if self.family.heads is not None:  # (B * H, Q, K): viewed as (B, H, Q, K)
            heads = int(getattr(block.module, self.family.heads))
            shape = (probs.shape[0] // heads, heads) + tuple(probs.shape[1:])
            scores, map_ = scores.reshape(shape), probs.view(shape)
            grad_view = lambda grad: grad.view(shape)  # noqa: E731
        else:
            map_ = probs
        blocked = scores.detach() <= BLOCKED_BELOW
        key_valid = _keys_seen(blocked, self.family.self_seen_keys)
        known = recorder.stream_valid.get(block.default_streams[1])
        causal = _causal(blocked, key_valid if known is None else known.to(torch.bool)) if block.kind == "self" else None
        if self.family.causal_decoder and causal is False and "decoder" in block.name.split("."):
            raise UnsupportedModelError(f"{block.name!r} ({self.family.name}) is refused: {self.family.causal_decoder}.")
        recorder.record(block, map_, grad_tensor=probs if grad_view is not None else None, grad_view=grad_view,
                        key_valid=None if known is not None else key_valid, causal=bool(causal))


def _keys_seen(blocked: torch.Tensor, self_seen: bool) -> torch.Tensor:
    """(B, K): keys some head and query sees; ``self_seen``: some query at another position."""
    num_queries, num_keys = blocked.shape[-2:]
    if self_seen and num_queries == num_keys > 1:
        own = torch.eye(num_keys, dtype=torch.bool, device=blocked.device)
        blocked = blocked | own  # a query's own key does not count
    return ~blocked.all(dim=2).all(dim=1)


def _causal(blocked: torch.Tensor, valid: torch.Tensor) -> Optional[bool]:
    """Whether every (query, later key) pair of real tokens is blocked in every head; None where
    the call has no such pair (one real token, or queries and keys of two sequences)."""
    num_queries, num_keys = blocked.shape[-2:]
    if num_queries != num_keys or valid.shape[-1] != num_keys:
        return None
    later = torch.ones(num_queries, num_keys, dtype=torch.bool, device=blocked.device).triu_(1)
    pairs = later & valid[:, :, None] & valid[:, None, :]  # (B, Q, K)
    if not bool(pairs.any()):
        return None
    return bool((blocked.all(dim=1) | ~pairs).all())
