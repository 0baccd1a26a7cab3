"""The corpus job's done-when check at full size: two torchrun processes (gloo) explain N built-in
DigitCanvas canvases; one is killed with SIGKILL once about half the shards are written; the same
command is run again; the store must equal an uninterrupted one-process run bit for bit (float32
maps), every row id exactly once. (tests/test_corpus_job.py runs the same check at 192 rows.)

Command::

    PYTHONPATH=. python benchmarks/corpus_kill_resume.py --rows 10000
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from captum_transformers.corpus import read_store


def worker_pids(pid: int):
    """The processes whose parent is ``pid`` (torchrun's workers), read from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--method", default="generic-attention")
    parser.add_argument("--shard-rows", type=int, default=256)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="corpus_kill_"))
    job = ["attribute", "--data", f"digits:{args.rows}", "--method", args.method, "--batch-size", "32",
           "--shard-rows", str(args.shard_rows), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "captum_transformers"]
    shards = -(-args.rows // args.shard_rows)
    records = scratch / "two" / "records"
    start = time.perf_counter()
    first = subprocess.Popen([*torchrun, *job, "--out", str(scratch / "two")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    while first.poll() is None and not (records.is_dir() and len(list(records.glob("*.json"))) >= shards // 2):
        time.sleep(0.05)
    if first.poll() is not None:
        raise SystemExit("the first run ended before half its shards: " + first.communicate()[0].decode()[-2000:])
    victim = max(worker_pids(first.pid))
    os.kill(victim, signal.SIGKILL)
    written = len(list(records.glob("*.json")))
    first.communicate(timeout=300)
    killed_at = time.perf_counter() - start
    start = time.perf_counter()
    second = subprocess.run([*torchrun, *job, "--out", str(scratch / "two")], env=env, capture_output=True, text=True)
    resumed = time.perf_counter() - start
    if second.returncode:
        raise SystemExit(second.stdout[-2000:] + second.stderr[-2000:])
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "captum_transformers", *job, "--out", str(scratch / "one")], env=env,
                   check=True, capture_output=True)
    single = time.perf_counter() - start
    two, one = read_store(scratch / "two"), read_store(scratch / "one")
    ids = two.column("row_id").to_pylist()
    ranks = sorted({json.loads(p.read_text())["rank"] for p in records.glob("*.json")})
    print(f"{args.rows} canvases, {args.method}, {shards} shards of {args.shard_rows}, 2 torchrun processes (gloo)")
    print(f"| step | seconds |\n|---|---|\n| 2 procs until SIGKILL of one ({written} of {shards} shards written) "
          f"| {killed_at:.1f} |\n| same command again (resumed) | {resumed:.1f} |\n| 1 proc uninterrupted | {single:.1f} |")
    print(f"resumed output: {second.stdout.strip().splitlines()[-1]}")
    print(f"row ids 0..{args.rows - 1} exactly once: {ids == list(range(args.rows))}; shards by ranks {ranks}; "
          f"equal to the one-process store bit for bit: {two.equals(one)}")
    shutil.rmtree(scratch, ignore_errors=True)
    if not (two.equals(one) and ids == list(range(args.rows))):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
