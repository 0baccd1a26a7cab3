"""Grad-CAM on the last attention layer (the baseline of Chefer et al., CVPR 2021)."""
from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from .. import functional
from ..capture.trace import AttentionRecord, AttentionTrace, CaptureSpec
from ..errors import CaptureError, InputError
from .base import TraceAttribution, blank_map_warning, warn_if_blank
from ..engine.pass_plan import PassPlan
from ..capture.row_chains import last_map_row, row_layout
from ..capture.row_stream import RowStream

HeadWeights = Literal["row", "all"]
HEAD_WEIGHTS = ("row", "all")


def _heads_and_gradients(probs: torch.Tensor, grad: torch.Tensor, valid=None) -> torch.Tensor:
    """The last map's heads and their gradients, (B, 2, H, Q, K): the row weights need the
    key stream's layout, known when the trace is reduced."""
    dtype = torch.promote_types(probs.dtype, torch.float32)
    return torch.stack((probs.to(dtype), grad.to(dtype)), dim=1)


def _weighted_by_real_keys(probs: torch.Tensor, grad: torch.Tensor, valid=None) -> torch.Tensor:
    """``"row"`` weights over every real key of each query row (no prefix tokens), fused now."""
    if valid is None:
        columns = torch.ones(probs.shape[0], probs.shape[-2], probs.shape[-1], dtype=torch.bool, device=probs.device)
    else:
        columns = valid[:, 0].to(torch.bool).expand(probs.shape[0], probs.shape[-2], probs.shape[-1])
    return functional.gradcam_heads_by_row(probs, grad, columns)


_weighted_by_real_keys.row_separable = True  # each row weighted over its own keys: streamable
_weighted_by_real_keys.reads_masked_keys = True  # its head weights average g_A over keys where A may be 0


class AttentionGradCAM(TraceAttribution):
    r"""Gradient-weighted attention heads of the last layer.

    .. math:: w_{h} = \mathrm{mean}_{k \in P}\,\frac{\partial y_t}{\partial A^{(L)}_{h,q,k}}, \qquad
              R_q = \big(\mathbb{E}_h[w_h A^{(L)}_{h,q,:}]\big)^+

    Grad-CAM applied to the heads of the last attention map, the baseline of Chefer et al.,
    "Transformer Interpretability Beyond Attention Visualization" (CVPR 2021). Two head
    weightings, both from the authors' code:

    * ``head_weights="row"`` (default): ``w_h`` averages the gradient over the explained
      row ``q`` and its patch columns ``P`` (key tokens after the prefix tokens, padding
      excluded; every real token for text). This is their ViT baseline
      (``baselines/ViT/ViT_explanation_generator.py``, ``generate_cam_attn``), the Grad-CAM
      rows of the paper's ImageNet segmentation and perturbation tables.
    * ``head_weights="all"``: ``w_h`` averages over all real (query, key) pairs, as their BERT
      generator does (``generate_attn_gradcam``), the Grad-CAM row of their ERASER
      movie-review table.

    On windowed models (Swin) ``"row"`` weighs each query row over its window's keys (the
    padding positions of a padded grid included: the model attends to them), and ``"all"``
    over every (query, key) pair of the layer's windows.

    Class-specific through the gradient of the target score ``y_t``. With several explained
    rows, each row is weighted and rectified on its own, then the rows are mixed. With several
    streams, the last map of each (explained stream, stream) pair is used (ICCV 2021, Sec. 4);
    ``P`` then follows the key stream's layout. A map that the rectification leaves 0 everywhere
    (no positive evidence in the last layer) is returned with a warning (:data:`BLANK_MAP_WARNING`); with
    several streams, a stream blank where another is not gets its own warning, naming it.

    Example::

        >>> cam = AttentionGradCAM(vit).attribute(pixel_values, target=labels)          # ViT tables
        >>> cam = AttentionGradCAM(bert, head_weights="all").attribute(ids, target=labels)  # BERT code
    """

    uses_row_chains = True
    #: Why a map can be 0 everywhere (:func:`~captum_transformers.methods.base.blank_map_warning`).
    blank_map_reason = ("For each of its tokens the gradient-weighted heads of the last layer sum to <= 0, and "
                        "Grad-CAM keeps only the positive part (Chefer et al.'s baseline)")

    def __init__(self, model, adapter=None, head_weights: HeadWeights = "row") -> None:
        if head_weights not in HEAD_WEIGHTS:
            raise InputError(f"head_weights must be one of {HEAD_WEIGHTS}, got {head_weights!r}: 'row' weighs each head "
                             "by its gradient over the explained row (the ViT baseline), 'all' over every (query, key) "
                             "pair (the authors' BERT code).")
        super().__init__(model, adapter)
        self.head_weights = head_weights

    def capture_spec(self, keep_heads: bool = True) -> CaptureSpec:
        """``"row"`` with ``keep_heads``: the last map's heads and gradients, weighted once the
        key streams' prefix tokens are known (images); without: weighted as the gradient
        arrives, every real key a column (no prefix tokens: token inputs), one (B, Q, K) map."""
        if self.head_weights == "all":
            return CaptureSpec(backward_reduce=functional.gradcam_heads, backward_blocks="last")
        if keep_heads:
            return CaptureSpec(backward_reduce=_heads_and_gradients, backward_blocks="last")
        return CaptureSpec(backward_reduce=_weighted_by_real_keys, backward_blocks="last")

    def pass_plan(self, inputs, additional, forward_kwargs) -> PassPlan:
        # Prefix tokens come only with an image's patch grid: token inputs need no (B, 2, H, Q, K)
        # copy of the last layer (an LLM's last layer over a long prompt would make it large).
        # Windowed models (Swin) have no prefix tokens and stack each example's windows into one
        # map: each row is weighted over its own window's keys as the gradient arrives.
        tensors = [*inputs, *additional, *(forward_kwargs or {}).values()]
        image = any(isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() for t in tensors)
        keep_heads = image and self.adapter.single_token_grid
        spec = self.capture_spec(keep_heads=keep_heads)
        # In attribute(), a map weighted per row as its gradient arrives ("row" without prefix
        # columns) is folded into the explained rows a chunk of rows at a time (streaming_rows,
        # last_only): the last layer's (B, H, N, N) map and gradient are never made whole.
        self._row_stream = None
        if self.streaming_rows and self.head_weights == "row" and not keep_heads:
            self._row_stream = RowStream(last_only=True)
            spec = dataclasses.replace(spec, row_stream=self._row_stream)
        return PassPlan(spec)

    def reduce(self, trace: AttentionTrace):
        return warn_if_blank(self._reduce(trace), self)

    def _reduce(self, trace: AttentionTrace):
        if (streamed := self.streamed_result(trace)) is not None:
            return streamed
        if self.head_weights == "row":
            records = tuple(self._row_weighted(trace, r) if r.backward_value is not None else r for r in trace.records)
            trace = dataclasses.replace(trace, records=records)
        if self.is_one_sequence(trace):
            return last_map_row(row_layout(trace), [r.backward_value for r in trace.records])
        return self.last_map_rows(trace, backward=True)

    @staticmethod
    def _row_weighted(trace: AttentionTrace, record: AttentionRecord) -> AttentionRecord:
        layout = trace.streams.layouts.get(record.streams[1])
        if record.backward_value.dim() == 3:  # weighted as the gradient arrived, with no prefix column
            if layout is not None and layout.num_prefix_tokens:
                raise CaptureError(
                    f"Attention call {record.call_index} ({record.block.name}) was weighted over every real key, but "
                    f"its key stream {record.streams[1]!r} has {layout.num_prefix_tokens} prefix tokens that the "
                    "ViT baseline leaves out (no image input was seen). Use head_weights='all', or pass the image.")
            return record
        probs, grad = record.backward_value.unbind(dim=1)
        batch, keys = probs.shape[0], probs.shape[-1]
        columns = torch.ones(batch, keys, dtype=torch.bool, device=probs.device)
        if layout is not None:
            columns[:, :layout.num_prefix_tokens] = False
            if layout.token_mask is not None and layout.token_mask.shape[-1] == keys:
                columns &= layout.token_mask.to(device=columns.device, dtype=torch.bool)
        if not bool(columns.any(dim=1).all()):
            raise CaptureError(
                f"Attention call {record.call_index} ({record.block.name}) has no patch column to average its "
                f"gradient over in some example ({keys} keys, {layout.num_prefix_tokens if layout else 0} prefix "
                "tokens, padding excluded). Use head_weights='all'.")
        return dataclasses.replace(record, backward_value=functional.gradcam_heads_by_row(probs, grad, columns))


#: The warning given with a Grad-CAM map that is 0 everywhere for some explained example.
BLANK_MAP_WARNING = blank_map_warning(AttentionGradCAM)


def _warn_if_blank(scores):
    """``scores`` as they are, after Grad-CAM's blank-map warnings (:func:`warn_if_blank`)."""
    return warn_if_blank(scores, AttentionGradCAM)
