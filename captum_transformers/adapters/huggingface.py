"""HuggingFace transformers models, through the attention-function registry.

transformers >= 5 dispatches attention through ``ALL_ATTENTION_FUNCTIONS`` keyed by
``config._attn_implementation``. We register one kernel (an explicit softmax attention,
numerically the library's eager path) under a private key, together with the eager mask
function under the same key (without it, padding masks would be silently dropped), and
point the model's configs at that key only inside :meth:`HuggingFaceAdapter.capture`.
Outside a capture the kernel is inert: with no active recorder it just computes attention.
eager, sdpa and flash models all become the same explicit computation while captured.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from .. import patching
from ..errors import CaptureError, InputError
from ..operation_rules import operation_rules
from ..recomputed_softmax import softmax_of_recomputed_scores
from ..rules import RuleSet, gate, norm_rules
from ..trace import Block
from .base import Adapter
from .recorder import Recorder

ATTENTION_KEY = "captum_transformers"

_ACTIVE: contextvars.ContextVar[Optional[Tuple[Recorder, Dict[int, Block]]]] = contextvars.ContextVar(
    "captum_transformers_hf_recorder", default=None
)
_RULES: contextvars.ContextVar[Optional[RuleSet]] = contextvars.ContextVar("captum_transformers_hf_rules", default=None)
_REGISTERED = False

# Per-architecture quirks are rows of data. prefix: tokens before the patch grid;
# rows: classifier token positions; "eos": CLIP text pools at the end-of-text token.
_MODEL_TYPE_QUIRKS: Dict[str, Dict[str, Any]] = {
    "vit": {"prefix": 1},
    "deit": {"prefix": 2},
    "clip_vision_model": {"prefix": 1},
    "clip_text_model": {"rows": "eos"},
}
# Heads that read more than one token: their rows are averaged.
_CLASS_ROWS: Dict[str, Tuple[int, ...]] = {
    "DeiTForImageClassificationWithTeacher": (0, 1),
}
_OUTPUT_FIELDS = ("logits", "logits_per_image", "image_embeds", "text_embeds", "pooler_output")


def _key_valid_from_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Non-padding keys (B, K) from a 4D additive or boolean mask, read at the last query row."""
    if mask is None or mask.dim() != 4:
        return None
    row = mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def captum_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                     dropout: float = 0.0, **kwargs: Any):
    """Explicit softmax attention that reports its probabilities to the active recorder.

    ``A = softmax(Q K^T * scaling + mask)``, ``O = A V``, with grouped-query heads
    expanded, optional logit soft-capping, and the eager dropout. Returns
    ``(O transposed to (B, Q, H, D), A)`` as every transformers kernel does.
    """
    active = _ACTIVE.get()
    if active is not None:
        query = active[0].connect(query)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    key_states = _repeat_kv(key, groups)
    value_states = _repeat_kv(value, groups)
    softcap = kwargs.get("softcap")

    def scores(query: torch.Tensor, key_states: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(query, key_states.transpose(-1, -2)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            mask = attention_mask[:, :, :, : key_states.shape[-2]]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        return scores

    rules = _RULES.get()
    if rules is not None and rules.softmax == "identity":
        # The identity rule on the softmax needs its input, the scores: recompute them from
        # Q and K (kept anyway) in the backward pass instead of keeping a (B, H, Q, K) tensor.
        probs = softmax_of_recomputed_scores(scores, query, key_states, dim=-1, dtype=torch.float32)
    else:
        probs = torch.softmax(scores(query, key_states), dim=-1, dtype=torch.float32)
    probs = probs.to(query.dtype)
    if active is not None:
        recorder, blocks = active
        block = blocks.get(id(module)) or Block(type(module).__name__, module, _kind(module))
        recorder.record(block, probs, key_valid=_key_valid_from_mask(attention_mask),
                        causal=bool(getattr(module, "is_causal", False)) and block.kind == "self")
    dropped = nn.functional.dropout(gate(probs, _RULES.get()), p=dropout, training=module.training)
    output = torch.matmul(dropped, value_states).transpose(1, 2).contiguous()
    return output, probs


def _kind(module: nn.Module) -> str:
    cross = getattr(module, "is_cross_attention", False) or "Cross" in type(module).__name__
    return "cross" if cross else "self"


def _register_kernel() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_KEY, captum_attention)
    AttentionMaskInterface.register(ATTENTION_KEY, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    _REGISTERED = True


def _pretrained(model: nn.Module) -> nn.Module:
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise CaptureError(f"{type(model).__name__} contains no transformers PreTrainedModel.")


def _is_attention_module(module: nn.Module) -> bool:
    name = type(module).__name__
    return "Attention" in name and not any("Attention" in type(c).__name__ for c in module.children())


class HuggingFaceAdapter(Adapter):
    """Adapter for transformers >= 5 models that dispatch through ``AttentionInterface``.

    Tested: BERT, DistilBERT, RoBERTa, ViT, DeiT (plain and distilled), CLIP vision and
    text towers, GPT-2 and Llama-style decoders (causal masks, grouped-query attention),
    with padding masks. Models with inline attention (LXMERT, VisualBERT) are not
    intercepted here and raise :class:`CaptureError`.
    """

    name = "huggingface"
    families = "transformers models using AttentionInterface (BERT, DistilBERT, RoBERTa, ViT, DeiT, CLIP towers, GPT-2, Llama-style)"

    def blocks(self, model: nn.Module) -> List[Block]:
        return [Block(name, m, _kind(m)) for name, m in model.named_modules() if _is_attention_module(m)]

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        _register_kernel()
        blocks = {id(b.module): b for b in self.blocks(model)}
        token = _ACTIVE.set((recorder, blocks))
        try:
            with patching.hf_attention_implementation(model, ATTENTION_KEY):
                yield
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        _register_kernel()
        token = _RULES.set(rules)
        try:
            with patching.hf_attention_implementation(model, ATTENTION_KEY), norm_rules(model, rules), \
                    operation_rules(model, rules):
                yield
        finally:
            _RULES.reset(token)

    def _quirks(self, model: nn.Module) -> Dict[str, Any]:
        return _MODEL_TYPE_QUIRKS.get(getattr(_pretrained(model).config, "model_type", ""), {})

    def num_prefix_tokens(self, model: nn.Module) -> Optional[int]:
        return self._quirks(model).get("prefix")

    def patch_size(self, model: nn.Module):
        config = _pretrained(model).config
        size = getattr(config, "patch_size", None)
        if isinstance(size, int):
            return (size, size)
        return super().patch_size(model)

    def query_rows(self, model, inputs, recorder, num_tokens, num_prefix, token_mask):
        batch = recorder.sites[0].batch_size
        device = inputs[0].device
        for module in model.modules():
            rows = _CLASS_ROWS.get(type(module).__name__)
            if rows is not None:
                return torch.tensor(rows, device=device).expand(batch, -1)
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
        eos = _pretrained(model).config.eos_token_id
        ids = input_ids.to(torch.int)
        position = ids.argmax(dim=-1) if eos == 2 else (ids == eos).int().argmax(dim=-1)
        return position.to(torch.long).unsqueeze(1)

    def logits(self, model, output, layout, causal):
        if not isinstance(output, (torch.Tensor, tuple, list)):
            for field in _OUTPUT_FIELDS:
                value = getattr(output, field, None)
                if isinstance(value, torch.Tensor):
                    output = value
                    break
            else:
                raise InputError(
                    f"{type(output).__name__} has none of the fields {_OUTPUT_FIELDS}; wrap the model so that its "
                    "forward returns the score tensor to explain."
                )
        return super().logits(model, output, layout, causal)
