"""Explain every confident detection of an object detector (DETR) in one batched call.

A DETR detection is a query ``q`` of an image whose best real class ``c`` (softmax over
the classes, "no object" excluded) has probability ``p_{q,c}`` above a threshold. Each
detection is explained with target ``(q, c)``, i.e. row ``q`` of the decoder-to-encoder
relevance (Chefer et al., ICCV 2021, Sec. 4, object detection). Example::

    >>> found = explain_detections(GenericAttention(detr), pixel_values, threshold=0.9)
    >>> found.maps.shape, found.label, found.score          # (D, 3, H, W), (D,), (D,)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple, Union

import torch

from ..compat.stochastic_layers import watched
from ..errors import InputError

TensorOrTuple = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


@dataclasses.dataclass(frozen=True)
class Detections:
    """D explained detections: ``maps`` is what the explainer returns for them ((D, C, H, W)
    maps, or token scores with ``return_tokens=True``); ``image_index``, ``query_index``,
    ``label`` and ``score`` (the class probability) are (D,) tensors."""

    maps: TensorOrTuple
    image_index: torch.Tensor
    query_index: torch.Tensor
    label: torch.Tensor
    score: torch.Tensor

    def __len__(self) -> int:
        return int(self.image_index.shape[0])


def detection_scores(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per query, the best real class and its probability: ``max_{c < C} softmax(logits)_c``
    over logits (B, Q, C + 1) whose last class is "no object". Returns (score, label), (B, Q)."""
    if logits.dim() != 3 or logits.shape[-1] < 2:
        raise InputError(
            f"Detection logits must be (B, num_queries, num_labels + 1) with a last 'no object' class; got shape "
            f"{tuple(logits.shape)}. Pass a DETR-style detector."
        )
    return logits.detach().softmax(dim=-1)[..., :-1].max(dim=-1)


def explain_detections(explainer: Any, pixel_values: TensorOrTuple, threshold: float = 0.9,
                       additional_forward_args: Any = None, forward_kwargs: Optional[dict] = None,
                       **kwargs: Any) -> Detections:
    """Explain every detection whose best class probability exceeds ``threshold``.

    One forward finds the detections (query ``q`` of image ``b`` with ``max_{c} p_{q,c} >
    threshold``); then ONE ``explainer.attribute`` call explains them all: each image is
    repeated once per detection (with its tensors in ``additional_forward_args`` and
    ``forward_kwargs``, e.g. ``pixel_mask``) and targets are the ``(q, c)`` pairs.
    Detections come in (image, query) order. ``kwargs`` go to ``attribute``
    (``return_tokens``, method options).

    With no detection above the threshold, every field is empty (D = 0) and ``maps`` has
    the shape the explainer gives one detection, with 0 rows: this is not an error, an
    image may hold no object.

    Example: ``explain_detections(GenericAttention(detr), images, threshold=0.7).maps``.
    """
    inputs = pixel_values if isinstance(pixel_values, tuple) else (pixel_values,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InputError(
            f"pixel_values must be a tensor or a tuple of tensors, got {type(pixel_values).__name__}."
        )
    additional = () if additional_forward_args is None else (
        additional_forward_args if isinstance(additional_forward_args, tuple) else (additional_forward_args,))
    forward_kwargs = dict(forward_kwargs or {})
    model, adapter = explainer.model, explainer.adapter
    # The finding forward follows the train-mode rule too (capture.stochastic_layers): a random one
    # would pick other detections, a batch norm in training mode would change the model.
    with torch.no_grad(), watched(model, getattr(explainer, "allow_stochastic", False)):
        output = model(*inputs, *additional, **forward_kwargs)
    # The adapter knows where the model keeps its logits (a ModelOutput field for HF).
    score, label = detection_scores(adapter.logits(model, output, None, False))
    image_index, query_index = torch.nonzero(score > threshold, as_tuple=True)
    score, label = score[image_index, query_index], label[image_index, query_index]

    if len(image_index) == 0:
        # One explanation of image 0, query 0 gives the maps' type and trailing shape.
        probe = torch.zeros(1, dtype=torch.long, device=inputs[0].device)
        example = _explain(explainer, pixel_values, additional, forward_kwargs, probe, [(0, 0)], kwargs)
        maps = tuple(m[:0] for m in example) if isinstance(example, tuple) else example[:0]
    else:
        targets = torch.stack([query_index, label], dim=1)
        maps = _explain(explainer, pixel_values, additional, forward_kwargs, image_index, targets, kwargs)
    return Detections(maps, image_index, query_index, label, score)


def _explain(explainer: Any, pixel_values: TensorOrTuple, additional: tuple, forward_kwargs: dict,
             index: torch.Tensor, targets: Any, kwargs: dict) -> TensorOrTuple:
    """``explainer.attribute`` on the images ``index`` (repeats allowed) with ``targets``."""
    inputs = pixel_values if isinstance(pixel_values, tuple) else (pixel_values,)
    batch = inputs[0].shape[0]

    def repeat(value: Any) -> Any:  # batch-first tensors follow their image; the rest is shared
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value[index.to(value.device)]
        return value

    repeated = tuple(repeat(t) for t in inputs)
    return explainer.attribute(
        repeated if isinstance(pixel_values, tuple) else repeated[0],
        target=targets,
        additional_forward_args=tuple(repeat(a) for a in additional) or None,
        forward_kwargs={k: repeat(v) for k, v in forward_kwargs.items()} or None,
        **kwargs,
    )
