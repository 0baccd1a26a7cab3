"""Inputs as the adapters take them: refusals of batches no explanation can be read from
(integer pixels, inference mode, an empty batch, NaN or infinite values), tensors made under
``torch.inference_mode()`` copied into ordinary ones, inputs made relevance-carrying leaves,
and the model's dtype."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

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
    inputs = ordinary_tensors(tuple(inputs))  # an inference tensor can neither require grad nor be saved
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
    """Refuse a caller inside ``torch.inference_mode()``: gradients cannot be enabled there
    (unlike ``torch.no_grad()``, which the package re-enables), and even forward-only methods
    would copy its inputs into inference tensors again."""
    if torch.is_inference_mode_enabled():
        raise InputError(
            "attribute() was called inside torch.inference_mode(), where gradients cannot be enabled, so no "
            "explanation can be computed there. Call it outside that block: under torch.no_grad() (the package "
            "re-enables gradients itself) or with no context. Tensors made inside inference_mode may be passed."
        )


def ordinary_tensors(value: Any) -> Any:
    """``value`` with every tensor made under ``torch.inference_mode()`` replaced by an ordinary
    copy (equal values, dtype and device): autograd cannot save an inference tensor for backward
    ("Inference tensors cannot be saved for backward"), so such inputs are explained exactly as
    copies. A tensor, or a tuple, list or dict of them (one level: inputs, additional arguments,
    keyword arguments); other values and ordinary tensors are returned as they are, uncopied.
    Call it outside inference mode (:func:`refuse_inference_mode`), where the copy is ordinary."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.is_inference() else value
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) and v.is_inference() for v in value):
        return type(value)(ordinary_tensors(v) for v in value) if type(value) in (tuple, list) else value
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) and v.is_inference() for v in value.values()):
        return {key: ordinary_tensors(v) for key, v in value.items()}
    return value


def refuse_non_finite(inputs: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None) -> None:
    """Refuse floating-point inputs holding NaN or +/-inf, naming the input, the counts and the
    examples: the forward would carry them into the logits and every map, where they surfaced as
    misleading errors about the explained rows or the model's precision. One read of each input
    (its extremes) when every value is finite."""
    for position, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or not tensor.numel():
            continue
        low, high = torch.aminmax(tensor.detach())
        if bool(torch.isfinite(low) & torch.isfinite(high)):
            continue
        values = tensor.detach()
        nan = int(torch.isnan(values).sum())
        positive, negative = int(torch.isposinf(values).sum()), int(torch.isneginf(values).sum())
        bad = ~torch.isfinite(values)
        examples = bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist() if bad.dim() else []
        label = names[position] if names is not None and position < len(names) else f"Input {position}"
        counts = ", ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (positive, "+inf"), (negative, "-inf"))
                           if count)
        shown = ", ".join(map(str, examples[:10])) + (", ..." if len(examples) > 10 else "")
        raise InputError(
            f"{label[:1].upper() + label[1:]} (shape {tuple(tensor.shape)}, {tensor.dtype}) holds {counts} of its "
            f"{tensor.numel()} entries (example(s) {shown} along dimension 0). An explanation of a non-finite input "
            "is not defined: the forward would carry it into the scores and every map. Fix the data (e.g. "
            "torch.nan_to_num, or drop those examples) before explaining."
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
    refuse_non_finite(inputs)
