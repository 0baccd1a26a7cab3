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
from restore import assert_same, raising_after, snapshot
from vlm_generation_checks import METHODS, PROMPT, TARGET, TOKENIZER, TOL, prefix_differences, shared_llava, text_columns
from vlm_models import (IMAGE, IMAGE_SIZE, IMAGE_TOKENS, build_llava, build_siglip_llava, image_prompt, pixels,
                        transformers)

from captum_transformers import AttnLRP, ConservativeLRP, GenericAttention, InputError, RawAttention
from captum_transformers.generation import GenerationAttribution
from captum_transformers.engine.runner import run_trace


@pytest.mark.parametrize("name", list(METHODS))
def test_rows_equal_explanations_of_each_prefix(name):
    llava, px = shared_llava(), pixels(1)
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
    llava, px = shared_llava(), pixels(1)
    generic = GenerationAttribution(GenericAttention(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    raw = GenerationAttribution(RawAttention(llava), TOKENIZER).attribute(PROMPT, target=TARGET, images=px)
    assert not raw.image_token_attr[:, 0].any()  # the dropped CLS token feeds no image token
    assert generic.image_token_attr[:, 0].abs().sum() > 0  # reached through the tower's attention to CLS


def test_batch_of_two_examples_with_two_images_equals_single_calls():
    llava = shared_llava()
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
    llava = shared_llava()
    prompt = image_prompt([1, 5], [7], images=2)
    px = pixels(2, seed=3)
    explainer = GenerationAttribution(GenericAttention(llava), TOKENIZER)
    result = explainer.attribute(prompt, target=TARGET[:2], images=px)
    assert isinstance(result.image_attr, list) and len(result.image_attr) == 2
    assert prefix_differences(explainer, result, prompt, TARGET[:2], px) < TOL
    assert not torch.equal(result.image_attr[0], result.image_attr[1])


def test_generated_target_and_pixel_values_keyword():
    llava, px = shared_llava(), pixels(1)
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

    llava, px = shared_llava(), pixels(1)
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
    llava, px = shared_llava(), pixels(1)
    method = GenericAttention(llava)
    result = GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET[:1], images=px)
    trace = run_trace(method.adapter, llava, (torch.tensor([PROMPT]),), (), TARGET[0], method.capture_spec(),
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


def test_full_strategy_keeps_the_cls_token_as_an_image_token():
    """"full": image token k is vision token k (CLS first). ``image_token_attr`` holds the CLS
    column; ``image_attr`` is the patch grid's map only (CLS has no pixel location)."""
    from captum_transformers.adapters.vision_language.base import to_pixels

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
    trace = run_trace(method.adapter, siglip, (torch.tensor([prompt]),), (), TARGET[0], method.capture_spec(),
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
