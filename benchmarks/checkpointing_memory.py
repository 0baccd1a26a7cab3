"""Peak memory of explanations with HF gradient checkpointing kept on (``keep_gradient_checkpointing``).

A 4-layer Llama built from a config (width 256, 8 heads, 2 key-value heads, intermediate
512, random weights, float32, eager attention) in train mode (its dropout is 0), one
sequence of 1k and 2k tokens, the causal-LM head explained at the last position. Each cell
runs in a fresh subprocess (one thread): peak memory is the growth of peak RSS above what was
live before the call (``benchmarks/peak_memory.py``), CPU time the process time of the fastest
of three more calls (``peak_memory.measure_on_random_ids``). "plain": checkpointing enabled but
turned off inside the explanation (the default); "kept": ``with keep_gradient_checkpointing():``.
The reference is the model's forward on input embeddings that require grad and ``autograd.grad`` of
the explained logit, without and with checkpointing (HF's own, as in training).

Command (about 7 minutes)::

    OMP_NUM_THREADS=1 python benchmarks/checkpointing_memory.py [--sizes 1024 2048] [--methods AttnLRP]

Figures (2-core VM, load 1.0, one thread; float32; MiB of peak-RSS growth; "memory" and "time" are
kept / plain, the time the fastest of three runs with freed buffers reused), commit 2627444 (the
attention methods stream their maps inside ``attribute()``, grouped-query keys kept unrepeated)::

    method                     N  plain MiB  kept MiB  memory   time
    reference               1024      254.6     111.2   0.44x  1.41x
    AttnLRP                 1024      251.4     126.5   0.50x  1.27x
    ConservativeLRP         1024      205.4      78.8   0.38x  1.69x
    GenericAttention        1024       81.6      34.0   0.42x  1.53x
    TransformerRelevance    1024       96.3      72.1   0.75x  1.33x
    AttentionGradCAM        1024       82.9      35.3   0.43x  1.42x
    reference               2048      891.9     421.7   0.47x  1.17x
    AttnLRP                 2048      885.8     451.8   0.51x  1.87x
    ConservativeLRP         2048      737.9     292.5   0.40x  1.77x
    GenericAttention        2048      162.7      67.1   0.41x  0.99x
    TransformerRelevance    2048      185.4     136.4   0.74x  1.36x
    AttentionGradCAM        2048      162.5      67.0   0.41x  1.01x

Keeping checkpointing halves the peak of the one-backward methods (0.4-0.5x, as for the model's
own forward + backward) for 1.0-1.9x the CPU time (each layer's forward runs twice).
TransformerRelevance (two backward passes) gains less (0.74-0.75x): what its rules keep per layer
between the passes is not an activation checkpointing frees. (Before the maps were streamed, on
2026-11-26 12:10 UTC at load 7-12 and timed under the memory measurement's allocator, the plain
peaks of TransformerRelevance and Grad-CAM were 197 / 174 MiB at 1k and 594 / 564 MiB at 2k, and
keeping checkpointing gave them only 0.70-0.90x.)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# This checkout's package, not whichever one the environment installed (a second worktree).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_memory import measure_on_random_ids, plain_gradient_run, run_cell  # noqa: E402

METHODS = ("AttnLRP", "ConservativeLRP", "GenericAttention", "TransformerRelevance", "AttentionGradCAM")


def build_model():
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
                                      attn_implementation="eager", pad_token_id=0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    return model.train()


def operation(name: str, model, ids: torch.Tensor, target: int, kept: bool):
    from captum_transformers.compat.checkpointing import keep_gradient_checkpointing
    if name == "reference":
        if not kept:  # the layers run plainly, as inside a default explanation
            for module in model.modules():
                if getattr(module, "gradient_checkpointing", False):
                    module.gradient_checkpointing = False
        return plain_gradient_run(model, ids, target)
    import captum_transformers as ct
    method = getattr(ct, name)(model)

    def run():
        if kept:
            with keep_gradient_checkpointing():
                return method.attribute(ids, target=target, return_tokens=True)
        return method.attribute(ids, target=target, return_tokens=True)
    return run


def cell(name: str, kept: bool, tokens: int) -> dict:
    torch.set_num_threads(1)
    return measure_on_random_ids(build_model(), tokens, lambda m, ids, target: operation(name, m, ids, target, kept))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--cell", nargs=3, metavar=("METHOD", "KEPT", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(args.cell[0], args.cell[1] == "kept", int(args.cell[2]))))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open("/proc/loadavg") as load:
        print(f"load average at start: {load.read().split()[0]}")
    print(f"{'method':22} {'N':>5} {'plain MiB':>9} {'kept MiB':>9} {'memory':>7} {'time':>6}")
    for tokens in args.sizes:
        for name in ("reference", *args.methods):
            results = {}
            for mode in ("plain", "kept"):
                result = run_cell(__file__, (name, mode, tokens), env)
                if isinstance(result, str):
                    print(f"{name:22} {tokens:5} {mode} {result}")
                    break
                results[mode] = result
            if len(results) < 2:
                continue
            plain, kept = results["plain"], results["kept"]
            print(f"{name:22} {tokens:5} {plain['peak'] / 2**20:9.1f} {kept['peak'] / 2**20:9.1f} "
                  f"{kept['peak'] / plain['peak']:6.2f}x {kept['cpu'] / plain['cpu']:5.2f}x", flush=True)
    with open("/proc/loadavg") as load:
        print(f"load average at end: {load.read().split()[0]}")


if __name__ == "__main__":
    main()
