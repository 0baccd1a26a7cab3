"""Average precision of many score rows at once, equal to scikit-learn's
``average_precision_score`` row by row (ties included)."""
from __future__ import annotations

import torch

from .validation import require_same_shape, require_tensor


def average_precision(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row average precision, shape (N,), for scores and binary labels of shape (N, P).

        AP = sum_k (R_k - R_{k-1}) P_k

    over the distinct score thresholds taken from high to low, where P_k and R_k are the
    precision and recall of predicting positive every item scored >= the k-th threshold
    (scikit-learn's definition: no interpolation; items with equal scores enter together).
    Equivalently, every positive item contributes ``P / n_pos`` with P the precision at the
    end of its tie block. A row without positives gives NaN.

    >>> average_precision(torch.tensor([[0.1, 0.4, 0.35, 0.8]]), torch.tensor([[0, 0, 1, 1]]))
    tensor([0.8333], dtype=torch.float64)
    """
    scores = require_tensor("scores", scores, ndim=(2,)).detach().to(torch.float64)
    labels = require_tensor("labels", labels, ndim=(2,))
    require_same_shape(("scores", "labels"), (scores, labels))
    positives = labels.detach().to(torch.float64)
    sorted_scores, order = torch.sort(scores, dim=1, descending=True)
    sorted_labels = positives.gather(1, order)
    true_positives = sorted_labels.cumsum(dim=1)
    ranks = torch.arange(1, scores.shape[1] + 1, dtype=torch.float64, device=scores.device)
    precision = true_positives / ranks
    # The last item of each tie block is where its threshold's precision is read.
    block_end = torch.ones_like(sorted_scores, dtype=torch.bool)
    block_end[:, :-1] = sorted_scores[:, :-1] != sorted_scores[:, 1:]
    positions = torch.arange(scores.shape[1], device=scores.device).expand_as(sorted_scores)
    end_index = torch.where(block_end, positions, torch.full_like(positions, scores.shape[1]))
    end_index = torch.flip(torch.cummin(torch.flip(end_index, dims=[1]), dim=1).values, dims=[1])
    precision_at_block_end = precision.gather(1, end_index)
    n_positive = positives.sum(dim=1)
    return (sorted_labels * precision_at_block_end).sum(dim=1) / n_positive
