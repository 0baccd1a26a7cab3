"""Trust review 3, the model zoo: OPT's flattened residual adds under TransformerRelevance (8a),
blank-map warnings per method and per stream (8b), refusals that leave ProphetNet and Canine
exactly as they were (8c), Whisper's audio features (9a) and heads that mean-pool patch tokens
without a CLS token (Siglip, I-JEPA; 9b)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from captum_transformers import AttnLRP, CaptureError, GenericAttention, InputError, PartialLRP, TransformerRelevance
from captum_transformers.adapters.huggingface import HuggingFaceAdapter
from captum_transformers.methods.grad_cam import BLANK_MAP_WARNING, AttentionGradCAM
from captum_transformers.methods.lrp import RuleGradientXInput
from captum_transformers.propagation.rules.rule_set import RuleSet

from hf_models import CASES
from restore import assert_same, snapshot

transformers = pytest.importorskip("transformers")


def _caught(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught]


# -- 8a: OPT flattens (B, N, D) to (B * N, D) around its feed-forward residual add -----------------
def _opt():
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                    num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                                    num_labels=3, pad_token_id=1)
    return transformers.OPTForSequenceClassification(config).double().eval()


def _opt_batch():
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    ids[1, 4:] = 1  # right padding with the pad token, which the head uses to find the last real token
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("explain", [
    lambda m, ids, mask: TransformerRelevance(m).attribute(ids, target=1, forward_kwargs={"attention_mask": mask},
                                                           return_tokens=True),
    lambda m, ids, mask: RuleGradientXInput(m, RuleSet.CHEFER).attribute(
        ids, target=1, forward_kwargs={"attention_mask": mask}, return_tokens=True),
], ids=["TransformerRelevance", "Chefer rules x input"])
def test_opt_normalized_adds_batch_equals_single_or_refuse(explain):
    model = _opt()
    ids, mask = _opt_batch()
    singles = [explain(model, ids[i:i + 1, :n], mask[i:i + 1, :n]) for i, n in enumerate((6, 4))]
    try:
        batched = explain(model, ids, mask)
    except CaptureError as error:  # refused: never a map mixing the examples' normalisations
        message = str(error)
        assert "normalised add" in message and "(12, 16)" in message and "one example at a time" in message
        return
    for i, n in enumerate((6, 4)):
        torch.testing.assert_close(batched[i:i + 1, :n], singles[i], rtol=0, atol=1e-12)


def test_opt_batches_still_run_where_no_add_is_normalised():
    model = _opt()
    ids, mask = _opt_batch()
    for method in (GenericAttention(model), AttnLRP(model)):
        batched = method.attribute(ids, target=1, forward_kwargs={"attention_mask": mask}, return_tokens=True)
        single = method.attribute(ids[1:, :4], target=1, forward_kwargs={"attention_mask": mask[1:, :4]},
                                  return_tokens=True)
        torch.testing.assert_close(batched[1:, :4], single, rtol=0, atol=1e-12)


# -- 8b: blank maps ------------------------------------------------------------------------------------
def test_partial_lrp_warns_on_a_blank_map_as_grad_cam_does():
    from captum_transformers.methods.base import blank_map_warning

    case = CASES["bert"]
    model = case.model(seed=3, dtype=torch.float64)
    ids, kwargs = case.inputs(batch=3, seed=3)
    scores, caught = _caught(lambda: PartialLRP(model).attribute(ids, target=0, forward_kwargs=kwargs,
                                                               return_tokens=True))
    assert bool((scores[0] == 0).all()) and bool((scores[1:].abs().amax(1) > 0).all())
    assert blank_map_warning(PartialLRP) in caught
    # One text for both methods, and Grad-CAM's stays what it was.
    assert BLANK_MAP_WARNING == blank_map_warning(AttentionGradCAM)
    # A map with positive entries everywhere comes without.
    _, caught = _caught(lambda: PartialLRP(model).attribute(ids[1:], target=0,
                                                          forward_kwargs={"attention_mask": kwargs["attention_mask"][1:]}))
    assert not [m for m in caught if "0 everywhere" in m]


def test_a_blank_stream_warns_by_name_even_when_another_stream_has_evidence():
    from captum_transformers.methods.base import blank_map_warning, warn_if_blank

    scores = {"encoder": torch.zeros(2, 5), "decoder": torch.tensor([[0.0, 0.3], [0.2, 0.0]])}
    returned, caught = _caught(lambda: warn_if_blank(scores, AttentionGradCAM))
    assert returned is scores
    assert caught == [blank_map_warning(AttentionGradCAM, "encoder")]
    assert "'encoder' stream" in caught[0]
    both = {"encoder": torch.tensor([[0.0, 0.1]]), "decoder": torch.zeros(1, 3)}
    _, caught = _caught(lambda: warn_if_blank(both, PartialLRP))
    assert caught == [blank_map_warning(PartialLRP, "decoder")]
    _, caught = _caught(lambda: warn_if_blank({"encoder": torch.ones(1, 2), "decoder": torch.ones(1, 3)}, PartialLRP))
    assert caught == []


def test_grad_cam_warns_per_blank_stream_of_a_seq2seq_model(monkeypatch):
    from captum_transformers.methods.base import blank_map_warning
    from test_hf_streams import bart, seq2seq_inputs

    model = bart()
    (source, prefix), kwargs = seq2seq_inputs()
    original = AttentionGradCAM._reduce

    def encoder_blank(self, trace):  # the rectification left the encoder stream blank
        scores = original(self, trace)
        return {**scores, "encoder": torch.zeros_like(scores["encoder"])}

    monkeypatch.setattr(AttentionGradCAM, "_reduce", encoder_blank)
    _, caught = _caught(lambda: AttentionGradCAM(model).attribute((source, prefix), target=5, forward_kwargs=kwargs))
    assert blank_map_warning(AttentionGradCAM, "encoder") in caught
    assert blank_map_warning(AttentionGradCAM, "decoder") not in caught


# -- 8c: a refused call leaves the model exactly as it was ------------------------------------------
def _prophetnet(dtype):
    torch.manual_seed(0)
    config = transformers.ProphetNetConfig(
        vocab_size=50, hidden_size=16, encoder_ffn_dim=32, decoder_ffn_dim=32, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=2, num_decoder_attention_heads=2,
        max_position_embeddings=32, ngram=2, num_buckets=8, relative_max_distance=16)
    model = transformers.ProphetNetForConditionalGeneration(config).to(dtype).eval()
    ids = torch.randint(3, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    prefix = torch.randint(3, 50, (2, 4), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return model, (ids, prefix), {"attention_mask": mask}, \
        lambda: model(input_ids=ids, decoder_input_ids=prefix, attention_mask=mask, output_hidden_states=True)


def _canine(dtype):
    torch.manual_seed(0)
    config = transformers.CanineConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_hash_functions=2,
        num_hash_buckets=16, downsampling_rate=2, upsampling_kernel_size=2, local_transformer_stride=4,
        max_position_embeddings=64, num_labels=3)
    model = transformers.CanineForSequenceClassification(config).to(dtype).eval()
    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    return model, ids, {"attention_mask": mask}, \
        lambda: model(input_ids=ids, attention_mask=mask, output_hidden_states=True)


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if hasattr(output, "to_tuple"):
        return _tensors(output.to_tuple())
    return []


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN at the same places counting as equal (``torch.equal(nan, nan)`` is
    False: ProphetNet's and Canine's float64 forwards give NaN outputs for a padded batch, their
    masks overflowing float32, which a plain comparison reads as a change)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


def _module_attributes(model: nn.Module) -> dict:
    """Every instance attribute of every module (tensors cloned, containers copied), its class and
    its config's class and values."""
    found = {}
    for name, module in model.named_modules():
        found[(name, "__class__")] = type(module)
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, torch.Tensor):
                value = value.detach().clone()
            elif isinstance(value, (dict, list, set)):
                value = type(value)(value) if not isinstance(value, dict) else dict(value)
            found[(name, key)] = value
        config = getattr(module, "config", None)
        if config is not None:
            found[(name, "config class")] = type(config)
            found[(name, "config")] = repr(sorted((k, repr(v)) for k, v in vars(config).items()))
    return found


def _same_attributes(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and _bitwise_equal(value, other), key
        else:
            assert value is other or value == other, key


@pytest.mark.parametrize("build, dtype", [(_prophetnet, torch.float32), (_prophetnet, torch.float64),
                                          (_canine, torch.float32), (_canine, torch.float64)],
                         ids=["prophetnet-float32", "prophetnet-float64", "canine-float32", "canine-float64"])
@pytest.mark.parametrize("method", [GenericAttention, TransformerRelevance, AttnLRP])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_a_refused_call_leaves_outputs_state_and_attributes_unchanged(build, dtype, method, frozen):
    model, inputs, kwargs, forward = build(dtype)
    if frozen:
        model.requires_grad_(False)
    with torch.no_grad():
        before_outputs = _tensors(forward())
    before, attributes = snapshot(model), _module_attributes(model)
    rng = torch.get_rng_state()
    with pytest.raises(CaptureError, match="computed no attention"):
        method(model).attribute(inputs, target=3, forward_kwargs=kwargs)
    assert torch.equal(rng, torch.get_rng_state())
    assert_same(before, snapshot(model))
    _same_attributes(attributes, _module_attributes(model))
    with torch.no_grad():
        after_outputs = _tensors(forward())
    assert len(before_outputs) == len(after_outputs)
    assert all(_bitwise_equal(a, b) for a, b in zip(before_outputs, after_outputs))


# -- 9a: Whisper ------------------------------------------------------------------------------------
def _whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=60, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=10,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        attn_implementation="eager")
    model = transformers.WhisperForConditionalGeneration(config).double().eval()
    features = torch.randn(2, 8, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    prefix = torch.tensor([[1, 5, 7], [1, 9, 4]])
    return model, features, prefix


def _abar(attention, grad):
    return (attention * grad).clamp(min=0).mean(dim=1)


def _normalized(self_map):
    """Eq. 8-9 of Chefer et al. (ICCV 2021): the map less I, each row divided by its sum, plus I."""
    eye = torch.eye(self_map.shape[-1], dtype=self_map.dtype)
    hat = self_map - eye
    sums = hat.sum(-1, keepdim=True)
    return torch.where(sums != 0, hat / torch.where(sums != 0, sums, torch.ones_like(sums)), 0 * hat) + eye


def _reference_generic_attention(model, features, prefix, target):
    """GenericAttention from the model's own eager maps (output_attentions=True), one example at a
    time, written from Eq. 6-7 (self-attention) and Eq. 10-11 (cross-attention; no R^ed)."""
    encoder_scores, decoder_scores = [], []
    for i in range(features.shape[0]):
        out = model(input_features=features[i:i + 1], decoder_input_ids=prefix[i:i + 1], output_attentions=True)
        score = out.logits[0, -1, target]
        maps = list(out.encoder_attentions) + [m for pair in zip(out.decoder_attentions, out.cross_attentions)
                                               for m in pair]
        grads = torch.autograd.grad(score, maps)
        n_enc, n_dec = out.encoder_attentions[0].shape[-1], prefix.shape[1]
        r_ee = torch.eye(n_enc, dtype=torch.float64)
        r_dd, r_de = torch.eye(n_dec, dtype=torch.float64), torch.zeros(n_dec, n_enc, dtype=torch.float64)
        layers = len(out.encoder_attentions)
        for a, g in zip(maps[:layers], grads[:layers]):
            r_ee = r_ee + _abar(a, g)[0] @ r_ee
        for k, (a, g) in enumerate(zip(maps[layers:], grads[layers:])):
            abar = _abar(a, g)[0]
            if k % 2 == 0:  # decoder self-attention
                r_dd, r_de = r_dd + abar @ r_dd, r_de + abar @ r_de
            else:  # cross-attention, decoder queries over encoder keys
                r_de = r_de + _normalized(r_dd).T @ abar @ _normalized(r_ee)
        encoder_scores.append(r_de[-1])
        decoder_scores.append(r_dd[-1])
    return torch.stack(encoder_scores), torch.stack(decoder_scores)


def test_whisper_generic_attention_equals_the_paper_reference_and_maps_onto_the_frames():
    model, features, prefix = _whisper()
    tokens = GenericAttention(model).attribute((features, prefix), target=3, return_tokens=True)
    expected = _reference_generic_attention(model, features, prefix, 3)
    torch.testing.assert_close(tokens[0], expected[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(tokens[1], expected[1], rtol=1e-9, atol=1e-12)
    feature_map, prefix_map = GenericAttention(model).attribute((features, prefix), target=3)
    assert feature_map.shape == features.shape and prefix_map.shape == prefix.shape
    assert bool((feature_map.flatten(1).abs().amax(1) > 0).all())
    # Each encoder token covers two frames (the stride-2 convolution): linear upsampling over time,
    # the same at every mel bin, as an image's patch scores are upsampled over its pixels.
    upsampled = F.interpolate(tokens[0][:, None], size=features.shape[-1], mode="linear", align_corners=False)
    torch.testing.assert_close(feature_map, upsampled.expand(-1, features.shape[1], -1), rtol=1e-12, atol=0)
    # With the decoder prefix by keyword, the features get the same map.
    by_keyword = GenericAttention(model).attribute(features, target=3, forward_kwargs={"decoder_input_ids": prefix})
    torch.testing.assert_close(by_keyword, feature_map, rtol=1e-12, atol=0)


def test_whisper_attn_lrp_is_non_zero_and_its_delta_is_the_token_total_less_the_logit():
    model, features, prefix = _whisper()
    tokens, delta = AttnLRP(model).attribute((features, prefix), target=3, return_tokens=True,
                                             return_convergence_delta=True)
    assert bool((tokens[0].abs().amax(1) > 0).all())
    with torch.no_grad():
        logit = model(input_features=features, decoder_input_ids=prefix).logits[:, -1, 3]
    total = tokens[0].sum(1) + tokens[1].sum(1)
    torch.testing.assert_close(delta, total - logit, rtol=1e-9, atol=1e-12)
    feature_map, _ = AttnLRP(model).attribute((features, prefix), target=3)
    assert feature_map.shape == features.shape and bool((feature_map.flatten(1).abs().amax(1) > 0).all())


class ConvFrontEncoder(nn.Module):
    """A user's model: a strided 1-D convolution over (B, C, T) features, then a BERT encoder
    over the (B, T / 2, D) frames, read at its first token."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(6, 32, kernel_size=3, stride=2, padding=1)
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=10)
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(32, 3)

    def forward(self, features):
        frames = self.conv(features).transpose(1, 2)
        return self.head(self.bert(inputs_embeds=frames).last_hidden_state[:, 0])


def test_features_that_do_not_line_up_with_the_tokens_are_refused_not_zeroed():
    torch.manual_seed(0)
    model = ConvFrontEncoder().eval()
    features = torch.randn(2, 6, 16)
    with pytest.raises(CaptureError, match="return_tokens=True"):
        GenericAttention(model).attribute(features, target=1)
    tokens = GenericAttention(model).attribute(features, target=1, return_tokens=True)
    assert tokens.shape == (2, 8)


# -- 9b: heads that mean-pool the patch tokens (no CLS token) ----------------------------------------
def _siglip():
    torch.manual_seed(0)
    config = transformers.SiglipConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8),
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         vocab_size=99, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        num_labels=3)
    return transformers.SiglipForImageClassification(config).double().eval()


def _ijepa():
    torch.manual_seed(0)
    config = transformers.IJepaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, image_size=32, patch_size=8, num_labels=3)
    return transformers.IJepaForImageClassification(config).double().eval()


@pytest.mark.parametrize("build", [_siglip, _ijepa], ids=["siglip", "ijepa"])
def test_mean_pooling_image_heads_are_explained_at_every_patch_row(build):
    model = build()
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    default = GenericAttention(model).attribute(pixels, target=1, return_tokens=True)
    mean = GenericAttention(model, adapter=HuggingFaceAdapter(query_rows="mean")).attribute(
        pixels, target=1, return_tokens=True)
    torch.testing.assert_close(default, mean, rtol=0, atol=0)
    first = GenericAttention(model, adapter=HuggingFaceAdapter(query_rows=0)).attribute(pixels, target=1,
                                                                                     return_tokens=True)
    assert not torch.allclose(default, first)


def test_siglip2_is_explained_at_its_real_patch_rows_and_a_padded_batch_equals_single():
    torch.manual_seed(0)
    config = transformers.Siglip2Config(
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           patch_size=4, num_patches=16, num_channels=3),
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         vocab_size=99, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        num_labels=3)
    model = transformers.Siglip2ForImageClassification(config).double().eval()
    patches = torch.randn(2, 16, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0
    shapes = torch.tensor([[4, 4], [3, 4]])
    kwargs = {"pixel_attention_mask": mask, "spatial_shapes": shapes}
    default = GenericAttention(model).attribute(patches, target=1, forward_kwargs=kwargs, return_tokens=True)
    mean = GenericAttention(model, adapter=HuggingFaceAdapter(query_rows="mean")).attribute(
        patches, target=1, forward_kwargs=kwargs, return_tokens=True)
    torch.testing.assert_close(default, mean, rtol=0, atol=0)
    assert bool((default[1, 12:] == 0).all())
    single = GenericAttention(model).attribute(patches[1:, :12], target=1, return_tokens=True, forward_kwargs={
        "pixel_attention_mask": mask[1:, :12], "spatial_shapes": shapes[1:]})
    torch.testing.assert_close(default[1:, :12], single, rtol=1e-9, atol=1e-12)


class MeanPooledSiglipTower(nn.Module):
    """A user's head over Siglip's vision tower: the mean of the patch tokens, then a linear layer
    (the tower's own attention-pooling head runs but is not read)."""

    def __init__(self, tower):
        super().__init__()
        self.tower = tower
        self.head = nn.Linear(32, 3)

    def forward(self, pixels):
        return self.head(self.tower(pixels).last_hidden_state.mean(dim=1))


def test_a_user_mean_pooling_head_over_siglip_is_refused_like_dinov2s():
    tower = _siglip().vision_model
    model = MeanPooledSiglipTower(tower).double().eval()
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(InputError, match="query_rows='mean'"):
        GenericAttention(model).attribute(pixels, target=1)
    GenericAttention(model, adapter=HuggingFaceAdapter(query_rows="mean")).attribute(pixels, target=1)
