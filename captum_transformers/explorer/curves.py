"""Per-example deletion and insertion curves of a map (one forward call for all steps).

For a map ``m`` of example ``x`` explaining class ``c``, pixels are ranked by ``m``
(highest first; ties as ``torch.topk`` breaks them, as in ``evaluation.pixel_perturbation``).
At each fraction ``f`` of ``FRACTIONS``:

    deletion(f)  = p_c(x with its top f pixels set to 0)          (a faithful map falls fast)
    insertion(f) = p_c(0 with only its top f pixels taken from x)  (a faithful map rises fast)

where ``p_c`` is the model's probability of ``c`` (its softmax, or the workspace's
``score_func``) and 0 is the zero of the model's input (the dataset mean colour under the
usual ``(x - mean) / std`` normalisation). The area under each curve is the trapezoid rule
of ``evaluation.curves.trapezoid``. All ``2 * len(FRACTIONS)`` perturbed copies go through
the model in one call of ``evaluation.batched_forward.logits_per_step``.

Text: the example's real, non-special tokens are ranked instead of pixels, and a removed token
is replaced by ``workspace.removed_token_id`` (the pad token of the model's config unless
given; as in ``evaluation.token_flipping``, [CLS], [SEP] and padding are never changed); a
workspace with no such id refuses text curves rather than guess one.

Example::

    >>> curve = deletion_insertion(workspace, index=0, scores=map_hw, target=3)
    >>> curve["deletion"]["auc"] < curve["insertion"]["auc"]   # for a faithful map
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from ..capture.targets import output_scores
from ..errors import InputError
from ..evaluation.batched_forward import logits_per_step
from ..evaluation.curves import trapezoid

FRACTIONS = tuple(i / 100 for i in range(10)) + tuple(i / 10 for i in range(1, 11))


def deletion_insertion(workspace, index: int, scores: torch.Tensor, target: int) -> Dict[str, Any]:
    """``{"x": fractions, "deletion": {"y", "auc"}, "insertion": {"y", "auc"}}`` (see module)."""
    if workspace.modality == "text":
        return _token_curves(workspace, index, scores, target)
    pixels = workspace.inputs[0][index:index + 1]
    if pixels.dim() != 4:
        raise InputError(f"expected an image input of shape (1, C, H, W), received {tuple(pixels.shape)}.")
    height, width = pixels.shape[-2:]
    if tuple(scores.shape) != (height, width):
        scores = torch.nn.functional.interpolate(scores[None, None].float(), size=(height, width),
                                                 mode="nearest")[0, 0]
    order = scores.reshape(-1).to(pixels.device)
    counts = [int(round(height * width * f)) for f in FRACTIONS]

    def build(steps):
        # steps 0..T-1 delete, T..2T-1 insert (the same ranking, the complement kept)
        copies = []
        for step in steps:
            top = torch.topk(order, counts[step % len(counts)]).indices
            kept = torch.ones(height * width, dtype=pixels.dtype, device=pixels.device)
            kept[top] = 0.0
            kept = kept.reshape(1, 1, height, width)
            copies.append(pixels * kept if step < len(counts) else pixels * (1 - kept))
        return torch.cat(copies)

    return _curves(_probabilities(workspace, index, 2 * len(counts), build)[:, target].tolist(), target)


def _curves(probabilities, target: int) -> dict:
    """The deletion (first half of the steps) and insertion (second half) curves and their AUCs."""
    half = len(probabilities) // 2
    deletion, insertion = probabilities[:half], probabilities[half:]
    return {"x": list(FRACTIONS), "target": target,
            "deletion": {"y": deletion, "auc": trapezoid(deletion, FRACTIONS)},
            "insertion": {"y": insertion, "auc": trapezoid(insertion, FRACTIONS)}}


def _probabilities(workspace, index: int, steps: int, build) -> torch.Tensor:
    """Probabilities (steps, classes) of the ``build(steps)`` copies of example ``index``, its
    other inputs and keyword tensors repeated alongside, in as few forward calls as possible."""
    rest = tuple(t[index:index + 1] for t in workspace.inputs[1:])
    rows_in_batch = len(workspace)
    kwargs = {name: value[index:index + 1] if isinstance(value, torch.Tensor) and value.dim() and
              value.shape[0] == rows_in_batch else value for name, value in workspace.forward_kwargs.items()}

    def forward(batch):
        rows = batch.shape[0]
        repeated = tuple(t.expand(rows, *t.shape[1:]) for t in rest)
        named = {name: value.expand(rows, *value.shape[1:]) if isinstance(value, torch.Tensor) and value.dim() and
                 value.shape[0] == 1 else value for name, value in kwargs.items()}
        output = output_scores(workspace.model(batch, *repeated, **named))
        output = output[0] if isinstance(output, (tuple, list)) else output
        return workspace.score_func(output) if workspace.score_func is not None else output.softmax(-1)

    return logits_per_step(forward, build, steps, 1)[:, 0].float().cpu()


def _token_curves(workspace, index: int, scores: torch.Tensor, target: int) -> Dict[str, Any]:
    removed = workspace.removed_token_id
    if removed is None:
        raise InputError("token curves need the id that replaces a removed token, and this model's config names no "
                         "pad token; build the Workspace with removed_token_id=tokenizer.unk_token_id (or pad).")
    ids = workspace.inputs[0][index:index + 1]
    mask = workspace.forward_kwargs.get("attention_mask")
    positions = torch.arange(ids.shape[1]) if mask is None else mask[index].bool().cpu().nonzero().flatten()
    tokens = workspace.displays[index]
    changeable = [row for row, token in enumerate(tokens) if token not in workspace.special_tokens]
    if not changeable:
        raise InputError(f"example {index} has no token to remove (only special tokens).")
    order = scores.reshape(-1)[changeable]
    where = positions[torch.tensor(changeable)].to(ids.device)
    counts = [int(round(len(changeable) * f)) for f in FRACTIONS]

    def build(steps):
        copies = []
        for step in steps:
            top = torch.topk(order, counts[step % len(counts)]).indices
            chosen = torch.zeros(len(changeable), dtype=torch.bool)
            chosen[top] = True
            replace = chosen if step < len(counts) else ~chosen  # delete the top ones / keep only them
            copy = ids.clone()
            copy[0, where[replace.to(where.device)]] = removed
            copies.append(copy)
        return torch.cat(copies)

    return _curves(_probabilities(workspace, index, 2 * len(counts), build)[:, target].tolist(), target)
