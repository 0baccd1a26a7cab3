"""A benchmark run as a Markdown table, JSON and CSV files, and curve plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

from ..evaluation import write_csv, write_json
from ..evaluation.results import CurveResult
from ..visualization.curves import plot_curves
from .extended_metrics import recent_columns
from .recall.benchmark import recall_columns
from .benchmark_runs import BenchmarkReport

# Columns per task: (header, metric name, field, format). Arrows say which way is better.
_COLUMNS: Dict[str, List[Tuple[str, str, str, str]]] = {
    "digits": [("positive AUC (lower better)", "perturbation_positive", "auc", "{:.1f}"),
               ("negative AUC (higher better)", "perturbation_negative", "auc", "{:.1f}"),
               ("pixel accuracy", "segmentation", "pixel_accuracy", "{:.3f}"),
               ("mIoU", "segmentation", "miou", "{:.3f}"),
               ("mAP", "segmentation", "mean_ap", "{:.3f}")],
    "digits-two": [("class-specific share (0.5 = agnostic)", "class_specificity", "specificity", "{:.3f}")],
    "digits-swin": None,  # the same columns as their ViT tasks (below)
    "digits-two-swin": None,
    "movies": [("AUAC (higher better)", "auac", "auc", "{:.3f}"),
               ("AU-MSE (lower better)", "au_mse", "auc", "{:.3f}"),
               ("token F1, silver rationales (macro)", "rationale_f1_topgold", "macro_f1", "{:.3f}")],
    "motifs": [("node AUROC vs motif", "node_auroc", "value", "{:.3f}"),
               ("AUAC (higher better)", "auac", "auc", "{:.3f}"),
               ("AU-MSE (lower better)", "au_mse", "auc", "{:.3f}"),
               ("fid+ top-5 (higher better)", "fidelity_plus", "value", "{:.3f}"),
               ("fid- top-5 (lower better)", "fidelity_minus", "value", "{:.3f}"),
               ("class-specific share, two motifs (0.5 = agnostic)", "class_specificity", "specificity", "{:.3f}")],
}
_COLUMNS["digits-swin"], _COLUMNS["digits-two-swin"] = _COLUMNS["digits"], _COLUMNS["digits-two"]
# The same graphs and metrics with the built-in Graphormer, without PyG's fidelity (tasks.motifs.evaluation).
_COLUMNS["motifs-graphormer"] = [column for column in _COLUMNS["motifs"] if not column[1].startswith("fidelity")]
_COLUMNS["recall"] = recall_columns()  # means with bootstrap 95 % intervals (tasks.recall.benchmark)


def table(report: BenchmarkReport) -> str:
    """The run as a Markdown table: one row per method, the task's metrics as columns."""
    columns = ((_COLUMNS[report.task] if report.metrics in ("classic", "all") else [])
               + recent_columns(report.task, report.metrics))
    by_key = {(method, result.name): result for method, result in report.rows}
    lines = ["| method | " + " | ".join(header for header, *_ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for method in report.methods:
        cells = []
        for _, metric, field, form in columns:
            result = by_key.get((method, metric))
            cells.append(form.format(getattr(result, field)) if result is not None else "-")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(report: BenchmarkReport) -> str:
    steps = f", pixel steps: {report.pixel_steps}" if report.pixel_steps else ""
    steps += f", metrics: {report.metrics}" if report.metrics != "classic" else ""
    return (f"task {report.task}: {report.examples} test examples, {len(report.methods)} methods, explained class: "
            f"{report.explained}{steps}, {report.world_size} process(es), {report.seconds:.1f} s")


def write_report(report: BenchmarkReport, out_dir) -> List[Path]:
    """Write ``results.json`` (every result, curves included), ``results.csv``, ``summary.md``,
    ``run.json`` (how the run was made) and one PNG per curve metric; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.csv", out / "summary.md", out / "run.json"]
    write_json(report.rows, paths[0])
    write_csv(report.rows, paths[1])
    paths[2].write_text(f"{summary(report)}\n\n{table(report)}\n")
    paths[3].write_text(json.dumps({"task": report.task, "methods": list(report.methods), "examples": report.examples,
                                    "world_size": report.world_size, "seconds": report.seconds,
                                    "explained": report.explained, "pixel_steps": report.pixel_steps,
                                    "metrics": report.metrics}, indent=2))
    curves: Dict[str, Dict[str, CurveResult]] = {}
    for method, result in report.rows:
        if isinstance(result, CurveResult):
            curves.setdefault(result.name, {})[method] = result
    for metric, by_method in curves.items():
        path = out / f"{metric}.png"
        plot_curves(by_method, path, title=f"{report.task}: {metric}")
        paths.append(path)
    return paths
