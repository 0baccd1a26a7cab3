"""Class specificity of saliency maps on canvases holding two objects of different classes."""
from __future__ import annotations

import torch

from ..accumulator import Accumulator, exact_sum
from ..results import SpecificityResult
from ..validation import require_finite, require_same_shape, require_tensor


def positive_mass(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``sum(relu(map) * mask)`` per image, (B,)."""
    return (maps.clamp(min=0) * masks).sum(dim=(1, 2))


class ClassSpecificity(Accumulator):
    """Share of a map's positive relevance that falls on the object of the explained class.

    For the map explaining class ``x`` (object mask ``mask_x``; the other object ``mask_y``)::

        share_x = sum(relu(map_x) * mask_x) / (sum(relu(map_x) * mask_x) + sum(relu(map_x) * mask_y))

    and ``specificity`` is the mean of ``share_a`` and ``share_b`` over all examples. A map
    that ignores the target (the same map for both classes) scores exactly 0.5; a map that
    lights up only the explained object scores 1.0. A direction whose map has no positive
    relevance on either object has an undefined share: it is left out of the mean and counted
    in ``excluded`` (so ``count + excluded = 2 * examples``). NaN or infinite maps or masks are
    refused, not excluded.

    Example::

        metric = ClassSpecificity()
        metric.update(maps_for_a, maps_for_b, masks_a, masks_b)   # (B, H, W) each
        metric.compute().specificity
    """

    def __init__(self) -> None:
        super().__init__()
        self._add_state("share_sum", exact=True)
        self._add_state("count")
        self._add_state("excluded")

    def update(self, maps_a: torch.Tensor, maps_b: torch.Tensor, masks_a: torch.Tensor, masks_b: torch.Tensor) -> None:
        """Add a batch of maps explaining class a and class b and the two objects' masks, all (B, H, W)."""
        names = ("maps_a", "maps_b", "masks_a", "masks_b")
        tensors = [require_tensor(n, t, ndim=(3,)).detach().to(torch.float64) for n, t in
                   zip(names, (maps_a, maps_b, masks_a, masks_b))]
        require_same_shape(names, tensors)
        for name, tensor in zip(names, tensors):  # a NaN map would count as "excluded", an infinite one as NaN
            require_finite(name, tensor)
        maps_a, maps_b, masks_a, masks_b = tensors
        masks_a, masks_b = (masks_a != 0).double(), (masks_b != 0).double()
        on_own = torch.cat([positive_mass(maps_a, masks_a), positive_mass(maps_b, masks_b)])
        on_other = torch.cat([positive_mass(maps_a, masks_b), positive_mass(maps_b, masks_a)])
        total = on_own + on_other
        defined = total > 0
        safe_total = torch.where(defined, total, torch.ones_like(total))
        share = torch.where(defined, on_own / safe_total, torch.zeros_like(total))
        self._add("share_sum", exact_sum(share))
        self._add("count", defined.sum())
        self._add("excluded", (~defined).sum())

    def compute(self) -> SpecificityResult:
        count = int(self._state["count"].item())
        value = float(self._value("share_sum")) / count if count else float("nan")
        return SpecificityResult(name="class_specificity", specificity=value, count=count,
                                 excluded=int(self._state["excluded"].item()))
