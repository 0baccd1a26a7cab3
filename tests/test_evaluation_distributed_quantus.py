"""The Quantus-defined metrics (PixelFlipping, RegionPerturbation, ROAD, Monotonicity), sharded over
2 gloo processes and reduced with all_reduce_metrics, equal one process bit for bit."""
import torch
from distributed_runs import assert_reduced_equals_single, sharded_and_reduced_states

from captum_transformers.evaluation.monotonicity import Monotonicity
from captum_transformers.evaluation.images.pixel_flipping import PixelFlipping, RegionPerturbation
from captum_transformers.evaluation.images.road import ROAD

N, SIZE = 9, 6
WEIGHTS = torch.randn(3 * SIZE * SIZE, 3, generator=torch.Generator().manual_seed(1))


def image_model(x):
    return x.reshape(x.shape[0], -1) @ WEIGHTS


def dataset():
    g = torch.Generator().manual_seed(0)
    return (torch.rand(N, 3, SIZE, SIZE, generator=g), torch.randint(0, 3, (N,), generator=g),
            torch.randn(N, SIZE, SIZE, generator=g))


def new_metrics():
    return [PixelFlipping(image_model, (SIZE, SIZE), features_in_step=4),
            PixelFlipping(image_model, (SIZE, SIZE), features_in_step=6, baseline="mean", softmax=False),
            RegionPerturbation(image_model, 2, "morf", 9), RegionPerturbation(image_model, 4, "lerf", 4),
            ROAD(image_model, "morf", percentages=(10, 50, 90), noise=0.0),
            ROAD(image_model, "lerf", percentages=(10, 50, 90), noise=0.0),
            Monotonicity(image_model, features_in_step=9)]


def evaluate(indices, batch_size):
    images, labels, maps = dataset()
    metrics = new_metrics()
    indices = list(indices)
    for start in range(0, len(indices), batch_size):
        rows = indices[start:start + batch_size]
        for metric in metrics:
            metric.update(images[rows], labels[rows], maps[rows])
    return metrics




def test_sharded_and_reduced_equals_single_process_exactly(tmp_path):
    reduced_states = sharded_and_reduced_states(evaluate, N, tmp_path)
    single = evaluate(range(N), batch_size=4)  # other batch boundaries too
    assert single[-1].compute().count == N
    assert_reduced_equals_single(single, reduced_states)
