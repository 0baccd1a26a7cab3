"""How the explorer's store page holds up at 100k rows: open time, memory, and the latency of
its API answers (a page sorted by each key, first and cached; a search; a row's map from a
cold and from a kept shard), over HTTP (Starlette's test client, no network).

Two synthetic stores written with the job's own shard writer: text (100k rows of 8-40 tokens
and their token maps) and images (100k rows of 32x32 maps, no tokens).

Command::

    PYTHONPATH=. python benchmarks/store_explorer.py --rows 100000
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from captum_transformers.corpus.store import claim_manifest, shard_plan, write_shard

WORDS = "the film was a quiet and warm story with sharp dull long funny plot actors music".split()


def _store(out: Path, rows: int, text: bool, shard_rows: int = 1024) -> None:
    rng = np.random.default_rng(0)
    claim_manifest(out, {"format": "captum-transformers corpus store 2", "kind": "classifier", "method": "attn-lrp",
                         "model_class": "Synthetic", "dtype": "torch.float32", "rows": rows, "shard_rows": shard_rows,
                         "batch_size": 32, "source": "synthetic", "target": "predicted"})
    for shard, start, stop in shard_plan(rows, shard_rows):
        lengths = rng.integers(8, 41, stop - start) if text else None
        maps = [rng.standard_normal(int(lengths[i]) if text else (32, 32)).astype(np.float32)
                for i in range(stop - start)]
        columns = {"row_id": list(range(start, stop)), "target": rng.integers(0, 5, stop - start).tolist(),
                   "score": rng.standard_normal(stop - start).tolist(), "map": [m.reshape(-1) for m in maps],
                   "map_shape": [list(m.shape) for m in maps],
                   "tokens": [[WORDS[w] for w in rng.integers(0, len(WORDS), len(m))] for m in maps] if text
                   else [None] * (stop - start), "method": ["attn-lrp"] * (stop - start)}
        write_shard(out, shard, start, stop, columns, {"rank": 0})


def _rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _ms(client, path, params=None, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        answer = client.get(path, params=params, headers={"X-Explorer-Token": "t" * 32})
        times.append(1000 * (time.perf_counter() - start))
        assert answer.status_code == 200, answer.text
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--only", choices=("text", "images"), help="measure one store in this process (the "
                                                                   "command runs each in its own, for a clean RSS)")
    parser.add_argument("--store", help="with --only: the store written for it")
    args = parser.parse_args()
    if args.only is None:
        scratch = Path(tempfile.mkdtemp(prefix="store_explorer_"))
        import subprocess
        import sys

        print(f"{args.rows} rows per store; milliseconds per API answer (median of 5; first: the first call)\n")
        print("| store | on disk (MB) | open (s) | RSS added (MiB) | sort by score: first / cached | search 'warm film' "
              "| page (offset rows/2, sorted by class) | row map: cold / kept shard |")
        print("|---|---|---|---|---|---|---|---|", flush=True)
        for kind in ("text", "images"):
            _store(scratch / kind, args.rows, kind == "text")  # written here: the measuring process only reads
            subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--only", kind, "--store",
                            str(scratch / kind)], check=True)
            shutil.rmtree(scratch / kind)
        shutil.rmtree(scratch, ignore_errors=True)
        return
    from starlette.testclient import TestClient

    from captum_transformers.explorer.app import create_app
    from captum_transformers.explorer.pages.store.index import StoreIndex

    name, text = {"text": ("text", True), "images": ("images 32x32", False)}[args.only]
    out = Path(args.store)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6
    before, start = _rss_mib(), time.perf_counter()
    index = StoreIndex(out)
    opened, added = time.perf_counter() - start, _rss_mib() - before
    client = TestClient(create_app(index, "t" * 32), base_url="http://127.0.0.1")
    sort = _ms(client, "/api/rows", {"sort": "score", "order": "desc"})
    search = _ms(client, "/api/rows", {"q": "warm film" if text else ""}) if text else None
    page = _ms(client, "/api/rows", {"sort": "target", "offset": args.rows // 2, "limit": 50})
    cold = _ms(client, f"/api/rows/{args.rows - 7}", repeats=1)[0]
    kept = statistics.median(_ms(client, f"/api/rows/{args.rows - 9}"))
    print(f"| {name} | {size:.0f} | {opened:.1f} | {added:.0f} | {sort[0]:.0f} / {statistics.median(sort[1:]):.0f} "
          f"| {'%.0f' % statistics.median(search) if search else '-'} | {statistics.median(page):.0f} "
          f"| {cold:.0f} / {kept:.0f} |", flush=True)


if __name__ == "__main__":
    main()
