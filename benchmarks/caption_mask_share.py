"""Does each generated digit's image map sit on that digit? Mask shares on the built-in captioner.

The shipped digit captioner (:mod:`captum_transformers.tasks.digit_captioner`, a tiny LLaVA)
writes the two digits of a two-digit DigitCanvas canvas in reading order. Both digits' exact
masks are known, so for each generated digit ``t`` with mask ``M_t`` (the other digit's
``M_o``) and image map ``A_t`` (``result.image_attr[t]`` of :class:`GenerationAttribution`,
one batched call per method, the correct digits given as targets) the benchmark scores

.. math:: \\text{share}_t = \\frac{\\sum_{p \\in M_t} A_t^+(p)}{\\sum_{p \\in M_t \\cup M_o} A_t^+(p)},
          \\qquad A^+ = \\max(A, 0)

over the canvases the captioner reads correctly. A map that does not depend on which digit is
being written (raw attention, rollout: class-agnostic) puts the same mass on both digits for
both steps, so its shares average about 0.5; a map that follows the written digit scores near
1. The package's methods that support vision-language models run through the engine; Captum's
Integrated Gradients runs on the pixels directly (``captum.attr.IntegratedGradients`` of the
step's logit w.r.t. ``pixel_values``, teacher forced, black canvas baseline), through the same
model. Means carry seeded percentile bootstrap 95 % intervals over (canvas, digit) pairs; a
digit whose map has no positive mass on either mask has no share (column ``no mass``, left out).

Run::

    python benchmarks/caption_mask_share.py [--n 64] [--threads 1] [--figure docs/images/captioner_maps.png]

Measured (2026-11-26, CPU, 1 thread, defaults: 61 of 64 canvases captioned right, 122 digits;
43 CPU s in all)::

    method                   share [95 % CI]              n no mass   CPU s
    attn-lrp                 0.909 [0.900, 0.917]       122       0     0.3
    conservative-lrp         0.884 [0.875, 0.892]       122       0     0.2
    conservative-lrp-ah      0.846 [0.831, 0.860]       122       0     0.2
    captum-ig (pixels)       0.826 [0.816, 0.836]       122       0     9.8
    gradient-x-input         0.816 [0.799, 0.832]       122       0     0.2
    generic-attention        0.814 [0.790, 0.839]       122       0     0.3
    transformer-relevance    0.770 [0.719, 0.821]       122       0     0.9
    lrp                      0.671 [0.624, 0.717]       122       0     0.9
    rollout                  0.581 [0.568, 0.593]       122       0     0.2
    partial-lrp              0.542 [0.496, 0.595]       120       2     0.8
    grad-cam                 0.538 [0.461, 0.612]        52      70     0.4
    attention-flow           0.512 [0.495, 0.528]       122       0    21.3
    raw-attention            0.505 [0.465, 0.542]       122       0     0.2

A method the engine refuses for vision-language models would be listed with the reason (none is).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from captum_transformers.errors import CaptureError, InputError
from captum_transformers.tasks.bootstrap import bootstrap_interval
from captum_transformers.tasks.digit_canvas import digit_canvases, normalize
from captum_transformers.tasks.digit_captioner import (PROMPT, answer_ids, caption_inputs, caption_targets,
                                                       generated_digits, load_digit_captioner)

SEED = 7  # test canvases scored (not those of the accuracy record, seed 0)
IG_STEPS = 32
CAPTUM_IG = "captum-ig (pixels)"


def mask_shares(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """(N, 2) shares of the positive mass of ``maps`` (N, 2, H, W) on ``masks`` (N, 2, H, W) of the same digit.

    Step ``t``'s share is its positive mass on mask ``t`` over its positive mass on both masks;
    NaN where a map has no positive mass on either digit (excluded from the means).

    Example::

        >>> masks = torch.zeros(1, 2, 2, 2, dtype=torch.bool); masks[0, 0, 0] = True; masks[0, 1, 1] = True
        >>> mask_shares(torch.ones(1, 2, 2, 2), masks).tolist()
        [[0.5, 0.5]]
    """
    positive = maps.double().clamp(min=0)
    either = (masks[:, 0] | masks[:, 1]).unsqueeze(1)
    own = (positive * masks).flatten(2).sum(-1)
    both = (positive * either).flatten(2).sum(-1)
    return torch.where(both > 0, own / both.clamp(min=1e-300), torch.full_like(own, float("nan")))


def correct_canvases(model, tokenizer, n: int, seed: int):
    """The first ``n`` test canvases (seed ``seed``) and which the captioner reads exactly right."""
    data = digit_canvases("test", "two", n=n, seed=seed)
    labels, masks = caption_targets(data)
    expected = answer_ids(labels)
    got = generated_digits(model, tokenizer, data.images)
    return data, masks, expected[:, :2], (got[:, :2] == expected[:, :2]).all(-1)


def package_maps(name: str, model, tokenizer, images01: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, 2, H, W) image maps of the two digits from the package's method ``name`` (one batched call)."""
    from captum_transformers.generation import GenerationAttribution
    from captum_transformers.methods.catalog import build_method

    explainer = GenerationAttribution(build_method(name, model), tokenizer)
    results = explainer.attribute([PROMPT] * len(images01), target=targets.tolist(),
                                  pixel_values=normalize(images01))
    maps = []
    for result in results:
        image_attr = result.image_attr
        image_attr = image_attr[0] if isinstance(image_attr, (list, tuple)) else image_attr
        maps.append(torch.as_tensor(image_attr).detach().float()[:2])
    return torch.stack(maps)


def captum_ig_maps(model, tokenizer, images01: torch.Tensor, targets: torch.Tensor,
                   steps: int = IG_STEPS) -> torch.Tensor:
    """(N, 2, H, W) Captum Integrated Gradients of each digit's logit w.r.t. the pixels, summed over channels.

    The score of digit ``t`` is the logit of its token at its place given the prompt and the
    digits before it (teacher forced); baseline: the black canvas.
    """
    from captum.attr import IntegratedGradients

    inputs = caption_inputs(tokenizer, images01)
    prompt = inputs["input_ids"]
    ids = torch.cat([prompt, targets], dim=1)
    first = prompt.shape[1] - 1  # the position whose logits predict digit 1

    def score(pixel_values, input_ids, step):
        logits = model(input_ids=input_ids, pixel_values=pixel_values).logits
        rows = torch.arange(len(input_ids))
        return logits[rows, first + step, input_ids[rows, first + 1 + step]]

    ig = IntegratedGradients(score)
    baseline = normalize(torch.zeros_like(images01))
    maps = []
    for step in range(targets.shape[1]):
        attr = ig.attribute(inputs["pixel_values"], baselines=baseline, n_steps=steps, internal_batch_size=256,
                            additional_forward_args=(ids, step))
        maps.append(attr.sum(1))
    return torch.stack(maps, dim=1).detach()


def run(n: int, seed: int = SEED, methods: Optional[List[str]] = None, log: Callable[[str], None] = print
        ) -> Tuple[Dict[str, dict], dict]:
    """``(rows, context)``: per method its shares interval, count and seconds, or the refusal."""
    from captum_transformers.methods.catalog import PACKAGE_METHOD_NAMES

    model, tokenizer = load_digit_captioner()
    data, masks, targets, correct = correct_canvases(model, tokenizer, n, seed)
    images, masks, targets = data.images[correct], masks[correct], targets[correct]
    log(f"{int(correct.sum())} of {n} canvases captioned exactly right; scoring their {2 * len(images)} digits")
    rows: Dict[str, dict] = {}
    all_maps: Dict[str, torch.Tensor] = {}
    for name in list(PACKAGE_METHOD_NAMES if methods is None else methods) + [CAPTUM_IG]:
        start = time.process_time()
        try:
            maps = (captum_ig_maps(model, tokenizer, images, targets) if name == CAPTUM_IG
                    else package_maps(name, model, tokenizer, images, targets))
        except (InputError, CaptureError, NotImplementedError) as error:
            rows[name] = {"refused": str(error).splitlines()[0][:160]}
            log(f"{name}: refused ({rows[name]['refused']})")
            continue
        seconds = time.process_time() - start
        interval = bootstrap_interval(mask_shares(maps, masks).reshape(-1), name=name)
        rows[name] = {"interval": interval, "seconds": seconds}
        all_maps[name] = maps
        log(f"{name}: {interval.text} n={interval.count} ({seconds:.1f} CPU s)")
    context = {"images": images, "masks": masks, "targets": targets, "maps": all_maps, "tokenizer": tokenizer}
    return rows, context


def best_method(rows: Dict[str, dict]) -> str:
    scored = {name: row["interval"].value for name, row in rows.items() if "interval" in row}
    if not scored:
        raise InputError("no method produced image maps; nothing to draw.")
    return max(scored, key=scored.get)


def side_by_side(masks: torch.Tensor) -> torch.Tensor:
    """(N,) whether the first digit (reading order) lies wholly left of the canvas middle and the second right of it."""
    middle = masks.shape[-1] // 2
    columns = masks.any(dim=-2)  # (N, 2, W)
    return ~columns[:, 0, middle:].any(-1) & ~columns[:, 1, :middle].any(-1)


def draw_figure(rows: Dict[str, dict], context: dict, path: str, index: Optional[int] = None):
    """The canvas and the best method's maps for its two generated digits (two rows), masks outlined.

    ``index`` picks the scored canvas (default: the first whose digits sit side by side, so the
    reading order is left to right).
    """
    from captum_transformers.methods.catalog import SIGNED_METHODS
    from captum_transformers.visualization.grid import ExplanationGrid

    name = best_method(rows)
    if index is None:
        beside = torch.nonzero(side_by_side(context["masks"])).flatten()
        index = int(beside[0]) if len(beside) else 0
    maps = context["maps"][name][index]
    words = context["tokenizer"].convert_ids_to_tokens(context["targets"][index].tolist())
    image = context["images"][index]
    grid = ExplanationGrid([image, image], {name: maps}, titles=[f"writes '{words[0]}' (1st)",
                                                                 f"writes '{words[1]}' (2nd)"],
                           signed=name in SIGNED_METHODS, outlines=[context["masks"][index, 0],
                                                                   context["masks"][index, 1]],
                           title=f"Digit captioner: {name} image map per generated digit (mask outlined)")
    return grid.save(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="test canvases (those captioned right are scored)")
    parser.add_argument("--seed", type=int, default=SEED, help="canvas seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", nargs="*", default=None, help="package methods (default: all)")
    parser.add_argument("--figure", default=None, help="write the best method's two maps to this PNG")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows, context = run(args.n, args.seed, args.methods, log=lambda line: print(line, file=sys.stderr))
    finally:
        torch.set_num_threads(threads)
    command = "python benchmarks/caption_mask_share.py " + " ".join(
        f"--{k} {v}" for k, v in (("n", args.n), ("seed", args.seed), ("threads", args.threads)))
    print(f"mask share of each generated digit's positive image map ({command}); class-agnostic ~0.5")
    print(f"{'method':24s} {'share [95 % CI]':24s} {'n':>5s} {'no mass':>7s} {'CPU s':>7s}")
    ordered = sorted(rows.items(), key=lambda item: -item[1]["interval"].value if "interval" in item[1] else 2)
    for name, row in ordered:
        if "interval" in row:
            interval = row["interval"]
            print(f"{name:24s} {interval.text:24s} {interval.count:5d} {interval.excluded:7d} {row['seconds']:7.1f}")
        else:
            print(f"{name:24s} refused: {row['refused']}")
    if args.figure:
        print(f"figure: {draw_figure(rows, context, args.figure)} ({best_method(rows)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
