"""Where the tokens of a windowed attention call (Swin) sit on the layer's token grid.

A Swin layer does not attend over its ``H x W`` tokens at once: it pads the grid to a
multiple of the window, shifts it cyclically, cuts it into windows and attends within each.
An attention call therefore holds ``nW`` maps of ``q x q`` entries (``q`` tokens per window);
:class:`WindowGeometry` says which grid token each window position holds, so the calls can be
read as one token-to-token map per layer (block-diagonal over windows, see
``docs/windowed-attention.md``) without ever building that ``N x N`` map.

Pure index math: no module is touched.

Example::

    >>> geometry = WindowGeometry(grid=(4, 4), window=(2, 2), shift=(1, 1))
    >>> geometry.num_windows, geometry.window_area
    (4, 4)
    >>> geometry.token_index()[:4].tolist()      # window 0 holds tokens 5, 6, 9, 10
    [5, 6, 9, 10]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .trace import TokenLayout


@dataclass(frozen=True)
class WindowGeometry:
    """One windowed attention call over a layer's token grid.

    ``grid`` (H, W): the layer's real tokens, row-major (token ``r * W + c``). ``window``
    (wh, ww) and ``shift`` (sh, sw): as the layer ran them (after any clamping to the grid).
    ``pad_first``: the grid is padded to a multiple of the window before the cyclic shift
    (HuggingFace Swin) or after it (timm). Padded positions hold no token (index -1): they are
    constants of the model, not inputs.
    """

    grid: Tuple[int, int]
    window: Tuple[int, int]
    shift: Tuple[int, int] = (0, 0)
    pad_first: bool = True

    @property
    def padded(self) -> Tuple[int, int]:
        return tuple(-(-n // w) * w for n, w in zip(self.grid, self.window))

    @property
    def window_area(self) -> int:
        return self.window[0] * self.window[1]

    @property
    def num_windows(self) -> int:
        padded = self.padded
        return (padded[0] // self.window[0]) * (padded[1] // self.window[1])

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def token_index(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """(nW * q,) the grid token at each window position, in the model's window order
        (windows row-major over the shifted padded grid, positions row-major inside a window);
        -1 at padding.

        ``torch.roll(x, -s)`` puts position ``(i + s) mod n`` at ``i``, over the padded grid
        when ``pad_first`` and over the real grid otherwise.
        """
        (height, width), (wh, ww), (sh, sw) = self.grid, self.window, self.shift
        hp, wp = self.padded
        rows = torch.arange(hp, device=device)
        cols = torch.arange(wp, device=device)
        if self.pad_first:
            source_rows, source_cols = (rows + sh) % hp, (cols + sw) % wp
        else:  # shift the real grid, then pad: positions past it are padding
            source_rows = torch.where(rows < height, (rows + sh) % height, rows)
            source_cols = torch.where(cols < width, (cols + sw) % width, cols)
        real = (source_rows[:, None] < height) & (source_cols[None, :] < width)
        index = torch.where(real, source_rows[:, None] * width + source_cols[None, :], -1)  # (hp, wp)
        windows = index.reshape(hp // wh, wh, wp // ww, ww).transpose(1, 2)  # (nH, nW, wh, ww)
        return windows.reshape(-1)


def merged_grid(grid: Tuple[int, int]) -> Tuple[int, int]:
    """The grid after a 2x2 patch merging (odd sides padded by one)."""
    return ((grid[0] + 1) // 2, (grid[1] + 1) // 2)


def merge_parents(fine: Tuple[int, int], device: Optional[torch.device] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each token of the ``fine`` grid, its merged token (N_fine,) on the coarse grid, and
    for each merged token the number of real children it was built from (N_coarse,) (4, or
    fewer at the bottom and right edges of an odd grid, whose missing children are padding)."""
    coarse = merged_grid(fine)
    rows = torch.arange(fine[0], device=device) // 2
    cols = torch.arange(fine[1], device=device) // 2
    parents = (rows[:, None] * coarse[1] + cols[None, :]).reshape(-1)
    counts = torch.zeros(coarse[0] * coarse[1], dtype=torch.long, device=device)
    counts.index_add_(0, parents, torch.ones_like(parents))
    return parents, counts


@dataclass(frozen=True)
class WindowedLayout(TokenLayout):
    """The layout of a windowed model (Swin): the tokens are the first layer's grid
    (``num_tokens = H0 * W0``, ``grid = (H0, W0)``, the grid the explanation is returned on),
    and ``windows`` holds one :class:`WindowGeometry` per attention call, in call order.
    The explained rows are the last call's tokens, averaged (the model's head mean-pools
    them): ``query_rows`` states them carried back onto the first grid."""

    windows: Tuple[WindowGeometry, ...] = ()
