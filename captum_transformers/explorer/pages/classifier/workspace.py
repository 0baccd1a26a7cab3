"""What the explorer shows: one batch, the model's predictions on it, and cached explanations.

A :class:`Workspace` holds a model and one batch of inputs with what the page needs around it
(the [0, 1] images or the tokens to draw, true labels, class names). Its predictions come from
one forward pass at construction. :meth:`Workspace.explain` explains any subset of the batch
with one method and its arguments, each example for its own target class, in ONE ``attribute``
call for all the examples not cached yet; results are cached per
``(example, method, arguments, target)``.

Example::

    >>> workspace = Workspace(model, (pixels,), images01, labels=labels, class_names=[str(d) for d in range(10)])
    >>> maps = workspace.explain("rollout", {"head_fusion": "max"}, {0: 3, 1: 7})
    >>> maps[0]["shape"], len(maps[0]["values"])  # the map summed over channels, flattened row-major
    ([32, 32], 1024)
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ....capture.targets import output_scores
from ....errors import InputError
from ...explaining import Cancelled, catalog_builder, stoppable
from ...method_arguments import arguments_key, checked_arguments, constructor_arguments

#: Cached maps kept (least recently computed dropped first): bounds memory for long sessions.
MAX_CACHED_MAPS = 4096
#: Maps larger than this per side are average-pooled before they are sent (patch methods are
#: piecewise constant per patch, so a 224 x 224 map loses nothing visible at 112 x 112).
MAX_MAP_SIDE = 112


def _check_token_counts(ids: torch.Tensor, displays: Sequence, mask: Optional[torch.Tensor]) -> None:
    """Each example's shown tokens must be its scored positions (the unmasked ones, or every
    position without ``attention_mask``): one token short would draw every score on its
    neighbour, one too many cannot be drawn."""
    for index, tokens in enumerate(displays):
        if mask is not None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            positions, what = int(mask[index].bool().sum()), "unmasked positions"
        else:
            positions, what = (ids.shape[1] if ids.dim() >= 2 else 1), "positions"
        if len(tokens) != positions:
            raise InputError(f"example {index} shows {len(tokens)} tokens but its input has {positions} {what}; give "
                             "one token per scored position, in order, so that each score is drawn on its own token.")


@dataclass(frozen=True)
class Prediction:
    """The model's view of one example: predicted class, its probability, margin, true labels
    (one, or several on multi-label inputs such as two-digit canvases; empty when unknown)."""

    index: int
    predicted: int
    probability: float
    margin: float  # probability of the predicted class minus the runner-up's
    labels: Tuple[int, ...]

    @property
    def correct(self) -> Optional[bool]:
        """Whether the predicted class is one of the true labels (``None`` without labels)."""
        return self.predicted in self.labels if self.labels else None


class Workspace:
    """A model and one batch to explore (see the module docstring).

    ``inputs``: the tuple of model inputs of the batch (the first is explained);
    ``displays``: per example a (3, H, W) float tensor in [0, 1] (``modality="image"``) or a
    list of token strings (``"text"``; the example's real tokens, in order);
    ``forward_kwargs``: keyword tensors of the forward (``attention_mask``);
    ``labels``: true classes (B,), several per example (B, K), or ``None``;
    ``class_names``: one string per output class;
    ``special_tokens``: tokens shown but scored 0 ([CLS], [SEP]); ``method_builder(name, model,
    arguments)`` builds an attribution (the catalog by default; tests count calls through it);
    ``removed_token_id``: text curves replace removed tokens by it (default: the config's pad token).
    """

    def __init__(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], displays: Sequence,
                 modality: str = "image", labels: Optional[torch.Tensor] = None,
                 class_names: Optional[Sequence[str]] = None, forward_kwargs: Optional[Dict[str, Any]] = None,
                 name: str = "model", special_tokens: frozenset = frozenset(),
                 method_builder: Callable = catalog_builder, score_func: Optional[Callable] = None,
                 removed_token_id: Optional[int] = None) -> None:
        if modality not in ("image", "text"):
            raise InputError(f"modality must be 'image' or 'text', received {modality!r}.")
        if not isinstance(inputs, tuple) or not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise InputError(f"inputs must be a non-empty tuple of tensors, received {type(inputs).__name__}.")
        batch = inputs[0].shape[0]
        if len(displays) != batch:
            raise InputError(f"{len(displays)} displays for a batch of {batch}; give one image or token list per "
                             "example.")
        if modality == "text":
            _check_token_counts(inputs[0], displays, (forward_kwargs or {}).get("attention_mask"))
        if labels is not None and (labels.dim() not in (1, 2) or labels.shape[0] != batch):
            raise InputError(f"labels must have shape ({batch},) or ({batch}, K), received {tuple(labels.shape)}.")
        self.model, self.inputs, self.displays, self.modality = model, inputs, list(displays), modality
        self.forward_kwargs = dict(forward_kwargs or {})
        self.labels = None if labels is None else labels.long().cpu().reshape(batch, -1)
        self.name, self.special_tokens, self.method_builder = name, frozenset(special_tokens), method_builder
        self.score_func = score_func
        if removed_token_id is None and modality == "text":
            removed_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
        self.removed_token_id = removed_token_id
        self._cache: "OrderedDict[Tuple[int, str, str, int], Dict[str, Any]]" = OrderedDict()
        self._lock = threading.Lock()
        self.probabilities = self._probabilities()
        classes = self.probabilities.shape[1]
        names = [str(c) for c in class_names] if class_names is not None else [str(c) for c in range(classes)]
        if len(names) != classes:
            raise InputError(f"{len(names)} class names for a model with {classes} outputs; give one name per "
                             "output class.")
        self.class_names = names

    # -- predictions ---------------------------------------------------------------------
    def _probabilities(self) -> torch.Tensor:
        with torch.no_grad():
            output = output_scores(self.model(*self.inputs, **self.forward_kwargs))
        output = output[0] if isinstance(output, (tuple, list)) else output
        if output.dim() != 2:
            raise InputError(f"{self.name} returns scores of shape {tuple(output.shape)}; the explorer needs "
                             "(batch, classes).")
        scores = self.score_func(output) if self.score_func is not None else output.softmax(-1)
        return scores.detach().float().cpu()

    def __len__(self) -> int:
        return self.inputs[0].shape[0]

    def predictions(self) -> List[Prediction]:
        top = self.probabilities.topk(min(2, self.probabilities.shape[1]), dim=1)
        out = []
        for index in range(len(self)):
            values = top.values[index].tolist()
            margin = values[0] - values[1] if len(values) > 1 else values[0]
            labels = () if self.labels is None else tuple(int(v) for v in self.labels[index])
            out.append(Prediction(index, int(top.indices[index, 0]), values[0], margin, labels))
        return out

    # -- explanations --------------------------------------------------------------------
    def check_targets(self, targets: Mapping[int, int]) -> Dict[int, int]:
        """``{example: class}`` with both checked against the batch and the model's classes."""
        checked = {}
        for index, target in targets.items():
            if isinstance(index, bool) or isinstance(target, bool) or not isinstance(index, int) \
                    or not isinstance(target, int):
                raise InputError(f"example and target must be integers, received {index!r}: {target!r}.")
            if not 0 <= index < len(self):
                raise InputError(f"example {index} is out of range: the batch has {len(self)} examples.")
            if not 0 <= target < len(self.class_names):
                raise InputError(f"target {target} is out of range: the model has {len(self.class_names)} classes.")
            checked[index] = target
        return checked

    def cached(self, method: str, arguments: Mapping[str, Any], targets: Mapping[int, int]) -> Dict[int, Dict]:
        """The maps of ``explain(method, arguments, targets)`` already in the cache (computes nothing)."""
        checked = checked_arguments(method, arguments)
        key = arguments_key(checked)
        with self._lock:
            found = {i: self._cache.get((i, method, key, t)) for i, t in targets.items()}
        return {i: value for i, value in found.items() if value is not None}

    def explain(self, method: str, arguments: Mapping[str, Any], targets: Mapping[int, int],
                should_stop: Optional[Callable[[], bool]] = None) -> Dict[int, Dict]:
        """Maps of ``method`` for ``{example: target class}``: from the cache, and the rest in
        one ``attribute`` call. Each map is ``{"values": flat row-major list, "shape": [H, W] or
        [tokens], "target": int, "low": min, "high": max, "all_zero": bool}``. Image maps are the
        attribution summed over channels (average-pooled to ``MAX_MAP_SIDE``); token maps keep
        each example's real tokens, special tokens scored 0. A map with NaN or infinite values
        is refused; an all-zero map is flagged so the page says so instead of drawing a blank.
        ``should_stop``: checked before each torch operation of this thread that computes
        (``explaining.stoppable``); once it returns true the explanation raises ``Cancelled``
        (nothing of it is cached), and the explanation's cleanup restores the model and the thread."""
        checked = checked_arguments(method, arguments)
        key = arguments_key(checked)
        targets = self.check_targets(targets)
        with self._lock:
            missing = [i for i, t in targets.items() if (i, method, key, t) not in self._cache]
        if missing:
            maps = self._attribute(method, checked, missing, [targets[i] for i in missing], should_stop)
            with self._lock:
                found = {index: self._payload(index, scores, targets[index]) for index, scores in zip(missing, maps)}
                for index, payload in found.items():
                    self._cache[(index, method, key, targets[index])] = payload
                while len(self._cache) > MAX_CACHED_MAPS:
                    self._cache.popitem(last=False)
        else:
            found = {}
        with self._lock:
            return {i: found[i] if i in found else self._cache[(i, method, key, t)] for i, t in targets.items()}

    def _attribute(self, method: str, checked: Mapping[str, Any], rows: List[int], targets: List[int],
                   should_stop: Optional[Callable[[], bool]] = None) -> List:
        index = torch.tensor(rows, dtype=torch.long)
        inputs = tuple(t[index.to(t.device)] for t in self.inputs)
        kwargs = {k: v[index.to(v.device)] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == len(self)
                  else v for k, v in self.forward_kwargs.items()}
        target = torch.tensor(targets, dtype=torch.long, device=inputs[0].device)
        explainer = self.method_builder(method, self.model, constructor_arguments(method, checked))
        stop_check = stoppable(should_stop)
        with stop_check:
            attribution = explainer.attribute(inputs[0] if len(inputs) == 1 else inputs, target=target,
                                              forward_kwargs=kwargs or None, return_tokens=self.modality == "text")
        if getattr(stop_check, "fired", False):
            # the check raises once; code that caught Cancelled and went on computed the rest
            # of this map after a stop: it is neither returned nor cached
            raise Cancelled()
        if isinstance(attribution, tuple):
            attribution = attribution[0]
        attribution = attribution.detach().float().cpu()
        if self.modality == "image":
            maps = attribution.sum(1) if attribution.dim() == 4 else attribution
            if maps.dim() != 3:
                raise InputError(f"{method} returned maps of shape {tuple(attribution.shape)}; expected (B, C, H, W) "
                                 "or (B, H, W) for an image model.")
            if max(maps.shape[-2:]) > MAX_MAP_SIDE:
                side = [max(1, round(s * MAX_MAP_SIDE / max(maps.shape[-2:]))) for s in maps.shape[-2:]]
                maps = F.adaptive_avg_pool2d(maps.unsqueeze(1), side).squeeze(1)
            return list(maps)
        mask = kwargs.get("attention_mask")
        out = []
        for row, example in enumerate(rows):
            scores = attribution[row] if mask is None else attribution[row][mask[row].bool().cpu()]
            tokens = self.displays[example]
            special = torch.tensor([token in self.special_tokens for token in tokens], dtype=torch.bool)
            out.append(scores[:len(tokens)].masked_fill(special, 0.0))
        return out

    def _payload(self, index: int, scores: torch.Tensor, target: int) -> Dict[str, Any]:
        if not torch.isfinite(scores).all():
            raise InputError(f"the map of example {index} (class {self.class_names[target]}) holds NaN or infinite "
                             "values; it is not drawn. Try another method or check the model's outputs.")
        return {"values": [round(v, 6) for v in scores.reshape(-1).tolist()], "shape": list(scores.shape),
                "target": target, "low": float(scores.min()), "high": float(scores.max()),
                "all_zero": bool((scores == 0).all())}
