"""The Quantus-defined metrics (PixelFlipping, RegionPerturbation, ROAD, Monotonicity), sharded over
2 gloo processes and reduced with all_reduce_metrics, equal one process bit for bit."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from captum_transformers.evaluation import all_reduce_metrics, shard_indices
from captum_transformers.evaluation.monotonicity import Monotonicity
from captum_transformers.evaluation.pixel_flipping import PixelFlipping, RegionPerturbation
from captum_transformers.evaluation.road import ROAD

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


def _worker(rank, world_size, init_file, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics = evaluate(shard_indices(N, rank, world_size), batch_size=2)
        all_reduce_metrics(metrics)
        if rank == 0:
            torch.save([{k: v.clone() for k, v in m.state().items()} for m in metrics], out_file)
    finally:
        dist.destroy_process_group()


def test_sharded_and_reduced_equals_single_process_exactly(tmp_path):
    out_file = tmp_path / "states.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out_file)), nprocs=2, join=True)
    reduced_states = torch.load(out_file)
    single = evaluate(range(N), batch_size=4)  # other batch boundaries too
    assert single[-1].compute().count == N
    for metric, reduced in zip(single, reduced_states):
        for name, tensor in metric.state().items():
            assert torch.equal(tensor, reduced[name]), (type(metric).__name__, name)
        rebuilt = type(metric).__new__(type(metric))
        rebuilt.__dict__.update(metric.__dict__)
        rebuilt._state = reduced
        assert rebuilt.compute() == metric.compute()
