r"""Which generated tokens one forward pass explains, and the score each explanation reads.

A causal model's logits at position ``p`` are the next-token scores given tokens ``0..p`` only,
so one forward pass over prompt + generated tokens holds every step's scores exactly: step
``t`` (the ``t``-th generated token ``y_t``) is read at position ``P + t - 1``. The score of a
step, from its logits ``z`` (the vocabulary at that position):

* ``"logit"``: :math:`z_{y_t}` (what LRP conserves; the default);
* ``"log_prob"``: :math:`z_{y_t} - \log\sum_v e^{z_v}` (Captum's ``LLMGradientAttribution``);
* ``"prob"``: :math:`\mathrm{softmax}(z)_{y_t}`;

and with a foil token ``f_t`` (contrastive explanation, Yin & Neubig, EMNLP 2022) the
difference ``score(y_t) - score(f_t)`` (for logits and log-probabilities both: the logit
difference). ``groups`` say which steps are explained together: each alone (one backward pass
each) or a span explained as the sum of its steps' scores in one backward pass.

Example::

    >>> steps = ExplainedSteps(positions=torch.tensor([4, 5]), targets=torch.tensor([[7, 9]]))
    >>> step_scores(logits, steps, 0)     # (B,) the logit of token 7 at position 4
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence, Tuple

import torch

from ..errors import InputError

ScoreKind = Literal["logit", "log_prob", "prob"]
SCORE_KINDS: Tuple[str, ...] = ("logit", "log_prob", "prob")


@dataclasses.dataclass(frozen=True)
class ExplainedSteps:
    """The explained (row, target) pairs of one batch.

    ``positions`` (T,): the sequence position (of the explained stream) whose next-token
    logits explain each step, the same for every example (left padding aligns them);
    ``targets`` (B, T): the explained token ids; ``foils`` (B, T): contrast token ids, or None;
    ``score``: one of :data:`SCORE_KINDS`; ``groups``: tuples of step indices explained
    together (default: each step alone).
    """

    positions: torch.Tensor
    targets: torch.Tensor
    score: str = "logit"
    foils: Optional[torch.Tensor] = None
    groups: Optional[Tuple[Tuple[int, ...], ...]] = None

    def __post_init__(self) -> None:
        if self.score not in SCORE_KINDS:
            raise InputError(f"score must be one of {SCORE_KINDS}, got {self.score!r}.")
        if self.targets.dim() != 2 or self.targets.shape[1] != self.positions.shape[0]:
            raise InputError(f"targets must be (batch, {self.positions.shape[0]}) token ids, one per explained "
                             f"position; got shape {tuple(self.targets.shape)}.")
        if self.foils is not None and self.foils.shape != self.targets.shape:
            raise InputError(f"the contrast (foil) tokens must match the targets' shape {tuple(self.targets.shape)}, "
                             f"got {tuple(self.foils.shape)}.")
        for group in self.explained_groups:
            if not group or any(not 0 <= t < self.num_steps for t in group):
                raise InputError(f"a span of explained steps must name steps in [0, {self.num_steps}), got {group}.")

    @property
    def num_steps(self) -> int:
        return int(self.positions.shape[0])

    @property
    def explained_groups(self) -> Tuple[Tuple[int, ...], ...]:
        if self.groups is None:
            return tuple((t,) for t in range(self.num_steps))
        return self.groups


def output_vocabulary_size(model: torch.nn.Module) -> Optional[int]:
    """How many next-token scores the model's head returns (its output embeddings'
    ``out_features``, else the text config's ``vocab_size``), or None when neither says."""
    try:
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    except (AttributeError, NotImplementedError, TypeError):
        head = None
    size = getattr(head, "out_features", None)
    if not isinstance(size, int):
        weight = getattr(head, "weight", None)
        size = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    if size is None:
        config = getattr(model, "config", None)
        text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
        size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def refuse_ids_outside_vocabulary(rows: Sequence[Sequence[int]], model: torch.nn.Module, what: str,
                                  batched: bool) -> None:
    """Refuse explained (``what``: "target") or foil ("contrast") token ids outside
    ``[0, vocabulary)`` before any forward pass: the score would index past the logits (a raw
    ``RuntimeError`` after the whole forward). ``rows``: per prompt, the ids per output step."""
    size = output_vocabulary_size(model)
    if size is None:
        return
    for prompt, row in enumerate(rows):
        bad = next(((step, int(token)) for step, token in enumerate(row) if not 0 <= int(token) < size), None)
        if bad is not None:
            owner = f"Prompt {prompt}'s {what}" if batched else f"The {what}"
            raise InputError(
                f"{owner} holds the token id {bad[1]} at output step {bad[0]}, outside the model's output vocabulary: "
                f"valid ids are [0, {size}) ({type(model).__name__}'s head scores {size} tokens). Give ids of the "
                "model's own tokenizer (or text).")


def _token_score(logits: torch.Tensor, tokens: torch.Tensor, kind: str) -> torch.Tensor:
    """The score of ``tokens`` (B,) in ``logits`` (B, V), in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    picked = logits.gather(1, tokens.to(logits.device).long()[:, None])[:, 0]
    if kind == "logit":
        return picked
    log_prob = picked - torch.logsumexp(logits, dim=-1)
    return log_prob if kind == "log_prob" else log_prob.exp()


def step_scores(step_logits: torch.Tensor, steps: ExplainedSteps, step: int) -> torch.Tensor:
    """The explained score (B,) of ``step`` from the steps' logits (B, T, V)."""
    logits = step_logits[:, step]
    score = _token_score(logits, steps.targets[:, step], steps.score)
    if steps.foils is not None:
        score = score - _token_score(logits, steps.foils[:, step], steps.score)
    return score


def group_scores(step_logits: torch.Tensor, steps: ExplainedSteps, group: Sequence[int]) -> torch.Tensor:
    """The summed score (B,) of the steps of one explained group."""
    total = step_scores(step_logits, steps, group[0])
    for step in group[1:]:
        total = total + step_scores(step_logits, steps, step)
    return total


def token_probabilities(step_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``p(y_t | y_<t, prompt)`` (B, T) of the explained tokens, without a graph."""
    with torch.no_grad():
        logits = step_logits.detach().to(torch.promote_types(step_logits.dtype, torch.float32))
        return torch.softmax(logits, dim=-1).gather(2, targets.to(logits.device).long()[:, :, None])[:, :, 0]
