r"""Explained rows carried through a one-sequence model's attention calls, written once.

Every one-sequence attention method reads one row of a product of per-call maps, so it only
ever multiplies a row vector from the left, from the last call to the first (the order the
backward pass reaches the calls). What a row *is* depends on the layout; what a method does
with it does not. A :class:`RowLayout` gives the few operations a method needs:

* :meth:`~RowLayout.start`: the explained row(s) (B, N) on the last call's tokens;
* :meth:`~RowLayout.carry`: ``r A_l`` through call ``l``'s map;
* :meth:`~RowLayout.key_sums`: the row sums of ``A_l`` over real keys (for ``rownorm(I + A)``);
* :meth:`~RowLayout.to_previous`: a row on call ``l``'s tokens moved onto call ``l - 1``'s;
* :meth:`~RowLayout.real_map` and :meth:`~RowLayout.without_lowest`: a map with padding
  zeroed, and with its lowest entries discarded (rollout's ``discard_ratio``).

:class:`DenseRows` is a plain token sequence (whole ``(B, N, N)`` maps, per-graph maps of a
PyG batch included); :class:`WindowedRows` a windowed model (Swin, ``docs/windowed-attention.md``):
stacked window maps ``(B, nW * q, q)``, carried per window, and patch mergings between calls.
:func:`row_layout` is the only place that looks at the layout's type. The chains below
(:func:`relevance_chain`, :func:`rollout_chain`, :func:`last_map_row`) are the methods'
one-sequence math; "which calls" (the last, or from ``start_layer``) stays in the method,
which passes ``None`` for the calls it leaves out.

Example::

    >>> rows = row_layout(trace)
    >>> scores = relevance_chain(rows, [r.backward_value for r in trace.records])   # (B, N_0)
"""
from __future__ import annotations

import abc
from typing import Optional, Sequence, Tuple, Union

import torch

from .trace import AttentionRecord, AttentionTrace, TokenLayout
from .windows import WindowedLayout, WindowGeometry, merge_parents
from ..errors import CaptureError, InputError
from .. import functional

Values = Sequence[Optional[torch.Tensor]]
Ratio = Union[float, Sequence[float], torch.Tensor]


class RowLayout(abc.ABC):
    """The operations on explained rows of one token sequence; ``index`` is a call's position
    in the trace's records (call order), ``value`` that call's head-fused map."""

    @abc.abstractmethod
    def start(self, like: torch.Tensor) -> torch.Tensor:
        """The explained row(s) (B, N) on the last call's tokens, in the dtype of ``like`` (a
        map) promoted to at least float32."""

    @abc.abstractmethod
    def carry(self, row: torch.Tensor, index: int, value: torch.Tensor) -> torch.Tensor:
        """``row @ A`` for call ``index``'s map ``A``: (B, N) -> (B, N)."""

    @abc.abstractmethod
    def key_sums(self, index: int, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, N) the sum of each token's row of ``A`` over real keys."""

    def to_previous(self, row: torch.Tensor, index: int) -> torch.Tensor:
        """A row on call ``index``'s tokens onto call ``index - 1``'s (or the input's, at 0)."""
        return row

    def real_map(self, index: int, value: torch.Tensor) -> torch.Tensor:
        """The map with padded queries and keys zeroed."""
        return value

    @abc.abstractmethod
    def without_lowest(self, index: int, value: torch.Tensor, ratio: Ratio) -> torch.Tensor:
        """The map with the lowest ``ratio`` of its off-diagonal entries between real tokens
        zeroed (:func:`~captum_transformers.functional.discard_lowest`)."""

    def refuse_whole_map_method(self, name: str) -> None:
        """Raise :class:`InputError` where the records hold no whole token-to-token maps, for a
        method (``name``) that reads them directly instead of through these operations."""


class DenseRows(RowLayout):
    """A token sequence whose calls hold whole maps (B, N, N): rows are carried by ``bmm`` and
    start at the layout's explained rows (:func:`functional.query_vectors`)."""

    def __init__(self, layout: TokenLayout) -> None:
        self.layout = layout
        self._valid: Optional[torch.Tensor] = None

    def start(self, like: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        dtype = torch.promote_types(like.dtype, torch.float32)
        return functional.query_vectors(layout.query_rows, layout.num_tokens, dtype, layout.query_weights)

    def carry(self, row: torch.Tensor, index: int, value: torch.Tensor) -> torch.Tensor:
        return torch.bmm(row.unsqueeze(1), value.to(row.dtype)).squeeze(1)

    def key_sums(self, index: int, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return value.to(dtype).sum(dim=-1)  # padded keys hold no attention

    def real_map(self, index: int, value: torch.Tensor) -> torch.Tensor:
        mask = self.layout.token_mask
        return zero_padding(value, ((mask, "the layout's padding mask"),) * 2, f"Attention call {index}")

    def without_lowest(self, index: int, value: torch.Tensor, ratio: Ratio) -> torch.Tensor:
        if self._valid is None and self.layout.token_mask is not None:  # the same real pairs for every call
            mask = self.layout.token_mask.to(device=value.device, dtype=torch.bool)
            self._valid = mask[:, :, None] & mask[:, None, :]
        return functional.discard_lowest(value, ratio, self._valid)


class WindowedRows(RowLayout):
    """A windowed model (Swin): call ``l`` holds each example's windows stacked, (B, nW * q, q),
    over the grid of ``layout.windows[l]``. Rows start as the mean over the last call's grid
    (the head mean-pools it), are carried per window (O(B nW q^2), never O(B N^2)) and, at a
    2x2 patch merging, split equally over each merged token's real children, so rows summing
    to one keep summing to one."""

    def __init__(self, layout: WindowedLayout) -> None:
        self.geometries = layout.windows

    def start(self, like: torch.Tensor) -> torch.Tensor:
        tokens = self.geometries[-1].num_tokens
        dtype = torch.promote_types(like.dtype, torch.float32)
        return torch.full((like.shape[0], tokens), 1.0 / tokens, dtype=dtype, device=like.device)

    def carry(self, row: torch.Tensor, index: int, value: torch.Tensor) -> torch.Tensor:
        return carry_through_windows(row, value, self.geometries[index])

    def key_sums(self, index: int, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return real_key_sums(value, self.geometries[index], dtype)

    def to_previous(self, row: torch.Tensor, index: int) -> torch.Tensor:
        if index > 0 and self.geometries[index - 1].grid != self.geometries[index].grid:
            return to_finer_grid(row, self.geometries[index - 1].grid)
        return row

    def without_lowest(self, index: int, value: torch.Tensor, ratio: Ratio) -> torch.Tensor:
        if bool((torch.as_tensor(ratio) != 0).any()):
            raise InputError(
                f"discard_ratio={ratio} (AttentionRollout) is not defined on windowed attention (which entries "
                "compete is not defined across windows); use discard_ratio=0 for Swin models.")
        return value

    def refuse_whole_map_method(self, name: str) -> None:
        raise InputError(
            f"{name} has no definition on windowed attention (Swin); the supported attention methods are "
            "RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention, TransformerRelevance and PartialLRP.")


def row_layout(trace: AttentionTrace) -> RowLayout:
    """The :class:`RowLayout` of a one-sequence trace, chosen by its layout object."""
    if isinstance(trace.layout, WindowedLayout):
        return WindowedRows(trace.layout)
    return DenseRows(trace.layout)


# == the chains: each method's one-sequence math, written once ====================================
def _carried(rows: RowLayout, values: Values, step, start: Optional[torch.Tensor]) -> torch.Tensor:
    """``row <- step(row, index, value)`` from the last call to the first, skipping ``None``
    values, the row moved onto the previous call's tokens after each call. Returns (B, N_0)."""
    present = [v for v in values if v is not None]
    if not present:
        raise InputError("No attention call is left to explain (every call's map is missing); lower start_layer.")
    row = rows.start(present[-1]) if start is None else start.to(torch.promote_types(present[-1].dtype,
                                                                                      torch.float32))
    for index in reversed(range(len(values))):
        if values[index] is not None:  # a model spread over devices: reduced on the explained rows' device
            row = step(row, index, values[index].to(row.device))
        row = rows.to_previous(row, index)
    return row


def relevance_chain(rows: RowLayout, values: Values, start: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""Rows of ``R = (I + Abar_L) ... (I + Abar_1)`` (Chefer et al., ICCV 2021, Eq. 6:
    ``R <- R + Abar R`` from ``R = I``), computed right to left as ``r <- r + r Abar_l``.

    ``values``: each call's ``Abar`` in call order, ``None`` for calls left out; ``start``
    defaults to ``rows.start``. Example: with one call ``Abar = [[0, 1], [0, 0]]`` and
    ``r = [1, 0]``, the row is ``[1, 1]``.
    """
    return _carried(rows, values, lambda row, index, value: row + rows.carry(row, index, value), start)


def rollout_chain(rows: RowLayout, values: Values, discard_ratio: Ratio = 0.0,
                  start: Optional[torch.Tensor] = None) -> torch.Tensor:
    r"""Rows of the rollout ``Ahat_L ... Ahat_1`` with ``Ahat = rownorm(I + A)`` (Abnar &
    Zuidema, 2020), from the maps ``A`` themselves: with ``s = rowsum(A) + 1`` over real keys,

    .. math:: r \hat A = (r / s) A + r / s,

    so no ``I + A`` is made. ``discard_ratio`` first zeroes each map's lowest entries
    (:meth:`RowLayout.without_lowest`; refused on windowed layouts unless 0). Example: with
    ``A = [[0, 1], [0, 0]]`` and ``r = [1, 0]``, ``s = [2, 1]`` and the row is ``[.5, .5]``.
    """
    def step(row, index, value):
        value = rows.without_lowest(index, value, discard_ratio)
        scaled = row / (rows.key_sums(index, value, row.dtype) + 1)
        return rows.carry(scaled, index, value).add_(scaled)

    return _carried(rows, values, step, start)


def last_map_row(rows: RowLayout, values: Values, start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The explained row of the last call's map (padding zeroed), carried onto the input's
    tokens: raw attention, Grad-CAM and partial LRP. Calls before the last are ignored.
    Example: with ``A = [[.25, .75], [.5, .5]]`` and ``r = [1, 0]``, the row is ``[.25, .75]``."""
    last = max((i for i, v in enumerate(values) if v is not None), default=None)
    kept = [v if i == last else None for i, v in enumerate(values)]
    return _carried(rows, kept, lambda row, index, value: rows.carry(row, index, rows.real_map(index, value)), start)


# == windowed operations ==========================================================================
def _padded_index(geometry: WindowGeometry, device: torch.device) -> torch.Tensor:
    """Token index per window position with padding sent to an extra slot ``N``."""
    index = geometry.token_index(device)
    return torch.where(index < 0, geometry.num_tokens, index)


def carry_through_windows(row: torch.Tensor, layer_map: torch.Tensor, geometry: WindowGeometry) -> torch.Tensor:
    """``row @ A`` for a row (B, N) over the grid and one call's stacked window maps
    (B, nW * q, q): padded queries carry nothing, padded keys are dropped."""
    batch, tokens = row.shape
    windows, area = geometry.num_windows, geometry.window_area
    index = _padded_index(geometry, row.device)
    gathered = torch.nn.functional.pad(row, (0, 1))[:, index].reshape(batch, windows, 1, area)
    products = torch.matmul(gathered, layer_map.to(row.dtype).reshape(batch, windows, area, area))
    out = row.new_zeros(batch, tokens + 1).index_add_(1, index, products.reshape(batch, windows * area))
    return out[:, :tokens]


def real_key_sums(layer_map: torch.Tensor, geometry: WindowGeometry, dtype: torch.dtype) -> torch.Tensor:
    """Per grid token (B, N), the sum of its attention row over real (non-padding) keys."""
    batch = layer_map.shape[0]
    windows, area = geometry.num_windows, geometry.window_area
    index = _padded_index(geometry, layer_map.device)
    real_keys = (index < geometry.num_tokens).to(dtype).reshape(1, windows, 1, area)
    sums = (layer_map.to(dtype).reshape(batch, windows, area, area) * real_keys).sum(-1).reshape(batch, -1)
    out = sums.new_zeros(batch, geometry.num_tokens + 1).index_add_(1, index, sums)
    return out[:, :geometry.num_tokens]


def to_finer_grid(row: torch.Tensor, fine: Sequence[int]) -> torch.Tensor:
    """A row over a merged grid (B, N_coarse) onto the grid before the 2x2 merging (B, N_fine):
    each merged token's value split equally over its real children."""
    parents, counts = merge_parents(tuple(fine), row.device)
    return row[:, parents] / counts[parents].to(row.dtype)


# == dense padding ================================================================================
def zero_padding(value: torch.Tensor, masks: Sequence[Tuple[Optional[torch.Tensor], str]], call: str) -> torch.Tensor:
    """A (B, Q, K) map with padded queries, then padded keys, zeroed: ``masks`` holds the
    (mask (B, Q) or (B, K), False at padding, or None; its name for the error) of each axis."""
    for axis, (mask, name) in zip((1, 2), masks):
        if mask is None:
            continue
        if mask.shape[-1] != value.shape[axis]:
            raise CaptureError(
                f"{call} has {value.shape[axis]} {'queries' if axis == 1 else 'keys'} but {name} covers "
                f"{mask.shape[-1]} tokens; the adapter's layout does not describe this call."
            )
        mask = mask.to(device=value.device, dtype=value.dtype)  # the layer's device (a spread model)
        value = value * (mask[:, :, None] if axis == 1 else mask[:, None, :])
    return value


def record_without_padding(trace: AttentionTrace, record: AttentionRecord, value: torch.Tensor) -> torch.Tensor:
    """A call's fused (B, Q, K) map with padded queries and keys zeroed, from the masks of its
    (query, key) streams' layouts (a stream without a layout or mask has no padding)."""
    layouts = trace.streams.layouts
    masks = [(layouts[name].token_mask if name in layouts else None, f"the {name!r} stream's padding mask")
             for name in record.streams]
    return zero_padding(value, masks, f"Attention call {record.call_index} ({record.block.name})")
