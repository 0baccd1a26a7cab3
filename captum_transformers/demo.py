"""The built-in demo: every attention method on small models built in code, offline.

Run ``python -m captum_transformers`` (optionally ``--out DIR``). It builds a 4-layer
ViT and a 4-layer BERT from configs with random weights (there is no model hub here; the
trained built-in model arrives with the evaluation harness), explains one batch with
every method, prints a summary per method and, if matplotlib is installed, writes a PNG
grid of the image maps.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

import torch

from .methods import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS

DEMO_METHODS = ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS


def _build_models():
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise SystemExit("The demo needs transformers: pip install 'captum_transformers[hf]'.") from error
    torch.manual_seed(0)
    vit = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=64,
        patch_size=8, num_labels=10)).eval()
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, num_labels=2,
        vocab_size=1000)).eval()
    return vit, bert


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m captum_transformers", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="captum_transformers_demo", help="folder for the PNG grid")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    vit, bert = _build_models()
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 3, 64, 64, generator=generator)
    ids = torch.randint(1, 1000, (args.batch, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    with torch.no_grad():
        predicted = vit(images).logits.argmax(-1)
    print(f"ViT (random weights, 64x64 input, 8x8 patches): predicted classes {predicted.tolist()}")
    image_maps = {}
    for method in DEMO_METHODS:
        start = time.perf_counter()
        maps = method(vit).attribute(images, target=predicted)
        image_maps[method.__name__] = maps
        tokens = method(bert).attribute(ids, target=1, forward_kwargs={"attention_mask": mask}, return_tokens=True)
        elapsed = (time.perf_counter() - start) * 1000
        top = tokens[0].topk(3).indices.tolist()
        print(f"{method.__name__:>20}: image map {tuple(maps.shape)} range [{maps.min():.3g}, {maps.max():.3g}]; "
              f"BERT top tokens of example 0 {top}; {elapsed:.0f} ms")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNG grid (pip install 'captum_transformers[viz]').")
        return 0
    os.makedirs(args.out, exist_ok=True)
    figure, axes = plt.subplots(args.batch, len(image_maps) + 1, figsize=(2 * (len(image_maps) + 1), 2 * args.batch),
                                squeeze=False)
    for row in range(args.batch):
        axes[row][0].imshow(images[row].permute(1, 2, 0).numpy())
        axes[row][0].set_title(f"class {int(predicted[row])}", fontsize=8)
        for col, (name, maps) in enumerate(image_maps.items(), start=1):
            axes[row][col].imshow(maps[row].sum(0).numpy(), cmap="inferno")
            axes[row][col].set_title(name, fontsize=7)
    for ax in (a for row in axes for a in row):
        ax.axis("off")
    path = os.path.join(args.out, "methods.png")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
