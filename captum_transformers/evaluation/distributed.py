"""Sharding a dataset over processes and summing metric states across them.

Each process evaluates ``shard_indices(n, rank, world_size)`` of the dataset with its own
metrics, then ``all_reduce_metrics`` sums every state tensor (float64, exact sums: see
``accumulator``), after which ``compute()`` on any rank equals the single-process result
bit for bit.

Example::

    for index in batches(shard_indices(len(dataset), rank, world_size)):
        metric.update(...)
    all_reduce_metrics([metric])
    result = metric.compute()
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..errors import InputError
from .accumulator import Accumulator


def shard_indices(n: int, rank: int, world_size: int) -> range:
    """The contiguous block of ``range(n)`` that process ``rank`` of ``world_size`` evaluates.

    Blocks are as equal as possible: the first ``n % world_size`` ranks get one index more.
    Together they cover ``range(n)`` once, in order, deterministically.

    >>> [list(shard_indices(5, r, 2)) for r in range(2)]
    [[0, 1, 2], [3, 4]]
    """
    for name, value in (("n", n), ("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InputError(f"{name} must be an int, got {value!r}.")
    if n < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise InputError(
            f"shard_indices(n={n}, rank={rank}, world_size={world_size}): expected n >= 0, world_size >= 1 and "
            "0 <= rank < world_size."
        )
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def all_reduce_metrics(metrics: Iterable[Accumulator], group: Optional[object] = None) -> None:
    """Sum every state tensor of every metric over the processes of ``group``, in place.

    A no-op when ``torch.distributed`` is unavailable or not initialised (single process).
    Every process must pass metrics built with the same options, in the same order. State
    tensors live on the CPU (gloo); for NCCL they are moved to the current CUDA device for
    the reduction and copied back.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    backend = dist.get_backend(group)
    for metric in metrics:
        for name, tensor in metric.state().items():
            if backend == "nccl":
                on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=group)
                tensor.copy_(on_device.cpu())
            else:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
