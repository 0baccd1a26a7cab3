"""Images and audio in the sweep: small sizes of vision and audio configs, the batch of two
inputs of each, and the check that a forward-only method reads the rows the head reads.

Sizes (:func:`shrink_media`, after the generic rules of :mod:`.shrink`): images of 32 x 32
pixels, patches of at most 8; one block per stage (``depths``), the stages kept; per-stage
widths (``hidden_sizes``, ``embed_dims``, ...) divided by 16 and rounded up to a multiple of 4
(8 at least); convolutional feature extractors of audio models 32 channels per layer, their
strides and kernels kept; positional convolutions of 8 taps in 4 groups. What these rules
cannot build is a row of :data:`MEDIA_OVERRIDES`.

Inputs (:func:`media_inputs`): seeded standard-normal pixels ``(2, C, S, S)``, waveforms
``(2, L)`` long enough for 8 frames after the feature extractor's strides, and features
(log-mel ``(2, mels, frames)`` for Whisper, ``(2, frames, mels)`` for AST and w2v-BERT), the
same length in both rows: no padding (a padded audio batch is not measured here). Siglip 2 takes
its processor's flattened patches ``(2, 16, C * 8 * 8)`` with an all-ones patch mask and a 4 x 4
grid shape.

The rows check (:func:`read_rows_problem`): raw attention, rollout and attention flow take no
gradient, so the package's own check of the rows a head reads (its gradient at the last
attention output) cannot run for them. The harness makes it: the rows whose gradient of the
explained logit at the output of the last self-attention block is not zero (a forward hook,
then ``torch.autograd.grad``) must be the rows the method's trace explains, weighted as the
head weights them (equal weights when it averages).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

IMAGE_SIZE, MAX_PATCH, CONV_CHANNELS, POS_CONV, POS_CONV_GROUPS, FRAMES = 32, 8, 32, 8, 4, 8
MEDIA_INPUTS = ("pixel_values", "input_values", "input_features")
STAGE_WIDTHS = ("hidden_sizes", "embed_dims", "neck_hidden_sizes", "base_attn_unit_dims", "stage_in_channels",
                "stage_mid_channels", "stage_out_channels")
ROW_READING_FORWARD = ("raw-attention", "rollout", "attention-flow")

# Per-family sizes the rules above cannot set (values set after them).
MEDIA_OVERRIDES: Dict[str, Dict[str, Any]] = {
    # AST: a spectrogram of 24 frames x 16 mel bins in 8 x 8 patches (4 x 1 of them, plus 2 tokens).
    "audio-spectrogram-transformer": {"max_length": 24, "num_mel_bins": 16, "frequency_stride": 8,
                                      "time_stride": 8},
    # Perceiver: 256 latents of 1280 by default over 224 x 224 pixels (270 M parameters in float64).
    "perceiver": {"num_latents": 8, "d_latents": 32, "num_blocks": 1, "num_self_attends_per_block": 2,
                  "num_self_attention_heads": 4, "num_cross_attention_heads": 1},
    # CvT: three stages of 1, 2 and 10 blocks, widths 64, 192, 384 over 1, 3, 6 heads (a stage indexes its
    # drop-path rates by its own index: stage i needs more than i blocks).
    "cvt": {"embed_dim": [16, 32, 48], "num_heads": [1, 2, 4], "depth": [1, 2, 3], "drop_path_rate": [0.0] * 3},
    # Windows of 7 x 7 over the 8 x 8 patch grid of a 32-pixel image: windows of 4.
    "swin": {"window_size": 4}, "donut-swin": {"window_size": 4},
    # LeViT: a stem of four stride-2 convolutions, whose total stride its attention biases assume.
    "levit": {"patch_size": 16},
    # Stage widths divisible by PVTv2's 1, 2, 5 and 8 heads.
    "pvt_v2": {"hidden_sizes": [8, 16, 40, 64]},
    # Siglip 2: 256 patch positions by default; a 4 x 4 grid of 8-pixel patches here.
    "siglip2": {"vision_config": {"num_patches": 16}},
    # MobileViT v2 downsamples 32 times before its last attention stage.
    "mobilevitv2": {"image_size": 64}, "mobilevit": {"image_size": 64},
    # CNNs: group norms of 8 groups over bottlenecks of 8 channels (BiT); EfficientNet's head width as
    # computed from its width coefficient; HGNetV2's stem ending in the first stage's width.
    "bit": {"hidden_sizes": [32, 64, 128, 256], "num_groups": 8},
    "efficientnet": {"hidden_dim": 2560},
    "hgnet_v2": {"stem_channels": [3, 8, 8]},
}


def _stage_width(value: int) -> int:
    return max(8, 4 * math.ceil(value / 16 / 4))


def shrink_media(values: Mapping[str, Any]) -> Dict[str, Any]:
    """A shrunk config dict (:func:`.shrink.shrink_config_dict`) with the image and audio sizes
    of this module; vision and audio sub-configs too."""
    small = dict(values)
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or "image_size" in value):
            small[key] = shrink_media(value)
        elif key == "image_size":
            small[key] = [IMAGE_SIZE] * len(value) if isinstance(value, list) else IMAGE_SIZE
        elif key == "patch_size" and isinstance(value, int) and value > MAX_PATCH:
            small[key] = MAX_PATCH
        elif key == "depths" and isinstance(value, list):
            small[key] = [1] * len(value)
        elif key in STAGE_WIDTHS and isinstance(value, list) and all(isinstance(v, int) for v in value):
            small[key] = [_stage_width(v) for v in value]
        elif key == "conv_dim" and isinstance(value, list):
            small[key] = [CONV_CHANNELS] * len(value)
        elif key == "num_conv_pos_embeddings":
            small[key] = POS_CONV
        elif key == "num_conv_pos_embedding_groups":
            small[key] = POS_CONV_GROUPS
        elif key in ("out_features", "out_indices", "stage_names"):
            small.pop(key)  # backbone bookkeeping named after the default stages
    return small


def media_reason(model_class: Any) -> Optional[str]:
    """Why ``model_class`` is not measured here (its input is no image or audio tensor), or None."""
    main_input = getattr(model_class, "main_input_name", "input_ids")
    if main_input not in MEDIA_INPUTS:
        return f"other inputs (input {main_input}: text, image-text or raw bytes)"
    return None


def _sub(config: Any, name: str) -> Any:
    """``config.name``, else the first vision / audio sub-config's (None if none has it)."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    for sub_name in getattr(config, "sub_configs", {}):
        value = getattr(getattr(config, sub_name, None), name, None)
        if value is not None:
            return value
    return None


def _pixels_shape(config: Any) -> Tuple[int, ...]:
    size = _sub(config, "image_size") or IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return (2, _sub(config, "num_channels") or 3, height, width)


def _waveform_length(config: Any) -> int:
    """Samples for :data:`FRAMES` frames after the feature extractor's convolutions."""
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides:
        return 16000
    length = FRAMES
    for kernel, stride in reversed(list(zip(kernels, strides))):
        length = (length - 1) * stride + kernel
    return length


def media_inputs(model: torch.nn.Module, seed: int) -> Tuple[str, torch.Tensor, Dict[str, torch.Tensor]]:
    """The main input's name, a seeded batch of two (see the module docstring) and the other
    keyword tensors the model needs (Siglip 2's patch mask and grid shapes)."""
    config = model.config
    name = type(model).main_input_name
    generator = torch.Generator().manual_seed(seed)
    model_type = getattr(config, "model_type", "")
    dtype = next(model.parameters()).dtype
    if model_type == "siglip2":  # patches flattened by its processor: (B, patches, C * P * P), a 4 x 4 grid
        vision = config.vision_config
        side = int(vision.num_patches ** 0.5)
        patches = torch.randn(2, side * side, vision.num_channels * vision.patch_size ** 2, generator=generator,
                              dtype=dtype)
        return name, patches, {"pixel_attention_mask": torch.ones(2, side * side, dtype=torch.long),
                               "spatial_shapes": torch.tensor([[side, side]] * 2)}
    if name == "pixel_values":
        shape = _pixels_shape(config)
    elif name == "input_values" and model_type == "audio-spectrogram-transformer":
        shape = (2, config.max_length, config.num_mel_bins)
    elif name == "input_values":
        shape = (2, _waveform_length(config))
    elif model_type == "whisper":
        shape = (2, config.num_mel_bins, 2 * config.max_source_positions)
    else:  # w2v-BERT and the like: (frames, features)
        shape = (2, 2 * FRAMES, getattr(config, "feature_projection_input_dim", 80))
    return name, torch.randn(shape, generator=generator, dtype=dtype), {}


# -- the rows a head reads ------------------------------------------------------------------
def head_rows(model: torch.nn.Module, blocks: List[torch.nn.Module], kwargs: Dict[str, torch.Tensor], score,
              num_tokens: int) -> Optional[torch.Tensor]:
    """The rows (B, N) that the explained scores (``score(output)``, (B,)) depend on (a
    non-zero gradient) at the last output (B, N, D) of any of ``blocks`` over ``num_tokens``
    tokens: an attention-pooling head's probe query (B, 1, D) and windowed calls are passed
    over. None when no call's output has that shape."""
    kept: List[torch.Tensor] = []
    batch = next(iter(kwargs.values())).shape[0]

    def keep(module, args, output):
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape[:2]) == (batch, num_tokens) and tensor.dim() == 3:
            kept.append(tensor)

    handles = [block.register_forward_hook(keep) for block in blocks]
    try:
        with torch.enable_grad():
            output = model(**kwargs)
            if not kept or not kept[-1].requires_grad:
                return None
            grad, = torch.autograd.grad(score(output).sum(), kept[-1], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    if grad is None:
        return torch.zeros(kept[-1].shape[:2], dtype=torch.bool)
    return grad.ne(0).any(dim=-1)


def explained_weights(method: Any, inputs: Any, target: Any, forward_kwargs: Dict[str, torch.Tensor]
                      ) -> Optional[torch.Tensor]:
    """The weight (B, N) the method's trace gives each token of the last layer (normalised
    per example); None if the trace has no row layout."""
    layout = method.trace(inputs, target=target, forward_kwargs=forward_kwargs or None).layout
    rows = getattr(layout, "query_rows", None)
    if rows is None:
        return None
    given = torch.ones(rows.shape) if layout.query_weights is None else layout.query_weights.detach().cpu()
    weights = torch.zeros(rows.shape[0], layout.num_tokens, dtype=torch.float64)
    weights.scatter_add_(1, rows.cpu(), (given / given.sum(1, keepdim=True)).double())
    return weights


def read_rows_problem(model: torch.nn.Module, method: Any, example: Any, score) -> Tuple[Optional[str], str]:
    """``(problem, note)``: the problem when the method's explained rows are not the rows the
    head reads (equal weights over them), None when they are; the note says what was checked."""
    blocks = [b.module for b in method.adapter.blocks(model) if b.kind == "self"]
    weights = explained_weights(method, example.method_inputs, example.target, example.forward_kwargs)
    if weights is None or not blocks:
        return None, "rows not checked (no row layout or no self-attention block)"
    read = head_rows(model, blocks, example.model_kwargs, score, weights.shape[1])
    if read is None:
        return None, f"rows not checked (no block output over the trace's {weights.shape[1]} tokens)"
    for row in range(read.shape[0]):
        reads = read[row].nonzero().flatten().tolist()
        explains = (weights[row] > 0).nonzero().flatten().tolist()
        if reads != explains:
            return (f"explains row(s) {_rows_text(explains)} of example {row}, but the head reads "
                    f"{_rows_text(reads)}"), ""
        expected = read[row].double() / read[row].sum()
        if not torch.allclose(weights[row], expected, rtol=1e-6, atol=1e-9):
            return f"weights the rows of example {row} unlike the head's equal weights", ""
    return None, "rows = the head's"


def _rows_text(rows: List[int]) -> str:
    if len(rows) > 6:
        return f"[{rows[0]}, {rows[1]}, ..., {rows[-1]}] ({len(rows)} rows)"
    return str(rows)
