"""Run explanation methods over a benchmark task and feed the faithfulness metrics.

Tasks (``TASKS``):

* ``digits``: DigitCanvas test canvases, built-in ViT. Maps explain the predicted class (the
  "predicted" setting of Chefer et al., CVPR'21); positive and negative pixel perturbation
  AUC (``pixel_steps``: ``"fine"`` 1 % steps to 10 % then 10 % steps, or ``"cvpr21"`` the
  authors' 10 % steps; see ``evaluation.pixel_perturbation``), and segmentation pixAcc /
  mIoU / mAP against the digit masks.
* ``digits-two``: two-digit canvases; each method explains both classes and the class
  specificity is the share of positive relevance on the explained digit (0.5 for a
  class-agnostic map).
* ``motifs``: BA-2Motifs graphs (house vs 5-cycle, generated offline), built-in TransformerConv
  model; node AUROC against the motif, AUAC / AU-MSE over nodes, PyG fidelity of the top-5
  nodes, and the class-specific share on graphs holding both motifs (``tasks.motifs.evaluation``).
* ``digits-swin``, ``digits-two-swin``: the same two tasks on the DigitCanvas Swin
  (:mod:`.digits.swin`) instead of the ViT.
* ``motifs-graphormer``: the same graphs and metrics, the built-in Graphormer
  (``tasks.motifs.graphormer``), every package method; no PyG fidelity (it masks node
  features only, which this model's predictions do not depend on: ``motif_metrics``).
* ``recall``: the built-in recall Llama's answers; evidence-token hit rates, shares and cost
  with bootstrap intervals (:mod:`.recall.benchmark`, which runs it).
* ``movies``: Rotten Tomatoes snippets, fine-tuned MiniLM. Token relevance explains the true
  class (Ali et al.'s AUAC measures p(true class)); AUAC, AU-MSE, and token F1 of the top
  words against silver VADER-lexicon rationales.

``metrics="recent"`` (``--metrics recent``) evaluates SRG, RISE deletion / insertion,
comprehensiveness / sufficiency AOPC and completeness error instead, ``"all"`` both
(:mod:`.extended_metrics`; digits, digits-swin, movies and the motifs tasks); ``"road"`` the
recent metrics plus ROAD MoRF / LeRF (digits tasks; opt-in, hours on one CPU thread).

The evaluation set is cut into batches first and the batches are sharded over processes
(``torch.distributed`` under ``torchrun``), so every example is explained in the same batch
as in a single process; metric states are float64 sums reduced exactly, so the numbers are
identical to a single-process run (given the same number of threads per process).

Example::

    >>> report = run_benchmark("digits", methods=["rollout", "generic-attention"], limit=64)
    >>> print(report.table())
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import InputError
from ..evaluation import (ClassSpecificity, PixelPerturbation, RationaleF1, SegmentationScores, TokenActivation,
                          TokenPruning, all_reduce_metrics, shard_indices)
from ..evaluation.accumulator import Accumulator
from ..evaluation.images.pixel_perturbation import PIXEL_PROTOCOLS
from ..methods.catalog import METHOD_NAMES, PACKAGE_METHOD_NAMES, build_method, resolve_method_names
from .benchmark_runs import BenchmarkReport, progress_bar, rank_and_world_size
from .extended_metrics import (RecentGraphMetrics, RecentImageMetrics, RecentTokenMetrics, merged, metric_parts,
                               road_wanted)

TASKS = ("digits", "digits-two", "digits-swin", "digits-two-swin", "movies", "motifs", "motifs-graphormer", "recall")
# Tasks with pixel perturbation, and the two-digit tasks (both labels explained).
_PIXEL_TASKS = ("digits", "digits-swin")
_TWO_DIGIT_TASKS = ("digits-two", "digits-two-swin")


def _my_batches(n: int, batch_size: int, task: str, progress: bool) -> List[slice]:
    """This process's batches as slices: the dataset is cut into batches, the batches sharded
    over the processes (so each example sits in the same batch as in a single process)."""
    rank, world_size = rank_and_world_size()
    starts = range(0, n, batch_size)
    mine = [slice(starts[i], min(starts[i] + batch_size, n)) for i in shard_indices(len(starts), rank, world_size)]
    return progress_bar(mine, len(mine), task, progress)


def _image_scores(attribution) -> torch.Tensor:
    """(B, C, H, W) attributions (pixel relevance, or maps expanded over channels) -> (B, H, W)."""
    if isinstance(attribution, tuple):
        attribution = attribution[0]
    return attribution.detach().to(torch.float64).sum(1)


def _digit_classifier(swin: bool):
    """The built-in DigitCanvas ViT, or the DigitCanvas Swin."""
    if swin:
        from .digits.swin import load_digit_swin
        return load_digit_swin()
    from .digits.model import load_digit_model
    return load_digit_model()


def _run_digits(method_names, limit, batch_size, progress, device, explain, cache_dir, pixel_steps, swin=False,
                parts=(True, False), road=False):
    from .digits.canvas import digit_canvases, normalize

    classic, recent_set = parts  # (classic metrics, recent metrics): tasks.extended_metrics.metric_parts
    data = digit_canvases(split="test", variant="one", n=limit, seed=0)
    model = _digit_classifier(swin).to(device)
    forward = lambda images: model(images.to(device))  # noqa: E731 - the metrics' model callable
    metrics: Dict[str, List[Accumulator]] = {
        name: [PixelPerturbation(forward, "positive", fractions=pixel_steps, normalize=normalize),
               PixelPerturbation(forward, "negative", fractions=pixel_steps, normalize=normalize),
               SegmentationScores()] if classic else []
        for name in method_names}
    recent = RecentImageMetrics(forward, normalize, method_names, road=road) if recent_set else None
    explainers = {name: build_method(name, model) for name in method_names}
    for chunk in _my_batches(len(data), batch_size, "digits", progress):
        images, labels, masks = data.images[chunk], data.labels[chunk], data.masks[chunk]
        inputs = normalize(images).to(device)
        target = _explained_class(model, inputs, labels, explain)
        if recent:
            recent.begin_batch(inputs, target, chunk.start)
        for name, explainer in explainers.items():
            maps = _image_scores(explainer.attribute(inputs, target=target)).cpu()
            if classic:
                positive, negative, segmentation = metrics[name]
                positive.update(images, labels, maps)
                negative.update(images, labels, maps)
                segmentation.update(maps, masks)
            if recent:
                recent.update(name, images, maps, maps)  # the channel sum keeps the total relevance
    return merged(metrics, recent), len(data)


def _run_digits_two(method_names, limit, batch_size, progress, device, explain, cache_dir, pixel_steps, swin=False,
                    parts=(True, False)):
    from .digits.canvas import digit_canvases, normalize

    data = digit_canvases(split="test", variant="two", n=limit, seed=0)
    model = _digit_classifier(swin).to(device)
    metrics = {name: [ClassSpecificity()] for name in method_names}
    explainers = {name: build_method(name, model) for name in method_names}
    for chunk in _my_batches(len(data), batch_size, "digits-two", progress):
        inputs = normalize(data.images[chunk]).to(device)
        labels, masks = data.labels[chunk], data.masks[chunk]
        # Both digits in one call: the batch twice, explaining the first then the second label.
        doubled, targets = torch.cat([inputs, inputs]), torch.cat([labels[:, 0], labels[:, 1]]).to(device)
        for name, explainer in explainers.items():
            maps_a, maps_b = _image_scores(explainer.attribute(doubled, target=targets)).cpu().chunk(2)
            metrics[name][0].update(maps_a, maps_b, masks[:, 0], masks[:, 1])
    return metrics, len(data)


def _run_movies(method_names, limit, batch_size, progress, device, explain, cache_dir, pixel_steps,
                parts=(True, False)):
    from .movies.model import load_movie_model
    from .movies.snippets import encode, load_movie_snippets

    data = load_movie_snippets(split="test", limit=limit, cache_dir=cache_dir)
    model, tokenizer = load_movie_model(cache_dir)
    model = model.to(device)
    forward = lambda batch: model(**{k: v.to(device) for k, v in batch.items()}).logits  # noqa: E731
    unk = tokenizer.unk_token_id
    classic, recent_set = parts
    metrics: Dict[str, List[Accumulator]] = {
        name: [TokenActivation(forward, unk), TokenPruning(forward, unk), RationaleF1(k="gold")] if classic else []
        for name in method_names}
    recent = RecentTokenMetrics(forward, unk, model.config.pad_token_id, method_names) if recent_set else None
    explainers = {name: build_method(name, model) for name in method_names}
    for chunk in _my_batches(len(data), batch_size, "movies", progress):
        snippets = data[chunk]
        encoded = encode(snippets, tokenizer)
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
        labels = snippets.labels
        gold = _word_rationales(snippets.rationales)
        target = _explained_class(model, {"input_ids": ids, "attention_mask": mask}, labels, explain)
        if recent:
            recent.begin_batch(ids, mask, target)
        for name, explainer in explainers.items():
            scores = explainer.attribute(ids, target=target, forward_kwargs={"attention_mask": mask},
                                         return_tokens=True).detach().to(torch.float64).cpu()
            if classic:
                activation, pruning, rationale = metrics[name]
                activation.update(encoded["input_ids"], encoded["attention_mask"], scores, labels,
                                  encoded["special_tokens_mask"])
                pruning.update(encoded["input_ids"], encoded["attention_mask"], scores, labels,
                               encoded["special_tokens_mask"])
                rationale.update(scores, encoded["word_ids"], gold)
            if recent:
                recent.update(name, encoded, scores)
    return merged(metrics, recent), len(data)


def _run_motifs(method_names, limit, batch_size, progress, device, explain, cache_dir, pixel_steps,
                parts=(True, False), graphormer: bool = False):
    from .motifs.graphs import motif_graphs
    from .motifs.evaluation import motif_metrics, pyg_arguments, update_motif_metrics
    from .motifs.train import TEST_GRAPHS, TEST_SEED

    n = limit or TEST_GRAPHS
    data, pairs = motif_graphs(n, seed=TEST_SEED), motif_graphs(n, seed=TEST_SEED + 1, two_motifs=True)
    if graphormer:
        from .motifs.graphormer import graphormer_arguments, graphormer_forward, load_motif_graphormer

        explained = load_motif_graphormer().to(device)
        model, arguments = graphormer_forward(explained), graphormer_arguments  # metrics: the flat-batch form
    else:
        from .motifs.model import load_motif_model

        explained = model = load_motif_model().to(device)
        arguments = pyg_arguments
    classic, recent_set = parts
    metrics = motif_metrics(model, method_names, fidelity=not graphormer) if classic else {}  # see motif_metrics
    recent = RecentGraphMetrics(model, method_names) if recent_set else None
    explainers = {name: build_method(name, explained) for name in method_names}
    task = "motifs-graphormer" if graphormer else "motifs"
    for chunk in _my_batches(n, batch_size, task, progress):
        if classic:
            update_motif_metrics(model, explainers, metrics, data.graphs(chunk.start, chunk.stop),
                                 pairs.graphs(chunk.start, chunk.stop), explain, device, arguments)
        if recent:
            recent.update_batch(explainers, data.graphs(chunk.start, chunk.stop), explain, device, arguments)
    return merged(metrics, recent), n


def _run_motifs_graphormer(*args, **kwargs):
    return _run_motifs(*args, **kwargs, graphormer=True)


def _word_rationales(rationales: Sequence[Sequence[bool]]) -> torch.Tensor:
    """Per-word silver rationales as a (B, W) bool tensor, padded with False."""
    width = max((len(words) for words in rationales), default=0)
    gold = torch.zeros(len(rationales), max(width, 1), dtype=torch.bool)
    for row, words in enumerate(rationales):
        gold[row, :len(words)] = torch.tensor(list(words), dtype=torch.bool)
    return gold


def _explained_class(model, inputs, labels: torch.Tensor, explain: str) -> torch.Tensor:
    if explain == "label":
        return labels.to(_device_of(inputs))
    with torch.no_grad():
        output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = getattr(output, "logits", output)
    return logits.argmax(-1)


def _device_of(inputs) -> torch.device:
    tensor = next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
    return tensor.device


_RUNNERS: Dict[str, Tuple[Callable, str]] = {
    "digits": (_run_digits, "predicted"),
    "digits-two": (_run_digits_two, "both labels"),
    "digits-swin": (functools.partial(_run_digits, swin=True), "predicted"),
    "digits-two-swin": (functools.partial(_run_digits_two, swin=True), "both labels"),
    "movies": (_run_movies, "label"),
    "motifs": (_run_motifs, "label"),
    "motifs-graphormer": (_run_motifs_graphormer, "label"),
}
# The methods a task runs by default where not every catalog method applies (PyG graph models:
# TransformerRelevance's normalised adds and Captum's baselines do not, see adapters/pyg_attention.py).
_DEFAULT_METHODS = {"motifs": ("raw-attention", "rollout", "grad-cam", "generic-attention", "gradient-x-input",
                               "conservative-lrp-ah", "conservative-lrp", "attn-lrp", "partial-lrp", "lrp"),
                    # Every package method the catalog runs by default (Chefer et al.'s rule sets apply).
                    "motifs-graphormer": tuple(name for name in PACKAGE_METHOD_NAMES if name in METHOD_NAMES)}


def run_benchmark(task: str, methods: Optional[Sequence[str]] = None, limit: Optional[int] = None,
                  batch_size: int = 32, progress: bool = False, device: str = "cpu",
                  explain: Optional[str] = None, cache_dir: Optional[str] = None,
                  pixel_steps: str = "fine", metrics: str = "classic") -> BenchmarkReport:
    """Evaluate ``methods`` (catalog names; default all) on ``task`` and return every metric result.

    ``limit`` takes the first N examples of the test split; ``explain`` is ``"predicted"`` or
    ``"label"`` (default per task, see the module docstring; ignored by ``digits-two``, which
    explains both labels). ``cache_dir`` holds the movie data and fine-tuned model (default
    ``$CAPTUM_TRANSFORMERS_CACHE`` or ``~/.cache/captum_transformers``). ``pixel_steps`` names
    the digits task's pixel perturbation protocol (``"fine"`` or ``"cvpr21"``; other tasks refuse
    ``"cvpr21"``). ``metrics`` picks the metric set: ``"classic"`` (the task's original metrics),
    ``"recent"`` (SRG, RISE, AOPC, completeness: :mod:`.extended_metrics`), ``"all"`` (both) or
    ``"road"`` (``"recent"`` plus ROAD; digits tasks; slow: opt-in). Under
    ``torch.distributed`` each process evaluates its shard of
    batches and the results are reduced; every process returns the full report.
    """
    parts = metric_parts(metrics, task)
    if task == "recall":  # per-prompt bootstrap intervals, not accumulators: its own runner
        from .recall.benchmark import run_recall_benchmark

        if pixel_steps != "fine":
            raise InputError(f"pixel_steps={pixel_steps!r} applies to the digits task only; drop the option.")
        return run_recall_benchmark(methods, limit, batch_size, progress, device, explain)
    if task not in _RUNNERS:
        raise InputError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}.")
    if limit is not None and limit < 1:
        raise InputError(f"--limit {limit}: expected a positive number of examples.")
    if batch_size < 1:
        raise InputError(f"batch size {batch_size}: expected a positive integer.")
    runner, default_explain = _RUNNERS[task]
    explain = explain or default_explain
    if task not in _TWO_DIGIT_TASKS and explain not in ("predicted", "label"):
        raise InputError(f"explain={explain!r}: expected 'predicted' or 'label'.")
    if pixel_steps not in PIXEL_PROTOCOLS:
        raise InputError(f"pixel_steps={pixel_steps!r}: expected one of {', '.join(PIXEL_PROTOCOLS)}.")
    if task not in _PIXEL_TASKS and pixel_steps != "fine":
        raise InputError(f"pixel_steps={pixel_steps!r} applies to the digits task only (pixel perturbation); "
                         f"task {task!r} has no pixel perturbation. Drop the option.")
    names = resolve_method_names(methods if methods is not None else _DEFAULT_METHODS.get(task))
    start = time.perf_counter()
    accumulators, examples = runner(names, limit, batch_size, progress, torch.device(device), explain, cache_dir,
                                    pixel_steps, parts=parts, **({"road": True} if road_wanted(metrics) else {}))
    all_reduce_metrics([metric for name in names for metric in accumulators[name]])
    rows = tuple((name, metric.compute()) for name in names for metric in accumulators[name])
    _, world_size = rank_and_world_size()
    return BenchmarkReport(task, tuple(names), rows, examples, world_size, time.perf_counter() - start,
                           explain if task not in _TWO_DIGIT_TASKS else default_explain,
                           pixel_steps if task in _PIXEL_TASKS else None, metrics)


__all__ = ["TASKS", "BenchmarkReport", "run_benchmark"]
