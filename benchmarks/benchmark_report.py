"""What the benchmark compares and how it prints it: method names, reference passes,
targets, and the table (one row per measurement, ratios against the reference pass)."""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

METHOD_NAMES = ("RawAttention", "AttentionRollout", "AttentionGradCAM", "GenericAttention", "ConservativeLRP",
                "TransformerRelevance")
GRADIENT_METHODS = ("AttentionGradCAM", "GenericAttention", "ConservativeLRP", "TransformerRelevance")
# Reference passes: name -> label in the table.
REFERENCES = {
    "forward": "forward (no_grad)",
    "forward_eager": "forward (no_grad, eager attn)",
    "train_step": "fwd+bwd (params)",
    "fwd_bwd_inputs": "fwd+bwd (input embeds)",
}
TIME_TARGETS = {"AttentionRollout": ("forward", 1.10), "GenericAttention": ("train_step", 1.15),
                "ConservativeLRP": ("train_step", 1.15), "TransformerRelevance": ("train_step", 2.2)}
MEMORY_TARGET = 1.30


@dataclasses.dataclass
class Row:
    model: str
    name: str
    wall_ms: float
    cpu_ms: Optional[float]
    reference: Optional[str] = None
    ratio: Optional[float] = None
    cpu_ratio: Optional[float] = None
    time_target: Optional[float] = None
    peak_mib: Optional[float] = None
    peak_exact: bool = True
    memory_ratio: Optional[float] = None
    memory_target: Optional[float] = None


def reference_of(name: str) -> Optional[str]:
    if name in GRADIENT_METHODS:
        return "train_step"
    if name in METHOD_NAMES:
        return "forward"
    return None


def summarize(model_name: str, times: Dict[str, Dict[str, List[float]]],
              peaks: Dict[str, Tuple[int, bool]], device: str) -> List[Row]:
    rows = []
    med = {name: statistics.median(t["wall"]) for name, t in times.items()}
    cpu = {name: statistics.median(t["cpu"]) for name, t in times.items()} if device == "cpu" else {}
    train_peak = peaks.get("train_step", (None, True))[0]
    for name in times:
        row = Row(model_name, name, med[name] * 1e3, cpu[name] * 1e3 if cpu else None)
        ref = reference_of(name)
        if ref is not None and ref in med:
            row.reference = ref
            row.ratio = med[name] / med[ref]
            if cpu and cpu[ref] > 0:
                row.cpu_ratio = cpu[name] / cpu[ref]
            target = TIME_TARGETS.get(name)
            row.time_target = target[1] if target and target[0] == ref else None
        if name in peaks:
            row.peak_mib = peaks[name][0] / 2 ** 20
            row.peak_exact = peaks[name][1]
            if name in METHOD_NAMES and train_peak:
                row.memory_ratio = peaks[name][0] / train_peak
                row.memory_target = MEMORY_TARGET
        rows.append(row)
    return rows


def _verdict(value: Optional[float], target: Optional[float]) -> str:
    if value is None or target is None:
        return ""
    return f"<= {target:.2f} {'ok' if value <= target else 'MISS'}"


def format_table(rows: Sequence[Row]) -> str:
    header = ["model", "measurement", "wall ms", "cpu ms", "vs", "x wall", "x cpu", "time target",
              "peak MiB", "x train peak", "mem target"]
    lines = []
    for row in rows:
        label = REFERENCES.get(row.name, row.name)
        lines.append([
            row.model, label, f"{row.wall_ms:.1f}", "" if row.cpu_ms is None else f"{row.cpu_ms:.1f}",
            {"forward": "forward", "train_step": "fwd+bwd"}.get(row.reference or "", ""),
            "" if row.ratio is None else f"{row.ratio:.2f}",
            "" if row.cpu_ratio is None else f"{row.cpu_ratio:.2f}",
            _verdict(row.ratio, row.time_target),
            "" if row.peak_mib is None else ("" if row.peak_exact else "~") + f"{row.peak_mib:.1f}",
            "" if row.memory_ratio is None else f"{row.memory_ratio:.2f}",
            _verdict(row.memory_ratio, row.memory_target),
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
           "  ".join("-" * w for w in widths)]
    previous = None
    for line in lines:
        if previous is not None and line[0] != previous:
            out.append("")
        previous = line[0]
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    return "\n".join(out)
