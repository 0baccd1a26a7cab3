"""Token heatmaps: signed colours, padding, special tokens, the word-piece merge rule,
escaping of input text, and files written."""
from __future__ import annotations

import re

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.visualization import TokenHeatmap, merge_word_pieces

pytest.importorskip("matplotlib")

XSS = "<img src=x onerror=alert(1)>"
SPECIAL = {"[CLS]", "[SEP]", "[PAD]"}


def backgrounds(html: str):
    """(token text, (r, g, b) or None) per token span, in order."""
    spans = re.findall(r"<span class='tok( special)?' style='background:([^;]+);[^']*' title='[^']*'>(.*?)</span>",
                       html)
    out = []
    for special, background, text in spans:
        colour = None if background == "transparent" else tuple(int(v) for v in background[4:-1].split(","))
        out.append((text, colour))
    return out


def test_negative_words_are_blue_positive_red_zero_white_and_specials_uncoloured():
    tokens = ["[CLS]", "good", "bad", "the", "[SEP]"]
    scores = torch.tensor([[5.0, 1.0, -1.0, 0.0, 0.3]])
    heatmap = TokenHeatmap(tokens, {"lrp": scores}, special_tokens=SPECIAL)
    cells = dict(backgrounds(heatmap.to_html()))
    r, g, b = cells["good"]
    assert r > g + 60 and r > b + 60
    r, g, b = cells["bad"]
    assert b > r + 60                              # strongly negative is blue, not neutral
    assert cells["the"] == (255, 255, 255)
    assert cells["[CLS]"] is None and cells["[SEP]"] is None
    # The CLS score (5.0) is left out of the scale: the words set it.
    assert heatmap.scales["lrp"][0].limit == 1.0 and heatmap.scales["lrp"][0].signed


def test_hide_special_drops_them_and_padding_is_read_from_the_mask_left_or_right():
    tokens = [["[CLS]", "a", "b", "[SEP]"], ["[PAD]", "[CLS]", "c", "[SEP]"]]
    scores = torch.tensor([[0.1, 1.0, -2.0, 0.2], [9.0, 0.3, 4.0, 0.5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    heatmap = TokenHeatmap(tokens, scores, attention_mask=mask, special_tokens=SPECIAL, hide_special=True)
    assert [line.tokens for line in heatmap.lines] == [["a", "b"], ["c"]]
    assert heatmap.lines[1].scores[""].tolist() == [4.0]
    # Tokens given without padding (only the real ones) work with the mask too.
    unpadded = TokenHeatmap([["[CLS]", "a", "b", "[SEP]"], ["[CLS]", "c", "[SEP]"]], scores, attention_mask=mask)
    assert unpadded.lines[1].tokens == ["[CLS]", "c", "[SEP]"]


def test_word_pieces_merge_by_summing_their_scores_and_keep_the_total():
    tokens = ["[CLS]", "un", "##believ", "##able", "film", "[SEP]"]
    scores = torch.tensor([0.5, 0.25, -1.0, 2.0, 0.125, 0.0])
    special = [token in SPECIAL for token in tokens]
    words, merged, flags, groups = merge_word_pieces(tokens, scores, special)
    assert words == ["[CLS]", "unbelievable", "film", "[SEP]"]
    assert merged.tolist() == [0.5, 1.25, 0.125, 0.0]
    assert groups == [[0], [1, 2, 3], [4], [5]] and flags == [True, False, False, True]
    assert merged.sum() == scores.sum()
    heatmap = TokenHeatmap(tokens, scores[None], special_tokens=SPECIAL, merge_word_pieces=True)
    assert heatmap.lines[0].tokens == words


@pytest.mark.parametrize("tokens, words", [
    (["<s>", "▁The", "▁un", "believ", "able", "▁film", "</s>"], ["<s>", "The", "unbelievable", "film", "</s>"]),
    (["Ġthe", "Ġun", "bel", "Ġfilm"], ["the", "unbel", "film"]),
])
def test_word_start_marked_vocabularies_merge_unmarked_pieces_into_the_previous_word(tokens, words):
    special = [token in {"<s>", "</s>"} for token in tokens]
    merged_words, merged, _, _ = merge_word_pieces(tokens, torch.ones(len(tokens)), special)
    assert merged_words == words and merged.sum() == len(tokens)


def test_input_text_and_names_are_escaped():
    heatmap = TokenHeatmap([["[CLS]", XSS, "ok"]], {XSS: torch.tensor([[0.0, 1.0, -1.0]])}, titles=[XSS],
                           special_tokens={"[CLS]"}, title=XSS)
    page = heatmap.to_html(standalone=True)
    assert XSS not in page and page.count("&lt;img src=x onerror=alert(1)&gt;") == 5  # title, heading, line title, name, token
    assert "<script" not in page.lower()


def test_refusals_say_what_was_received_and_expected():
    with pytest.raises(InputError, match=r"has 3 tokens but scores\[''\] has 4 real positions"):
        TokenHeatmap(["a", "b", "c"], torch.ones(1, 4))
    with pytest.raises(InputError, match=r"shape \(3, 4\); expected \(2, S\)"):
        TokenHeatmap([["a"] * 4, ["b"] * 4], torch.ones(3, 4))
    with pytest.raises(InputError, match="NaN or infinite"):
        TokenHeatmap(["a", "b"], torch.tensor([[1.0, float("nan")]]))


def test_shared_scale_spans_every_method_and_per_row_each_line(tmp_path):
    scores = {"big": torch.tensor([[4.0, 2.0]]), "small": torch.tensor([[1.0, 0.5]])}
    per_row = TokenHeatmap(["a", "b"], scores)
    shared = TokenHeatmap(["a", "b"], scores, scale="shared")
    assert per_row.scales["small"][0].limit == 1.0 and shared.scales["small"][0].limit == 4.0
    png = shared.save(tmp_path / "tokens.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in shared.save(tmp_path / "tokens.svg").read_text()
    assert shared.save(tmp_path / "tokens.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
