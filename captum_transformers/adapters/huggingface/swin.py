"""HuggingFace Swin and Swin v2 (``Swin*``, ``Swinv2*``): windowed attention.

HF Swin dispatches its window attention through ``AttentionInterface`` (the relative position
bias and the shift mask arrive as the additive mask), so the HuggingFace kernel observes every
call; this adapter adds what a windowed model needs: the geometry of each call (read from the
layer after it ran: its grid, window and shift, which HF clamps for grids smaller than the
window) and the layout of :class:`~.windowed.WindowedAdapterMixin`. See
``docs/windowed-attention.md`` for how the calls become token-to-token maps.

Swin v2 computes its cosine attention inline (``softmax`` then ``self.dropout``, no
``AttentionInterface``): :class:`Swinv2Adapter` records the dropout's input, the probabilities
autograd differentiates, and applies the AH gate at the dropout's output (as for LXMERT).

Example::

    >>> from transformers import SwinConfig, SwinForImageClassification
    >>> swin = SwinForImageClassification(SwinConfig(image_size=32, patch_size=4, embed_dim=16,
    ...                                              depths=[2, 2], num_heads=[2, 4], window_size=4)).eval()
    >>> maps = GenericAttention(swin).attribute(torch.randn(2, 3, 32, 32), target=[0, 1])   # (2, 3, 32, 32)
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ...model_state import patching
from ...capture.recorder import Recorder
from ...capture.windows import WindowGeometry
from ...errors import CaptureError
from ...propagation.rules.operations import operation_rules
from ...propagation.rules.rule_set import RuleSet, gate, norm_rules
from .adapter import HuggingFaceAdapter, gradient_checkpointing_off
from ..windowed import WindowedAdapterMixin, note_geometry, start_geometries


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
            stack.enter_context(self.attention_capture(model, recorder))
            for layer in layers:
                stack.enter_context(patching.forward_hook(layer, observe, with_kwargs=True))
            yield

    def attention_capture(self, model: nn.Module, recorder: Recorder):
        """The context in which every window attention call reports to ``recorder``."""
        return HuggingFaceAdapter.capture(self, model, recorder)


class Swinv2Adapter(SwinAdapter):
    """Adapter for HuggingFace Swin v2 (``Swinv2ForImageClassification``, ``Swinv2Model``).

    Cosine attention ``softmax(cos(Q, K) * tau + 16 sigmoid(CPB) + M)``: the continuous position
    bias and the shift mask are inside the scores, as Swin v1's bias (``docs/windowed-attention.md``).
    """

    name = "swinv2"
    families = "HuggingFace Swin v2 (Swinv2ForImageClassification, Swinv2Model)"
    # float16: the model's own logits are NaN on tiny models; bfloat16: Grad-CAM maps correlate
    # below 0.98 with float32 (measured): both refused.
    refused_dtypes = (torch.float16, torch.bfloat16)

    @contextlib.contextmanager
    def attention_capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(gradient_checkpointing_off(model))
            for block in self.blocks(model):
                def tap(module, args, kwargs):
                    # The anchor tap: gradients reach this call's map even in a frozen model.
                    if args:
                        return (recorder.connect(args[0]), *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": recorder.connect(kwargs["hidden_states"])}

                def record(dropout, args, output, block=block):
                    recorder.record(block, args[0])  # the softmax output, inside the graph

                stack.enter_context(patching.forward_hook(block.module, tap, pre=True, with_kwargs=True))
                stack.enter_context(patching.forward_hook(_dropout_of(block.module), record))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(gradient_checkpointing_off(model))
            if rules.attention_gate != "gradient":
                for block in self.blocks(model):  # A V sees A as a constant (same values)
                    stack.enter_context(patching.forward_hook(
                        _dropout_of(block.module), lambda module, args, output: gate(output, rules)))
            stack.enter_context(norm_rules(model, rules))
            stack.enter_context(operation_rules(model, rules))
            yield


def _dropout_of(attention: nn.Module) -> nn.Module:
    dropout = getattr(attention, "dropout", None)
    if not isinstance(dropout, nn.Dropout):
        raise CaptureError(f"{type(attention).__name__} has no `dropout` child after its softmax; its attention "
                           "cannot be observed. Pass a custom adapter with adapter=.")
    return dropout
