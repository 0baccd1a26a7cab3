"""The generation views: GenerationMatrix, GenerationText and generation_report.

Results are built directly (GenerationResult of chosen numbers) so that every expected colour
is known; one test explains a tiny random Llama end to end. The 64 x 512 pages are opened in
headless Chromium (Debian's ``chromium`` through Playwright's ``executable_path``, as the
explorer's browser tests do), offline; those tests skip, with the reason, where either is absent."""
from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser

import pytest
import torch

from captum_transformers import GenerationResult
from captum_transformers.errors import InputError
from captum_transformers.visualization import (ColorScale, GenerationMatrix, GenerationReport, GenerationText,
                                               generation_report)
from captum_transformers.visualization.colors import css_rgb

pytest.importorskip("matplotlib")
EVIL = "<script>alert(1)</script>"
VOID = {"meta", "br", "img", "input", "hr", "link"}


def make_result(inputs, outputs, signed=True, seed=0, read=None, token_attr=None, target_attr=None):
    """A GenerationResult of random scores (non-negative when unsigned), decoder-only by default."""
    g = torch.Generator().manual_seed(seed)
    rows, read = len(outputs), list(outputs if read is None else read)
    token_attr = torch.randn(rows, len(inputs), generator=g) if token_attr is None else token_attr
    if target_attr is None:
        offset = 0 if read == list(outputs) else 1
        target_attr = torch.randn(rows, len(read), generator=g).tril(offset - 1)
    if not signed:
        token_attr, target_attr = token_attr.abs(), target_attr.abs()
    return GenerationResult(input_tokens=list(inputs), output_tokens=list(outputs), token_attr=token_attr,
                            target_attr=target_attr, target_attr_tokens=read,
                            output_probs=torch.rand(rows, generator=g), scores=torch.randn(rows, generator=g),
                            score_kind="logit", method="AttnLRP",
                            first_token_share=torch.rand(rows, generator=g), input_ids=list(range(len(inputs))),
                            output_ids=list(range(rows)), signed=signed, encoder_decoder=read != list(outputs))


class TagChecker(HTMLParser):
    """Fails on a closing tag that does not close the innermost open one; records every tag."""

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def well_formed(page: str) -> TagChecker:
    checker = TagChecker()
    checker.feed(page)
    checker.close()
    assert checker.errors == [] and checker.stack == [], (checker.errors, checker.stack)
    return checker


INPUTS = ["<s>", "the", "big", EVIL, "sat"]
OUTPUTS = ["on", EVIL, "mat"]


def test_html_is_well_formed_escaped_and_scriptless():
    result = make_result(INPUTS, OUTPUTS)
    views = [GenerationMatrix(result, title=EVIL), GenerationText(result, 2, title=EVIL),
             generation_report({EVIL: result, "other": make_result(INPUTS, OUTPUTS, seed=1)})]
    for view in views:
        for page in (view.to_html(standalone=True), view._repr_html_()):
            checker = well_formed(page)
            assert "script" not in checker.tags
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and EVIL not in page
            assert "http://" not in page and "https://" not in page  # nothing fetched


def test_matrix_holds_prompt_then_output_columns_with_the_read_cells():
    result = make_result(INPUTS, OUTPUTS)
    matrix = GenerationMatrix(result)
    assert matrix.columns == INPUTS + OUTPUTS and matrix.prompt_columns == 5
    assert torch.equal(matrix.values, torch.cat([result.token_attr, result.target_attr], 1))
    assert matrix.read[:, :5].all() and torch.equal(matrix.read[:, 5:], torch.ones(3, 3, dtype=torch.bool).tril(-1))
    page = matrix.to_html()
    assert page.count("class='c nr") == 6 and page.count("sep'") == 1 + 3 + 1  # header, rows, span header
    rows = re.findall(r"<th class='row[^']*'>([^<]*)</th>", page)
    assert rows == [f"{t} (p={float(p):.2f})" for t, p in zip(["on", "&lt;script&gt;alert(1)&lt;/script&gt;", "mat"],
                                                             result.output_probs)]
    shares = re.findall(r"<td class='share'>(\d+)%</td>", page)
    assert shares == [f"{100 * float(s):.0f}" for s in result.first_token_share]
    # An encoder-decoder's columns are the start token then the outputs: row t reads columns 0..t.
    seq2seq = GenerationMatrix(make_result(INPUTS, OUTPUTS, read=["<pad>", "on", EVIL]))
    assert torch.equal(seq2seq.read[:, 5:], torch.ones(3, 3, dtype=torch.bool).tril(0))


def test_signed_and_unsigned_legends_follow_the_result():
    signed = GenerationMatrix(make_result(INPUTS, OUTPUTS, signed=True)).to_html()
    unsigned = GenerationMatrix(make_result(INPUTS, OUTPUTS, signed=False)).to_html()
    assert "Signed scores: red = for the generated token" in signed and "(blue against, white 0, red for)" in signed
    assert "Unsigned scores: darker red = more relevant" in unsigned and "unsigned: no direction" in unsigned
    assert "blue" not in unsigned and "unsigned" not in signed
    # An all-positive signed result keeps its signed scale (the method decides, not the data).
    positive = make_result(INPUTS, OUTPUTS, signed=True, token_attr=torch.rand(3, 5))
    assert GenerationMatrix(positive).scales[0].signed
    negative = make_result(INPUTS, OUTPUTS, signed=False)
    negative.token_attr[0, 1] = -1.0
    with pytest.raises(InputError, match="signed=False"):
        GenerationMatrix(negative)


def test_special_and_skipped_tokens_are_grey_and_out_of_the_scale():
    result = make_result(INPUTS, OUTPUTS)
    result.token_attr[:, 0] = 100.0  # an attention sink on <s>
    result.token_attr[:, 1] = -50.0  # "the", skipped
    matrix = GenerationMatrix(result, skip=["the"])
    assert matrix.greyed.tolist() == [True, True, False, False, False, False, False, False]
    assert matrix.scales[0].limit < 10
    page = matrix.to_html()
    assert page.count("class='c sp") == 2 * 3 and "<th class='ch spt'><span>&lt;s&gt;</span>" in page
    assert not GenerationMatrix(result).greyed[1]  # not skipped by default
    colours = matrix.cell_rgb()
    assert colours[:, :2].eq(torch.tensor([225, 225, 225], dtype=torch.uint8)).all()
    # A tokenizer's own special tokens, when given, replace the shape-based guess.
    assert GenerationMatrix(result, special_tokens=["sat"]).greyed.tolist()[:5] == [False, False, False, False, True]
    with pytest.raises(InputError, match="skip"):
        GenerationMatrix(result, skip="the")


def test_merge_words_sums_the_pieces():
    inputs, outputs = ["[CLS]", "un", "##believ", "##able", "cat"], ["play", "##ing", "now"]
    result = make_result(inputs, outputs)
    matrix = GenerationMatrix(result, merge_words=True)
    assert matrix.columns == ["[CLS]", "unbelievable", "cat", "playing", "now"] and matrix.prompt_columns == 3
    assert torch.allclose(matrix.values[:, 1], result.token_attr[:, 1:4].sum(1))
    assert torch.allclose(matrix.values[:, 3], result.target_attr[:, :2].sum(1))
    assert matrix.read[:, 3].tolist() == [False, True, True]  # read once its first piece was read
    text = GenerationText(result, output_index=2, merge_words=True)
    assert [c.token for c in text.prompt_cells] == ["[CLS]", "unbelievable", "cat"]
    assert text.prompt_cells[1].score == pytest.approx(float(result.token_attr[2, 1:4].sum()), abs=1e-6)
    assert [c.token for c in text.output_cells] == ["playing", "now"]
    assert text.output_cells[0].score == pytest.approx(float(result.target_attr[2, :2].sum()), abs=1e-6)


SPAN = re.compile(r"<span class='(tok[^']*)' style='([^']*)' title='[^']*'>([^<]*)</span>")


def test_text_view_colours_exactly_the_chosen_rows_evidence():
    outputs = ["on", "the", "big", "mat", "now"]
    result = make_result(INPUTS, outputs, seed=3)
    for index in range(len(outputs)):
        view = GenerationText(result, output_index=index)
        evidence = torch.cat([result.token_attr[index, 1:], result.target_attr[index, :index]])  # <s> greyed
        scale = ColorScale.fit([evidence], signed=True)
        expected = [css_rgb(c) for c in scale.rgb(evidence)]
        spans = SPAN.findall(view.to_html())
        assert len(spans) == len(INPUTS) + len(outputs)
        backgrounds = [re.search(r"background:(rgb\([^)]*\))", style) for _, style, _ in spans]
        shown = [b.group(1) for b in backgrounds if b]
        assert shown == expected  # the prompt's words, then exactly the outputs before y_t
        assert backgrounds[0] is None and all(b is None for b in backgrounds[len(INPUTS) + index:])
        chosen = [token for _, style, token in spans if "outline" in style]
        assert chosen == [outputs[index]]
    assert GenerationText(result, -1).output_index == 4
    with pytest.raises(InputError, match="output_index"):
        GenerationText(result, 5)


def test_pngs_and_svgs_are_written(tmp_path):
    result = make_result(INPUTS, OUTPUTS)
    views = {"matrix": GenerationMatrix(result, scale="per-row"), "text": GenerationText(result, 1, merge_words=True),
             "report": generation_report({"a": result, "b": make_result(INPUTS, OUTPUTS, signed=False)}),
             "report_text": generation_report({"a": result, "b": make_result(INPUTS, OUTPUTS, seed=2)}, output_index=2)}
    for name, view in views.items():
        png, svg, page = (view.save(tmp_path / f"{name}.{ext}") for ext in ("png", "svg", "html"))
        assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 2000
        assert "<svg" in svg.read_text() and svg.stat().st_size > 2000
        assert page.read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(InputError, match=r"\.html, \.png or \.svg"):
        views["matrix"].save(tmp_path / "matrix.pdf")


def test_report_and_refusals():
    a, b = make_result(INPUTS, OUTPUTS), make_result(INPUTS, OUTPUTS, signed=False, seed=1)
    report = generation_report({"lrp": a, "attention": b}, merge_words=True)
    assert isinstance(report, GenerationReport) and list(report.views) == ["lrp", "attention"]
    assert all(isinstance(v, GenerationMatrix) for v in report.views.values())
    page = report.to_html()
    assert "Signed scores" in page and "Unsigned scores" in page
    with pytest.raises(InputError, match="same generation"):
        generation_report({"lrp": a, "other": make_result(INPUTS, ["on", "a", "mat"])})
    with pytest.raises(InputError, match="non-empty"):
        generation_report({})
    span = make_result(INPUTS, ["on+the"], read=["on", "the"], target_attr=torch.randn(1, 2))
    assert GenerationMatrix(span).read.all()
    with pytest.raises(InputError, match="span"):
        GenerationText(span)
    with pytest.raises(InputError, match="GenerationResult"):
        GenerationMatrix(object())
    with pytest.raises(InputError, match="shape"):
        broken = make_result(INPUTS, OUTPUTS)
        broken.first_token_share = torch.zeros(2)
        GenerationMatrix(broken)


def test_a_tiny_llama_explained_end_to_end():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from captum_transformers import AttnLRP, GenerationAttribution

    words = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "big"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager", eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).double().eval()
    result = GenerationAttribution(AttnLRP(model), tokenizer).attribute("the big cat sat", target="on the mat")
    matrix = GenerationMatrix(result, special_tokens=tokenizer)
    assert matrix.columns == ["<s>", "the", "big", "cat", "sat", "on", "the", "mat"]
    assert matrix.greyed.tolist() == [True] + [False] * 7
    assert torch.allclose(matrix.values, torch.cat([result.token_attr, result.target_attr], 1).float())
    assert GenerationText(result, 2).output_cells[-1].chosen


# -- 64 x 512 in headless Chromium, offline ----------------------------------------------
CHROMIUM = os.environ.get("CAPTUM_EXPLORER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    if CHROMIUM is None:
        pytest.skip("no Chromium binary found (apt-get install -y chromium, or set CAPTUM_EXPLORER_CHROMIUM); the "
                    "browser tests need one")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_offline(browser, path):
    """``path`` opened with every network request refused and recorded, console errors too."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors, requests = [], []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("dialog", lambda dialog: (errors.append("dialog: " + dialog.message), dialog.dismiss()))
    page.route("**/*", lambda route: (requests.append(route.request.url), route.abort())
               if not route.request.url.startswith("file:") else route.continue_())
    page.goto(path.as_uri())
    return page, errors, requests


def test_64_by_512_renders_in_chromium(browser, tmp_path):
    inputs = ["<s>", EVIL] + [f"w{i}" for i in range(510)]
    outputs = [f"o{i}" for i in range(63)] + ["</s>"]
    result = make_result(inputs, outputs, seed=5)
    matrix = GenerationMatrix(result).save(tmp_path / "matrix.html")
    page, errors, requests = open_offline(browser, matrix)
    assert page.locator("table.gm tbody tr").count() == 64
    assert page.locator("table.gm tbody tr").first.locator("td.c").count() == 512 + 64
    assert page.locator("table.gm thead th.ch").nth(1).text_content() == EVIL  # shown as text, not run
    assert page.evaluate("document.scripts.length") == 0
    first = page.locator("table.gm tbody tr").first.locator("td.c").nth(2)
    assert first.evaluate("cell => getComputedStyle(cell).backgroundColor") == css_rgb(
        matrix_colour := GenerationMatrix(result).cell_rgb()[0, 2]).replace(",", ", ")
    assert matrix_colour.tolist() != [255, 255, 255]
    page.close()
    text = GenerationText(result, output_index=40).save(tmp_path / "text.html")
    page, text_errors, text_requests = open_offline(browser, text)
    assert page.locator("span.tok").count() == 512 + 64
    assert page.locator("span.tok[style*='outline']").text_content() == "o40"
    page.close()
    assert errors == [] and text_errors == [] and requests == [] and text_requests == []


def test_the_layout_comes_from_the_result_not_from_token_spellings():
    # An encoder-decoder whose start token is spelled like the outputs: row 0 read the start token.
    result = make_result(["x"], ["a", "a", "a"], read=["a", "a", "a"])
    result.encoder_decoder = True
    from captum_transformers.visualization.generation import checked_parts, read_mask
    assert read_mask(checked_parts(result)).tolist() == [[True, False, False], [True, True, False], [True, True, True]]


# -- the report as a page: wrapped at the window, one legend, blank panels said (issue 41) --
def _many_methods(blank: str = "grad-cam"):
    inputs = ["<s>"] + [f"w{i}" for i in range(24)]
    outputs = [f"o{i}" for i in range(6)]
    results = {}
    for k, name in enumerate(["raw", "rollout", blank, "partial", "lrp", "attn-lrp", "gi", "ah", "ah-ln",
                              "generic", "relevance"]):
        result = make_result(inputs, outputs, signed=k % 2 == 0, seed=k)
        if name == blank:
            result = make_result(inputs, outputs, signed=False, token_attr=torch.zeros(6, 25),
                                 target_attr=torch.zeros(6, 6))
        results[name] = result
    return results


def test_a_report_states_the_legend_once_and_says_a_blank_panel_is_blank():
    results = _many_methods()
    for index in (None, 0):
        page = generation_report(results, output_index=index).to_html()
        assert page.count("Signed scores") == 1 and page.count("Unsigned scores") == 1  # not once per panel
        assert page.count("Nothing coloured") == 1  # the blank method only, instead of a 0..1 bar
        assert "flex-wrap:wrap" in page and "<table><tr><td" not in page
    text = GenerationText(results["grad-cam"], 0)
    assert text.blank and "Nothing coloured" in text.to_html() and "class='bar'" not in text._body_html()
    assert not GenerationText(results["lrp"], 0).blank
    matrix = GenerationMatrix(results["grad-cam"])
    assert all(matrix.row_label(row).endswith("all 0") for row in range(6))
    assert "Nothing coloured" in matrix.to_html()
    half = make_result(["a", "b"], ["x", "y"], signed=False, token_attr=torch.tensor([[0.0, 0.0], [1.0, 2.0]]),
                       target_attr=torch.zeros(2, 2))
    labels = [GenerationMatrix(half).row_label(row) for row in range(2)]
    assert labels[0].endswith("all 0") and not labels[1].endswith("all 0")
    GenerationText(results["grad-cam"], 0).to_png()  # the drawing says it too, without a colour bar


@pytest.mark.parametrize("index", [None, 2])
def test_a_report_of_eleven_methods_fits_a_1280_pixel_window(browser, tmp_path, index):
    path = generation_report(_many_methods(), output_index=index).save(tmp_path / "report.html")
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(path.as_uri())
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    page.close()
