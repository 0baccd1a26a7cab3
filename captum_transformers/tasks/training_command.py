"""The command line of the step-trained task models (``recall.train``, ``captioner.train``).

``python -m captum_transformers.tasks.<script> [--steps N] [--seed S] [--threads T] [--out PATH]``: the weights go
to ``--out`` (by default the package's ``assets/<weights file>``), the JSON record beside them. The thread count is
set here, since the same seed and thread count give the same weights.

Example::

    >>> args, command = parse_training_command("recall.train", "Train.", "recall_llama.pt", "recall_llama.json",
    ...                                        steps=3000, seed=0, threads=1, argv=["--steps", "5"])
    >>> command
    'python -m captum_transformers.tasks.recall.train --steps 5 --seed 0 --threads 1'
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence, Tuple

import torch


def parse_training_command(script: str, description: str, weights_file: str, record_file: str, steps: int,
                           seed: int, threads: int, argv: Optional[Sequence[str]] = None
                           ) -> Tuple[argparse.Namespace, str]:
    """Parse ``argv`` (``--out``, ``--steps``, ``--seed``, ``--threads``), set torch's thread count, and return the
    arguments with the command line that reproduces the run (for the weights' record)."""
    default_out = Path(__file__).resolve().parent.parent / "assets" / weights_file
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out,
                        help=f"weights path (default: {default_out}); the record goes beside it with suffix "
                             f".json ({record_file} for the default)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--threads", type=int, default=threads,
                        help="CPU threads (the same seed and thread count give the same weights)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = f"python -m captum_transformers.tasks.{script} " + " ".join(
        f"--{name} {getattr(args, name)}" for name in ("steps", "seed", "threads"))
    return args, command
