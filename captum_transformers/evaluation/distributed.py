"""Sharding a dataset over processes and summing metric states across them.

Each process evaluates ``shard_indices(n, rank, world_size)`` of the dataset with its own
metrics, then ``all_reduce_metrics`` sums every state tensor (float64, exact sums: see
``accumulator``), after which ``compute()`` on any rank equals the single-process result
bit for bit. Every rank must pass metrics of the same classes and options; the call checks
that, and refuses a metric it has reduced before (see ``all_reduce_metrics``).

Example::

    for index in batches(shard_indices(len(dataset), rank, world_size)):
        metric.update(...)
    all_reduce_metrics([metric])
    result = metric.compute()
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import InputError
from .accumulator import Accumulator, describe_options


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
    """Sum every state tensor of every metric over the processes of ``group``, in place, once.

    A no-op when ``torch.distributed`` is unavailable or not initialised (single process).
    Every process must pass the same number of metrics, of the same classes built with the
    same options (``Accumulator.options()``), in the same order, none of them reduced yet.
    That is checked first: each process all-gathers every process's class, options and
    ``reduced`` flag, and on any difference *every* process raises the same ``InputError``
    naming the ranks (of ``group``) that differ, before any state is summed, so none is left
    waiting in a collective. Afterwards each metric holds the totals of all processes and is
    ``reduced``: a second call, ``update`` and ``merge`` with an unreduced metric are refused
    until ``reset()`` (see ``Accumulator``). State tensors live on the CPU (gloo); for NCCL
    they are moved to the current CUDA device for the reduction and copied back.
    """
    metrics = list(metrics)
    if not (dist.is_available() and dist.is_initialized()):
        return
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [_fingerprint(metric) for metric in metrics], group=group)
    _check_fingerprints(gathered)
    backend = dist.get_backend(group)
    for metric in metrics:
        for name, tensor in metric.state().items():
            if backend == "nccl":
                on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
                dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=group)
                tensor.copy_(on_device.cpu())
            else:
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        metric.mark_reduced()


def _fingerprint(metric) -> Tuple:
    """(class, options, state shapes, reduced) of one process's metric; (type name,) for a non-metric."""
    if not isinstance(metric, Accumulator):
        return (type(metric).__name__,)
    shapes = tuple((name, tuple(tensor.shape)) for name, tensor in metric.state().items())
    return metric.kind(), metric.options(), shapes, metric.reduced


def _name(fingerprint: Tuple) -> str:
    if len(fingerprint) == 1:
        return f"of type {fingerprint[0]}, not an Accumulator,"
    return describe_options(fingerprint[0].rsplit(".", 1)[-1], fingerprint[1])


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _check_fingerprints(gathered: List[List[Tuple]]) -> None:
    """Raise, the same on every process, unless all ranks passed alike, unreduced metrics."""
    counts = [len(prints) for prints in gathered]
    if len(set(counts)) > 1:
        listing = "; ".join(f"rank {r}: {n} metric{'s' if n != 1 else ''}" for r, n in enumerate(counts))
        raise InputError(f"all_reduce_metrics got a different number of metrics per rank ({listing}). Pass the same "
                         "metrics, in the same order, on every rank.")
    for index, reference in enumerate(gathered[0]):
        # Compare everything but the reduced flag first, so a mismatch is named as what it is.
        strays = [r for r, prints in enumerate(gathered) if len(prints[index]) == 1]
        if strays:
            raise InputError(
                f"all_reduce_metrics: metric {index} is {_name(gathered[strays[0]][index])} on {_ranks(strays)}. Pass "
                "metrics (Accumulator instances such as CompletenessError()) only.")
        differing = [r for r, prints in enumerate(gathered) if prints[index][:3] != reference[:3]]
        if differing:
            others = sorted({_name(gathered[r][index]) for r in differing} - {_name(reference)})
            detail = f"{_ranks(differing)} passed {', '.join(others) or 'it with other state shapes'}"
            first = gathered[differing[0]][index]
            if first[0] == reference[0] and first[1] != reference[1]:
                keys = sorted(k for k in set(first[1]) | set(reference[1]) if first[1].get(k) != reference[1].get(k)
                              or (k in first[1]) != (k in reference[1]))
                detail += f" (options {', '.join(keys)} differ)"
            elif first[0] != reference[0]:
                detail += " (another class)"
            raise InputError(
                f"all_reduce_metrics: metric {index} is {_name(reference)} on rank 0, but {detail}. Every rank must "
                "pass metrics of the same classes built with the same options, in the same order; build them alike on "
                "every rank.")
    for index, reference in enumerate(gathered[0]):
        reduced = [r for r, prints in enumerate(gathered) if prints[index][3]]
        if reduced:
            rest = [r for r in range(len(gathered)) if r not in reduced]
            who = "every rank" if not rest else f"{_ranks(reduced)} (not {_ranks(rest)})"
            raise InputError(
                f"all_reduce_metrics: metric {index}, {_name(reference)}, already holds the totals of all ranks on "
                f"{who}: all_reduce_metrics was called on it before, and reducing it again would multiply every count "
                "by the world size. Call compute() on it as it is, or reset() it on every rank to start a new "
                "evaluation.")
