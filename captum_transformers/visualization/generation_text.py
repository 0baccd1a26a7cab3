"""One generated token's evidence over the text, and several methods side by side.

``GenerationText(result, output_index=t)`` writes the prompt and the generated text, marks
the chosen output token ``y_t`` (outlined) and colours what it read: the prompt tokens by
``token_attr[t]`` and the earlier output tokens by ``target_attr[t]``; the tokens after
``y_t`` stay plain (the step never read them). Colours, greyed special tokens and word
merging (``merge_words=True``: a word's score is the sum of its pieces') are those of
:class:`~captum_transformers.visualization.GenerationMatrix`; the scale is the row's own
(its largest ``|score|`` over the coloured tokens), stated in the colour bar.

For an encoder-decoder the generated text starts with the decoder's start token (what
``target_attr``'s first column scores). A ``span`` result (one row summing several steps)
has no single chosen token: draw it with ``GenerationMatrix``.

``GenerationReport`` (from ``generation_report``) holds one view per method: side by side
in HTML, and in the drawing side by side when they fit 40 inches, else one under another.

>>> GenerationText(result, output_index=2, merge_words=True).save("token2.html")   # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Tuple

import torch

from ..errors import InputError
from .colors import ColorScale, css_rgb, text_colour
from .generation import (BLANK_MEANING, MATRIX_MEANING, GenerationMatrix, SpecialOption, checked_parts,
                         fraction_rgb, is_encoder_decoder, legend_sentence, special_flags)
from .images import add_colorbar
from .output import Picture, agg_figure, escape, legend_html, plain_text
from .tokens import merge_word_pieces

CHARS_PER_LINE = 90
MAX_WIDTH = 40.0  # inches: wider reports stack their views


@dataclass
class TextCell:
    """One shown token (or word): ``score`` None for a token drawn plain (not read, or the chosen one)."""

    token: str
    score: Optional[float]
    special: bool
    chosen: bool = False


def _cells(tokens: List[str], values: Optional[torch.Tensor], flags: List[bool], merge: bool) -> List[TextCell]:
    """Cells of a run of tokens: scored when ``values`` is given, merged into words on request."""
    if not tokens:
        return []
    scores = values if values is not None else torch.zeros(len(tokens))
    if merge:
        tokens, scores, flags, _ = merge_word_pieces(tokens, scores, flags)
    return [TextCell(token, None if values is None else float(score), flag)
            for token, score, flag in zip(tokens, scores.tolist(), flags)]


class GenerationText(Picture):
    """The prompt and the generated text with one output token's evidence coloured (module docstring).

    Args:
        result: a ``GenerationResult``.
        output_index: which generated token to explain (negative counts from the end).
        merge_words: join word pieces into words (sum of their scores).
        title: the picture's title (default: the explained token).
        skip: tokens to grey, as for ``GenerationMatrix``.
        special_tokens: tokens to grey by kind, as for ``GenerationMatrix``.

    ``prompt_cells`` and ``output_cells`` list the shown ``TextCell``\\ s, ``scale`` the colour scale."""

    def __init__(self, result, output_index: int = 0, merge_words: bool = False, *, title: Optional[str] = None,
                 skip: Optional[Iterable[str]] = None, special_tokens: SpecialOption = None):
        parts = checked_parts(result)
        rows = len(parts["outputs"])
        if rows != len(parts["read"]):
            raise InputError(f"this result has {rows} row(s) for {len(parts['read'])} output tokens (a span: one row "
                             "summing several steps), so no single token is chosen; draw it with GenerationMatrix.")
        if isinstance(output_index, bool) or not isinstance(output_index, int) or not -rows <= output_index < rows:
            raise InputError(f"output_index={output_index!r}: expected an int in [{-rows}, {rows}) (the generated "
                             f"tokens are {parts['outputs']!r:.200}).")
        index = output_index % rows
        self.signed, self.output_index = parts["signed"], index
        decoder_only = not is_encoder_decoder(parts)
        stream = parts["outputs"] if decoder_only else parts["read"] + parts["outputs"][-1:]
        chosen = index if decoder_only else index + 1  # position of y_t in the shown stream
        self.token = parts["outputs"][index]
        self.probability = float(parts["output_probs"][index])
        self.title = str(title) if title is not None else \
            f"{getattr(result, 'method', 'method')}: why {self.token!r} was generated"
        prompt_flags = special_flags(parts["inputs"], special_tokens, skip)
        stream_flags = special_flags(stream, special_tokens, skip)
        self.prompt_cells = _cells(parts["inputs"], parts["token_attr"][index], prompt_flags, merge_words)
        self.output_cells = (_cells(stream[:chosen], parts["target_attr"][index, :chosen], stream_flags[:chosen],
                                    merge_words)
                             + [TextCell(stream[chosen], None, stream_flags[chosen], chosen=True)]
                             + _cells(stream[chosen + 1:], None, stream_flags[chosen + 1:], merge_words))
        evidence = [cell.score for cell in self.prompt_cells + self.output_cells
                    if cell.score is not None and not cell.special]
        self.scale = ColorScale.fit([torch.tensor(evidence, dtype=torch.float32)], signed=self.signed)
        # Nothing to colour: every score the step read is 0 (Grad-CAM when no head's gradient-weighted
        # attention is positive, a partial-LRP map that is exactly zero). Said instead of a scale.
        self.blank = not any(score != 0 for score in evidence)

    def colour(self, cell: TextCell) -> Optional[str]:
        """The cell's CSS background, None for a plain (or greyed) one."""
        if cell.score is None or cell.special:
            return None
        return css_rgb(self.scale.rgb(torch.tensor([cell.score]))[0])

    def _span(self, cell: TextCell) -> str:
        background = self.colour(cell)
        if cell.chosen:
            style = "outline:2px solid #000;font-weight:700"
            tip = f"explained token (p={self.probability:.3g})"
        elif background is not None:
            ink = text_colour(float(self.scale.normalized(torch.tensor(cell.score))))
            style = f"background:{background};color:{ink}"
            tip = f"{cell.score:+.4g}"
        else:
            style, tip = "", ("not read" if cell.score is None else f"{cell.score:+.4g} (special, not coloured)")
        classes = "tok special" if cell.special else "tok"
        return f"<span class='{classes}' style='{style}' title='{escape(tip)}'>{escape(cell.token)}</span>"

    def _body_html(self, compact: bool = False) -> str:
        """The panel; ``compact``: the colour bar without the sentence saying what colours mean
        (a report states it once under its panels)."""
        prompt = "".join(self._span(cell) for cell in self.prompt_cells)
        output = "".join(self._span(cell) for cell in self.output_cells)
        meaning = "" if compact else (f"<div class='legend'>{escape(legend_sentence(self.signed))} "
                                      "After the outlined token: plain (not read yet).</div>")
        return (f"<h3>{escape(self.title)}</h3>"
                f"<div class='legend'>output token {self.output_index} {escape(repr(self.token))}, "
                f"p={self.probability:.3g}, outlined</div>"
                f"<div style='text-align:left;margin:4px 0'><b>prompt</b> {prompt}</div>"
                f"<div style='text-align:left;margin:4px 0'><b>generated</b> {output}</div>"
                f"{self._scale_html(compact)}{meaning}")

    def _scale_html(self, compact: bool) -> str:
        if self.blank:
            return f"<div class='legend blank'><b>Nothing coloured:</b> {escape(BLANK_MEANING)}</div>"
        return legend_html(self.scale, compact=compact)

    # -- the drawing (PNG / SVG) -------------------------------------------------------
    def _lines(self) -> List[Tuple[str, List[TextCell]]]:
        """(``"prompt"`` or ``"output"``, cells) lines of at most ``CHARS_PER_LINE`` characters."""
        lines: List[Tuple[str, List[TextCell]]] = []
        for label, cells in (("prompt", self.prompt_cells), ("output", self.output_cells)):
            current, used = [], 0
            for cell in cells:
                if current and used + len(cell.token) + 1 > CHARS_PER_LINE:
                    lines.append((label, current))
                    current, used = [], 0
                current.append(cell)
                used += len(cell.token) + 1
            lines.append((label, current))
        return lines

    def panel_size(self):
        """(width, height) in inches: the longest line, at least the colour bar and the legend."""
        lines = self._lines()
        longest = max(sum(len(cell.token) + 1 for cell in cells) for _, cells in lines)
        return max(0.85 + 0.075 * longest + 0.3, 5.6), 0.22 * len(lines) + 1.3

    def draw(self, figure, origin=(0.0, 0.0)) -> None:
        """Draw into ``figure`` with the lower left corner at ``origin`` (inches)."""
        panel_width, panel_height = self.panel_size()
        width, height = figure.get_size_inches()
        x0, y0 = origin
        figure.text((x0 + 0.1) / width, (y0 + panel_height - 0.25) / height, plain_text(self.title), fontsize=8,
                    weight="bold")
        y = panel_height - 0.55
        for label, line in self._lines():
            figure.text((x0 + 0.1) / width, (y0 + y) / height, label, fontsize=6,
                        color="#666", va="center")
            x = 0.85
            for cell in line:
                background = self.colour(cell)
                if cell.chosen:
                    box = dict(facecolor="white", edgecolor="black", linewidth=1.2, pad=0.6)
                elif cell.special:
                    box = dict(facecolor="none", edgecolor="#bbbbbb", linestyle="--", pad=0.5)
                else:
                    box = dict(facecolor="white" if background is None else
                               fraction_rgb(self.scale.rgb(torch.tensor([cell.score]))[0].tolist()),
                               edgecolor="none", pad=0.5)
                dark = background is not None and abs(float(self.scale.normalized(torch.tensor(cell.score)))) > 0.65
                figure.text((x0 + x) / width, (y0 + y) / height, plain_text(cell.token), fontsize=7, va="center",
                            family="monospace", color="#888" if cell.special else ("#fff" if dark else "#000"),
                            weight="bold" if cell.chosen else "normal", bbox=box)
                x += 0.075 * (len(cell.token) + 1)
            y -= 0.22
        if self.blank:
            figure.text((x0 + 0.1) / width, (y0 + 0.5) / height, plain_text("Nothing coloured: " + BLANK_MEANING),
                        fontsize=6, color="#a00", wrap=True)
        else:
            add_colorbar(figure, ((x0 + 0.85) / width, (y0 + 0.5) / height, 3.0 / width, 0.1 / height), self.scale)
        figure.text((x0 + 0.1) / width, (y0 + 0.05) / height, plain_text(legend_sentence(self.signed, "\n")),
                    fontsize=5, color="#333")

    def _figure(self):
        figure = agg_figure(*self.panel_size())
        self.draw(figure)
        return figure


class GenerationReport(Picture):
    """One view per method of the same generation (``generation_report`` builds it)."""

    def __init__(self, results: Mapping[str, object], output_index: Optional[int] = None, *,
                 title: str = "Why each token was generated", **options):
        if not isinstance(results, Mapping) or not results:
            raise InputError(f"results must be a non-empty {{method name: GenerationResult}} dict, got "
                             f"{type(results).__name__}.")
        first_name, first = next(iter(results.items()))
        for name, result in results.items():
            parts, reference = checked_parts(result), checked_parts(first)
            if parts["inputs"] != reference["inputs"] or parts["outputs"] != reference["outputs"]:
                raise InputError(f"results[{name!r}] explains {parts['inputs']!r:.80} -> {parts['outputs']!r:.80} but "
                                 f"results[{first_name!r}] explains {reference['inputs']!r:.80} -> "
                                 f"{reference['outputs']!r:.80}; a report compares methods on the same generation.")
        self.title = str(title)
        self.output_index = output_index
        self.views = {str(name): (GenerationMatrix(result, title=str(name), **options) if output_index is None else
                                  GenerationText(result, output_index, title=str(name), **options))
                      for name, result in results.items()}

    def _body_html(self) -> str:
        """The panels side by side, wrapping at the page's width (a wide matrix scrolls in its own
        box), and once under them what the colours mean (each panel keeps its own colour bar)."""
        size = "flex:0 1 auto;max-width:100%" if self.output_index is None else "flex:1 1 240px;max-width:420px"
        panels = "".join(f"<div style='{size};min-width:0;text-align:left'>{view._body_html(compact=True)}</div>"
                         for view in self.views.values())
        kinds = sorted({view.signed for view in self.views.values()}, reverse=True)
        notes = [legend_sentence(signed) for signed in kinds]
        if any(isinstance(view, GenerationMatrix) for view in self.views.values()):
            notes.append(MATRIX_MEANING)
        else:
            notes.append("After the outlined token: plain (not read yet).")
        footer = "".join(f"<div class='legend'>{escape(note)}</div>" for note in notes)
        return (f"<h3>{escape(self.title)}</h3><div style='display:flex;flex-wrap:wrap;gap:8px 18px;"
                f"align-items:flex-start'>{panels}</div>{footer}")

    def _sizes(self):
        return [view.layout().size if isinstance(view, GenerationMatrix) else view.panel_size()
                for view in self.views.values()]

    def _figure(self):
        sizes = self._sizes()
        beside = sum(w for w, _ in sizes) <= MAX_WIDTH
        width = sum(w for w, _ in sizes) if beside else max(w for w, _ in sizes)
        height = (max(h for _, h in sizes) if beside else sum(h for _, h in sizes)) + 0.35
        figure = agg_figure(max(width, 5.5), height)
        figure.text(0.1 / max(width, 5.5), 1 - 0.22 / height, plain_text(self.title), fontsize=9, weight="bold")
        x, y = 0.0, height - 0.35
        for view, (w, h) in zip(self.views.values(), sizes):
            if beside:
                view.draw(figure, (x, y - h))
                x += w
            else:
                view.draw(figure, (0.0, y - h))
                y -= h
        return figure


def generation_report(results, output_index: Optional[int] = None, **options) -> GenerationReport:
    """Several methods' explanations of one generation side by side, in one picture.

    ``results``: ``{method name: GenerationResult}``, all of the same prompt and output. Each
    is drawn as a ``GenerationMatrix``, or, with ``output_index``, as a ``GenerationText`` of
    that output token. Other keyword arguments go to each view (``merge_words``, ``skip``...).

    >>> generation_report({"AttnLRP": lrp_result, "attention": attention_result}).save("why.html")  # doctest: +SKIP
    """
    return GenerationReport(results, output_index, **options)
