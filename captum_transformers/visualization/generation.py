"""Why a language model wrote each token, drawn: the generated tokens x what they read.

``GenerationMatrix(result)`` draws a :class:`~captum_transformers.GenerationResult` as one
matrix: a row per generated token ``y_t`` (labelled with its probability and the share of
its attribution on the first tokens, ``first_token_share``), a column per token it could
read, the prompt's (``token_attr``) then, after a separator, the earlier generated tokens'
(``target_attr``, named by ``target_attr_tokens``):

.. math:: M[t, :] = \\big[\\,\\text{token\\_attr}[t, :]\\;\\big|\\;\\text{target\\_attr}[t, :]\\,\\big]

Colours follow the package's one convention (``colors``), chosen by the METHOD
(``result.signed``): signed scores (relevance, gradient x input) on a scale symmetric about
zero, red = for the row's token, blue = against it; unsigned ones (attention maps) white to
red, darker = more relevant, no direction. Special tokens (``<s>``, ``<|eot_id|>``,
``[CLS]``... or those given) and the tokens named in ``skip`` are greyed, their value in the
tooltip only, and left out of the colour scale (an attention sink would wash out every word).
Cells of output tokens a step had not read yet (the ones after it) are drawn blank.
A model with an attention-sink slot (``result.sink_share``, GPT-OSS) gets one more column: the
probability each row's query put on the slot, beside the first-token share.
``merge_words=True`` joins word pieces into words, each word's score the SUM of its pieces'
(``merge_word_pieces``; relevance is additive, so a row's total is kept).

The matrix shows itself in a notebook and ``save``s to ``.html`` (one self-contained file,
no script), ``.png`` or ``.svg``. ``GenerationText`` shows one generated token's evidence
over the text; ``generation_report`` (in ``generation_text``) puts several methods side by side.

>>> result = GenerationAttribution(AttnLRP(model), tokenizer).attribute("k = 3 ; q ?")  # doctest: +SKIP
>>> GenerationMatrix(result, merge_words=True).save("why.html")                          # doctest: +SKIP
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

import torch

from ..errors import InputError
from .colors import ColorScale, as_float_tensor, css_rgb
from .images import add_colorbar
from .output import Picture, agg_figure, escape, legend_html, plain_text
from .tokens import merge_word_pieces

# Spellings of special tokens across tokenizers: <s>, </s>, <pad>, <|endoftext|>, <|eot_id|>, [CLS].
SPECIAL_SHAPE = re.compile(r"^(<\|?/?[A-Za-z0-9_.:-]+\|?>|\[[A-Z][A-Z_]*\])$")
SIGNED_MEANING = "red = for the generated token (it raises the token's score), blue = against it, white = 0"
UNSIGNED_MEANING = "darker red = more relevant (unsigned: no direction, neither for nor against the token)"
GREY_MEANING = "Grey dashed: special or skipped tokens (not coloured, not in the scale)."
UNREAD_RGB = (250, 250, 250)
SPECIAL_RGB = (225, 225, 225)
# Scoped to .ctv .gm: the matrix's cells are many, so their common style is said once here.
MATRIX_STYLE = (
    "<style>.ctv .gm td.c{width:12px;min-width:12px;height:14px;padding:0;border:1px solid #fff}"
    ".ctv .gm td.sp{background:#e1e1e1;border:1px dashed #bbb} .ctv .gm td.nr{background:#fafafa}"
    ".ctv .gm .sep{border-left:2px solid #444} .ctv .gm th.ch{padding:1px;font-weight:400;font-size:11px}"
    ".ctv .gm th.ch span{writing-mode:vertical-rl;transform:rotate(180deg);white-space:pre}"
    ".ctv .gm th.ch.spt{color:#888;font-style:italic} .ctv .gm th.row{text-align:right;white-space:pre;"
    "font-weight:400;font-size:12px;position:sticky;left:0;background:#fff}"
    ".ctv .gm td.share,.ctv .gm td.sink{font-size:11px;color:#444;padding:0 6px}</style>"
)

SpecialOption = Union[None, Iterable[str], object]


def special_flags(tokens: Sequence[str], special_tokens: SpecialOption, skip: Optional[Iterable[str]]) -> List[bool]:
    """True for each token to grey: a special token or one named in ``skip``.

    ``special_tokens``: None (tokens shaped like ``<s>``, ``<|eot_id|>``, ``[CLS]``), an iterable
    of token strings, or a tokenizer (its ``all_special_tokens``)."""
    if skip is not None and (isinstance(skip, str) or not all(isinstance(t, str) for t in skip)):
        raise InputError(f"skip={skip!r}: expected a list of token strings to grey, e.g. skip=['<s>', ','].")
    skipped = set(skip or ())
    if special_tokens is None:
        return [bool(SPECIAL_SHAPE.match(t)) or t in skipped for t in tokens]
    named = getattr(special_tokens, "all_special_tokens", special_tokens)
    if isinstance(named, str) or not all(isinstance(t, str) for t in named):
        raise InputError(f"special_tokens={special_tokens!r}: expected None, a list of token strings or a tokenizer.")
    named = set(named) | skipped
    return [t in named for t in tokens]


def checked_parts(result) -> dict:
    """The parts of a ``GenerationResult`` the views draw, checked for shape and finiteness."""
    needed = ("input_tokens", "output_tokens", "token_attr", "target_attr", "target_attr_tokens", "output_probs",
              "first_token_share", "signed")
    missing = [name for name in needed if getattr(result, name, None) is None]
    if missing:
        raise InputError(f"a {type(result).__name__} without {missing}; expected a GenerationResult "
                         "(GenerationAttribution(method, tokenizer).attribute(prompt)).")
    parts = {"inputs": [str(t) for t in result.input_tokens], "outputs": [str(t) for t in result.output_tokens],
             "read": [str(t) for t in result.target_attr_tokens], "signed": bool(result.signed),
             # the layout the result says it has; spellings only for objects that do not say
             "encoder_decoder": getattr(result, "encoder_decoder", None)}
    rows = len(parts["outputs"])
    shapes = {"token_attr": (rows, len(parts["inputs"])), "target_attr": (rows, len(parts["read"])),
              "output_probs": (rows,), "first_token_share": (rows,)}
    for name, shape in shapes.items():
        parts[name] = as_float_tensor(getattr(result, name), f"result.{name}")
        if tuple(parts[name].shape) != shape:
            raise InputError(f"result.{name} has shape {tuple(parts[name].shape)}; expected {shape} (one row per "
                             "output token, one column per token named in the result).")
    if rows == 0:
        raise InputError("the result has no output token; nothing was generated to explain.")
    return parts


def sink_shares(result, rows: int) -> Optional[torch.Tensor]:
    """``result.sink_share`` (rows,) as floats, or None where the result has none (a model without
    an attention-sink slot, or a result made before the field existed)."""
    value = getattr(result, "sink_share", None)
    if value is None:
        return None
    value = as_float_tensor(value, "result.sink_share")
    if tuple(value.shape) != (rows,):
        raise InputError(f"result.sink_share has shape {tuple(value.shape)}; expected ({rows},) (one value per output "
                         "token), or None.")
    return value


def is_encoder_decoder(parts: dict) -> bool:
    """Whether the result's read tokens start with a decoder start token (encoder-decoders)."""
    known = parts.get("encoder_decoder")
    return bool(known) if known is not None else parts["read"] != parts["outputs"]


def read_mask(parts: dict) -> torch.Tensor:
    """(T, m) True where row t's step read output column j: decoder-only models read the
    tokens before y_t (j < t); encoder-decoders the start token and those before (j <= t);
    a span's single row (a sum of steps) is drawn as having read every column."""
    rows, columns = len(parts["outputs"]), len(parts["read"])
    if rows != columns:
        return torch.ones(rows, columns, dtype=torch.bool)
    offset = 1 if is_encoder_decoder(parts) else 0
    return torch.arange(columns)[None, :] < torch.arange(rows)[:, None] + offset


def merged_columns(tokens: List[str], values: torch.Tensor, flags: List[bool], read: Optional[torch.Tensor]):
    """Word pieces joined (sums of their scores); a word counts as read when any piece was."""
    if not tokens:
        return tokens, values, flags, read
    words, merged, word_flags, groups = merge_word_pieces(tokens, values, flags)
    if read is not None:
        read = torch.stack([read[:, group].any(-1) for group in groups], dim=-1)
    return words, merged, word_flags, read


MATRIX_MEANING = ("Blank: output tokens the step had not read yet. First-token share: the share of |attribution| "
                  "on the first token(s) (attention sinks).")
SINK_MEANING = ("Sink slot: the probability the row's query put on the learned attention-sink slot (no token), "
                "averaged over heads and layers.")
BLANK_MEANING = ("the method scored every token this output read 0, so no colour and no scale are shown (Grad-CAM: "
                 "no head's gradient-weighted attention is positive; the call's warning says why).")


def legend_sentence(signed: bool, separator: str = " ") -> str:
    """What the colours mean (``separator="\\n"``: on two lines, for a drawing)."""
    return (f"Signed scores: {SIGNED_MEANING}." if signed else f"Unsigned scores: {UNSIGNED_MEANING}.") + \
        separator + GREY_MEANING


def fraction_rgb(colour) -> tuple:
    return tuple(float(c) / 255 for c in colour)


@dataclass
class MatrixLayout:
    """Sizes in inches of the matrix drawing's parts (labels, cells, colour bar)."""

    left: float
    bottom: float
    top: float
    cells_width: float
    cells_height: float
    right: float = 0.9

    @property
    def size(self):
        # At least 5.6 inches wide: the legend's sentence is drawn under the cells.
        return max(self.left + self.cells_width + self.right, 5.6), self.top + self.cells_height + self.bottom


class GenerationMatrix(Picture):
    """Generated tokens (rows) x prompt then earlier output tokens (columns); see the module docstring.

    Args:
        result: a ``GenerationResult``.
        title: the heading (default: the method and the explained score).
        merge_words: join word pieces into words (sum of their scores) in the columns.
        skip: token strings to grey like special tokens (e.g. ``[","]``).
        special_tokens: None (``<s>``, ``<|...|>``, ``[CLS]``-shaped tokens), token strings, or the tokenizer.
        scale: ``"shared"`` (one limit for the matrix), ``"per-row"`` (each row by its largest
            ``|score|``, printed in its label) or a number (the limit).

    ``values`` (T, C) holds the drawn scores, ``columns`` their tokens, ``prompt_columns`` how
    many are the prompt's, ``greyed`` (C,) and ``read`` (T, C) which cells are coloured,
    ``scales`` one ``ColorScale`` per row."""

    def __init__(self, result, title: Optional[str] = None, merge_words: bool = False,
                 skip: Optional[Iterable[str]] = None, *, special_tokens: SpecialOption = None,
                 scale: Union[str, float] = "shared"):
        parts = checked_parts(result)
        self.signed = parts["signed"]
        method, kind = getattr(result, "method", "method"), getattr(result, "score_kind", "score")
        self.title = str(title) if title is not None else f"{method}: why each token was generated ({kind})"
        self.rows = parts["outputs"]
        self.probabilities = parts["output_probs"]
        self.shares = parts["first_token_share"]
        self.sinks = sink_shares(result, len(self.rows))  # None: no attention-sink slot (no column)
        self.contrast = [str(t) for t in result.contrast_tokens] if getattr(result, "contrast_tokens", None) else None
        self.row_special = special_flags(self.rows, special_tokens, skip)
        prompt_flags = special_flags(parts["inputs"], special_tokens, skip)
        output_flags = special_flags(parts["read"], special_tokens, skip)
        read = read_mask(parts)
        prompt, prompt_values, output, output_values = parts["inputs"], parts["token_attr"], parts["read"], \
            parts["target_attr"]
        if merge_words:
            prompt, prompt_values, prompt_flags, _ = merged_columns(prompt, prompt_values, prompt_flags, None)
            output, output_values, output_flags, read = merged_columns(output, output_values, output_flags, read)
        self.columns = prompt + output
        self.prompt_columns = len(prompt)
        self.values = torch.cat([prompt_values, output_values], dim=1)
        self.greyed = torch.tensor(prompt_flags + output_flags, dtype=torch.bool)
        self.read = torch.cat([torch.ones(len(self.rows), len(prompt), dtype=torch.bool), read], dim=1)
        self.scale_mode = scale
        self.scales = self._fit(scale)

    def _fit(self, scale) -> List[ColorScale]:
        coloured = self.read & ~self.greyed[None, :]
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            fixed = ColorScale(self.signed, float(scale))
            ColorScale.fit([self.values[coloured]], signed=self.signed)  # refuses negatives on an unsigned scale
            return [fixed] * len(self.rows)
        if scale == "shared":
            return [ColorScale.fit([self.values[coloured]], signed=self.signed)] * len(self.rows)
        if scale == "per-row":
            return [ColorScale.fit([self.values[row][coloured[row]]], signed=self.signed)
                    for row in range(len(self.rows))]
        raise InputError(f"scale={scale!r}: expected 'shared', 'per-row' or a positive number (the limit).")

    def row_label(self, row: int) -> str:
        """``token (p=0.83)``, with the foil of a contrast and the row's range under ``per-row``."""
        token = self.rows[row] + (f" vs {self.contrast[row]}" if self.contrast and row < len(self.contrast) else "")
        label = f"{token} (p={float(self.probabilities[row]):.2f})"
        coloured = self.read[row] & ~self.greyed
        if not bool((self.values[row][coloured] != 0).any()):
            label += " all 0"  # a blank row is the method's answer, not a missing one
        if self.scale_mode == "per-row":
            scale = self.scales[row]
            label += f" ±{scale.limit:.2g}" if scale.signed else f" 0..{scale.limit:.2g}"
        return label

    def cell_rgb(self) -> torch.Tensor:
        """(T, C, 3) uint8: each cell's colour, special columns grey and unread cells blank."""
        colours = torch.stack([self.scales[row].rgb(self.values[row]) for row in range(len(self.rows))])
        colours[~self.read] = torch.tensor(UNREAD_RGB, dtype=torch.uint8)
        colours[:, self.greyed] = torch.tensor(SPECIAL_RGB, dtype=torch.uint8)
        return colours

    def _legend(self, compact: bool = False) -> str:
        coloured = self.read & ~self.greyed[None, :]
        if not bool((self.values[coloured] != 0).any()):
            bar = f"<div class='legend blank'><b>Nothing coloured:</b> {escape(BLANK_MEANING)}</div>"
        elif self.scale_mode == "per-row":
            bar = "<div class='legend'>Each row is scaled by its largest |score| (its range is in its label).</div>"
        else:
            bar = legend_html(self.scales[0], compact=compact)
        if compact:
            return bar
        sinks = "" if self.sinks is None else " " + SINK_MEANING
        return (f"{bar}<div class='legend'>{escape(legend_sentence(self.signed))} {escape(MATRIX_MEANING)}"
                f"{escape(sinks)}</div>")

    def _body_html(self, compact: bool = False) -> str:
        """The matrix; ``compact``: without the sentences saying what colours mean (a report
        states them once under its panels)."""
        colours = self.cell_rgb()
        separator = self.prompt_columns
        heads = "".join(
            f"<th class='ch{' spt' if self.greyed[j] else ''}{' sep' if j == separator else ''}'>"
            f"<span>{escape(token)}</span></th>" for j, token in enumerate(self.columns))
        body = []
        for row in range(len(self.rows)):
            cells = []
            for j in range(len(self.columns)):
                kind = "sp" if self.greyed[j] else ("nr" if not self.read[row, j] else "")
                classes = f"c{' ' + kind if kind else ''}{' sep' if j == separator else ''}"
                style = "" if kind else f" style='background:{css_rgb(colours[row, j])}'"
                value = "not read" if kind == "nr" else f"{float(self.values[row, j]):+.4g}"
                cells.append(f"<td class='{classes}'{style} title='{value}'></td>")
            label = f"<th class='row{' spt' if self.row_special[row] else ''}'>{escape(self.row_label(row))}</th>"
            share = f"<td class='share'>{100 * float(self.shares[row]):.0f}%</td>"
            if self.sinks is not None:
                share += f"<td class='sink'>{100 * float(self.sinks[row]):.0f}%</td>"
            body.append(f"<tr>{label}{''.join(cells)}{share}</tr>")
        spans = (f"<tr><th></th><th colspan='{self.prompt_columns}'>prompt</th>"
                 f"<th colspan='{len(self.columns) - self.prompt_columns}' class='sep'>generated</th>"
                 f"<th></th>{'' if self.sinks is None else '<th></th>'}</tr>") \
            if len(self.columns) > self.prompt_columns else ""
        sink_head = "" if self.sinks is None else "<th class='ch'><span>sink slot %</span></th>"
        return (f"{MATRIX_STYLE}<h3>{escape(self.title)}</h3><div style='overflow:auto'><table class='gm'>"
                f"<thead>{spans}<tr><th>generated token (p)</th>{heads}<th class='ch'><span>first-token %</span>"
                f"</th>{sink_head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>{self._legend(compact)}")

    # -- the drawing (PNG / SVG) -------------------------------------------------------
    def layout(self) -> MatrixLayout:
        longest_row = max(len(self.row_label(row)) for row in range(len(self.rows)))
        longest_column = max((len(token) for token in self.columns), default=1)
        cell = min(0.16, max(0.05, 24.0 / max(len(self.columns), 1)))
        return MatrixLayout(left=0.3 + 0.065 * min(longest_row, 40), bottom=0.85 + 0.06 * min(longest_column, 20),
                            top=0.45, cells_width=cell * len(self.columns),
                            cells_height=min(0.2, max(0.06, 14.0 / len(self.rows))) * len(self.rows),
                            right=0.9 if self.sinks is None else 1.2)  # room for the sink column's labels

    def draw(self, figure, origin=(0.0, 0.0)) -> None:
        """Draw into ``figure`` with the lower left corner at ``origin`` (inches)."""
        box = self.layout()
        width, height = figure.get_size_inches()
        x0, y0 = origin
        axis = figure.add_axes(((x0 + box.left) / width, (y0 + box.bottom) / height, box.cells_width / width,
                                box.cells_height / height))
        axis.imshow(self.cell_rgb().numpy(), aspect="auto", interpolation="nearest")
        rows, columns = len(self.rows), len(self.columns)
        column_step = max(1, -(-columns // int(box.cells_width / 0.11 + 1)))  # labels at most every 0.11 inch
        row_step = max(1, -(-rows // int(box.cells_height / 0.12 + 1)))
        axis.set_xticks(range(0, columns, column_step))
        axis.set_xticklabels([plain_text(self.columns[j][:20]) for j in range(0, columns, column_step)], rotation=90,
                             fontsize=6)
        axis.set_yticks(range(0, rows, row_step))
        axis.set_yticklabels([plain_text(self.row_label(row)[:40]) for row in range(0, rows, row_step)], fontsize=6)
        for label, j in zip(axis.get_xticklabels(), range(0, columns, column_step)):
            label.set_color("#888" if self.greyed[j] else "#000")
        if self.prompt_columns < columns:
            axis.axvline(self.prompt_columns - 0.5, color="#333", linewidth=1.5)
        for row in range(0, rows, row_step):
            axis.text(columns - 0.5 + 0.15 / box.cells_width * columns, row, f"{100 * float(self.shares[row]):.0f}%",
                      fontsize=5, va="center", color="#444", clip_on=False)
        axis.text(columns - 0.5, -0.6, "first-token\nshare", fontsize=5, va="bottom", ha="left", color="#444")
        if self.sinks is not None:  # a second column of labels, right of the first
            for row in range(0, rows, row_step):
                axis.text(columns - 0.5 + 0.6 / box.cells_width * columns, row, f"{100 * float(self.sinks[row]):.0f}%",
                          fontsize=5, va="center", color="#444", clip_on=False)
            axis.text(columns - 0.5 + 0.5 / box.cells_width * columns, -0.6, "sink\nslot", fontsize=5, va="bottom",
                      ha="left", color="#444")
        figure.text((x0 + 0.1) / width, (y0 + box.size[1] - 0.25) / height, plain_text(self.title), fontsize=8,
                    weight="bold")
        bar_rect = ((x0 + box.left) / width, (y0 + 0.45) / height, min(box.cells_width, 3.0) / width, 0.1 / height)
        bar = add_colorbar(figure, bar_rect, self.scales[0] if self.scale_mode != "per-row" else
                           ColorScale(self.signed, 1.0))
        if self.scale_mode == "per-row":
            bar.set_ticklabels(["-range", "0", "+range"] if self.signed else ["0", "range"])
        figure.text((x0 + 0.1) / width, (y0 + 0.05) / height, plain_text(legend_sentence(self.signed, "\n")),
                    fontsize=5, color="#333")

    def _figure(self):
        width, height = self.layout().size
        figure = agg_figure(width, height)
        self.draw(figure)
        return figure

