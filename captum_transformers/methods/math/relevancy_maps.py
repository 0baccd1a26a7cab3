"""Relevancy maps between token streams: the update rules of Chefer, Gur & Wolf (ICCV 2021).

Pure tensor math. A model's attention calls each mix a *query stream* ``q`` with a *key
stream* ``k`` (self-attention: ``q == k``; LXMERT's co-attention: text over image and image
over text; a decoder's cross-attention: decoder over encoder). One relevancy map
``R^{st}`` (B, N_s, N_t) is kept per ordered pair of streams and updated call by call, in
forward order, with the head-fused map ``Abar`` (B, N_q, N_k) of each call:

* Eq. 1-2, before any attention: ``R^{ss} = I`` and ``R^{st} = 0`` for ``s != t``.
* Eq. 6-7, self-attention in ``q``: ``R^{qt} <- R^{qt} + Abar R^{qt}`` for every stream ``t``.
* Eq. 8-11, ``q`` attending to ``k != q``:
  ``R^{qk} <- R^{qk} + (Rbar^{qq})^T Abar Rbar^{kk}`` and ``R^{qq} <- R^{qq} + Abar R^{kq}``, where
  ``Rbar^{ss} = (R^{ss} - I) / rowsum(R^{ss} - I) + I`` (Eq. 8-9). Both additions are computed
  from the maps before the call.

Encoder-decoder models are the case where no call has the encoder as query stream, so
``R^{ed}`` stays 0 and Eq. 11 adds nothing, exactly the paper's "no R^{ed}".

Calls that read the same inputs (LXMERT's text-over-image and image-over-text attention of
one cross layer) form a *group*: every addition of the group is computed from the maps
before it, then all are added, as the layer computes both directions from its inputs.

Example::

    >>> steps = [(("text", "text"), a_tt), (("text", "image"), a_ti)]
    >>> maps = accumulate(steps, {"text": 5, "image": 3})
    >>> maps[("text", "image")].shape                       # (B, 5, 3)
"""
from __future__ import annotations

import itertools
from typing import Dict, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

Pair = Tuple[str, str]


def identity_maps(sizes: Mapping[str, int], batch: int, dtype: torch.dtype,
                  device: torch.device) -> Dict[Pair, torch.Tensor]:
    """Eq. 1: ``R^{ss} = I`` (B, N_s, N_s) for every stream ``s``."""
    return {(s, s): torch.eye(n, dtype=dtype, device=device).expand(batch, n, n).clone() for s, n in sizes.items()}


def initial_maps(sizes: Mapping[str, int], batch: int, dtype: torch.dtype, device: torch.device) -> Dict[Pair, torch.Tensor]:
    """Eq. 1-2: identity for every stream with itself, zeros between different streams."""
    maps = identity_maps(sizes, batch, dtype, device)
    for s, n_s in sizes.items():
        for t, n_t in sizes.items():
            if s != t:
                maps[(s, t)] = torch.zeros(batch, n_s, n_t, dtype=dtype, device=device)
    return maps


def normalized_self_relevance(self_map: torch.Tensor) -> torch.Tensor:
    """Eq. 8-9: ``Rbar = Rhat / rowsum(Rhat) + I`` with ``Rhat = R - I``.

    A row of ``Rhat`` that sums to 0 (a stream no self-attention has touched yet, or a token
    whose gradients all vanished) has nothing to normalise and stays 0 instead of 0/0.
    """
    eye = torch.eye(self_map.shape[-1], dtype=self_map.dtype, device=self_map.device)
    aggregated = self_map - eye
    sums = aggregated.sum(dim=-1, keepdim=True)
    safe = torch.where(sums == 0, torch.ones_like(sums), sums)
    return torch.where(sums == 0, torch.zeros_like(aggregated), aggregated / safe) + eye


def self_attention_additions(maps: Mapping[Pair, torch.Tensor], stream: str,
                             abar: torch.Tensor) -> Dict[Pair, torch.Tensor]:
    """Eq. 6-7: ``R^{qt} += Abar R^{qt}`` for every stream ``t`` (``q = stream``): the additions."""
    return {(s, t): torch.bmm(abar, current) for (s, t), current in maps.items() if s == stream}


def cross_attention_additions(maps: Mapping[Pair, torch.Tensor], query: str, key: str,
                              abar: torch.Tensor) -> Dict[Pair, torch.Tensor]:
    """Eq. 10-11 for ``query`` tokens attending to ``key`` tokens: the additions to
    ``R^{qk}`` (``(Rbar^{qq})^T Abar Rbar^{kk}``) and to ``R^{qq}`` (``Abar R^{kq}``)."""
    query_self = normalized_self_relevance(maps[(query, query)])
    key_self = normalized_self_relevance(maps[(key, key)])
    return {
        (query, key): torch.bmm(torch.bmm(query_self.transpose(1, 2), abar), key_self),
        (query, query): torch.bmm(abar, maps[(key, query)]),
    }


def accumulate(steps: Iterable[Tuple[Pair, torch.Tensor]], sizes: Mapping[str, int],
               dtype: Optional[torch.dtype] = None,
               groups: Optional[Sequence[Optional[Hashable]]] = None) -> Dict[Pair, torch.Tensor]:
    """Every relevancy map after applying ``steps`` ((query, key) stream pair, ``Abar``) in order.

    ``groups`` (one per step, None: alone): consecutive steps with the same group are applied
    together, each addition computed from the maps before the group.
    """
    steps = list(steps)
    if not steps:
        raise ValueError("accumulate needs at least one attention call.")
    groups = list(groups) if groups is not None else [None] * len(steps)
    if len(groups) != len(steps):
        raise ValueError(f"accumulate got {len(steps)} steps but {len(groups)} groups.")
    first = steps[0][1]
    dtype = dtype or torch.promote_types(first.dtype, torch.float32)
    maps = initial_maps(sizes, first.shape[0], dtype, first.device)
    for batch in _consecutive_groups(steps, groups):
        additions: List[Dict[Pair, torch.Tensor]] = []
        for (query, key), abar in batch:
            abar = abar.to(dtype)
            if query == key:
                additions.append(self_attention_additions(maps, query, abar))
            else:
                additions.append(cross_attention_additions(maps, query, key, abar))
        for addition in additions:
            for pair, value in addition.items():
                maps[pair] = maps[pair] + value
    return maps


def _consecutive_groups(steps: list, groups: list) -> Iterable[list]:
    """Runs of consecutive steps sharing a group that is not None; other steps alone."""
    keys = [group if group is not None else object() for group in groups]
    for _, run in itertools.groupby(zip(keys, steps), key=lambda pair: pair[0]):
        yield [step for _, step in run]


def explained_rows(maps: Mapping[Pair, torch.Tensor], rows: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Token relevance per stream: ``r^t = sum_q rows_q R^{qt}`` over the explained streams ``q``.

    ``rows`` maps each explained stream to its row vectors (B, N_q) (e.g. one-hot at CLS).
    Streams are returned in the order the maps first mention them.
    """
    out: Dict[str, torch.Tensor] = {}
    for (query, target), relevance in maps.items():
        if query not in rows:
            continue
        contribution = torch.bmm(rows[query].to(relevance.dtype).unsqueeze(1), relevance).squeeze(1)
        out[target] = out[target] + contribution if target in out else contribution
    return out


def cross_rollout(query_rollout: torch.Tensor, abar: torch.Tensor, key_rollout: torch.Tensor) -> torch.Tensor:
    """Eq. 12, the rollout baseline between streams: ``R^{qk} = (R^{qq})^T Abar R^{kk}``."""
    return torch.bmm(torch.bmm(query_rollout.transpose(1, 2), abar.to(query_rollout.dtype)), key_rollout)
