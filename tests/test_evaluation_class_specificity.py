"""ClassSpecificity: class-agnostic maps give exactly 0.5, perfect maps 1.0, undefined shares are excluded."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import ClassSpecificity


def canvases(n=6, size=12):
    masks_a = torch.zeros(n, size, size, dtype=torch.bool)
    masks_b = torch.zeros(n, size, size, dtype=torch.bool)
    masks_a[:, 1:5, 1:5] = True
    masks_b[:, 6:11, 5:10] = True
    return masks_a, masks_b


def specificity(maps_a, maps_b, masks_a, masks_b):
    metric = ClassSpecificity()
    metric.update(maps_a, maps_b, masks_a, masks_b)
    return metric.compute()


@pytest.mark.parametrize("seed", range(5))
def test_class_agnostic_maps_give_exactly_one_half(seed):
    masks_a, masks_b = canvases()
    shared = torch.randn(6, 12, 12, generator=torch.Generator().manual_seed(seed))
    result = specificity(shared, shared, masks_a, masks_b)
    assert result.specificity == 0.5 and result.count == 12 and result.excluded == 0


def test_perfect_reversed_and_known_partial_maps():
    masks_a, masks_b = canvases()
    noise = torch.rand(6, 12, 12)
    assert specificity(masks_a * noise, masks_b * noise, masks_a, masks_b).specificity == 1.0
    assert specificity(masks_b * noise, masks_a * noise, masks_a, masks_b).specificity == 0.0
    # Map a: 3 units on object a, 1 on object b (share 3/4); map b: negative relevance is ignored (share 1).
    map_a = 3 * masks_a.double() / 16 + masks_b.double() / 25
    map_b = masks_b.double() - 5 * masks_a.double()
    assert specificity(map_a, map_b, masks_a, masks_b).specificity == pytest.approx(0.875, abs=1e-9)


def test_directions_without_positive_mass_are_excluded_and_counted():
    masks_a, masks_b = canvases(n=2)
    maps_a = masks_a.double()
    maps_b = -torch.ones(2, 12, 12)  # no positive relevance anywhere: share undefined
    result = specificity(maps_a, maps_b, masks_a, masks_b)
    assert result.specificity == 1.0 and result.count == 2 and result.excluded == 2
    nothing = specificity(maps_b, maps_b, masks_a, masks_b)
    assert nothing.count == 0 and nothing.excluded == 4 and nothing.specificity != nothing.specificity


def test_two_updates_equal_one_update_on_the_concatenation():
    masks_a, masks_b = canvases()
    maps_a, maps_b = torch.randn(6, 12, 12), torch.randn(6, 12, 12)
    whole, split = ClassSpecificity(), ClassSpecificity()
    whole.update(maps_a, maps_b, masks_a, masks_b)
    split.update(maps_a[:4], maps_b[:4], masks_a[:4], masks_b[:4])
    split.update(maps_a[4:], maps_b[4:], masks_a[4:], masks_b[4:])
    assert all(torch.equal(whole.state()[k], split.state()[k]) for k in whole.state())


def test_bad_inputs_raise_input_error():
    masks_a, masks_b = canvases()
    with pytest.raises(InputError, match="shape"):
        ClassSpecificity().update(torch.rand(6, 12, 11), torch.rand(6, 12, 12), masks_a, masks_b)
    with pytest.raises(InputError, match="dims"):
        ClassSpecificity().update(torch.rand(12, 12), torch.rand(12, 12), masks_a[0], masks_b[0])
