"""Rows per second of the corpus job, and its overhead over the bare method calls.

For each (model, method): the same rows in the same batches are explained (1) by a bare loop of
``attribute`` calls, (2) by ``explain_dataset`` in this process (writing the Parquet store),
interleaved, best of ``--repeats``; overhead = job / bare - 1 (the job adds one no-grad
forward per batch for the explained class and its logit, the Parquet writes and the hashes).
Then the command line over torchrun with one and with two processes (one thread each,
``OMP_NUM_THREADS=1``), wall time of the whole command (process start and model load included).

Memory: the resident set size of this process after the job's first shard and its peak over
the whole job (flat memory: the peak is not much above the first figure, whatever the rows).

Models: the built-in DigitCanvas ViT (``--rows`` canvases) and the shipped all-MiniLM-L6-v2
(``--rows`` short synthetic sentences; a sequence classifier with a seeded head, saved once), batch 32.

Command::

    PYTHONPATH=. python benchmarks/corpus_throughput.py --rows 1024
    PYTHONPATH=. python benchmarks/corpus_throughput.py --rows 4096 --cli-only   # also the shard loops' times
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from captum_transformers.corpus import digit_canvas_source, explain_dataset, table_source
from captum_transformers.methods.catalog import build_method

WORDS = "the film was a quiet and warm story with sharp dull long funny plot actors music".split()


def _sentences(rows: int):
    generator = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (int(torch.randint(5, 20, (1,), generator=generator)),),
                                                    generator=generator)) for _ in range(rows)]


def _bare(model, source, method, batch_size):
    attribution = build_method(method, model)
    start = time.perf_counter()
    for low in range(0, source.rows, batch_size):
        inputs, kwargs, tokens = source.batch(low, min(low + batch_size, source.rows))
        with torch.no_grad():
            logits = model(*inputs, **kwargs)
        logits = getattr(logits, "logits", logits)
        attribution.attribute(inputs[0], target=logits.argmax(-1), forward_kwargs=kwargs or None,
                              return_tokens=tokens is not None)
    return time.perf_counter() - start


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _job(model, source, method, batch_size, folder, memory=None):
    """Seconds of one job; with ``memory`` (a list), the resident set size after the first shard
    and at the end are appended to it (sampled every 0.2 s by a thread)."""
    shutil.rmtree(folder, ignore_errors=True)
    samples, done = [], threading.Event()

    def sample():
        while not done.wait(0.2):
            records = folder / "records"
            samples.append((len(list(records.glob("*.json"))) if records.is_dir() else 0, _rss_mib()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    explain_dataset(model, source, method, folder, batch_size=batch_size, shard_rows=256, progress=False)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    if memory is not None:
        after_first = [rss for shards, rss in samples if shards >= 1]
        memory.append((after_first[0] if after_first else _rss_mib(), max([rss for _, rss in samples] + [_rss_mib()])))
    return seconds


def _command(processes: int, data: str, method: str, folder: Path, model=None):
    """``(wall seconds of the whole command, seconds of rank 0's shard loop)``: the loop excludes
    process start, model load and the final barrier (rank 0 takes every other shard)."""
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "captum_transformers", "attribute", "--data", data, "--method", method, "--batch-size", "32",
               "--out", str(folder), "--no-progress"] + (["--model", model] if model else [])
    start = time.perf_counter()
    done = subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    loop = re.search(r"computed \d+ shard\(s\) \(\d+ rows, ([\d.]+) s\)", done.stdout)
    return wall, float(loop.group(1)) if loop else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["generic-attention", "attn-lrp"])
    parser.add_argument("--cli-only", action="store_true", help="only the command-line runs, 1 and 2 processes")
    args = parser.parse_args()
    from captum_transformers.model_loading import load_model
    from captum_transformers.tasks.movies.model import load_pretrained_minilm

    scratch = Path(tempfile.mkdtemp(prefix="corpus_bench_"))
    text_file = scratch / "sentences.jsonl"
    text_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in _sentences(args.rows)))
    classifier, tokenizer = load_pretrained_minilm(num_labels=2, seed=0)  # saved once: every process loads the same head
    classifier.save_pretrained(scratch / "minilm")
    tokenizer.save_pretrained(scratch / "minilm")
    digit, minilm = load_model(None), load_model(str(scratch / "minilm"))
    models = {"DigitCanvas ViT": (digit, digit_canvas_source(args.rows), f"digits:{args.rows}", None),
              "MiniLM-L6": (minilm, table_source(text_file, minilm.prepare), str(text_file), str(scratch / "minilm"))}
    print(f"{args.rows} rows, batch 32, torch threads {torch.get_num_threads()}, {os.cpu_count()} cores\n")
    if args.cli_only:
        print("| model | method | CLI 1 proc (s) | CLI 2 procs (s) | speed-up | shard loop 1 proc (s) "
              "| shard loop 2 procs, rank 0 (s) | loop speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for name, (_, _, data, model_arg) in models.items():
            for method in args.methods:
                (one, loop_one), (two, loop_two) = (_command(k, data, method, scratch / f"p{k}", model_arg)
                                                    for k in (1, 2))
                print(f"| {name} | {method} | {one:.1f} | {two:.1f} | {one / two:.2f}x | {loop_one:.1f} "
                      f"| {loop_two:.1f} | {loop_one / loop_two:.2f}x |", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
        return
    print("| model | method | bare rows/s | job rows/s | overhead | RSS after shard 1 / peak (MiB) "
          "| CLI 1 proc (s) | CLI 2 procs (s) | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (loaded, source, data, model_arg) in models.items():
        model = loaded.model.eval()
        for method in args.methods:
            bares, jobs, memory = [], [], []
            for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits both
                bares.append(_bare(model, source, method, 32))
                jobs.append(_job(model, source, method, 32, scratch / "job", memory))
            bare, job = min(bares), min(jobs)
            first, peak = memory[-1]
            one, _ = _command(1, data, method, scratch / "one", model_arg)
            two, _ = _command(2, data, method, scratch / "two", model_arg)
            print(f"| {name} | {method} | {args.rows / bare:.0f} | {args.rows / job:.0f} | {100 * (job / bare - 1):+.1f} % "
                  f"| {first:.0f} / {peak:.0f} | {one:.1f} | {two:.1f} | {one / two:.2f}x |", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
