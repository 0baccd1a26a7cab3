r"""Comprehensiveness and sufficiency as AOPC (DeYoung et al., ACL 2020, "ERASER", Sec. 4.2).

For an example ``x`` with predicted (or given) class ``y``, ``p(y | .)`` the classifier's
softmax probability and ``r_b`` the ``k_b`` most relevant changeable tokens of bin ``b``::

    comprehensiveness_b = p(y | x) - p(y | x \ r_b)        (the rationale erased: higher is better)
    sufficiency_b       = p(y | x) - p(y | r_b)            (only the rationale kept: lower is better)
    AOPC = mean over the bins b of the per-bin value (then over examples)

with the ERASER bins ``f_b`` in {1, 5, 10, 20, 50} % of the tokens and ``k_b = ceil(f_b * n)``
for ``n`` changeable tokens (every bin removes or keeps at least one token; the ceil is the
one of :func:`~.token_flipping.flip_counts`). Tokens are ranked by signed relevance, ties by
earlier position.

**Removal.** ``removal="drop"`` (default) deletes the tokens from the sequence, as ERASER's
``x \ r`` (the text without the rationale) and ferret (``remove_tokens=True``, its default):
the kept tokens are left-packed in their order, the later ones move to earlier positions.
``removal="replace"`` writes ``replacement_id`` (e.g. ``[MASK]``) in their place instead
(ferret's ``remove_tokens=False``) and keeps the positions.

**Labels.** ``y`` is the class passed as ``labels``: ERASER uses the model's
prediction on the full input (``logits.argmax(-1)``); another class measures how the
rationale supports that class instead.

**Never removed**: padding (attention mask 0) and the tokens of ``special_tokens_mask``
([CLS], [SEP]): the changeable tokens are those with mask 1 and not special, as in
:class:`~.token_flipping.TokenActivation`. ferret likewise strips [CLS]/[SEP] before ranking and
the tokenizer puts them back (``remove_first_last=True``).

Example::

    metric = Comprehensiveness(lambda batch: model(**batch).logits)
    metric.update(input_ids, attention_mask, relevance, labels, special_tokens_mask)
    metric.compute().aopc
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..results import ResultRecord
from .token_compaction import compact_tokens
from .token_flipping import flip_counts, ranks
from .token_batches import token_batch
from ..validation import require_choice, require_fractions

ERASER_FRACTIONS = (0.01, 0.05, 0.10, 0.20, 0.50)
"""The AOPC bins of ERASER: the top 1, 5, 10, 20 and 50 % of the tokens."""

REMOVALS = ("drop", "replace")


@dataclass(frozen=True)
class AOPCResult(ResultRecord):
    """Comprehensiveness or sufficiency: the mean probability drop per bin and their mean (AOPC).

    ``per_bin[b]`` is the mean over examples of ``p(y|x) - p(y|x_b)`` at ``fractions[b]``;
    ``aopc`` the mean of ``per_bin``; ``full_probability`` the mean of ``p(y|x)``.
    """

    name: str
    fractions: Tuple[float, ...]
    per_bin: Tuple[float, ...]
    aopc: float
    full_probability: float
    count: int
    removal: str = "drop"
    higher_is_better: bool = True


class _AOPC(Accumulator):
    """Shared: rank the changeable tokens, build every bin's input, one stacked forward per batch."""

    _keeps_rationale = False  # sufficiency keeps only the rationale; comprehensiveness erases it
    _name = ""

    def __init__(self, forward: Forward, removal: str = "drop", replacement_id: Optional[int] = None,
                 fractions: Sequence[float] = ERASER_FRACTIONS, max_batch_size: Optional[int] = None) -> None:
        super().__init__()
        require_choice("removal", removal, REMOVALS)
        if removal == "replace" and (isinstance(replacement_id, bool) or not isinstance(replacement_id, int)):
            raise InputError(f"removal='replace' needs replacement_id, an int token id (e.g. tokenizer.mask_token_id); "
                             f"got {replacement_id!r}.")
        if removal == "drop" and replacement_id is not None:
            raise InputError("replacement_id is only used with removal='replace'; removal='drop' deletes the tokens. "
                             "Pass one or the other.")
        fractions = require_fractions(fractions, 0.0, 1.0)
        if fractions[0] == 0.0:
            raise InputError(f"fractions={fractions} must be above 0: p(y|x) itself is the reference of every bin.")
        self.forward, self.removal, self.replacement_id = forward, removal, replacement_id
        self.fractions = fractions
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self._add_state("sums", (len(fractions),), exact=True)
        self._add_state("full_sum", exact=True)
        self._add_state("count")

    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, relevance: torch.Tensor,
               labels: torch.Tensor, special_tokens_mask: Optional[torch.Tensor] = None,
               extra_inputs: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Add a batch: ids, mask, relevance (B, S), labels (B,); per-token extra inputs (B, S) pass through."""
        checked = token_batch(input_ids, attention_mask, relevance, labels, special_tokens_mask, extra_inputs,
                              require_changeable=True)
        input_ids, attention_mask, relevance, labels, changeable, _ = checked
        extra = self._extra(checked.extra, input_ids)
        order = ranks(torch.where(changeable, relevance, torch.full_like(relevance, -math.inf)), descending=True)
        counts = flip_counts(self.fractions, changeable).to(order.device)
        in_rationale = [changeable & (order < counts[b][:, None]) for b in range(len(self.fractions))]
        removed = [torch.zeros_like(changeable)] + [
            changeable & ~r if self._keeps_rationale else r for r in in_rationale]
        batch = input_ids.shape[0]
        logits = logits_per_step(self.forward, lambda steps: self._inputs(input_ids, attention_mask, extra,
                                                                          [removed[s] for s in steps]),
                                 len(removed), batch, self.max_batch_size, labels=labels).to(torch.float64)
        probability = torch.softmax(logits, dim=-1).gather(
            2, labels.to(logits.device)[None, :, None].expand(len(removed), -1, 1)).squeeze(2)
        self._add("sums", exact_sum(probability[:1] - probability[1:], dim=1))
        self._add("full_sum", exact_sum(probability[0]))
        self._add("count", torch.tensor(batch))

    @staticmethod
    def _extra(extra_inputs, input_ids) -> Dict[str, torch.Tensor]:
        extra = dict(extra_inputs or {})
        for key, value in extra.items():  # token_batch refused input_ids / attention_mask already
            if not isinstance(value, torch.Tensor) or tuple(value.shape[:2]) != tuple(input_ids.shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise InputError(f"extra_inputs[{key!r}] has shape {shape}; expected a per-token tensor (B, S, ...) "
                                 f"matching input_ids {tuple(input_ids.shape)} (e.g. token_type_ids), since removed "
                                 "tokens are removed from it too.")
        return extra

    def _inputs(self, input_ids, attention_mask, extra, removed) -> Dict[str, torch.Tensor]:
        """The model input of the listed bins' removals, stacked bin-major."""
        repeat = lambda t: t.repeat(len(removed), *([1] * (t.dim() - 1)))  # noqa: E731 - bin-major copies
        gone = torch.cat(removed)
        ids, mask = repeat(input_ids), repeat(attention_mask)
        if self.removal == "replace":
            ids = torch.where(gone, torch.full_like(ids, self.replacement_id), ids)
            return {"input_ids": ids, "attention_mask": mask, **{k: repeat(v) for k, v in extra.items()}}
        keep = mask.bool() & ~gone
        if not bool(keep.any(dim=1).all()):
            raise InputError("removal='drop' would leave an example with no token at all (every token removed and no "
                             "special token kept); pass special_tokens_mask for [CLS]/[SEP], fractions below 1, or "
                             "removal='replace'.")
        packed, packed_mask = compact_tokens(ids, keep)
        others = {k: compact_tokens(repeat(v), keep)[0] for k, v in extra.items()}
        return {"input_ids": packed, "attention_mask": packed_mask.to(attention_mask.dtype), **others}

    def compute(self) -> AOPCResult:
        count = int(self._state["count"].item())
        per_bin = tuple((self._value("sums") / count).tolist()) if count else (math.nan,) * len(self.fractions)
        full = float(self._value("full_sum")) / count if count else math.nan
        return AOPCResult(name=self._name, fractions=self.fractions, per_bin=per_bin,
                          aopc=sum(per_bin) / len(per_bin), full_probability=full, count=count, removal=self.removal,
                          higher_is_better=not self._keeps_rationale)


class Comprehensiveness(_AOPC):
    r"""ERASER comprehensiveness as AOPC: ``mean_b [p(y|x) - p(y|x \ r_b)]``, higher is better.

    ``r_b``: the ``ceil(f_b * n)`` changeable tokens of highest relevance, erased by
    ``removal`` ("drop", default, or "replace" with ``replacement_id``); see the module docstring.

    Example::

        metric = Comprehensiveness(forward, removal="replace", replacement_id=tokenizer.mask_token_id)
        metric.update(input_ids, attention_mask, relevance, labels, special_tokens_mask)
        metric.compute().aopc
    """

    _keeps_rationale = False
    _name = "comprehensiveness"


class Sufficiency(_AOPC):
    """ERASER sufficiency as AOPC: ``mean_b [p(y|x) - p(y|r_b)]`` (only the rationale and the
    special tokens kept), lower is better (negative: the rationale alone is more confident).

    Example::

        metric = Sufficiency(forward)              # drops every changeable token outside r_b
        metric.update(input_ids, attention_mask, relevance, labels, special_tokens_mask)
        metric.compute().per_bin
    """

    _keeps_rationale = True
    _name = "sufficiency"
