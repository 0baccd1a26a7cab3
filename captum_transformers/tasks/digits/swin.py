"""The DigitCanvas Swin: a tiny timm Swin Transformer next to the built-in ViT, and its weights.

Architecture: ``SwinTransformer(img_size=32, patch_size=4, embed_dim=48, depths=(2, 2),
num_heads=(2, 4), window_size=4, mlp_ratio=2, num_classes=10)``: an 8x8 patch grid (the ViT's)
in four 4x4 windows, shifted in every second layer, merged once into a 4x4 grid (one window),
averaged by the head. Same input (``digit_canvas.normalize(images)``), classes and training
recipe as the ViT (:mod:`captum_transformers.tasks.digits.train` with ``--model swin``).

The weights ship as ``captum_transformers/assets/digit_swin.pt`` (float16 state dict, loaded
back into float32) next to ``digit_swin.json`` (accuracies, training time, seed, command).

Example::

    >>> from captum_transformers.tasks.digits.swin import load_digit_swin
    >>> swin = load_digit_swin()
    >>> swin(torch.zeros(1, 3, 32, 32)).shape
    torch.Size([1, 10])
"""
from __future__ import annotations

from typing import Any, Dict

from ..shipped_weights import asset, load_shipped_weights

WEIGHTS_FILE = "digit_swin.pt"
RECORD_FILE = "digit_swin.json"
MODEL_CONFIG: Dict[str, Any] = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=48,
                                    depths=(2, 2), num_heads=(2, 4), window_size=4, mlp_ratio=2.0,
                                    drop_path_rate=0.0, global_pool="avg")


def build_digit_swin():
    """A randomly initialised DigitCanvas Swin (``MODEL_CONFIG``), in train mode.

    Example::

        >>> build_digit_swin()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    from timm.models.swin_transformer import SwinTransformer
    return SwinTransformer(**MODEL_CONFIG)


def load_digit_swin():
    """The shipped DigitCanvas Swin in eval mode, float32 (weights stored as float16).

    Raises :class:`InputError` naming the expected path when the weights file is missing.
    """
    return load_shipped_weights(build_digit_swin(), asset(WEIGHTS_FILE), "The DigitCanvas Swin weights",
                                "python -m captum_transformers.tasks.digits.train --model swin")
