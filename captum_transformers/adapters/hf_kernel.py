"""The explicit attention kernel that HuggingFace models run while captured.

transformers >= 5 dispatches attention through ``ALL_ATTENTION_FUNCTIONS`` keyed by
``config._attn_implementation``. :func:`captum_attention` is registered there under a
private key (:data:`ATTENTION_KEY`), together with the eager mask function under the same
key (without it, padding masks would be silently dropped). The adapter points a model's
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

from ..errors import CaptureError
from ..propagation.attention_core import softmax_attention
from ..propagation.recomputed_softmax import softmax_of_recomputed_scores
from ..propagation.rules import RuleSet, gate
from ..capture.trace import Block
from ..capture.recorder import Recorder, SiteObserver

ATTENTION_KEY = "captum_transformers"

_ACTIVE: contextvars.ContextVar[Optional[Tuple[Recorder, Dict[int, Block]]]] = contextvars.ContextVar(
    "captum_transformers_hf_recorder", default=None
)
_RULES: contextvars.ContextVar[Optional[RuleSet]] = contextvars.ContextVar("captum_transformers_hf_rules", default=None)
_REGISTERED = False

# Attributes under which models keep a cross-attention module whose class does not say so
# (BART family: encoder_attn; T5: EncDecAttention inside T5LayerCrossAttention; BERT: crossattention).
_CROSS_COMPONENTS = frozenset({"encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention",
                               "encoder_decoder_attention"})
# Eager-kernel arguments that change the attention and that the kernel below does not implement.
_UNSUPPORTED_KERNEL_ARGS = ("sinks", "s_aux")
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
    # The largest additive value over the queries: no (B, Q, K) temporary.
    return rows.amax(dim=1) > torch.finfo(rows.dtype).min / 2


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def captum_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                     dropout: float = 0.0, **kwargs: Any):
    """Explicit softmax attention that reports its probabilities to the active recorder.

    ``A = softmax(Q K^T * scaling + position_bias + mask)``, ``O = A V``, with grouped-query
    heads expanded, optional logit soft-capping, and the eager dropout. ``position_bias``
    is T5's (and its relatives') additive relative-position bias (T5 also passes
    ``scaling=1.0``). Returns ``(O transposed to (B, Q, H, D), A)`` as every transformers
    kernel does.
    """
    unsupported = [name for name in _UNSUPPORTED_KERNEL_ARGS if kwargs.get(name) is not None]
    if unsupported:
        raise CaptureError(
            f"{type(module).__name__} passes {unsupported} (attention sinks) to its attention kernel, which the "
            "captum_transformers kernel does not implement, so the captured attention would differ from the model's. "
            "This model is not supported by the HuggingFace adapter."
        )
    active = _ACTIVE.get()
    if active is not None:
        query = active[0].connect(query)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    key_states = _repeat_kv(key, groups)
    value_states = _repeat_kv(value, groups)
    softcap = kwargs.get("softcap")
    position_bias = kwargs.get("position_bias")

    mask = attention_mask[:, :, :, : key_states.shape[-2]] if attention_mask is not None else None

    def scores(query: torch.Tensor, key_states: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor:
        extras = iter(extras)
        scores = torch.matmul(query, key_states.transpose(-1, -2)) * scaling
        if position_bias is not None:
            scores = scores + next(extras)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~next(extras), torch.finfo(scores.dtype).min)
            else:
                scores = scores + next(extras)
        return scores

    extras = tuple(t for t in (position_bias, mask) if t is not None)
    rules = _RULES.get()
    # float32 at least (half-precision scores), float64 for float64 models: the model's own
    # precision, so float64 maps equal its eager attention's, not a float32 rounding of them.
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    if (rules is None or rules.attention_gate == "gradient") and (dropout == 0.0 or not module.training):
        # One Function for softmax(S) V that recomputes S and A in its backward pass: no
        # (B, H, Q, K) tensor is kept per layer (see attention_core).
        observer = SiteObserver() if active is not None else None
        output, probs = softmax_attention(scores, query, key_states, value_states, *extras,
                                          softmax_dtype=softmax_dtype, observer=observer)
    else:  # a constant gate or training-mode dropout between the map and the product
        observer = None
        if rules is not None and rules.softmax == "identity":
            # The identity rule needs the scores: recompute them in the backward pass.
            probs = softmax_of_recomputed_scores(scores, query, key_states, *extras, dim=-1, dtype=softmax_dtype)
        else:
            probs = torch.softmax(scores(query, key_states, *extras), dim=-1, dtype=softmax_dtype)
        probs = probs.to(query.dtype)
        dropped = nn.functional.dropout(gate(probs, rules), p=dropout, training=module.training)
        output = torch.matmul(dropped, value_states)
    if active is not None:
        recorder, blocks = active
        block = blocks.get(id(module)) or Block(type(module).__name__, module, block_kind(module))
        # The recorder keeps the first mask per key stream: later calls need not derive theirs.
        known = block.default_streams[1] in recorder.stream_valid
        recorder.record(block, probs, key_valid=None if known else _key_valid_from_mask(attention_mask),
                        causal=bool(getattr(module, "is_causal", False)) and block.kind == "self",
                        observer=observer)
    return output.transpose(1, 2).contiguous(), probs


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
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_KEY, captum_attention)
    # The shipped eager mask by name: the "eager" entry may have been replaced already.
    AttentionMaskInterface.register(ATTENTION_KEY, eager_mask)
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
    for registry, interface, functions in registries:
        ours = functions[ATTENTION_KEY]
        expected_ours = (ours is captum_attention if registry == "ALL_ATTENTION_FUNCTIONS"
                         else _shipped(ours) and getattr(ours, "__qualname__", "") == "eager_mask")
        if not expected_ours:
            raise CaptureError(
                f"{registry}[{ATTENTION_KEY!r}] is {_describe(ours)}, not captum_transformers' own entry: another "
                "library replaced it, so captured attention would be computed by that code. Undo it with "
                f"`del {registry}[{ATTENTION_KEY!r}]` (a per-instance override) or do not re-register the key."
            )
        for key in list(functions):
            function = functions[key]
            if key == ATTENTION_KEY or _shipped(function) or (registry, key, id(function)) in _WARNED_FOREIGN:
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
    token = _ACTIVE.set((recorder, blocks))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


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
