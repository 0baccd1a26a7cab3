"""Attention methods at long contexts: peak memory and CPU time against one forward + backward.

A 4-layer Llama built from a config (width 256, 8 heads, 2 key-value heads, random weights,
float32), HF ``eager`` and ``sdpa`` attention, one sequence of 1k, 2k and 4k tokens, the
causal-LM head explained at the last position (its arg-max token). Each cell runs in a fresh
subprocess (one thread): peak memory is the growth of peak RSS above what was live before
the call (``benchmarks/peak_memory.py``: freed buffers returned to the OS, ``VmHWM`` reset),
CPU time the process time of a second call. Both are given relative to the reference: the
model's forward on input embeddings that require grad and ``autograd.grad`` of the explained
logit to them (``logits_to_keep=1``), on the same attention implementation.

The last column, "slope", is the method's extra memory beyond the reference's
(``peak - peak_ref``) per token from 2k to 4k: constant in N (linear memory) means
``extra(4k) - extra(2k) ~ extra(2k) - extra(1k)``.

Command (about 10 minutes)::

    OMP_NUM_THREADS=1 python benchmarks/long_context.py

``--sizes 1024 2048`` / ``--impls eager`` / ``--methods GenericAttention`` select cells.

Figures (2-core VM shared with other jobs, load average 6-9 during both runs, so times are
noisy to +-20 %; one thread; peak RSS growth; memory x / time x of the reference, same impl).
Before: commit c75e2b6; after: streamed rows (GenericAttention only, see
``captum_transformers/methods/streaming_rows.py``). Reference peak MiB: eager 255 / 892 / 3318,
sdpa 74 / 146 / 291 at 1k / 2k / 4k.

=================== ======= ================ ================ ================
method              impl    1k before/after  2k before/after  4k before/after
=================== ======= ================ ================ ================
GenericAttention    eager   0.67/0.35 mem    0.61/0.20        0.58/0.11
                            1.01/0.84 time   1.08/0.76        0.85/0.84
GenericAttention    sdpa    2.29/1.19 mem    3.74/1.20     6.64/1.30
                            2.32/1.58 time   2.79/2.20     3.73/3.07
TransformerRelevance eager  0.77 mem, 2.0 time (unchanged)    0.61, 1.8-2.0
TransformerRelevance sdpa   2.66 / 4.5-5.2   4.06 / 6.6       6.96 / 7.0 (unchanged)
AttentionRollout    eager   0.26 mem, 0.3 time at every size (unchanged)
AttentionRollout    sdpa    0.88 / 0.7-0.8   1.59 / 0.84      3.03 / 0.93 (unchanged)
AttnLRP             sdpa    0.88 / 0.8-1.1 at every size (unchanged; eager 1.0 / 0.9-1.0)
=================== ======= ================ ================ ================

Extra memory over the reference (before, sdpa), KiB per token: GenericAttention 306 (1k->2k),
621 (2k->4k); TransformerRelevance 325, 644; AttentionRollout 96, 252: quadratic (one
(B, N, N) map per layer kept, plus a (B, H, N, N) map made per layer). After, GenericAttention
sdpa: 15 and 30 KiB per token (extra 14 / 29 / 88 MiB): what is left is quadratic but 20x
smaller, the (1, 1, N, N) boolean causal mask each layer builds for the recomputed map
(16 MiB per layer at 4k). Time stays above 1.5x on sdpa: the explicit attention (7 products
per chunk, the causal half skipped) against PyTorch's fused flash kernel; the 4k sdpa cell was
run by itself while the machine was loaded (load 8).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

# This checkout's package, not whichever one the environment installed (a second worktree).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_memory import measure_on_random_ids, plain_gradient_run  # noqa: E402

METHODS = ("GenericAttention", "TransformerRelevance", "AttentionRollout", "AttnLRP", "AttentionGradCAM",
           "RawAttention")


def build_model(impl: str):
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                                      attn_implementation=impl, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def operation(name: str, model, ids: torch.Tensor, target: int):
    if name == "reference":
        return plain_gradient_run(model, ids, target)
    import captum_transformers as ct
    method = getattr(ct, name)(model)
    return lambda: method.attribute(ids, target=target, return_tokens=True)


def cell(name: str, impl: str, tokens: int) -> dict:
    torch.set_num_threads(1)
    return measure_on_random_ids(build_model(impl), tokens, lambda m, ids, target: operation(name, m, ids, target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--impls", nargs="+", default=["eager", "sdpa"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--cell", nargs=3, metavar=("METHOD", "IMPL", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(args.cell[0], args.cell[1], int(args.cell[2]))))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open("/proc/loadavg") as load:
        print(f"load average at start: {load.read().split()[0]}")
    print(f"{'impl':6} {'N':>5} {'method':22} {'peak MiB':>9} {'memory':>7} {'time':>6} {'extra MiB':>9}")
    extras = {}
    for impl in args.impls:
        for tokens in args.sizes:
            results = {}
            for name in ("reference", *args.methods):
                out = subprocess.run([sys.executable, __file__, "--cell", name, impl, str(tokens)], env=env,
                                     capture_output=True, text=True)
                if out.returncode:
                    print(f"{impl:6} {tokens:5} {name:22} failed: {out.stderr.strip().splitlines()[-1:]}")
                    continue
                results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            ref = results.get("reference")
            for name, res in results.items():
                extra = (res["peak"] - ref["peak"]) / 2**20
                extras[(impl, name, tokens)] = extra
                print(f"{impl:6} {tokens:5} {name:22} {res['peak'] / 2**20:9.1f} {res['peak'] / ref['peak']:6.2f}x "
                      f"{res['cpu'] / ref['cpu']:5.2f}x {extra:9.1f}", flush=True)
    print("\nslope of the extra memory over the reference, KiB per token (between consecutive sizes):")
    for impl in args.impls:
        for name in args.methods:
            pairs = list(zip(args.sizes, args.sizes[1:]))
            slopes = [(extras.get((impl, name, b), float("nan")) - extras.get((impl, name, a), float("nan")))
                      * 1024 / (b - a) for a, b in pairs]
            print(f"{impl:6} {name:22} " + "  ".join(f"{a}->{b}: {s:8.1f}" for (a, b), s in zip(pairs, slopes)))
    with open("/proc/loadavg") as load:
        print(f"load average at end: {load.read().split()[0]}")


if __name__ == "__main__":
    main()
