"""Pixel flipping (Bach et al., PLoS ONE 2015) and region perturbation (Samek et al., IEEE TNNLS
2017) as Quantus 0.6.0 defines them (``quantus.PixelFlipping``, ``quantus.RegionPerturbation``).

Both replace pixels, in order of relevance, cumulatively by a baseline and record the explained
class's score (softmax probability by default, as Quantus' ``softmax=True``) after every step.
The baseline of a step is one value per image, read from the image *as perturbed so far*:

    "black": min, "white": max, "mean": mean over all channels and pixels (the running mean:
    it changes as pixels are replaced, as in Quantus), "uniform": a fresh draw from
    ``uniform_range`` per image and step, or a number.

Unlike Quantus, which ranks every channel of every pixel as a feature, a pixel here is
replaced in all its channels at once and the maps are per pixel (a (B, C, H, W) map is summed
over channels). For one-channel images, and for per-pixel maps without ties, the two agree.
Ties in the map are broken by the stable sort: the earlier pixel (row-major) first.
``benchmarks/quantus_parity.py`` compares them with Quantus per example.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..accumulator import Accumulator, exact_sum
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..curves import mean_curve
from ..results import CurveResult
from .saliency_maps import image_batch
from ..tokens.token_flipping import stable_order
from ..validation import require_choice, require_positive_int

Baseline = Union[str, float]
BASELINES = ("black", "white", "mean", "uniform")
"""The named baselines; a number is a constant baseline."""

Fill = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``fill(current (B, C, P), indices (B, n)) -> values (B, C, n)`` for the pixels of one step."""


def require_baseline(baseline: Baseline) -> Baseline:
    if isinstance(baseline, bool) or not (isinstance(baseline, (int, float)) or baseline in BASELINES):
        raise InputError(f"baseline={baseline!r} is neither a number nor one of {BASELINES}. Pick one of those.")
    return float(baseline) if isinstance(baseline, (int, float)) else baseline


def baseline_values(baseline: Baseline, current: torch.Tensor, uniform_range: Tuple[float, float],
                    generator: Optional[torch.Generator]) -> torch.Tensor:
    """One baseline value per image (B,) of ``current`` (B, ...), in its dtype.

    >>> baseline_values("black", torch.tensor([[0.2, 0.5], [0.9, 0.4]]), (0.0, 1.0), None)
    tensor([0.2000, 0.4000])
    """
    flat = current.reshape(current.shape[0], -1)
    if baseline == "black":
        return flat.amin(dim=1)
    if baseline == "white":
        return flat.amax(dim=1)
    if baseline == "mean":  # accumulated in float64 so that the summation order hardly matters
        return flat.to(torch.float64).mean(dim=1).to(flat.dtype)
    if baseline == "uniform":
        low, high = uniform_range
        draws = torch.rand(flat.shape[0], generator=generator, dtype=torch.float64)
        return (low + (high - low) * draws).to(device=flat.device, dtype=flat.dtype)
    return torch.full((flat.shape[0],), float(baseline), dtype=flat.dtype, device=flat.device)


def baseline_fill(baseline: Baseline, uniform_range: Tuple[float, float],
                  generator: Optional[torch.Generator]) -> Fill:
    """A ``Fill`` writing each image's baseline value (read from the current image) in every channel."""

    def fill(current: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        value = baseline_values(baseline, current, uniform_range, generator)
        return value[:, None, None].expand(current.shape[0], current.shape[1], indices.shape[1])

    return fill


def target_scores(logits: torch.Tensor, labels: torch.Tensor, softmax: bool) -> torch.Tensor:
    """Score of each row's label, (..., B): softmax probability (in the logits' dtype) or logit.

    Computed in the logits' dtype, as Quantus' ``nn.Softmax`` head does, then widened to float64.
    """
    scores = torch.softmax(logits, dim=-1) if softmax else logits
    index = labels.to(scores.device).reshape(*([1] * (scores.dim() - 2)), -1, 1).expand(*scores.shape[:-1], 1)
    return scores.gather(-1, index).squeeze(-1).to(torch.float64)


def cumulative_logits(forward: Forward, images: torch.Tensor, steps: Sequence[torch.Tensor], fill: Fill,
                      view: Callable[[torch.Tensor], torch.Tensor], max_batch_size: Optional[int],
                      include_start: bool = False, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits (T, B, K) after each step of a cumulative perturbation of ``images`` (B, C, H, W).

    Step ``t`` sets the pixels ``steps[t]`` (B, n_t), flat indices into H * W, in every channel
    to ``fill(current, indices)``, where ``current`` is the image after step ``t - 1``. Each
    perturbed image goes through ``view`` (e.g. crop and normalise) into ``forward``. With
    ``include_start`` the unperturbed image is step 0 (T = len(steps) + 1). ``labels`` are
    checked against the model's classes (see :func:`.batched_forward.logits_per_step`).
    """
    batch, channels = images.shape[:2]
    state = {"image": images.reshape(batch, channels, -1).clone(), "next": 0}
    plan: List[Optional[torch.Tensor]] = ([None] if include_start else []) + list(steps)

    def build(chunk):
        out = []
        for step in chunk:
            if step != state["next"]:  # logits_per_step walks the steps in order, once
                raise InputError(f"Internal order error: step {step} requested, {state['next']} expected.")
            state["next"] += 1
            indices = plan[step]
            if indices is not None:
                current = state["image"].clone()
                index = indices.to(current.device)[:, None, :].expand(batch, channels, indices.shape[1])
                current.scatter_(2, index, fill(current, index[:, 0]).to(current.dtype))
                state["image"] = current
            out.append(view(state["image"].reshape(images.shape)))
        return torch.cat(out)

    return logits_per_step(forward, build, len(plan), batch, max_batch_size, labels=labels)


class PerturbationCurve(Accumulator):
    """Shared options and checks of the perturbation curves (pixels replaced by a baseline)."""

    def __init__(self, forward: Forward, baseline: Baseline, softmax: bool, absolute: bool,
                 normalize: Optional[Callable[[torch.Tensor], torch.Tensor]], max_batch_size: Optional[int],
                 uniform_range: Tuple[float, float], generator: Optional[torch.Generator]) -> None:
        super().__init__()
        self.forward = forward
        self.baseline = require_baseline(baseline)
        self.softmax = bool(softmax)
        self.absolute = bool(absolute)
        self.normalize = normalize if normalize is not None else (lambda images: images)
        self.max_batch_size = check_max_batch_size(max_batch_size)
        low, high = (float(v) for v in uniform_range)
        if not low <= high:
            raise InputError(f"uniform_range={uniform_range!r} must be (low, high) with low <= high.")
        self.uniform_range = (low, high)
        self.generator = generator

    def _inputs(self, images, labels, maps):
        images, labels, maps = image_batch(images, labels, maps)
        batch, channels, height, width = images.shape
        return images, labels, maps.abs() if self.absolute else maps

    def _fill(self) -> Fill:
        return baseline_fill(self.baseline, self.uniform_range, self.generator)

    def update(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> None:
        """Add a batch: images (B, C, H, W) as the model reads them (before ``normalize``),
        labels (B,) the explained classes, maps (B, H, W) / (B, 1|C, H, W)."""
        curves = self.per_example(images, labels, maps)
        self._add("curve", exact_sum(curves, dim=0))
        self._add("count", torch.tensor(curves.shape[0]))

    def per_example(self, images, labels, maps) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError


class PixelFlipping(PerturbationCurve):
    """Score of the explained class as the most relevant pixels are replaced, ``features_in_step`` at a time.

    Pixels are ranked by the map (descending; ``absolute=True`` ranks ``|map|``) and replaced
    cumulatively by the baseline; after step ``t = 1..T`` (``T = ceil(H W / features_in_step)``)

        y_t = p(label | x with its t * features_in_step most relevant pixels replaced)
        AUC = trapezoid of the mean curve over images, dx = 1  (Quantus: mean of return_auc_per_sample)

    ``per_example`` returns the curves (B, T), Quantus' per-sample output. A faithful map makes
    the curve fall early, so lower AUC is better. ``image_size`` fixes T before any update (every
    process needs the same state shapes). ``baseline="uniform"`` draws from ``generator``.
    All T perturbed copies go through the model in one call unless ``max_batch_size`` bounds
    the rows per call: set it for large T (one pixel per step on 224 x 224 is T = 50176).

    Example::

        metric = PixelFlipping(model, image_size=(32, 32), features_in_step=16)
        metric.update(images, labels, maps)
        metric.compute().auc
    """

    def __init__(self, forward: Forward, image_size: Tuple[int, int], features_in_step: int = 1,
                 baseline: Baseline = "black", softmax: bool = True, absolute: bool = False,
                 normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 max_batch_size: Optional[int] = None, uniform_range: Tuple[float, float] = (0.0, 1.0),
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(forward, baseline, softmax, absolute, normalize, max_batch_size, uniform_range, generator)
        self.image_size = _require_size(image_size)
        self.features_in_step = require_positive_int("features_in_step", features_in_step)
        self.steps = math.ceil(self.image_size[0] * self.image_size[1] / self.features_in_step)
        self._add_state("curve", (self.steps,), exact=True)
        self._add_state("count")

    def per_example(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
        """The curves (B, T), float64: the label's score after each step."""
        images, labels, maps = self._inputs(images, labels, maps)
        if tuple(images.shape[2:]) != self.image_size:
            raise InputError(f"images are {tuple(images.shape[2:])} but the metric was built for image_size="
                             f"{self.image_size}. Build one metric per image size.")
        order = stable_order(maps.reshape(maps.shape[0], -1), descending=True)
        s = self.features_in_step
        steps = [order[:, t * s:(t + 1) * s] for t in range(self.steps)]
        logits = cumulative_logits(self.forward, images, steps, self._fill(), self.normalize, self.max_batch_size,
                                   labels=labels)
        return target_scores(logits, labels, self.softmax).T.cpu()

    def compute(self) -> CurveResult:
        return mean_curve("pixel_flipping", range(1, self.steps + 1), self._value("curve"), self._state["count"],
                          higher_is_better=False, x_label=f"step ({self.features_in_step} pixels each)",
                          y_label="probability" if self.softmax else "logit")


class RegionPerturbation(PerturbationCurve):
    """Drop of the explained class's score as patches are replaced, in order of their summed relevance.

    The image is cut into non-overlapping ``patch_size`` squares (row-major). When H or W is no
    multiple of ``patch_size`` it is padded as Quantus pads it: ``floor`` / ``ceil`` of the
    missing rows (columns) before / after, the image by edge values, the map by zeros; the
    baseline is read from the padded image, the model sees it cropped. Patches are ranked by
    their map sum (``"morf"``: most relevant first, ``"lerf"``: least, ``"random"``: a
    permutation from ``generator``); after replacing the first ``k = 1..R`` of them

        y_k = p(label | x) - p(label | x with k patches replaced)
        AUC = trapezoid of the mean curve over images, dx = 1

    ``R = regions_evaluation`` must not exceed the number of patches (Quantus would silently
    return shorter curves). Higher AUC is better for MoRF (AOPC), lower for LeRF.

    Example::

        metric = RegionPerturbation(model, patch_size=4, regions_evaluation=16)
        metric.update(images, labels, maps)
        metric.compute().auc
    """

    def __init__(self, forward: Forward, patch_size: int = 8, order: str = "morf", regions_evaluation: int = 100,
                 baseline: Baseline = "black", softmax: bool = True, absolute: bool = False,
                 normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 max_batch_size: Optional[int] = None, uniform_range: Tuple[float, float] = (0.0, 1.0),
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__(forward, baseline, softmax, absolute, normalize, max_batch_size, uniform_range, generator)
        require_choice("order", order, ("morf", "lerf", "random"))
        self.patch_size = require_positive_int("patch_size", patch_size)
        self.order = order
        self.regions_evaluation = require_positive_int("regions_evaluation", regions_evaluation)
        self._add_state("curve", (self.regions_evaluation,), exact=True)
        self._add_state("count")

    def per_example(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
        """The curves (B, R), float64: score drop after each replaced patch."""
        images, labels, maps = self._inputs(images, labels, maps)
        batch, _, height, width = images.shape
        size = self.patch_size
        (top, bottom), (left, right) = _padding(height, size), _padding(width, size)
        padded_maps = F.pad(maps, (left, right, top, bottom))
        padded = F.pad(images, (left, right, top, bottom), mode="replicate") if top + bottom + left + right else images
        rows, cols = padded.shape[2] // size, padded.shape[3] // size
        if self.regions_evaluation > rows * cols:
            raise InputError(f"regions_evaluation={self.regions_evaluation} but {tuple(images.shape[2:])} images hold "
                             f"only {rows * cols} patches of {size}x{size}. Lower regions_evaluation or patch_size.")
        sums = padded_maps.reshape(batch, rows, size, cols, size).sum(dim=(2, 4)).reshape(batch, -1)
        if self.order == "random":
            ranking = torch.stack([torch.randperm(rows * cols, generator=self.generator) for _ in range(batch)])
        else:
            ranking = stable_order(sums, descending=self.order == "morf").cpu()  # indexes the CPU patch table
        # Flat pixel indices (into the padded image) of every patch, row-major within the patch.
        corner = (torch.arange(rows)[:, None] * size * padded.shape[3] + torch.arange(cols)[None, :] * size).reshape(-1)
        offsets = (torch.arange(size)[:, None] * padded.shape[3] + torch.arange(size)[None, :]).reshape(-1)
        patch_pixels = corner[:, None] + offsets[None, :]
        steps = [patch_pixels[ranking[:, k]] for k in range(self.regions_evaluation)]

        def view(image):
            return self.normalize(image[:, :, top:top + height, left:left + width])

        logits = cumulative_logits(self.forward, padded, steps, self._fill(), view, self.max_batch_size,
                                   include_start=True, labels=labels)
        scores = target_scores(logits, labels, self.softmax)
        return (scores[0:1] - scores[1:]).T.cpu()

    def compute(self) -> CurveResult:
        return mean_curve(f"region_perturbation_{self.order}", range(1, self.regions_evaluation + 1),
                          self._value("curve"), self._state["count"], higher_is_better=self.order == "morf",
                          x_label=f"patches replaced ({self.patch_size}x{self.patch_size})",
                          y_label="score drop")


def _padding(length: int, patch: int) -> Tuple[int, int]:
    missing = (-length) % patch
    return missing // 2, missing - missing // 2


def _require_size(image_size) -> Tuple[int, int]:
    size = tuple(image_size) if isinstance(image_size, (tuple, list)) else None
    if size is None or len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size):
        raise InputError(f"image_size={image_size!r} must be (height, width), two positive ints.")
    return size
