"""The Captum-facing shell shared by every attention method.

A method subclasses :class:`TraceAttribution`, says what to capture (:meth:`capture_spec`)
and reduces the trace to token scores (:meth:`reduce`). This module formats inputs and
targets the Captum way, asks the adapter for a trace, and maps token scores back onto the
shape of each input.
"""
from __future__ import annotations

import abc
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from captum.attr import Attribution
from captum.log import log_usage
from torch import nn

from ..adapters.base import Adapter
from ..errors import InputError
from ..registry import get_adapter
from ..trace import AttentionTrace, CaptureSpec, TokenLayout
from .. import functional

TensorOrTuple = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def _format_inputs(inputs: Any) -> Tuple[Tuple[torch.Tensor, ...], bool]:
    is_tuple = isinstance(inputs, tuple)
    formatted = inputs if is_tuple else (inputs,)
    if not formatted or not all(isinstance(t, torch.Tensor) for t in formatted):
        raise InputError(
            f"inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}"
            + (f" of {[type(t).__name__ for t in formatted]}" if is_tuple else "") + "."
        )
    batch = formatted[0].shape[0] if formatted[0].dim() else None
    if batch is None or any(t.dim() == 0 or t.shape[0] != batch for t in formatted):
        raise InputError(
            f"every input needs the same batch size in dimension 0; got shapes {[tuple(t.shape) for t in formatted]}."
        )
    return formatted, is_tuple


def _check_forward_kwargs(forward_kwargs: Optional[dict], batch: int) -> None:
    """Tensors passed by name must match the batch: Captum wrappers (NoiseTunnel, metrics)
    expand ``additional_forward_args`` with the inputs but never ``forward_kwargs``."""
    for name, value in (forward_kwargs or {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] not in (1, batch):
            raise InputError(
                f"forward_kwargs[{name!r}] has batch size {value.shape[0]} but the inputs have {batch}. Captum "
                "wrappers such as NoiseTunnel expand additional_forward_args, not forward_kwargs: pass it "
                "positionally through additional_forward_args (or wrap the model) instead."
            )


def _format_additional(additional_forward_args: Any) -> Tuple[Any, ...]:
    if additional_forward_args is None:
        return ()
    return additional_forward_args if isinstance(additional_forward_args, tuple) else (additional_forward_args,)


def scores_to_input(scores: torch.Tensor, layout: TokenLayout, tensor: torch.Tensor) -> torch.Tensor:
    """Map token scores (B, N) onto the shape of one input tensor.

    Images (B, C, H, W): the patch-token scores as a (gh, gw) map, bilinearly upsampled to
    H x W and expanded over channels. Token inputs (B, N) get the scores; embeddings
    (B, N, D) get them repeated over D. An input with no token correspondence (for example
    a per-example scalar feature) gets zeros: it is not a token the attention mixes.
    """
    batch = scores.shape[0]
    if layout.grid is not None and tensor.dim() == 4:
        patches = scores[:, layout.num_prefix_tokens:].reshape(batch, 1, *layout.grid)
        upsampled = F.interpolate(patches, size=tensor.shape[-2:], mode="bilinear", align_corners=False)
        return upsampled.expand(-1, tensor.shape[1], -1, -1).contiguous()
    if tensor.dim() >= 2 and tensor.shape[1] == layout.num_tokens:
        view = scores.reshape(batch, layout.num_tokens, *([1] * (tensor.dim() - 2)))
        return view.expand(*tensor.shape).contiguous()
    return torch.zeros(tensor.shape, dtype=scores.dtype, device=scores.device)


class TraceAttribution(Attribution):
    """Base of the attention methods: Captum's ``Attribution`` over an adapter trace.

    Subclasses implement :meth:`capture_spec` and :meth:`reduce`.
    """

    def __init__(self, model: nn.Module, adapter: Union[Adapter, str, None] = None) -> None:
        super().__init__(model)
        self.model = model
        self.adapter = get_adapter(model, adapter)

    @abc.abstractmethod
    def capture_spec(self) -> CaptureSpec:
        """What to keep from each attention call."""

    @abc.abstractmethod
    def reduce(self, trace: AttentionTrace) -> torch.Tensor:
        """Token scores (B, N) from a trace."""

    def trace(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
              forward_kwargs: Optional[dict] = None) -> AttentionTrace:
        """Run the capture alone and return the raw :class:`AttentionTrace`."""
        formatted, _ = _format_inputs(inputs)
        _check_forward_kwargs(forward_kwargs, formatted[0].shape[0])
        return self._trace(formatted, target, _format_additional(additional_forward_args), forward_kwargs)

    def _trace(self, inputs: Tuple[torch.Tensor, ...], target: Any, additional: Tuple[Any, ...],
               forward_kwargs: Optional[dict]) -> AttentionTrace:
        """The passes a method needs; one capture by default, methods with two passes override."""
        return self.adapter.trace(self.model, inputs, additional, target, self.capture_spec(), forward_kwargs)

    @log_usage()
    def attribute(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
                  return_tokens: bool = False, forward_kwargs: Optional[dict] = None) -> TensorOrTuple:
        """Attribute the target output to the inputs.

        Args:
            inputs: a tensor or a tuple of tensors, batch first (pixel values, token ids or
                embeddings), passed positionally to the model.
            target: any Captum target form; ``None`` explains the predicted class.
            additional_forward_args: extra positional model arguments (e.g. an attention mask).
            return_tokens: return the raw (B, N) token scores instead of input-shaped maps.
            forward_kwargs: extra keyword arguments for the model (e.g. ``{"attention_mask": mask}``
                for a HF model whose second positional argument is something else).

        Returns:
            Attributions with the structure and shapes of ``inputs`` (or (B, N) token scores).
        """
        formatted, is_tuple = _format_inputs(inputs)
        _check_forward_kwargs(forward_kwargs, formatted[0].shape[0])
        trace = self._trace(formatted, target, _format_additional(additional_forward_args), forward_kwargs)
        scores = self.reduce(trace)
        if trace.layout.token_mask is not None:
            scores = scores * trace.layout.token_mask.to(scores.dtype)
        if return_tokens:
            return scores
        mapped = tuple(scores_to_input(scores, trace.layout, t) for t in formatted)
        return mapped if is_tuple else mapped[0]

    @staticmethod
    def layers_from(trace: AttentionTrace, start_layer: int) -> int:
        """Validate ``start_layer`` against the number of captured attention layers."""
        if not 0 <= start_layer < len(trace):
            raise InputError(
                f"start_layer={start_layer} but the model has {len(trace)} attention layers; "
                f"use a value in [0, {len(trace)})."
            )
        return start_layer

    @staticmethod
    def start_rows(trace: AttentionTrace, dtype: torch.dtype) -> torch.Tensor:
        """Row vectors selecting the explained token(s) of each example."""
        layout = trace.layout
        return functional.query_vectors(layout.query_rows, layout.num_tokens, dtype, layout.query_weights)
