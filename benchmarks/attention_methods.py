"""Cost of the attention methods relative to the passes they are built from.

For a 6-layer HF ViT (hidden 256, 4 heads, MLP 1024, 224x224 images, 16x16 patches) and a
6-layer HF BERT (same widths, 128 tokens, odd examples padded), batch 16, eval mode,
randomly initialised from configs (no hub access), this prints one row per measurement.
``--models timm_vit mha_encoder`` measures the same sizes as a timm ViT and as a pre-norm
``nn.TransformerEncoder`` classifier (the timm and ``nn.MultiheadAttention`` adapters):

* median wall time of one ``attribute`` call over ``--repeats`` runs, in ms, and as a ratio
  to the pass it should be compared with:

  - ``RawAttention`` and ``AttentionRollout`` need no gradient: they are compared with a
    plain forward under ``torch.no_grad()`` (the model's own attention implementation,
    SDPA by default; an eager-attention forward is printed too, since a capture runs an
    explicit softmax attention);
  - ``AttentionGradCAM``, ``GenericAttention`` and ``ConservativeLRP`` need one backward, and
    ``TransformerRelevance`` one forward and two backward passes: they are compared with
    a *training-step-like* pass, a forward with gradients plus
    ``torch.autograd.grad(target logits sum, parameters)``. A forward plus the gradient
    with respect to the input embeddings only (no weight gradients) is printed too.

  Every measurement is interleaved with the others (one run of each per round, in a
  rotating order), after warm-up, so that slow drift of a shared machine hits all of them
  alike. On CPU the median process CPU time (user + system, all threads) is printed as
  well; it is much less sensitive to other processes competing for the cores than wall
  time, so use its ratio when the machine is busy.

* peak memory of one call, as a ratio to the peak of the training step on the same batch.
  Peak memory is the high-water mark *above* what was live before the call (model weights
  and inputs excluded):

  - CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``,
    minus ``memory_allocated()`` before the call (exact tensor memory);
  - CPU: each measurement runs in a fresh Python subprocess (``--memory subprocess``, the
    default) so that no allocator cache or fragmentation from another measurement leaks
    in. The child sets glibc's ``M_MMAP_THRESHOLD`` to 64 KiB (and ``M_TRIM_THRESHOLD``
    to 0), so every tensor buffer of any size is its own ``mmap`` and goes back to the OS
    when freed: resident memory then tracks live tensors closely. It runs the call once as
    warm-up, trims the heap, reads ``VmRSS``, resets the kernel's peak-RSS counter by
    writing ``5`` to ``/proc/self/clear_refs``, runs the call again and reads ``VmHWM``;
    the difference is the peak. (``tracemalloc`` does not see torch's C++ allocations, and
    ``ru_maxrss`` alone cannot be reset, so without ``clear_refs`` - non-Linux kernels -
    the child skips the warm-up and reports ``ru_maxrss`` growth, marked ``~``.)
    ``--memory inprocess`` does the same without subprocesses (faster, slightly less
    isolated; used by ``--quick``), ``--memory off`` skips memory.

Targets printed next to the ratios: rollout <= 1.1x forward, GenericAttention and
ConservativeLRP <= 1.15x forward+backward, TransformerRelevance <= 2.2x, every method's peak
memory <= 1.3x the training step's.

Usage::

    python benchmarks/attention_methods.py                     # full sizes, CPU
    python benchmarks/attention_methods.py --device cuda --repeats 20
    python benchmarks/attention_methods.py --quick             # tiny smoke run
    python benchmarks/attention_methods.py --profile GenericAttention --models vit

The functions are importable (``build_model``, ``make_batch``, ``make_ops``,
``time_ops``, ``measure_peaks``, ``run``, ``format_table``, ``main``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_models import (EXTRA_MODELS, FULL, IMAGE_MODELS, MODELS, QUICK, Batch,  # noqa: E402,F401
                              EncoderClassifier, Sizes, _logits, build_model, make_batch)
from benchmark_report import (GRADIENT_METHODS, MEMORY_TARGET, METHOD_NAMES, REFERENCES, TIME_TARGETS,  # noqa: E402,F401
                              Row, format_table, reference_of, summarize)


def make_ops(name: str, model: torch.nn.Module, batch: Batch,
             include: Optional[Sequence[str]] = None) -> Dict[str, Callable[[], object]]:
    """Zero-argument callables, one per measurement (references first, then methods)."""
    import captum_transformers as ct

    ops: Dict[str, Callable[[], object]] = {}
    params = [p for p in model.parameters() if p.requires_grad]
    x, kwargs, target = batch.inputs, batch.forward_kwargs, batch.target

    def target_score(logits: torch.Tensor) -> torch.Tensor:
        return logits.gather(1, target[:, None]).sum()

    def forward():
        with torch.no_grad():
            return _logits(model(x, **kwargs))

    ops["forward"] = forward
    if (include is None or "forward_eager" in include) and hasattr(model, "set_attn_implementation"):
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")

        def forward_eager():
            with torch.no_grad():
                return eager(x, **kwargs).logits

        ops["forward_eager"] = forward_eager

    def train_step():
        return torch.autograd.grad(target_score(_logits(model(x, **kwargs))), params)

    ops["train_step"] = train_step

    if name in IMAGE_MODELS:
        def fwd_bwd_inputs():
            pixels = x.detach().requires_grad_(True)
            return torch.autograd.grad(target_score(_logits(model(pixels, **kwargs))), pixels)
    elif name == "mha_encoder":
        def fwd_bwd_inputs():
            embeds = model.embed(x).detach().requires_grad_(True)
            hidden = model.encoder(embeds, src_key_padding_mask=kwargs["key_padding_mask"])
            return torch.autograd.grad(target_score(model.head(hidden[:, 0])), embeds)
    else:
        embedding = model.get_input_embeddings()

        def fwd_bwd_inputs():
            with torch.no_grad():
                embeds = embedding(x)
            embeds.requires_grad_(True)
            return torch.autograd.grad(target_score(model(inputs_embeds=embeds, **kwargs).logits), embeds)

    ops["fwd_bwd_inputs"] = fwd_bwd_inputs

    for method in METHOD_NAMES:
        explainer = getattr(ct, method)(model)
        method_target = target if method in GRADIENT_METHODS else None

        def attribute(explainer=explainer, method_target=method_target):
            return explainer.attribute(x, target=method_target, forward_kwargs=kwargs or None)

        ops[method] = attribute
    if include is not None:
        ops = {k: v for k, v in ops.items() if k in include}
    return ops


# --------------------------------------------------------------------------- timing


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_ops(ops: Dict[str, Callable[[], object]], repeats: int, warmup: int = 2,
             device: str = "cpu") -> Dict[str, Dict[str, List[float]]]:
    """Wall and CPU seconds per run, interleaved: each round runs every op once, rotated."""
    names = list(ops)
    for _ in range(warmup):
        for name in names:
            ops[name]()
    _sync(device)
    results = {name: {"wall": [], "cpu": []} for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            _sync(device)
            wall, cpu = time.perf_counter(), _cpu_seconds()
            ops[name]()
            _sync(device)
            results[name]["wall"].append(time.perf_counter() - wall)
            results[name]["cpu"].append(_cpu_seconds() - cpu)
    return results


# --------------------------------------------------------------------------- memory

from peak_memory import _tight_malloc, peak_bytes  # noqa: E402,F401  (peak_bytes is part of this API)


def _child_peak(model_name: str, op_name: str, sizes: Sizes, device: str, threads: int) -> Tuple[int, bool]:
    """Run one memory measurement in a fresh interpreter and read its JSON answer."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024), MALLOC_TRIM_THRESHOLD_="0")
    command = [sys.executable, os.path.abspath(__file__), "--_child-memory", model_name, op_name,
               "--device", device, "--threads", str(threads), "--_sizes", json.dumps(dataclasses.asdict(sizes))]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory child for {model_name}/{op_name} failed:\n{done.stderr[-4000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["peak"], answer["exact"]


def measure_peaks(model_name: str, op_names: Sequence[str], sizes: Sizes, device: str = "cpu", mode: str = "subprocess",
                  threads: int = 1, ops: Optional[Dict[str, Callable[[], object]]] = None) -> Dict[str, Tuple[int, bool]]:
    """Peak memory per op. ``mode``: ``subprocess`` (CPU only; CUDA always measures in process),
    ``inprocess`` (reuses ``ops`` if given) or ``off``."""
    if mode == "off":
        return {}
    if mode == "subprocess" and not device.startswith("cuda"):
        return {name: _child_peak(model_name, name, sizes, device, threads) for name in op_names}
    cpu = not device.startswith("cuda")
    if cpu:
        _tight_malloc()
    try:
        if ops is None:
            model = build_model(model_name, sizes, device)
            ops = make_ops(model_name, model, make_batch(model_name, sizes, device), include=op_names)
        return {name: peak_bytes(ops[name], device) for name in op_names}
    finally:
        if cpu:
            _tight_malloc(False)


def _child_main(model_name: str, op_name: str, sizes: Sizes, device: str, threads: int) -> None:
    torch.set_num_threads(threads)
    _tight_malloc()
    model = build_model(model_name, sizes, device)
    ops = make_ops(model_name, model, make_batch(model_name, sizes, device), include=[op_name])
    peak, exact = peak_bytes(ops[op_name], device)
    print(json.dumps({"peak": peak, "exact": exact}))


def profile_op(op: Callable[[], object], rows: int = 25) -> str:
    """A torch.profiler table (self CPU time, grouped by op) of one run after a warm-up."""
    from torch.profiler import ProfilerActivity, profile

    op()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=False) as prof:
        op()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# --------------------------------------------------------------------------- entry points


def run(sizes: Sizes = FULL, models: Sequence[str] = MODELS, repeats: int = 5, warmup: int = 2, device: str = "cpu",
        memory: str = "subprocess", threads: Optional[int] = None, log: Callable[[str], None] = print) -> List[Row]:
    """Time and measure every method and reference on every model; return the table rows."""
    threads = threads or _default_threads(device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run(sizes, models, repeats, warmup, device, memory, threads, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run(sizes: Sizes, models: Sequence[str], repeats: int, warmup: int, device: str, memory: str, threads: int,
         log: Callable[[str], None]) -> List[Row]:
    rows: List[Row] = []
    for model_name in models:
        model = build_model(model_name, sizes, device)
        batch = make_batch(model_name, sizes, device)
        ops = make_ops(model_name, model, batch)
        log(f"[{model_name}] timing {len(ops)} measurements x {repeats} repeats ...")
        times = time_ops(ops, repeats=repeats, warmup=warmup, device=device)
        memory_names = ["train_step", "forward"] + list(METHOD_NAMES)
        if memory != "off":
            log(f"[{model_name}] peak memory ({memory}) ...")
        peaks = measure_peaks(model_name, memory_names, sizes, device, memory, threads,
                              ops=ops if memory == "inprocess" or device.startswith("cuda") else None)
        rows.extend(summarize(model_name, times, peaks, device))
        del model, ops
        gc.collect()
    return rows


def _default_threads(device: str) -> int:
    if device.startswith("cuda"):
        return torch.get_num_threads()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _warn_if_busy(threads: int) -> None:
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return
    cores = _default_threads("cpu")
    if load - 1.0 + threads > cores:  # about one unit of load is this process starting up
        print(f"warning: 1-minute load average is {load:.1f} on {cores} usable cores; other processes compete for "
              f"the CPU, so wall times are noisy (compare the 'x cpu' column, or use --threads 1).")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 16; 2 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 5; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 2; 1 with --quick)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: usable CPU cores; 1 with --quick). On a machine shared "
                             "with other busy processes use fewer threads: oversubscribed OpenMP threads make "
                             "wall times erratic")
    parser.add_argument("--models", nargs="+", choices=MODELS + EXTRA_MODELS, default=list(MODELS),
                        help=f"default {' '.join(MODELS)}; also {' '.join(EXTRA_MODELS)} (timm ViT, nn.TransformerEncoder)")
    parser.add_argument("--memory", choices=("subprocess", "inprocess", "off"), default=None,
                        help="how to measure peak memory (default subprocess; inprocess with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 repeat: a smoke test, not a benchmark")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--profile", metavar="NAME", choices=tuple(REFERENCES) + METHOD_NAMES,
                        help="print a torch.profiler table for one measurement instead of benchmarking")
    parser.add_argument("--_child-memory", nargs=2, metavar=("MODEL", "OP"), help=argparse.SUPPRESS)
    parser.add_argument("--_sizes", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> List[Row]:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args._sizes:
        sizes = Sizes(**json.loads(args._sizes))
    if args.batch is not None:
        sizes = dataclasses.replace(sizes, batch=args.batch)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but CUDA is not available")
    threads = args.threads or (1 if args.quick else _default_threads(args.device))
    if args._child_memory:
        _child_main(*args._child_memory, sizes, args.device, threads)
        return []
    if args.profile:
        torch.set_num_threads(threads)
        for model_name in args.models:
            model = build_model(model_name, sizes, args.device)
            ops = make_ops(model_name, model, make_batch(model_name, sizes, args.device), include=[args.profile])
            print(f"== {model_name}: {args.profile}")
            print(profile_op(ops[args.profile]))
        return []
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    memory = args.memory or ("inprocess" if args.quick else "subprocess")
    print(f"torch {torch.__version__}, device {args.device}, threads {threads}, batch {sizes.batch}, "
          f"repeats {repeats}, warm-up {warmup}, memory {memory}" + (" [QUICK: tiny sizes]" if args.quick else ""))
    print(f"sizes: {dataclasses.asdict(sizes)}")
    _warn_if_busy(threads)
    rows = run(sizes, args.models, repeats, warmup, args.device, memory, threads)
    print()
    print(format_table(rows))
    print()
    print("x wall / x cpu: median wall (process CPU) time over the reference: 'forward' = forward under no_grad, "
          "'fwd+bwd' = forward + autograd.grad(target logits sum, parameters).")
    print("x train peak: peak memory above weights+inputs over the training step's (fwd+bwd params) peak. "
          "'~' marks an approximate CPU peak (no resettable peak-RSS counter).")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([dataclasses.asdict(r) for r in rows], handle, indent=2)
    return rows


if __name__ == "__main__":
    main()
