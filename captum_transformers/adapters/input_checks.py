"""Inputs as the adapters take them: refusals of batches no explanation can be read from
(integer pixels, inference mode, an empty batch), inputs made relevance-carrying leaves, and
the model's dtype."""
from __future__ import annotations

from typing import Tuple

import itertools
import torch
from torch import nn

from ..errors import InputError


def relevance_carrying(inputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
    """The floating-point inputs as fresh leaves that require grad (others as they are).

    Rule Functions treat an operand that requires grad as carrying relevance; an input is
    what is explained, so it always does, whatever the caller's tensor says (a float input
    entering the residual stream directly would otherwise change the first layer's rules).
    """
    return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter or buffer (float32 if none)."""
    return next((t.dtype for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()), torch.float32)


def refuse_integer_pixels(inputs: Tuple[torch.Tensor, ...]) -> None:
    """Refuse image batches (B, C, H, W) of integers (uint8 pixels): no gradient or
    relevance can be taken at integers, and the patch grid is read from float images, so
    such a batch would get an all-zero map."""
    for position, tensor in enumerate(inputs):
        if tensor.dim() == 4 and not (tensor.is_floating_point() or tensor.is_complex()):
            raise InputError(
                f"Input {position} is an image batch of shape {tuple(tensor.shape)} with dtype {tensor.dtype}; "
                "explanations need floating-point pixel values (relevance is read at float pixels, and an integer "
                "image would get an all-zero map). Pass the pixel values the model's image processor returns, "
                "or e.g. images.float() / 255 normalised as the model was trained."
            )


def refuse_inference_mode() -> None:
    if torch.is_inference_mode_enabled():
        raise InputError(
            "attribute() was called under torch.inference_mode(), where no gradient can ever be taken. "
            "Call it under torch.no_grad() or with no context instead."
        )


def refuse_empty_batch(inputs: Tuple[torch.Tensor, ...]) -> None:
    # Refused rather than answered with an empty result: without a forward pass the number
    # of tokens (the width of return_tokens=True) is unknown, and most models fail on B = 0.
    if inputs and inputs[0].dim() > 0 and inputs[0].shape[0] == 0:
        raise InputError(
            f"The batch is empty: inputs of shapes {[tuple(t.shape) for t in inputs]} hold no example. Call attribute() "
            "only on batches with at least one example (skip empty batches in the calling loop)."
        )


def refuse_unexplainable_batch(inputs: Tuple[torch.Tensor, ...]) -> None:
    """Every refusal above, in the order an explanation meets them."""
    refuse_inference_mode()
    refuse_empty_batch(inputs)
    refuse_integer_pixels(inputs)
