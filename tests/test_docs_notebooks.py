"""The tutorials' notebooks are their scripts, executed, with their pictures.

Each ``tutorials/NAME.py`` (percent format, the reviewed source) is paired with
``tutorials/NAME.ipynb`` (generated with ``jupytext --to ipynb --execute``, CONTRIBUTING.md),
which the site renders (``docs/tutorials/NAME.ipynb`` links to it). The scripts are run by
``tests/test_tutorials.py``; here each notebook must hold exactly its script's cells, every code
cell executed without error, and the pictures the tutorial draws in its outputs, so a script
edited without regenerating its notebook fails here instead of publishing stale code.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "tutorials").glob("*.py"))
# What each notebook must show: embedded images (overlays, grids, curves) or token tables.
PICTURES = {"quickstart": "<img", "digit_canvas_vit": "<img", "multimodal": "<img", "movie_minilm": "<table"}


def _cells(notebook):
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


def test_every_tutorial_is_a_notebook_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert SCRIPTS
    for script in SCRIPTS:
        assert script.with_suffix(".ipynb").is_file(), f"{script.name} has no paired notebook"
        link = ROOT / "docs" / "tutorials" / f"{script.stem}.ipynb"
        assert link.exists() and os.path.samefile(link, script.with_suffix(".ipynb")), link
        assert f"tutorials/{script.stem}.ipynb" in nav, f"{script.stem}.ipynb is not in mkdocs.yml's nav"
        assert script.stem in PICTURES, f"say what {script.name}'s notebook must show"


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_notebook_holds_its_script_executed(script):
    jupytext = pytest.importorskip("jupytext", reason="needs jupytext: pip install -e '.[dev]' (the README's set-up)")
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
    assert _cells(notebook) == _cells(jupytext.read(script)), (
        f"{script.with_suffix('.ipynb').name} differs from {script.name}: run "
        f"`jupytext --to ipynb --execute tutorials/{script.name}`")
    html = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        assert cell.execution_count is not None, f"a cell of {script.stem}.ipynb was not executed"
        for output in cell.get("outputs", []):
            assert output.output_type != "error", f"{script.stem}.ipynb holds an error: {output.get('ename')}"
            html.append(output.get("data", {}).get("text/html", ""))
    assert PICTURES[script.stem] in "".join(html), f"{script.stem}.ipynb shows no pictures"
