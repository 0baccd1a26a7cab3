"""GenerationAttribution on a vision-language model (tiny float64 LLaVA, tests/vlm_models.py).

Per generated token: a map over the image's pixels (``image_attr``), one over the vision
tower's tokens (``image_token_attr``) and one over the text tokens (``token_attr``). Each row
must equal a separate explanation of that token alone on its prefix (prompt + y_<t, its own
forward pass) to 1e-10, and the text part must equal the method's own single call on the
prefix; a batch of two examples with two images equals the single calls; the model is
restored exactly; AH+LN conserves over image + text on a bias-free model.
"""
from __future__ import annotations

import pytest
import torch
from generation_models import IdTokenizer
from restore import assert_same, raising_after, snapshot
from vlm_models import (IMAGE, IMAGE_SIZE, IMAGE_TOKENS, build_llava, build_siglip_llava, image_prompt, llava_config,
                        llava_processor, pixels, transformers)

from captum_transformers import (AttentionFlow, AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,
                                 GenericAttention, InputError, PartialLRP, RawAttention, TransformerLRP,
                                 TransformerRelevance, UnsupportedModelError)
from captum_transformers.adapters.llava import LlavaAdapter
from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.captum_baselines import CaptumIntegratedGradients

TOL = 1e-10
TOKENIZER = IdTokenizer()
PROMPT, TARGET = image_prompt([1, 5], [7, 9]), [20, 21, 22]
METHODS = {
    "AttnLRP": AttnLRP,
    "ConservativeLRP-AH+LN": lambda m: ConservativeLRP(m, "AH+LN"),
    "TransformerLRP": TransformerLRP,
    "GenericAttention": GenericAttention,
    "TransformerRelevance": TransformerRelevance,
    "AttentionRollout": AttentionRollout,
    "RawAttention": RawAttention,
    "AttentionGradCAM": AttentionGradCAM,
    "PartialLRP": PartialLRP,
    "AttentionFlow": AttentionFlow,
}
_MODEL: dict = {}


def model() -> torch.nn.Module:
    if "llava" not in _MODEL:
        _MODEL["llava"] = build_llava()
    return _MODEL["llava"]


def text_columns(prompt):
    return [i for i, token in enumerate(prompt) if token != IMAGE]


def prefix_differences(explainer, result, prompt, target, images):
    """Largest |difference| of each row with the same method explaining y_t alone on its prefix."""
    worst = 0.0
    n_text = len(text_columns(prompt))
    for t, token in enumerate(target):
        single = explainer.attribute(prompt + target[:t], target=[token], images=images)
        parts = [(result.token_attr[t], single.token_attr[0, :n_text]),
                 (result.target_attr[t, :t], single.token_attr[0, n_text:])]
        mine = result.image_attr if isinstance(result.image_attr, list) else [result.image_attr]
        theirs = single.image_attr if isinstance(single.image_attr, list) else [single.image_attr]
        mine_tokens = result.image_token_attr if isinstance(result.image_token_attr, list) else [result.image_token_attr]
        their_tokens = single.image_token_attr if isinstance(single.image_token_attr, list) else \
            [single.image_token_attr]
        parts += [(a[t], b[0]) for a, b in zip(mine, theirs)] + [(a[t], b[0]) for a, b in zip(mine_tokens, their_tokens)]
        for a, b in parts:
            worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
    return worst


@pytest.mark.parametrize("name", list(METHODS))
def test_rows_equal_explanations_of_each_prefix(name):
    llava, px = model(), pixels(1)
    method = METHODS[name](llava)
    explainer = GenerationAttribution(method, TOKENIZER)
    result = explainer.attribute(PROMPT, target=TARGET, images=px)
    assert result.token_attr.shape == (3, 4) and result.input_tokens == ["t1", "t5", "t7", "t9"]
    assert result.image_attr.shape == (3, IMAGE_SIZE, IMAGE_SIZE) and result.image_token_attr.shape == (3, 17)
    assert result.image_grid == (4, 4)
    assert result.image_attr.dtype == torch.float64 and result.image_attr.abs().sum() > 0
    assert prefix_differences(explainer, result, PROMPT, TARGET, px) < TOL
    # The text part is the method's own single call on the prefix (the pixels by keyword).
    text = text_columns(PROMPT)
    if name == "AttentionFlow":  # its single calls refuse two streams (a flow over one sequence's graph)
        with pytest.raises(InputError, match="one token sequence"):
            method.attribute(torch.tensor([PROMPT]), target=TARGET[0], forward_kwargs={"pixel_values": px})
        return
    for t, token in enumerate(TARGET):
        ids = torch.tensor([PROMPT + TARGET[:t]])
        decoder = method.attribute(ids, target=token, forward_kwargs={"pixel_values": px})  # scores over the ids
        assert (decoder[0, text] - result.token_attr[t]).abs().max() < TOL


def test_methods_that_chain_layers_reach_the_vision_tower():
    """GenericAttention carries the image tokens' relevance through the tower's layers (ICCV'21):
    its tower-input map differs from the image tokens' own scores; RawAttention stops there."""
    llava, px = model(), pixels(1)
    generic = GenerationAttribution(GenericAttention(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    raw = GenerationAttribution(RawAttention(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    assert not raw.image_token_attr[:, 0].any()  # the dropped CLS token feeds no image token
    assert generic.image_token_attr[:, 0].abs().sum() > 0  # reached through the tower's attention to CLS


def test_batch_of_two_examples_with_two_images_equals_single_calls():
    llava = model()
    prompts = [PROMPT, image_prompt([1, 6, 8], [3, 4, 10, 12])]  # left padding moves the first image
    targets = [TARGET, [23, 24]]
    images = [pixels(1, seed=1), pixels(1, seed=2)]
    for name in ("AttnLRP", "GenericAttention", "AttentionRollout"):
        explainer = GenerationAttribution(METHODS[name](llava), TOKENIZER)
        results = explainer.attribute(prompts, target=targets, images=images)
        for result, prompt, target, image in zip(results, prompts, targets, images):
            assert result.output_ids == target and result.image_attr.shape == (len(target), IMAGE_SIZE, IMAGE_SIZE)
            assert prefix_differences(explainer, result, prompt, target, image) < TOL


def test_two_images_in_one_prompt_give_one_map_each():
    llava = model()
    prompt = image_prompt([1, 5], [7], images=2)
    px = pixels(2, seed=3)
    explainer = GenerationAttribution(GenericAttention(llava), TOKENIZER)
    result = explainer.attribute(prompt, target=TARGET[:2], images=px)
    assert isinstance(result.image_attr, list) and len(result.image_attr) == 2
    assert prefix_differences(explainer, result, prompt, TARGET[:2], px) < TOL
    assert not torch.equal(result.image_attr[0], result.image_attr[1])


def test_generated_target_and_pixel_values_keyword():
    llava, px = model(), pixels(1)
    explainer = GenerationAttribution(AttnLRP(llava), TOKENIZER)
    result = explainer.attribute(PROMPT, gen_args={"max_new_tokens": 3, "do_sample": False}, pixel_values=px)
    with torch.no_grad():
        expected = llava.generate(torch.tensor([PROMPT]), pixel_values=px, max_new_tokens=3, do_sample=False,
                                  pad_token_id=0)[0, len(PROMPT):].tolist()
    cut = next((i + 1 for i, token in enumerate(expected) if token == 2), len(expected))
    assert result.output_ids == expected[:cut]
    explicit = explainer.attribute(PROMPT, target=result.output_ids, images=px)
    assert torch.equal(result.image_attr, explicit.image_attr)


def _bias_free_llava():
    llava = build_llava(seed=3)

    class Float64RMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
        def forward(self, hidden_states):
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    with torch.no_grad():
        for module in llava.modules():
            if type(module) is transformers.models.llama.modeling_llama.LlamaRMSNorm:
                module.__class__ = Float64RMSNorm
        for name, parameter in llava.named_parameters():
            if name.endswith("bias"):  # CLIP's attention, MLP and LayerNorm biases
                parameter.zero_()
    return llava


def test_conservative_ah_ln_sums_to_the_logit_over_image_and_text():
    """Text tokens + earlier outputs + every vision-tower token (what enters through the
    image: patches, CLS and position embeddings, at the tower's first layer) == the logit.
    The identity rule on activations: CLIP's quick-GELU and the projector's GELU are not gated."""
    llava, px = _bias_free_llava(), pixels(1)
    method = ConservativeLRP(llava, "AH+LN", activation_rule="identity")
    result = GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    totals = result.token_attr.sum(1) + result.target_attr.sum(1) + result.image_token_attr.sum(1)
    assert (totals - result.scores).abs().max() < TOL
    assert result.image_token_attr.abs().sum() > 0
    # The gradient rule on GELU leaks relevance: the check can fail.
    leaky = GenerationAttribution(ConservativeLRP(llava, "AH+LN"), TOKENIZER).attribute(PROMPT, target=TARGET,
                                                                                          images=px)
    leaked = leaky.token_attr.sum(1) + leaky.target_attr.sum(1) + leaky.image_token_attr.sum(1) - leaky.scores
    assert leaked.abs().max() > 1e-6


def test_model_restored_after_a_call_and_after_an_exception():
    llava, px = build_llava(seed=4), pixels(1)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = llava(ids, pixel_values=px).logits.clone()
    before = snapshot(llava)
    GenerationAttribution(AttnLRP(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    assert_same(before, snapshot(llava))
    for layer in (llava.model.vision_tower.encoder.layers[0], llava.model.language_model.layers[1]):
        for method in (AttnLRP(llava), GenericAttention(llava)):
            with raising_after(layer, RuntimeError("failure inside the forward")), \
                    pytest.raises(RuntimeError, match="failure inside the forward"):
                GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
            assert_same(before, snapshot(llava))
    with torch.no_grad():
        assert torch.equal(llava(ids, pixel_values=px).logits, logits)


def test_refusals():
    llava, px = model(), pixels(1)
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
    llava, px = model(), pixels(1)
    method = METHODS[name](llava)
    ids = torch.tensor([PROMPT])
    with pytest.raises(InputError, match=r"GenerationAttribution\(method, tokenizer\).*images=pixel_values"):
        method.attribute(ids, target=TARGET[0], forward_kwargs={"pixel_values": px}, return_tokens=True)
    decoder = method.attribute(ids, target=TARGET[0], forward_kwargs={"pixel_values": px})
    assert decoder.shape == ids.shape and decoder.abs().sum() > 0


def test_an_image_token_in_the_answer_is_refused_naming_its_step():
    """A generated (or given) output token equal to the image placeholder id: refused, naming the
    output step, instead of a count mismatch between image tokens and images."""
    llava, px = model(), pixels(1)
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
    processor, llava = llava_processor(), model()
    image = torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5))
    inputs = processor(images=image, text="t1 t5 <image> t7 t9", return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == PROMPT
    explainer = GenerationAttribution(GenericAttention(llava), processor.tokenizer)
    result = explainer.attribute(inputs, target=TARGET)
    explicit = explainer.attribute(PROMPT, target=TARGET, images=inputs["pixel_values"][0])
    assert result.input_tokens == ["t1", "t5", "t7", "t9"]
    assert torch.equal(result.image_attr, explicit.image_attr) and torch.equal(result.token_attr, explicit.token_attr)


@pytest.mark.parametrize("name", ["AttentionRollout", "GenericAttention", "AttnLRP"])
def test_tower_layers_after_the_feature_layer_change_nothing(name):
    """LLaVA's default feature layer (-2) skips the tower's last layer: changing its weights
    leaves every map unchanged (rollout included, which reads forward maps only)."""
    llava, px = build_llava(seed=6, feature_layer=-2), pixels(1)
    explainer = GenerationAttribution(METHODS[name](llava), TOKENIZER)
    before = explainer.attribute(PROMPT, target=TARGET, images=px)
    last = llava.model.vision_tower.encoder.layers[-1].self_attn
    with torch.no_grad():
        last.q_proj.weight.mul_(3.0)
    after = explainer.attribute(PROMPT, target=TARGET, images=px)
    assert torch.allclose(before.image_attr, after.image_attr, atol=TOL, rtol=0)
    assert torch.allclose(before.token_attr, after.token_attr, atol=TOL, rtol=0)
    assert prefix_differences(explainer, after, PROMPT, TARGET, px) < TOL


def test_sdpa_llava_equals_eager():
    eager, px = build_llava(seed=7), pixels(1)
    sdpa = build_llava(seed=7)
    sdpa.set_attn_implementation("sdpa")
    for make in (AttnLRP, GenericAttention):
        a = GenerationAttribution(make(eager), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
        b = GenerationAttribution(make(sdpa), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
        assert (a.image_attr - b.image_attr).abs().max() < 1e-9 and (a.token_attr - b.token_attr).abs().max() < 1e-9


def test_span_and_json_round_trip():
    """AttnLRP is linear in its seed: a span's maps are the sum of its steps' maps. A result with
    one image and one with two read back from JSON bit for bit."""
    from captum_transformers.generation.serialization import result_from_dict, result_to_dict

    llava, px = model(), pixels(1)
    explainer = GenerationAttribution(AttnLRP(llava), TOKENIZER)
    rows = explainer.attribute(PROMPT, target=TARGET, images=px)
    span = explainer.attribute(PROMPT, target=TARGET, images=px, span=slice(0, 3))
    assert span.image_attr.shape == (1, IMAGE_SIZE, IMAGE_SIZE)
    assert (span.image_attr[0] - rows.image_attr.sum(0)).abs().max() < TOL
    two = GenerationAttribution(GenericAttention(llava), TOKENIZER).attribute(
        image_prompt([1], [7], images=2), target=TARGET[:2], images=pixels(2))
    for result in (rows, two):
        back = result_from_dict(result_to_dict(result))
        mine = result.image_attr if isinstance(result.image_attr, list) else [result.image_attr]
        read = back.image_attr if isinstance(back.image_attr, list) else [back.image_attr]
        assert len(mine) == len(read) and all(torch.equal(a, b) for a, b in zip(mine, read))
        assert back.image_grid == result.image_grid and torch.equal(back.token_attr, result.token_attr)


def test_generic_attention_follows_the_iccv_rules_across_the_two_streams():
    """Reference from whole matrices: ``R^{vv} = prod (I + Abar_v)`` over the tower's calls,
    ``R^{dd} = prod (I + Abar_d)`` over the decoder's, ``R^{dv} = R^{dd} E R^{vv}`` (the image
    tokens are the tower's outputs); the image row is ``e_q R^{dv}`` (Chefer et al., ICCV 2021)."""
    llava, px = model(), pixels(1)
    method = GenericAttention(llava)
    result = GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET[:1], images=px)
    trace = method.adapter.trace(llava, (torch.tensor([PROMPT]),), (), TARGET[0], method.capture_spec(),
                                 forward_kwargs={"pixel_values": px})

    def chain(stream, size, skip=0):
        relevance = torch.eye(size, dtype=torch.float64)
        for record in [r for r in trace.records if r.streams[0] == stream][skip:]:
            relevance = relevance + record.backward_value[0].to(torch.float64) @ relevance
        return relevance

    vision, decoder = chain("image", 17), chain("tokens", len(PROMPT))
    embedding = torch.zeros(len(PROMPT), 17, dtype=torch.float64)
    for k, position in enumerate(i for i, token in enumerate(PROMPT) if token == IMAGE):
        embedding[position, k + 1] = 1.0  # "default": image token k is vision token k + 1 (after CLS)
    expected = (decoder @ embedding @ vision)[len(PROMPT) - 1]
    assert (result.image_token_attr[0] - expected).abs().max() < TOL
    assert (result.token_attr[0] - decoder[len(PROMPT) - 1, text_columns(PROMPT)]).abs().max() < TOL
    # start_layer per stream: the tower's chain from its second call, the decoder's whole.
    later = GenerationAttribution(GenericAttention(llava, start_layer={"image": 1}), TOKENIZER).attribute(
        PROMPT, target=TARGET[:1], images=px)
    expected = (decoder @ embedding @ chain("image", 17, skip=1))[len(PROMPT) - 1]
    assert (later.image_token_attr[0] - expected).abs().max() < TOL
    assert (later.image_token_attr[0] - result.image_token_attr[0]).abs().max() > 1e-6
    with pytest.raises(InputError, match="streams"):
        GenerationAttribution(GenericAttention(llava, start_layer={"text": 1}), TOKENIZER).attribute(
            PROMPT, target=TARGET[:1], images=px)


def test_gradient_times_input_pixel_maps_are_the_plain_gradient():
    """ConservativeLRP("GI") is plain Gradient x Input: each row's pixel map is
    ``sum_c x * d logit / d x`` of the prefix's plain forward (HF's sdpa kernel, float64)."""
    llava, px = build_llava(seed=8), pixels(1)
    llava.set_attn_implementation("sdpa")
    result = GenerationAttribution(ConservativeLRP(llava, "GI"), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    for t, token in enumerate(TARGET):
        leaf = px.clone().requires_grad_()
        logits = llava(torch.tensor([PROMPT + TARGET[:t]]), pixel_values=leaf).logits
        (grad,) = torch.autograd.grad(logits[0, -1, token], leaf)
        assert (result.image_attr[t] - (leaf * grad).sum(1)[0]).abs().max() < 1e-12


def _processor_inputs():
    processor = llava_processor()
    image = torch.rand(3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5))
    return processor, processor(images=image, text="t1 t5 <image> t7 t9", return_tensors="pt")


def test_image_inputs_that_would_be_dropped_or_misread_are_refused():
    llava, px = model(), pixels(1)
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


def test_full_strategy_keeps_the_cls_token_as_an_image_token():
    """"full": image token k is vision token k (CLS first). ``image_token_attr`` holds the CLS
    column; ``image_attr`` is the patch grid's map only (CLS has no pixel location)."""
    from captum_transformers.adapters.vision_language import to_pixels

    llava, px = build_llava(strategy="full"), pixels(1)
    prompt = [1, 5] + [IMAGE] * (IMAGE_TOKENS + 1) + [7, 9]
    for make in (RawAttention, GenericAttention, AttnLRP):
        explainer = GenerationAttribution(make(llava), TOKENIZER)
        result = explainer.attribute(prompt, target=TARGET[:2], images=px)
        assert result.image_token_attr.shape == (2, 17) and result.image_token_attr[:, 0].abs().min() > 0
        assert prefix_differences(explainer, result, prompt, TARGET[:2], px) < TOL
        image = explainer.method.adapter.images(llava, torch.tensor([prompt]), {"pixel_values": px})[0]
        assert image.token_map[0, 0] == 1 and torch.equal(image.grid_tokens, torch.arange(1, 17))
        if make is RawAttention:  # no pixel relevance of its own: the grid's map upsampled, CLS excluded
            assert torch.allclose(result.image_attr, to_pixels(result.image_token_attr, image), atol=TOL, rtol=0)
    with pytest.raises(InputError, match="expand each image's placeholder"):
        GenerationAttribution(GenericAttention(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_siglip_tower_has_no_cls_token(strategy):
    """SigLIP: 16 patch tokens, no CLS. "default" drops the first patch (as HF does): image
    token k is vision token k + 1, patch (0, 0) feeds no image token. Rows equal the prefix
    calls; GenericAttention equals the ICCV chain with that map."""
    siglip, px = build_siglip_llava(strategy), pixels(1)
    dropped = 1 if strategy == "default" else 0
    prompt = [1, 5] + [IMAGE] * (IMAGE_TOKENS - dropped) + [7, 9]
    method = GenericAttention(siglip)
    explainer = GenerationAttribution(method, TOKENIZER)
    result = explainer.attribute(prompt, target=TARGET[:2], images=px)
    assert result.image_token_attr.shape == (2, IMAGE_TOKENS) and result.image_attr.shape == (2, 16, 16)
    assert prefix_differences(explainer, result, prompt, TARGET[:2], px) < TOL
    trace = method.adapter.trace(siglip, (torch.tensor([prompt]),), (), TARGET[0], method.capture_spec(),
                                 forward_kwargs={"pixel_values": px})

    def chain(stream, size, calls):
        relevance = torch.eye(size, dtype=torch.float64)
        for record in [r for r in trace.records if r.streams[0] == stream][:calls]:
            relevance = relevance + record.backward_value[0].to(torch.float64) @ relevance
        return relevance

    embedding = torch.zeros(len(prompt), IMAGE_TOKENS, dtype=torch.float64)
    for k, position in enumerate(i for i, token in enumerate(prompt) if token == IMAGE):
        embedding[position, k + dropped] = 1.0
    expected = (chain("tokens", len(prompt), None) @ embedding @ chain("image", IMAGE_TOKENS, 2))[len(prompt) - 1]
    assert (result.image_token_attr[0] - expected).abs().max() < TOL
    raw = GenerationAttribution(RawAttention(siglip), TOKENIZER).attribute(prompt, target=TARGET[:1], images=px)
    assert (raw.image_token_attr[0, 0] == 0) == bool(dropped)  # the dropped patch feeds no image token


def test_a_batch_prompt_without_images_takes_none():
    llava = model()
    prompts, targets = [PROMPT, [1, 6, 8, 3]], [TARGET[:2], [22]]
    explainer = GenerationAttribution(AttnLRP(llava), TOKENIZER)
    for empty in (None, torch.zeros(0, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64)):
        results = explainer.attribute(prompts, target=targets, images=[pixels(1, seed=1), empty])
        assert results[1].image_attr is None
        assert prefix_differences(explainer, results[0], PROMPT, TARGET[:2], pixels(1, seed=1)) < TOL
        alone = explainer.attribute(prompts[1], target=[22])
        assert (results[1].token_attr - alone.token_attr).abs().max() < TOL
