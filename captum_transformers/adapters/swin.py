"""HuggingFace Swin (``SwinForImageClassification``, ``SwinModel``): windowed attention.

HF Swin dispatches its window attention through ``AttentionInterface`` (the relative position
bias and the shift mask arrive as the additive mask), so the HuggingFace kernel observes every
call; this adapter adds what a windowed model needs: the geometry of each call (read from the
layer after it ran: its grid, window and shift, which HF clamps for grids smaller than the
window) and the layout of :class:`~.windowed.WindowedAdapterMixin`. See
``docs/windowed-attention.md`` for how the calls become token-to-token maps.

Example::

    >>> from transformers import SwinConfig, SwinForImageClassification
    >>> swin = SwinForImageClassification(SwinConfig(image_size=32, patch_size=4, embed_dim=16,
    ...                                              depths=[2, 2], num_heads=[2, 4], window_size=4)).eval()
    >>> maps = GenericAttention(swin).attribute(torch.randn(2, 3, 32, 32), target=[0, 1])   # (2, 3, 32, 32)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from ..capture import patching
from ..capture.recorder import Recorder
from ..capture.windows import WindowGeometry
from ..errors import CaptureError
from .huggingface import HuggingFaceAdapter
from .windowed import WindowedAdapterMixin, note_geometry, start_geometries


def _windowed_layers(model: nn.Module):
    """HF Swin layers: a module holding the attention, ``window_size`` and ``shift_size``."""
    return [m for m in model.modules()
            if hasattr(m, "window_size") and hasattr(m, "shift_size") and isinstance(getattr(m, "attention", None),
                                                                                  nn.Module)]


class SwinAdapter(WindowedAdapterMixin, HuggingFaceAdapter):
    """Adapter for HuggingFace Swin: every attention and relevance method, explained at the
    first layer's patch grid.

    The explained rows are the last stage's tokens, averaged, as the classifier's pooler
    averages them. Any input size the model accepts works: grids that are not a multiple of
    the window are padded by the model, and padded positions (constants, not inputs) take no
    relevance. Relevance methods read the hidden states entering the first Swin layer.
    """

    name = "swin"
    families = "HuggingFace Swin (SwinForImageClassification, SwinModel)"

    def __init__(self) -> None:
        super().__init__(query_rows=None)

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        layers = _windowed_layers(model)
        if not layers:
            raise CaptureError(f"{type(model).__name__} has no Swin layer (window_size, shift_size, attention).")
        start_geometries(recorder)

        def observe(layer, args, kwargs, output):
            dimensions = args[1] if len(args) > 1 else kwargs.get("input_dimensions")
            window, shift = int(layer.window_size), int(layer.shift_size)  # as the forward set them
            note_geometry(recorder, WindowGeometry((int(dimensions[0]), int(dimensions[1])), (window, window),
                                                   (shift, shift), pad_first=True))

        with contextlib.ExitStack() as stack:
            stack.enter_context(super().capture(model, recorder))
            for layer in layers:
                stack.enter_context(patching.forward_hook(layer, observe, with_kwargs=True))
            yield
