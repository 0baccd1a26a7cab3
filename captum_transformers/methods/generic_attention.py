"""Generic attention explainability, self-attention rule (Chefer et al., ICCV 2021)."""
from __future__ import annotations

from typing import Mapping

from .. import functional
from .math import relevancy_maps
from ..capture.row_chains import relevance_chain, row_layout
from ..capture.row_stream import RowStream
from ..capture.trace import TOKENS, AttentionTrace, CaptureSpec
from .base import StartLayer, TraceAttribution


class GenericAttention(TraceAttribution):
    r"""Gradient-weighted attention relevance propagated through every layer.

    .. math:: \bar A^{(l)} = \mathbb{E}_h\big[(\nabla A^{(l)} \odot A^{(l)})^+\big], \qquad
              R \leftarrow R + \bar A^{(l)} R, \quad R^{(0)} = I

    (Eq. 5-6 of Chefer, Gur & Wolf, "Generic Attention-model Explainability for
    Interpreting Bi-Modal and Encoder-Decoder Transformers", ICCV 2021), read at the row of
    the explained token: CLS for encoders, the last real token for causal decoders. The
    gradient is of the target score, so the map is class-specific. One forward and one
    backward pass per batch; heads are fused as each gradient arrives.

    Models with several token streams get every rule of the paper (Sec. 3, Eq. 1-11, see
    :mod:`captum_transformers.methods.math.relevancy_maps`): one map per pair of streams, self-attention
    updating ``R^{qt}`` (Eq. 6-7), co-attention updating ``R^{qk}`` and ``R^{qq}`` with the row
    normalisation of Eq. 8-9 (Eq. 10-11), and encoder-decoder models keeping no ``R^{ed}``. A
    stream's scores are the explained rows of ``R^{qt}`` for each explained stream ``q``
    (Sec. 3.1): LXMERT's text CLS row of ``R^{tt}`` and ``R^{ti}``, a DETR query's row of
    ``R^{de}``, both towers of a CLIP similarity. Inputs get their stream's scores (a tuple
    of inputs gets a tuple of maps), ``return_tokens=True`` a tuple of per-stream scores.

    Example::

        >>> explainer = GenericAttention(model)
        >>> maps = explainer.attribute(pixel_values, target=labels)        # (B, 3, H, W)
        >>> scores = explainer.attribute(input_ids, additional_forward_args=(mask,), return_tokens=True)

    Args:
        model: a supported transformer.
        adapter: an adapter instance or registered name, to override the lookup.
        start_layer: first attention layer (in call order) whose update is applied. With
            several streams it counts the attention calls of each query stream (a decoder
            layer with cross-attention makes two); ``{"image": 11}`` sets it per stream
            (e.g. only CLIP's image tower, as the ICCV code did for ViT-B/16).
    """

    uses_row_chains = True
    chains_every_layer = True

    def __init__(self, model, adapter=None, start_layer: StartLayer = 0) -> None:
        super().__init__(model, adapter)
        self.start_layer = start_layer

    def capture_spec(self) -> CaptureSpec:
        # In attribute(), one-sequence maps are folded into the explained rows as the backward pass
        # reaches them (streaming_rows: no per-layer map kept); other layouts decline and keep them.
        self._row_stream = None
        if self.streaming_rows and isinstance(self.start_layer, (int, Mapping)):
            start = self.start_layer.get(TOKENS, 0) if isinstance(self.start_layer, Mapping) else self.start_layer
            self._row_stream = RowStream(start)
        return CaptureSpec(backward_reduce=functional.gradient_weighted_heads, row_stream=self._row_stream)

    def reduce(self, trace: AttentionTrace):
        self.layers_from(trace, self.start_layer)
        if (streamed := self.streamed_result(trace)) is not None:
            return streamed
        if self.is_one_sequence(trace):
            return relevance_chain(row_layout(trace), self.values_from(trace, self.start_layer, backward=True))
        records = self.records_from(trace, self.start_layer)
        steps = [(r.streams, self.without_padding(trace, r, r.backward_value)) for r in records]
        maps = relevancy_maps.accumulate(steps, self.stream_sizes(trace), groups=[r.group for r in records])
        return relevancy_maps.explained_rows(maps, self.explained_stream_rows(trace, steps[0][1].dtype))
