"""Every tutorial script runs to the end, offline, writing only into a temporary directory.

The scripts are the percent-format sources of the notebooks the documentation site renders
(``tests/test_docs_notebooks.py`` checks that each notebook holds its script's cells); running
the scripts here executes the notebooks' code without a second, kernel-driven run.

The real-model tutorials also expose what they measure as module globals; the checks below
read them from ``runpy``'s returned namespace, so a tutorial whose model stopped learning, or
whose maps stopped landing on the object, fails here rather than printing a silent figure.
"""
from __future__ import annotations

import glob
import os
import runpy

import pytest
import torch
from movie_cache import fresh_movie_cache

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "*.py")))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(8) == PNG_MAGIC and os.path.getsize(path) > 10_000


def check_quickstart(namespace, out):
    written = sorted(p.name for p in out.iterdir())
    assert "vit_generic_attention.png" in written
    assert "bert_generic_attention.html" in written
    assert "<table" in (out / "bert_generic_attention.html").read_text()


def check_digit_canvas_vit(namespace, out):
    from captum_transformers.methods.catalog import METHOD_NAMES

    for name in ("digit_methods.png", "digit_positive_perturbation.png", "digit_negative_perturbation.png",
                 "digit_two_classes.png"):
        assert _is_png(out / name), name
    # The shipped ViT classifies the test canvases it explains (it scores 0.9455 on 2,000).
    assert namespace["DIGIT_ACCURACY"] >= 0.9
    assert all(namespace["SHOWN_CORRECT"])
    ratios = namespace["MASK_RATIO"]
    assert set(ratios) == set(METHOD_NAMES) | {"integrated-gradients", "saliency"}
    # Per pixel, GenericAttention / TransformerRelevance put several times more positive
    # relevance on the digit than off it (1.0 would be a map blind to the digit).
    assert ratios["generic-attention"] > 3 and ratios["transformer-relevance"] > 3
    for name, (positive_auc, negative_auc) in namespace["PERTURBATION"].items():
        assert 0 <= positive_auc < negative_auc <= 100, name  # removing relevant pixels hurts more
    assert 0.5 < namespace["SEGMENTATION"]["generic-attention"] <= 1
    # Two-digit canvases: rollout's maps ignore the target, the class-specific ones move.
    assert namespace["MAP_CHANGE"]["rollout"] == 0
    assert namespace["SPECIFICITY"]["rollout"] == pytest.approx(0.5, abs=1e-9)
    for name in ("generic-attention", "transformer-relevance"):
        assert namespace["MAP_CHANGE"][name] > 0.2, name
        assert namespace["SPECIFICITY"][name] > 0.55, name


def check_movie_minilm(namespace, out):
    html = (out / "movie_token_relevance.html").read_text(encoding="utf-8")
    assert html.count("<table") == 4 and "rgb(" in html
    # The short fine-tune (not a cached full model) beats the majority class (0.547 of these
    # 256 sentences) clearly.
    assert namespace["MODEL_SOURCE"].startswith("pretrained MiniLM fine-tuned for 96 steps")
    assert all(parameter.requires_grad for parameter in namespace["model"].parameters())
    assert namespace["HELD_OUT_ACCURACY"] > 0.7
    negative = namespace["NEGATIVE_CELLS"]
    # Signed maps are drawn signed: LRP and Integrated Gradients show blue (negative) cells;
    # the attention-based maps are non-negative by construction.
    for name in ("ConservativeLRP", "AttnLRP", "LayerIntegratedGradients"):
        assert negative[name] > 0, name
    assert negative["GenericAttention"] == 0 and negative["TransformerRelevance"] == 0
    correlation = namespace["CLASS_CORRELATION"]
    for name in ("ConservativeLRP", "AttnLRP", "LayerIntegratedGradients"):
        assert correlation[name] < -0.9, name  # explaining the other class flips the sign
    for name in ("GenericAttention", "TransformerRelevance"):
        assert correlation[name] < 0.9, name   # ... or moves the attention-based map


def check_multimodal(namespace, out):
    written = {p.name for p in out.iterdir()}
    assert {"lxmert_streams.html", "clip_streams.png"} <= written, written
    assert "<table" in (out / "lxmert_streams.html").read_text(encoding="utf-8")
    assert _is_png(out / "clip_streams.png")


def _movie_data_or_skip(tmp_path, monkeypatch):
    """The movie data in a fresh cache without a fine-tuned model, so the tutorial always takes
    its short fine-tune path (a fully fine-tuned model in the user's cache would replace it)."""
    fresh_movie_cache(tmp_path, monkeypatch)


CHECKS = {
    "quickstart.py": (None, check_quickstart),
    "digit_canvas_vit.py": (None, check_digit_canvas_vit),
    "movie_minilm.py": (_movie_data_or_skip, check_movie_minilm),
    "multimodal.py": (None, check_multimodal),
}


def test_there_are_tutorials():
    assert TUTORIALS, "no tutorials/*.py found"
    missing = set(CHECKS) - {os.path.basename(path) for path in TUTORIALS}
    assert not missing, f"tutorials checked here but missing from tutorials/: {sorted(missing)}"


@pytest.mark.parametrize("path", TUTORIALS, ids=[os.path.basename(p) for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path, monkeypatch):
    pytest.importorskip("IPython")  # captum's visualize_text needs it
    prepare, check = CHECKS.get(os.path.basename(path), (None, None))
    if prepare is not None:
        prepare(tmp_path, monkeypatch)
    out = tmp_path / "out"
    monkeypatch.setenv("QUICKSTART_OUT", str(out))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to oversubscription
    try:
        namespace = runpy.run_path(path, run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        import matplotlib.pyplot as plt

        plt.close("all")
    if check is not None:
        check(namespace, out)
