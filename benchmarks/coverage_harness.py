"""Coverage of transformers' text architectures by every method: one verdict per (architecture,
head, method), a JSON results file and the Markdown table of ``docs/coverage.md``.

Usage (from the repository root)::

    nice -n 10 .venv/bin/python benchmarks/coverage_harness.py --markdown docs/coverage.md
    nice -n 10 .venv/bin/python benchmarks/coverage_harness.py --suite vision-audio \\
        --markdown docs/coverage-vision-audio.md
    .venv/bin/python benchmarks/coverage_harness.py --heads causal-lm sequence-classification \\
        --methods raw-attention generic-attention --only llama,bert --out results.json
    .venv/bin/python benchmarks/coverage_harness.py --table-only --markdown docs/coverage.md

Resumable: entries whose every requested method already has a verdict in ``--out`` (default
``benchmarks/coverage/results.json``) are skipped.
Each architecture runs in a worker subprocess (a SIGALRM limit per method, the worker killed
when it stalls), see :mod:`benchmarks.coverage.sweep`. The verdicts are defined in
:mod:`benchmarks.coverage.harness`.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # benchmarks.coverage (benchmarks/ is a namespace package)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.coverage.entries import HEADS, SUITES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", default="text", choices=list(SUITES),
                        help="text (docs/coverage.md) or vision-audio (docs/coverage-vision-audio.md): the default "
                             "heads and results file")
    parser.add_argument("--heads", nargs="+", default=None, choices=list(HEADS),
                        help="head kinds (default: the suite's)")
    parser.add_argument("--methods", nargs="+", default=["all"],
                        help="catalog names (default 'all': every method run by default)")
    parser.add_argument("--only", default=None, help="comma-separated model types (default all)")
    parser.add_argument("--out", default=None,
                        help="the JSON results file (read and extended; default: the suite's)")
    parser.add_argument("--markdown", default=None, help="write the Markdown table here")
    parser.add_argument("--method-timeout", type=float, default=60.0, help="seconds per method call and checks")
    parser.add_argument("--entry-timeout", type=float, default=120.0,
                        help="seconds per architecture: past them its remaining methods are timed out")
    parser.add_argument("--redo", nargs="+", default=[], choices=["timed out", "does not build", "failed", "refused"],
                        help="judge the cells with these verdicts again (e.g. --redo 'does not build')")
    parser.add_argument("--in-process", action="store_true", help="no worker subprocess (debugging)")
    parser.add_argument("--table-only", action="store_true", help="only rewrite --markdown from --out")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.heads = args.heads or SUITES[args.suite]["heads"]
    args.out = args.out or SUITES[args.suite]["out"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.coverage import sweep, table

    if args.worker:
        sweep.worker_main(args.worker, args.progress, args.method_timeout, args.entry_timeout)
        return 0
    from benchmarks.coverage.entries import enumerate_entries
    from captum_transformers.methods.catalog import resolve_method_names

    methods = resolve_method_names(args.methods)
    if args.table_only:
        results = sweep.load_results(args.out)
    else:
        only = args.only.split(",") if args.only else None
        entries = enumerate_entries(args.heads, only)
        results = sweep.sweep(entries, methods, args.out, args.method_timeout, args.entry_timeout,
                              in_process=args.in_process, redo=args.redo)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table.render(results, heads=args.heads, suite=args.suite))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
