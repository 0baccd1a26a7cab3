"""A griffe extension for the API reference: the package's docstrings are written for ``help()``
and Sphinx-style readers, so for Markdown a bare doctest paragraph (``>>> ...`` lines not
indented as a literal block) is fenced as a ``pycon`` code block, an RST ``.. math::``
directive becomes a fenced block of its LaTeX (the site loads no math renderer: it builds and
reads offline), a role such as ``:mod:`x``` becomes the code ``x``, and an RST literal-block
marker (``Example::``) loses its second colon. Without it Markdown reads ``[[0, 1], [2]]`` in
a doctest's output as a cross-reference and ``mkdocs build --strict`` fails.

Loaded by mkdocs.yml (``extensions`` of the python handler); excluded from the site itself.
"""
from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|obj|exc|ref|math):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """``text`` with each paragraph that starts with ``>>>`` at column 0 fenced as ``pycon``."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(".. math::"):
            indent = len(line) - len(line.lstrip())
            block = [line.lstrip()[len(".. math::"):].strip()]
            i += 1
            while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
                block.append(lines[i].strip())
                i += 1
            out += [" " * indent + "```text", *(" " * indent + b for b in block if b), " " * indent + "```"]
            continue
        if line.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out += ["```pycon", *block, "```"]
            continue
        if line.rstrip().endswith("::") and not line.rstrip().endswith(":::") and line.strip() != "::":
            line = line.rstrip()[:-1]
        out.append(line)
        i += 1
    return ROLE.sub(r"`\1`", "\n".join(out))


class DoctestBlocks(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`fence_doctests`."""

    def on_object(self, *, obj, loader, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
