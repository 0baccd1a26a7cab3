"""Gemma 3 (Gemma3ForConditionalGeneration): the pooled-image geometry, and GenerationAttribution's
image and text maps.

Float64 tiny model (tests/vlm_family_models.py): a SigLIP tower over a 4x4 patch grid pooled to
2x2 image tokens, a decoder with a sliding and a full layer, whose image tokens attend to each
other in both directions (token_type_ids). Every row of a generation explanation equals a single
call on its prefix to 1e-10 (text maps also a direct call of the method), a batch of two equals
the single calls, and the model is restored exactly.
"""
from __future__ import annotations

import pytest
import torch
from generation_models import IdTokenizer
from restore import assert_same, raising_after, snapshot
from vlm_family_models import GEMMA_SIZE, GEMMA_TOKENS, IMAGE, PATCH, build_gemma3, gemma_pixels, gemma_prompt
from vlm_generation_checks import worst_difference

from captum_transformers import (AttentionFlow, AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,
                                 GenericAttention, InputError, PartialLRP, RawAttention, TransformerLRP,
                                 TransformerRelevance)
from captum_transformers.adapters.vision_language.gemma3 import Gemma3Adapter, pooling_map
from captum_transformers.adapters.huggingface.adapter import HuggingFaceAdapter
from captum_transformers.adapters.registry import get_adapter
from captum_transformers.adapters.vision_language.base import image_token_scores, to_pixels
from captum_transformers.generation import GenerationAttribution

transformers = pytest.importorskip("transformers")

TOL = 1e-10
# The explained logits against the model's own forward: Gemma's RMSNorm computes in float32, so
# the explicit kernel's float64 rounding (1e-16) can move a float32 rounding (1e-7 relative).
SCORE_TOL = 1e-5
METHODS = {"AttnLRP": AttnLRP, "ConservativeLRP": ConservativeLRP, "TransformerLRP": TransformerLRP,
           "GenericAttention": GenericAttention, "TransformerRelevance": TransformerRelevance,
           "AttentionGradCAM": AttentionGradCAM, "PartialLRP": PartialLRP, "RawAttention": RawAttention,
           "AttentionRollout": AttentionRollout, "AttentionFlow": AttentionFlow}
PROMPT, TARGET = gemma_prompt([1, 5], [7, 8]), [9, 11, 12]
TOKENIZER = IdTokenizer()
_MODEL: list = []


def model() -> torch.nn.Module:
    if not _MODEL:
        _MODEL.append(build_gemma3())
    return _MODEL[0]


def plain_scores(net, prompt, target, pixels, token_types: bool = True) -> torch.Tensor:
    """(T,) the logit of each target token from the model's own forward."""
    ids = torch.tensor([prompt + target[:-1]])
    extra = {"token_type_ids": (ids == IMAGE).long()} if token_types else {}
    with torch.no_grad():
        logits = net(ids, pixel_values=pixels, **extra).logits[0, len(prompt) - 1:]
    return logits[torch.arange(len(target)), torch.tensor(target)]


# -- geometry ---------------------------------------------------------------------------
def test_image_token_k_reads_exactly_the_pixels_of_its_pooled_cell():
    net = build_gemma3(seed=1)
    with torch.no_grad():  # no attention output: each patch depends on its own pixels only
        for layer in net.model.vision_tower.encoder.layers:
            layer.self_attn.out_proj.weight.zero_()
            layer.self_attn.out_proj.bias.zero_()
    pixels = gemma_pixels(2)
    jacobian = torch.autograd.functional.jacobian(lambda x: net.model.get_image_features(x).pooler_output.sum(-1),
                                                  pixels)
    reads = jacobian.abs().sum(3) > 0  # (images, tokens, images, H, W)
    side, cell = int(GEMMA_TOKENS ** 0.5), GEMMA_SIZE // int(GEMMA_TOKENS ** 0.5)
    for i in range(2):
        for k in range(GEMMA_TOKENS):
            r, c = divmod(k, side)
            expected = torch.zeros(2, GEMMA_SIZE, GEMMA_SIZE, dtype=torch.bool)
            expected[i, r * cell:(r + 1) * cell, c * cell:(c + 1) * cell] = True
            assert torch.equal(reads[i, k], expected)


def test_token_map_is_the_projectors_average_pooling():
    net = model()
    grid = GEMMA_SIZE // PATCH
    features = torch.randn(3, grid * grid, 16, dtype=torch.float64)
    projector = net.model.multi_modal_projector
    pooled = projector.avg_pool(features.transpose(1, 2).reshape(3, 16, grid, grid)).flatten(2).transpose(1, 2)
    assert torch.allclose(pooling_map(grid, 2) @ features, pooled, atol=1e-14)
    image = Gemma3Adapter().images(net, torch.tensor([PROMPT]), {"pixel_values": gemma_pixels(1)})[0]
    assert image.positions.tolist() == [3, 4, 5, 6] and image.grid == (grid, grid)
    assert image.pixel_size == (GEMMA_SIZE, GEMMA_SIZE) and torch.equal(image.token_map, pooling_map(grid, 2))


def test_a_score_on_image_token_k_lands_on_its_pooled_cell():
    image = Gemma3Adapter().images(model(), torch.tensor([PROMPT]), {"pixel_values": gemma_pixels(1)})[0]
    side, cell_size = int(GEMMA_TOKENS ** 0.5), GEMMA_SIZE // int(GEMMA_TOKENS ** 0.5)
    for k, position in enumerate(image.positions.tolist()):
        scores = torch.zeros(1, len(PROMPT), dtype=torch.float64)
        scores[0, position] = 1.0
        heat = to_pixels(image_token_scores(scores, image), image)
        r, c = divmod(k, side)
        cell = heat[r * cell_size:(r + 1) * cell_size, c * cell_size:(c + 1) * cell_size]
        assert cell.max() == heat.max() and cell.sum() > 0.6 * heat.sum()


def test_the_adapter_is_found_for_the_unmodified_class_only():
    assert isinstance(get_adapter(model()), Gemma3Adapter)
    text_only = transformers.Gemma3ForCausalLM(model().config.text_config)
    assert type(get_adapter(text_only)) is HuggingFaceAdapter


# -- generation -------------------------------------------------------------------------
def single_step_rows(explainer, prompt, target, pixels):
    rows = []
    for t, token in enumerate(target):
        single = explainer.attribute(torch.tensor(prompt + target[:t]), target=[token], pixel_values=pixels)
        rows.append((single.token_attr[0], single.image_attr[0]))
    return rows


@pytest.mark.parametrize("name", list(METHODS))
def test_rows_equal_single_calls_on_each_prefix(name):
    net = model()
    method = METHODS[name](net)
    explainer = GenerationAttribution(method, TOKENIZER)
    pixels = gemma_pixels(1)
    result = explainer.attribute(torch.tensor(PROMPT), target=TARGET, pixel_values=pixels)
    assert result.image_attr.shape == (len(TARGET), GEMMA_SIZE, GEMMA_SIZE)
    assert result.image_attr.dtype == torch.float64 and result.image_attr.abs().sum() > 0
    assert result.token_attr.shape == (len(TARGET), len(PROMPT) - GEMMA_TOKENS)
    assert (result.scores - plain_scores(net, PROMPT, TARGET, pixels)).abs().max().item() < SCORE_TOL
    assert worst_difference(result, single_step_rows(explainer, PROMPT, TARGET, pixels)) < TOL
    if name == "AttentionFlow":  # its single calls refuse two streams; generation stops it at the image tokens
        return
    # The text maps against the method's own call on each prefix (its columns past the image tokens).
    text = torch.tensor([i for i, token in enumerate(PROMPT) if token != IMAGE])
    for t, token in enumerate(TARGET):
        direct = method.attribute(torch.tensor([PROMPT + TARGET[:t]]), target=token,
                                  forward_kwargs={"pixel_values": pixels})[0]  # the decoder's scores over the ids
        assert (result.token_attr[t] - direct[text]).abs().max().item() < TOL
        assert (result.target_attr[t, :t] - direct[len(PROMPT):]).abs().max().item() < TOL if t else True


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
def test_sdpa_model_rows_equal_single_calls_on_each_prefix(name):
    net = build_gemma3(impl="sdpa")
    explainer = GenerationAttribution(METHODS[name](net), TOKENIZER)
    pixels = gemma_pixels(1)
    result = explainer.attribute(torch.tensor(PROMPT), target=TARGET, pixel_values=pixels)
    assert result.image_attr.abs().sum() > 0
    assert (result.scores - plain_scores(net, PROMPT, TARGET, pixels)).abs().max().item() < SCORE_TOL
    assert worst_difference(result, single_step_rows(explainer, PROMPT, TARGET, pixels)) < TOL


def test_the_image_block_is_bidirectional_as_in_the_model():
    """Without token_type_ids Gemma 3 is another (causal) model: the explained scores are those
    of the model given them, as its processor does."""
    net = model()
    pixels = gemma_pixels(1)
    result = GenerationAttribution(AttnLRP(net), TOKENIZER).attribute(torch.tensor(PROMPT), target=TARGET,
                                                                      pixel_values=pixels)
    causal = plain_scores(net, PROMPT, TARGET, pixels, token_types=False)
    assert (result.scores - plain_scores(net, PROMPT, TARGET, pixels)).abs().max().item() < SCORE_TOL
    assert (result.scores - causal).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
def test_batch_of_two_equals_single_calls(name):
    net = model()
    explainer = GenerationAttribution(METHODS[name](net), TOKENIZER)
    prompts = [PROMPT, gemma_prompt([1, 4, 10], [3])]
    targets = [TARGET, [20, 21]]
    pixels = gemma_pixels(2, seed=5)
    results = explainer.attribute([torch.tensor(p) for p in prompts], target=targets, pixel_values=pixels)
    for i, (result, prompt, target) in enumerate(zip(results, prompts, targets)):
        single = explainer.attribute(torch.tensor(prompt), target=target, pixel_values=pixels[i:i + 1])
        assert result.output_ids == target and result.image_attr.shape == single.image_attr.shape
        assert (result.scores - plain_scores(net, prompt, target, pixels[i:i + 1])).abs().max().item() < SCORE_TOL
        assert (result.token_attr - single.token_attr).abs().max().item() < TOL
        assert (result.target_attr - single.target_attr).abs().max().item() < TOL
        assert (result.image_attr - single.image_attr).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
def test_several_images_in_a_prompt_in_a_batch_equal_single_calls(name):
    """A prompt with two images (image_attr: a list, one map per image) next to a prompt with one."""
    net = model()
    explainer = GenerationAttribution(METHODS[name](net), TOKENIZER)
    prompts = [gemma_prompt([1, 5], []) + gemma_prompt([6], [7, 8]), gemma_prompt([1, 4], [3])]
    pixels = gemma_pixels(3, seed=7)
    results = explainer.attribute([torch.tensor(p) for p in prompts], target=[TARGET, [20]], pixel_values=pixels)
    for result, prompt, target, own in zip(results, prompts, [TARGET, [20]], (pixels[:2], pixels[2:])):
        single = explainer.attribute(torch.tensor(prompt), target=target, pixel_values=own)
        maps = result.image_attr if isinstance(result.image_attr, list) else [result.image_attr]
        alone = single.image_attr if isinstance(single.image_attr, list) else [single.image_attr]
        assert len(maps) == own.shape[0] and all(m.abs().sum() > 0 for m in maps)
        assert (result.token_attr - single.token_attr).abs().max().item() < TOL
        assert max((a - b).abs().max().item() for a, b in zip(maps, alone)) < TOL


def test_model_restored_after_a_call_and_after_an_exception():
    net = build_gemma3(seed=4)
    ids = torch.tensor([PROMPT])
    pixels = gemma_pixels(1)
    with torch.no_grad():
        logits = net(ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits.clone()
    before = snapshot(net)
    GenerationAttribution(AttnLRP(net), TOKENIZER).attribute(ids[0], target=TARGET, pixel_values=pixels)
    assert_same(before, snapshot(net))
    for layer in (net.model.language_model.layers[0], net.model.vision_tower.encoder.layers[0]):
        for method in (AttnLRP(net), GenericAttention(net)):
            with raising_after(layer, RuntimeError("failure inside the forward")), \
                    pytest.raises(RuntimeError, match="failure inside the forward"):
                GenerationAttribution(method, TOKENIZER).attribute(ids[0], target=TARGET, pixel_values=pixels)
            assert_same(before, snapshot(net))
    with torch.no_grad():
        assert torch.equal(net(ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits, logits)


def test_generated_target_is_generated_with_the_processors_token_type_ids(monkeypatch):
    """target=None: generate gets token_type_ids (1 at image tokens) as the processor gives
    them, so the answer explained is the one the bidirectional model writes."""
    net = model()
    seen = []
    original = net.generate

    def spying(*args, **kwargs):
        seen.append({k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        return original(*args, **kwargs)

    monkeypatch.setattr(net, "generate", spying)
    args = {"max_new_tokens": 3, "do_sample": False}
    result = GenerationAttribution(AttnLRP(net), TOKENIZER).attribute(torch.tensor(PROMPT), gen_args=args,
                                                                      pixel_values=gemma_pixels(1))
    ids = seen[0]["input_ids"]
    assert torch.equal(seen[0]["token_type_ids"], (ids == IMAGE).long())
    assert seen[0]["token_type_ids"].sum().item() == GEMMA_TOKENS
    with torch.no_grad():
        out = original(input_ids=ids, pixel_values=gemma_pixels(1), token_type_ids=(ids == IMAGE).long(), **args)
    assert result.output_ids == out[0, ids.shape[1]:].tolist()


# -- refusals ---------------------------------------------------------------------------
def test_wrong_images_placeholders_and_token_types_are_refused():
    net = model()
    explainer = GenerationAttribution(AttnLRP(net), TOKENIZER)
    with pytest.raises(InputError, match="image_size"):
        explainer.attribute(torch.tensor(PROMPT), target=[9], pixel_values=torch.randn(1, 3, 8, 8,
                                                                                        dtype=torch.float64))
    with pytest.raises(InputError, match="image tokens"):
        explainer.attribute(torch.tensor(PROMPT + [IMAGE]), target=[9], pixel_values=gemma_pixels(1))
    ids = torch.tensor([PROMPT])
    with pytest.raises(InputError, match="GenerationAttribution"):  # the tower's tokens: not a zero map
        AttnLRP(net).attribute(ids, target=9, forward_kwargs={"pixel_values": gemma_pixels(1)}, return_tokens=True)
    wrong = torch.zeros_like(ids)
    with pytest.raises(InputError, match="token_type_ids"):
        AttnLRP(net).attribute(ids, target=9, forward_kwargs={"pixel_values": gemma_pixels(1),
                                                              "token_type_ids": wrong})
