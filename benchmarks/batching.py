"""Images per second of each method: one batch of 32 against one image per call.

The reference repositories explain one image at a time; every method here takes a batch.
For each method, the same images are explained as one ``attribute`` call on a batch and as
one call per image (targets: the model's arg-max), interleaved, median of ``--repeats``; the
table gives both rates and their ratio (the gain of batching).

Models: the built-in DigitCanvas ViT (timm, 4 layers, width 64, 32 px, 65 tokens; the shipped
weights) and a ViT-B-sized HF ViT with random weights (12 layers, width 768, 224 px, 197
tokens). One image per call is timed on the first ``--singles`` images (a rate, so fewer
suffice on the large model).

Command (one thread, the README's table)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/batching.py --threads 1

``--quick`` runs the DigitCanvas ViT only, with 8 images; ``--digit-only`` the DigitCanvas ViT
with the full batch (to compare two checkouts: ``PYTHONPATH=<checkout>``); ``--large-only`` the
ViT-B-sized model only.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

METHODS = ("raw-attention", "rollout", "grad-cam", "generic-attention", "transformer-relevance", "conservative-lrp",
           "attn-lrp")


def digit_vit() -> torch.nn.Module:
    from captum_transformers.tasks.digits.model import load_digit_model

    return load_digit_model()


def vit_base() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       image_size=224, patch_size=16, num_labels=1000)
    return ViTForImageClassification(config).eval()


def _cpu_median(op: Callable[[], object], repeats: int) -> float:
    values: List[float] = []
    for _ in range(repeats):
        gc.collect()
        start = time.process_time()
        op()
        values.append(time.process_time() - start)
    return statistics.median(values)


def rates(model: torch.nn.Module, images: torch.Tensor, methods: Sequence[str], singles: int,
          repeats: int) -> Dict[str, tuple]:
    """method -> (images/s batched, images/s one at a time), CPU time of this process."""
    from captum_transformers.methods.catalog import build_method

    with torch.no_grad():
        logits = model(images)
    logits = logits.logits if hasattr(logits, "logits") else logits
    targets = logits.argmax(-1)
    found = {}
    for name in methods:
        method = build_method(name, model)

        def batched(method=method):
            return method.attribute(images, target=targets)

        def one_at_a_time(method=method):
            return [method.attribute(images[i:i + 1], target=targets[i:i + 1]) for i in range(singles)]

        batched(), one_at_a_time()  # warm-up
        seconds_batched, seconds_singles = [], []
        for _ in range(repeats):  # interleaved
            seconds_batched.append(_cpu_median(batched, 1))
            seconds_singles.append(_cpu_median(one_at_a_time, 1))
        found[name] = (len(images) / statistics.median(seconds_batched), singles / statistics.median(seconds_singles))
        print(f"  {name}: {found[name][0]:.1f} images/s batched, {found[name][1]:.1f} one at a time", flush=True)
    return found


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--singles", type=int, default=32, help="images explained one per call (DigitCanvas ViT)")
    parser.add_argument("--singles-large", type=int, default=4, help="images explained one per call (ViT-B)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--digit-only", action="store_true", help="the DigitCanvas ViT only, full batch")
    parser.add_argument("--large-only", action="store_true", help="the ViT-B-sized model only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    models = [] if args.large_only else [("DigitCanvas ViT (timm, 4 layers, width 64, 32 px)", digit_vit, 32,
                                          args.singles)]
    if not (args.quick or args.digit_only):
        models.append(("ViT-B-sized HF ViT (random, 12 layers, width 768, 224 px)", vit_base, 224, args.singles_large))
    batch = 8 if args.quick else args.batch
    table = []
    for label, build, size, singles in models:
        print(label, flush=True)
        images = torch.randn(batch, 3, size, size, generator=generator)
        found = rates(build(), images, args.methods, min(singles, batch), 1 if args.quick else args.repeats)
        table.extend((label, name, *values) for name, values in found.items())
    print(f"\n{args.threads} thread(s), CPU time, median of {args.repeats}; batch {batch}")
    print("| model | method | images/s, batch | images/s, one per call | gain |")
    print("|---|---|---|---|---|")
    for label, name, batched, single in table:
        print(f"| {label} | {name} | {batched:.1f} | {single:.1f} | {batched / single:.1f}x |")


if __name__ == "__main__":
    main()
