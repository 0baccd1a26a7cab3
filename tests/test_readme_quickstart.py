"""The README's first code block (the quick start on the built-in trained ViT) runs as printed."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

pytest.importorskip("timm")
pytest.importorskip("sklearn")
pytest.importorskip("skimage")

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _quick_start_block() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quick_start_puts_most_of_the_map_on_the_digit():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_quick_start_block(), "README.md quick start", "exec"), {"__name__": "__readme__"})
    share = float(re.search(r"tensor\(([0-9.]+)\)", out.getvalue()).group(1))
    # The README's comment says 0.55 of the map lies on the digit's 11 % of the pixels.
    assert share == pytest.approx(0.55, abs=0.01)


def test_readme_is_a_five_minute_read():
    # The long tables live on the documentation site (docs/, mkdocs.yml); the README keeps the
    # install, the two commands, the quick starts and links (CONTRIBUTING.md, Documentation).
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move the detail to a page in docs/"
    text = "\n".join(lines)
    for command in ('python3 -m venv .venv && .venv/bin/pip install -e ".[all,dev]" && .venv/bin/python -m '
                    'captum_transformers', ".venv/bin/python -m pytest tests",
                    "pip install torch --index-url https://download.pytorch.org/whl/cpu"):
        assert command in text, command
