"""Token relevance as colour: one line per (example, method), every token shaded.

``TokenHeatmap(tokens, {method: scores})`` takes the tokens of each example and (B, S)
scores (``return_tokens=True`` of any method). Colours follow ``colors``: white at 0, red
for the explained class, blue against it, on a scale symmetric about 0 for signed scores.
Hover a token (HTML) for its exact score.

* **Padding**: with ``attention_mask`` (a (B, S) tensor, or the tokenizer's ``BatchEncoding`` /
  a ``{"attention_mask": ...}`` dict, whose ``attention_mask`` entry is taken) the real
  positions of each row are read (left or right padding alike); otherwise each token list
  must be as long as its scores.
* **Conservation at a glance**: each signed line ends with the sum of its relevance (over
  every real position, special tokens included) and, with ``logits`` (one explained logit per
  example, e.g. ``model(**batch).logits.gather(1, target[:, None])[:, 0]``), the logit next
  to it: ``sum of relevance 1.83 · logit 2.10``. Conservative methods aim at equal numbers;
  how far apart they are says how much relevance the model's biases and nonlinearities
  absorbed (docs/relevance-rules.md). Unsigned maps get no sum: it has no meaning there.
* **Legend**: signed lines read red = for the explained class, blue = against; unsigned ones
  (GenericAttention, rollout: ``0..range``) read darker = more relevant, with no direction.
  Signed is a property of the METHOD, whatever the scale (a limit shared with a signed method
  leaves an unsigned one ``0..limit``): ``signed=`` takes a bool or a ``{method: bool}`` dict;
  by default a catalog method's name follows ``SIGNED_METHODS``, and only another name is
  guessed from its scores (signed when one is negative: wrong for a signed method's
  all-positive line, so say ``signed=`` for your own names).
* **Special tokens** (``special_tokens``: ``[CLS]``, ``<s>``...) are drawn grey with a dashed
  border, their score in the tooltip only, and are left out of the colour scale: a
  self-relevance of ~1 on CLS would otherwise wash out every word. ``hide_special=True``
  drops them.
* **Word pieces** (``merge_word_pieces=True``): pieces of one word become one cell whose score
  is the **sum** of its pieces' scores (relevance is additive, so a row's total is kept). A
  word starts at a piece without WordPiece's ``##`` prefix; in vocabularies that mark word
  starts instead (SentencePiece ``▁``, byte-level BPE ``Ġ``) a word starts at a marked piece.
  Special tokens are never merged.

>>> TokenHeatmap(tokens, {"attn-lrp": scores}, special_tokens={"[CLS]", "[SEP]"},
...              attention_mask=mask, merge_word_pieces=True).save("tokens.html")   # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import InputError
from .colors import (ColorScale, ScaleOption, SignedOption, as_float_tensor, common_scale, css_rgb, fit_scales,
                     legend_words, text_colour)
from .output import Picture, agg_figure, escape, legend_html, plain_text

WORD_START_MARKS = ("▁", "Ġ")
CONTINUATION = "##"


def merge_word_pieces(tokens: Sequence[str], scores: torch.Tensor,
                      special: Sequence[bool]) -> Tuple[List[str], torch.Tensor, List[bool], List[List[int]]]:
    """Pieces joined into words: ``(words, word_scores (..., W), word_is_special, groups)``.

    ``scores`` has the pieces on its last axis; a word's score is the sum over its pieces
    (``groups[w]`` lists their positions). See the module docstring for where a word starts."""
    marks_starts = any(token.startswith(WORD_START_MARKS) for token, is_special in zip(tokens, special)
                       if not is_special)
    groups: List[List[int]] = []
    words: List[str] = []
    flags: List[bool] = []
    for position, (token, is_special) in enumerate(zip(tokens, special)):
        continues = bool(groups) and not is_special and not flags[-1] and (
            not token.startswith(WORD_START_MARKS) if marks_starts else token.startswith(CONTINUATION))
        if continues:
            groups[-1].append(position)
            words[-1] += token[len(CONTINUATION):] if token.startswith(CONTINUATION) else token
        else:
            groups.append([position])
            words.append(token if is_special else token.lstrip("".join(WORD_START_MARKS)) or token)
            flags.append(is_special)
    merged = torch.stack([scores[..., group].sum(-1) for group in groups], dim=-1)
    return words, merged, flags, groups


_merge_pieces = merge_word_pieces  # the constructor's keyword of the same name hides the function


@dataclass
class TokenLine:
    """One example: its title, the shown tokens (or words), which are special, and per method the scores."""

    title: str
    tokens: List[str]
    special: List[bool]
    scores: Dict[str, torch.Tensor]
    # The sum of each method's scores over every real position (before merging or hiding).
    sums: Optional[Dict[str, float]] = None
    logit: Optional[float] = None


class TokenHeatmap(Picture):
    """Token heatmap of one or more examples and methods (see the module docstring).

    ``scale``: ``"per-row"`` (default: each line by its largest |score|, so colours compare
    within a line), ``"per-method"``, ``"shared"`` or a number (the limit)."""

    def __init__(self, tokens, scores, *, titles: Optional[Sequence[str]] = None, special_tokens=(),
                 attention_mask=None, merge_word_pieces: bool = False, hide_special: bool = False,
                 scale: ScaleOption = "per-row", signed: SignedOption = None, title: str = "Token relevance",
                 logits=None):
        examples = [list(tokens)] if tokens and isinstance(tokens[0], str) else [list(t) for t in tokens]
        if not examples or not all(isinstance(t, str) for ex in examples for t in ex):
            raise InputError("tokens must be a list of strings (one example) or a list of such lists; got "
                             f"{type(tokens).__name__}.")
        named = scores if isinstance(scores, Mapping) else {"": scores}
        if not named:
            raise InputError("scores is empty; expected a (B, S) tensor or a {method_name: (B, S)} dict.")
        self.title = str(title)
        titles = [str(t) for t in titles] if titles is not None else [""] * len(examples)
        if len(titles) != len(examples):
            raise InputError(f"got {len(titles)} titles for {len(examples)} examples; expected one per example.")
        mask = boolean_attention_mask(attention_mask)
        logit_values = None if logits is None else as_float_tensor(logits, "logits").reshape(-1)
        if logit_values is not None and len(logit_values) != len(examples):
            raise InputError(f"logits has {len(logit_values)} values for {len(examples)} examples; expected one "
                             "explained logit per example, e.g. model(**batch).logits.gather(1, target[:, None])[:, 0].")
        specials = frozenset(special_tokens)
        tables = {name: self._batched(as_float_tensor(values, f"scores[{name!r}]"), len(examples), name)
                  for name, values in named.items()}
        self.lines: List[TokenLine] = []
        for row, example in enumerate(examples):
            line_scores = {name: self._real(values[row], example, None if mask is None else mask[row], row, name)
                           for name, values in tables.items()}
            shown = self._real_tokens(example, None if mask is None else mask[row])
            special = [token in specials for token in shown]
            sums = {name: float(values.double().sum()) for name, values in line_scores.items()}
            if merge_word_pieces:
                merged = {}
                for name, values in line_scores.items():
                    words, merged[name], word_special, _ = _merge_pieces(shown, values, special)
                shown, special, line_scores = words, word_special, merged
            if hide_special:
                keep = [i for i, flag in enumerate(special) if not flag]
                shown, special = [shown[i] for i in keep], [False] * len(keep)
                line_scores = {name: values[keep] for name, values in line_scores.items()}
            self.lines.append(TokenLine(titles[row], shown, special, line_scores, sums,
                                        None if logit_values is None else float(logit_values[row])))
        scored = {name: [line.scores[name][~torch.tensor(line.special, dtype=torch.bool)] if line.tokens
                         else torch.zeros(0) for line in self.lines] for name in named}
        self.scale_mode = "per-map" if scale == "per-row" else scale
        self.scales: Dict[str, List[ColorScale]] = fit_scales(scored, self.scale_mode, signed, 100.0)

    @staticmethod
    def _batched(values: torch.Tensor, count: int, name: str) -> torch.Tensor:
        if values.dim() == 1 and count == 1:
            values = values.unsqueeze(0)
        if values.dim() != 2 or values.shape[0] != count:
            raise InputError(f"scores[{name!r}] has shape {tuple(values.shape)}; expected ({count}, S): one row of "
                             "token scores per example (return_tokens=True).")
        return values

    @staticmethod
    def _real(values: torch.Tensor, tokens: List[str], mask, row: int, name: str) -> torch.Tensor:
        if mask is not None:
            if mask.shape != values.shape:
                raise InputError(f"attention_mask row {row} has {mask.shape[0]} positions but scores[{name!r}] has "
                                 f"{values.shape[0]}; expected the same (B, S).")
            values = values[mask]
        if len(tokens) not in (len(values), len(mask) if mask is not None else -1):
            raise InputError(f"example {row} has {len(tokens)} tokens but scores[{name!r}] has {len(values)} real "
                             "positions; expected one score per token (pass attention_mask for padded batches).")
        return values

    @staticmethod
    def _real_tokens(tokens: List[str], mask) -> List[str]:
        if mask is not None and len(tokens) == len(mask) and len(tokens) != int(mask.sum()):
            return [token for token, keep in zip(tokens, mask.tolist()) if keep]
        return tokens

    def conservation_caption(self, row: int, name: str) -> str:
        """``sum of relevance 1.83 · logit 2.10`` for a signed line (the logit when given); "" for
        an unsigned one (a sum of unsigned scores is no amount of evidence)."""
        line = self.lines[row]
        if not self.scales[name][row].signed or line.sums is None:
            return ""
        caption = f"sum of relevance {line.sums[name]:.3g}"
        return caption + (f" · logit {line.logit:.3g}" if line.logit is not None else "")

    def _legend_words(self) -> str:
        names = [name for name in self.scales for _ in self.scales[name]]
        return legend_words([scale for group in self.scales.values() for scale in group], names)

    def _cells(self, line: TokenLine, name: str, row: int) -> List[Tuple[str, str, str, float]]:
        """(token, background, text colour, raw score) per shown token."""
        scale = self.scales[name][row]
        values = line.scores[name]
        colours = scale.rgb(values)
        out = []
        for index, token in enumerate(line.tokens):
            if line.special[index]:
                out.append((token, "transparent", "#888", float(values[index])))
            else:
                normalized = float(scale.normalized(values[index]))
                out.append((token, css_rgb(colours[index]), text_colour(normalized), float(values[index])))
        return out

    def _body_html(self) -> str:
        parts = [f"<h3>{escape(self.title)}</h3>"]
        for row, line in enumerate(self.lines):
            if line.title:
                parts.append(f"<h4 style='margin:8px 0 2px'>{escape(line.title)}</h4>")
            parts.append("<table>")
            for name in self.lines[0].scores:
                scale = self.scales[name][row]
                spans = "".join(
                    f"<span class='tok{' special' if line.special[i] else ''}' style='background:{background};"
                    f"color:{colour}' title='{score:+.4g}'>{escape(token)}</span>"
                    for i, (token, background, colour, score) in enumerate(self._cells(line, name, row)))
                limit = f"±{scale.limit:.3g}" if scale.signed else f"0..{scale.limit:.3g} (unsigned)"
                label = f"{escape(name)}<br><span class='legend'>{limit}</span>" if name else \
                    f"<span class='legend'>{limit}</span>"
                caption = self.conservation_caption(row, name)
                caption = f" <span class='legend'>{escape(caption)}</span>" if caption else ""
                parts.append(f"<tr><td class='name'>{label}</td><td style='text-align:left'>{spans}{caption}</td></tr>")
            parts.append("</table>")
        if self.scale_mode == "per-map":
            parts.append("<div class='legend'>Each line is scaled by its largest |score| (its range is next to "
                         f"it). {escape(self._legend_words())} Grey dashed: special tokens, not coloured.</div>")
        else:
            shared = self.scale_mode != "per-method"  # "shared" or a number: one limit for every line
            parts.append(legend_html(common_scale(self.scales) if shared else next(iter(self.scales.values()))[0],
                                     "" if shared else "(first method's scale)"))
            parts.append(f"<div class='legend'>{escape(self._legend_words())}</div>")
        return "".join(parts)

    def _figure(self):
        names = list(self.lines[0].scores)
        label_chars = max(len(name) for name in names) + 9
        captions = {(row, name): self.conservation_caption(row, name) for row in range(len(self.lines))
                    for name in names}
        caption_chars = max(len(caption) + 2 for caption in captions.values())
        line_chars = label_chars + caption_chars + max(sum(len(token) + 1 for token in line.tokens)
                                                       for line in self.lines)
        lines = len(self.lines) * (len(names) + (1 if any(line.title for line in self.lines) else 0)) + 1
        footer = self._legend_words() + " Range beside each line; dashed: special (not scored)."
        width = min(max(0.075 * line_chars, 0.062 * len(footer)) + 0.5, 40)
        figure = agg_figure(width, 0.28 * lines + 0.3)
        axis = figure.add_axes((0, 0, 1, 1))
        axis.set_axis_off()
        char, step = 0.075 / width, 1.0 / lines  # a character's advance: 0.075 inch, as a figure fraction
        y = 1.0 - step / 2
        for row, line in enumerate(self.lines):
            if line.title:
                axis.text(0.005, y, plain_text(line.title), fontsize=8, weight="bold", va="center", family="monospace")
                y -= step
            for name in names:
                scale = self.scales[name][row]
                limit = f"±{scale.limit:.2g}" if scale.signed else f"0..{scale.limit:.2g}"
                axis.text(0.005, y, plain_text(f"{name} {limit}".strip()), fontsize=7, va="center", family="monospace")
                x = label_chars * char
                for token, background, colour, _ in self._cells(line, name, row):
                    style = dict(facecolor="none", edgecolor="#bbbbbb", linestyle="--", pad=0.5) \
                        if background == "transparent" else dict(facecolor=_rgb_fraction(background),
                                                                 edgecolor="none", pad=0.5)
                    axis.text(x, y, plain_text(token), fontsize=7, va="center", family="monospace",
                              color=colour, bbox=style)
                    x += (len(token) + 1) * char
                if captions[(row, name)]:
                    axis.text(x + char, y, plain_text(captions[(row, name)]), fontsize=6, va="center",
                              family="monospace", color="#444")
                y -= step
        axis.text(0.005, step / 2, footer, fontsize=6, va="center", family="monospace", color="#444")
        return figure


def boolean_attention_mask(attention_mask) -> Optional[torch.Tensor]:
    """The (B, S) mask as booleans, from a tensor, array or list, or from the ``attention_mask``
    entry of a tokenizer's ``BatchEncoding`` or of a ``{"attention_mask": ...}`` dict."""
    if attention_mask is None:
        return None
    if isinstance(attention_mask, Mapping):
        if "attention_mask" not in attention_mask:
            raise InputError(f"attention_mask is a {type(attention_mask).__name__} with keys "
                             f"{sorted(map(str, attention_mask))} but no 'attention_mask' entry; expected the (B, S) "
                             "mask itself, or the tokenizer's output (whose 'attention_mask' entry is taken).")
        attention_mask = attention_mask["attention_mask"]
    try:
        mask = torch.as_tensor(attention_mask)
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputError(f"attention_mask: expected a (B, S) tensor of 0/1 (or the tokenizer's output), got "
                         f"{type(attention_mask).__name__} ({error}).") from None
    return mask.bool()


def _rgb_fraction(css: str) -> Tuple[float, float, float]:
    r, g, b = (int(v) / 255 for v in css[4:-1].split(","))
    return (r, g, b)
