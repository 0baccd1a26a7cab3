"""The benchmark's recent faithfulness metrics per method: SRG, RISE, AOPC and completeness error.

``run_benchmark(..., metrics=...)`` picks the metric set (``METRIC_SETS``): ``"classic"`` (the
papers' protocols of each task, the default), ``"recent"`` (the metrics below only, ROAD left
out), ``"all"`` (classic and recent, ROAD left out) or ``"road"`` (recent and ROAD; digits tasks
only). ROAD is opt-in because its imputation solves a sparse system per perturbed copy: on one
CPU thread it turns the digits runs' minutes into hours. Per task:

* ``digits``, ``digits-swin``: :class:`ImageRelevanceGain` (MIF / LIF over the model's 4 x 4
  patches, mean occlusion, 21 steps; SRG = A(LIF) - A(MIF), Blücher et al., TMLR 2024),
  :class:`RiseDeletion` (zero baseline) and :class:`RiseInsertion` (blurred canvas), 51 steps
  (Petsiuk et al., BMVC 2018), all on the softmax probability of the explained class; under
  ``"road"`` also :class:`ROAD` MoRF and LeRF (Rong et al., ICML 2022; noisy linear imputation, 1, 3, ..., 99 % of pixels, top-1
  agreement with the explained class; the noise generator is seeded with each batch's first
  example index, so every method sees the same draws and torchrun gives the same numbers);
* ``movies``: :class:`TokenRelevanceGain` ([UNK] replaces removed tokens, as the classic AUAC),
  ERASER comprehensiveness and sufficiency as AOPC over 1/5/10/20/50 % (tokens dropped from the
  sequence; DeYoung et al., ACL 2020);
* ``motifs``, ``motifs-graphormer``: :class:`GraphRelevanceGain` (removed nodes lose their
  features and edges, as the classic node AUAC);
* images and tokens: :class:`CompletenessError` ``|sum R - s| / |s|`` (LibraGrad, Eq. 1) for the
  methods whose relevance distributes a known score (``COMPLETENESS_SCORES``): the explained
  logit for the logit-seeded rule sets (AttnLRP, Gradient x Input, AH, AH+LN), and
  ``logit(x) - logit(baseline)`` for Integrated Gradients (its baseline: zeros of the model
  input for images, [PAD] ids at every position for tokens). TransformerLRP is seeded with 1,
  and the attention maps and Saliency distribute no score, so they have no completeness row.

Every curve tracks the class the maps explain (``target``), not the true label.

Example::

    >>> report = run_benchmark("digits", methods=["attn-lrp"], limit=8, metrics="recent")
    >>> report.result("attn-lrp", "srg_image").srg
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import InputError
from ..evaluation.accumulator import Accumulator
from ..evaluation.tokens.aopc import Comprehensiveness, Sufficiency
from ..evaluation.completeness import CompletenessError
from ..evaluation.images.deletion_insertion import RiseDeletion, RiseInsertion
from ..evaluation.graphs.relevance_gain import GraphRelevanceGain
from ..evaluation.images.relevance_gain import ImageRelevanceGain
from ..evaluation.tokens.relevance_gain import TokenRelevanceGain
from ..evaluation.images.road import ROAD

METRIC_SETS: Tuple[str, ...] = ("classic", "recent", "all", "road")
"""``classic``: each task's original metrics; ``recent``: this module's without ROAD; ``all``: both
without ROAD; ``road``: ``recent`` plus ROAD MoRF / LeRF (digits tasks)."""

ROAD_TASKS: Tuple[str, ...] = ("digits", "digits-swin")
"""The tasks ROAD runs on (``metrics="road"``): it imputes pixels."""

RECENT_TASKS: Tuple[str, ...] = ("digits", "digits-swin", "movies", "motifs", "motifs-graphormer")
"""The tasks with recent metrics (the two-digit tasks and recall have none)."""

COMPLETENESS_SCORES: Dict[str, str] = {
    "attn-lrp": "logit", "gradient-x-input": "logit", "conservative-lrp-ah": "logit", "conservative-lrp": "logit",
    "integrated-gradients": "logit - baseline logit",
}
"""Methods with a completeness row, and the score their relevance should sum to."""

DIGIT_PATCH = 4  # the ViT's and the Swin's patch size: SRG ranks the 8 x 8 grid the models read
MAX_ROWS = 512  # perturbed copies per forward call (memory bound; the numbers do not depend on it)


# Report columns of the recent metrics per task: (header, metric name, field, format), as tasks.report's.
_IMAGE_COLUMNS = [("SRG, 4x4 patches, mean occlusion (higher better)", "srg_image", "srg", "{:.3f}"),
                  ("MIF area (lower better)", "srg_image", "area_mif", "{:.3f}"),
                  ("LIF area (higher better)", "srg_image", "area_lif", "{:.3f}"),
                  ("RISE deletion AUC (lower better)", "deletion", "auc", "{:.3f}"),
                  ("RISE insertion AUC (higher better)", "insertion", "auc", "{:.3f}")]
ROAD_COLUMNS = [("ROAD MoRF AUC (lower better)", "road_morf", "auc", "{:.3f}"),
                ("ROAD LeRF AUC (higher better)", "road_lerf", "auc", "{:.3f}")]
"""The report's ROAD columns (``metrics="road"`` only), after the image columns."""
_COMPLETENESS_COLUMNS = [("completeness error, mean (lower better)", "completeness_error", "mean_error", "{:.3f}"),
                         ("completeness error, max", "completeness_error", "max_error", "{:.3g}")]
_GRAPH_COLUMNS = [("SRG, nodes dropped (higher better)", "srg_graphs", "srg", "{:.3f}"),
                  ("MIF area (lower better)", "srg_graphs", "area_mif", "{:.3f}"),
                  ("LIF area (higher better)", "srg_graphs", "area_lif", "{:.3f}")]
RECENT_COLUMNS: Dict[str, List[Tuple[str, str, str, str]]] = {
    "digits": _IMAGE_COLUMNS + _COMPLETENESS_COLUMNS,
    "digits-swin": _IMAGE_COLUMNS + _COMPLETENESS_COLUMNS,
    "movies": [("SRG, [UNK] replaces (higher better)", "srg_tokens", "srg", "{:.3f}"),
               ("MIF area (lower better)", "srg_tokens", "area_mif", "{:.3f}"),
               ("LIF area (higher better)", "srg_tokens", "area_lif", "{:.3f}"),
               ("comprehensiveness AOPC (higher better)", "comprehensiveness", "aopc", "{:.3f}"),
               ("sufficiency AOPC (lower better)", "sufficiency", "aopc", "{:.3f}"), *_COMPLETENESS_COLUMNS],
    "motifs": _GRAPH_COLUMNS,
    "motifs-graphormer": _GRAPH_COLUMNS,
}
"""The report's columns of the recent metrics (``"-"`` where a method has no such row, e.g. completeness)."""


def recent_columns(task: str, metric_set: str) -> List[Tuple[str, str, str, str]]:
    """The report's recent columns of a run: ``RECENT_COLUMNS`` plus, under ``"road"``, ROAD's."""
    if metric_set == "classic":
        return []
    columns = RECENT_COLUMNS[task]
    if metric_set == "road":  # ROAD after the image columns, before completeness
        columns = _IMAGE_COLUMNS + ROAD_COLUMNS + columns[len(_IMAGE_COLUMNS):]
    return columns


def metric_parts(metric_set: str, task: str) -> Tuple[bool, bool]:
    """(classic, recent): which metric families a run of ``task`` evaluates (ROAD: ``road_wanted``)."""
    if metric_set not in METRIC_SETS:
        raise InputError(f"metrics={metric_set!r}: expected one of {', '.join(METRIC_SETS)}.")
    if metric_set != "classic" and task not in RECENT_TASKS:
        raise InputError(f"metrics={metric_set!r}: task {task!r} has no recent metrics (they exist for "
                         f"{', '.join(RECENT_TASKS)}); drop the option.")
    if metric_set == "road" and task not in ROAD_TASKS:
        raise InputError(f"metrics='road': task {task!r} has no ROAD (it imputes pixels: "
                         f"{', '.join(ROAD_TASKS)}); use metrics='recent'.")
    return metric_set in ("classic", "all"), metric_set != "classic"


def road_wanted(metric_set: str) -> bool:
    """Whether a run adds ROAD MoRF / LeRF (opt-in: ``metrics="road"``)."""
    return metric_set == "road"


def merged(classic: Dict[str, List[Accumulator]], recent: Optional["RecentMetrics"]) -> Dict[str, List[Accumulator]]:
    """Every method's accumulators: the classic ones first, then the recent ones."""
    if recent is None:
        return classic
    return {name: classic.get(name, []) + recent.by_method[name] for name in recent.by_method}


class RecentMetrics:
    """One task's recent accumulators per method, fed a batch at a time.

    ``begin_batch`` takes what every method of the batch shares (explained class, completeness
    scores); ``update(method, ...)`` feeds one method's relevance.
    """

    def __init__(self, by_method: Dict[str, List[Accumulator]]) -> None:
        self.by_method = by_method
        self._target: Optional[torch.Tensor] = None
        self._scores: Dict[str, torch.Tensor] = {}

    @staticmethod
    def _completeness(name: str) -> List[Accumulator]:
        return [CompletenessError()] if name in COMPLETENESS_SCORES else []

    def _needs_scores(self) -> bool:
        return any(name in COMPLETENESS_SCORES for name in self.by_method)

    def _record_scores(self, logits: torch.Tensor, baseline_logits: Optional[torch.Tensor],
                       target: torch.Tensor) -> None:
        index = target.to(logits.device)[:, None]
        logit = logits.detach().to(torch.float64).gather(1, index).squeeze(1).cpu()
        self._scores = {"logit": logit}
        if baseline_logits is not None:
            baseline = baseline_logits.detach().to(torch.float64).gather(1, index).squeeze(1).cpu()
            self._scores["logit - baseline logit"] = logit - baseline

    def _update_completeness(self, name: str, relevance: torch.Tensor, metrics: Sequence[Accumulator]) -> None:
        for completeness in metrics:
            completeness.update(relevance, self._scores[COMPLETENESS_SCORES[name]])


class RecentImageMetrics(RecentMetrics):
    """SRG over patches, RISE deletion and insertion, ROAD MoRF and LeRF if ``road``, completeness error
    (digits tasks)."""

    def __init__(self, forward: Callable, normalize: Callable, method_names: Sequence[str],
                 road: bool = False) -> None:
        self.forward = forward  # forward(normalised images) -> logits
        self._curves = 5 if road else 3  # accumulators fed the maps; completeness follows them
        super().__init__({name: [
            ImageRelevanceGain(forward, patch_size=DIGIT_PATCH, normalize=normalize, max_batch_size=MAX_ROWS),
            RiseDeletion(forward, normalize=normalize, max_batch_size=MAX_ROWS),
            RiseInsertion(forward, normalize=normalize, max_batch_size=MAX_ROWS),
            *([ROAD(forward, "morf", normalize=normalize, max_batch_size=MAX_ROWS),
               ROAD(forward, "lerf", normalize=normalize, max_batch_size=MAX_ROWS)] if road else []),
            *self._completeness(name)] for name in method_names})

    def begin_batch(self, inputs: torch.Tensor, target: torch.Tensor, first_example: int) -> None:
        """``inputs``: the normalised batch the methods explain; ``target``: the explained classes;
        ``first_example``: the batch's index in the evaluation set (ROAD's noise seed)."""
        self._target = target.cpu()
        for metrics in self.by_method.values():
            for road in metrics[3:self._curves]:
                road.generator = torch.Generator().manual_seed(first_example)
        if self._needs_scores():
            with torch.no_grad():
                logits = self.forward(inputs)
                # Integrated Gradients' baseline for float inputs: zeros of the model input.
                baseline = self.forward(torch.zeros_like(inputs)) if "integrated-gradients" in self.by_method else None
            self._record_scores(logits, baseline, target)

    def update(self, name: str, images: torch.Tensor, maps: torch.Tensor, relevance: torch.Tensor) -> None:
        """``images`` in [0, 1], ``maps`` (B, H, W), ``relevance`` the full attribution (summed for completeness)."""
        metrics = self.by_method[name]
        for metric in metrics[:self._curves]:
            metric.update(images, self._target, maps)
        self._update_completeness(name, relevance, metrics[self._curves:])


class RecentTokenMetrics(RecentMetrics):
    """SRG over tokens, comprehensiveness and sufficiency AOPC, completeness error (movies)."""

    def __init__(self, forward: Callable, replacement_id: int, pad_id: int, method_names: Sequence[str]) -> None:
        self.forward, self.pad_id = forward, pad_id  # forward({"input_ids", "attention_mask"}) -> logits
        super().__init__({name: [
            TokenRelevanceGain(forward, replacement_id=replacement_id, max_batch_size=MAX_ROWS),
            Comprehensiveness(forward, max_batch_size=MAX_ROWS), Sufficiency(forward, max_batch_size=MAX_ROWS),
            *self._completeness(name)] for name in method_names})

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, target: torch.Tensor) -> None:
        self._target = target.cpu()
        if self._needs_scores():
            with torch.no_grad():
                logits = self.forward({"input_ids": input_ids, "attention_mask": attention_mask})
                # Integrated Gradients' baseline for token ids: the [PAD] embedding at every position.
                pads = torch.full_like(input_ids, self.pad_id)
                baseline = (self.forward({"input_ids": pads, "attention_mask": attention_mask})
                            if "integrated-gradients" in self.by_method else None)
            self._record_scores(logits, baseline, target)

    def update(self, name: str, encoded: Dict[str, torch.Tensor], scores: torch.Tensor) -> None:
        """``encoded``: the tokenizer's batch (ids, mask, special tokens); ``scores`` (B, S) token relevance."""
        gain, comprehensiveness, sufficiency, *completeness = self.by_method[name]
        arguments = (encoded["input_ids"], encoded["attention_mask"], scores, self._target,
                     encoded["special_tokens_mask"])
        for metric in (gain, comprehensiveness, sufficiency):
            metric.update(*arguments)
        self._update_completeness(name, scores, completeness)


class RecentGraphMetrics(RecentMetrics):
    """SRG over nodes (motifs tasks); removed nodes lose their features and edges."""

    def __init__(self, model: Callable, method_names: Sequence[str]) -> None:
        self.model = model
        forward = lambda x, edge_index, batch: model(x, edge_index, batch)  # noqa: E731
        super().__init__({name: [GraphRelevanceGain(forward)] for name in method_names})

    def update_batch(self, explainers, data, explain: str, device, arguments) -> None:
        """Explain one batch of single-motif graphs with every method and feed SRG (the classic
        metrics explain the same graphs in ``update_motif_metrics``; explanations are deterministic)."""
        from .motifs.evaluation import node_scores

        if explain == "label":
            target = data.labels
        else:
            with torch.no_grad():
                logits = self.model(data.x.to(device), data.edge_index.to(device), data.batch.to(device))
            target = logits.argmax(-1).cpu()
        for name, explainer in explainers.items():
            scores = node_scores(explainer, data, target.to(device), device, arguments)
            self.by_method[name][0].update(data.x, data.edge_index, data.batch, scores, target)

__all__ = ["METRIC_SETS", "RECENT_TASKS", "ROAD_TASKS", "COMPLETENESS_SCORES", "RECENT_COLUMNS", "ROAD_COLUMNS",
           "RecentImageMetrics", "RecentTokenMetrics", "RecentGraphMetrics", "metric_parts", "road_wanted",
           "recent_columns", "merged"]
