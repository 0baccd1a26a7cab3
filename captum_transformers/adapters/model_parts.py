"""Parts of a model found from its modules: the patch size of its patch embedding, and the
layer (an element of a layer list) that encloses an attention block.

Read-only lookups that :class:`~captum_transformers.adapters.base.Adapter`'s defaults
(:meth:`~captum_transformers.adapters.base.Adapter.patch_size`,
:meth:`~captum_transformers.adapters.base.Adapter.first_layer`) are built from, held apart
from the adapter contract.
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from ..model_state import module_walk
from ..capture.trace import Block


def find_patch_size(model: nn.Module) -> Optional[Tuple[int, int]]:
    """The patch size of the first patch-embedding convolution (kernel == stride)."""
    for module in module_walk.modules(model):
        if isinstance(module, nn.Conv2d) and tuple(module.kernel_size) == tuple(module.stride):
            return tuple(module.kernel_size)
    return None


def enclosing_layer(model: nn.Module, block: Block) -> nn.Module:
    """The innermost ancestor of ``block`` that is an element of a layer list (its path ends in a
    number); the block's own module if none is.

    A block that is itself an element of a list inside a layer (LongCat-Flash's two attention
    sublayers ``model.layers.0.self_attn.0`` and ``.1``, one decoder layer) is not the layer: the
    layer is the numbered ancestor above the block's own list, whose input the first sublayer's
    residual stream starts from. A block numbered with no numbered ancestor (a list of attention
    modules) is its own layer, as before."""
    parts = block.name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if parts[end - 1].isdigit():
            return model.get_submodule(".".join(parts[:end]))
    return block.module
