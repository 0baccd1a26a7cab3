"""``explain --save-scores``: the raw scores of every method as JSON (``scores.json``).

Schema (``"schema": "captum_transformers.explain.scores/1"``)::

    {
      "schema": "captum_transformers.explain.scores/1",
      "model": "<--model, or the built-in model's name>",
      "modality": "image" | "text",
      "target": "predicted" | <the --target class>,
      "examples": [{"index": 0, "title": "pred 7 (0.98), true 7", "predicted": 7, "predicted_name": "7",
                    "probability": 0.98, "explained_class": 7, "true": 7 | null,
                    "tokens": ["[CLS]", ...], "special": [true, ...]}],       # text only
      "methods": {"attn-lrp": {"shape": [B, C, H, W], "scores": [...]}}
    }

Scores are the method's output as returned, not rescaled, signs kept: images give the
(B, C, H, W) attribution as nested lists; text gives, per example, one score per real token
(padding removed, special tokens kept and flagged in ``special``), ``shape`` being
``[B, null]`` (rows of different lengths).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import torch

SCHEMA = "captum_transformers.explain.scores/1"


def write_scores(path: Path, *, model: str, modality: str, target: Optional[int], examples: List[dict],
                 scores: Dict[str, object]) -> Path:
    """Write the file; ``scores[method]`` is a (B, ...) tensor (images) or a list of 1-D tensors (text)."""
    methods = {}
    for name, values in scores.items():
        if isinstance(values, torch.Tensor):
            methods[name] = {"shape": list(values.shape), "scores": values.tolist()}
        else:
            methods[name] = {"shape": [len(values), None], "scores": [row.tolist() for row in values]}
    payload = {"schema": SCHEMA, "model": model, "modality": modality,
               "target": "predicted" if target is None else target, "examples": examples, "methods": methods}
    path.write_text(json.dumps(payload), encoding="utf-8")
    return path
