"""Completeness error |sum R - s| / |s| (LibraGrad) on hand-computed cases and a conservative linear model."""
import math

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.completeness import (CompletenessError, CompletenessResult, bin_upper_edge,
                                                         error_bins)


def states_equal(a, b):
    return all(torch.equal(a.state()[k], b.state()[k]) for k in a.state())


def test_by_hand():
    metric = CompletenessError(tolerance=0.1)
    metric.update(torch.tensor([[1.0, 2.0], [3.0, 4.0], [-1.0, -1.0]]), torch.tensor([4.0, 7.0, -4.0]))
    result = metric.compute()
    # sums 3, 7, -2 against 4, 7, -4: relative errors 1/4, 0, 1/2
    assert result.mean_error == pytest.approx(0.25, abs=1e-12)
    assert result.max_error == 0.5 * (1 + 2 ** -8)  # 0.5 opens its bin; the bound is the bin's upper edge
    assert (result.count, result.above_tolerance, result.relative) == (3, 2, True)
    absolute = CompletenessError(relative=False)
    absolute.update(torch.tensor([[1.0, 2.0], [3.0, 4.0], [-1.0, -1.0]]), torch.tensor([4.0, 7.0, -4.0]))
    assert absolute.compute().mean_error == pytest.approx(1.0, abs=1e-12)


def test_input_times_gradient_of_a_linear_model_is_complete():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 3, generator=generator, dtype=torch.float64)
    inputs = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    targets = torch.tensor([0, 1, 2, 1, 0])
    relevance = inputs * weight[:, targets].T  # x * d logit_t / dx, no bias: sums to the logit
    metric = CompletenessError(tolerance=1e-9)
    metric.update(relevance, (inputs @ weight).gather(1, targets[:, None]).squeeze(1))
    result = metric.compute()
    assert result.mean_error < 1e-12 and result.max_error < 1e-12 and result.above_tolerance == 0
    halved = CompletenessError()
    halved.update(relevance / 2, (inputs @ weight).gather(1, targets[:, None]).squeeze(1))
    assert halved.compute().mean_error == pytest.approx(0.5, abs=1e-12) and halved.compute().above_tolerance == 5


def test_max_error_is_a_tight_upper_bound():
    errors = torch.rand(200, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 30
    metric = CompletenessError(relative=False)
    metric.update(errors[:, None], torch.zeros(200, dtype=torch.float64))
    bound = metric.compute().max_error
    assert errors.max().item() < bound <= errors.max().item() * (1 + 2 ** -8)
    bins = error_bins(torch.tensor([0.0, 2.0 ** -41, 2.0 ** -40, 3.0], dtype=torch.float64))
    assert bins[0] == bins[1] == 0 and bin_upper_edge(0) == 2.0 ** -40 and bins[2] == 1
    assert bin_upper_edge(int(bins[3])) == 3.0 + 2.0 ** -7


def test_batch_of_three_equals_three_updates_and_merge_is_exact():
    generator = torch.Generator().manual_seed(2)
    relevance, scores = torch.randn(3, 4, 5, generator=generator), torch.randn(3, generator=generator)
    whole, split = CompletenessError(), CompletenessError()
    whole.update(relevance, scores)
    parts = [CompletenessError() for _ in range(3)]
    for i in range(3):
        split.update(relevance[i:i + 1], scores[i:i + 1])
        parts[i].update(relevance[i:i + 1], scores[i:i + 1])
    assert states_equal(whole, split) and states_equal(whole, parts[2].merge(parts[1]).merge(parts[0]))
    assert whole.compute() == split.compute()
    assert CompletenessResult.from_dict(whole.compute().to_dict()) == whole.compute()


def test_bad_inputs_raise_input_error():
    metric = CompletenessError()
    with pytest.raises(InputError, match="exactly 0"):
        metric.update(torch.ones(2, 3), torch.tensor([1.0, 0.0]))
    with pytest.raises(InputError, match="batch size"):
        metric.update(torch.ones(2, 3), torch.tensor([1.0]))
    with pytest.raises(InputError, match="NaN"):
        metric.update(torch.ones(1, 3), torch.tensor([math.nan]))
    with pytest.raises(InputError, match="dims"):
        metric.update(torch.ones(2, 3), torch.ones(2, 1))
    with pytest.raises(InputError, match="tolerance"):
        CompletenessError(tolerance=-1.0)
    with pytest.raises(InputError, match="relative"):
        CompletenessError(relative=1)
    assert metric.compute().count == 0 and math.isnan(metric.compute().mean_error)
