"""timm Swin (``swin_*``, ``swinv2_*``): windowed attention through the timm hooks.

timm's ``WindowAttention`` has the same two paths as its ViT attention (``fused_attn``: SDPA,
or an explicit softmax passed through ``attn_drop``), so :class:`~.timm.TimmAdapter`'s capture
and propagation apply unchanged to it; this adapter adds the Swin geometry (timm shifts the
real grid, then pads: ``pad_first=False``), its layers' ``(B, H, W, C)`` inputs read as tokens,
and the layout of :class:`~.windowed.WindowedAdapterMixin` (``docs/windowed-attention.md``).

Example::

    >>> import timm
    >>> swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=56, embed_dim=16,
    ...                          depths=(2, 2), num_heads=(1, 2), window_size=7).eval()
    >>> maps = GenericAttention(swin).attribute(torch.randn(2, 3, 56, 56), target=[0, 1])
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch
from torch import nn

from ...model_state import patching
from ...compat.compiled import original_module
from ...capture.recorder import Recorder
from ...capture.trace import Block
from ...capture.windows import WindowGeometry
from ...errors import CaptureError
from ...propagation.rules.operations import operation_rules
from ...propagation.rules.rule_set import RuleSet, gate, norm_rules
from .vit import TimmAdapter, is_attention
from ..windowed import WindowedAdapterMixin, note_geometry, start_geometries


def _swin_backbone(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), nn.Module) and isinstance(
                getattr(module, "patch_embed", None), nn.Module):
            return module
    raise CaptureError(f"{type(model).__name__} contains no timm SwinTransformer (a module with `layers` and "
                       "`patch_embed`).")


def _swin_blocks(backbone: nn.Module) -> List[nn.Module]:
    """The Swin blocks in call order: modules with an ``attn``, ``window_size`` and ``shift_size``."""
    return [m for m in original_module(backbone.layers).modules()
            if hasattr(m, "window_size") and hasattr(m, "shift_size") and isinstance(getattr(m, "attn", None),
                                                                                   nn.Module)]


def _pair(value) -> tuple:
    return (int(value[0]), int(value[1])) if isinstance(value, (tuple, list)) else (int(value), int(value))


class TimmSwinAdapter(WindowedAdapterMixin, TimmAdapter):
    """Adapter for timm ``SwinTransformer`` (``swin_*``) and ``SwinTransformerV2`` (``swinv2_*``, cosine
    attention, explicit path only): every attention and relevance method,
    explained at the first stage's patch grid. The head must average the last stage's tokens
    (``global_pool='avg'``, timm's default); other pools are refused."""

    name = "timm_swin"
    families = "timm SwinTransformer (swin_*) and SwinTransformerV2 (swinv2_*)"

    def backbone(self, model: nn.Module) -> nn.Module:
        return _swin_backbone(model)

    def blocks(self, model: nn.Module) -> List[Block]:
        names = {id(m): name for name, m in model.named_modules()}
        blocks = []
        for layer in _swin_blocks(_swin_backbone(model)):
            if not (is_attention(layer.attn) or isinstance(getattr(layer.attn, "attn_drop", None), nn.Dropout)):
                raise CaptureError(f"{type(layer.attn).__name__} in {names[id(layer)]!r} is not a timm window "
                                   "attention with a `fused_attn` flag and `attn_drop`; pass a custom adapter.")
            blocks.append(Block(names[id(layer.attn)], layer.attn, "self"))
        if not blocks:
            raise CaptureError(f"{type(model).__name__} has no Swin block with window attention.")
        return blocks

    @staticmethod
    def _check_pooling(backbone: nn.Module) -> None:
        pool = getattr(backbone, "global_pool", "avg")
        if pool != "avg":
            raise CaptureError(
                f"{type(backbone).__name__} pools its last tokens with global_pool={pool!r}; the windowed methods "
                "explain the mean of the last stage's tokens (global_pool='avg', timm's default). Use 'avg'."
            )

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        start_geometries(recorder)

        def observe(layer, args, output):
            grid = (int(args[0].shape[1]), int(args[0].shape[2]))  # (B, H, W, C)
            note_geometry(recorder, WindowGeometry(grid, _pair(layer.window_size), _pair(layer.shift_size),
                                                   pad_first=False))

        with contextlib.ExitStack() as stack:
            for stage in original_module(_swin_backbone(model).layers).children():
                if getattr(stage, "grad_checkpointing", False):
                    # timm checkpoints per stage (in eval mode too): a checkpointed stage re-runs its
                    # blocks in the backward pass, outside this capture. Run them plainly.
                    stack.enter_context(patching.flag(stage, "grad_checkpointing", False))
            stack.enter_context(super().capture(model, recorder))
            for layer in _swin_blocks(_swin_backbone(model)):
                stack.enter_context(patching.forward_hook(layer, observe))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        """timm's rules (:meth:`TimmAdapter.propagation`); Swin v2's window attention has only the
        explicit path (no ``fused_attn``): the AH gate detaches its ``attn_drop`` output."""
        blocks = self.blocks(model)
        if all(hasattr(block.module, "fused_attn") for block in blocks):
            with TimmAdapter.propagation(self, model, rules):
                yield
            return
        with contextlib.ExitStack() as stack:
            if rules.attention_gate != "gradient":
                for block in blocks:
                    stack.enter_context(patching.forward_hook(
                        block.module.attn_drop, lambda module, args, output: gate(output, rules)))
            stack.enter_context(norm_rules(model, rules))
            stack.enter_context(operation_rules(model, rules))
            yield

    def first_layer(self, model: nn.Module) -> nn.Module:
        return _swin_blocks(_swin_backbone(model))[0]

    def token_states(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.reshape(hidden.shape[0], -1, hidden.shape[-1]) if hidden.dim() == 4 else hidden

    def num_prefix_tokens(self, model: nn.Module):
        return 0
