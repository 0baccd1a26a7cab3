"""Run a test's evaluation sharded over gloo processes and compare the reduced metric states with one process.

Each distributed test module gives an ``evaluate(indices, batch_size) -> list of metrics`` function (module level,
so the spawned processes can unpickle it); this module spawns the processes, reduces the states with
``all_reduce_metrics`` and checks them against a single-process run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from captum_transformers.evaluation import all_reduce_metrics, shard_indices


def _worker(rank, world_size, evaluate, n, init_file, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics = evaluate(shard_indices(n, rank, world_size), batch_size=2)
        all_reduce_metrics(metrics)
        if rank == 0:
            torch.save([{k: v.clone() for k, v in m.state().items()} for m in metrics], out_file)
    finally:
        dist.destroy_process_group()


def sharded_and_reduced_states(evaluate, n, tmp_path, world_size=2):
    """Evaluate rows ``0..n-1`` split by ``shard_indices`` over ``world_size`` gloo processes (batches of 2),
    all-reduce the metrics and return rank 0's states, one ``{name: tensor}`` per metric."""
    out_file = tmp_path / "states.pt"
    mp.spawn(_worker, args=(world_size, evaluate, n, str(tmp_path / "init"), str(out_file)), nprocs=world_size,
             join=True)
    return torch.load(out_file)


def assert_reduced_equals_single(single, reduced_states):
    """Every state tensor of the single-process ``single`` metrics equals the reduced one exactly, and a metric
    rebuilt on the reduced state computes the same result."""
    for metric, reduced in zip(single, reduced_states):
        for name, tensor in metric.state().items():
            assert torch.equal(tensor, reduced[name]), (type(metric).__name__, name)
        rebuilt = type(metric).__new__(type(metric))
        rebuilt.__dict__.update(metric.__dict__)
        rebuilt._state = reduced
        assert rebuilt.compute() == metric.compute()
