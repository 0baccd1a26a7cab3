"""GenerationAttribution on the tiny LLaVA: the inputs it takes (a processor's output, a batch prompt without
images) and the ones it refuses, with their reasons (image placeholders without images or an image token in the
answer, images given twice, image_sizes, LLaVA-NeXT's tiles, unknown keywords, a direct return_tokens=True)."""
from __future__ import annotations

import pytest
import torch
from vlm_generation_checks import METHODS, PROMPT, TARGET, TOKENIZER, TOL, prefix_differences, shared_llava
from vlm_models import IMAGE, IMAGE_SIZE, build_llava, llava_config, llava_processor, pixels, transformers

from captum_transformers import AttnLRP, GenericAttention, InputError, UnsupportedModelError
from captum_transformers.adapters.vision_language.llava import LlavaAdapter
from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.captum_baselines import CaptumIntegratedGradients


def test_refusals():
    llava, px = shared_llava(), pixels(1)
    explainer = GenerationAttribution(GenericAttention(llava), TOKENIZER)
    with pytest.raises(InputError, match="image tokens"):
        explainer.attribute(PROMPT[:-3], target=TARGET, images=pixels(2))
    with pytest.raises(InputError, match="image_sizes .* are not mapped back to the image; give one pixel_values"):
        explainer.attribute(PROMPT, target=TARGET, pixel_values=px, image_sizes=torch.tensor([[16, 16]]))
    with pytest.raises(InputError, match="twice"):
        explainer.attribute(PROMPT, target=TARGET, images=px, pixel_values=px)
    with pytest.raises(InputError, match="not a vision-language one"):
        GenerationAttribution(CaptumIntegratedGradients(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    with pytest.raises(InputError, match="one entry per prompt"):
        explainer.attribute([PROMPT, PROMPT], target=[TARGET, TARGET], images=px)
    assert isinstance(explainer.method.adapter, LlavaAdapter)
    several = GenerationAttribution(GenericAttention(build_llava(feature_layer=[-2, -1])), TOKENIZER)
    with pytest.raises(InputError, match="several hidden states"):
        several.attribute(PROMPT, target=TARGET, images=px)


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention", "RawAttention"])
def test_direct_return_tokens_refuses_the_unscored_tower_stream(name):
    """A direct call scores the decoder's tokens only: return_tokens=True (which would return the
    vision tower's tokens as an all-zero map) is refused, pointing to GenerationAttribution."""
    llava, px = shared_llava(), pixels(1)
    method = METHODS[name](llava)
    ids = torch.tensor([PROMPT])
    with pytest.raises(InputError, match=r"GenerationAttribution\(method, tokenizer\).*images=pixel_values"):
        method.attribute(ids, target=TARGET[0], forward_kwargs={"pixel_values": px}, return_tokens=True)
    decoder = method.attribute(ids, target=TARGET[0], forward_kwargs={"pixel_values": px})
    assert decoder.shape == ids.shape and decoder.abs().sum() > 0


def test_an_image_token_in_the_answer_is_refused_naming_its_step():
    """A generated (or given) output token equal to the image placeholder id: refused, naming the
    output step, instead of a count mismatch between image tokens and images."""
    llava, px = shared_llava(), pixels(1)
    explainer = GenerationAttribution(AttnLRP(llava), TOKENIZER)
    forced = {"max_new_tokens": 3, "do_sample": False, "sequence_bias": [[[IMAGE], 1e4]]}
    with pytest.raises(InputError, match=r"the model generated the image placeholder token .* output step\(s\) "
                                         r"\[0, 1, 2\] of 3"):
        explainer.attribute(PROMPT, gen_args=forced, images=px)
    allowed = explainer.attribute(PROMPT, gen_args={**forced, "bad_words_ids": [[IMAGE]]}, images=px)  # as advised
    assert IMAGE not in allowed.output_ids and len(allowed.output_ids) > 0
    with pytest.raises(InputError, match=r"the target holds the image placeholder token .* step\(s\) \[1\] of 2"):
        explainer.attribute(PROMPT, target=[TARGET[0], IMAGE], images=px)


def test_processor_output_is_a_prompt_with_its_images():
    processor, llava = llava_processor(), shared_llava()
    image = torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5))
    inputs = processor(images=image, text="t1 t5 <image> t7 t9", return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == PROMPT
    explainer = GenerationAttribution(GenericAttention(llava), processor.tokenizer)
    result = explainer.attribute(inputs, target=TARGET)
    explicit = explainer.attribute(PROMPT, target=TARGET, images=inputs["pixel_values"][0])
    assert result.input_tokens == ["t1", "t5", "t7", "t9"]
    assert torch.equal(result.image_attr, explicit.image_attr) and torch.equal(result.token_attr, explicit.token_attr)


def _processor_inputs():
    processor = llava_processor()
    image = torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5))
    return processor, processor(images=image, text="t1 t5 <image> t7 t9", return_tensors="pt")


def test_image_inputs_that_would_be_dropped_or_misread_are_refused():
    llava, px = shared_llava(), pixels(1)
    processor, inputs = _processor_inputs()
    for make in (GenericAttention, AttnLRP):  # placeholders read as text embeddings, hidden from token_attr
        with pytest.raises(InputError, match="16 image placeholder tokens .* but no images"):
            GenerationAttribution(make(llava), TOKENIZER).attribute(PROMPT, target=TARGET)
    captum_rows = GenerationAttribution(CaptumIntegratedGradients(llava), processor.tokenizer)
    with pytest.raises(InputError, match=r"holds images \(\['pixel_values'\]\), but .* explains no images"):
        captum_rows.attribute(inputs, target=TARGET)
    with pytest.raises(InputError, match="16 image placeholder tokens .* explains no images"):
        captum_rows.attribute(PROMPT, target=TARGET)
    explainer = GenerationAttribution(GenericAttention(llava), processor.tokenizer)
    with pytest.raises(InputError, match="given twice"):
        explainer.attribute(inputs, target=TARGET, images=px)
    inputs["image_sizes"] = torch.tensor([[16, 16]])
    with pytest.raises(InputError, match="image_sizes .* are not mapped back to the image; give one pixel_values"):
        explainer.attribute(inputs, target=TARGET)
    with pytest.raises(InputError, match=r"unexpected keyword arguments \['skip_token'\]"):
        explainer.attribute(PROMPT, target=TARGET, images=px, skip_token=[1])
    text_model = transformers.LlamaForCausalLM(llava.config.text_config).to(torch.float64).eval()
    with pytest.raises(InputError, match=r"unexpected keyword arguments \['skip_token'\]"):
        GenerationAttribution(AttnLRP(text_model), TOKENIZER).attribute([1, 5, 7], target=[20], skip_token=[1])


def test_llava_next_is_refused_with_its_reason():
    config = llava_config()
    next_config = transformers.LlavaNextConfig(vision_config=config.vision_config, text_config=config.text_config,
                                               image_token_id=IMAGE, vision_feature_layer=-1,
                                               image_grid_pinpoints=[[16, 16]], attn_implementation="eager")
    torch.manual_seed(0)
    llava_next = transformers.LlavaNextForConditionalGeneration(next_config).to(torch.float64).eval()
    ids = torch.tensor([[1, 5] + [IMAGE] * 20 + [7, 9]])
    feature = transformers.BatchFeature({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "pixel_values": pixels(2)[None], "image_sizes": torch.tensor([[16, 16]])})
    for make in (GenericAttention, AttnLRP):
        with pytest.raises(UnsupportedModelError, match="LlavaNextForConditionalGeneration .* tiles each image"):
            GenerationAttribution(make(llava_next), TOKENIZER).attribute(feature, target=[20, 21])
        with pytest.raises(UnsupportedModelError, match="tiles each image"):  # text only, single calls too
            make(llava_next).attribute(torch.tensor([[1, 5, 7]]), target=20)


def test_a_batch_prompt_without_images_takes_none():
    llava = shared_llava()
    prompts, targets = [PROMPT, [1, 6, 8, 3]], [TARGET[:2], [22]]
    explainer = GenerationAttribution(AttnLRP(llava), TOKENIZER)
    for empty in (None, torch.zeros(0, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64)):
        results = explainer.attribute(prompts, target=targets, images=[pixels(1, seed=1), empty])
        assert results[1].image_attr is None
        assert prefix_differences(explainer, results[0], PROMPT, TARGET[:2], pixels(1, seed=1)) < TOL
        alone = explainer.attribute(prompts[1], target=[22])
        assert (results[1].token_attr - alone.token_attr).abs().max() < TOL

