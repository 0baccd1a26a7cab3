"""Time and peak memory of every method on a Swin-T-sized model, as ratios to its own passes.

Model: timm ``SwinTransformer`` with Swin-T's sizes (patch 4, embed 96, depths 2-2-6-2,
heads 3-6-12-24, window 7, 224x224, 1000 classes), randomly initialised (no hub), eval mode;
``--model hf`` measures HF ``SwinForImageClassification`` with the same sizes. Batch 8,
explaining class 0 for every image.

Reference passes (interleaved with the methods, one run of each per round in rotating order,
after warm-up, median over ``--repeats``):

* ``forward``: ``model(x)`` under ``torch.no_grad()``; RawAttention and AttentionRollout take
  no gradient and are compared with it;
* ``forward+backward``: a forward with gradients plus ``torch.autograd.grad`` of the explained
  logits with respect to every parameter (a training step without the update); every
  gradient method is compared with it.

Peak memory: above what was live before the call (model and inputs excluded), read as in
``peak_memory.py`` (CPU: VmHWM after resetting the counter; CUDA: ``max_memory_allocated``):
each op in a fresh subprocess (``--memory subprocess``, the default), or after the timing runs
in the same process (``--memory inprocess``: glibc set to return freed buffers at once, the op
already warm, one more run each; cheaper on a busy machine). Printed as a Markdown table.

Run: ``OMP_NUM_THREADS=1 python benchmarks/swin_cost.py [--model timm|hf] [--repeats 3]
[--warmup 1] [--batch 8] [--image 224] [--memory subprocess|inprocess|off]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_methods import time_ops  # noqa: E402
from peak_memory import _tight_malloc, peak_bytes  # noqa: E402

import captum_transformers as ct  # noqa: E402

FORWARD_ONLY = ("RawAttention", "AttentionRollout")
METHODS = ("RawAttention", "AttentionRollout", "AttentionGradCAM", "GenericAttention", "TransformerRelevance",
           "PartialLRP", "ConservativeLRP", "AttnLRP", "TransformerLRP")


def build(kind: str, image: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "timm":
        from timm.models.swin_transformer import SwinTransformer
        return SwinTransformer(img_size=image, patch_size=4, embed_dim=96, depths=(2, 2, 6, 2),
                               num_heads=(3, 6, 12, 24), window_size=7, num_classes=1000).eval()
    from transformers import SwinConfig, SwinForImageClassification
    return SwinForImageClassification(SwinConfig(image_size=image, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2],
                                                 num_heads=[3, 6, 12, 24], window_size=7, num_labels=1000)).eval()


def make_ops(model: torch.nn.Module, x: torch.Tensor, methods=METHODS) -> Dict[str, Callable[[], object]]:
    target = [0] * x.shape[0]
    params = [p for p in model.parameters() if p.requires_grad]

    def logits(output):
        return getattr(output, "logits", output)

    def forward():
        with torch.no_grad():
            return logits(model(x))

    def forward_backward():
        with torch.enable_grad():
            score = logits(model(x))[:, 0].sum()
            return torch.autograd.grad(score, params)

    ops = {"forward": forward, "forward+backward": forward_backward}
    for name in methods:
        explainer = getattr(ct, name)(model)
        ops[name] = (lambda e: lambda: e.attribute(x, target=target))(explainer)
    return ops


def _child(kind: str, op: str, batch: int, image: int) -> None:
    _tight_malloc()
    model = build(kind, image)
    x = torch.randn(batch, 3, image, image)
    peak, exact = peak_bytes(make_ops(model, x)[op])
    print(json.dumps({"peak": peak, "exact": exact}))


def _peak(kind: str, op: str, batch: int, image: int) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 * 1024), MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", op, "--model", kind,
                           "--batch", str(batch), "--image", str(image)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("timm", "hf"), default="timm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--memory", choices=("subprocess", "inprocess", "off"), default="subprocess")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="methods to measure (the two reference passes always run); on a busy machine run "
                             "several processes with a few methods each")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        _child(args.model, args._child, args.batch, args.image)
        return
    model = build(args.model, args.image)
    x = torch.randn(args.batch, 3, args.image, args.image)
    ops = make_ops(model, x, args.methods)
    times = time_ops(ops, repeats=args.repeats, warmup=args.warmup)
    median = {name: statistics.median(t["wall"]) for name, t in times.items()}
    cpu = {name: statistics.median(t["cpu"]) for name, t in times.items()}
    peaks = {}
    if args.memory == "subprocess":
        peaks = {name: _peak(args.model, name, args.batch, args.image) for name in ops}
    elif args.memory == "inprocess":
        _tight_malloc()
        peaks = {name: peak_bytes(op, warmup=False)[0] for name, op in ops.items()}
    print(f"{args.model} Swin-T sizes, {args.image}x{args.image}, batch {args.batch}, threads "
          f"{torch.get_num_threads()}, median of {args.repeats} after {args.warmup} warm-up (wall / process CPU), "
          f"memory {args.memory}")
    print("| op | wall s | CPU s | time ratio | reference | peak MiB | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in ops:
        reference = "forward" if name in FORWARD_ONLY or name == "forward" else "forward+backward"
        ratio = cpu[name] / cpu[reference]
        memory = f"{peaks[name] / 2**20:.0f}" if peaks else "-"
        memory_ratio = f"{peaks[name] / max(peaks[reference], 1):.2f}" if peaks else "-"
        print(f"| {name} | {median[name]:.2f} | {cpu[name]:.2f} | {ratio:.2f} | {reference} | {memory} | "
              f"{memory_ratio} |")


if __name__ == "__main__":
    main()
