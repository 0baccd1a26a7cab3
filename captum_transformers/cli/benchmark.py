"""``captum-transformers benchmark``: the faithfulness table of a task, with JSON, CSV and plots.

Under ``torchrun --nproc_per_node N`` the evaluation is sharded over the processes (gloo on
CPU, NCCL with ``--device cuda``) and the metrics reduced; rank 0 prints and writes.
"""
from __future__ import annotations

import contextlib
import os

import torch

from ..errors import InputError
from ..evaluation.images.pixel_perturbation import PIXEL_PROTOCOLS
from ..methods.catalog import KNOWN_METHOD_NAMES
from .output_folder import claimed_output_folder


def add_parser(subparsers) -> None:
    from ..tasks.recall.benchmark import CAPTUM_LLM_METHODS
    from ..tasks.runner import TASKS

    parser = subparsers.add_parser("benchmark", help="faithfulness metrics of methods on a benchmark task",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--methods", nargs="+", choices=KNOWN_METHOD_NAMES + CAPTUM_LLM_METHODS + ("all",),
                        default=None, help="methods to evaluate (default: all; recall also takes Captum's LLM "
                                           "wrappers: " + ", ".join(CAPTUM_LLM_METHODS) + ")")
    parser.add_argument("--limit", type=int, help="first N test examples only (recall: default 200)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--explain", choices=("predicted", "label"),
                        help="class to explain (default: predicted for digits, label for movies; "
                             "recall: label, the true answer)")
    parser.add_argument("--pixel-steps", choices=tuple(PIXEL_PROTOCOLS), default="fine",
                        help="digits: removed-pixel fractions, 'fine' (0-10%% in 1%% steps, then 10%% steps to "
                             "90%%; default) or 'cvpr21' (the authors' 0, 10, ..., 90%%)")
    parser.add_argument("--metrics", choices=("classic", "recent", "all", "road"), default="classic",
                        help="classic: each task's original metrics (default); recent: SRG (MIF/LIF), RISE deletion / "
                             "insertion, comprehensiveness / sufficiency AOPC and completeness error (digits, "
                             "digits-swin, movies, motifs, motifs-graphormer); all: both; road: recent plus ROAD "
                             "MoRF / LeRF (digits, digits-swin; opt-in: its imputation takes hours on one thread)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)")
    parser.add_argument("--out", default="captum_transformers_benchmark",
                        help="output folder (default: %(default)s), checked before the run; one that holds an "
                             "earlier results.json is never overwritten: the run goes to OUT-2, OUT-3, ... and says so")
    parser.add_argument("--cache-dir", help="movies: where the data and fine-tuned model are cached "
                                            "(default $CAPTUM_TRANSFORMERS_CACHE or ~/.cache/captum_transformers)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _join_process_group(backend: str) -> None:
    """``init_process_group(backend)``, with ``torch._dynamo`` imported first.

    torch._dynamo (which timm imports) keeps references to a process group that exists when
    it is imported, so ``destroy_process_group()`` left that group's gloo threads running into
    interpreter shutdown, where they aborted a rank now and then ("terminate called without an
    active exception", SIGABRT). Imported before the group exists, it holds none.
    """
    import torch._dynamo  # noqa: F401

    torch.distributed.init_process_group(backend)


def _start_distributed(device: str) -> str:
    """Join the torchrun process group when launched by torchrun; returns the device to use."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError("--device cuda but no CUDA device is available; use --device cpu (gloo).")
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not torch.distributed.is_initialized():
        _join_process_group("nccl" if device.startswith("cuda") else "gloo")
    return device


def _check_device(device: str) -> None:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r} is not a device this command runs on; use --device cpu, cuda or cuda:N.")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device} but no CUDA device is available; use --device cpu.")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise InputError(f"--device {device} but there are {torch.cuda.device_count()} CUDA device(s); use cuda:0 "
                         f"to cuda:{torch.cuda.device_count() - 1}.")


def run(args) -> int:
    _check_device(args.device)
    # Settled before the run (minutes) and before joining a process group; only rank 0 writes,
    # and a run that fails leaves no empty folder behind.
    writes = int(os.environ.get("RANK", "0")) == 0
    with claimed_output_folder(args.out, "results.json", "benchmark") if writes else contextlib.nullcontext() as out:
        return _run_into(args, out)


def _run_into(args, out) -> int:
    from ..tasks.report import summary, table, write_report
    from ..tasks.runner import run_benchmark

    device = _start_distributed(args.device)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    try:
        report = run_benchmark(args.task, args.methods, args.limit, args.batch_size,
                               progress=not args.no_progress and rank == 0, device=device, explain=args.explain,
                               cache_dir=args.cache_dir, pixel_steps=args.pixel_steps, metrics=args.metrics)
        if rank == 0:
            print(summary(report))
            print(table(report))
            for path in write_report(report, out):
                print(f"wrote {path}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
