"""Immutable records of what an attention capture observed.

A method never touches a module: it receives an :class:`AttentionTrace` and reduces it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Tuple

import torch
from torch import nn

BlockKind = Literal["self", "cross"]


@dataclass(frozen=True)
class Block:
    """One attention site of a model.

    ``name`` is the dotted module path, ``kind`` says whether queries and keys come from
    the same sequence (``"self"``) or not (``"cross"``).
    """

    name: str
    module: nn.Module = field(compare=False, repr=False)
    kind: BlockKind = "self"


@dataclass(frozen=True)
class CaptureSpec:
    """What a method asks an adapter to keep from each attention call.

    ``forward_reduce(probs)`` maps the ``(B, H, Q, K)`` attention probabilities to what is
    stored at forward time (for example the head mean), so raw per-head maps need not be
    kept. ``backward_reduce(probs, grad, valid)`` fuses the heads as soon as the gradient of
    the explained score with respect to ``probs`` arrives; ``valid`` (B, 1, Q, K) is False
    where the query or the key is padding (None when nothing is padded). ``backward_blocks`` chooses which
    calls get a backward reduction: every call or only the last one.
    """

    forward_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    backward_reduce: Optional[Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None
    backward_blocks: Literal["all", "last"] = "all"
    # When True, backward_reduce is also given ``call_index=`` (the call's position in the
    # forward pass), for reductions that pair each map with data from an earlier pass.
    pass_call_index: bool = False

    @property
    def needs_gradient(self) -> bool:
        return self.backward_reduce is not None


@dataclass(frozen=True)
class AttentionRecord:
    """One attention call: the block, its position in call order, and the reductions."""

    block: Block
    call_index: int
    forward_value: Optional[torch.Tensor] = None
    backward_value: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class TokenLayout:
    """How the model's token sequence maps back onto the input.

    ``query_rows`` (B, R) holds, per example, the token positions whose relevance rows are
    averaged to explain the output (the CLS token; DeiT's CLS and distillation tokens; the
    last real token of a causal decoder; every patch token for mean-pooled models).
    ``query_weights`` (B, R), when given, weighs those rows (each example's weights sum
    to 1), e.g. a mean over a different number of real tokens per example.
    ``token_mask`` (B, N) is False at padding. ``num_prefix_tokens`` counts the non-patch
    tokens in front of an image's patch grid ``grid`` (rows, cols).
    """

    num_tokens: int
    query_rows: torch.Tensor
    token_mask: Optional[torch.Tensor] = None
    num_prefix_tokens: int = 0
    grid: Optional[Tuple[int, int]] = None
    query_weights: Optional[torch.Tensor] = None

    @property
    def is_image(self) -> bool:
        return self.grid is not None


@dataclass(frozen=True)
class AttentionTrace:
    """Everything one forward (and backward) pass observed, in call order."""

    records: Tuple[AttentionRecord, ...]
    layout: TokenLayout
    logits: torch.Tensor
    target: Optional[torch.Tensor]

    def __len__(self) -> int:
        return len(self.records)

    def forward_values(self, start: int = 0) -> list:
        return [r.forward_value for r in self.records[start:]]

    def backward_values(self, start: int = 0) -> list:
        return [r.backward_value for r in self.records[start:]]
