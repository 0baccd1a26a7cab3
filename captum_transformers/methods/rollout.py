"""Attention rollout (Abnar & Zuidema, 2020)."""
from __future__ import annotations

from typing import Sequence, Union

import torch

from .. import functional
from ..trace import AttentionTrace, CaptureSpec
from .base import TraceAttribution


class AttentionRollout(TraceAttribution):
    r"""Attention rollout: attention propagated through the residual stream.

    .. math:: \hat A^{(l)} = \mathrm{rownorm}(I + \mathrm{fuse}_h(A^{(l)})), \qquad
              R = \hat A^{(L)} \cdots \hat A^{(s)}

    read at the explained token's row (Abnar & Zuidema, "Quantifying Attention Flow in
    Transformers", ACL 2020). Before adding the identity, ``discard_ratio`` zeroes the lowest
    fraction of each example's off-diagonal attention (a float, or one value per example).
    Class-agnostic; one forward pass, no backward.

    Example::

        >>> rollout = AttentionRollout(vit, head_fusion="max", discard_ratio=0.9)
        >>> maps = rollout.attribute(pixel_values)      # (B, 3, H, W)

    Args:
        model: a supported transformer.
        adapter: an adapter instance or registered name, to override the lookup.
        head_fusion: ``"mean"`` (default), ``"max"`` or ``"min"``.
        discard_ratio: fraction in [0, 1) of lowest attention values dropped per layer.
        start_layer: first attention layer (in call order) included in the product.
    """

    def __init__(self, model, adapter=None, head_fusion: functional.HeadFusion = "mean",
                 discard_ratio: Union[float, Sequence[float], torch.Tensor] = 0.0, start_layer: int = 0) -> None:
        super().__init__(model, adapter)
        functional.fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio
        self.start_layer = start_layer

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(forward_reduce=lambda probs: functional.fuse_heads(probs, self.head_fusion))

    def reduce(self, trace: AttentionTrace) -> torch.Tensor:
        self.layers_from(trace, self.start_layer)
        maps = [
            functional.add_identity_and_normalize(functional.discard_lowest(m, self.discard_ratio))
            for m in trace.forward_values(self.start_layer)
        ]
        return functional.rollout_rows(maps, self.start_rows(trace, maps[-1].dtype))
