"""Modality-wise token removal curves for bi-modal models (Chefer et al., ICCV 2021, Sec. 4,
and their LXMERT/VisualBERT perturbation code)."""
from __future__ import annotations

import math
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..batched_forward import check_max_batch_size, logits_per_step
from ..curves import mean_curve
from ..results import CurveResult
from .token_compaction import compact_tokens
from .token_flipping import ranks
from ..validation import require_choice, require_finite, require_fractions, require_tensor

MODALITY_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
"""Removed fractions of the authors' VQA perturbation code (``pert_steps``)."""

_FLOAT_SLACK = 1e-9  # so that (1 - 0.8) * 10 = 1.9999999999999996 keeps 2 tokens, not 1

ModalityInputs = Mapping[str, Tuple[torch.Tensor, torch.Tensor]]


def kept_counts(fractions: Sequence[float], removable: torch.Tensor) -> torch.Tensor:
    """Removable tokens kept per step and example, (T, B): ``floor((1 - f) * n_b)`` as the authors' ``int(...)``.

    >>> kept_counts((0.0, 0.8, 1.0), torch.ones(1, 10, dtype=torch.bool)).tolist()
    [[10], [2], [0]]
    """
    n = removable.sum(dim=1).to(torch.float64)
    f = torch.tensor(fractions, dtype=torch.float64, device=n.device)[:, None]
    return torch.floor((1.0 - f) * n + _FLOAT_SLACK).long()


def step_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Top-1 score per step and example, (T, B), of logits (T, B, C).

    ``labels`` (B,) int: 1 if the arg-max is the label, else 0. ``labels`` (B, C) float: the
    soft score of the arg-max answer (VQA accuracy, as ``item["label"].get(answer, 0)``).
    """
    prediction = logits.argmax(dim=-1)
    labels = labels.to(logits.device)
    if labels.dim() == 1:
        return (prediction == labels[None, :]).to(torch.float64)
    return labels[None].expand(logits.shape[0], -1, -1).gather(2, prediction[..., None]).squeeze(2).to(torch.float64)


class ModalityTokenRemoval(Accumulator):
    """Accuracy as tokens of one modality are dropped from the sequence in order of relevance.

    At removed fraction ``f`` the ``floor((1 - f) * n)`` removable tokens of ``modality`` (mask
    1, not special) that are *kept* are the least relevant ones for ``"positive"`` (the most
    relevant are removed first) or the most relevant ones for ``"negative"``; ties are ranked
    by position (stable sort). Special tokens (e.g. [CLS], [SEP]) always stay. Kept tokens are
    left-packed in their original order by ``compact_tokens`` (the removed ones are gone from
    the sequence, not masked) and the other modalities are passed unchanged::

        curve(f) = mean over examples of score(argmax forward(kept_f), label)
        AUC = 100 * trapezoid(curve, fractions)

    ``forward`` receives ``{name: (values, mask)}`` for every modality, the perturbed one
    re-padded with ``pad_value`` to the longest kept row; all steps of a batch are stacked into
    as few calls as ``max_batch_size`` allows. Labels are class ids (B,) or soft scores (B, C).
    Lower positive AUC and higher negative AUC are better.

    Example::

        metric = ModalityTokenRemoval(vqa_forward, modality="image", mode="positive")
        metric.update({"text": (ids, text_mask), "image": (features, image_mask)}, image_relevance, labels)
        metric.compute().auc
    """

    def __init__(
        self,
        forward: Callable[[Dict[str, Tuple[torch.Tensor, torch.Tensor]]], torch.Tensor],
        modality: str,
        mode: str = "positive",
        fractions: Sequence[float] = MODALITY_FRACTIONS,
        pad_value=0,
        max_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        require_choice("mode", mode, ("positive", "negative"))
        self.forward = forward
        self.modality = modality
        self.mode = mode
        self.fractions = require_fractions(fractions, 0.0, 1.0)
        self.pad_value = pad_value
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self._add_state("sums", (len(self.fractions),), exact=True)
        self._add_state("count")

    def update(self, inputs: ModalityInputs, relevance: torch.Tensor, labels: torch.Tensor,
               special_tokens_mask: Optional[torch.Tensor] = None) -> None:
        """Add a batch: ``{name: (values (B, S, ...), mask (B, S))}``, relevance (B, S) of the
        perturbed modality, labels (B,) or (B, C), and which of its tokens are special (B, S)."""
        if not isinstance(inputs, Mapping) or self.modality not in inputs:
            raise InputError(
                f"inputs must be a dict {{modality: (values, mask)}} containing {self.modality!r}; got "
                f"{type(inputs).__name__} with keys {list(inputs) if isinstance(inputs, Mapping) else None}."
            )
        for name, pair in inputs.items():
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise InputError(f"inputs[{name!r}] must be a (values, mask) pair, got {type(pair).__name__}.")
        values, mask = inputs[self.modality]
        mask = require_tensor(f"inputs[{self.modality!r}] mask", mask, ndim=(2,)).bool()
        relevance = require_tensor("relevance", relevance, ndim=(2,)).detach()
        if tuple(relevance.shape) != tuple(mask.shape) or tuple(values.shape[:2]) != tuple(mask.shape):
            raise InputError(
                f"relevance {tuple(relevance.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} of "
                f"modality {self.modality!r} must share (B, S). Pass one relevance score per token."
            )
        require_finite("relevance", relevance)
        labels = require_tensor("labels", labels, ndim=(1, 2))
        batch = mask.shape[0]
        if labels.shape[0] != batch or (labels.dim() == 1 and labels.is_floating_point()):
            raise InputError(
                f"labels of shape {tuple(labels.shape)}, dtype {labels.dtype} do not fit a batch of {batch}: expected "
                "integer class ids (B,) or float soft scores (B, C)."
            )
        special = torch.zeros_like(mask)
        if special_tokens_mask is not None:
            special = require_tensor("special_tokens_mask", special_tokens_mask, ndim=(2,)).bool()
            if special.shape != mask.shape:
                raise InputError(f"special_tokens_mask {tuple(special.shape)} must match the mask {tuple(mask.shape)}.")
        removable = mask & ~special
        # Rank removable tokens so that the ones to keep come first.
        keep_first = relevance if self.mode == "negative" else -relevance
        order = ranks(torch.where(removable, keep_first, torch.full_like(keep_first, -math.inf)), descending=True)
        kept = kept_counts(self.fractions, removable).to(order.device)
        others = {name: pair for name, pair in inputs.items() if name != self.modality}

        def build(steps):
            n = len(steps)
            keep = torch.cat([(mask & special) | (removable & (order < kept[s][:, None])) for s in steps])
            packed, packed_mask = compact_tokens(values.repeat(n, *([1] * (values.dim() - 1))), keep, self.pad_value)
            repeat = lambda t: t.repeat(n, *([1] * (t.dim() - 1)))  # noqa: E731 - step-major copies
            batch_inputs = {name: (repeat(v), repeat(m)) for name, (v, m) in others.items()}
            batch_inputs[self.modality] = (packed, packed_mask)
            return batch_inputs

        logits = logits_per_step(self.forward, build, len(self.fractions), batch, self.max_batch_size)
        self._add("sums", exact_sum(step_scores(logits, labels), dim=1))
        self._add("count", torch.tensor(batch))

    def compute(self) -> CurveResult:
        return mean_curve(
            f"{self.modality}_removal_{self.mode}", self.fractions, self._value("sums"), self._state["count"],
            auc_scale=100.0, higher_is_better=self.mode == "negative", y_label="accuracy",
            x_label=f"fraction of {self.modality} tokens removed",
        )
