"""The built-in DigitCanvas classifier: a tiny timm Vision Transformer and its shipped weights.

Architecture: ``VisionTransformer(img_size=32, patch_size=4, embed_dim=64, depth=4,
num_heads=4, mlp_ratio=2, num_classes=10)`` with class-token pooling (64 patch tokens + CLS,
the token whose attention row the explainability methods read). It takes
``digit_canvas.normalize(images)`` and returns one logit per digit class, trained
multi-label (sigmoid per class), so on a two-digit canvas both classes are the top-2 logits.

The weights ship as ``captum_transformers/assets/digit_vit.pt`` (float16 state dict, loaded
back into float32) next to ``digit_vit.json`` (accuracies, training time, seed and the exact
command of :mod:`captum_transformers.tasks.digits.train` that produced them).

Example::

    >>> from captum_transformers.tasks.digits.model import load_digit_model
    >>> from captum_transformers.tasks.digits.canvas import digit_canvases, normalize
    >>> model = load_digit_model()
    >>> data = digit_canvases("test", n=4)
    >>> model(normalize(data.images)).argmax(-1).shape
    torch.Size([4])
"""
from __future__ import annotations

from typing import Any, Dict

from ..shipped_weights import asset, load_shipped_record, load_shipped_weights

WEIGHTS_FILE = "digit_vit.pt"
RECORD_FILE = "digit_vit.json"
MODEL_CONFIG: Dict[str, Any] = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=64, depth=4,
                                    num_heads=4, mlp_ratio=2.0, global_pool="token", class_token=True)


def build_digit_model():
    """A randomly initialised DigitCanvas ViT (``MODEL_CONFIG``), in train mode.

    Example::

        >>> build_digit_model()(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 10])
    """
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(**MODEL_CONFIG)


def weights_path():
    """Where the shipped weights live inside the installed package (a Traversable)."""
    return asset(WEIGHTS_FILE)


def digit_model_record() -> Dict[str, Any]:
    """The JSON record of the shipped weights: test accuracies, seed, training time, command."""
    return load_shipped_record(RECORD_FILE, "The DigitCanvas model record",
                               "python -m captum_transformers.tasks.digits.train")


def load_digit_model():
    """The shipped DigitCanvas ViT in eval mode, float32 (weights stored as float16).

    Raises :class:`InputError` naming the expected path when the weights file is missing.

    Example::

        >>> load_digit_model().training
        False
    """
    return load_shipped_weights(build_digit_model(), weights_path(), "The DigitCanvas weights",
                                "python -m captum_transformers.tasks.digits.train")
