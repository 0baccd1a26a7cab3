"""What the pictures say next to the colours: signed vs unsigned legends, the relevance sum
beside the explained logit, and the attention_mask forms TokenHeatmap accepts."""
from __future__ import annotations

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.visualization import ColorScale, ExplanationGrid, TokenHeatmap
from captum_transformers.visualization.colors import SIGNED_WORDS, UNSIGNED_WORDS
from captum_transformers.visualization.images import image_overlay

pytest.importorskip("matplotlib")

TOKENS = ["[CLS]", "not", "depressing", "[SEP]"]
SIGNED = torch.tensor([[0.5, 1.0, -2.0, 0.25]])     # sum -0.25
UNSIGNED = torch.tensor([[0.1, 0.2, 0.9, 0.05]])    # a GenericAttention-like map: no sign


def _text(picture) -> str:
    return picture.to_html()


# -- unsigned maps do not say "red = for the class" ---------------------------------------------
def test_unsigned_token_map_says_darker_is_more_relevant_not_for_the_class():
    html = _text(TokenHeatmap(TOKENS, {"generic-attention": UNSIGNED}, special_tokens={"[CLS]", "[SEP]"}))
    assert UNSIGNED_WORDS in html and "no direction" in html
    assert "red for" not in html and "red = for" not in html and "against" not in html.replace(
        "neither for nor against", "")


def test_signed_token_map_keeps_red_for_blue_against_and_mixed_maps_name_the_unsigned_ones():
    signed = _text(TokenHeatmap(TOKENS, {"attn-lrp": SIGNED}))
    assert SIGNED_WORDS in signed and UNSIGNED_WORDS not in signed
    mixed = _text(TokenHeatmap(TOKENS, {"attn-lrp": SIGNED, "rollout": UNSIGNED}))
    assert SIGNED_WORDS in mixed and "Unsigned maps (rollout)" in mixed
    shared = _text(TokenHeatmap(TOKENS, {"rollout": UNSIGNED}, scale="shared"))
    assert UNSIGNED_WORDS in shared and "unsigned: no direction" in shared  # the colour bar's words too


def test_unsigned_image_maps_and_grid_say_what_they_are(tmp_path):
    images = torch.full((1, 3, 8, 8), 0.5)
    grid = ExplanationGrid(images, {"rollout": torch.rand(1, 8, 8)})
    html = grid.to_html()
    assert UNSIGNED_WORDS in html and "red marks relevance for" not in html
    signed_grid = ExplanationGrid(images, {"lrp": torch.randn(1, 8, 8)})
    assert SIGNED_WORDS in signed_grid.to_html()
    assert "unsigned: no direction" in image_overlay(images[0], torch.rand(8, 8)).to_html()
    assert grid.save(tmp_path / "grid.png").stat().st_size > 0


# -- the relevance sum next to the logit ---------------------------------------------------------
def test_token_lines_show_the_relevance_sum_next_to_the_given_logit(tmp_path):
    heatmap = TokenHeatmap(TOKENS, {"attn-lrp": SIGNED, "rollout": UNSIGNED}, special_tokens={"[CLS]", "[SEP]"},
                           hide_special=True, logits=torch.tensor([2.1]))
    # The sum runs over every real position, special tokens included, even when they are hidden.
    assert heatmap.conservation_caption(0, "attn-lrp") == "sum of relevance -0.25 · logit 2.1"
    assert heatmap.conservation_caption(0, "rollout") == ""          # unsigned: no sum shown
    assert "sum of relevance -0.25 · logit 2.1" in heatmap.to_html()
    assert heatmap.save(tmp_path / "t.png").stat().st_size > 0
    without = TokenHeatmap(TOKENS, {"attn-lrp": SIGNED})
    assert without.conservation_caption(0, "attn-lrp") == "sum of relevance -0.25"
    with pytest.raises(InputError, match="one explained logit per example"):
        TokenHeatmap(TOKENS, {"attn-lrp": SIGNED}, logits=[1.0, 2.0])


def test_padded_rows_sum_only_their_real_positions():
    scores = torch.tensor([[1.0, 2.0, 30.0], [0.5, -1.0, 0.25]])
    heatmap = TokenHeatmap([["a", "b", "[PAD]"], ["c", "d", "e"]], {"m": scores},
                           attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]), logits=[3.0, -0.25])
    assert heatmap.conservation_caption(0, "m") == "sum of relevance 3 · logit 3"
    assert heatmap.conservation_caption(1, "m") == "sum of relevance -0.25 · logit -0.25"


def test_grid_and_report_show_the_sum_next_to_the_model_logit(tmp_path):
    images = torch.full((2, 3, 8, 8), 0.5)
    maps = torch.zeros(2, 3, 8, 8)
    maps[0, 0, 0, 0], maps[0, 1, 2, 2], maps[1, 2, 5, 5] = 1.5, -0.5, -2.0
    grid = ExplanationGrid(images, {"conservative-lrp": maps, "rollout": torch.rand(2, 8, 8)},
                           logits=[1.0, -2.0])
    assert grid.conservation_caption("conservative-lrp", 0) == "sum of relevance 1 · logit 1"
    assert grid.conservation_caption("conservative-lrp", 1) == "sum of relevance -2 · logit -2"
    assert grid.conservation_caption("rollout", 0) == ""
    assert "sum of relevance 1 · logit 1" in grid.to_html()
    assert grid.save(tmp_path / "grid.png").stat().st_size > 0
    overlay = image_overlay(images[0], maps[0], logit=1.0)
    assert overlay.caption == "sum of relevance 1 · logit 1"

    from hf_models import CASES
    from captum_transformers.visualization.grid import report
    model = CASES["vit"].model()
    pixels = CASES["vit"].inputs()[0]
    drawn = report(model, pixels, methods=["attn-lrp"], images=torch.rand(pixels.shape))
    with torch.no_grad():
        expected = model(pixels).logits.max(-1).values
    assert drawn.logits == pytest.approx(expected.tolist(), rel=1e-5)
    assert f"logit {expected[0].item():.3g}" in drawn.conservation_caption("attn-lrp", 0)


# -- attention_mask in the forms the README and tokenizers give it -------------------------------
def test_token_heatmap_takes_the_attention_mask_of_a_dict_or_batch_encoding():
    transformers = pytest.importorskip("transformers")
    scores = torch.tensor([[1.0, 2.0, 9.0], [0.5, -1.0, 0.25]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tokens = [["a", "b", "[PAD]"], ["c", "d", "e"]]
    expected = TokenHeatmap(tokens, {"m": scores}, attention_mask=mask)
    for given in ({"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": mask},
                  transformers.BatchEncoding({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                              "attention_mask": mask})):
        heatmap = TokenHeatmap(tokens, {"m": scores}, attention_mask=given)
        assert [line.tokens for line in heatmap.lines] == [line.tokens for line in expected.lines] == [
            ["a", "b"], ["c", "d", "e"]]
    with pytest.raises(InputError, match="no 'attention_mask' entry"):
        TokenHeatmap(tokens, {"m": scores}, attention_mask={"input_ids": mask})


# -- signed or not is decided per METHOD, never by the scale or the data ---------------------------
POSITIVE = torch.tensor([[0.5, 1.0, 2.0, 0.25]])    # a signed method's line that happens to hold no negative


@pytest.mark.parametrize("scale", ["shared", 3.0])
def test_a_shared_limit_leaves_unsigned_maps_unsigned_and_without_a_sum(scale):
    images = torch.full((2, 3, 8, 8), 0.5)
    signed_maps = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))
    grid = ExplanationGrid(images, {"generic-attention": torch.rand(2, 8, 8), "attn-lrp": signed_maps},
                           scale=scale, logits=[9.47, 1.0])
    for row in range(2):
        assert not grid.scales["generic-attention"][row].signed and grid.scales["attn-lrp"][row].signed
        assert grid.scales["generic-attention"][row].limit == grid.scales["attn-lrp"][row].limit  # the limit IS shared
        assert grid.conservation_caption("generic-attention", row) == ""
        assert grid.conservation_caption("attn-lrp", row).startswith("sum of relevance")
    assert "Unsigned maps (generic-attention)" in grid.to_html()
    # A 4x4 rollout map (rows of 1/16: it sums to 1) next to a signed map must not read as exact conservation.
    rollout = ExplanationGrid(images[:1], {"rollout": torch.full((1, 4, 4), 1 / 16), "lrp": -torch.ones(1, 4, 4)},
                              scale=scale, logits=[1.0])
    assert rollout.conservation_caption("rollout", 0) == "" and "sum of relevance 1 · logit 1" not in rollout.to_html()
    tokens = TokenHeatmap(TOKENS, {"attn-lrp": SIGNED, "rollout": UNSIGNED}, scale=scale, logits=[2.1])
    assert tokens.conservation_caption(0, "rollout") == "" and not tokens.scales["rollout"][0].signed
    assert tokens.conservation_caption(0, "attn-lrp") == "sum of relevance -0.25 · logit 2.1"
    assert "Unsigned maps (rollout)" in tokens.to_html()


def test_an_unsigned_map_on_a_shared_limit_is_drawn_on_the_sequential_ramp():
    images = torch.full((1, 3, 8, 8), 0.5)
    shared = ExplanationGrid(images, {"rollout": torch.full((1, 8, 8), 0.5), "lrp": torch.full((1, 8, 8), -1.0)},
                             scale="shared", opacity=1.0)
    alone = ExplanationGrid(images, {"rollout": torch.full((1, 8, 8), 0.5)}, scale=1.0, opacity=1.0)
    assert shared.scales["rollout"][0] == ColorScale(False, 1.0) and shared.scales["lrp"][0] == ColorScale(True, 1.0)
    assert torch.equal(shared.cells["rollout"][0], alone.cells["rollout"][0])   # half-way red, 0..1


def test_a_signed_method_whose_maps_hold_no_negative_keeps_its_signed_legend_and_sum():
    heatmap = TokenHeatmap(TOKENS, {"attn-lrp": POSITIVE}, logits=[2.0])       # per-row: the default
    assert heatmap.scales["attn-lrp"][0].signed
    assert heatmap.conservation_caption(0, "attn-lrp") == "sum of relevance 3.75 · logit 2"
    html = heatmap.to_html()
    assert SIGNED_WORDS in html and UNSIGNED_WORDS not in html
    grid = ExplanationGrid(torch.full((1, 3, 8, 8), 0.5), {"lrp": torch.rand(1, 8, 8)}, logits=[1.0])
    assert grid.scales["lrp"][0].signed and grid.conservation_caption("lrp", 0).startswith("sum of relevance")
    # The caller says so for names the catalog does not know; without a word, a name of its own is a guess.
    said = TokenHeatmap(TOKENS, {"AttnLRP": POSITIVE, "mine": UNSIGNED}, signed={"AttnLRP": True}, logits=[2.0])
    assert said.conservation_caption(0, "AttnLRP") == "sum of relevance 3.75 · logit 2"
    assert not said.scales["mine"][0].signed                                   # guessed: no negative value
    assert TokenHeatmap(TOKENS, {"mine": POSITIVE}, signed=True).scales["mine"][0].signed


def test_signed_names_are_checked_and_an_unsigned_method_with_negatives_is_refused():
    with pytest.raises(InputError, match=r"not maps of this picture"):
        TokenHeatmap(TOKENS, {"attn-lrp": SIGNED}, signed={"atn-lrp": True})
    with pytest.raises(InputError, match=r"expected True .* or False"):
        TokenHeatmap(TOKENS, {"attn-lrp": SIGNED}, signed={"attn-lrp": 1})
    with pytest.raises(InputError, match=r"'rollout' is an unsigned method of the catalog"):
        TokenHeatmap(TOKENS, {"rollout": SIGNED})
    with pytest.raises(InputError, match=r"signed\['mine'\] is False"):
        TokenHeatmap(TOKENS, {"mine": SIGNED}, scale="shared", signed={"mine": False})


def test_report_and_the_explain_picture_label_each_map_by_its_method(tmp_path):
    from captum_transformers.cli import figures
    from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
    from captum_transformers.tasks.digits.model import load_digit_model
    from captum_transformers.visualization.grid import report

    canvases = digit_canvases("test", n=2)
    grid = report(load_digit_model(), normalize(canvases.images), images=canvases.images,
                  methods=["generic-attention", "attn-lrp"], scale="shared")
    for row in range(2):
        assert not grid.scales["generic-attention"][row].signed and grid.scales["attn-lrp"][row].signed
        assert grid.conservation_caption("generic-attention", row) == ""
        assert grid.conservation_caption("attn-lrp", row).startswith("sum of relevance")
    # The explain picture: a signed baseline ("lrp (baseline)", no catalog name) with no negative
    # value keeps its sum; rollout gets none.
    images = torch.full((1, 3, 8, 8), 0.5)
    _, page = figures.image_grid(images, {"rollout": torch.rand(1, 8, 8), "lrp": torch.rand(1, 8, 8)}, ["x"],
                                 tmp_path, logits=torch.tensor([1.5]))
    html = page.read_text(encoding="utf-8")
    assert html.count("sum of relevance") == 1 and SIGNED_WORDS in html and "Unsigned maps (rollout)" in html
    _, strips = figures.token_strips([TOKENS], {"attn-lrp": POSITIVE, "generic-attention": UNSIGNED}, ["x"],
                                     {"[CLS]", "[SEP]"}, tmp_path, logits=torch.tensor([2.0]))
    html = strips.read_text(encoding="utf-8")
    assert "sum of relevance 3.75 · logit 2" in html and html.count("sum of relevance") == 1
