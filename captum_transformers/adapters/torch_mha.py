"""Models built from ``torch.nn.MultiheadAttention`` (and the ``nn.Transformer*`` layers).

Mechanism. Inside :meth:`TorchMHAAdapter.capture`:

1. :func:`~captum_transformers.model_state.patching.mha_fastpath_disabled` keeps PyTorch's fused
   paths off in the explaining thread, per instance: ``TransformerEncoder`` (its nested-tensor
   conversion included) and ``TransformerEncoderLayer`` through flags only their fast paths
   read, ``MultiheadAttention`` through a torch-function mode around its forward. Every call
   goes through ``MultiheadAttention.forward`` and ``F.multi_head_attention_forward``; other
   threads, and the process-wide ``torch.backends.mha`` flag, are untouched.
2. :func:`~captum_transformers.model_state.patching.instance_forward` wraps each attention instance's
   ``forward``: the query is tapped through :meth:`Recorder.connect` (so gradients reach the
   attention even when every parameter is frozen), the original forward runs with
   ``need_weights=True, average_attn_weights=False``, and the per-head weights are
   recorded. What the caller gets back is what it asked for: ``(output, None)`` for
   ``need_weights=False``, the head mean for ``average_attn_weights=True``.

The per-head weights PyTorch returns are a *view* of the softmax output (shape
``(B*H, L, S)``); only that base tensor feeds the rest of the forward pass, so it is the
one whose gradient is hooked, and its gradient is reshaped to ``(B, H, L, S)``.
The output is the same attention computed without ``scaled_dot_product_attention``:
equal up to floating-point rounding, not bit for bit.

Example::

    >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, batch_first=True), 2)
    >>> model = MyClassifier(embedding, encoder, head).eval()      # any nn.Module around it
    >>> scores = GenericAttention(model).attribute(input_ids, target=label,
    ...                                            additional_forward_args=(padding_mask,))
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..model_state import patching
from ..errors import CaptureError
from ..propagation.rules.operations import active_rules, needs_operation_rules, operation_rules
from ..propagation.attention.core import softmax_attention
from ..propagation.attention.recomputed_softmax import softmax_of_recomputed_scores
from ..propagation.rules.rule_set import RuleSet, norm_rules
from ..capture.trace import Block
from .base import Adapter
from .query_rows import QueryRows, checked_query_rows, chosen_rows
from ..capture.recorder import Recorder, SiteObserver

# True while per-operation rules are active: attention is then recomputed explicitly.
_OBSERVER_ATTRIBUTE = "_captum_transformers_observer"
_EXPLICIT: contextvars.ContextVar[bool] = contextvars.ContextVar("captum_transformers_mha_explicit", default=False)

# Parameters of MultiheadAttention.forward the wrapper reads or overrides, by name.
_REQUIRED_PARAMETERS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                        "average_attn_weights", "is_causal")


def _blocked(mask: torch.Tensor) -> torch.Tensor:
    """Where a boolean (True = blocked) or additive float mask forbids attention."""
    if mask.dtype == torch.bool:
        return mask
    # Same rule as the HF adapter: -inf or the dtype's lowest value (or near it) blocks.
    return mask <= torch.finfo(mask.dtype).min / 2


def _is_causal_mask(mask: Optional[torch.Tensor], num_queries: int, num_keys: int) -> bool:
    """Whether a 2D attention mask blocks exactly the strict upper triangle."""
    if mask is None or num_queries != num_keys or tuple(mask.shape) != (num_queries, num_keys):
        return False
    upper = torch.ones(num_queries, num_keys, dtype=torch.bool, device=mask.device).triu(1)
    return bool(torch.equal(_blocked(mask), upper))


def _causal_mask(num_queries: int, num_keys: int, like: Optional[torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """An explicit causal mask in the same kind (bool or float) as ``like``.

    Matching the key-padding mask's kind keeps PyTorch from warning about mixed mask types.
    """
    upper = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).triu(1)
    if like is None or like.dtype == torch.bool:
        return upper
    return torch.zeros(num_queries, num_keys, dtype=dtype, device=device).masked_fill(upper, float("-inf"))


def _key_valid(key_padding_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(B, S) True at real tokens, from MultiheadAttention's key_padding_mask (True = pad)."""
    if key_padding_mask is None:
        return None
    valid = ~_blocked(key_padding_mask)
    return valid.unsqueeze(0) if valid.dim() == 1 else valid


def _decoder_cross_attention(model: nn.Module) -> set:
    """ids of the cross-attention modules of nn.TransformerDecoderLayer's."""
    return {id(m.multihead_attn) for m in model.modules() if isinstance(m, nn.TransformerDecoderLayer)}


class TorchMHAAdapter(Adapter):
    """Adapter for user models built from ``torch.nn.MultiheadAttention``.

    Covers ``nn.MultiheadAttention`` used directly, ``nn.TransformerEncoderLayer`` and
    ``nn.TransformerEncoder`` (fast path and nested tensors included: they are turned off
    in the explaining thread while capturing), with ``batch_first`` True or False, key
    padding masks (padding keys get zero attribution), attention masks and causal masks
    (``is_causal=True`` or a mask that blocks the upper triangle).

    Inputs are token ids (B, S) or embeddings (B, S, D); attributions come back in the
    same shape. Call ``model.eval()`` first: in training mode the recorded weights are
    those after attention dropout.

    Args:
        query_rows: which token(s) explain the output. ``None`` (default): the first token,
            or the last real token when the attention is causal; ``"last"``: the last real
            token; ``"mean"``: all real tokens, equally weighted (for mean-pooling classifiers); an int:
            that position (negative counts from the end of the sequence).

    Example::

        >>> from captum_transformers import AttentionRollout
        >>> from captum_transformers.adapters.torch_mha import TorchMHAAdapter
        >>> rollout = AttentionRollout(model, adapter=TorchMHAAdapter(query_rows="mean"))
        >>> scores = rollout.attribute(embeddings, return_tokens=True)   # (B, S)
    """

    name = "torch_mha"
    families = "models built from torch.nn.MultiheadAttention / nn.TransformerEncoder(Layer)"

    def __init__(self, query_rows: QueryRows = None) -> None:
        self.query_rows_choice = checked_query_rows(query_rows)

    # -- sites ----------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> List[Block]:
        cross = _decoder_cross_attention(model)
        return [
            Block(name, module, "cross" if id(module) in cross else "self")
            for name, module in model.named_modules()
            if isinstance(module, nn.MultiheadAttention)
        ]

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        blocks = self.blocks(model)
        with contextlib.ExitStack() as stack:
            stack.enter_context(patching.mha_fastpath_disabled(model))
            for block in blocks:
                stack.enter_context(patching.instance_forward(
                    block.module, lambda original, block=block: recording_forward(original, block, recorder)
                ))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        """AH gate: zero gradient into the softmax of torch's own attention path. Per-operation
        rules: ``F.multi_head_attention_forward`` hides its inner operations from interception,
        so each attention call is recomputed explicitly from the module's weights (the same
        values up to float rounding) where the rules can see every linear, product and softmax."""
        explicit = needs_operation_rules(rules)
        token = _EXPLICIT.set(True) if explicit else None
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(patching.mha_fastpath_disabled(model))
                if rules.attention_gate != "gradient" or explicit:
                    for block in self.blocks(model):
                        stack.enter_context(patching.instance_forward(
                            block.module,
                            lambda original, block=block: recording_forward(original, block, None, rules)))
                stack.enter_context(norm_rules(model, rules))
                stack.enter_context(operation_rules(model, rules))
                yield
        finally:
            if token is not None:
                _EXPLICIT.reset(token)

    # -- layout ---------------------------------------------------------------------
    def query_rows(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder,
                   num_tokens: int, num_prefix: int, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        if self.query_rows_choice is None:
            return super().query_rows(model, inputs, recorder, num_tokens, num_prefix, token_mask)
        return chosen_rows(self.query_rows_choice, num_tokens, token_mask, recorder.sites[0].batch_size, inputs[0].device)


def recording_forward(original: Callable, block: Block, recorder: Optional[Recorder],
                       rules: Optional[RuleSet] = None) -> Callable:
    """A ``forward`` for one MultiheadAttention instance that reports to ``recorder`` (if
    given) and, under ``rules`` with a constant attention gate, treats the softmax output as a
    constant (the explicit weight-returning path is used, so the softmax is observable)."""
    signature = inspect.signature(original)
    missing = [p for p in _REQUIRED_PARAMETERS if p not in signature.parameters]
    if missing:
        raise CaptureError(
            f"{block.name!r} ({type(block.module).__name__}) has a forward without the parameters {missing} of "
            "nn.MultiheadAttention.forward, so the torch_mha adapter cannot request its weights. Register a "
            "custom adapter for it."
        )
    module = block.module

    # functools.wraps exposes the original signature (via __wrapped__), so a second wrapper
    # (propagation inside a capture, as ConservativeLRP nests them) can bind arguments too.
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments: Dict[str, Any] = bound.arguments
        query, key, value = arguments["query"], arguments["key"], arguments["value"]
        want_weights, want_average = arguments["need_weights"], arguments["average_attn_weights"]
        batched = query.dim() == 3
        seq_dim = 1 if (batched and module.batch_first) else 0
        num_queries, num_keys = query.shape[seq_dim], key.shape[seq_dim]

        # Tap the query; keep `key is query` / `value is key` so PyTorch takes the same
        # packed self-attention projection it would have taken.
        tapped = recorder.connect(query) if recorder is not None else query
        arguments["query"] = tapped
        if key is query:
            arguments["key"] = tapped
            if value is query:
                arguments["value"] = tapped

        attn_mask, is_causal = arguments["attn_mask"], bool(arguments["is_causal"])
        if is_causal and attn_mask is None:
            # F.multi_head_attention_forward cannot return weights from the is_causal hint
            # alone (PyTorch 2.x even refuses the hint without a mask when no weights are
            # asked for); the hint means exactly this mask.
            arguments["attn_mask"] = _causal_mask(num_queries, num_keys, arguments["key_padding_mask"],
                                                  query.dtype, query.device)
        arguments["need_weights"] = True
        arguments["average_attn_weights"] = False
        if _EXPLICIT.get() and not getattr(original, "_captum_mha_wrapper", False):
            # Only the innermost wrapper recomputes; outer ones (capture + propagation) pass through.
            output, weights, observer = _explicit_attention(module, arguments)
        else:
            output, weights = original(*bound.args, **bound.kwargs)
            # An inner wrapper's explicit Function reports the map's gradient through this.
            observer = getattr(weights, _OBSERVER_ATTRIBUTE, None)
        if rules is not None and rules.attention_gate == "constant":
            _constant_gate(weights)

        kind = block.kind
        if kind == "self" and key is not query and num_keys != num_queries:
            kind = "cross"
        site = block if kind == block.kind else Block(block.name, block.module, kind)
        causal = kind == "self" and (is_causal or _is_causal_mask(attn_mask, num_queries, num_keys))
        if recorder is not None:
            _record(recorder, site, weights, batched, num_keys, arguments["key_padding_mask"], causal, observer)

        if not want_weights:
            return output, None
        if want_average:
            return output, weights.mean(dim=1 if batched else 0)
        if observer is not None:  # an outer wrapper (the other of capture and propagation) may record it
            setattr(weights, _OBSERVER_ATTRIBUTE, observer)
        return output, weights

    forward._captum_mha_wrapper = True
    return forward


def _constant_gate(weights: torch.Tensor) -> None:
    """The AH-rule for ``F.multi_head_attention_forward``: no gradient enters the softmax.

    A TorchFunctionMode cannot see that softmax (``multi_head_attention_forward`` is itself
    a torch-function override, and a mode is switched off while it handles one), so the
    gradient reaching the softmax output, of which ``weights`` is a view, is replaced by
    zeros. ``A V`` still passes its gradient to ``V``; the query/key path gets none, exactly as
    with ``probs.detach()``, and the forward values are untouched.
    """
    base = weights._base
    probs = base if base is not None and base.numel() == weights.numel() else weights
    if probs.requires_grad:
        probs.register_hook(torch.zeros_like)


def _record(recorder: Recorder, block: Block, weights: torch.Tensor, batched: bool, num_keys: int,
            key_padding_mask: Optional[torch.Tensor], causal: bool, observer: Optional[SiteObserver] = None) -> None:
    probs = weights if batched else weights.unsqueeze(0)
    key_valid = _key_valid(key_padding_mask) if block.kind == "self" else None
    if observer is not None:  # the explicit Function reports the map's gradient itself (all keys are real)
        recorder.record(block, probs, key_valid=key_valid, causal=causal, observer=observer)
        return
    shape = tuple(probs.shape)
    # The returned weights are a view that nothing downstream uses; the softmax (or
    # dropout) output it views is what the attention output was computed from.
    base = weights._base
    grad_tensor = base if base is not None and base.numel() == weights.numel() else weights
    # bias_k / add_zero_attn append keys that are no input token: keep the real ones.
    probs = probs[..., :num_keys]
    recorder.record(block, probs, grad_tensor=grad_tensor,
                    grad_view=lambda grad: grad.reshape(shape)[..., :num_keys], key_valid=key_valid, causal=causal)


def _additive(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """A boolean (True = blocked) or additive mask as an additive float mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _explicit_attention(module: nn.MultiheadAttention, arguments: Dict[str, Any]):
    """``nn.MultiheadAttention`` written out with ``F.linear``, ``@`` and ``softmax``.

    Returns ``(output, weights, observer)``: the first two like ``forward(..., need_weights=True,
    average_attn_weights=False)``, the weights being the (B, H, L, S) softmax output itself;
    ``observer`` (None unless the attention gate carries the gradient) is what the fused
    attention reports the map's gradient through.
    """
    if module.bias_k is not None or module.add_zero_attn or (module.training and module.dropout > 0):
        raise CaptureError(
            "Per-operation LRP rules recompute nn.MultiheadAttention explicitly, which does not cover bias_k/"
            "bias_v, add_zero_attn or attention dropout in training mode. Call model.eval() or use "
            "ConservativeLRP (RuleSet.AH / AH_LN), which needs no recomputation."
        )
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    batched = query.dim() == 3
    same_qkv = key is query and value is query
    same_kv = key is value
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    elif module.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    # (L, B, E) from here on, as in F.multi_head_attention_forward.
    length, batch, embed = query.shape
    heads, head_dim = module.num_heads, module.head_dim
    bias = module.in_proj_bias
    b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.chunk(3)
        if same_qkv:
            q, k, v = torch.nn.functional.linear(query, module.in_proj_weight, bias).chunk(3, dim=-1)
        elif same_kv:
            q = torch.nn.functional.linear(query, w_q, b_q)
            w_kv = module.in_proj_weight[embed:]
            b_kv = bias[embed:] if bias is not None else None
            k, v = torch.nn.functional.linear(key, w_kv, b_kv).chunk(2, dim=-1)
        else:
            q, k, v = (torch.nn.functional.linear(x, w, b) for x, w, b in ((query, w_q, b_q), (key, w_k, b_k),
                                                                           (value, w_v, b_v)))
    else:
        q = torch.nn.functional.linear(query, module.q_proj_weight, b_q)
        k = torch.nn.functional.linear(key, module.k_proj_weight, b_k)
        v = torch.nn.functional.linear(value, module.v_proj_weight, b_v)
    source = k.shape[0]

    def split(x, steps):  # (steps, B, E) -> (B, H, steps, head_dim)
        return x.reshape(steps, batch, heads, head_dim).permute(1, 2, 0, 3)

    q, k, v = split(q, length), split(k, source), split(v, source)

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = (q * (1.0 / float(head_dim)) ** 0.5) @ k.transpose(-1, -2)
        attn_mask = _additive(arguments["attn_mask"], scores.dtype)
        if attn_mask is not None:
            scores = scores + (attn_mask.reshape(batch, heads, length, source) if attn_mask.dim() == 3 else attn_mask)
        padding = _additive(arguments["key_padding_mask"], scores.dtype)
        if padding is not None:
            scores = scores + padding.reshape(batch, 1, 1, source)
        return scores

    rules = active_rules()
    observer = None
    if rules is not None and rules.attention_gate == "gradient":
        # One Function for softmax(S) V keeping only q, k, v; the map reaches the recorder
        # through the observer (see attention_core).
        observer = SiteObserver()
        heads_out, weights = softmax_attention(scores, q, k, v, observer=observer)
    else:
        if rules is not None and rules.softmax == "identity":
            # The softmax identity rule needs the scores: recompute them from q and k (kept
            # anyway) in the backward pass rather than keep a (B, H, L, S) tensor per layer.
            weights = softmax_of_recomputed_scores(scores, q, k, dim=-1)
        else:
            weights = torch.softmax(scores(q, k), dim=-1)
        heads_out = weights @ v
    attended = heads_out.permute(2, 0, 1, 3).reshape(length, batch, embed)
    output = torch.nn.functional.linear(attended, module.out_proj.weight, module.out_proj.bias)
    if not batched:
        return output.squeeze(1), weights.squeeze(0), observer
    if module.batch_first:
        output = output.transpose(0, 1)
    return output, weights, observer
