"""A griffe extension for the API reference: the package's docstrings are written for ``help()``
and Sphinx-style readers, so a bare doctest paragraph (``>>> ...`` lines not indented as a
literal block) is fenced as a ``pycon`` code block, and an RST literal-block marker
(``Example::``) loses its second colon. Without it Markdown reads ``[[0, 1], [2]]`` in a
doctest's output as a cross-reference and ``mkdocs build --strict`` fails.

Loaded by mkdocs.yml (``extensions`` of the python handler); excluded from the site itself.
"""
from __future__ import annotations

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with each paragraph that starts with ``>>>`` at column 0 fenced as ``pycon``."""
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
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
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`fence_doctests`."""

    def on_object(self, *, obj, loader, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
