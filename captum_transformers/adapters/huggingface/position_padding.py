"""Left-padded batches of models with learned absolute positions: the warning and its check.

A model that looks its positions up in a learned table (GPT-2's ``wpe``, BERT's
``position_embeddings``) numbers a left-padded row's tokens from the padding, so its maps
differ from the same text explained alone. :func:`learned_position_table` finds such a table
(read-only: a walk of the modules); :func:`warn_left_padding_without_positions` warns when a
batch is left-padded and no ``position_ids`` were passed. Held apart from
:mod:`.huggingface` (which calls it from ``call_model``) as one concern of the inputs, not
of the model's attention.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ...model_state import module_walk

# Learned absolute position tables looked up by position index (GPT-2's ``wpe``, BERT's and
# DistilBERT's ``position_embeddings``). Not: rotary models (no table), OPT (its
# OPTLearnedPositionalEmbedding subclass counts positions from the attention mask) and
# RoBERTa-style tables (``padding_idx`` set: positions counted from the non-pad input ids).
_LEARNED_POSITION_NAMES = ("wpe", "position_embeddings")


def learned_position_table(model: nn.Module) -> Optional[str]:
    """The dotted path of a plain ``nn.Embedding`` of absolute positions, or None."""
    for name, module in module_walk.named_modules(model):
        if type(module) is nn.Embedding and name.rsplit(".", 1)[-1] in _LEARNED_POSITION_NAMES \
                and module.padding_idx is None:
            return name
    return None


def warn_left_padding_without_positions(model: nn.Module, forward_kwargs: Optional[Mapping[str, Any]],
                                        table: Optional[str]) -> None:
    """A ``UserWarning`` when a model with learned absolute positions (``table``) gets a
    left-padded batch (a row of ``attention_mask`` starting with 0) and no ``position_ids``.

    Such a model numbers a row's tokens from the first (padding) position, so a left-padded
    text sits at other positions than the same text alone: its logits, and every map, differ
    from single calls (measured 0.118 on GPT-2). The fix is the caller's: positions counted
    from the first real token, or padding on the right."""
    if table is None or not forward_kwargs or forward_kwargs.get("position_ids") is not None:
        return
    mask = forward_kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] == 0:
        return
    left = (mask[:, 0] == 0).nonzero().flatten().tolist()
    if not left:
        return
    warnings.warn(
        f"{type(model).__name__} adds learned absolute position embeddings ({table}) and rows {left[:8]} of "
        "attention_mask start with 0 (left padding), but no position_ids were passed: those rows' tokens are "
        "numbered from the padding, so their logits and maps differ from the same text explained alone. Fix: pass "
        "forward_kwargs={'attention_mask': mask, 'position_ids': (mask.long().cumsum(-1) - 1).clamp(min=0)}, or pad "
        "on the right (tokenizer.padding_side = 'right').", UserWarning, stacklevel=2)
