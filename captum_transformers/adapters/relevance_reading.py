"""Reading relevance out of a rule-modified backward pass: the seed on the explained scores,
the hidden states entering a layer made a leaf, and what ``Adapter.relevance`` returns."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..model_state import patching
from ..capture.trace import StreamLayouts, TokenLayout

if TYPE_CHECKING:  # pragma: no cover
    from ..propagation.rules.rule_set import RuleSet


def seeded(scores: torch.Tensor, rules: Optional["RuleSet"]) -> torch.Tensor:
    """The explained scores, rescaled so their relevance is 1 under a one-hot seed.

    Gradient x Input puts relevance ``y * dy/dy = y`` on the output; Chefer et al. seed the
    relevance with 1 instead, i.e. backpropagate ``1 / y`` (0 where ``y == 0``).
    """
    if rules is None or rules.seed != "one":
        return scores
    scale = torch.where(scores == 0, torch.zeros_like(scores), 1.0 / scores.detach())
    return scores * scale


@contextlib.contextmanager
def read_layer_input(layer: nn.Module, store: List[torch.Tensor]):
    """Replace the hidden states entering ``layer`` (first call only) by a leaf that requires
    grad, with the same values, so ``d score / d hidden`` can be read there.

    A wrapped forward, not a pre-hook: a registered hook is seen by every thread (PyTorch's
    TransformerEncoderLayer leaves its fast path when any module has one)."""

    def make(original):
        def forward(*args, **kwargs):
            if store:
                return original(*args, **kwargs)
            if args and isinstance(args[0], torch.Tensor):
                source = args[0]
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                source = kwargs["hidden_states"]
            else:
                return original(*args, **kwargs)
            leaf = source.detach().requires_grad_()
            store.append(leaf)
            # Every argument that is the same tensor (query is key is value) gets the leaf.
            args = tuple(leaf if a is source else a for a in args)
            kwargs = {k: (leaf if v is source else v) for k, v in kwargs.items()}
            return original(*args, **kwargs)
        return forward

    with patching.instance_forward(layer, make):
        yield


@dataclasses.dataclass(frozen=True)
class RelevanceResult:
    """What :meth:`Adapter.relevance` returns: token relevance (B, N) (of the first stream) or
    per-input relevance, the layout, the relevance put on the output (B,) (the logit, or 1
    under a one-hot seed), the target index, the relevance sums (B,) over every stream, the
    token relevance of every stream read, and the streams."""

    tokens: Optional[torch.Tensor]
    per_input: Optional[Tuple[torch.Tensor, ...]]
    layout: TokenLayout
    scores: torch.Tensor
    target: torch.Tensor
    total: torch.Tensor
    stream_tokens: Optional[Dict[str, torch.Tensor]] = None
    streams: Optional[StreamLayouts] = None


def input_times_gradient(leaf: torch.Tensor, grad: Optional[torch.Tensor]) -> torch.Tensor:
    """``x * dy/dx`` in at least float32 (a half-precision sum over the hidden size loses the small
    total of large terms of both signs); a leaf the score does not reach has a zero gradient."""
    dtype = torch.promote_types(leaf.dtype, torch.float32)
    g = torch.zeros((), dtype=dtype, device=leaf.device) if grad is None else grad.to(dtype)
    return leaf.detach().to(dtype) * g


def token_sums(token_states, product: torch.Tensor, mask: Optional[torch.Tensor],
               batch: Optional[int] = None) -> torch.Tensor:
    """(B, N) per-token sums of a relevance product over the hidden size, padding zeroed.

    ``token_states`` is the adapter's (grids flattened to tokens); a sequence-first product
    (N, B, ...) is transposed when ``batch`` says so."""
    if batch is not None and product.shape[0] != batch and product.shape[1] == batch:
        product = product.transpose(0, 1)  # sequence-first layers
    hidden = token_states(product)
    tokens = hidden.reshape(hidden.shape[0], hidden.shape[1], -1).sum(-1)
    if mask is not None and mask.shape == tokens.shape:
        tokens = tokens * mask.to(device=tokens.device, dtype=tokens.dtype)  # layer 0's device may differ
    return tokens

