"""The explicit attention kernel that HuggingFace models run while captured.

transformers >= 5 dispatches attention through ``ALL_ATTENTION_FUNCTIONS`` keyed by
``config._attn_implementation``. :func:`captum_attention` is registered there under a
private key (:data:`ATTENTION_KEY`), together with the eager mask function under the same
key (without it, padding masks would be silently dropped). Models that run "sdpa" get a second
key (:data:`SDPA_KEY`, SDPA's masks): under rules that are a scaling of the attention operands'
gradients and with no map wanted, :func:`captum_sdpa_attention` runs transformers' own SDPA
call over those operands (propagation/fused_attention.py). The adapter points a model's
configs at the key only inside its contexts; the kernel reads the active recorder and rule
set from context variables (:func:`active_recorder`, :func:`active_rules`) and is inert
outside them. Entering either checks the registries: a foreign function under our key is
refused (:class:`CaptureError`); a replaced entry under another key ("eager", "sdpa"), which
captured models do not run, is reported once by a warning.
"""
from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ...errors import CaptureError, UnsupportedModelError
from ...capture.row_stream import UnreadWeights
from .replayed_kernel import explicit_sdpa_mask, replay_of, replayed_attention, sdpa_mask_for
from ...propagation.attention.core import softmax_attention
from ...propagation.backward_switch import SWITCH
from ...propagation.attention.chunk_products import repeat_heads
from ...propagation.attention.fused import fused_operands, scaled_gradient
from ...propagation.rules.operations import paused_rule_mode
from ...propagation.attention.constant_map import attention_over_constant_map
from ...propagation.attention.head_products import heads_matmul
from ...propagation.attention.recomputed_softmax import softmax_of_recomputed_scores
from ...propagation.attention.sinks import attention_softmax, constant_sinks
from ...propagation.rules.rule_set import RuleSet, gate
from ...capture.trace import Block
from ...capture.recorder import Recorder, SiteObserver
from .weights_readers import weights_reader
from .kernel_rows import fused_output, grouped_scores, keys_needed_of, masked_from, plain_gradient_of

ATTENTION_KEY = "captum_transformers"
# The key of models whose own implementation is "sdpa": SDPA's masks, and the fused kernel where
# the rules allow it (captum_sdpa_attention).
SDPA_KEY = "captum_transformers_sdpa"

# The recorder the kernel reports to in this context and its blocks keyed by module id (set by
# active_recorder; None outside one). An adapter may clear it around calls no recorder sees.
ACTIVE: contextvars.ContextVar[Optional[Tuple[Recorder, Dict[int, Block]]]] = contextvars.ContextVar(
    "captum_transformers_hf_recorder", default=None
)
_RULES: contextvars.ContextVar[Optional[RuleSet]] = contextvars.ContextVar("captum_transformers_hf_rules", default=None)
_REGISTERED = False

# Attributes under which models keep a cross-attention module whose class does not say so
# (BART family: encoder_attn; T5: EncDecAttention inside T5LayerCrossAttention; BERT: crossattention).
_CROSS_COMPONENTS = frozenset({"encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention",
                               "encoder_decoder_attention"})
# The keywords under which models pass attention sinks (propagation/attention/sinks.py): GPT-OSS and
# its relatives ``s_aux`` (one learned logit per head), Inkling2 ``sinks`` (per query, refused).
SINK_KERNEL_ARGS = ("s_aux", "sinks")
# Attention classes of causal decoders that set no ``is_causal`` flag (a row of data per class):
# Doge's dynamic-mask attention adds a learned per-head bias to its causal mask.
CAUSAL_WITHOUT_FLAG = frozenset({"DogeAttention"})


def is_causal_module(module: nn.Module) -> bool:
    """Whether ``module``'s self-attention is causal: its ``is_causal`` flag, or a row of
    :data:`CAUSAL_WITHOUT_FLAG`."""
    return bool(getattr(module, "is_causal", False)) or type(module).__name__ in CAUSAL_WITHOUT_FLAG


#: An additive mask value at or below which a key is blocked (padding), as the inline adapter reads it.
BLOCKED_BELOW = -1e3


def _key_valid_from_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Non-padding keys (B, K) from a 4D additive or boolean mask: the keys some query may attend to.

    Padding keys are blocked for every query; a sliding window (Mistral, Qwen2, Gemma 2/3) or
    a chunk blocks a real key only for distant queries, while the key's own query (the
    diagonal) always sees it. So the union over query rows is exactly the padding mask; one
    row (the last) would take the keys outside its window for padding.
    """
    if mask is None or mask.dim() != 4:
        return None
    rows = mask[:, 0]
    if rows.dtype == torch.bool:
        return rows.any(dim=1)
    # The largest additive value over the queries: no (B, Q, K) temporary. Blocked below -1e3, not
    # only near the dtype's minimum: MarkupLM (and BERT-era code) blocks padding with -10000, whose
    # probabilities are exactly 0 too (exp(-1000) underflows in every float format).
    return rows.amax(dim=1) > BLOCKED_BELOW


def _add(scores: torch.Tensor, addend: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``scores + addend``, in ``scores``'s buffer when ``in_place`` and that gives the same
    tensor (same dtype and shape after broadcasting); a new tensor otherwise."""
    if in_place and torch.result_type(scores, addend) == scores.dtype \
            and torch.broadcast_shapes(scores.shape, addend.shape) == scores.shape:
        return scores.add_(addend)
    return scores + addend


def captum_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                     dropout: float = 0.0, **kwargs: Any):
    """Explicit softmax attention that reports its probabilities to the active recorder.

    ``A = softmax(Q K^T * scaling + position_bias + mask)``, ``O = A V``, with grouped-query
    heads expanded, optional logit soft-capping, and the eager dropout. ``position_bias``
    is T5's (and its relatives') additive relative-position bias (T5 also passes
    ``scaling=1.0``). Attention sinks (``s_aux``: one learned logit per head, GPT-OSS) are an
    extra softmax column dropped from the map (propagation/attention/sinks.py), whose rows then sum
    to ``1 - p_sink``. Returns ``(O transposed to (B, Q, H, D), A)`` as every transformers
    kernel does.
    """
    sinks = _sinks_of(module, query, kwargs)
    active = ACTIVE.get()
    if active is not None:
        query = active[0].connect(query)
    rules = _RULES.get()
    position_bias = kwargs.get("position_bias")
    # Where no map is wanted and the rules are a scaling of the operands' gradients (AttnLRP,
    # plain gradients; see fused_attention), the operations run plainly over those operands:
    # what the model's eager attention costs (autograd keeps A, nothing is recomputed). The AH
    # gate takes the branch below, which costs the same (A kept for the product with V).
    if not (active is not None and active[0].wants_maps) and rules is not None and rules.attention_gate == "gradient" \
            and kwargs.get("softcap") is None and SWITCH.get() is None and (dropout == 0.0 or not module.training):
        # Over such operands no operation of the kernel gets a rule from the mode.
        with paused_rule_mode():
            operands = fused_operands(rules, query, key, value,
                                      position_bias is not None and position_bias.requires_grad)
            if operands is not None:
                return _explicit_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs,
                                           active, rules, operands, sinks)
    return _explicit_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs, active, rules,
                               None, sinks)


def _sinks_of(module: nn.Module, query: torch.Tensor, kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The call's attention sinks as constant (H,) logits (propagation/attention/sinks.py), or None;
    refused by name where they are not one constant logit per head, or given twice."""
    given = [name for name in SINK_KERNEL_ARGS if kwargs.get(name) is not None]
    if len(given) > 1:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes attention sinks under both {given} to its attention kernel; the "
            "captum_transformers kernel applies one set. This model is not supported by the HuggingFace adapter.")
    return constant_sinks(kwargs[given[0]], query.shape[1], type(module).__name__) if given else None


def _explicit_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], scaling: Optional[float], dropout: float,
                        kwargs: Dict[str, Any], active, rules: Optional[RuleSet], operands,
                        sinks: Optional[torch.Tensor] = None):
    """The body of :func:`captum_attention`; ``operands``: those of :func:`fused_operands`
    (the rules carried by their gradients), or None; ``sinks``: constant (H,) sink logits, or None."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    position_bias = kwargs.get("position_bias")
    if operands is not None:
        query, key, value, bias_factor = operands
        if position_bias is not None:
            position_bias = position_bias.detach() if bias_factor is None else scaled_gradient(position_bias, bias_factor)
    groups = query.shape[1] // key.shape[1]
    mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None

    def scores(query: torch.Tensor, key_states: torch.Tensor, *extras: torch.Tensor,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        extras = iter(extras)
        fresh = not torch.is_grad_enabled()  # nothing to differentiate: the same operations in one buffer
        if out is None or not fresh:
            scores = heads_matmul(query, key_states.transpose(-1, -2))
            scores = scores.mul_(scaling) if fresh else scores * scaling
        else:  # the chunked backward's buffer: the few query rows scaled, not the (B, H, c, K) scores
            scores = grouped_scores(query * scaling, key_states, groups, out)
        if position_bias is not None:
            scores = _add(scores, next(extras), fresh)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap) if fresh else torch.tanh(scores / softcap) * softcap
        if mask is not None:
            rows = next(extras)
            # A causal chunk of rows attends to every key before its first row: only the rest is masked.
            tail = masked_from(mask, rows) if fresh and (mask.dtype == torch.bool or torch.result_type(
                scores, rows) == scores.dtype) and torch.broadcast_shapes(scores.shape, rows.shape) == scores.shape \
                else 0  # (in place: the masked part is a view of the scores)
            part, rows = (scores[..., tail:], rows[..., tail:]) if tail else (scores, rows)
            if mask.dtype == torch.bool:
                blocked, lowest = ~rows, torch.finfo(scores.dtype).min
                part = part.masked_fill_(blocked, lowest) if fresh else part.masked_fill(blocked, lowest)
            else:
                part = _add(part, rows, fresh)
            scores = scores if tail else part
        return scores

    if sinks is not None:  # every softmax of these scores appends them (propagation/attention/sinks.py)
        scores.sinks = sinks
    if softcap is None:
        scores.plain_gradient = plain_gradient_of(scaling)
    scores.writes_into = True  # takes out=: the chunked backward pass reuses one buffer for every chunk
    scores.kv_groups = groups  # key_states and value_states repeat each model head, and go nowhere else
    scores.batch_sliceable = True  # reads nothing per example but its arguments
    scores.row_sliceable = True  # nor per query row: a chunk of rows gets that chunk of the scores
    if mask is not None:
        scores.keys_needed = keys_needed_of(mask)  # the mask comes last among the extras
    # A streamed forward needs only the output: SDPA's fused kernel where it gives the same (hf_rows).
    scores.fused_output = fused_output(mask, scaling, softcap is None and position_bias is None and sinks is None)
    extras = tuple(t for t in (position_bias, mask) if t is not None)
    # float32 at least (half-precision scores), float64 for float64 models: the model's own
    # precision, so float64 maps equal its eager attention's, not a float32 rounding of them.
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    observer = None
    replay = replay_of(active, module, kwargs, rules, dropout, query, key, sinks)  # forward-only: replayed_kernel
    if replay is not None:
        output, probs = replayed_attention(replay, len(active[0].sites), scores, query, repeat_heads(key, groups),
                                           repeat_heads(value, groups), extras, softmax_dtype, kwargs)
    elif operands is not None:
        key_states, value_states = repeat_heads(key, groups), repeat_heads(value, groups)
        # The rules live in the operands' gradients: no rule Function may act on these operations.
        with torch._C.DisableTorchFunction():
            probs = attention_softmax(scores, scores(query, key_states, *extras), softmax_dtype).to(query.dtype)
            output = torch.matmul(probs, value_states)
        # A gradient reaching the returned map from outside (a model that uses its attention
        # weights) skips the halving of A V, so it is undone for it: as attention_core adds it.
        probs = scaled_gradient(probs, 1.0 / bias_factor)
    elif (rules is None or rules.attention_gate == "gradient") and (dropout == 0.0 or not module.training):
        # One Function for softmax(S) V that recomputes S and A in its backward pass: no
        # (B, H, Q, K) tensor is kept per layer (see attention_core), and the model's H / G heads
        # of keys and values, not their H repeats.
        observer = SiteObserver() if active is not None else None
        output, probs = softmax_attention(scores, query, key, value, *extras, softmax_dtype=softmax_dtype,
                                          observer=observer, keep_map=not _streamed(active, module, kwargs),
                                          kv_groups=groups)
    else:  # a constant gate or training-mode dropout between the map and the product
        key_states, value_states = repeat_heads(key, groups), repeat_heads(value, groups)
        if rules is not None and rules.softmax == "identity":
            # The identity rule needs the scores: recompute them in the backward pass.
            probs = softmax_of_recomputed_scores(scores, query, key_states, *extras, dim=-1, dtype=softmax_dtype)
        else:
            probs = attention_softmax(scores, scores(query, key_states, *extras), softmax_dtype)
        probs = probs.to(query.dtype)
        dropped = nn.functional.dropout(gate(probs, rules), p=dropout, training=module.training)
        output = torch.matmul(dropped, value_states)
    if active is not None:
        _record(active, module, probs, attention_mask, observer, replayed=replay is not None)
        if (observer is not None or replay is not None) and not any(probs.stride()):  # a stand-in: no map
            probs = UnreadWeights.of(probs)
    return output.transpose(1, 2).contiguous(), probs


def _streamed(active, module: nn.Module, kwargs: Dict[str, Any]) -> bool:
    """Whether the kernel returns a stand-in for its map (see softmax_attention): the recorder only
    reports maps to a row stream (no forward reduction) and nothing may read the weights; where
    something may, the stream is declined (dense path, ``row_stream.reason``) and the map returned."""
    spec = None if active is None else active[0].spec
    if spec is None or spec.row_stream is None or spec.forward_reduce is not None or spec.row_stream.streamed is False:
        return False
    reader = weights_reader(module, kwargs)
    if reader:
        spec.row_stream.decline(reader)
    return not reader


def _record(active, module: nn.Module, probs: torch.Tensor, attention_mask: Optional[torch.Tensor],
            observer: Optional[SiteObserver], replayed: bool = False) -> None:
    recorder, blocks = active
    block = blocks.get(id(module)) or Block(type(module).__name__, module, block_kind(module))
    # The recorder keeps the first mask per key stream: later calls need not derive theirs.
    known = block.default_streams[1] in recorder.stream_valid
    recorder.record(block, probs, key_valid=None if known else _key_valid_from_mask(attention_mask),
                    causal=is_causal_module(module) and block.kind == "self",
                    observer=observer, replayed=replayed)


def captum_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs: Any):
    """The kernel of models that run ``"sdpa"`` (under :data:`SDPA_KEY`, with transformers'
    SDPA masks: boolean, or None for a causal or unpadded sequence).

    When no map is wanted (relevance under rules that are a scaling of the operands, see
    :mod:`~captum_transformers.propagation.attention.fused`: the AH gate, AttnLRP, plain
    gradients), transformers' own ``sdpa_attention_forward`` runs over operands whose gradients
    carry the rules: the forward is the model's own, and the backward pass is the fused kernel's,
    which keeps nothing of size (B, H, Q, K). Otherwise (a map to record or differentiate, the
    softmax identity rule, training-mode dropout, soft-capping) :func:`captum_attention` runs with
    the mask SDPA was given, the causal one made explicit.
    """
    active = ACTIVE.get()
    rules = _RULES.get()
    if (active is None or not active[0].wants_maps) and SWITCH.get() is None \
            and (dropout == 0.0 or not module.training) \
            and all(kwargs.get(name) is None for name in ("softcap", *SINK_KERNEL_ARGS)):
        position_bias = kwargs.get("position_bias")
        # Over such operands no operation of the kernel gets a rule from the mode.
        with paused_rule_mode():
            operands = fused_operands(rules, query, key, value,
                                      position_bias is not None and position_bias.requires_grad)
            if operands is not None:
                return _fused_sdpa(module, *operands, attention_mask, dropout, scaling, is_causal, active, kwargs)
    sinks = _sinks_of(module, query, kwargs)
    mask, causal_rows = sdpa_mask_for(module, query, key, attention_mask, is_causal,
                                      replay_of(active, module, kwargs, rules, dropout, query, key, sinks))
    return captum_attention(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs, **causal_rows)


def _fused_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                bias_factor: Optional[float], attention_mask: Optional[torch.Tensor], dropout: float,
                scaling: Optional[float], is_causal: Optional[bool], active, kwargs: Dict[str, Any]):
    """transformers' own SDPA call over the operands of :func:`fused_operands` (see
    :func:`captum_sdpa_attention`)."""
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        kwargs["position_bias"] = (position_bias.detach() if bias_factor is None
                                   else scaled_gradient(position_bias, bias_factor))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def run(value: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)[0]

    if bias_factor is None and kwargs.get("position_bias") is None and kwargs.get("cache") is None \
            and torch.is_grad_enabled() and value.requires_grad:
        # A constant map (the AH rule): the model's own call forward, g_V = A^T g_O backward.
        output = attention_over_constant_map(run, query, key, value,
                                             explicit_sdpa_mask(module, query, key, attention_mask, is_causal),
                                             query.shape[-1] ** -0.5 if scaling is None else scaling)
    else:
        output = run(value)
    if active is not None:
        # No map is made: the recorder reads only its shape (B, H, Q, K), from a zero-stride stand-in.
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        _record(active, module, query.new_zeros(()).expand(shape), attention_mask, None)
    return output, None


def block_kind(module: nn.Module, name: str = "") -> str:
    """``"cross"`` when the module says so, or sits under an attribute of _CROSS_COMPONENTS."""
    cross = getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__
    cross = cross or any(part in _CROSS_COMPONENTS for part in name.split("."))
    return "cross" if cross else "self"


def _register_kernel() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(ATTENTION_KEY, captum_attention)
    AttentionInterface.register(SDPA_KEY, captum_sdpa_attention)
    # The shipped masks by name: the "eager" and "sdpa" entries may have been replaced already.
    AttentionMaskInterface.register(ATTENTION_KEY, eager_mask)
    AttentionMaskInterface.register(SDPA_KEY, sdpa_mask)
    _REGISTERED = True


# (registry name, key, id of the function) already warned about.
_WARNED_FOREIGN: set = set()


def _shipped(function: Any) -> bool:
    return (getattr(function, "__module__", None) or "").split(".")[0] == "transformers"


def _describe(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def _check_registry() -> None:
    """Refuse a kernel or mask entry under :data:`ATTENTION_KEY` that is not ours; warn once
    about other entries of transformers' attention registries that another library replaced.

    The kernel key decides what every captured attention computes, so a foreign function
    there is a :class:`CaptureError`. Other keys ("eager", "sdpa", ...) are not run while a
    model is captured, so the maps are unaffected; the model's own forward outside an
    explanation runs them, which the warning says.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registries = (("ALL_ATTENTION_FUNCTIONS", "AttentionInterface", ALL_ATTENTION_FUNCTIONS),
                  ("ALL_MASK_ATTENTION_FUNCTIONS", "AttentionMaskInterface", ALL_MASK_ATTENTION_FUNCTIONS))
    expected = {("ALL_ATTENTION_FUNCTIONS", ATTENTION_KEY): captum_attention,
                ("ALL_ATTENTION_FUNCTIONS", SDPA_KEY): captum_sdpa_attention,
                ("ALL_MASK_ATTENTION_FUNCTIONS", ATTENTION_KEY): "eager_mask",
                ("ALL_MASK_ATTENTION_FUNCTIONS", SDPA_KEY): "sdpa_mask"}
    for registry, interface, functions in registries:
        for our_key in (ATTENTION_KEY, SDPA_KEY):
            ours, wanted = functions[our_key], expected[(registry, our_key)]
            expected_ours = (ours is wanted if callable(wanted)
                             else _shipped(ours) and getattr(ours, "__qualname__", "") == wanted)
            if not expected_ours:
                raise CaptureError(
                    f"{registry}[{our_key!r}] is {_describe(ours)}, not captum_transformers' own entry: another "
                    "library replaced it, so captured attention would be computed by that code. Undo it with "
                    f"`del {registry}[{our_key!r}]` (a per-instance override) or do not re-register the key."
                )
        for key in list(functions):
            function = functions[key]
            if key in (ATTENTION_KEY, SDPA_KEY) or _shipped(function) or (registry, key, id(function)) in _WARNED_FOREIGN:
                continue
            _WARNED_FOREIGN.add((registry, key, id(function)))
            local = key in getattr(functions, "_local_mapping", {})
            undo = (f"`del {registry}[{key!r}]`" if local else
                    f"`{interface}.register({key!r}, <the function transformers ships>)`")
            warnings.warn(
                f"transformers' {registry}[{key!r}] was replaced by {_describe(function)} (another library patched it "
                "in this process). Explanations are unaffected: captured models run captum_transformers' own "
                f"kernel. The models' own forward passes outside explanations run the replacement; undo it with "
                f"{undo}.", UserWarning, stacklevel=4)


@contextlib.contextmanager
def active_recorder(recorder: Recorder, blocks: Dict[int, Block]) -> Iterator[None]:
    """Inside: every kernel call reports to ``recorder`` (``blocks`` keyed by module id)."""
    _register_kernel()
    _check_registry()
    token = ACTIVE.set((recorder, blocks))
    try:
        yield
    finally:
        ACTIVE.reset(token)


@contextlib.contextmanager
def active_rules(rules: RuleSet) -> Iterator[None]:
    """Inside: every kernel call applies ``rules`` to its softmax and attention gate."""
    _register_kernel()
    _check_registry()
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)
