"""Peak memory of one call, measured so that the numbers mean something on CPU and CUDA.

CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
before. CPU: glibc is told to return freed buffers to the OS at once (``mallopt``), the
heap is trimmed, the kernel's peak-RSS counter is reset through ``/proc/self/clear_refs``
and ``VmHWM - VmRSS`` is read after the call; without that counter, the growth of
``ru_maxrss`` (approximate, flagged as not exact).
"""
from __future__ import annotations

import ctypes
import gc
import resource
import sys
import time
from typing import Callable, Optional, Tuple

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _tight_malloc(enable: bool = True) -> None:
    """Make glibc give freed tensor buffers back to the OS at once (see module docstring).

    ``enable=False`` puts glibc's default thresholds (128 KiB) back, though as fixed values:
    glibc's dynamic mmap threshold stays off for the rest of the process.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_MAX, 65536)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024 if enable else 128 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 0 if enable else 128 * 1024)


def _reusing_malloc() -> None:
    """Make glibc keep freed buffers for the next allocation (no ``mmap`` per buffer, no heap
    trimming), as a long-running evaluation loop settles into: a timing then measures the
    computation, not the kernel zeroing fresh pages. On the 2-core development VM those page
    faults made the same forward pass vary up to 4x in its memory-bound operations from run to
    run. Undone for a memory measurement by :func:`_tight_malloc` (which also re-enables
    ``mmap``)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)


def _trim() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def peak_bytes(op: Callable[[], object], device: str = "cpu", warmup: bool = True) -> Tuple[int, bool]:
    """Peak memory of ``op()`` above what was live before it; ``(bytes, exact)``.

    ``exact`` is False for the CPU fallback without a resettable peak-RSS counter.
    """
    if device.startswith("cuda"):
        if warmup:
            op()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = op()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del result
        return peak, True
    can_reset = _status_kib("VmHWM") is not None and _reset_peak_rss()
    if can_reset:
        if warmup:
            op()
        _trim()
        base = _status_kib("VmRSS")
        _reset_peak_rss()
        result = op()
        peak = (_status_kib("VmHWM") - base) * 1024
        del result
        return max(peak, 0), True
    # Fallback: growth of the lifetime peak (Linux reports KiB, macOS bytes).
    scale = 1 if sys.platform == "darwin" else 1024
    _trim()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = op()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del result
    return max(after - before, 0) * scale, False


def measure_on_random_ids(model, tokens: int, make_run: Callable[[object, torch.Tensor, int], Callable[[], object]],
                          timed_runs: int = 3) -> dict:
    """One subprocess cell of the long-input benchmarks: ``tokens`` seeded random ids, the target the model
    predicts after the first 16, ``make_run(model, ids, target)`` warmed up once on those 16 (lazy imports and
    kernels), then the peak memory (glibc returning freed buffers at once) of one run on all ids, and the CPU
    seconds of the fastest of ``timed_runs`` more after a warm-up run with glibc keeping freed buffers
    (:func:`_reusing_malloc`, as an evaluation loop settles into). On the shared 2-core VM one run's time
    varied by up to 30 % from one process to the next. Timed under the memory measurement's allocator
    instead, every fresh buffer costs page faults: GenericAttention's recomputed chunks at 4k tokens then
    took 1.6x the reference's time, against 1.1x with buffers reused.
    Returns ``{"peak": bytes, "exact": bool, "cpu": seconds}``."""
    ids = torch.randint(3, 512, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        target = int(model(ids[:, :16], logits_to_keep=1).logits[0, -1].argmax())
    make_run(model, ids[:, :16], target)()
    run = make_run(model, ids, target)
    _tight_malloc()
    peak, exact = peak_bytes(run, warmup=False)
    _reusing_malloc()
    run()
    times = []
    for _ in range(timed_runs):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return {"peak": peak, "exact": exact, "cpu": min(times)}


def plain_gradient_run(model, ids: torch.Tensor, target: int) -> Callable[[], torch.Tensor]:
    """The reference the explanations are measured against: one forward (head at the last
    position) and one backward to the input embeddings, as a callable."""
    embeddings = model.get_input_embeddings()(ids).detach()

    def run():
        leaf = embeddings.clone().requires_grad_(True)
        logits = model(inputs_embeds=leaf, logits_to_keep=1).logits
        return torch.autograd.grad(logits[0, -1, target], leaf)[0]
    return run


def run_cell(script: str, arguments, env) -> "dict | str":
    """Run ``script --cell *arguments`` in a fresh process (its own peak RSS) and return the JSON
    object it prints last, or the last line of its error output when it failed."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, script, "--cell", *map(str, arguments)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        return f"failed: {out.stderr.strip().splitlines()[-1:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])
