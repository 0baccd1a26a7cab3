"""Forward-only methods on short inputs: the dense maps against the replayed rows.

AttentionRollout and RawAttention replay each call's map after the forward pass, a chunk of rows
at a time (``capture/replayed_rows.py``), only where the dense maps exceed
``DENSE_MAPS_BUDGET_BYTES``; below it they keep the maps. On a 6-layer eager HF ViT (width 256,
4 heads, 192 px images: 144 patches + CLS, batch 16, eval, one CPU thread) this times, in
interleaved rounds after warm-up (CPU time of the thread: less disturbed by other processes than wall time), a plain forward under ``torch.no_grad()``, rollout and raw
attention as chosen by the budget, and both forced onto the replay (budget 0), and prints each
as a ratio to the forward (per round, over that round's forward, then the median: the paired
ratio, robust to a machine that drifts). The dense paths and the forced replays are timed in
two phases, each against its own forwards. The bound kept here: rollout <= 1.07x a forward; the
script exits 1 above it.

Usage::

    python benchmarks/rollout_short_inputs.py              # 15 rounds
    python benchmarks/rollout_short_inputs.py --rounds 40
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

BOUND = 1.07


def build(batch: int):
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    config = ViTConfig(image_size=192, patch_size=16, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                       intermediate_size=1024, num_labels=10, attn_implementation="eager")
    return ViTForImageClassification(config).eval(), torch.randn(batch, 3, 192, 192)


def interleaved(ops, rounds: int):
    """Each op's thread CPU time per round, after one warm-up call each, in a rotating order."""
    names = list(ops)
    for op in ops.values():
        op()
    times = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            start = time.thread_time()
            ops[name]()
            times[name].append(time.thread_time() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import captum_transformers as ct
    import captum_transformers.capture.replayed_rows as replayed_rows

    model, images = build(args.batch)
    rollout, raw = ct.AttentionRollout(model), ct.RawAttention(model)
    budget = replayed_rows.DENSE_MAPS_BUDGET_BYTES

    def forced(method):
        def run():
            replayed_rows.DENSE_MAPS_BUDGET_BYTES = 0
            try:
                method.attribute(images, target=0)
            finally:
                replayed_rows.DENSE_MAPS_BUDGET_BYTES = budget
        return run

    def forward():
        with torch.no_grad():
            model(images)

    rollout.attribute(images, target=0)
    chosen = "replayed rows" if rollout._row_stream.replayed else f"dense ({rollout._row_stream.reason})"
    print(f"6-layer eager ViT, batch {args.batch}, 145 tokens, 1 thread, {args.rounds} interleaved rounds per "
          f"phase (CPU time); rollout takes the {chosen} path")
    print(f"{'':32s} {'median ms':>10s} {'x forward':>10s}")
    # Two phases, each against its own forwards: the paths allocate differently, and a round of
    # one disturbs the caches of the next less when like is timed with like.
    phases = [{"rollout": lambda: rollout.attribute(images, target=0),
               "raw attention": lambda: raw.attribute(images, target=0)},
              {"rollout, replayed rows": forced(rollout), "raw attention, replayed rows": forced(raw)}]
    ratios = {}
    for phase in phases:
        ops = {"forward (no grad)": forward, **phase}
        times = interleaved(ops, args.rounds)
        for name in ops:
            # per round: the op's time over that round's forward (paired), then the median
            paired = statistics.median(t / f for t, f in zip(times[name], times["forward (no grad)"]))
            ratios[name] = paired
            print(f"{name:32s} {1000 * statistics.median(times[name]):10.1f} {paired:10.3f}")
    ratio = ratios["rollout"]
    print(f"rollout / forward (median of paired rounds): {ratio:.3f} (bound {BOUND})")
    return 0 if ratio <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
