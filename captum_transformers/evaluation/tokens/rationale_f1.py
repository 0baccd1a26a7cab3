"""ERASER-style token F1 of top-k word rationales against human rationales (DeYoung et al.,
ACL 2020)."""
from __future__ import annotations

from typing import Union

import torch

from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..results import RationaleF1Result
from ..validation import require_finite, require_same_shape, require_tensor


def word_scores(token_scores: torch.Tensor, word_ids: torch.Tensor, n_words: int):
    """Max-pool word-piece scores into word scores.

    Returns ``(scores (B, W), has_piece (B, W) bool)``; ``word_ids[b, s] = -1`` marks pieces of
    no word (special tokens, padding), which are ignored. Words without pieces score -inf.

    >>> word_scores(torch.tensor([[0.5, 0.1, 0.9, 0.3]]), torch.tensor([[-1, 0, 0, 1]]), 3)[0]
    tensor([[0.9000, 0.3000,   -inf]])
    """
    batch = token_scores.shape[0]
    index = torch.where(word_ids >= 0, word_ids, torch.full_like(word_ids, n_words))  # -1 -> a spare column
    pooled = torch.full((batch, n_words + 1), float("-inf"), dtype=token_scores.dtype, device=token_scores.device)
    pooled.scatter_reduce_(1, index, token_scores, reduce="amax", include_self=True)
    has_piece = torch.zeros(batch, n_words + 1, dtype=torch.bool, device=token_scores.device)
    has_piece.scatter_(1, index, True)
    return pooled[:, :n_words], has_piece[:, :n_words]


class RationaleF1(Accumulator):
    """Token-level F1 between the top-k scored words and the gold rationale words.

    Word score = max over its word pieces. The predicted rationale of an example is its ``k``
    highest-scoring words among those that have pieces (``k`` an int, or ``"gold"``: the
    example's number of gold words; ``k`` is clipped to the number of such words). Equal scores
    are ranked by word position (stable sort: earlier words first). Gold words without pieces
    (e.g. truncated) still count as gold, so they can only be missed.

        F1_i  = 2 TP_i / (2 TP_i + FP_i + FN_i)      (= 1 when gold and prediction are both empty)
        macro = mean_i F1_i,   micro = 2 sum TP / (2 sum TP + sum FP + sum FN)

    An example with no gold words and no predicted words (possible with ``k="gold"``) agrees
    perfectly and counts as F1 = 1; with an int ``k`` and no gold words its F1 is 0.

    Example::

        metric = RationaleF1(k="gold")
        metric.update(token_scores, word_ids, gold_words)   # (B, S), (B, S), (B, W)
        metric.compute().macro_f1
    """

    def __init__(self, k: Union[int, str] = "gold") -> None:
        super().__init__()
        if not (k == "gold" or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)):
            raise InputError(f"k={k!r} must be a non-negative int or 'gold' (the number of gold words).")
        self.k = k
        self._add_state("f1_sum", exact=True)
        for name in ("count", "true_positive", "false_positive", "false_negative"):
            self._add_state(name)

    def update(self, token_scores: torch.Tensor, word_ids: torch.Tensor, gold: torch.Tensor) -> None:
        """Add a batch: token scores (B, S), word index per piece (B, S) (-1 = none), gold words (B, W) bool."""
        token_scores = require_tensor("token_scores", token_scores, ndim=(2,)).detach().to(torch.float64)
        word_ids = require_tensor("word_ids", word_ids, ndim=(2,))
        gold = require_tensor("gold", gold, ndim=(2,))
        require_same_shape(("token_scores", "word_ids"), (token_scores, word_ids))
        require_same_shape(("token_scores", "gold"), (token_scores, gold), dims=1)
        require_finite("token_scores", token_scores)
        if word_ids.is_floating_point():
            raise InputError(f"word_ids must be integer word indices (-1 for none), got dtype {word_ids.dtype}.")
        n_words = gold.shape[1]
        if bool(((word_ids < -1) | (word_ids >= n_words)).any()):
            raise InputError(
                f"word_ids must lie in [-1, {n_words}) for gold rationales of {n_words} words; got values in "
                f"[{int(word_ids.min())}, {int(word_ids.max())}]. Pad gold to the largest word index + 1."
            )
        gold = gold.to(torch.bool)
        scores, has_piece = word_scores(token_scores, word_ids.long(), n_words)
        ranking_key = torch.where(has_piece, scores, torch.full_like(scores, float("-inf")))
        order = torch.sort(ranking_key, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(n_words, device=order.device).expand_as(order))
        k = gold.sum(dim=1) if self.k == "gold" else torch.full((gold.shape[0],), self.k, device=gold.device)
        k = torch.minimum(k, has_piece.sum(dim=1))
        predicted = (rank < k[:, None]) & has_piece
        tp = (predicted & gold).sum(dim=1).double()
        fp = (predicted & ~gold).sum(dim=1).double()
        fn = (~predicted & gold).sum(dim=1).double()
        denominator = 2 * tp + fp + fn
        f1 = torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.ones_like(tp))
        self._add("f1_sum", exact_sum(f1))
        self._add("count", torch.tensor(gold.shape[0]))
        self._add("true_positive", tp.sum())
        self._add("false_positive", fp.sum())
        self._add("false_negative", fn.sum())

    def compute(self) -> RationaleF1Result:
        s = self._state
        tp, fp, fn = (float(s[k]) for k in ("true_positive", "false_positive", "false_negative"))
        count = int(s["count"].item())
        nan = float("nan")
        return RationaleF1Result(
            name=f"rationale_f1_top{self.k}",
            macro_f1=float(self._value("f1_sum")) / count if count else nan,
            micro_f1=2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) else (1.0 if count else nan),
            micro_precision=tp / (tp + fp) if tp + fp else nan,
            micro_recall=tp / (tp + fn) if tp + fn else nan,
            count=count,
        )
