"""MIF / LIF curves and SRG over the tokens of a text classifier's input (Blücher et al., TMLR
2024; the AttnLRP paper's ``Delta A^F`` on text). See :mod:`relevance_gain` for the curve math.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from ...errors import InputError
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..relevance_gain import GAIN_FRACTIONS, RelevanceGain, removal_masks
from .token_batches import token_batch
from ..validation import require_choice

TOKEN_REMOVALS = ("replace", "mask")
"""How a removed token leaves the input: its id replaced by ``replacement_id``, or its attention mask set to 0."""


class TokenRelevanceGain(RelevanceGain):
    """MIF and LIF curves of the explained class's score as tokens are removed; SRG.

    Removable tokens have attention mask 1 and are not in ``special_tokens_mask`` ([CLS],
    [SEP] and padding are never removed); an example without any is refused. Step ``x_t`` removes the ``ceil(x_t * n)`` most
    (MIF) or least (LIF) relevant of the ``n`` removable tokens of each example:

    * ``removal="replace"`` (default): their ids become ``replacement_id`` (e.g. the
      tokenizer's [MASK], [UNK] or pad id); the attention mask is unchanged;
    * ``removal="mask"``: their attention mask becomes 0 (the model no longer attends to them).

    ``extra_inputs`` (e.g. ``token_type_ids``) pass through unchanged, copied per step.

    Example::

        metric = TokenRelevanceGain(model_forward, replacement_id=tokenizer.mask_token_id)
        metric.update(input_ids, attention_mask, relevance, labels, special_tokens_mask)
        metric.compute().srg
    """

    name = "srg_tokens"

    def __init__(
        self,
        forward: Forward,
        replacement_id: Optional[int] = None,
        removal: str = "replace",
        fractions: Sequence[float] = GAIN_FRACTIONS,
        score: str = "prob",
        max_batch_size: Optional[int] = None,
    ) -> None:
        super().__init__(fractions, score)
        require_choice("removal", removal, TOKEN_REMOVALS)
        if removal == "replace" and (not isinstance(replacement_id, int) or isinstance(replacement_id, bool)):
            raise InputError(f"removal='replace' needs replacement_id, an int token id (e.g. "
                             f"tokenizer.mask_token_id), got {replacement_id!r}; or use removal='mask'.")
        self.forward = forward
        self.replacement_id = replacement_id
        self.removal = removal
        self.max_batch_size = check_max_batch_size(max_batch_size)

    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, relevance: torch.Tensor,
               labels: torch.Tensor, special_tokens_mask: Optional[torch.Tensor] = None,
               extra_inputs: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Add a batch: ids, mask, relevance (B, S), labels (B,); special tokens (B, S) are never removed."""
        input_ids, attention_mask, relevance, labels, removable, extra = token_batch(
            input_ids, attention_mask, relevance, labels, special_tokens_mask, extra_inputs, require_changeable=True)
        batch = input_ids.shape[0]
        removed = removal_masks(relevance.to(removable.device), removable, self.fractions)

        def build(steps):
            copies = lambda t: t.repeat(len(steps), *([1] * (t.dim() - 1)))  # noqa: E731 - step-major copies
            gone = torch.cat([removed[s] for s in steps])
            ids, mask = copies(input_ids), copies(attention_mask)
            if self.removal == "replace":
                ids = torch.where(gone, torch.full_like(ids, self.replacement_id), ids)
            else:
                mask = torch.where(gone, torch.zeros_like(mask), mask)
            return {"input_ids": ids, "attention_mask": mask, **{k: copies(v) for k, v in extra.items()}}

        logits = logits_per_step(self.forward, build, removed.shape[0], batch, self.max_batch_size, labels=labels)
        self._record(logits, labels)
