"""The picture of ``captum-transformers explain`` marks baselines as baselines, in itself."""
from __future__ import annotations

import re

import pytest
import torch

from captum_transformers.cli import figures, main
from captum_transformers.methods.catalog import METHOD_NAMES

pytest.importorskip("matplotlib")


def test_baselines_come_last_and_are_titled_as_baselines(tmp_path):
    maps = {name: torch.rand(1, 8, 8) for name in ("lrp", "attn-lrp", "saliency", "generic-attention", "grad-cam")}
    ordered = list(figures.recommended_first(maps))
    assert ordered == ["attn-lrp", "generic-attention", "lrp (baseline)", "saliency (Captum baseline)",
                       "grad-cam (baseline)"]
    png, page = figures.image_grid(torch.full((1, 3, 8, 8), 0.5), maps, ["example"], tmp_path)
    headers = re.findall(r"<th>(.*?)</th>", page.read_text(encoding="utf-8"))
    assert headers == ["input"] + ordered
    # Every catalog method is either one of the papers' methods or a named baseline.
    recommended = [name for name in METHOD_NAMES if figures.column_title(name) == name]
    assert set(recommended) == {"rollout", "attn-lrp", "conservative-lrp", "generic-attention",
                                "transformer-relevance"}


def test_the_default_explain_picture_titles_transformer_lrp_as_a_baseline(tmp_path, monkeypatch):
    pytest.importorskip("timm")
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    page = (tmp_path / "captum_transformers_explain" / "explanations.html").read_text(encoding="utf-8")
    headers = re.findall(r"<th>(.*?)</th>", page)
    assert "lrp (baseline)" in headers and "lrp" not in headers
    assert headers.index("attn-lrp") < headers.index("lrp (baseline)")
    # Signed maps show their relevance sum beside the explained logit (the model's own output).
    assert page.count("sum of relevance") >= 4 and "logit" in page.split("sum of relevance", 1)[1][:80]
