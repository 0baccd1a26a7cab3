"""Does each generated digit's image map sit on that digit? Mask scores on the built-in captioner.

The shipped digit captioner (:mod:`captum_transformers.tasks.captioner.model`, a tiny LLaVA)
writes the two digits of a two-digit DigitCanvas canvas in reading order. Both digits' exact
masks are known, so for each generated digit ``t`` with mask ``M_t`` (the other digit's
``M_o``) and image map ``A_t`` (``result.image_attr[t]`` of :class:`GenerationAttribution`,
one batched call per method, the correct digits given as targets) the benchmark scores two
things, with ``A^+ = max(A, 0)``:

.. math:: \\text{share}_t = \\frac{\\sum_{p \\in M_t} A_t^+(p)}{\\sum_{p \\in M_t \\cup M_o} A_t^+(p)},
          \\qquad
          \\text{on-digit}_t = \\frac{\\sum_{p \\in M_t} A_t^+(p)}{\\sum_{p} A_t^+(p)}

``share`` is the share of the on-digit mass that lies on the written digit: it ignores the
mass off both digits (raw attention puts most of its mass there and still scores ~0.5).
``on-digit`` is the relevance mass accuracy of Arras et al. 2022 ("CLEVR-XAI", Information
Fusion 81): the written digit's share of the whole canvas's positive mass, so mass on the
background counts against a map. Baseline of ``share``: a map identical at both steps gives
``share_1 + share_2 = 1`` on every canvas, so its mean is exactly 0.5; a map that merely
varies little between the steps (raw attention, rollout: nearly class-agnostic) lands near
0.5, not at it. A map that follows the written digit scores near 1 on both columns.

The package's methods that support vision-language models run through the engine; Captum's
Integrated Gradients runs on the pixels directly (``captum.attr.IntegratedGradients`` of the
step's logit w.r.t. ``pixel_values``, teacher forced, black canvas baseline), through the same
model, over the canvases the captioner reads correctly. A digit whose map has no positive mass
on either mask has no share (column ``no mass``); the share column averages the others, the
``share (0)`` column counts those digits as 0, and a row with more than 10 % no-mass digits is
marked ``*`` (not comparable: its share averages a selected subset). Intervals are seeded
percentile bootstrap 95 % intervals over canvases (the two digits of a canvas share its image,
so a canvas's value is the mean of its digits' values and canvases are resampled).

Run::

    python benchmarks/caption_mask_share.py [--n 64] [--threads 1] [--figure docs/images/captioner_maps.png]

Measured (2026-11-26, CPU, 1 thread, ``--n 64 --seed 7 --threads 1``: 61 of 64 canvases captioned
right, 122 digits). A uniform map scores ``on-digit`` 0.119 (the written digit's mask covers
11.9 % of these canvases on average), so raw attention (0.091) and attention flow (0.128) sit near or below
chance there although their shares look like the 0.5 baseline::

    method                   share [95 % CI]          share (0) [95 % CI]      on-digit [95 % CI]           n no mass   CPU s
    attn-lrp                 0.909 [0.901, 0.916]     0.909 [0.901, 0.916]     0.755 [0.739, 0.772]       122       0     0.3
    conservative-lrp         0.884 [0.875, 0.892]     0.884 [0.875, 0.892]     0.745 [0.730, 0.760]       122       0     0.3
    conservative-lrp-ah      0.846 [0.833, 0.858]     0.846 [0.833, 0.858]     0.695 [0.677, 0.713]       122       0     0.3
    gradient-x-input         0.816 [0.803, 0.830]     0.816 [0.803, 0.830]     0.668 [0.651, 0.687]       122       0     0.3
    captum-ig (pixels)       0.826 [0.818, 0.834]     0.826 [0.818, 0.834]     0.642 [0.626, 0.657]       122       0    10.4
    lrp                      0.671 [0.633, 0.712]     0.671 [0.633, 0.712]     0.330 [0.296, 0.367]       122       0     0.9
    rollout                  0.581 [0.575, 0.586]     0.581 [0.575, 0.586]     0.259 [0.253, 0.265]       122       0     0.2
    generic-attention        0.814 [0.789, 0.838]     0.814 [0.789, 0.838]     0.213 [0.186, 0.239]       122       0     0.4
    transformer-relevance    0.770 [0.705, 0.827]     0.770 [0.705, 0.827]     0.173 [0.138, 0.209]       122       0     1.0
    attention-flow           0.512 [0.504, 0.519]     0.512 [0.504, 0.519]     0.128 [0.124, 0.131]       122       0    19.0
    partial-lrp              0.549 [0.504, 0.596]     0.533 [0.492, 0.575]     0.112 [0.094, 0.133]       120       2     1.1
    raw-attention            0.505 [0.477, 0.529]     0.505 [0.477, 0.529]     0.091 [0.082, 0.100]       122       0     0.1
    grad-cam *               0.552 [0.477, 0.625]     0.229 [0.175, 0.283]     0.063 [0.043, 0.087]        52      70     0.6

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
from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
from captum_transformers.tasks.captioner.model import (PROMPT, answer_ids, caption_inputs, caption_targets,
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


def on_digit_mass(maps: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """(N, 2) relevance mass accuracy (Arras et al. 2022): positive mass on the written digit's mask over the whole map's.

    NaN where a map has no positive mass at all.

    Example::

        >>> masks = torch.zeros(1, 2, 2, 2, dtype=torch.bool); masks[0, 0, 0, 0] = True; masks[0, 1, 1, 1] = True
        >>> on_digit_mass(torch.ones(1, 2, 2, 2), masks).tolist()
        [[0.25, 0.25]]
    """
    positive = maps.double().clamp(min=0)
    own = (positive * masks).flatten(2).sum(-1)
    total = positive.flatten(2).sum(-1)
    return torch.where(total > 0, own / total.clamp(min=1e-300), torch.full_like(own, float("nan")))


def per_canvas(values: torch.Tensor, missing_as_zero: bool = False) -> torch.Tensor:
    """(N,) the mean of each canvas's two digit values (N, 2), the unit the bootstrap resamples.

    NaN digits are left out (a canvas with none left is NaN) or, with ``missing_as_zero``, count as 0.

    Example::

        >>> per_canvas(torch.tensor([[1.0, float("nan")], [0.5, 0.0]])).tolist()
        [1.0, 0.25]
        >>> per_canvas(torch.tensor([[1.0, float("nan")]]), missing_as_zero=True).tolist()
        [0.5]
    """
    values = values.double()
    if missing_as_zero:
        return torch.nan_to_num(values, nan=0.0).mean(-1)
    return values.nanmean(-1)


NOT_COMPARABLE = 0.10  # rows with more no-mass digits than this share average a selected subset


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
    """``(rows, context)``: per method its share, share (0) and on-digit intervals (over canvases), digit
    counts, comparability and seconds, or the refusal."""
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
        shares = mask_shares(maps, masks)
        no_mass = int(torch.isnan(shares).sum())
        rows[name] = {"interval": bootstrap_interval(per_canvas(shares), name=name),
                      "share_zero": bootstrap_interval(per_canvas(shares, missing_as_zero=True), name=name),
                      "on_digit": bootstrap_interval(per_canvas(on_digit_mass(maps, masks), missing_as_zero=True),
                                                     name=name),
                      "digits": shares.numel() - no_mass, "no_mass": no_mass,
                      "comparable": no_mass <= NOT_COMPARABLE * shares.numel(), "seconds": seconds}
        all_maps[name] = maps
        log(f"{name}: share {rows[name]['interval'].text} on-digit {rows[name]['on_digit'].text} "
            f"no mass {no_mass} ({seconds:.1f} CPU s)")
    context = {"images": images, "masks": masks, "targets": targets, "maps": all_maps, "tokenizer": tokenizer}
    return rows, context


def best_method(rows: Dict[str, dict]) -> str:
    """The comparable method with the most positive mass on the written digit (``on-digit``)."""
    scored = {name: row["on_digit"].value for name, row in rows.items() if "interval" in row and row["comparable"]}
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


def format_rows(rows: Dict[str, dict]) -> str:
    """The table body: comparable rows by ``on-digit`` (highest first), then the not comparable (``*``), then refusals."""
    def order(item):
        name, row = item
        if "interval" not in row:
            return (2, 0.0)
        return (0 if row["comparable"] else 1, -row["on_digit"].value)

    lines = []
    for name, row in sorted(rows.items(), key=order):
        if "interval" not in row:
            lines.append(f"{name:24s} refused: {row['refused']}")
            continue
        label = name if row["comparable"] else name + " *"
        lines.append(f"{label:24s} {row['interval'].text:24s} {row['share_zero'].text:24s} {row['on_digit'].text:24s} "
                     f"{row['digits']:5d} {row['no_mass']:7d} {row['seconds']:7.1f}")
    return "\n".join(lines)


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
    print(f"positive image mass of each generated digit ({command}); share: of the on-digit mass "
          f"(exactly 0.5 for a map identical at both steps), share (0): no-mass digits count 0, on-digit: of the "
          f"whole canvas; 95 % CI over canvases; * more than {NOT_COMPARABLE:.0%} no-mass digits: not comparable")
    print(f"{'method':24s} {'share [95 % CI]':24s} {'share (0) [95 % CI]':24s} {'on-digit [95 % CI]':24s} "
          f"{'n':>5s} {'no mass':>7s} {'CPU s':>7s}")
    print(format_rows(rows))
    if args.figure:
        print(f"figure: {draw_figure(rows, context, args.figure)} ({best_method(rows)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
