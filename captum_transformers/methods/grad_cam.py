"""Grad-CAM on the last attention layer (the baseline of Chefer et al., CVPR 2021)."""
from __future__ import annotations

from . import functional
from ..capture.trace import AttentionTrace, CaptureSpec
from .base import TraceAttribution


class AttentionGradCAM(TraceAttribution):
    r"""Gradient-weighted attention heads of the last layer.

    .. math:: w_h = \mathrm{mean}_{q,k}\,\frac{\partial y_t}{\partial A^{(L)}_h}, \qquad
              R = \big(\mathbb{E}_h[w_h A^{(L)}_h]\big)^+_{q,:}

    Grad-CAM applied to the heads of the last attention map, as the baseline in Chefer et
    al., "Transformer Interpretability Beyond Attention Visualization" (CVPR 2021).
    Class-specific through the gradient of the target score ``y_t``. With several streams, the
    last map of each (explained stream, stream) pair is used (ICCV 2021, Sec. 4).

    Example::

        >>> cam = AttentionGradCAM(vit).attribute(pixel_values, target=labels)
    """

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(backward_reduce=functional.gradcam_heads, backward_blocks="last")

    def reduce(self, trace: AttentionTrace):
        return self.last_map_rows(trace, backward=True)
