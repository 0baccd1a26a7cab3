"""Metrics refuse what they cannot score: non-finite or empty segmentation batches, merges and all-reduces of
metrics built differently, and a second reduction of the same metric (2 gloo processes on the CPU)."""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from captum_transformers.errors import InputError
from captum_transformers.evaluation import (ClassSpecificity, CompletenessError, RiseDeletion, SegmentationScores,
                                            TokenActivation, TokenPruning, all_reduce_metrics)


def segmentation_batch(n=2, size=6):
    maps = torch.rand(n, size, size, generator=torch.Generator().manual_seed(0))
    masks = torch.zeros(n, size, size, dtype=torch.bool)
    masks[:, 1:4, 2:5] = True
    return maps, masks


# --- finite maps, empty batches -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_segmentation_refuses_non_finite_maps(bad):
    maps, masks = segmentation_batch()
    maps[0, 0, 0] = bad
    metric = SegmentationScores()
    with pytest.raises(InputError, match="maps holds NaN or infinite"):
        metric.update(maps, masks)
    assert metric.compute().count == 0  # nothing was added


def test_segmentation_refuses_non_finite_masks():
    maps, masks = segmentation_batch()
    masks = masks.double()
    masks[1, 2, 2] = float("nan")
    with pytest.raises(InputError, match="masks holds NaN or infinite"):
        SegmentationScores().update(maps, masks)


def test_segmentation_refuses_an_empty_batch_like_the_other_metrics():
    maps, masks = segmentation_batch()
    metric = SegmentationScores()
    with pytest.raises(InputError, match="batch is empty"):
        metric.update(maps[:0], masks[:0])
    with pytest.raises(InputError, match="batch is empty"):  # the same answer as CompletenessError's
        CompletenessError().update(torch.zeros(0, 3), torch.zeros(0))
    metric.update(maps, masks)
    assert metric.compute().count == 2


def test_class_specificity_refuses_non_finite_maps():
    maps, masks = segmentation_batch()
    bad = maps.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(InputError, match="maps_a holds NaN or infinite"):
        ClassSpecificity().update(bad, maps, masks, ~masks)
    bad[0, 0, 0] = float("inf")
    with pytest.raises(InputError, match="maps_b holds NaN or infinite"):
        ClassSpecificity().update(maps, bad, masks, ~masks)


# --- merge ------------------------------------------------------------------------------------------------------


def completeness(relative, tolerance=1e-2):
    metric = CompletenessError(relative=relative, tolerance=tolerance)
    metric.update(torch.tensor([[1.0, 2.0]]), torch.tensor([31.0]))  # error 28, relative 28 / 31
    return metric


def test_merge_refuses_different_options_naming_both():
    relative, absolute = completeness(True), completeness(False)
    before = {k: v.clone() for k, v in relative.state().items()}
    with pytest.raises(InputError, match="relative") as caught:
        relative.merge(absolute)
    message = str(caught.value)
    assert "CompletenessError(relative=False, tolerance=0.01)" in message
    assert "CompletenessError(relative=True, tolerance=0.01)" in message
    assert all(torch.equal(before[k], v) for k, v in relative.state().items())  # left untouched
    with pytest.raises(InputError, match="tolerance"):
        completeness(True, 1e-2).merge(completeness(True, 1e-3))


def test_merge_refuses_same_shaped_states_of_other_options_or_class():
    forward = lambda x: x.reshape(x.shape[0], -1)[:, :3]  # noqa: E731
    with pytest.raises(InputError, match="fractions"):
        RiseDeletion(forward, fractions=(0.0, 0.5, 1.0)).merge(RiseDeletion(forward, fractions=(0.0, 0.25, 1.0)))
    with pytest.raises(InputError, match="TokenPruning"):
        TokenActivation(forward, 1).merge(TokenPruning(forward, 1))


def test_merge_accepts_same_options_and_ignores_max_batch_size():
    merged = completeness(True).merge(completeness(True))
    assert merged.compute().count == 2
    forward = lambda x: x  # noqa: E731
    assert TokenActivation(forward, 1, max_batch_size=4).merge(TokenActivation(forward, 1)).options() == \
        TokenActivation(forward, 1).options()
    assert "forward" not in TokenActivation(forward, 1).options()  # callables are not compared


def test_a_reduced_metric_takes_no_more_data_until_reset():
    metric = completeness(True)
    metric.mark_reduced()
    assert metric.reduced
    with pytest.raises(InputError, match="all_reduce_metrics"):
        metric.update(torch.tensor([[1.0]]), torch.tensor([2.0]))
    with pytest.raises(InputError, match="all_reduce_metrics"):
        metric.merge(completeness(True))
    with pytest.raises(InputError, match="all_reduce_metrics"):
        completeness(True).merge(metric)
    assert metric.compute().count == 1
    other = completeness(True)
    other.mark_reduced()
    assert metric.merge(other).compute().count == 2  # totals of two reduced evaluations add up
    metric.reset()
    assert not metric.reduced
    metric.update(torch.tensor([[1.0]]), torch.tensor([2.0]))
    assert metric.compute().count == 1


# --- all_reduce_metrics over 2 gloo processes -------------------------------------------------------------------


def _attempt(action):
    """'ok' or the InputError's message; any other error propagates."""
    try:
        action()
        return "ok"
    except InputError as error:
        return str(error)


def _states(metrics):
    return [{k: v.clone() for k, v in m.state().items()} for m in metrics]


def _worker(rank, world_size, init_file, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    forward = lambda x: x  # noqa: E731
    out = {}
    try:
        # Same class and state shapes, different options: relative on rank 0, absolute on rank 1.
        mixed = [completeness(rank == 0)]
        before = _states(mixed)
        out["options"] = _attempt(lambda: all_reduce_metrics(mixed))
        out["options_untouched"] = all(torch.equal(before[0][k], v) for k, v in mixed[0].state().items())
        # Different classes with equal states.
        kinds = [TokenActivation(forward, 1) if rank == 0 else TokenPruning(forward, 1)]
        out["class"] = _attempt(lambda: all_reduce_metrics(kinds))
        # A different number of metrics: no rank may hang in a collective the other skips.
        counted = [completeness(True)] * (1 + rank)
        out["count"] = _attempt(lambda: all_reduce_metrics(counted))
        # Something that is not a metric on one rank only.
        strays = [completeness(True) if rank == 0 else object()]
        out["stray"] = _attempt(lambda: all_reduce_metrics(strays))
        # Reducing twice.
        metric = completeness(True)
        out["first"] = _attempt(lambda: all_reduce_metrics([metric]))
        out["count_after_first"] = metric.compute().count
        out["second"] = _attempt(lambda: all_reduce_metrics([metric]))
        out["count_after_second"] = metric.compute().count
        out["update_after"] = _attempt(lambda: metric.update(torch.tensor([[1.0]]), torch.tensor([2.0])))
        # Only rank 0 starts over: the ranks disagree, and both say so.
        if rank == 0:
            metric.reset()
            metric.update(torch.tensor([[1.0]]), torch.tensor([2.0]))
        out["half_reset"] = _attempt(lambda: all_reduce_metrics([metric]))
        # Both start over: a new evaluation reduces again.
        if rank == 1:
            metric.reset()
            metric.update(torch.tensor([[1.0]]), torch.tensor([2.0]))
        out["after_reset"] = _attempt(lambda: all_reduce_metrics([metric]))
        out["count_after_reset"] = metric.compute().count
    finally:
        dist.destroy_process_group()
    torch.save(out, f"{out_file}.{rank}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trust3")
    mp.spawn(_worker, args=(2, str(folder / "init"), str(folder / "out")), nprocs=2, join=True)
    return [torch.load(f"{folder / 'out'}.{rank}") for rank in range(2)]


def test_all_reduce_refuses_different_options_on_every_rank(outcomes):
    for out in outcomes:
        assert "rank 1" in out["options"] and "rank 0" in out["options"]
        assert "CompletenessError(relative=False, tolerance=0.01)" in out["options"]
        assert "CompletenessError(relative=True, tolerance=0.01)" in out["options"]
        assert "options relative differ" in out["options"]
        assert out["options_untouched"]


def test_all_reduce_refuses_different_classes_and_counts(outcomes):
    for out in outcomes:
        assert "TokenPruning" in out["class"] and "TokenActivation" in out["class"] and "rank 1" in out["class"]
        assert "2 metrics" in out["count"] and "1 metric" in out["count"]
        assert "of type object, not an Accumulator, on rank 1" in out["stray"]


def test_a_second_reduction_is_refused_and_counts_stay(outcomes):
    for out in outcomes:
        assert out["first"] == "ok" and out["count_after_first"] == 2
        assert "already holds the totals" in out["second"]
        assert out["count_after_second"] == 2
        assert "reset()" in out["update_after"]
        assert "already holds the totals" in out["half_reset"] and "rank 1" in out["half_reset"]
        assert out["after_reset"] == "ok" and out["count_after_reset"] == 2
