"""Attention rollout (Abnar & Zuidema, 2020)."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence, Union

import torch

from .. import functional
from .math import relevancy_maps
from ..capture.replayed_rows import replay_for
from ..capture.row_chains import rollout_chain, row_layout
from ..capture.trace import TOKENS, AttentionTrace, CaptureSpec
from .base import StartLayer, TraceAttribution


class AttentionRollout(TraceAttribution):
    r"""Attention rollout: attention propagated through the residual stream.

    .. math:: \hat A^{(l)} = \mathrm{rownorm}(I + \mathrm{fuse}_h(A^{(l)})), \qquad
              R = \hat A^{(L)} \cdots \hat A^{(s)}

    read at the explained token's row (Abnar & Zuidema, "Quantifying Attention Flow in
    Transformers", ACL 2020). Before adding the identity, ``discard_ratio`` zeroes the lowest
    fraction of each example's off-diagonal attention between real tokens (a float, or one
    value per example; padding neither counts nor competes).
    Class-agnostic; one forward pass, no backward.

    Several streams (the baseline of Chefer et al., ICCV 2021, Sec. 4): each stream's
    self-attention is rolled out on its own (``R^{ss}``, full matrices), and the relevance of
    key stream ``k`` for explained stream ``q`` is Eq. 12, ``R^{qk} = (R^{qq})^T Abar R^{kk}``
    with ``Abar`` the last head-fused ``q``-over-``k`` map.

    Example::

        >>> rollout = AttentionRollout(vit, head_fusion="max", discard_ratio=0.9)
        >>> maps = rollout.attribute(pixel_values)      # (B, 3, H, W)

    Args:
        model: a supported transformer.
        adapter: an adapter instance or registered name, to override the lookup.
        head_fusion: ``"mean"`` (default), ``"max"`` or ``"min"``.
        discard_ratio: fraction in [0, 1) of lowest attention values dropped per layer.
        start_layer: first attention layer (in call order) included in the product; per query
            stream with several streams, or ``{stream: int}`` (see GenericAttention).
    """

    uses_row_chains = True
    class_specific = False  # no gradient: target does not change the map
    chains_every_layer = True

    def __init__(self, model, adapter=None, head_fusion: functional.HeadFusion = "mean",
                 discard_ratio: Union[float, Sequence[float], torch.Tensor] = 0.0, start_layer: StartLayer = 0) -> None:
        super().__init__(model, adapter)
        functional.fuse_heads(torch.zeros(1, 1, 1, 1), head_fusion)
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio
        self.start_layer = start_layer

    def capture_spec(self) -> CaptureSpec:
        # In attribute(), a one-sequence model's maps are recomputed after the forward pass, a chunk of
        # rows at a time, last call first (replayed_rows: no per-layer map kept); trace() keeps them.
        self._row_stream = replay_for(self, self.discard_ratio)
        return CaptureSpec(forward_reduce=functional.head_fusion_of(self.head_fusion),
                           replay=self._row_stream)

    def _corrected(self, layer_map: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        return functional.add_identity_and_normalize(functional.discard_lowest(layer_map, self.discard_ratio, valid))

    @staticmethod
    def _valid_pairs(trace: AttentionTrace, record, device: torch.device) -> Optional[torch.Tensor]:
        """(B, Q, K) real (query, key) pairs of a self-attention call, from its stream's mask."""
        layout = trace.streams.layouts.get(record.streams[0])
        if layout is None or layout.token_mask is None:
            return None
        mask = layout.token_mask.to(device=device, dtype=torch.bool)
        return mask[:, :, None] & mask[:, None, :]

    def reduce(self, trace: AttentionTrace):
        self.layers_from(trace, self.start_layer)
        replay = getattr(self, "_row_stream", None)
        if replay is not None and replay.used(trace):
            start = self.start_layer.get(TOKENS, 0) if isinstance(self.start_layer, Mapping) else self.start_layer
            return replay.rollout(trace, start, self.head_fusion)
        if self.is_one_sequence(trace):
            values = self.values_from(trace, self.start_layer, backward=False)
            return rollout_chain(row_layout(trace), values, self.discard_ratio)
        sizes = self.stream_sizes(trace)
        records = self.records_from(trace, self.start_layer)
        dtype = torch.promote_types(records[0].forward_value.dtype, torch.float32)
        batch, device = records[0].forward_value.shape[0], records[0].forward_value.device
        maps = relevancy_maps.identity_maps(sizes, batch, dtype, device)
        last_cross = {}
        for record in records:
            # A model spread over devices: every map is reduced on the first map's device.
            layer_map = self.without_padding(trace, record, record.forward_value.to(device=device, dtype=dtype))
            if record.is_self:
                corrected = self._corrected(layer_map, self._valid_pairs(trace, record, device))
                maps[record.streams] = torch.bmm(corrected, maps[record.streams])
            else:
                last_cross[record.streams] = layer_map
        for (query, key), layer_map in last_cross.items():
            maps[(query, key)] = relevancy_maps.cross_rollout(maps[(query, query)], layer_map, maps[(key, key)])
        return relevancy_maps.explained_rows(maps, self.explained_stream_rows(trace, dtype))
