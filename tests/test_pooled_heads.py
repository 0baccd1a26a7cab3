"""Pooled heads read what the head reads: for the HuggingFace image and audio classifiers that
average tokens (BEiT and Data2Vec-Vision with and without mean pooling, CLIP's image classifier over its patch
tokens, Whisper's audio classifier over every frame, AST over its
two class tokens), the rows every row-reading method explains are exactly the rows whose gradient
at the last layer's output is non-zero (found here with a hook, independently of the package),
equally weighted as the head averages them; and DINOv2's [CLS, mean of patches] concatenation,
which no weighting of rows describes, is refused by the row-reading methods by name while the
relevance methods explain it."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import AttentionRollout, GenericAttention  # noqa: E402
from captum_transformers.adapters.huggingface.adapter import HuggingFaceAdapter  # noqa: E402
from captum_transformers.errors import UnsupportedModelError  # noqa: E402
from captum_transformers.methods.catalog import build_method  # noqa: E402

VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
              patch_size=8)


def _pixels():
    return torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _beit(mean_pooling, family="Beit"):
    def build():
        torch.manual_seed(0)
        model = getattr(transformers, f"{family}ForImageClassification")(getattr(transformers, f"{family}Config")(
            **VISION, num_labels=3, use_mean_pooling=mean_pooling, attn_implementation="eager"))
        model = model.double().eval()
        return model, _pixels(), _last_layer(model)
    return build


def _last_layer(model):
    """The last encoder layer (the last module whose class name ends with "Layer")."""
    return [module for module in model.modules() if type(module).__name__.endswith("Layer")][-1]


def _clip(head="CLIPForImageClassification", config="CLIPConfig"):
    def build():
        torch.manual_seed(0)
        text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=99)
        made = getattr(transformers, config)(vision_config=VISION, text_config=text, num_labels=3)
        model = getattr(transformers, head)(made).double().eval()
        return model, _pixels(), model.vision_model.encoder.layers[-1]
    return build


def _whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                                        num_mel_bins=16, max_source_positions=8, vocab_size=99, num_labels=3)
    model = transformers.WhisperForAudioClassification(config).double().eval()
    features = torch.randn(2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, features, model.encoder.layers[-1]


def _ast():
    torch.manual_seed(0)
    config = transformers.ASTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    num_mel_bins=16, max_length=24, patch_size=8, frequency_stride=8, time_stride=8,
                                    num_labels=3)
    model = transformers.ASTForAudioClassification(config).double().eval()
    features = torch.randn(2, 24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return model, features, model.audio_spectrogram_transformer.layers[-1]


POOLED = {
    "beit-mean": (_beit(True), "all but the first"), "beit-cls": (_beit(False), "the first"),
    "data2vec-vision-mean": (_beit(True, "Data2VecVision"), "all but the first"),
    "data2vec-vision-cls": (_beit(False, "Data2VecVision"), "the first"),
    "clip": (_clip(), "all but the first"),
    "metaclip-2": (_clip("MetaClip2ForImageClassification", "MetaClip2Config"), "all but the first"), "whisper": (_whisper, "all"),
    "ast": (_ast, "the first two"),
}


def _rows_read(model, inputs, layer, target):
    """Rows (B, N) of ``layer``'s output whose gradient of the target logit is not zero."""
    kept = {}

    def keep(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        tensor.retain_grad()
        kept["output"] = tensor

    handle = layer.register_forward_hook(keep)
    try:
        logits = model(inputs).logits
    finally:
        handle.remove()
    logits[:, target].sum().backward()
    return kept["output"].grad.ne(0).any(dim=-1)


@pytest.mark.parametrize("name", sorted(POOLED))
def test_the_explained_rows_are_the_rows_the_head_reads_equally_weighted(name):
    build, which = POOLED[name]
    model, inputs, layer = build()
    read = _rows_read(model, inputs, layer, target=1)
    layout = AttentionRollout(model).trace(inputs, target=1).layout
    weights = torch.zeros(read.shape, dtype=torch.float64)
    given = torch.ones(layout.query_rows.shape) if layout.query_weights is None else layout.query_weights
    weights.scatter_(1, layout.query_rows.cpu(), (given / given.sum(1, keepdim=True)).double().cpu())
    assert torch.equal(weights > 0, read), (name, which, read[0].nonzero().flatten().tolist())
    expected = read.double() / read.sum(1, keepdim=True)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)  # the head's equal weights
    GenericAttention(model).attribute(inputs, target=1, return_tokens=True)  # the gradient check agrees


@pytest.mark.parametrize("registers", [False, True])
def test_dinov2s_concatenated_head_is_refused_by_the_row_methods_and_explained_by_relevance(registers):
    torch.manual_seed(0)
    if registers:
        model = transformers.Dinov2WithRegistersForImageClassification(transformers.Dinov2WithRegistersConfig(
            **VISION, num_labels=3, num_register_tokens=2)).double().eval()
    else:
        model = transformers.Dinov2ForImageClassification(transformers.Dinov2Config(**VISION, num_labels=3)).double()
        model.eval()
    pixels = _pixels()
    for method in ("raw-attention", "rollout", "grad-cam"):
        with pytest.raises(UnsupportedModelError, match=r"concatenation \[CLS token, mean of the patch tokens"):
            build_method(method, model).attribute(pixels, target=1)
    for method in ("attn-lrp", "conservative-lrp", "gradient-x-input"):
        assert build_method(method, model).attribute(pixels, target=1).shape == pixels.shape
    chosen = AttentionRollout(model, adapter=HuggingFaceAdapter(query_rows=0)).attribute(pixels, target=1)
    assert chosen.shape == pixels.shape  # the CLS row, chosen on purpose
