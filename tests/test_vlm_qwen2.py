"""Qwen2-VL and Qwen2.5-VL: the image geometry, and GenerationAttribution's image and text maps.

Float64 tiny models (tests/vlm_family_models.py). The geometry is checked against the model
itself (which pixel rows each image token depends on, where each patch sits in the tower's
window order) and against the processor's patch layout; every row of a generation explanation
(text and image maps) equals a single call on its prefix to 1e-10, a batch of two examples with
different image sizes equals the single calls, and the model is restored exactly.
"""
from __future__ import annotations

import pytest
import torch
from generation_models import EOS, IdTokenizer
from restore import assert_same, raising_after, snapshot
from vlm_family_models import (IMAGE, MERGE, PATCH, TEMPORAL, build_qwen2_5_vl, build_qwen2_vl, qwen_pixels,
                               qwen_prompt)
from vlm_generation_checks import worst_difference

from captum_transformers import (AttentionFlow, AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,
                                 GenericAttention, InputError, PartialLRP, RawAttention, TransformerLRP,
                                 TransformerRelevance)
from captum_transformers.adapters.vision_language.qwen2_vl import Qwen2VLAdapter, grid_order, tower_places, window_order
from captum_transformers.adapters.vision_language.qwen2_vl_geometry import image_grids, patch_row_spans, patchify
from captum_transformers.adapters.registry import get_adapter
from captum_transformers.adapters.vision_language.base import image_token_scores, to_pixels
from captum_transformers.capture.recorder import Recorder
from captum_transformers.capture.trace import CaptureSpec
from captum_transformers.generation import GenerationAttribution

transformers = pytest.importorskip("transformers")

TOL = 1e-10
# The explained logits against the model's own forward: its RMSNorm computes in float32, so the
# explicit kernel's float64 rounding (1e-16) can move a float32 rounding (1e-7 relative).
SCORE_TOL = 1e-5
FAMILIES = {"qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl}
GRID = {"qwen2_vl": (4, 4), "qwen2_5_vl": (4, 8)}  # 2.5-VL: two 2x2-cell windows side by side
METHODS = {"AttnLRP": AttnLRP, "ConservativeLRP": ConservativeLRP, "TransformerLRP": TransformerLRP,
           "GenericAttention": GenericAttention, "TransformerRelevance": TransformerRelevance,
           "AttentionGradCAM": AttentionGradCAM, "PartialLRP": PartialLRP, "RawAttention": RawAttention,
           "AttentionRollout": AttentionRollout, "AttentionFlow": AttentionFlow}
BEFORE, AFTER, TARGET = [1, 5], [7, 8], [9, 11, 12]
TOKENIZER = IdTokenizer()
_MODELS: dict = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = FAMILIES[family]()
    return _MODELS[family]


def zeroed_tower_attention(model: torch.nn.Module) -> torch.nn.Module:
    """The tower with every attention output zeroed: each patch then depends on its own pixels only."""
    with torch.no_grad():
        for block in model.model.visual.blocks:
            block.attn.proj.weight.zero_()
            block.attn.proj.bias.zero_()
    return model


# -- geometry ---------------------------------------------------------------------------
def test_patches_to_image_inverts_the_processors_patch_layout():
    processor = transformers.Qwen2VLImageProcessor()
    images = torch.randn(2, 3, 16, 24, dtype=torch.float64)
    rows, h, w = processor.patchify(images, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    ours, thw = patchify(images, PATCH, MERGE, TEMPORAL)
    assert torch.equal(ours, rows.reshape(-1, rows.shape[-1])) and thw.tolist() == [[1, h, w]] * 2
    grid = image_grids(torch.tensor([[1, h, w]]), PATCH, MERGE)[0]
    assert grid.image_size == (16, 24) and grid.num_tokens == 6
    for b in range(2):  # the temporal copies of a still image are summed
        assert torch.equal(grid.patches_to_image(rows[b], 3, TEMPORAL), TEMPORAL * images[b])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_image_token_k_reads_exactly_the_pixel_rows_of_its_merged_cell(family):
    model = zeroed_tower_attention(FAMILIES[family](seed=1))
    inputs = qwen_pixels([(4, 8), (8, 4)])
    grids = image_grids(inputs["image_grid_thw"], PATCH, MERGE)
    jacobian = torch.autograd.functional.jacobian(
        lambda rows: model.model.visual(rows, grid_thw=inputs["image_grid_thw"]).pooler_output.sum(-1),
        inputs["pixel_values"])
    reads = jacobian.abs().sum(-1) > 0  # (image tokens, pixel rows)
    token = 0
    for grid, (start, _) in zip(grids, patch_row_spans(grids)):
        for k in range(grid.num_tokens):
            assert reads[token].nonzero().flatten().tolist() == list(range(start + 4 * k, start + 4 * k + 4))
            token += 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_grid_tokens_and_token_map_follow_the_towers_order(family):
    """The tower's first block sees patch embeddings in its own (2.5-VL: window) order; each grid
    cell's ``grid_tokens`` entry is the row holding that cell's patch, and each decoder token's
    ``token_map`` row averages the four patches of its merged cell."""
    model = model_of(family)
    grid_hw = (4, 8) if family == "qwen2_5_vl" else (4, 4)
    inputs = qwen_pixels([grid_hw, (4, 4)], seed=3)
    ids = torch.tensor([qwen_prompt(BEFORE, grid_hw, []) + qwen_prompt([], (4, 4), AFTER)])
    seen = []
    handle = model.model.visual.blocks[0].register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"]
                                                                                            if a == () else a[0]),
                                                                    with_kwargs=True)
    try:
        with torch.no_grad():
            model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
            embedded = model.model.visual.patch_embed(inputs["pixel_values"])
    finally:
        handle.remove()
    images = Qwen2VLAdapter().images(model, ids, inputs)
    order = window_order(model, inputs["image_grid_thw"])
    assert (order is None) == (family == "qwen2_vl")
    first_cell = 0
    for image, grid in zip(images, image_grids(inputs["image_grid_thw"], PATCH, MERGE)):
        start = image.vision_span[0]
        processor_rows = grid_order(grid, torch.arange(grid.num_tokens))  # the processor's layout
        for cell in range(grid.h * grid.w):
            tower_row = start + int(image.grid_tokens[cell])
            assert torch.equal(seen[0][tower_row], embedded[start + int(processor_rows[cell])])
        cells = image.grid_tokens.reshape(grid.h, grid.w)
        for k in range(grid.num_tokens):
            r, c = divmod(k, grid.w // MERGE)
            block = cells[r * MERGE:(r + 1) * MERGE, c * MERGE:(c + 1) * MERGE].flatten().sort().values
            assert torch.equal(image.token_map[k].nonzero().flatten(), block)
            assert torch.allclose(image.token_map[k].sum(), torch.tensor(1.0, dtype=torch.float64))
        places = tower_places(grid, order, first_cell)
        assert sorted(places.tolist()) == list(range(grid.num_tokens))
        first_cell += grid.num_tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_recorded_tower_makes_one_block_diagonal_call_per_block_with_the_towers_output(family):
    """While maps are recorded, each tower block is one call over all images whose map is 0
    across images (2.5-VL's windowed block: across windows), and the tower's output is that of
    its own per-image (per-window) calls through the same kernel (the capture without maps; HF's
    eager kernel differs from both by its float32 softmax)."""
    model = model_of(family)
    inputs = qwen_pixels([GRID[family], (4, 4)], seed=6)
    adapter = Qwen2VLAdapter()
    recorder = Recorder(CaptureSpec(forward_reduce=lambda probs: probs.clone()))
    with torch.no_grad():
        with adapter.capture(model, Recorder(CaptureSpec())):
            own = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
        with adapter.capture(model, recorder):
            captured = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    assert (captured - own).abs().max().item() < 1e-12
    sites = [s for s in recorder.sites if s.streams == ("image", "image")]
    total = inputs["pixel_values"].shape[0]
    assert len(sites) == len(model.model.visual.blocks)
    first = GRID[family][0] * GRID[family][1]
    for site in sites:
        probs = site.forward_value
        assert probs.shape[0] == 1 and probs.shape[-2:] == (total, total)
        assert probs[..., :first, first:].abs().max() == 0 and probs[..., first:, :first].abs().max() == 0
        assert torch.allclose(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    if family == "qwen2_5_vl":  # the windowed block: four 2x2-cell windows of 16 patches in the first image
        windowed = sites[0].forward_value[0, :, :first, :first]
        assert windowed[:, :16, 16:].abs().max() == 0 and windowed[:, 16:32, :16].abs().max() == 0
        assert sites[1].forward_value[0, :, :16, 16:first].abs().min() > 0  # the full block sees the whole image


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_score_on_image_token_k_lands_on_its_cell_of_the_resized_image(family):
    """Decoder scores one-hot at image token k, carried through ``token_map`` and ``grid_tokens``
    onto the pixels: the map's peak and most of its mass lie in merged cell k's pixel rectangle."""
    model = model_of(family)
    grid_hw = (4, 8) if family == "qwen2_5_vl" else (4, 4)
    inputs = qwen_pixels([grid_hw])
    ids = torch.tensor([qwen_prompt(BEFORE, grid_hw, AFTER)])
    image = Qwen2VLAdapter().images(model, ids, inputs)[0]
    side = MERGE * PATCH
    for k, position in enumerate(image.positions.tolist()):
        scores = torch.zeros(ids.shape, dtype=torch.float64)
        scores[0, position] = 1.0
        heat = to_pixels(image_token_scores(scores, image), image)
        r, c = divmod(k, grid_hw[1] // MERGE)
        cell = heat[r * side:(r + 1) * side, c * side:(c + 1) * side]
        assert heat.shape == (grid_hw[0] * PATCH, grid_hw[1] * PATCH)
        assert cell.max() == heat.max() and cell.sum() > 0.6 * heat.sum()


def test_the_adapter_is_found_for_the_unmodified_classes():
    for build in FAMILIES.values():
        assert isinstance(get_adapter(build()), Qwen2VLAdapter)


# -- generation -------------------------------------------------------------------------
def prompt_of(family: str, before=BEFORE, after=AFTER):
    return qwen_prompt(before, GRID[family], after)


def single_step_rows(explainer, prompt, target, images):
    """Per step t, the one-step explanation of ``prompt + target[:t]`` (text scores over the
    prompt and the earlier outputs, and the image map)."""
    rows = []
    for t, token in enumerate(target):
        single = explainer.attribute(torch.tensor(prompt + target[:t]), target=[token], **images)
        rows.append((single.token_attr[0], single.image_attr[0]))
    return rows


def plain_scores(model, prompt, target, images) -> torch.Tensor:
    """(T,) the logit of each target token from the model's own forward (its M-RoPE positions)."""
    ids = torch.tensor([prompt + target[:-1]])
    with torch.no_grad():
        logits = model(ids, **images, mm_token_type_ids=(ids == IMAGE).int()).logits[0, len(prompt) - 1:]
    return logits[torch.arange(len(target)), torch.tensor(target)]


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_equal_single_calls_on_each_prefix(family, name):
    model = model_of(family)
    explainer = GenerationAttribution(METHODS[name](model), TOKENIZER)
    images = qwen_pixels([GRID[family]])
    result = explainer.attribute(torch.tensor(prompt_of(family)), target=TARGET, **images)
    height, width = GRID[family][0] * PATCH, GRID[family][1] * PATCH
    assert result.image_attr.shape == (len(TARGET), height, width)
    assert result.image_attr.dtype == torch.float64 and result.image_attr.abs().sum() > 0
    assert result.token_attr.shape[0] == len(TARGET) and result.token_attr.abs().sum() > 0
    assert (result.scores - plain_scores(model, prompt_of(family), TARGET, images)).abs().max().item() < SCORE_TOL
    assert worst_difference(result, single_step_rows(explainer, prompt_of(family), TARGET, images)) < TOL


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sdpa_models_rows_equal_single_calls_on_each_prefix(family, name):
    """Models that run SDPA (transformers' default): the tower's per-image calls run fused where no
    map is recorded, and as one explicit block-diagonal call where one is."""
    model = FAMILIES[family](impl="sdpa")
    explainer = GenerationAttribution(METHODS[name](model), TOKENIZER)
    images = qwen_pixels([GRID[family]])
    result = explainer.attribute(torch.tensor(prompt_of(family)), target=TARGET, **images)
    assert result.image_attr.abs().sum() > 0
    assert (result.scores - plain_scores(model, prompt_of(family), TARGET, images)).abs().max().item() < SCORE_TOL
    assert worst_difference(result, single_step_rows(explainer, prompt_of(family), TARGET, images)) < TOL


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_of_two_equals_single_calls(family, name):
    """Two prompts of different lengths with images of different sizes (left padding, each
    example's own M-RoPE positions), answers of different lengths."""
    model = model_of(family)
    explainer = GenerationAttribution(METHODS[name](model), TOKENIZER)
    grids = [GRID[family], (4, 4) if family == "qwen2_vl" else (8, 4)]
    prompts = [qwen_prompt(BEFORE, grids[0], AFTER), qwen_prompt([1, 4, 10], grids[1], [3])]
    targets = [TARGET, [20, 21]]
    both = qwen_pixels(grids, seed=5)
    results = explainer.attribute([torch.tensor(p) for p in prompts], target=targets, **both)
    spans = patch_row_spans(image_grids(both["image_grid_thw"], PATCH, MERGE))
    for i, (result, prompt, target) in enumerate(zip(results, prompts, targets)):
        own = {"pixel_values": both["pixel_values"][spans[i][0]:spans[i][1]],
               "image_grid_thw": both["image_grid_thw"][i:i + 1]}
        single = explainer.attribute(torch.tensor(prompt), target=target, **own)
        assert result.output_ids == target and result.image_attr.shape == single.image_attr.shape
        assert (result.scores - plain_scores(model, prompt, target, own)).abs().max().item() < SCORE_TOL
        assert (result.token_attr - single.token_attr).abs().max().item() < TOL
        assert (result.target_attr - single.target_attr).abs().max().item() < TOL
        assert (result.image_attr - single.image_attr).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
def test_several_images_in_a_prompt_in_a_batch_equal_single_calls(name):
    """A prompt with two images of different sizes (image_attr: a list, one map per image) next to
    a prompt with one: each example equals its own call."""
    model = model_of("qwen2_vl")
    explainer = GenerationAttribution(METHODS[name](model), TOKENIZER)
    prompts = [qwen_prompt(BEFORE, (4, 4), []) + qwen_prompt([6], (4, 8), AFTER), qwen_prompt([1, 4], (4, 4), [3])]
    grids = [(4, 4), (4, 8), (4, 4)]
    both = qwen_pixels(grids, seed=7)
    results = explainer.attribute([torch.tensor(p) for p in prompts], target=[TARGET, [20]], **both)
    spans = patch_row_spans(image_grids(both["image_grid_thw"], PATCH, MERGE))
    owned = [(0, 2), (2, 3)]
    for result, prompt, target, (first, last) in zip(results, prompts, [TARGET, [20]], owned):
        own = {"pixel_values": both["pixel_values"][spans[first][0]:spans[last - 1][1]],
               "image_grid_thw": both["image_grid_thw"][first:last]}
        single = explainer.attribute(torch.tensor(prompt), target=target, **own)
        maps = result.image_attr if isinstance(result.image_attr, list) else [result.image_attr]
        alone = single.image_attr if isinstance(single.image_attr, list) else [single.image_attr]
        assert [tuple(m.shape[1:]) for m in maps] == [(g[0] * PATCH, g[1] * PATCH) for g in grids[first:last]]
        assert (result.token_attr - single.token_attr).abs().max().item() < TOL
        assert max((a - b).abs().max().item() for a, b in zip(maps, alone)) < TOL
        assert all(m.abs().sum() > 0 for m in maps)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_model_restored_after_a_call_and_after_an_exception(family):
    model = FAMILIES[family](seed=4)
    ids = torch.tensor([prompt_of(family)])
    images = qwen_pixels([GRID[family]])
    kwargs = dict(images, mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        logits = model(ids, **kwargs).logits.clone()
    model.model.rope_deltas = None
    before = snapshot(model)
    GenerationAttribution(AttnLRP(model), TOKENIZER).attribute(ids[0], target=TARGET, **images)
    assert_same(before, snapshot(model))
    assert model.model.rope_deltas is None
    for layer in (model.model.language_model.layers[0], model.model.visual.blocks[0]):
        for method in (AttnLRP(model), GenericAttention(model)):
            with raising_after(layer, RuntimeError("failure inside the forward")), \
                    pytest.raises(RuntimeError, match="failure inside the forward"):
                GenerationAttribution(method, TOKENIZER).attribute(ids[0], target=TARGET, **images)
            assert_same(before, snapshot(model))
            assert model.model.rope_deltas is None
            assert all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids, **kwargs).logits, logits)


def test_processor_output_is_explained_in_the_resized_images_layout():
    """A 20x30 image through Qwen2-VL's processor (resized to 16x32: multiples of patch * merge):
    the image map has the resized image's layout, the one its pixel_values rows tile."""
    processor = transformers.Qwen2VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                                   size={"shortest_edge": 256, "longest_edge": 1024})
    image = (torch.rand(3, 20, 30, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8)
    processed = processor(images=[image], return_tensors="pt")
    grid = tuple(processed["image_grid_thw"][0, 1:].tolist())
    images = {"pixel_values": processed["pixel_values"].to(torch.float64), "image_grid_thw": processed["image_grid_thw"]}
    explainer = GenerationAttribution(GenericAttention(model_of("qwen2_vl")), TOKENIZER)
    result = explainer.attribute(torch.tensor(qwen_prompt(BEFORE, grid, AFTER)), target=TARGET, **images)
    assert grid == (4, 8) and result.image_attr.shape == (len(TARGET), 16, 32)
    assert torch.isfinite(result.image_attr).all() and result.image_attr.abs().sum() > 0


@pytest.mark.parametrize("name", ["AttnLRP", "GenericAttention"])
def test_images_given_as_images_equal_the_processors_patch_rows(name):
    """``images=`` (one (C, H, W) image per prompt, normalized) is laid out as the processor's
    rows: the maps equal those of the rows; a batch of two prompts too."""
    model = model_of("qwen2_5_vl")
    explainer = GenerationAttribution(METHODS[name](model), TOKENIZER)
    pictures = torch.randn(2, 3, 16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    rows, thw = patchify(pictures, PATCH, MERGE, TEMPORAL)
    prompts = [torch.tensor(qwen_prompt(BEFORE, (4, 8), AFTER)), torch.tensor(qwen_prompt([1, 4], (4, 8), [3]))]
    given = explainer.attribute(prompts, target=[TARGET, [20]], images=[pictures[0], pictures[1]])
    as_rows = explainer.attribute(prompts, target=[TARGET, [20]], pixel_values=rows, image_grid_thw=thw)
    for a, b in zip(given, as_rows):
        assert a.image_attr.shape == (len(a.output_ids), 16, 32)
        assert (a.image_attr - b.image_attr).abs().max().item() < TOL
        assert (a.token_attr - b.token_attr).abs().max().item() < TOL
    with pytest.raises(InputError, match="carry their own grid"):
        explainer.attribute(prompts[0], target=[9], pixel_values=pictures[:1], image_grid_thw=thw[:1])


def test_generation_inputs_give_generate_the_processors_keywords():
    """``generation_inputs``: what ``model.generate`` needs next to the ids (the patch rows and grid
    of images given as such, mm_token_type_ids): the same tokens as the processor's inputs."""
    model = build_qwen2_vl(seed=1)
    ids = torch.tensor([prompt_of("qwen2_vl")])
    picture = torch.randn(1, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    keywords = Qwen2VLAdapter().generation_inputs(model, ids, {"pixel_values": picture})
    assert sorted(keywords) == ["image_grid_thw", "mm_token_type_ids", "pixel_values"]
    rows, thw = patchify(picture, PATCH, MERGE, TEMPORAL)
    args = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        ours = model.generate(input_ids=ids, **keywords, **args)
        theirs = model.generate(input_ids=ids, pixel_values=rows, image_grid_thw=thw,
                                mm_token_type_ids=(ids == IMAGE).int(), **args)
    assert torch.equal(ours, theirs)


def _greedy_answer(model: torch.nn.Module, ids: torch.Tensor, args: dict, **keywords) -> list:
    """HF generate's answer with the processor's inputs (mm_token_type_ids), cut after the first end token."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, **keywords, mm_token_type_ids=(ids == IMAGE).int(), **args)
    answer = out[0, ids.shape[1]:].tolist()
    return answer[:answer.index(EOS) + 1] if EOS in answer else answer


@pytest.mark.parametrize("seed", [1, 2])
def test_generated_target_is_the_models_greedy_generate_with_its_processor_inputs(seed):
    """target=None: the tokens HF generate writes given the processor's inputs (mm_token_type_ids,
    from which M-RoPE places the image), cut after the first end token."""
    model = build_qwen2_vl(seed=seed)
    ids = torch.tensor([prompt_of("qwen2_vl")])
    images = qwen_pixels([GRID["qwen2_vl"]], seed=seed)
    args = {"max_new_tokens": 5, "do_sample": False}
    result = GenerationAttribution(AttnLRP(model), TOKENIZER).attribute(ids[0], gen_args=args, **images)
    assert result.output_ids == _greedy_answer(model, ids, args, **images)


def test_generated_target_with_images_given_as_pictures():
    """target=None with ``images=`` one (C, H, W) picture: generate reads the processor's patch
    rows and grid of it (HF's generate cannot take the picture itself)."""
    model = build_qwen2_vl(seed=1)
    ids = torch.tensor([prompt_of("qwen2_vl")])
    picture = torch.randn(3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rows, thw = patchify(picture[None], PATCH, MERGE, TEMPORAL)
    args = {"max_new_tokens": 5, "do_sample": False}
    result = GenerationAttribution(AttnLRP(model), TOKENIZER).attribute(ids[0], gen_args=args, images=picture)
    assert result.output_ids == _greedy_answer(model, ids, args, pixel_values=rows, image_grid_thw=thw)
    assert result.image_attr.shape == (len(result.output_ids), 16, 16)


# -- refusals ---------------------------------------------------------------------------
def test_direct_return_tokens_refuses_the_unscored_tower_stream():
    """A direct call with one (1, C, H, W) picture scores the decoder's tokens; return_tokens=True
    (the vision tower's tokens, unscored by it: an all-zero map) is refused."""
    model = model_of("qwen2_vl")
    ids = torch.tensor([prompt_of("qwen2_vl")])
    picture = torch.randn(1, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with pytest.raises(InputError, match="GenerationAttribution"):
        AttnLRP(model).attribute(ids, target=9, forward_kwargs={"pixel_values": picture}, return_tokens=True)
    decoder = AttnLRP(model).attribute(ids, target=9, forward_kwargs={"pixel_values": picture})
    assert decoder.shape == ids.shape and decoder.abs().sum() > 0


def test_videos_and_mismatched_placeholders_are_refused():
    model = model_of("qwen2_vl")
    explainer = GenerationAttribution(AttnLRP(model), TOKENIZER)
    video = qwen_pixels([(4, 4)])
    video["image_grid_thw"] = torch.tensor([[2, 2, 4]])
    with pytest.raises(InputError, match="temporal patches"):
        explainer.attribute(torch.tensor(prompt_of("qwen2_vl")), target=[9], **video)
    with pytest.raises(InputError, match="image tokens"):
        explainer.attribute(torch.tensor(qwen_prompt(BEFORE, (4, 8), AFTER)), target=[9], **qwen_pixels([(4, 4)]))
    with pytest.raises(InputError, match="patches but pixel_values has"):
        rows = qwen_pixels([(4, 4)])
        rows["pixel_values"] = rows["pixel_values"][:-4]
        explainer.attribute(torch.tensor(prompt_of("qwen2_vl")), target=[9], **rows)
