"""ROAD: RemOve And Debias (Rong, Leemann et al., "A Consistent and Efficient Evaluation Strategy
for Attribution Methods", ICML 2022), with noisy linear imputation, as ``quantus.ROAD`` (0.6.0)
computes it.

Removing pixels by a constant leaks the mask's shape to the model; ROAD instead *imputes* the
removed pixels from their neighbours. Each removed pixel ``i`` takes the weighted mean of its
valid (inside the image) neighbours ``j`` — weight 1/6 for the four direct, 1/12 for the four
diagonal ones — where removed neighbours are unknowns too, giving for every channel the sparse
linear system

    s_i u_i - sum_{j removed} w_ij u_j = sum_{j kept} w_ij x_j,   s_i = sum_{j valid} w_ij

(symmetric positive definite while one pixel is kept), then ``u + noise * N(0, 1)`` replaces
the removed pixels. It is solved here with batched conjugate gradients in float64 (the matrix
applied as a 3x3 convolution), so it needs no SciPy and runs on the images' device. It
matches SciPy's direct solve (Quantus) to ~1e-13. Cost grows with the holes: one 3 x 224 x 224
image takes 0.2 s (10 % removed) to 3 s (99 %) on one CPU thread, a 200-row hole 7 s (SciPy:
0.6-1.9 s); 32 x 32 images take milliseconds. A looser ``tolerance`` (e.g. 1e-8, still far
below float32 resolution) saves a quarter to a third of the iterations.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..accumulator import Accumulator
from ..batched_forward import Forward, check_max_batch_size, logits_per_step
from ..curves import mean_curve
from ..results import CurveResult
from .saliency_maps import image_batch
from ..tokens.token_flipping import stable_order
from ..validation import require_choice, require_tensor

ROAD_PERCENTAGES = tuple(range(1, 100, 2))
"""1, 3, ..., 99: the percentages of pixels removed (Quantus' default)."""

_NEIGHBOURS = ((1 / 12, 1 / 6, 1 / 12), (1 / 6, 0.0, 1 / 6), (1 / 12, 1 / 6, 1 / 12))


def noisy_linear_imputation(images: torch.Tensor, removed: torch.Tensor, noise: float = 0.01,
                            generator: Optional[torch.Generator] = None, tolerance: float = 1e-13,
                            max_iterations: Optional[int] = None) -> torch.Tensor:
    """``images`` (N, C, H, W) with the ``removed`` (N, H, W) pixels imputed from their neighbours.

    Solves the system of the module docstring per image and channel by conjugate gradients
    until the residual is below ``tolerance`` times the right-hand side's norm (at most
    ``max_iterations``, default ``2 H W + 100``; not converging raises ``InputError``), then
    adds ``noise`` times standard normal draws from ``generator``. Returned in the images' dtype.

    >>> image = torch.tensor([[[[0.0, 0.0, 0.0], [0.0, 9.0, 0.0], [0.0, 0.0, 0.0]]]])
    >>> float(noisy_linear_imputation(image, torch.tensor([[[False, False, False], [False, True, False],
    ...                                                    [False, False, False]]]), noise=0.0)[0, 0, 1, 1])
    0.0
    """
    images = require_tensor("images", images, ndim=(4,))
    batch, channels, height, width = images.shape
    removed = require_tensor("removed", removed, ndim=(3,))
    if tuple(removed.shape) != (batch, height, width):
        raise InputError(f"removed has shape {tuple(removed.shape)} but the images need {(batch, height, width)}: "
                         "one (H, W) mask per image.")
    if bool(removed.reshape(batch, -1).all(dim=1).any()):
        raise InputError("A mask removes every pixel of its image; imputation needs at least one kept pixel.")
    x = images.detach().to(torch.float64)
    hole = removed.to(device=x.device, dtype=torch.float64)[:, None]
    kernel = torch.tensor(_NEIGHBOURS, dtype=torch.float64, device=x.device).reshape(1, 1, 3, 3)

    def spread(u: torch.Tensor) -> torch.Tensor:  # sum_j w_ij u_j over the neighbours inside the image
        return F.conv2d(u.reshape(-1, 1, height, width), kernel, padding=1).reshape(u.shape)

    weight_sum = spread(torch.ones(1, 1, height, width, dtype=torch.float64, device=x.device))

    def apply(u: torch.Tensor) -> torch.Tensor:
        return (weight_sum * u - spread(u)) * hole

    rhs = spread(x * (1 - hole)) * hole
    solution = torch.zeros_like(rhs)
    residual = rhs.clone()
    direction = residual.clone()
    squared = (residual * residual).sum(dim=(2, 3), keepdim=True)
    limit = (tolerance ** 2) * squared
    limit_iterations = max_iterations if max_iterations is not None else 2 * height * width + 100
    for _ in range(limit_iterations):
        active = squared > limit
        if not bool(active.any()):
            break
        applied = apply(direction)
        step = torch.where(active, squared / (direction * applied).sum(dim=(2, 3), keepdim=True), 0.0)
        solution = solution + step * direction
        residual = residual - step * applied
        new_squared = (residual * residual).sum(dim=(2, 3), keepdim=True)
        direction = residual + torch.where(active, new_squared / squared, 0.0) * direction
        squared = torch.where(active, new_squared, squared)
    else:
        if bool((squared > limit).any()):
            raise InputError(f"The ROAD imputation did not converge in {limit_iterations} conjugate-gradient "
                             f"iterations (tolerance={tolerance}). Raise max_iterations or the tolerance.")
    if noise:
        draws = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.device)
        solution = solution + noise * draws
    return torch.where(hole.bool(), solution, x).to(images.dtype)


class ROAD(Accumulator):
    """Top-1 accuracy as the most (``"morf"``) or least (``"lerf"``) relevant pixels are imputed.

    For each percentage ``p`` the ``int(H * W * p / 100)`` pixels ranked first (stable sort of
    the map, descending for MoRF, ascending for LeRF; ``absolute=True`` ranks ``|map|``) are
    removed from the original image and imputed (``noisy_linear_imputation``), and

        curve(p) = mean over images of 1[argmax forward(normalize(x_p)) == label]
        AUC = trapezoid(curve, p / 100)

    Quantus' ``ROAD`` is MoRF and returns ``{p: curve(p)}``; its LeRF is MoRF of ``-map``.
    A faithful map drops MoRF accuracy fast (lower AUC better) and keeps LeRF accuracy (higher
    better). Noise comes from ``generator``: pass ``noise=0.0`` for a deterministic metric
    (batch == single and the torchrun property then hold bit for bit).

    Example::

        metric = ROAD(model, order="morf", generator=torch.Generator().manual_seed(0))
        metric.update(images, labels, maps)
        metric.compute().y   # accuracy per percentage
    """

    def __init__(self, forward: Forward, order: str = "morf", percentages: Sequence[float] = ROAD_PERCENTAGES,
                 noise: float = 0.01, generator: Optional[torch.Generator] = None, absolute: bool = False,
                 normalize: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 max_batch_size: Optional[int] = None, tolerance: float = 1e-13,
                 max_iterations: Optional[int] = None) -> None:
        super().__init__()
        require_choice("order", order, ("morf", "lerf"))
        values = tuple(percentages)
        if not values or any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 100
                             for p in values) or any(b <= a for a, b in zip(values, values[1:])):
            raise InputError(f"percentages={values} must be strictly increasing numbers in [0, 100), "
                             "e.g. ROAD_PERCENTAGES (1, 3, ..., 99).")
        if not isinstance(noise, (int, float)) or isinstance(noise, bool) or noise < 0:
            raise InputError(f"noise={noise!r} must be a non-negative number (the standard deviation; 0 for none).")
        self.forward = forward
        self.order = order
        self.percentages = values
        self.noise = float(noise)
        self.generator = generator
        self.absolute = bool(absolute)
        self.normalize = normalize if normalize is not None else (lambda images: images)
        self.max_batch_size = check_max_batch_size(max_batch_size)
        self.tolerance = tolerance
        self.max_iterations = max_iterations
        self._add_state("correct", (len(values),))
        self._add_state("count")

    def per_example(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
        """Correct (True) or not per image and percentage, (B, P): Quantus' per-sample output."""
        images, labels, maps = image_batch(images, labels, maps)
        batch, channels, height, width = images.shape
        key = (maps.abs() if self.absolute else maps).reshape(batch, -1)
        order = stable_order(key, descending=self.order == "morf")
        pixels = height * width
        counts = [int(pixels * p / 100) for p in self.percentages]  # Quantus' int(a_size * p / 100)

        def build(steps):
            removed = torch.zeros(len(steps), batch, pixels, dtype=torch.bool)
            for row, step in enumerate(steps):
                removed[row].scatter_(1, order[:, :counts[step]].cpu(), True)
            stacked = images.repeat(len(steps), 1, 1, 1)
            imputed = noisy_linear_imputation(stacked, removed.reshape(-1, height, width), self.noise,
                                              self.generator, self.tolerance, self.max_iterations)
            return self.normalize(imputed)

        logits = logits_per_step(self.forward, build, len(counts), batch, self.max_batch_size, labels=labels)
        return (logits.argmax(dim=-1).cpu() == labels.cpu()).T

    def update(self, images: torch.Tensor, labels: torch.Tensor, maps: torch.Tensor) -> None:
        """Add a batch: images (B, C, H, W) as the model reads them (before ``normalize``),
        labels (B,), maps (B, H, W) / (B, 1|C, H, W)."""
        correct = self.per_example(images, labels, maps)
        self._add("correct", correct.sum(dim=0))
        self._add("count", torch.tensor(correct.shape[0]))

    def compute(self) -> CurveResult:
        return mean_curve(f"road_{self.order}", self.percentages, self._state["correct"], self._state["count"],
                          auc_scale=0.01, higher_is_better=self.order == "lerf", y_label="top-1 accuracy",
                          x_label="% of pixels imputed")
