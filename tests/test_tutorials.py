"""Every tutorial script runs to the end, offline, writing only into a temporary directory."""
from __future__ import annotations

import glob
import os
import runpy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUTORIALS = sorted(glob.glob(os.path.join(ROOT, "tutorials", "*.py")))


def test_there_are_tutorials():
    assert TUTORIALS, "no tutorials/*.py found"


@pytest.mark.parametrize("path", TUTORIALS, ids=[os.path.basename(p) for p in TUTORIALS])
def test_tutorial_runs(path, tmp_path, monkeypatch):
    pytest.importorskip("IPython")  # captum's visualize_text needs it
    out = tmp_path / "out"
    monkeypatch.setenv("QUICKSTART_OUT", str(out))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to oversubscription
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        import matplotlib.pyplot as plt

        plt.close("all")
    if os.path.basename(path) == "quickstart.py":
        written = sorted(p.name for p in out.iterdir())
        assert "vit_generic_attention.png" in written
        assert "bert_generic_attention.html" in written
        assert "<table" in (out / "bert_generic_attention.html").read_text()
