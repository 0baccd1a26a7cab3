r"""The attention methods on windowed models (Swin), without building ``N x N`` maps.

Each attention call ``l`` of a Swin layer is a token-to-token map ``A^{(l)}`` over the layer's
grid: block-diagonal over its windows once the cyclic shift is undone (a permutation of the
tokens), with padding positions left out (``docs/windowed-attention.md``). The methods only
ever multiply a row vector from the left, so the explained row is carried down instead:

* through a layer, ``r A`` is gathered per window, multiplied by each ``q x q`` window map and
  scattered back: O(B nW q^2), never O(B N^2);
* through a 2x2 patch merging, a merged token's value is split equally over its real children
  (:func:`to_finer_grid`), so rows that sum to one keep summing to one;
* the explained row is the mean over the last layer's tokens (the head averages them).

Pure tensor math over an :class:`~captum_transformers.capture.trace.AttentionTrace` whose layout
is a :class:`~captum_transformers.capture.windows.WindowedLayout`; records hold per-example
stacked windows ``(B, nW * q, q)`` (:mod:`captum_transformers.adapters.windowed`).

Example::

    >>> row = carry_through_windows(start, layer_map, geometry)   # start @ A, (B, N)
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..capture.trace import AttentionTrace
from ..capture.windows import WindowGeometry, WindowedLayout, merge_parents
from ..errors import InputError


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


def mean_of_last_tokens(layout: WindowedLayout, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The explained row (B, N_L): the mean over the last call's grid tokens."""
    tokens = layout.windows[-1].num_tokens
    return torch.full((batch, tokens), 1.0 / tokens, dtype=dtype, device=device)


def chain(trace: AttentionTrace, values: Sequence[Optional[torch.Tensor]],
          step: Callable[[torch.Tensor, torch.Tensor, WindowGeometry], torch.Tensor]) -> torch.Tensor:
    """Carry the explained row from the last call to the first grid: ``row <- step(row, map,
    geometry)`` for every call whose value is not None (latest first), and onto the finer grid
    at each patch merging. Returns (B, N_0)."""
    layout: WindowedLayout = trace.layout
    geometries = layout.windows
    present = [v for v in values if v is not None]
    dtype = torch.promote_types(present[0].dtype, torch.float32)
    row = mean_of_last_tokens(layout, present[0].shape[0], dtype, present[0].device)
    for index in reversed(range(len(geometries))):
        if values[index] is not None:
            row = step(row, values[index], geometries[index])
        if index > 0 and geometries[index - 1].grid != geometries[index].grid:
            row = to_finer_grid(row, geometries[index - 1].grid)
    return row


def _self_relevance_step(row, layer_map, geometry):
    """ICCV'21 Eq. 6 on rows: ``r <- r + r Abar``."""
    return row + carry_through_windows(row, layer_map, geometry)


def _rollout_step(row, layer_map, geometry):
    """``r <- r rownorm(I + A)`` with A restricted to real keys."""
    scaled = row / (1 + real_key_sums(layer_map, geometry, row.dtype))
    return scaled + carry_through_windows(scaled, layer_map, geometry)


def _last_only(values: Sequence[Optional[torch.Tensor]]) -> list:
    last = max(i for i, v in enumerate(values) if v is not None)
    return [v if i == last else None for i, v in enumerate(values)]


def _from_start(method, trace: AttentionTrace, values: Sequence[Optional[torch.Tensor]]) -> list:
    start = getattr(method, "start_layer", 0)
    method.layers_from(trace, start)
    return [v if i >= start else None for i, v in enumerate(values)]


def windowed_scores(method, trace: AttentionTrace) -> torch.Tensor:
    """Token scores (B, N_0) of ``method`` on a windowed trace, or :class:`InputError` for a
    method (or option) with no windowed definition."""
    from .generic_attention import GenericAttention
    from .grad_cam import AttentionGradCAM
    from .raw_attention import RawAttention
    from .rollout import AttentionRollout
    from .transformer_relevance import PartialLRP, TransformerRelevance

    forward = [r.forward_value for r in trace.records]
    backward = [r.backward_value for r in trace.records]
    if isinstance(method, RawAttention):
        return chain(trace, _last_only(forward), carry_through_windows)
    if isinstance(method, (AttentionGradCAM, PartialLRP)):
        return chain(trace, _last_only(backward), carry_through_windows)
    if isinstance(method, AttentionRollout):
        ratio = torch.as_tensor(method.discard_ratio)
        if bool((ratio != 0).any()):
            raise InputError(
                f"AttentionRollout(discard_ratio={method.discard_ratio}) is not defined on windowed attention (which "
                "entries compete is not defined across windows); use discard_ratio=0 for Swin models."
            )
        return chain(trace, _from_start(method, trace, forward), _rollout_step)
    if isinstance(method, (GenericAttention, TransformerRelevance)):
        return chain(trace, _from_start(method, trace, backward), _self_relevance_step)
    raise InputError(
        f"{type(method).__name__} has no definition on windowed attention (Swin); the supported attention methods are "
        "RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention, TransformerRelevance and PartialLRP."
    )


def is_windowed(trace: AttentionTrace) -> bool:
    return isinstance(trace.layout, WindowedLayout)

