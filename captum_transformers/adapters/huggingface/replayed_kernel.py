"""The HuggingFace kernel's replay branch, and the masks SDPA applies made explicit.

Inside ``attribute`` of a forward-only method (AttentionRollout, RawAttention) the spec carries
a :class:`~captum_transformers.capture.replayed_rows.ReplayedRows` (``spec.replay``). Where it
applies (:func:`replay_of`), :func:`replayed_attention` keeps what recomputing the call's map
needs (O(B H N d)) and computes the output a chunk of query rows at a time: no (B, H, N, N)
map, no fused (B, N, N) map, and, for SDPA's causal sequences, no (Q, K) causal mask either
(:func:`sdpa_mask_for`: the mask is made per chunk). The method replays the calls afterwards.

Example (what :mod:`.hf_kernel` does)::

    >>> replay = replay_of(active, module, kwargs, rules, dropout, query, key)
    >>> if replay is not None:
    ...     output, probs = replayed_attention(replay, len(active[0].sites), scores, q, k, v, extras,
    ...                                        softmax_dtype, kwargs)   # probs: a zero-stride stand-in
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ...capture.replayed_rows import ReplayedCall, ReplayedRows, chunked_output, dense_maps_bytes
from .kernel_rows import causal_mask
from .weights_readers import weights_reader

#: The keyword :func:`sdpa_mask_for` passes on to the kernel for a causal sequence given no mask.
CAUSAL_ROWS = "captum_causal_rows"


def replay_of(active, module: nn.Module, kwargs: Dict[str, Any], rules, dropout: float,
              query: torch.Tensor, key: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> Optional[ReplayedRows]:
    """The active spec's replay where this call is replayed, else None: no rules (forward-only),
    no training-mode dropout between the map and the product, and the replay accepted (decided at
    the first call, before any map is dropped: one token sequence, nothing that may read the
    weights of any block, see :func:`.weights_readers.weights_reader`, and dense maps of this
    call's ``query`` (B, H, Q, d) and ``key`` (B, h, K, d) over every block above the budget,
    :func:`~captum_transformers.capture.replayed_rows.dense_maps_bytes`).

    A call with attention ``sinks`` is not replayed (its map is recorded as on the dense path, which
    the replay reads per call): the replay's chunks take a plain softmax
    (:func:`~captum_transformers.capture.replayed_rows.call_chunks`), not the sink's."""
    if sinks is not None:
        return None
    replay = None if active is None else getattr(active[0].spec, "replay", None)
    if replay is None or replay.replayed is False or rules is not None or torch.is_grad_enabled() \
            or (dropout and module.training):
        return None
    if replay.replayed is None and getattr(active[0].spec.forward_reduce, "head_fusion", None) is None:
        # A subclass's own forward reduction: the replay recomputes head fusions only.
        replay.decline("the spec's forward_reduce is not a head fusion (functional.head_fusion_of)")
    if replay.replayed is None:
        blocks = list(active[1].values())
        readers = [weights_reader(b.module, kwargs) for b in blocks] + [weights_reader(module, kwargs)]
        batch, heads, queries, _ = query.shape
        dense = dense_maps_bytes(len(blocks), batch, heads, queries, key.shape[-2], query.element_size())
        replay.accepts(blocks, next((reader for reader in readers if reader), ""), dense)
    return replay if replay.replayed else None


def replayed_attention(replay: ReplayedRows, call_index: int, scores_fn, query: torch.Tensor,
                       key_states: torch.Tensor, value_states: torch.Tensor, extras: Tuple[torch.Tensor, ...],
                       softmax_dtype: torch.dtype, kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(O, stand-in)``: the output of ``softmax(scores_fn(Q, K, *extras)) V`` a chunk of rows at a
    time, the call kept for the replay, and a zero-stride (B, H, Q, K) stand-in for the map."""
    call = ReplayedCall(scores_fn, query, key_states, tuple(extras), softmax_dtype, bool(kwargs.get(CAUSAL_ROWS)))
    output = chunked_output(call, value_states)
    replay.keep(call_index, call)
    shape = (query.shape[0], query.shape[1], query.shape[2], key_states.shape[2])
    return output, query.new_zeros(()).expand(shape)


def sdpa_mask_for(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  is_causal: Optional[bool], replay: Optional[ReplayedRows]) -> Tuple[Optional[torch.Tensor], dict]:
    """``(mask, keywords)`` for the explicit kernel: :func:`explicit_sdpa_mask`, except for a
    replayed call given no mask, whose causal mask (if any) the chunks make:
    ``(None, {CAUSAL_ROWS: True})``."""
    if replay is not None and attention_mask is None:
        return None, ({CAUSAL_ROWS: True} if _sdpa_is_causal(module, query, is_causal) else {})
    return explicit_sdpa_mask(module, query, key, attention_mask, is_causal), {}


def explicit_sdpa_mask(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], is_causal: Optional[bool]) -> Optional[torch.Tensor]:
    """The mask SDPA applies, made explicit for a recomputed map: the one it was given (cut to
    the keys), else its causal one (:func:`causal_mask_of_sdpa`)."""
    if attention_mask is not None:
        return attention_mask[:, :, :, : key.shape[-2]]
    return causal_mask_of_sdpa(module, query, key, is_causal)


def _sdpa_is_causal(module: nn.Module, query: torch.Tensor, is_causal: Optional[bool]) -> bool:
    """``sdpa_attention_forward``'s decision: the call's flag, else the module's (default True),
    and more than one query."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(query.shape[2] > 1 and causal)


def causal_mask_of_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        is_causal: Optional[bool]) -> Optional[torch.Tensor]:
    """The boolean mask (1, 1, Q, K) that ``sdpa_attention_forward`` applies through
    ``is_causal`` when it is given no mask (None when it applies none), upper-left aligned."""
    if not _sdpa_is_causal(module, query, is_causal):
        return None
    return causal_mask(query.shape[2], key.shape[2], query.device)  # one mask shared by the layers
