"""Audio inputs whose tokens are strided patches, for the HuggingFace adapter: which samples of a
waveform each frame of the wav2vec2 family is computed from, and which cells of AST's log-mel
spectrogram each patch covers (:class:`~captum_transformers.capture.trace.InputSpan`'s ``fields``).

The wav2vec2 family (wav2vec2, HuBERT, Data2Vec-Audio, SEW, SEW-D, UniSpeech, wav2vec2-Conformer)
turns a waveform (B, samples) into frames by unpadded strided convolutions (``config.conv_kernel``,
``config.conv_stride``): frame ``t`` reads the samples ``[t * hop, t * hop + field)``, ``hop`` the
product of the strides and ``field`` the receptive field (400 and 320 at the defaults); SEW then
average-pools ``squeeze_factor`` frames into one token. AST cuts its (frames, mel bins) input into
``patch_size`` squares every ``time_stride`` frames and ``frequency_stride`` bins, enumerated
frequency first, after two class tokens. The token counts are checked against the tokens the
encoder attended over: a layout that does not match is refused, never mapped.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch import nn

from ...errors import CaptureError, InputError


def strided_input_fields(model: nn.Module, config: Any, tensor: torch.Tensor, num_tokens: int):
    """(fields, order, first patch token) of :class:`~captum_transformers.capture.trace.InputSpan`
    for a main input whose tokens are strided patches: a waveform (B, samples) of the wav2vec2
    family (:func:`sample_frames`), AST's spectrogram (B, time, frequency) after its two class
    tokens (:func:`spectrogram_patches`); (None, None, 0) for other inputs. ``config``: the
    pretrained model's."""
    if getattr(config, "model_type", None) == "audio-spectrogram-transformer":
        return spectrogram_patches(config, tensor, num_tokens), (1, 0), 2
    frames = sample_frames(model, config, tensor, num_tokens)
    return (None, None, 0) if frames is None else ((frames,), None, 0)

def spectrogram_patches(config: Any, features: torch.Tensor, num_tokens: int) -> Tuple[Tuple[int, int], ...]:
    """AST: ((field, hop) over time, over frequency) of its patch embedding, checked against
    the tokens: ``config.patch_size`` squares every ``time_stride`` frames and
    ``frequency_stride`` mel bins after its two class tokens, frequency enumerated first."""
    if features.dim() != 3 or not features.is_floating_point():
        raise InputError(
            f"AST takes log-mel features (batch, frames, mel bins); got an input of shape {tuple(features.shape)} "
            f"and dtype {features.dtype}. Pass the features its feature extractor makes.")
    fields = ((config.patch_size, config.time_stride), (config.patch_size, config.frequency_stride))
    patches = math.prod((length - field) // hop + 1 for length, (field, hop) in zip(features.shape[1:], fields))
    if patches + 2 != num_tokens:
        raise CaptureError(
            f"AST attends over {num_tokens} tokens, but its patches of {config.patch_size} every "
            f"({config.time_stride}, {config.frequency_stride}) make {patches} (+ 2 class tokens) of the features of "
            f"shape {tuple(features.shape)}. Pass the features its feature extractor makes, or return_tokens=True.")
    return fields

def sample_frames(model: nn.Module, config: Any, waveform: torch.Tensor, num_tokens: int) -> Optional[Tuple[int, int]]:
    """(field, hop) of the frames of a waveform input (B, L) to a model with a strided
    convolutional feature extractor (``config.conv_kernel``, ``config.conv_stride``: the
    wav2vec2 family), SEW's squeezing of frames into tokens included: token ``t`` is computed
    from the samples ``[t * hop, t * hop + field)``. None for other inputs; a waveform that
    no frame layout maps is refused (zeros would say "nothing mattered")."""
    if waveform.dim() != 2 or not waveform.is_floating_point():
        return None
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides:
        raise CaptureError(
            f"The {num_tokens} token scores cannot be mapped onto the waveform input of shape "
            f"{tuple(waveform.shape)}: {type(model).__name__}'s config names no convolutional feature extractor "
            "(conv_kernel, conv_stride) that says which samples each token is computed from. Pass "
            "return_tokens=True for the (B, N) token scores.")
    field, hop, frames = 1, 1, waveform.shape[1]
    for kernel, stride in zip(kernels, strides):
        field, hop, frames = field + (kernel - 1) * hop, hop * stride, (frames - kernel) // stride + 1
    squeeze = getattr(config, "squeeze_factor", 1) or 1  # SEW: frames average-pooled in groups before attention
    field, hop, frames = field + (squeeze - 1) * hop, hop * squeeze, frames // squeeze
    if frames != num_tokens:
        raise CaptureError(
            f"The audio encoder attends over {num_tokens} tokens, but its feature extractor (kernels {kernels}, "
            f"strides {strides}) makes {frames} frames of the waveform of shape {tuple(waveform.shape)}. Pass the "
            "raw waveform (batch, samples) the model's feature extractor takes, or return_tokens=True.")
    return field, hop
