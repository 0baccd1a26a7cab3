"""Next-token logits computed only where they are explained (HuggingFace ``logits_to_keep``).

A causal LM's head projects every position onto the vocabulary, but an explanation reads
one score: the logit at the explained (last real) token. HuggingFace causal LMs take
``logits_to_keep`` for exactly this (``generate`` passes 1): the head then runs on the kept
positions only. On a real vocabulary that is most of the head's cost and memory (Llama 3 at
1k tokens: 1024 x 128256 logits, 0.5 GB per example in float32, and the same again for their
gradient); on the benchmark's 1k-word model it is 12 % of a forward + backward at 128 tokens.

The positions are chosen before the forward pass from the same inputs the layout reads
afterwards (the 2-D attention mask, or an explicit ``query_rows``), and checked against the
layout once it exists: a disagreement raises instead of reading another position's logits.
Anything this module does not understand (a 4-D mask, ``labels``, a user's own
``logits_to_keep``, several inputs) keeps every position, as the model would by default.

Example::

    >>> kept = kept_logit_positions(llama, (ids,), (), {"attention_mask": mask}, None)
    >>> llama(ids, attention_mask=mask, logits_to_keep=kept.keep).logits.shape   # (B, len(kept.positions), V)
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ...capture.trace import TokenLayout
from ...errors import CaptureError
from ..query_rows import QueryRows, chosen_rows


#: Heads that take ``logits_to_keep`` but pool or score positions themselves: keeping only the
#: explained position would change what they compute (BioGPT's classifier then indexes past it),
#: or whose target names the position (token-level heads; XLM's masked-LM ``WithLMHeadModel``).
_POOLING_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                  "ForQuestionAnsweringSimple", "ForMaskedLM", "WithLMHeadModel")


@dataclasses.dataclass(frozen=True)
class KeptLogitPositions:
    """The sequence positions whose logits the model computes.

    ``keep`` is what the model receives as ``logits_to_keep``: ``1`` (the last position) or a
    1-D tensor of the ascending ``positions``.
    """

    keep: Union[int, torch.Tensor]
    positions: Tuple[int, ...]

    def layout_for_logits(self, layout: TokenLayout, causal: bool) -> TokenLayout:
        """``layout`` with its explained rows renumbered into the kept positions, for reading
        the logits; raises if the forward pass explains a position that was not kept."""
        rows = layout.query_rows
        if not causal or layout.query_weights is not None or rows.shape[1] != 1:
            raise CaptureError(
                f"Logits were kept at positions {list(self.positions)} for a causal LM, but the forward pass "
                f"{'explains ' + str(rows.shape[1]) + ' weighted rows' if causal else 'was not causal'}. "
                "Pass forward_kwargs={'logits_to_keep': 0} to keep every position, and report this model."
            )
        explained = rows[:, 0].tolist()
        index = {position: i for i, position in enumerate(self.positions)}
        if any(position not in index for position in explained):
            raise CaptureError(
                f"The explained positions {explained} are not among the positions whose logits were kept "
                f"({list(self.positions)}, chosen from the attention mask before the forward pass). Pass "
                "forward_kwargs={'logits_to_keep': 0} to keep every position, and report this model."
            )
        renumbered = torch.tensor([[index[position]] for position in explained], dtype=rows.dtype, device=rows.device)
        return dataclasses.replace(layout, query_rows=renumbered)


@functools.lru_cache(maxsize=256)
def forward_signature(model_class: type) -> Optional[inspect.Signature]:
    """The class's forward signature (an instance's forward may be wrapped for the explanation,
    as ``*args, **kwargs``); None when it cannot be read. Cached: reading it costs 0.1 ms."""
    try:
        return inspect.signature(model_class.forward)
    except (TypeError, ValueError):
        return None



def kept_logit_positions(model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                         forward_kwargs: Optional[dict], query_rows: QueryRows) -> Optional[KeptLogitPositions]:
    """The positions to keep when ``model`` takes ``logits_to_keep``, else None (keep all).

    ``query_rows`` is the adapter's choice: None or ``"last"`` (the last real token by the
    attention mask), a position, or ``"mean"`` (all tokens: nothing to save).
    """
    if len(inputs) != 1 or query_rows == "mean" or inputs[0].dim() < 2:
        return None
    if type(model).__name__.endswith(_POOLING_HEADS):  # they read positions themselves (BioGPT's classifier)
        return None
    signature = forward_signature(type(model))
    if signature is None or "logits_to_keep" not in signature.parameters:
        return None
    try:
        arguments = signature.bind_partial(model, *inputs, *additional_forward_args, **(forward_kwargs or {})).arguments
    except TypeError:  # arguments that do not fit: the model raises its own error when called
        return None
    if any(arguments.get(name) is not None for name in ("logits_to_keep", "labels", "num_logits_to_keep")):
        return None
    num_tokens = inputs[0].shape[1]
    mask = arguments.get("attention_mask")
    if mask is None and not isinstance(query_rows, int):
        last = [num_tokens - 1]
    elif mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == num_tokens):
        # The rows the layout will choose, by the function that chooses them (its refusals included).
        last = chosen_rows("last" if query_rows is None else query_rows, num_tokens, mask,
                           inputs[0].shape[0], inputs[0].device)[:, 0].tolist()
    else:
        return None
    positions = tuple(sorted(set(last)))
    if positions == (num_tokens - 1,):
        return KeptLogitPositions(1, positions)
    # On the CPU: an index every device accepts (the final norm may sit on another device than the inputs).
    return KeptLogitPositions(torch.tensor(positions), positions)
