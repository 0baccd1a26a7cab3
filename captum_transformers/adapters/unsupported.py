"""Model families the built-in adapters are known not to fit, refused by name (and the Swin
families, which only their own adapter may explain).

The attention methods chain the maps of one token sequence through every layer, with the
patch tokens of an image forming one fixed grid. Windowed and hierarchical vision models
break both: an attention call sees one window (or a pooled copy) of the tokens, and stages
merge patches into coarser grids. A built-in adapter would at best fail with a grid
mismatch, at worst give maps that look plausible and are wrong, so such a model is refused
before anything runs. A user adapter (``adapter=MyAdapter()``, or one registered for the
model's class) is trusted to handle it.

Example: ``GenericAttention(PvtForImageClassification(config))`` raises
``UnsupportedModelError`` naming PVT and why; ``GenericAttention(swin, adapter="huggingface")``
raises naming the ``swin`` adapter, which explains HF Swin (``docs/windowed-attention.md``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from torch import nn

from ..errors import NotSoftmaxAttentionError, UnsupportedModelError

_SWIN = "windowed attention with cyclic shift and patch merging (each call attends within one window of tokens, " \
        "windows shift between layers, and stages merge patches into coarser grids)"
# Swin blocks inside other models: the swin, swinv2 and timm_swin adapters read HF Swin / Swin v2 and timm
# swin_* / swinv2_* layouts only (docs/windowed-attention.md).
_SWIN_ELSEWHERE = _SWIN + " inside a model whose stages and head the Swin adapters do not read (they explain HF " \
    "Swin, Swin v2 and timm swin_* / swinv2_* classifiers)"
_SCAN = "a selective state-space scan (a linear recurrence over the sequence, with no attention map)"
_PYRAMID = "spatial-reduction attention (keys and values from a downsampled grid) in stages of decreasing resolution"


class Family(NamedTuple):
    name: str
    module: str  # the class's module, or a prefix of it
    class_prefix: str  # "" for every class of that module
    why: str
    # The built-in adapter that does handle the family ("" for none): any other is refused.
    served_by: str = ""
    # False: the family mixes tokens by something other than softmax attention, so methods
    # defined on attention maps do not apply (NotSoftmaxAttentionError), not merely unsupported.
    softmax: bool = True


UNSUPPORTED: Tuple[Family, ...] = (
    Family("Swin", "transformers.models.swin.", "", _SWIN, served_by="swin"),
    Family("Swinv2", "transformers.models.swinv2.", "", _SWIN, served_by="swinv2"),
    Family("Donut-Swin", "transformers.models.donut.modeling_donut_swin", "", _SWIN_ELSEWHERE),
    Family("MaskFormer-Swin", "transformers.models.maskformer.modeling_maskformer_swin", "", _SWIN_ELSEWHERE),
    Family("Swin2SR", "transformers.models.swin2sr.", "", _SWIN_ELSEWHERE),
    Family("CLAP audio (HTS-AT, Swin)", "transformers.models.clap.", "ClapAudio", _SWIN_ELSEWHERE),
    Family("Swin v2 CR (timm)", "timm.models.swin_transformer_v2_cr", "", _SWIN_ELSEWHERE),
    Family("Swin (timm)", "timm.models.swin_transformer", "", _SWIN, served_by="timm_swin"),  # and swin_transformer_v2
    Family("MaxViT", "timm.models.maxxvit", "",
           "block and grid attention over partitions of the feature map, between downsampling MBConv stages"),
    Family("PVT", "transformers.models.pvt.", "", _PYRAMID),
    Family("PVTv2", "transformers.models.pvt_v2.", "", _PYRAMID),
    Family("PVTv2 (timm)", "timm.models.pvt_v2", "", _PYRAMID),
    Family("SegFormer", "transformers.models.segformer.", "", _PYRAMID),
    Family("Twins", "timm.models.twins", "",
           "locally grouped attention in windows alternating with attention to subsampled keys, in stages of "
           "decreasing resolution"),
    Family("CvT", "transformers.models.cvt.", "",
           "convolutional token embeddings at each stage of decreasing resolution (the class token only in the "
           "last) and strided convolutional key and value projections"),
    Family("Hiera", "transformers.models.hiera.", "", "mask-unit (windowed) attention with pooling between stages"),
    Family("Hiera (timm)", "timm.models.hiera", "", "mask-unit (windowed) attention with pooling between stages"),
    Family("DiNAT", "transformers.models.dinat.", "", "neighborhood attention (each token attends to a local window)"),
    Family("NesT", "timm.models.nest", "", "attention within image blocks, aggregated between hierarchy levels"),
    Family("MViTv2", "timm.models.mvitv2", "", "pooling attention (queries, keys and values at other resolutions)"),
    Family("TinyViT", "timm.models.tiny_vit", "", "windowed attention in stages of decreasing resolution"),
    Family("DaViT", "timm.models.davit", "", "windowed spatial attention alternating with channel attention"),
    Family("LeViT", "transformers.models.levit.", "",
           "attention with subsampled queries (LevitAttentionSubsample) between stages of decreasing resolution, "
           "after a convolutional stem"),
    Family("MobileViT", "transformers.models.mobilevit.", "",
           "attention across patches within unfolded feature maps between convolution blocks (each call attends "
           "over one pixel offset of every 2 x 2 patch, so its tokens are no fixed grid of the image)"),
    Family("WavLM", "transformers.models.wavlm.", "",
           "torch's fused multi_head_attention_forward with a gated relative position bias (the map is made inside "
           "torch's kernel, where no adapter observes it)"),
    Family("MobileViTV2", "transformers.models.mobilevitv2.", "",
           "separable self-attention (a softmax over the tokens of one learned context score, no map between "
           "tokens) between convolution blocks", softmax=False),
    Family("SwiftFormer", "transformers.models.swiftformer.", "",
           "efficient additive attention (a softmax over the tokens of one learned query score, pooled into a "
           "single global query, no map between tokens) between convolution blocks", softmax=False),
    Family("DiffLlama", "transformers.models.diffllama.", "",
           "differential attention: each head's weights are the difference of two softmax maps (A1 - lambda A2), "
           "signed and not a probability map, which neither the attention rules nor the relevance rules read",
           softmax=False),
    # Token mixers that are not softmax attention (text models of transformers' auto mappings).
    Family("Mamba", "transformers.models.mamba.", "", _SCAN, softmax=False),
    Family("Mamba-2", "transformers.models.mamba2.", "", _SCAN, softmax=False),
    Family("FalconMamba", "transformers.models.falcon_mamba.", "", _SCAN, softmax=False),
    Family("xLSTM", "transformers.models.xlstm.", "", "a recurrence of gated matrix memories (mLSTM cells)",
           softmax=False),
    Family("RWKV", "transformers.models.rwkv.", "",
           "the WKV recurrence (exponentially decaying weighted sums over the past, no softmax over the sequence)",
           softmax=False),
    Family("FNet", "transformers.models.fnet.", "", "Fourier mixing (a 2-D discrete Fourier transform, no weights "
           "over tokens that depend on the input)", softmax=False),
    Family("Nystromformer", "transformers.models.nystromformer.", "",
           "Nystrom attention (softmax of queries against a few landmark means, combined through a pseudo-inverse: "
           "not a probability map over the tokens)", softmax=False),
    Family("YOSO", "transformers.models.yoso.", "",
           "YOSO attention (the expected collision of locality-sensitive hashes of queries and keys, not a softmax)",
           softmax=False),
)


def unsupported_family(model: nn.Module) -> Optional[Family]:
    """The first family of :data:`UNSUPPORTED` that a module of ``model`` belongs to."""
    seen = set()
    for module in model.modules():
        cls = type(module)
        if cls in seen:
            continue
        seen.add(cls)
        for family in UNSUPPORTED:
            if cls.__module__.startswith(family.module) and cls.__name__.startswith(family.class_prefix):
                return family
    return None


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def attention_free_reason(model: nn.Module, adapter: object) -> Optional[str]:
    """Why ``model`` holds nothing these methods read (None if it may): no attention module the
    built-in ``adapter`` finds and none by class name, but convolutions: a CNN (ResNet,
    ConvNeXt, MobileNet, EfficientNet, RegNet, FocalNet's focal modulation, PoolFormer's pooling)."""
    blocks = getattr(adapter, "blocks", None)
    if blocks is None or is_user_adapter(adapter):
        return None
    classes = {type(module) for module in model.modules()}
    if not any(issubclass(cls, _CONVOLUTIONS) for cls in classes):
        return None
    if any("Attention" in cls.__name__ or issubclass(cls, nn.MultiheadAttention) for cls in classes):
        return None
    try:
        if blocks(model):
            return None
    except Exception:  # an adapter that cannot walk this model: the method's own errors say why
        return None
    return "convolutions" + (" and pooling" if any(cls.__name__.endswith("Pool2d") or "Pooling" in cls.__name__
                                                   for cls in classes) else "")


def refuse_attention_free(model: nn.Module, adapter: object) -> None:
    """:class:`NotSoftmaxAttentionError` for a model without attention (:func:`attention_free_reason`):
    one line naming what mixes its inputs and the methods that do explain it."""
    if not isinstance(model, nn.Module):
        return
    mixers = attention_free_reason(model, adapter)
    if mixers is not None:
        raise NotSoftmaxAttentionError(
            f"{type(model).__name__} has no attention layer (it mixes its inputs by {mixers}), and every method of "
            "captum_transformers reads or propagates through attention: use Captum's LayerGradCam or LRP "
            "(captum.attr), or IntegratedGradients / Saliency (build_method('integrated-gradients', model)).")


def is_user_adapter(adapter: object) -> bool:
    """An adapter instance written outside this package (a user's own), trusted to handle the
    families the built-in adapters refuse."""
    return adapter is not None and not isinstance(adapter, str) and \
        not type(adapter).__module__.startswith("captum_transformers.")


def refuse_unsupported(model: nn.Module, adapter: object = None) -> None:
    """Raise :class:`UnsupportedModelError` if ``model`` holds a family no built-in adapter fits
    and ``adapter`` (None: none found) is a built-in one."""
    if not isinstance(model, nn.Module) or is_user_adapter(adapter):
        return
    family = unsupported_family(model)
    if family is None:
        return
    if family.served_by:
        if getattr(adapter, "name", None) == family.served_by:
            return
        raise UnsupportedModelError(
            f"{type(model).__name__} is (or contains) a {family.name} model ({family.why}), which only the "
            f"{family.served_by!r} adapter explains; the {getattr(adapter, 'name', adapter)!r} adapter would read its "
            f"window maps as one token sequence. Omit adapter= (or pass adapter={family.served_by!r})."
        )
    if not family.softmax:
        raise NotSoftmaxAttentionError(
            f"{type(model).__name__} is (or contains) a {family.name} model, whose tokens are mixed by {family.why}, "
            "not by softmax attention over the sequence, so this method (defined on attention probability maps and "
            "their rules) does not apply to it. Explain it with a method that needs no attention: Captum's "
            "IntegratedGradients or Saliency (build_method('integrated-gradients' or 'saliency', model)), or pass "
            "adapter=YourAdapter() that defines its maps."
        )
    raise UnsupportedModelError(
        f"{type(model).__name__} is (or contains) a {family.name} model, which is not supported yet: "
        f"{family.why}, so its attention maps do not chain over one token sequence as these methods require. "
        "Explain a model with softmax attention over one sequence (ViT, DeiT, BEiT, DINOv2, CLIP, timm "
        "VisionTransformer; BERT, Llama, Qwen2, GPT-2), or pass adapter=YourAdapter() that describes its attention."
    )
