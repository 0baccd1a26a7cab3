"""``captum-transformers explain`` draws with the visualization helpers: signed token strips
(a negative word is blue, not neutral) and ``--save-scores`` writing the raw scores as JSON."""
from __future__ import annotations

import json
import re

import pytest
import torch

from captum_transformers.cli import main
from captum_transformers.cli.scores_file import SCHEMA

pytest.importorskip("matplotlib")
transformers = pytest.importorskip("transformers")

WORDS = ["a", "dull", "funny", "film", "gri", "##pping", ","]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny random BERT classifier and a WordPiece tokenizer, saved as a local model folder."""
    folder = tmp_path_factory.mktemp("bert")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    tokenizer = transformers.BertTokenizer(str(folder / "vocab.txt"))
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=len(WORDS) + 5, num_labels=2, max_position_embeddings=32,
                                     initializer_range=0.3)  # larger weights: word scores well above rounding
    transformers.BertForSequenceClassification(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


def _strip_lines(page: str):
    """{method name: [(token, (r, g, b) or None), ...]} of the first example's lines."""
    first_table = page.split("<table>")[1]
    lines = {}
    for name, spans in re.findall(r"<td class='name'>([^<]*)<br>.*?</td><td style='text-align:left'>(.*?)</td>",
                                  first_table):
        cells = re.findall(r"style='background:([^;]+);[^']*' title='[^']*'>(.*?)</span>", spans)
        lines[name] = [(token, None if colour == "transparent" else
                        tuple(int(v) for v in colour[4:-1].split(","))) for colour, token in cells]
    return lines


def test_text_strips_are_signed_and_the_scores_file_holds_the_raw_scores(text_model, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["explain", "--model", str(text_model), "--text", "a gripping, funny film", "--text", "dull",
                 "--method", "conservative-lrp", "--method", "generic-attention", "--target", "0", "--save-scores",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'scores.json'}" in printed and f"wrote {out / 'explanations.html'}" in printed
    assert (out / "explanations.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / "scores.json").read_text())
    assert saved["schema"] == SCHEMA and saved["modality"] == "text" and saved["target"] == 0
    first = saved["examples"][0]
    assert first["tokens"] == ["[CLS]", "a", "gri", "##pping", ",", "funny", "film", "[SEP]"]
    assert first["special"] == [True] + [False] * 6 + [True]
    assert saved["examples"][1]["tokens"] == ["[CLS]", "dull", "[SEP]"]
    lrp = saved["methods"]["conservative-lrp"]
    assert lrp["shape"] == [2, None] and [len(row) for row in lrp["scores"]] == [8, 3]

    lines = _strip_lines((out / "explanations.html").read_text(encoding="utf-8"))
    scores = lrp["scores"][0]
    limit = max(abs(s) for s, special in zip(scores, first["special"]) if not special)
    negatives = 0
    for (token, colour), score, special in zip(lines["conservative-lrp"], scores, first["special"]):
        if special:
            assert colour is None
            continue
        r, g, b = colour
        if score < -0.3 * limit:      # clearly negative: blue, where the old strips drew white
            assert b > r + 30, (token, score, colour)
            negatives += 1
        elif score > 0.3 * limit:
            assert r > b + 30, (token, score, colour)
    assert negatives, f"the random model gave no clearly negative token: {scores}"


def test_image_scores_file_equals_the_methods_own_output(tmp_path, capsys):
    pytest.importorskip("timm")
    from captum_transformers.methods.catalog import build_method
    from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
    from captum_transformers.tasks.digits.model import load_digit_model

    assert main(["explain", "--samples", "2", "--method", "attn-lrp", "--method", "rollout", "--save-scores",
                 "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "scores.json").read_text())
    assert saved["modality"] == "image" and saved["methods"]["attn-lrp"]["shape"] == [2, 3, 32, 32]
    canvases = digit_canvases(split="test", variant="one", n=2, seed=0)
    assert [example["true"] for example in saved["examples"]] == canvases.labels.tolist()
    target = torch.tensor([example["explained_class"] for example in saved["examples"]])
    expected = build_method("attn-lrp", load_digit_model()).attribute(normalize(canvases.images), target=target)
    assert torch.allclose(torch.tensor(saved["methods"]["attn-lrp"]["scores"]), expected, atol=1e-6)
    assert float(torch.tensor(saved["methods"]["attn-lrp"]["scores"]).min()) < 0  # signed, not clamped
    page = (tmp_path / "out" / "explanations.html").read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 2 + 2 * 2 and "<script" not in page


def test_without_save_scores_no_scores_file_is_written(tmp_path, capsys):
    pytest.importorskip("timm")
    assert main(["explain", "--samples", "1", "--method", "rollout", "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "scores.json").exists()
    assert (tmp_path / "out" / "explanations.html").exists()
