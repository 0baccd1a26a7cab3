r"""Explained rows carried through the backward pass itself: no per-layer map is kept.

The ICCV'21 update ``R <- R + Abar R`` only ever needs the explained rows ``r`` of ``R``,
carried from the last attention call to the first (:func:`~.row_chains.relevance_chain`):

.. math:: r \leftarrow r + r \bar A_l = r + \sum_c r_{[:, c]} \bar A_{l, [c, :]},

and the backward pass reaches the calls in exactly that order. A :class:`RowStream` set on a
:class:`~captum_transformers.capture.trace.CaptureSpec` (``row_stream``) receives each call's
fused map as the recorder reduces it, whole or in chunks of query rows ``c`` (the kernels of
:mod:`~captum_transformers.propagation.attention.core` recompute a long sequence's map a few
rows at a time), folds it into the row and drops it. Memory: O(B N) per carried row, plus one
chunk of rows, where the dense path keeps one (B, N, N) map per call.

Two variants: ``paired=True`` (TransformerRelevance, CVPR'21) folds maps reduced from two
backward passes through one graph (the relevance pass defers, the plain-gradient pass hands
both gradients per chunk); ``last_only=True`` (AttentionGradCAM) keeps only the last call's
map, ``r <- r A_L`` with padding zeroed (:func:`~.row_chains.last_map_row`).

Where it applies is decided at the first reduction, from the recorder: one token sequence
attending to itself (no windows, no other stream), every call reduced (``backward_blocks="all"``;
the last one for ``last_only``), one backward pass (two for ``paired``). Elsewhere the stream
declines and the recorder keeps the maps as before. A call whose map arrives out of order (a model whose
backward pass does not visit its attention calls last to first) is kept whole until its turn,
so the result never depends on the order.

Example::

    >>> stream = RowStream(start_layer=0)
    >>> spec = CaptureSpec(backward_reduce=functional.gradient_weighted_heads, row_stream=stream)
    >>> # ... run_trace(adapter, model, inputs, ..., spec) (engine.runner) ...
    >>> scores = stream.result() if stream.streamed else relevance_chain(row_layout(trace), values)
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .windows import WindowedLayout
from ..errors import CaptureError
from .row_chains import DenseRows


class RowStream:
    """The explained rows ``r`` (B, N) of ``R = (I + Abar_L) ... (I + Abar_s)``, updated as the
    calls' maps arrive (``s``: ``start_layer``, calls before it are dropped unread).

    The recorder calls :meth:`accepts`, then :meth:`fold_rows` per chunk and :meth:`finish`
    per call, or :meth:`fold` with a whole map; the method reads :meth:`result`."""

    def __init__(self, start_layer: int = 0, *, paired: bool = False, last_only: bool = False) -> None:
        self.start_layer = start_layer
        self.paired, self.last_only = paired, last_only
        self._last: Optional[int] = None       # last_only: the call whose map is the result
        self.streamed: Optional[bool] = None   # None until the first reduction decides it
        self.reason = ""                       # why the stream declined, for tests and messages
        self._rows: Optional[DenseRows] = None
        self._row: Optional[torch.Tensor] = None
        self._update: Optional[torch.Tensor] = None
        self._next: Optional[int] = None       # the call whose map is folded next
        self._pending: Dict[int, torch.Tensor] = {}
        self._chunks: Dict[int, torch.Tensor] = {}  # out-of-order calls being assembled from chunks

    # -- the decision ------------------------------------------------------------------------
    def accepts(self, recorder) -> bool:
        """Whether this recorder's maps are streamed (decided once, at the first reduction)."""
        if self.streamed is None:
            self.reason = _why_not(recorder, self)
            self.streamed = not self.reason
            if self.streamed:
                self._rows = DenseRows(recorder.streams.layouts[recorder.streams.explained[0]])
                self._next = self._last = len(recorder.sites) - 1
        return self.streamed

    def fresh(self) -> "RowStream":
        """A new, empty stream with these options (one per explained group of a generation); one
        declined before its first reduction (a kernel whose weights something may read) stays so."""
        stream = RowStream(self.start_layer, paired=self.paired, last_only=self.last_only)
        if self.streamed is False:
            stream.decline(self.reason)
        return stream

    def decline(self, reason: str) -> None:
        """Keep the maps (the dense path) for ``reason``: a kernel whose weights something may read
        returns its whole map, so the stream is declined before the first reduction decides."""
        if self.streamed is None:
            self.streamed, self.reason = False, reason

    # -- folding -----------------------------------------------------------------------------
    def fold_rows(self, call_index: int, rows: slice, value: torch.Tensor) -> None:
        """Rows ``rows`` (B, c, K) of call ``call_index``'s fused map, its first K keys (the
        others are 0: after the last key a causal chunk attends to)."""
        if call_index < self.start_layer or (self.last_only and call_index != self._last):
            return
        keys = value.shape[-1]
        if call_index != self._next:
            whole = self._chunks.get(call_index)
            if whole is None:
                tokens = self._rows.layout.num_tokens
                whole = self._chunks[call_index] = value.new_zeros(value.shape[0], tokens, tokens)
            whole[:, rows, :keys] = value
            return
        row = self._current(value)
        value = value.to(row.device)  # a model spread over devices: reduced on the explained rows' device
        if self._update is None:
            self._update = torch.zeros_like(row)
        if self.last_only:  # last_map_row reads the map with padded queries and keys zeroed
            value = self._real_rows(rows, value)
        self._update[:, None, :keys].baddbmm_(row[:, None, rows], value.to(row.dtype))

    def finish(self, call_index: int) -> None:
        """Call ``call_index``'s rows have all been folded (:meth:`fold_rows`)."""
        if call_index < self.start_layer or (self.last_only and call_index != self._last):
            return
        if call_index in self._chunks:
            self._pending[call_index] = self._chunks.pop(call_index)
        elif call_index == self._next:
            if self._update is not None:
                self._row = self._update if self.last_only else self._row + self._update
            self._update = None
            self._next = self._after(call_index)
        self._fold_pending()

    def fold(self, call_index: int, value: torch.Tensor) -> None:
        """Call ``call_index``'s whole fused map (B, N, N)."""
        if call_index < self.start_layer or (self.last_only and call_index != self._last):
            return
        if call_index != self._next:
            self._pending[call_index] = value
            return
        row = self._current(value)
        value = value.to(row.device)
        if self.last_only:
            self._row = self._rows.carry(row, call_index, self._rows.real_map(call_index, value))
        else:
            self._row = row + self._rows.carry(row, call_index, value)
        self._next = self._after(call_index)
        self._fold_pending()

    def _after(self, call_index: int) -> int:
        """The call folded after ``call_index``: the previous one, or none after the last call's
        map when only that one is read (``last_only``)."""
        return self.start_layer - 1 if self.last_only else call_index - 1

    def _real_rows(self, rows: slice, value: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (B, c, K) of a map with padded queries and keys zeroed."""
        mask = self._rows.layout.token_mask
        if mask is None:
            return value
        mask = mask.to(device=value.device, dtype=value.dtype)  # the layer's device (a spread model)
        return value * mask[:, rows, None] * mask[:, None, :value.shape[-1]]

    def _fold_pending(self) -> None:
        while self._next in self._pending:
            self.fold(self._next, self._pending.pop(self._next))

    def _current(self, like: torch.Tensor) -> torch.Tensor:
        if self._row is None:
            self._row = self._rows.start(like)
        return self._row

    def served(self, trace) -> bool:
        """Whether ``trace`` is the one these rows were folded from: a streamed trace's calls keep no
        backward value, so a trace made elsewhere (``method.trace``) is never read through the rows
        left by an earlier ``attribute``."""
        return bool(self.streamed) and all(record.backward_value is None for record in trace.records)

    def result(self) -> torch.Tensor:
        """The carried rows (B, N) once every call from ``start_layer`` on was folded."""
        self._fold_pending()
        if self._next is None or self._next >= self.start_layer or self._row is None:
            missing = "no map" if self._next is None else f"the map of call {self._next}"
            raise CaptureError(
                f"The streamed relevance rows are incomplete: {missing} reached them (start_layer="
                f"{self.start_layer}). This is a bug in the capture; explain with the dense path (method.trace).")
        return self._row


def _why_not(recorder, stream: RowStream) -> str:
    """Why a recorder's maps cannot be streamed into ``stream`` ('' when they can)."""
    streams = getattr(recorder, "streams", None)
    if streams is None:
        return "the adapter gave the recorder no token layout before the backward pass"
    if not streams.is_single or any(site.streams[0] != site.streams[1] for site in recorder.sites):
        return "several token streams (the ICCV'21 rules between streams keep whole maps)"
    if isinstance(streams.layouts[streams.explained[0]], WindowedLayout):
        return "a windowed layout (Swin)"
    unknown = [spec for spec in (recorder.spec, recorder.first_spec) if spec is not None
               and not getattr(spec.backward_reduce, "row_separable", False)]
    if unknown:  # a subclass's own reduction may read across rows: chunks of rows would change it
        return f"the reduction {unknown[0].backward_reduce!r} is not marked row_separable"
    if recorder.spec.backward_blocks != ("last" if stream.last_only else "all"):
        return f"backward_blocks={recorder.spec.backward_blocks!r} (this stream folds {'the last' if stream.last_only else 'every'} call)"
    if recorder.pairs_passes and not stream.paired:
        return "two backward passes reduce each map together"
    if stream.paired and not recorder.pairs_passes:
        return "a paired stream needs the two backward passes through one graph"
    return ""


class UnreadWeights(torch.Tensor):
    """What a streamed kernel returns for its attention weights (it made no map): its shape,
    dtype and device can be read, any operation on it raises :class:`CaptureError`, so a model
    or hook that reads the weights fails loudly instead of reading zeros.

    Example::

        >>> weights = UnreadWeights.of(torch.zeros(()).expand(1, 2, 3, 3))
        >>> weights.shape            # torch.Size([1, 2, 3, 3])
        >>> weights.sum()            # raises CaptureError
    """

    _READABLE = frozenset(getattr(torch.Tensor, name).__get__ for name in
                          ("shape", "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf"))

    @classmethod
    def of(cls, stand_in: torch.Tensor) -> "UnreadWeights":
        return stand_in.as_subclass(cls)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._READABLE or func in (torch.Tensor.size, torch.Tensor.dim):
            return super().__torch_function__(func, types, args, kwargs or {})
        raise CaptureError(
            f"The attention weights returned during a streamed or replayed attribute() were read "
            f"({getattr(func, '__name__', func)}); that kernel makes no map. Pass "
            "output_attentions=True (the stream then declines and the weights are the model's), or "
            "explain with method.trace(...) (the dense path).")

    def __repr__(self) -> str:
        return f"UnreadWeights(shape={tuple(self.shape)}: a streamed kernel's stand-in, not a map)"
