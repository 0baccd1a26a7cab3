# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Explaining a trained ViT: DigitCanvas
#
# The quickstart used random weights, so its maps only showed how to call the methods. Here
# the model is **trained**: the built-in DigitCanvas ViT (a 4-layer timm `VisionTransformer`,
# 32x32 canvases cut into an 8x8 grid of 4x4 patches, 65 tokens with CLS), shipped inside
# the package (`load_digit_model()`, no download). The canvases are handwritten
# scikit-learn digits drawn on real textures next to two pixel-scrambled "distractor"
# digits, and each comes with the exact mask of its digit, so we can check *where* a map
# puts its relevance.
#
# We
#
# 1. run every method of `captum_transformers.methods.catalog` on a few test canvases and
#    draw the maps over them,
# 2. measure how much of each map falls on the digit,
# 3. run one evaluation loop (pixel perturbation, segmentation) for a few package methods next
#    to Captum's own `IntegratedGradients` and `Saliency`,
# 4. explain *each* digit of two-digit canvases: class-specific methods move with the
#    explained class, attention rollout cannot.
#
# Everything runs offline on one CPU thread in well under a minute. Figures go to the
# directory named by `QUICKSTART_OUT`, or to a fresh temporary directory.

# %%
import os
import tempfile

import torch
from captum.attr import IntegratedGradients, Saliency

from captum_transformers.evaluation import ClassSpecificity, PixelPerturbation, SegmentationScores
from captum_transformers.methods.catalog import METHOD_NAMES, build_method
from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
from captum_transformers.tasks.digits.model import digit_model_record, load_digit_model
from captum_transformers.visualization import CurvePlot, ExplanationGrid

torch.manual_seed(0)
OUT = os.environ.get("QUICKSTART_OUT") or tempfile.mkdtemp(prefix="digit_canvas_vit_")
os.makedirs(OUT, exist_ok=True)
print("writing outputs to", OUT)

# %% [markdown]
# ## 1. The model and the test canvases
#
# `digit_canvases("test", n=...)` returns images in [0, 1] (what we draw), their masks and
# labels; the model takes `normalize(images)`. Test canvases only use source digits the
# model never saw in training.

# %%
model = load_digit_model()
record = digit_model_record()
print(f"shipped model: test top-1 {record['test_top1_one_digit']:.3f} on {record['test_canvases_per_variant']} "
      f"canvases, trained with `{record['command']}`")

test = digit_canvases("test", variant="one", n=128, seed=0)
inputs = normalize(test.images)
with torch.no_grad():
    predicted = model(inputs).argmax(dim=1)
DIGIT_ACCURACY = (predicted == test.labels).float().mean().item()
print(f"top-1 accuracy on these {len(test)} test canvases: {DIGIT_ACCURACY:.3f}")

shown = test[:4]
SHOWN_CORRECT = (predicted[:4] == shown.labels).tolist()
print("shown canvases: labels", shown.labels.tolist(), "predicted", predicted[:4].tolist())

# %% [markdown]
# ## 2. Every method, side by side
#
# `build_method(name, model)` builds any method of the catalog by its short name. Every method
# returns an attribution shaped like the input, `(B, 3, 32, 32)`: the attention methods
# upsample their 8x8 patch scores and repeat them over the channels, the LRP family gives
# signed relevance per pixel and channel. We sum the channels to one map per canvas, and add
# Captum's own `IntegratedGradients` and `Saliency` on the same model.
#
# Each map is explained for the model's predicted class and drawn over the grey canvas:
# **red is positive relevance, blue negative, and zero shows the canvas itself**
# (attention-based maps are never negative). The green line is the digit's mask.


# %%
def pixel_maps(attribution: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) attribution -> (B, H, W) map: the channels summed (signs kept)."""
    return attribution.detach().sum(dim=1)


def captum_baselines(model):
    """Captum's gradient methods, called the same way as the catalog's (`attribute(x, target)`)."""
    integrated = IntegratedGradients(model)
    saliency = Saliency(model)
    return {
        "integrated-gradients": lambda x, target: integrated.attribute(x, target=target, n_steps=32,
                                                                       internal_batch_size=256),
        "saliency": lambda x, target: saliency.attribute(x, target=target),
    }


explainers = {name: build_method(name, model).attribute for name in METHOD_NAMES}
explainers.update(captum_baselines(model))

shown_inputs, shown_target = normalize(shown.images), predicted[:4]
shown_maps = {name: pixel_maps(explain(shown_inputs, target=shown_target)) for name, explain in explainers.items()}


# `ExplanationGrid` draws the methods x examples view: each map over its canvas (in grey, so that
# only relevance is coloured), with the digit's mask outlined. `scale="per-map"` scales each cell
# by its own 98th percentile of |map|, not the maximum (Captum's visualizer does the same):
# per-pixel maps have a few extreme pixels that would otherwise wash out the rest. In a
# notebook the grid shows itself; `save` writes PNG, SVG or one self-contained HTML file.
grid = ExplanationGrid(shown.images, shown_maps,
                       [f"label {label}, pred {pred}" for label, pred in zip(shown.labels.tolist(), predicted[:4].tolist())],
                       scale="per-map", percentile=98, outlines=shown.masks, title="Every method on four test canvases")
methods_png = str(grid.save(os.path.join(OUT, "digit_methods.png")))
methods_html = str(grid.save(os.path.join(OUT, "digit_methods.html")))  # opens offline, images embedded
print("saved", methods_png, "and", methods_html)
grid  # shown inline in a notebook (a script ignores this line)

# %% [markdown]
# ## 3. How much of each map lies on the digit?
#
# A number for what the figure shows: the mean *positive* relevance per pixel inside the
# digit's mask divided by the mean per pixel outside it, over all 128 canvases. 1 means the
# map ignores the digit; the digit covers about a fifth of the canvas.


# %%
def inside_outside_ratio(maps: torch.Tensor, masks: torch.Tensor) -> float:
    """mean(relu(map) on mask pixels) / mean(relu(map) off mask), pooled over the batch."""
    positive = maps.clamp(min=0).double()
    inside = positive[masks].mean()
    outside = positive[~masks].mean()
    return (inside / outside.clamp(min=1e-300)).item()


def maps_in_batches(explain, inputs, target, batch_size=32):
    """One method's maps of a whole set, 32 canvases per call (bounded memory)."""
    return torch.cat([pixel_maps(explain(inputs[start:start + batch_size], target=target[start:start + batch_size]))
                      for start in range(0, len(inputs), batch_size)])


all_maps = {name: maps_in_batches(explain, inputs, predicted) for name, explain in explainers.items()}
MASK_RATIO = {name: inside_outside_ratio(maps, test.masks) for name, maps in all_maps.items()}
print(f"digit pixels: {test.masks.float().mean():.3f} of the canvas")
print("positive relevance per pixel, inside / outside the digit mask:")
for name, ratio in sorted(MASK_RATIO.items(), key=lambda item: -item[1]):
    print(f"  {name:22s} {ratio:6.2f}")

# %% [markdown]
# ## 4. One evaluation loop: pixel perturbation and segmentation
#
# The metrics of Chefer et al. (CVPR'21) as batch accumulators:
#
# * `PixelPerturbation(model, "positive")` removes (zeroes) the 0 %, 10 %, ..., 90 % most
#   relevant pixels and records top-1 accuracy; the area under that curve (AUC, x100) is
#   *lower* for a more faithful map. `"negative"` removes the least relevant first (higher is
#   better). It takes images in [0, 1] and applies `normalize` itself.
# * `SegmentationScores` thresholds each map at its mean and scores it against the masks
#   (pixel accuracy, mIoU, mAP).
#
# The catalog's maps above (`all_maps`) explain the predicted class; we feed them batch by
# batch, as one would over a data loader. Captum's methods go through the same loop.
#
# The digit covers about 12 % of a canvas, so removing the top 10 % of pixels already
# destroys most predictions for every method: the positive curves differ mainly in how close
# to zero they stay. The negative curves (removing the least relevant first) separate the
# methods more.

# %%
compared = ["rollout", "generic-attention", "transformer-relevance", "attn-lrp", "conservative-lrp",
            "integrated-gradients", "saliency"]
metrics = {name: (PixelPerturbation(model, "positive", normalize=normalize),
                  PixelPerturbation(model, "negative", normalize=normalize),
                  SegmentationScores()) for name in compared}
for batch in range(0, len(test), 32):
    rows = slice(batch, batch + 32)
    images, labels, masks = test.images[rows], test.labels[rows], test.masks[rows]
    for name in compared:
        maps = all_maps[name][rows]
        positive, negative, segmentation = metrics[name]
        positive.update(images, labels, maps)
        negative.update(images, labels, maps)
        segmentation.update(maps, masks)

results = {name: tuple(metric.compute() for metric in triple) for name, triple in metrics.items()}
PERTURBATION = {name: (positive.auc, negative.auc) for name, (positive, negative, _) in results.items()}
SEGMENTATION = {name: segmentation.miou for name, (_, _, segmentation) in results.items()}
print(f"{'method':22s} {'positive AUC':>13s} {'negative AUC':>13s} {'pixAcc':>7s} {'mIoU':>6s} {'mAP':>6s}")
for name, (positive, negative, segmentation) in results.items():
    print(f"{name:22s} {positive.auc:13.1f} {negative.auc:13.1f} {segmentation.pixel_accuracy:7.3f} "
          f"{segmentation.miou:6.3f} {segmentation.mean_ap:6.3f}")
# `CurvePlot` draws the curves (in a notebook it shows itself with a table of the areas);
# `curve_plots("results.json")` does the same from a benchmark's results file.
positive_plot = CurvePlot({name: positive for name, (positive, _, _) in results.items()},
                          title="Removing the most relevant pixels first (lower is better)")
curves_png = str(positive_plot.save(os.path.join(OUT, "digit_positive_perturbation.png")))
negative_plot = CurvePlot({name: negative for name, (_, negative, _) in results.items()},
                          title="Removing the least relevant pixels first (higher is better)")
negative_curves_png = str(negative_plot.save(os.path.join(OUT, "digit_negative_perturbation.png")))
print("saved", curves_png, "and", negative_curves_png)
positive_plot  # shown inline in a notebook

# %% [markdown]
# ## 5. Class specificity: two digits, two explanations
#
# On a two-digit canvas the model (trained multi-label) ranks both digits' classes highest.
# A class-specific method explains each class by its own digit; attention rollout reads
# only the attention, which does not depend on the class asked for, so its two maps are
# identical. `ClassSpecificity` measures the share of a map's positive relevance on the
# explained digit (out of both digits): 0.5 for a map that ignores the target.
#
# We explain both labels of each canvas in one call: the batch twice, with the first then
# the second label as target.

# %%
pairs = digit_canvases("test", variant="two", n=64, seed=0)
pair_inputs = normalize(pairs.images)
with torch.no_grad():
    top_two = model(pair_inputs).topk(2, dim=1).indices.sort(dim=1).values
both_found = (top_two == pairs.labels.sort(dim=1).values).all(dim=1)
print(f"both digits are the top-2 classes on {both_found.float().mean():.3f} of {len(pairs)} two-digit canvases")

doubled = torch.cat([pair_inputs, pair_inputs])
targets = torch.cat([pairs.labels[:, 0], pairs.labels[:, 1]])
contrasted = ["rollout", "generic-attention", "transformer-relevance", "attn-lrp", "conservative-lrp",
              "integrated-gradients"]
pair_maps = {name: maps_in_batches(explainers[name], doubled, targets).chunk(2) for name in contrasted}
SPECIFICITY = {}
MAP_CHANGE = {}  # relative L1 change between the maps of the two classes, per method
for name, (maps_first, maps_second) in pair_maps.items():
    metric = ClassSpecificity()
    metric.update(maps_first, maps_second, pairs.masks[:, 0], pairs.masks[:, 1])
    SPECIFICITY[name] = metric.compute().specificity
    MAP_CHANGE[name] = ((maps_first - maps_second).abs().sum() / maps_first.abs().sum().clamp(min=1e-12)).item()
print(f"{'method':22s} {'share on the explained digit':>29s} {'|map_a - map_b| / |map_a|':>27s}")
for name in contrasted:
    print(f"{name:22s} {SPECIFICITY[name]:29.3f} {MAP_CHANGE[name]:27.3f}")

# %% [markdown]
# The figure shows three canvases on which both digits are the model's top two classes.
# Each map pair explains the first, then the second label (green: both digits' masks).

# %%
drawn = [name for name in contrasted if name != "integrated-gradients"]
examples = both_found.nonzero().flatten()[:3]
pair_columns = {f"{name}, {which} label": pair_maps[name][index][examples]
                for name in drawn for index, which in enumerate(("1st", "2nd"))}
two_grid = ExplanationGrid(pairs.images[examples], pair_columns,
                           [f"digits {a} and {b}" for a, b in pairs.labels[examples].tolist()],
                           scale="per-map", percentile=98, outlines=pairs.masks[examples].any(dim=1),
                           title="Each label of two-digit canvases explained (green: both digits)")
two_png = str(two_grid.save(os.path.join(OUT, "digit_two_classes.png")))
print("saved", two_png)

FIGURES = [methods_png, methods_html, curves_png, negative_curves_png, two_png]
two_grid  # shown inline in a notebook

# %% [markdown]
# ## What to take away
#
# * On a trained model the attention-based maps (raw attention, rollout, GenericAttention,
#   TransformerRelevance) sit on the digit, not on the scrambled distractors; the LRP family
#   gives signed pixel maps whose negative evidence (blue) the attention maps cannot show.
# * Pixel perturbation and segmentation rank the methods differently: the signed LRP maps
#   remove the evidence fastest (low positive AUC), the attention maps segment the digit best.
# * The negative curves penalise signed maps: the protocol removes the *most negative* pixels
#   first, and the negative evidence of AttnLRP, ConservativeLRP and Integrated Gradients lies
#   on the digit's strokes too (the blue pixels in the first figure).
# * Only gradient-based maps are class-specific: asked about the other digit, GenericAttention
#   and TransformerRelevance move to it; rollout's two maps are identical.
# * `python -m captum_transformers benchmark --task digits` runs the same protocol on all
#   methods and all test canvases and writes JSON, CSV and plots.
