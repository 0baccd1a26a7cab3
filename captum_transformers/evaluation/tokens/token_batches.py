"""A batch of token relevance as the token metrics read it: ids, mask and relevance checked, and
which tokens a metric may change.

A token is *changeable* when its attention mask is 1 and it is not in ``special_tokens_mask``
([CLS], [SEP] and padding are never removed, replaced or revealed). ``extra_inputs`` (e.g.
``token_type_ids``) pass through to the model and must not repeat ``input_ids`` or
``attention_mask``. Shared by :mod:`token_flipping`, :mod:`aopc` and :mod:`relevance_gain_tokens`.

>>> batch = token_batch(torch.tensor([[101, 7, 102]]), torch.ones(1, 3), torch.zeros(1, 3), torch.tensor([0]),
...                     torch.tensor([[1, 0, 1]]))
>>> batch.changeable.tolist()
[[False, True, False]]
"""
from __future__ import annotations

from typing import Dict, Mapping, NamedTuple, Optional

import torch

from ...errors import InputError
from ..validation import require_finite, require_labels, require_same_shape, require_tensor


class TokenBatch(NamedTuple):
    """The checked batch: ids, mask, relevance (B, S) (detached), labels (B,) long, changeable (B, S) bool, extra."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    relevance: torch.Tensor
    labels: torch.Tensor
    changeable: torch.Tensor
    extra: Dict[str, torch.Tensor]


def token_batch(input_ids, attention_mask, relevance, labels, special_tokens_mask=None,
                extra_inputs: Optional[Mapping[str, torch.Tensor]] = None,
                require_changeable: bool = False) -> TokenBatch:
    """Check a token batch and find its changeable tokens (see the module docstring).

    ``require_changeable=True`` refuses examples without any changeable token: a metric that
    removes a share of them would count such an example as unchanged at every step.
    """
    input_ids = require_tensor("input_ids", input_ids, ndim=(2,))
    attention_mask = require_tensor("attention_mask", attention_mask, ndim=(2,))
    relevance = require_tensor("relevance", relevance, ndim=(2,)).detach()
    require_same_shape(("input_ids", "attention_mask", "relevance"), (input_ids, attention_mask, relevance))
    require_finite("relevance", relevance)
    labels = require_labels(labels, input_ids.shape[0])
    changeable = attention_mask.bool()
    if special_tokens_mask is not None:
        special = require_tensor("special_tokens_mask", special_tokens_mask, ndim=(2,))
        require_same_shape(("input_ids", "special_tokens_mask"), (input_ids, special))
        changeable = changeable & ~special.bool().to(changeable.device)
    extra = dict(extra_inputs or {})
    for key in ("input_ids", "attention_mask"):
        if key in extra:
            raise InputError(f"extra_inputs must not contain {key!r}; pass it as the argument of that name.")
    if require_changeable:
        empty = (~changeable.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise InputError(f"Examples {empty[:5]} of the batch have no changeable token (attention mask 1 and not "
                             "special): there is nothing to remove. Leave them out of the evaluation.")
    return TokenBatch(input_ids, attention_mask, relevance, labels, changeable, extra)
