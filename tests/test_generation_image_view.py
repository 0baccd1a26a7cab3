"""GenerationImageView: a vision-language model's generated token, its image map beside its text view.

On the shipped captioner (a tiny LLaVA): the drawn overlay is the result's image_attr row of the
chosen token (not another row, not another image), the view saves to PNG and HTML, and bad
requests (a result without images, an image or output index out of range, an image of another
size) are refused with what was received.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import AttnLRP, GenerationAttribution, InputError
from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
from captum_transformers.tasks.captioner.model import PROMPT, load_digit_captioner
from captum_transformers.tasks.recall.model import load_recall_model
from captum_transformers.visualization import GenerationImageView


@pytest.fixture(scope="module")
def explained():
    model, tokenizer = load_digit_captioner()
    canvas = digit_canvases("test", variant="two", n=1)
    result = GenerationAttribution(AttnLRP(model), tokenizer).attribute(PROMPT, images=normalize(canvas.images))
    return result, canvas


def test_the_view_draws_the_chosen_tokens_image_row(explained, tmp_path):
    result, canvas = explained
    for index in (0, 1, -1):
        view = GenerationImageView(result, canvas.images[0], output_index=index, outline=canvas.masks[0, 0])
        assert torch.equal(view.values, result.image_attr[index].float())
        assert view.text.output_index == index % len(result.output_tokens)
    assert not torch.equal(result.image_attr[0], result.image_attr[1])   # the rows differ, so a wrong row shows
    view.save(tmp_path / "view.png")
    view.save(tmp_path / "view.html")
    assert (tmp_path / "view.png").stat().st_size > 5000
    html = (tmp_path / "view.html").read_text()
    assert "image map of" in html and "<img" in html


def test_bad_requests_are_refused(explained):
    result, canvas = explained
    with pytest.raises(InputError, match="image_index=1"):
        GenerationImageView(result, canvas.images[0], image_index=1)
    with pytest.raises(InputError, match="output_index"):
        GenerationImageView(result, canvas.images[0], output_index=7)
    with pytest.raises(InputError):
        GenerationImageView(result, torch.rand(3, 16, 16))   # not the size of the map


def test_a_text_only_result_is_refused_with_the_way_to_get_image_maps():
    model, tokenizer = load_recall_model()
    result = GenerationAttribution(AttnLRP(model), tokenizer).attribute("c red fox ; h green cat ? h", target=" green")
    with pytest.raises(InputError, match="images=pixel_values"):
        GenerationImageView(result, torch.rand(3, 32, 32))
