r"""Forward-only methods at long contexts: each map replayed after the forward pass, a few query
rows at a time, and folded into the explained rows; no per-layer map is kept or made whole.

AttentionRollout and RawAttention read one row of a product of head-fused maps
(:func:`~.row_chains.rollout_chain`, :func:`~.row_chains.last_map_row`), applied from the last
call to the first, while the forward pass reaches the calls first to last. Keeping every call's
(B, N, N) map until the end costs O(L B N^2). Instead the kernel keeps what recomputing a map
needs (the scores function, Q, K, the mask and bias, the softmax dtype: O(B H N d) per call)
and computes its output a chunk of rows at a time (:func:`chunked_output`); after the forward
the method replays the calls from the last to the first. For a chunk ``c`` of query rows,
``A_c = fuse_h(softmax(S(Q_c, K)))`` and rollout's step (``s = rowsum(A) + 1`` over the keys,
which padding never takes part in) is

.. math:: r' = \sum_c (r_c / s_c) A_c + r / s,

so a chunk whose rows of ``r`` are all zero is skipped (its terms are exactly 0); raw attention
replays only the last call's chunks that hold explained rows, with padding zeroed as
:meth:`~.row_chains.DenseRows.real_map` does. Memory: O(B H N d) per call plus one chunk.

Where it applies is decided before any map is dropped: by the method (``discard_ratio != 0``
needs a global quantile of each whole map; a windowed layout), then at the first kernel call
from the model's blocks (one token sequence attending to itself) and from what may read the
returned weights (``output_attentions=True``, a forward hook; see
:func:`~captum_transformers.adapters.huggingface.replayed_kernel.replay_of`). Declined, the recorder keeps
the maps as before; a model whose kernel keeps no replay (timm, PyG) declines at the reduction.

Example::

    >>> stream = ReplayedRows()
    >>> spec = CaptureSpec(forward_reduce=lambda p: functional.fuse_heads(p), replay=stream)
    >>> trace = run_trace(adapter, model, inputs, (), None, spec)  # engine.runner
    >>> scores = stream.rollout(trace, 0, "mean") if stream.used() else rollout_chain(row_layout(trace), ...)
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, NamedTuple, Optional, Tuple

import torch

from .trace import AttentionTrace, Block, one_self_attending_sequence
from .windows import WindowedLayout
from ..errors import CaptureError
from .row_chunks import rows_of, rows_per_chunk, softmax_in_place
from .. import functional
from .row_chains import DenseRows, last_map_row, row_layout


class ReplayedCall(NamedTuple):
    """What recomputing one call's map needs: ``A = softmax(scores_fn(Q, K, *extras))`` in
    ``softmax_dtype``, cast to Q's dtype; ``causal``: the upper-left causal mask applied after
    the scores (SDPA's ``is_causal``), made per chunk instead of kept as a (Q, K) tensor."""

    scores_fn: Callable[..., torch.Tensor]
    query: torch.Tensor     # (B, H, Q, d)
    key: torch.Tensor       # (B, H, K, d), grouped-query heads expanded
    extras: Tuple[torch.Tensor, ...]
    softmax_dtype: torch.dtype
    causal: bool = False


def call_chunks(call: ReplayedCall, skip: Optional[Callable[[slice], bool]] = None
                ) -> Iterator[Tuple[slice, torch.Tensor]]:
    """``(rows, A_c)`` for each chunk of query rows, ``A_c`` (B, H, c, K_c) the map's rows over
    its first ``K_c`` keys: where a causal or masked chunk attends to no key from ``K_c`` on,
    those probabilities are exactly 0 and are not made. ``skip(rows)``: chunks not computed."""
    query, key = call.query, call.key
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    step = rows_per_chunk(query, key)
    keys_needed = getattr(call.scores_fn, "keys_needed", None)
    for start in range(0, num_queries, step):
        rows = slice(start, min(start + step, num_queries))
        if skip is not None and skip(rows):
            continue
        extras = [rows_of(e, rows, num_queries) for e in call.extras]
        keys = min(num_keys, rows.stop) if call.causal else num_keys if keys_needed is None else keys_needed(*extras)
        if keys < num_keys:
            extras = [e[..., :keys] if e.dim() and e.shape[-1] == num_keys else e for e in extras]
        scores = call.scores_fn(query[..., rows, :], key[..., :keys, :], *extras)
        if call.causal:  # key k is open to query q when k <= q, as SDPA's upper-left mask
            positions = torch.arange(keys, device=scores.device)
            blocked = positions[None, :] > torch.arange(rows.start, rows.stop, device=scores.device)[:, None]
            scores = scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
        yield rows, softmax_in_place(scores, call.softmax_dtype).to(query.dtype)


def chunked_output(call: ReplayedCall, value: torch.Tensor) -> torch.Tensor:
    """``O = A V`` (B, H, Q, d) a chunk of rows at a time, laid out (B, Q, H, d) underneath
    (the kernel's transpose back is free): the attention's output without its map."""
    output = None
    for rows, probs in call_chunks(call):
        part = torch.matmul(probs, value[..., :probs.shape[-1], :])
        if output is None:
            batch, heads, _, dim = part.shape
            output = part.new_empty(batch, call.query.shape[-2], heads, dim).transpose(1, 2)
        output[..., rows, :] = part
    return output


#: Replay only where it saves memory: the dense path keeps every call's head-fused (B, Q, K) map
#: (float32 at least) and makes one call's (B, H, Q, K) map at a time; where that is at most this
#: many bytes, keeping the maps is cheaper (measured: on a 6-layer ViT, 16 x 145 tokens, the
#: replay's chunked products cost 1.14-1.19x a forward, the dense path 1.01-1.06x).
DENSE_MAPS_BUDGET_BYTES = 64 * 2 ** 20


def dense_maps_bytes(calls: int, batch: int, heads: int, queries: int, keys: int, itemsize: int) -> int:
    """What the dense path holds at its peak for ``calls`` calls of (B, H, Q, K) maps."""
    return calls * batch * queries * keys * max(itemsize, 4) + batch * heads * queries * keys * itemsize


class ReplayedRows:
    """One ``attribute`` call's replay: the decision (``replayed``, ``reason``), the kept calls
    (by call index; only the last with ``last_only``), and the replayed chains."""

    def __init__(self, last_only: bool = False) -> None:
        self.last_only = last_only
        self.replayed: Optional[bool] = None   # None until the first kernel call decides it
        self.reason = ""                       # why the replay declined, for tests and messages
        self._calls: Dict[int, ReplayedCall] = {}

    def decline(self, reason: str) -> None:
        """Keep the maps (the dense path) for ``reason``; only before the first call decides."""
        if self.replayed is None:
            self.replayed, self.reason = False, reason

    def one_sequence(self, blocks: Iterable[Block]) -> bool:
        """Declines unless the model's ``blocks`` are one token sequence attending to itself;
        whether the replay may still apply (the adapter asks before the forward pass)."""
        blocks = list(blocks)
        if not one_self_attending_sequence(blocks):
            pairs = sorted({block.default_streams for block in blocks})
            self.decline(f"several token streams or cross-attention ({pairs}): maps between streams")
        return self.replayed is not False

    def accepts(self, blocks: Iterable[Block], reader: str, dense_bytes: Optional[int] = None) -> bool:
        """Decided once, at the first kernel call: the model's ``blocks`` must be one token
        sequence attending to itself, nothing (``reader``: what may) read the weights, and the
        dense maps (``dense_bytes``, :func:`dense_maps_bytes`) must exceed
        :data:`DENSE_MAPS_BUDGET_BYTES` (below it the dense path is cheaper)."""
        if self.replayed is None and self.one_sequence(blocks):
            if reader:
                self.decline(reader)
            elif dense_bytes is not None and dense_bytes <= DENSE_MAPS_BUDGET_BYTES:
                self.decline(f"the dense maps fit the budget ({dense_bytes} <= DENSE_MAPS_BUDGET_BYTES = "
                             f"{DENSE_MAPS_BUDGET_BYTES} bytes): keeping them is cheaper than replaying")
            self.replayed = self.replayed is None
        return self.replayed

    def used(self, trace: AttentionTrace) -> bool:
        """Whether ``trace``'s calls were replayed (some call kept no forward value); a model whose
        kernel kept none declines here, and a trace made elsewhere (``method.trace``) is never read
        through the replay left by an earlier ``attribute``."""
        self.decline("no attention call ran through the HuggingFace kernel (nothing to replay)")
        return bool(self.replayed) and any(record.forward_value is None for record in trace.records)

    def keep(self, call_index: int, call: ReplayedCall) -> None:
        if self.last_only:
            self._calls.clear()
        self._calls[call_index] = call

    # -- the chains --------------------------------------------------------------------------
    def rollout(self, trace: AttentionTrace, start_layer: int, fusion: functional.HeadFusion) -> torch.Tensor:
        """:func:`~.row_chains.rollout_chain` (``discard_ratio=0``) over the calls from
        ``start_layer`` on; a call recorded densely (not replayed) is read from the trace."""
        rows, like = self._dense_rows(trace)
        row = rows.start(like)
        with torch.no_grad():
            for index in reversed(range(start_layer, len(trace.records))):
                value = trace.records[index].forward_value
                if value is None:
                    row = self._rollout_step(row, self._call(index), fusion)
                else:
                    scaled = row / (rows.key_sums(index, value, row.dtype) + 1)
                    row = rows.carry(scaled, index, value).add_(scaled)
        self._calls.clear()
        return row

    @staticmethod
    def _rollout_step(row: torch.Tensor, call: ReplayedCall, fusion: functional.HeadFusion) -> torch.Tensor:
        scaled, update = torch.zeros_like(row), torch.zeros_like(row)
        for rows, probs in call_chunks(call, skip=lambda rows: not bool(row[:, rows].any())):
            # A model spread over devices: every call's rows are reduced on the explained rows' device.
            fused = functional.fuse_heads(probs, fusion).to(device=row.device, dtype=row.dtype)
            del probs
            part = row[:, rows] / (fused.sum(dim=-1) + 1)
            scaled[:, rows] = part
            update[:, :fused.shape[-1]] += torch.bmm(part[:, None], fused).squeeze(1)
        return update.add_(scaled)

    def last_row(self, trace: AttentionTrace, fusion: functional.HeadFusion) -> torch.Tensor:
        """:func:`~.row_chains.last_map_row`: the explained rows of the last call's map, padded
        queries and keys zeroed, from the chunks that hold explained rows only."""
        rows, like = self._dense_rows(trace)
        last = len(trace.records) - 1
        value = trace.records[last].forward_value
        if value is not None:
            self._calls.clear()
            return last_map_row(rows, [None] * last + [value])
        call, start = self._call(last), rows.start(like)
        out = torch.zeros_like(start)
        mask = rows.layout.token_mask
        mask = None if mask is None else mask.to(device=start.device, dtype=start.dtype)
        with torch.no_grad():
            for chunk, probs in call_chunks(call, skip=lambda chunk: not bool(start[:, chunk].any())):
                fused = functional.fuse_heads(probs, fusion).to(start.device)
                del probs
                keys = fused.shape[-1]
                if mask is not None:  # as zero_padding: queries, then keys
                    fused = fused * mask[:, chunk, None].to(fused.dtype) * mask[:, None, :keys].to(fused.dtype)
                out[:, :keys] += torch.bmm(start[:, None, chunk], fused.to(start.dtype)).squeeze(1)
        self._calls.clear()
        return out

    def _call(self, index: int) -> ReplayedCall:
        call = self._calls.pop(index, None)
        if call is None:
            raise CaptureError(
                f"Attention call {index} kept neither its map nor what replays it (calls kept: {sorted(self._calls)}). "
                "This is a bug in the capture; explain with the dense path (method.trace + method.reduce).")
        return call

    def _dense_rows(self, trace: AttentionTrace) -> Tuple[DenseRows, torch.Tensor]:
        """The trace's :class:`DenseRows`, checked against the kept calls, and a tensor whose
        dtype the rows start from (the fused maps': the model's, promoted to float32)."""
        layout = trace.streams.layouts[trace.streams.explained[0]]
        one_sequence = trace.streams.is_single and all(r.is_self for r in trace.records)
        tokens = {n for call in self._calls.values() for n in (call.query.shape[-2], call.key.shape[-2])}
        if not one_sequence or isinstance(layout, WindowedLayout) or tokens - {layout.num_tokens}:
            self._calls.clear()
            raise CaptureError(
                f"The replayed attention calls (token counts {sorted(tokens)}) do not form the trace's one token "
                f"sequence of {layout.num_tokens} tokens (streams {sorted(trace.streams.layouts)}). This is a bug in "
                "the capture; explain with the dense path (method.trace + method.reduce).")
        dtypes = [c.query.dtype for c in self._calls.values()] + [r.forward_value.dtype for r in trace.records
                                                                  if r.forward_value is not None]
        dtype = torch.promote_types(dtypes[0] if dtypes else torch.float32, torch.float32)
        return row_layout(trace), torch.empty(0, dtype=dtype)


def replay_for(method, discard_ratio=0.0, last_only: bool = False) -> Optional[ReplayedRows]:
    """The replay of ``method``'s running ``attribute`` in this thread (None in ``trace``: the
    dense path), declined up front where its layout or options need whole maps."""
    if not method.streaming_rows:
        return None
    stream = ReplayedRows(last_only)
    if bool((torch.as_tensor(discard_ratio) != 0).any()):
        stream.decline(f"discard_ratio={discard_ratio} ranks each whole map's entries (a global quantile)")
    if not getattr(method.adapter, "single_token_grid", True):  # a windowed adapter (WindowedAdapterMixin)
        stream.decline("a windowed layout (Swin)")
    return stream
