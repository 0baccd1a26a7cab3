"""Generation steps explained by one call per step on the prefix, for Captum's own methods.

Captum's Integrated Gradients and Saliency (the catalog's baseline rows) take the gradient of
their own forward passes, so they cannot share the package's one-forward engine: step ``t``
is explained by a call on the prefix (prompt + ``y_<t``) with the next-token logit of ``y_t``
as the target, which is the definition the engine's rows are checked against. Only the logit
score, one step at a time.

Example::

    >>> prefix_scores(CaptumIntegratedGradients(llm), batch, steps, on_step)
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import InputError
from .batch import GenerationBatch
from .engine import OnStep, StepLogits
from .steps import ExplainedSteps


def prefix_scores(method: Any, batch: GenerationBatch, steps: ExplainedSteps, on_step: OnStep) -> StepLogits:
    """Token scores per step from prefix calls of ``method.attribute(..., return_tokens=True)``."""
    name = type(method).__name__
    if batch.encoder_decoder:
        raise InputError(f"{name} explains one token-id input; encoder-decoder generation is explained by the "
                         "package's methods (AttnLRP, ConservativeLRP, GenericAttention, ...).")
    if steps.score != "logit" or steps.foils is not None or steps.groups is not None:
        raise InputError(f"{name} explains the next-token logit of one step per call; score={steps.score!r}, "
                         "contrast and span need the package's methods (e.g. AttnLRP).")
    model = method.model
    (ids,) = batch.inputs
    takes_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
    for t in range(steps.num_steps):
        length = int(steps.positions[t]) + 1
        kwargs = {key: value[:, :length] for key, value in batch.forward_kwargs.items()}
        if takes_keep:
            kwargs["logits_to_keep"] = 1
        target = [(0 if takes_keep else length - 1, int(y)) for y in steps.targets[:, t].tolist()]
        scores = method.attribute(ids[:, :length], target=target, forward_kwargs=kwargs, return_tokens=True)
        padded = scores.new_zeros(ids.shape[0], ids.shape[1])
        padded[:, :length] = scores
        on_step(t, {"tokens": padded})
    with torch.no_grad():
        output = model(ids, **batch.forward_kwargs)
    logits = output.logits if hasattr(output, "logits") else output
    return StepLogits(logits.index_select(1, steps.positions.to(logits.device)).detach(), None)
