"""Generic attention explainability, self-attention rule (Chefer et al., ICCV 2021)."""
from __future__ import annotations

import torch

from .. import functional
from ..trace import AttentionTrace, CaptureSpec
from .base import TraceAttribution


class GenericAttention(TraceAttribution):
    r"""Gradient-weighted attention relevance propagated through every layer.

    .. math:: \bar A^{(l)} = \mathbb{E}_h\big[(\nabla A^{(l)} \odot A^{(l)})^+\big], \qquad
              R \leftarrow R + \bar A^{(l)} R, \quad R^{(0)} = I

    (Eq. 5-6 of Chefer, Gur & Wolf, "Generic Attention-model Explainability for
    Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021), read at the row of
    the explained token: CLS for encoders, the last real token for causal decoders. The
    gradient is of the target score, so the map is class-specific. One forward and one
    backward pass per batch; heads are fused as each gradient arrives.

    Example::

        >>> explainer = GenericAttention(model)
        >>> maps = explainer.attribute(pixel_values, target=labels)        # (B, 3, H, W)
        >>> scores = explainer.attribute(input_ids, additional_forward_args=(mask,), return_tokens=True)

    Args:
        model: a supported transformer.
        adapter: an adapter instance or registered name, to override the lookup.
        start_layer: first attention layer (in call order) whose update is applied.
    """

    def __init__(self, model, adapter=None, start_layer: int = 0) -> None:
        super().__init__(model, adapter)
        self.start_layer = start_layer

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(backward_reduce=functional.gradient_weighted_heads)

    def reduce(self, trace: AttentionTrace) -> torch.Tensor:
        self.layers_from(trace, self.start_layer)
        maps = trace.backward_values(self.start_layer)
        return functional.self_attention_relevance_rows(maps, self.start_rows(trace, maps[-1].dtype))
