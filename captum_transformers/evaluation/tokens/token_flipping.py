"""Activation (AUAC) and pruning (AU-MSE) curves of token relevance (Ali et al., ICML 2022,
Sec. 6.2, and their evaluation code ``utils.flip``)."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch

from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..curves import mean_curve
from ..results import CurveResult
from .token_batches import token_batch
from ..validation import require_fractions

TOKEN_FRACTIONS = tuple(i / 10 for i in range(11))
"""0.0, 0.1, ..., 1.0 (``np.linspace(0, 1, 11)`` in the authors' code)."""

_FLOAT_SLACK = 1e-9  # so that 0.3 * 10 = 3.0000000000000004 is not rounded up to 4


def flip_counts(fractions: Sequence[float], changeable: torch.Tensor) -> torch.Tensor:
    """Tokens flipped per step and example, (T, B): ``ceil(f * n_b)`` with n_b changeable tokens.

    Ceil follows the authors' ``n_flip = int(np.ceil(frac * N))``: any non-zero fraction flips
    at least one token. The product is taken with a 1e-9 slack so that floating-point noise in
    ``f * n`` (e.g. 0.3 * 10) does not flip one token more.

    >>> flip_counts((0.0, 0.3, 1.0), torch.ones(1, 10, dtype=torch.bool)).tolist()
    [[0], [3], [10]]
    """
    n = changeable.sum(dim=1).to(torch.float64)
    f = torch.tensor(fractions, dtype=torch.float64, device=n.device)[:, None]
    return torch.ceil(f * n - _FLOAT_SLACK).clamp(min=0).long()


def stable_order(key: torch.Tensor, descending: bool) -> torch.Tensor:
    """Indices that sort each row of ``key`` (B, P); ties keep the earlier index first.

    >>> stable_order(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), descending=True).tolist()
    [[1, 2, 3, 0]]
    """
    return torch.sort(key, dim=1, descending=descending, stable=True).indices


def ranks(key: torch.Tensor, descending: bool) -> torch.Tensor:
    """Position of every entry in its row's stable sort (ties: earlier position first), the inverse of
    :func:`stable_order`.

    >>> ranks(torch.tensor([[1.0, 3.0, 3.0, 2.0]]), descending=True).tolist()
    [[3, 0, 1, 2]]
    """
    order = stable_order(key, descending)
    positions = torch.arange(key.shape[1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


class _TokenFlipping(Accumulator):
    """Shared input handling: the changeable tokens, their order, one stacked forward per batch."""

    def __init__(self, forward: Forward, replacement_id: int, fractions, max_batch_size) -> None:
        super().__init__()
        if not isinstance(replacement_id, int):
            raise InputError(
                f"replacement_id must be an int token id (e.g. tokenizer.unk_token_id), got {replacement_id!r}."
            )
        self.forward = forward
        self.replacement_id = replacement_id
        self.fractions = require_fractions(fractions, 0.0, 1.0)
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self._add_state("sums", (len(self.fractions),), exact=True)
        self._add_state("count")

    def _prepare(self, input_ids, attention_mask, relevance, labels, special_tokens_mask, extra_inputs):
        return token_batch(input_ids, attention_mask, relevance, labels, special_tokens_mask, extra_inputs)

    def _logits(self, input_ids, attention_mask, extra, flipped_at_step, labels):
        """Logits (T, B, C); ``flipped_at_step(step) -> (B, S) bool`` says which tokens are [UNK]."""
        batch = input_ids.shape[0]

        def build(steps):
            replacement = torch.full_like(input_ids, self.replacement_id)
            ids = torch.cat([torch.where(flipped_at_step(s), replacement, input_ids) for s in steps])
            repeat = lambda t: t.repeat(len(steps), *([1] * (t.dim() - 1)))  # noqa: E731 - step-major copies
            extra_copies = {k: repeat(v) for k, v in extra.items()}
            return {"input_ids": ids, "attention_mask": repeat(attention_mask), **extra_copies}

        return logits_per_step(self.forward, build, len(self.fractions), batch, self.max_batch_size,
                               labels=labels).to(torch.float64)


class TokenActivation(_TokenFlipping):
    """Activation curve and AUAC: reveal the most relevant tokens first into an all-[UNK] input.

    Step ``f`` starts from the input with every changeable token (attention mask 1 and not in
    ``special_tokens_mask``: [CLS], [SEP] and padding are never changed) replaced by
    ``replacement_id`` and restores the ``ceil(f * n)`` changeable tokens of highest relevance
    (ties: earlier position first). With ``p_f = softmax(logits)[label]``::

        curve(f) = mean over examples of p_f,     AUAC = trapezoid(curve, fractions),  x in [0, 1]

    Higher is better. (The authors' code also turns [CLS]/[SEP] into [UNK]; here they stay.)

    Example::

        metric = TokenActivation(model_forward, replacement_id=tokenizer.unk_token_id)
        metric.update(input_ids, attention_mask, relevance, labels, special_tokens_mask)
        metric.compute().auc
    """

    def __init__(self, forward: Forward, replacement_id: int, fractions: Sequence[float] = TOKEN_FRACTIONS,
                 max_batch_size: Optional[int] = None) -> None:
        super().__init__(forward, replacement_id, fractions, max_batch_size)

    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, relevance: torch.Tensor,
               labels: torch.Tensor, special_tokens_mask: Optional[torch.Tensor] = None,
               extra_inputs: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Add a batch: ids, mask, relevance (B, S), labels (B,); extra inputs (token_type_ids) pass through."""
        input_ids, attention_mask, relevance, labels, changeable, extra = self._prepare(
            input_ids, attention_mask, relevance, labels, special_tokens_mask, extra_inputs)
        order = ranks(torch.where(changeable, relevance, torch.full_like(relevance, -math.inf)), descending=True)
        revealed = flip_counts(self.fractions, changeable).to(order.device)
        logits = self._logits(input_ids, attention_mask, extra,
                              lambda s: changeable & (order >= revealed[s][:, None]), labels)
        probability = torch.softmax(logits, dim=-1).gather(
            2, labels.to(logits.device)[None, :, None].expand(len(self.fractions), -1, 1)).squeeze(2)
        self._add("sums", exact_sum(probability, dim=1))
        self._add("count", torch.tensor(input_ids.shape[0]))

    def compute(self) -> CurveResult:
        return mean_curve("auac", self.fractions, self._value("sums"), self._state["count"],
                          higher_is_better=True, y_label="p(true class)", x_label="fraction of tokens revealed")


class TokenPruning(_TokenFlipping):
    """Pruning curve and AU-MSE: replace the least |relevant| tokens first by [UNK].

    Step ``f`` replaces the ``ceil(f * n)`` changeable tokens of lowest absolute relevance
    (ties: earlier position first) by ``replacement_id``. With ``y_0`` the logits of the
    unchanged input (step f = 0) and ``y_f`` those at step ``f``::

        err_f = sum over classes of (y_0 - y_f)**2       (the full logit vector, as the authors' code)
        curve(f) = mean over examples of err_f,   AU-MSE = trapezoid(curve, fractions)

    Lower is better. ``fractions`` must start at 0 (the unpruned reference).

    Example::

        metric = TokenPruning(model_forward, replacement_id=tokenizer.unk_token_id)
        metric.update(input_ids, attention_mask, relevance, labels, special_tokens_mask)
        metric.compute().auc
    """

    def __init__(self, forward: Forward, replacement_id: int, fractions: Sequence[float] = TOKEN_FRACTIONS,
                 max_batch_size: Optional[int] = None) -> None:
        super().__init__(forward, replacement_id, fractions, max_batch_size)
        if self.fractions[0] != 0.0:
            raise InputError(f"fractions must start at 0.0 (the unpruned reference logits), got {self.fractions}.")

    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, relevance: torch.Tensor,
               labels: torch.Tensor, special_tokens_mask: Optional[torch.Tensor] = None,
               extra_inputs: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Add a batch: ids, mask, relevance (B, S), labels (B,) (checked only); extra inputs pass through."""
        input_ids, attention_mask, relevance, labels, changeable, extra = self._prepare(
            input_ids, attention_mask, relevance, labels, special_tokens_mask, extra_inputs)
        order = ranks(torch.where(changeable, relevance.abs(), torch.full_like(relevance, math.inf)), descending=False)
        pruned = flip_counts(self.fractions, changeable).to(order.device)
        logits = self._logits(input_ids, attention_mask, extra,
                              lambda s: changeable & (order < pruned[s][:, None]), labels)
        squared_error = ((logits - logits[:1]) ** 2).sum(dim=-1)
        self._add("sums", exact_sum(squared_error, dim=1))
        self._add("count", torch.tensor(input_ids.shape[0]))

    def compute(self) -> CurveResult:
        return mean_curve("au_mse", self.fractions, self._value("sums"), self._state["count"],
                          higher_is_better=False, y_label="squared logit error", x_label="fraction of tokens pruned")
