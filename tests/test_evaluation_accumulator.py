"""Exact fixed-point sums and the accumulator's merge / reset."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import ClassSpecificity, exact_sum, limbs_value


@pytest.mark.parametrize("scale", [1.0, 1e-8, 1e3])
def test_exact_sum_is_independent_of_grouping_and_keeps_small_values(scale):
    values = scale * torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grouped = exact_sum(values[:333]) + exact_sum(values[333:700]) + exact_sum(values[700:])
    assert torch.equal(grouped, exact_sum(values))
    assert float(limbs_value(grouped)) == pytest.approx(float(values.sum()), abs=1000 * 2.0 ** -40)


def test_exact_sum_reduces_along_a_dim():
    values = torch.tensor([[0.25, -0.5], [1.0, 2.0]])
    assert limbs_value(exact_sum(values, dim=1)).tolist() == [-0.25, 3.0]


def test_exact_sum_refuses_values_it_cannot_hold():
    with pytest.raises(InputError, match="magnitude"):
        exact_sum(torch.tensor([1e9]))
    with pytest.raises(InputError, match="magnitude"):
        exact_sum(torch.tensor([float("nan")]))


def test_merge_adds_states_and_refuses_other_kinds():
    masks = torch.zeros(2, 4, 4, dtype=torch.bool)
    masks[:, :2] = True
    a, b = ClassSpecificity(), ClassSpecificity()
    a.update(masks.double(), masks.double(), masks, ~masks)
    b.update(masks.double(), masks.double(), masks, ~masks)
    assert a.merge(b).state()["count"].item() == 8  # 2 examples x 2 directions, twice
    assert a.compute().specificity == 0.5  # map b lies on object a: shares 1 and 0
    with pytest.raises(InputError, match="merge"):
        a.merge(object())
    a.reset()
    assert a.state()["count"].item() == 0 and not a.state()["share_sum"].any()
