"""Audio classifiers: the maps reach the waveform's samples (the wav2vec2 family: wav2vec2, HuBERT,
SEW, Data2Vec-Audio, ...) and AST's spectrogram cells, and every row-reading method explains the
frames the head averages.

* The head: a mean of the last layer's frames over the real frames of the padding mask the
  model derives from the samples' ``attention_mask``. The explained rows are exactly the rows
  whose gradient at the last encoder layer's output is non-zero (a hook, independent of the
  package), equally weighted; a padded batch equals each clip alone.
* The samples: frame ``t`` is computed from the samples ``[t * hop, t * hop + field)`` of the
  convolutional feature extractor (SEW: two frames squeezed into one token). Each frame's score is
  spread evenly over them, so the samples' sum is the frames' sum (relevance conserves onto the
  waveform); checked against a slow per-sample loop written from that rule.
* ``use_weighted_layer_sum=True`` (every layer pooled) is refused by the row-reading methods.
* AST: each patch's score spread over its (overlapping) patch of the (frames, mel bins) input.
* CNNs (ResNet) are refused by every attention method in one line naming Captum's methods.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import AttentionRollout, AttnLRP, RawAttention  # noqa: E402
from captum_transformers.errors import CaptureError, NotSoftmaxAttentionError, UnsupportedModelError  # noqa: E402
from captum_transformers.methods.catalog import build_method, resolve_method_names  # noqa: E402

ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=8,
               num_conv_pos_embedding_groups=4, num_labels=3)
FIELD, HOP = 10 + 2 * 5 + 2 * 10, 20  # receptive field and hop of kernels (10, 3, 3), strides (5, 2, 2)


def _build(family, **extra):
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**ENCODER, **extra)
    model = getattr(transformers, f"{family}ForSequenceClassification")(config)
    return model.double().eval()


def _waves(batch=2, length=330):
    return torch.randn(batch, length, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _last_layer_rows(model, waves, mask=None, target=1):
    """Rows (B, N) of the last encoder layer's output whose gradient of the logit is not zero."""
    layer = [m for m in model.modules() if type(m).__name__.endswith("EncoderLayer")
             or type(m).__name__.endswith("EncoderLayerStableLayerNorm")][-1]
    kept = {}

    def keep(module, args, output):
        kept["output"] = output[0] if isinstance(output, tuple) else output

    handle = layer.register_forward_hook(keep)
    try:
        logits = model(waves, attention_mask=mask).logits
    finally:
        handle.remove()
    grad, = torch.autograd.grad(logits[:, target].sum(), kept["output"])
    return grad.ne(0).any(dim=-1)


FAMILIES = {
    "wav2vec2": ("Wav2Vec2", {}),
    "wav2vec2-layer-norm": ("Wav2Vec2", {"feat_extract_norm": "layer", "do_stable_layer_norm": True}),
    "hubert": ("Hubert", {}),
    "data2vec-audio": ("Data2VecAudio", {}),
    "sew": ("SEW", {"squeeze_factor": 2}),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_explained_frames_are_those_the_head_averages(name):
    family, extra = FAMILIES[name]
    model = _build(family, **extra)
    waves = _waves()
    read = _last_layer_rows(model, waves)
    layout = AttentionRollout(model).trace(waves, target=1).layout
    weights = torch.zeros(read.shape, dtype=torch.float64)
    given = torch.ones(layout.query_rows.shape) if layout.query_weights is None else layout.query_weights
    weights.scatter_(1, layout.query_rows, (given / given.sum(1, keepdim=True)).double())
    assert read.all() and torch.equal(weights > 0, read)
    torch.testing.assert_close(weights, read.double() / read.sum(1, keepdim=True))


def test_a_padded_batch_reads_the_real_frames_and_equals_each_clip_alone():
    model = _build("Wav2Vec2", feat_extract_norm="layer", do_stable_layer_norm=True)
    waves = _waves(length=330)
    mask = torch.ones(2, 330, dtype=torch.long)
    mask[1, 250:] = 0
    waves[1, 250:] = 0.0
    read = _last_layer_rows(model, waves, mask)
    assert read[0].all() and 0 < int(read[1].sum()) < read.shape[1]  # the head skips the padded frames
    for method in ("raw-attention", "rollout", "generic-attention", "attn-lrp"):
        explainer = build_method(method, model)
        if method != "attn-lrp":  # (relevance methods read no rows)
            layout = explainer.trace(waves, target=1, forward_kwargs={"attention_mask": mask}).layout
            explained = torch.zeros_like(read)
            explained.scatter_(1, layout.query_rows, True)
            assert torch.equal(explained & layout.token_mask, read), method
        batch = explainer.attribute(waves, target=1, forward_kwargs={"attention_mask": mask})
        for row, length in ((0, 330), (1, 250)):
            alone = explainer.attribute(waves[row:row + 1, :length], target=1)
            torch.testing.assert_close(batch[row, :length], alone[0], rtol=1e-7, atol=1e-12, msg=method)
            assert not batch[row, length:].any()


def _slow_spread(tokens, field, hop, length):
    out = torch.zeros(tokens.shape[0], length, dtype=tokens.dtype)
    for sample in range(length):
        for frame in range(tokens.shape[1]):
            if frame * hop <= sample < frame * hop + field:
                out[:, sample] += tokens[:, frame] / field
    return out


@pytest.mark.parametrize("name", ["wav2vec2", "sew"])
def test_frame_scores_spread_over_each_frames_samples(name):
    family, extra = FAMILIES[name]
    model = _build(family, **extra)
    waves = _waves(length=337)  # a tail of samples no frame reads
    field, hop = (FIELD, HOP) if name == "wav2vec2" else (FIELD + HOP, 2 * HOP)
    for method in (RawAttention(model), AttnLRP(model)):
        tokens = method.attribute(waves, target=1, return_tokens=True)
        samples = method.attribute(waves, target=1)
        assert samples.shape == waves.shape
        torch.testing.assert_close(samples, _slow_spread(tokens.detach(), field, hop, waves.shape[1]))
        torch.testing.assert_close(samples.sum(1), tokens.sum(1))  # conserved onto the waveform
        covered = (tokens.shape[1] - 1) * hop + field
        assert covered < waves.shape[1] and not samples[:, covered:].any()


def test_a_waveform_that_makes_another_number_of_frames_is_refused():
    model = _build("Wav2Vec2")
    method = RawAttention(model)
    trace_tokens = method.attribute(_waves(), target=1, return_tokens=True).shape[1]
    assert trace_tokens == (330 - FIELD) // HOP + 1
    model.config.conv_stride = (5, 2, 3)  # the config no longer says how the frames were made
    try:
        with pytest.raises(CaptureError, match="makes .* frames of the waveform"):
            method.attribute(_waves(), target=1)
    finally:
        model.config.conv_stride = (5, 2, 2)


def test_a_weighted_sum_of_layers_is_refused_by_the_row_methods_and_explained_by_relevance():
    model = _build("Wav2Vec2", use_weighted_layer_sum=True)
    waves = _waves()
    for method in ("raw-attention", "rollout", "generic-attention"):
        with pytest.raises(UnsupportedModelError, match="use_weighted_layer_sum"):
            build_method(method, model).attribute(waves, target=1)
    assert AttnLRP(model).attribute(waves, target=1).shape == waves.shape


def test_cnns_are_refused_in_one_line_by_every_attention_method():
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    model = transformers.ResNetForImageClassification(config).double().eval()
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for name in resolve_method_names(["all"]):
        method = build_method
        if name in ("integrated-gradients", "saliency"):
            assert method(name, model).attribute(pixels, target=1).shape == pixels.shape
            continue
        with pytest.raises(NotSoftmaxAttentionError, match=r"has no attention layer \(it mixes its inputs by "
                                                             r"convolutions and pooling\).*LayerGradCam or LRP"):
            method(name, model).attribute(pixels, target=1)


def test_ast_patch_scores_spread_over_their_overlapping_spectrogram_patches():
    """AST: patches of 8 x 8 every 6 frames and 4 mel bins (overlapping), enumerated frequency
    first after the two class tokens; each patch's score spread over its 64 cells of the
    (frames, mel bins) input, against a slow loop over the cells; the last frame, which no patch
    reads, gets 0."""
    torch.manual_seed(0)
    config = transformers.ASTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    num_mel_bins=16, max_length=27, patch_size=8, frequency_stride=4, time_stride=6,
                                    num_labels=3)
    model = transformers.ASTForAudioClassification(config).double().eval()
    features = torch.randn(2, 27, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    frequencies, times = (16 - 8) // 4 + 1, (27 - 8) // 6 + 1  # 3 x 4 patches over frames 0..25
    for method in (RawAttention(model), AttnLRP(model)):
        tokens = method.attribute(features, target=1, return_tokens=True).detach()
        assert tokens.shape[1] == 2 + frequencies * times
        cells = method.attribute(features, target=1)
        slow = torch.zeros_like(features)
        for f in range(frequencies):
            for t in range(times):
                slow[:, t * 6:t * 6 + 8, f * 4:f * 4 + 8] += tokens[:, 2 + f * times + t, None, None] / 64
        torch.testing.assert_close(cells, slow)
        torch.testing.assert_close(cells.sum((1, 2)), tokens[:, 2:].sum(1))
        assert not cells[:, 26:].any()  # frame 26: after the last patch (frames 18..25)
