"""What every adapter of a windowed model (Swin) shares: per-example window maps and layouts.

A windowed attention call computes ``B * nW`` maps of ``q x q`` entries (``nW`` windows per
example, ``q`` tokens per window). Two things make them explainable by the methods:

* :func:`per_example_windows` wraps a method's :class:`CaptureSpec` so that each reduction sees
  one example's windows stacked along the queries, ``(B, H, nW * q, q)``: a head mean, the
  gradient-weighted heads and Grad-CAM's per-head mean over (query, key) pairs then act per
  example, as they do on a global map;
* :class:`WindowedAdapterMixin` collects the :class:`~captum_transformers.capture.windows.WindowGeometry`
  of each call while the model runs (the subclass observes its layers) and returns a
  :class:`~captum_transformers.capture.windows.WindowedLayout`, from which
  :mod:`captum_transformers.capture.row_chains` carries the explained rows through the layers.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn

from ..capture.recorder import Recorder
from ..capture.trace import CaptureSpec, StreamLayouts
from ..capture.windows import WindowedLayout, WindowGeometry, merge_parents, merged_grid
from ..errors import CaptureError, InputError
from .input_checks import model_dtype

# Geometries per running capture, keyed by its recorder (one adapter instance serves every thread).
_GEOMETRIES: "weakref.WeakKeyDictionary[Recorder, List[WindowGeometry]]" = weakref.WeakKeyDictionary()


def stacked_windows(maps: torch.Tensor, batch: int) -> torch.Tensor:
    """(B * nW, H, q, k) window maps as (B, H, nW * q, k): each example's windows stacked
    along the queries (the model's windows are batch-major)."""
    total, heads, queries, keys = maps.shape
    if total % batch:
        raise CaptureError(f"A windowed attention call computed {total} maps, not a multiple of the batch of {batch}.")
    windows = total // batch
    stacked = maps.reshape(batch, windows, heads, queries, keys).transpose(1, 2)
    return stacked.reshape(batch, heads, windows * queries, keys)


def per_example_windows(spec: Optional[CaptureSpec], batch: int) -> Optional[CaptureSpec]:
    """``spec`` whose reductions see each example's windows stacked, ``(B, H, nW * q, k)``.

    Padding inside windows is handled by the methods from the geometry, so no ``valid`` mask
    is passed on (the kernel's mask holds the relative position bias, not padding).
    """
    if spec is None:
        return None
    forward = spec.forward_reduce
    backward = spec.backward_reduce

    def forward_reduce(probs):
        return forward(stacked_windows(probs, batch))

    def backward_reduce(probs, grad, valid, **extra):
        return backward(stacked_windows(probs, batch), stacked_windows(grad, batch), None, **extra)

    return dataclasses.replace(spec, forward_reduce=None if forward is None else forward_reduce,
                               backward_reduce=None if backward is None else backward_reduce)


def note_geometry(recorder: Recorder, geometry: WindowGeometry) -> None:
    """Record the geometry of the attention call a layer just ran."""
    _GEOMETRIES.setdefault(recorder, []).append(geometry)


def start_geometries(recorder: Recorder) -> None:
    _GEOMETRIES[recorder] = []


class WindowedAdapterMixin:
    """Layouts and traces of windowed models; the subclass calls :func:`note_geometry` from a
    hook on each windowed layer during :meth:`capture`."""

    name = "windowed"
    single_token_grid = False

    #: Half-precision dtypes whose forward pass of this family is itself unreliable (refused).
    refused_dtypes: Tuple[torch.dtype, ...] = ()

    def refuse_precision(self, model: nn.Module, rules) -> None:
        """Refuse what measured as wrong on tiny Swins: float16 under the rules with separate
        alpha-beta denominators (``RuleSet.LRP``: PartialLRP, TransformerLRP; correlation with
        the float32 map of the same weights 0.19-0.33, TransformerLRP -0.85), and the dtypes in
        :attr:`refused_dtypes`."""
        dtype = model_dtype(model)
        if dtype in self.refused_dtypes:
            raise InputError(
                f"{type(model).__name__} in {dtype} is not explained by the {self.name} adapter: its own forward pass "
                "is unreliable in that precision (HF Swin v2 in float16 returns NaN logits on tiny models). Explain a "
                "float32 copy (model.float())."
            )
        if rules is not None and dtype == torch.float16 and rules.linear == "alpha1beta0_separate":
            raise InputError(
                f"The {rules.name!r} rules (alpha-beta with separate denominators) on a float16 Swin gave maps unrelated "
                "to the float32 map of the same weights (correlation 0.19 to 0.33; TransformerLRP -0.85), so they are "
                "not run in float16. Explain a float32 copy (model.float()), or use AttnLRP, ConservativeLRP or "
                "TransformerRelevance, which hold in float16."
            )

    def refuse_trace(self, model, inputs, additional_forward_args, forward_kwargs, rules) -> None:
        self.refuse_precision(model, rules)

    def refuse_relevance(self, model, inputs, additional_forward_args, forward_kwargs, rules) -> None:
        self.refuse_precision(model, rules)

    def trace_spec(self, spec: Optional[CaptureSpec], inputs: Tuple[torch.Tensor, ...]) -> Optional[CaptureSpec]:
        """Each reduction sees one example's windows stacked (:func:`per_example_windows`)."""
        batch = inputs[0].shape[0] if inputs and inputs[0].dim() else 0
        return per_example_windows(spec, batch)

    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        geometries = tuple(_GEOMETRIES.get(recorder, ()))
        sites = recorder.sites
        if len(geometries) != len(sites):
            raise CaptureError(
                f"{type(model).__name__} made {len(sites)} attention calls but {len(geometries)} windowed layers "
                f"reported their windows to the {self.name} adapter; the model does not run its layers as the adapter "
                "expects (a modified Swin). Pass a custom adapter with adapter=."
            )
        batch = inputs[0].shape[0]
        previous = None
        for site, geometry in zip(sites, geometries):
            if site.num_queries != geometry.window_area or site.batch_size != batch * geometry.num_windows:
                raise CaptureError(
                    f"Attention call {site.call_index} ({site.block.name}) computed {site.batch_size} maps of "
                    f"{site.num_queries} queries, but its layer's grid {geometry.grid} in windows {geometry.window} "
                    f"gives {batch} x {geometry.num_windows} maps of {geometry.window_area}. Pass a custom adapter."
                )
            if previous is not None and geometry.grid not in (previous.grid, merged_grid(previous.grid)):
                raise CaptureError(
                    f"Attention call {site.call_index} ({site.block.name}) runs on a {geometry.grid} grid after a "
                    f"{previous.grid} grid: neither the same grid nor a 2x2 patch merging of it."
                )
            previous = geometry
        first = geometries[0]
        device = inputs[0].device
        weights = explained_weights(geometries, device)
        rows = torch.arange(first.num_tokens, device=device).expand(batch, -1)
        layout = WindowedLayout(first.num_tokens, rows, None, 0, first.grid, weights.expand(batch, -1),
                                windows=geometries)
        return StreamLayouts.single(layout, len(inputs))


def explained_weights(geometries: Tuple[WindowGeometry, ...], device=None) -> torch.Tensor:
    """The mean over the last call's tokens (what the head pools) carried onto the first grid
    through the patch mergings (each merged token's weight split over its real children)."""
    row = torch.full((1, geometries[-1].num_tokens), 1.0 / geometries[-1].num_tokens, device=device)
    for finer, coarser in zip(reversed(geometries[:-1]), reversed(geometries[1:])):
        if finer.grid != coarser.grid:
            parents, counts = merge_parents(finer.grid, device)
            row = row[:, parents] / counts[parents]
    return row
