"""MIF / LIF removal curves and their area difference, the symmetric relevance gain (SRG).

Blücher, Vielhaben and Strodthoff (TMLR 2024, "Decoupling pixel flipping and occlusion
strategy for consistent XAI benchmarks") remove the features of an input in the order of
their relevance, most relevant first (MIF) and least relevant first (LIF), and track the
model's score of the explained class ``y`` after each step. With ``x_t`` the fraction of
features removed (in [0, 1]) and ``s_t`` the score at step ``t``::

    A(MIF) = trapezoid(s^MIF, x),   A(LIF) = trapezoid(s^LIF, x)
    SRG = A(LIF) - A(MIF)            (higher is better; a random order scores 0 in expectation)

The area of the random order appears in both relevance gains (MRG = A(random) - A(MIF),
LRG = A(LIF) - A(random)) and cancels in their sum, which is why SRG ranks explanations
consistently across occlusion choices. The AttnLRP paper (Achtibat et al., ICML 2024)
reports the same difference as ``Delta A^F``.

**Score and normalisation.** ``score="prob"`` (default): ``softmax(logits)[y]``, not
rescaled per example, the paper's definition (SRG is not in Quantus 0.6.0, the latest
PyPI release at the time of writing); the x axis is the removed fraction, so both areas lie in [0, 1] and SRG in [-1, 1],
comparable across models and step schedules. ``"logit"`` and ``"log_prob"`` are the
alternatives (unbounded scales, e.g. to compare with tables computed on logits).

**Order.** MIF sorts relevance descending, LIF ascending, both by a stable sort (ties:
earlier feature first in both curves). Tied features are thus removed in the same order by
the two curves, so a constant map gives identical MIF and LIF curves and SRG exactly 0 (an
uninformative map gains nothing; a port that reverses the MIF order for LIF instead scores
a constant map non-zero). Without ties the LIF step removing ``k`` features keeps
exactly what the MIF step removing ``n - k`` features removed.
Step ``t`` removes ``ceil(x_t * n)`` of the ``n`` removable features (``flip_counts``).

:func:`symmetric_relevance_gain` is the curve math alone (per-step scores in, areas and
SRG out), shared by the image, token and graph accumulators here and usable on its own::

    >>> gain = symmetric_relevance_gain(torch.tensor([1.0, 0.2, 0.0]), torch.tensor([1.0, 0.9, 0.0]), (0.0, 0.5, 1.0))
    >>> [round(float(v), 6) for v in gain]
    [0.35, 0.7, 0.35]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence, Tuple

import torch

from ..errors import InputError
from .accumulator import Accumulator, exact_sum
from .results import ResultRecord
from .tokens.token_flipping import flip_counts, ranks
from .validation import require_choice, require_fractions, require_labels

GAIN_FRACTIONS: Tuple[float, ...] = tuple(i / 20 for i in range(21))
"""0.0, 0.05, ..., 1.0: the removed fractions of the MIF and LIF curves (21 steps, both ends included)."""

GAIN_SCORES: Tuple[str, ...] = ("prob", "logit", "log_prob")
"""What the curves track of the explained class: its softmax probability (default), logit or log-probability."""


class GainAreas(NamedTuple):
    """Areas under the MIF and LIF curves and their difference ``srg = area_lif - area_mif``."""

    area_mif: torch.Tensor
    area_lif: torch.Tensor
    srg: torch.Tensor


def symmetric_relevance_gain(mif_scores, lif_scores, fractions: Sequence[float]) -> GainAreas:
    """Trapezoid areas of MIF and LIF score curves over ``fractions``, and SRG = A(LIF) - A(MIF).

    ``mif_scores`` and ``lif_scores`` are (..., T) (one curve per leading index, e.g. per
    example, or a single mean curve of shape (T,)); ``fractions`` the T increasing removed
    fractions in [0, 1]. Returns float64 tensors of shape (...). The area is linear in the
    curve, so the mean of per-example areas equals the area of the mean curve.

    >>> symmetric_relevance_gain(torch.ones(2, 3), torch.ones(2, 3), (0.0, 0.5, 1.0)).srg.tolist()
    [0.0, 0.0]
    """
    x = torch.tensor(require_fractions(fractions, 0.0, 1.0), dtype=torch.float64)
    curves = []
    for name, scores in (("mif_scores", mif_scores), ("lif_scores", lif_scores)):
        scores = torch.as_tensor(scores).detach().to(device="cpu", dtype=torch.float64)
        if scores.dim() < 1 or scores.shape[-1] != len(x):
            raise InputError(
                f"{name} has shape {tuple(scores.shape)} but {len(x)} fractions were given: the last dim must hold "
                "one score per removal step."
            )
        curves.append(scores)
    if curves[0].shape != curves[1].shape:
        raise InputError(f"mif_scores {tuple(curves[0].shape)} and lif_scores {tuple(curves[1].shape)} differ in "
                         "shape; pass one MIF and one LIF curve per example.")
    area_mif, area_lif = (torch.trapezoid(curve, x, dim=-1) for curve in curves)
    return GainAreas(area_mif, area_lif, area_lif - area_mif)


def class_scores(logits: torch.Tensor, labels: torch.Tensor, score: str) -> torch.Tensor:
    """Score of class ``labels[b]`` in logits (..., B, C) as float64 (..., B): prob, logit or log_prob."""
    logits = logits.to(torch.float64)
    if score == "prob":
        logits = torch.softmax(logits, dim=-1)
    elif score == "log_prob":
        logits = torch.log_softmax(logits, dim=-1)
    index = labels.to(logits.device).expand(*logits.shape[:-1])[..., None]
    return logits.gather(-1, index).squeeze(-1)


def removal_masks(relevance: torch.Tensor, removable: torch.Tensor, fractions: Sequence[float]) -> torch.Tensor:
    """Which features each step removes, (2T, B, N) bool: the T MIF steps, then the T LIF steps.

    ``relevance`` and ``removable`` are (B, N); only removable features are ranked and
    removed, ``ceil(x_t * n_b)`` of them at step t. MIF ranks by descending, LIF by
    ascending relevance, both stable (ties: earlier feature first), so a constant map
    removes the same features at every step of both curves.

    >>> masks = removal_masks(torch.tensor([[0.1, 0.9, 0.5]]), torch.ones(1, 3, dtype=torch.bool), (0.0, 0.4, 1.0))
    >>> masks[:, 0].int().tolist()
    [[0, 0, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 1], [1, 1, 1]]
    """
    relevance = relevance.detach().to(torch.float64)
    removable = removable.to(device=relevance.device, dtype=torch.bool)
    # Non-removable features get the key that sorts them last, so they never fall within the counts.
    mif_rank = ranks(torch.where(removable, relevance, torch.full_like(relevance, -torch.inf)), descending=True)
    lif_rank = ranks(torch.where(removable, relevance, torch.full_like(relevance, torch.inf)), descending=False)
    counts = flip_counts(fractions, removable).to(relevance.device)[:, :, None]  # (T, B, 1)
    return torch.cat([mif_rank[None] < counts, lif_rank[None] < counts])


@dataclass(frozen=True)
class RelevanceGainResult(ResultRecord):
    """Mean MIF and LIF curves (``y`` at removed fraction ``x``), their areas and ``srg``.

    ``srg = area_lif - area_mif``; higher is better. ``score`` names what ``mif`` and
    ``lif`` hold (``"prob"``, ``"logit"`` or ``"log_prob"`` of the explained class).
    """

    name: str
    x: Tuple[float, ...]
    mif: Tuple[float, ...]
    lif: Tuple[float, ...]
    area_mif: float
    area_lif: float
    srg: float
    count: int
    score: str = "prob"
    higher_is_better: bool = True
    x_label: str = "fraction of features removed"


class RelevanceGain(Accumulator):
    """Shared state of the MIF / LIF accumulators: per-step exact sums of both curves and a count.

    Subclasses turn a batch into logits of shape (2T, B, C) (MIF steps, then LIF steps) and
    call ``_record``; ``compute()`` averages the curves and applies
    :func:`symmetric_relevance_gain`.
    """

    name = "srg"

    def __init__(self, fractions: Sequence[float], score: str) -> None:
        super().__init__()
        require_choice("score", score, GAIN_SCORES)
        self.fractions = require_fractions(fractions, 0.0, 1.0)
        self.score = score
        self._add_state("mif", (len(self.fractions),), exact=True)
        self._add_state("lif", (len(self.fractions),), exact=True)
        self._add_state("count")

    def _record(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        steps = len(self.fractions)
        labels = require_labels(labels, logits.shape[1])
        scores = class_scores(logits, labels, self.score).cpu()
        self._add("mif", exact_sum(scores[:steps], dim=1))
        self._add("lif", exact_sum(scores[steps:], dim=1))
        self._add("count", torch.tensor(logits.shape[1]))

    def compute(self) -> RelevanceGainResult:
        n = int(self._state["count"].item())
        if n:
            mif, lif = self._value("mif") / n, self._value("lif") / n
        else:  # nothing seen: NaN, never a silent 0
            mif = lif = torch.full((len(self.fractions),), float("nan"), dtype=torch.float64)
        gain = symmetric_relevance_gain(mif, lif, self.fractions)
        return RelevanceGainResult(
            name=self.name, x=self.fractions, mif=tuple(mif.tolist()), lif=tuple(lif.tolist()),
            area_mif=float(gain.area_mif), area_lif=float(gain.area_lif), srg=float(gain.srg), count=n,
            score=self.score,
        )
