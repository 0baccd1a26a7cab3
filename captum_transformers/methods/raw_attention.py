"""Raw attention: the last layer's attention row of the explained token."""
from __future__ import annotations

import torch

from .. import functional
from ..capture.replayed_rows import replay_for
from ..capture.row_chains import last_map_row, row_layout
from ..capture.trace import AttentionTrace, CaptureSpec
from .base import TraceAttribution


class RawAttention(TraceAttribution):
    r"""Raw attention of the last attention layer, heads fused.

    .. math:: R = \mathrm{fuse}_h(A^{(L)})_{q,:}

    the row of the explained token ``q`` (CLS, or the last real token of a decoder) in the
    last layer's head-fused attention map. Class-agnostic: ``target`` does not change it.
    Several streams (Chefer et al., ICCV 2021, Sec. 4): each stream's scores come from the
    last map with the explained stream as queries and that stream as keys (LXMERT's image
    tokens: the last text-over-image co-attention; DETR's image: the last cross-attention).
    The baseline "raw attention" of Chefer et al. (CVPR 2021, ICCV 2021).

    Example::

        >>> attr = RawAttention(model).attribute(pixel_values)         # (B, 3, H, W)
        >>> tokens = RawAttention(model).attribute(input_ids, return_tokens=True)  # (B, S)

    Args:
        model: a supported transformer (see the README's support matrix).
        adapter: an adapter instance or registered name, to override the lookup.
        head_fusion: ``"mean"`` (default), ``"max"`` or ``"min"`` over heads.
    """

    uses_row_chains = True
    class_specific = False  # no gradient: target does not change the map

    def __init__(self, model, adapter=None, head_fusion: functional.HeadFusion = "mean") -> None:
        super().__init__(model, adapter)
        functional.fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)  # validates the option now
        self.head_fusion = head_fusion

    def capture_spec(self) -> CaptureSpec:
        # In attribute(), a one-sequence model keeps what recomputes its last call's map (replayed_rows),
        # and only that call's chunks holding explained rows are made; trace() keeps the maps.
        self._row_stream = replay_for(self, last_only=True)
        return CaptureSpec(forward_reduce=functional.head_fusion_of(self.head_fusion),
                           replay=self._row_stream)

    def reduce(self, trace: AttentionTrace):
        replay = getattr(self, "_row_stream", None)
        if replay is not None and replay.used(trace):
            return replay.last_row(trace, self.head_fusion)
        if self.is_one_sequence(trace):
            return last_map_row(row_layout(trace), [r.forward_value for r in trace.records])
        return self.last_map_rows(trace, backward=False)
