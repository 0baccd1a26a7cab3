"""``torch.compile``-d models and parts, explained as the original modules they compile.

A compiled graph cannot see the hooks, wrapped forwards and torch-function modes an
explanation relies on (captured before they existed, or traced through), so its maps would
be wrong: all zeros for a compiled timm ViT, 1.5e-3 off for a compiled nn.TransformerEncoder.
Inside :func:`uncompiled` an ``OptimizedModule`` (``torch.compile(module)``) calls its
``_orig_mod`` eagerly and a module compiled in place (``module.compile()``) runs its eager
``_call_impl``, in the explaining thread only (built from :mod:`.patching`); other threads
keep the compiled code. A one-time warning per model says so.

Example::

    >>> compiled = torch.compile(vit)
    >>> GenericAttention(compiled).attribute(images, target=labels)   # warns once; maps of vit
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Iterator, List

from torch import nn

from .quantized_linear import differentiable_kernels
from ..model_state import module_walk, offload, patching

_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _is_optimized(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def original_module(module: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` wrapped (``module`` itself if not compiled so)."""
    while _is_optimized(module):
        module = module._orig_mod
    return module


def _compiled_parts(model: nn.Module) -> List[nn.Module]:
    return [module for module in module_walk.modules(model)
            if _is_optimized(module) or getattr(module, "_compiled_call_impl", None) is not None]


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s compiled parts as their original modules in the current context.

    The explanation is then that of the original module, whose outputs equal the compiled
    ones up to float rounding. bitsandbytes layers likewise run kernels with a backward pass
    (:func:`~captum_transformers.compat.quantized_linear.differentiable_kernels`).

    Every explanation enters here (the adapters' captured forward, Captum's baselines, the LLM
    layer methods), so a weight left on ``meta`` with no accelerate hook to load it is refused
    here for every adapter (:func:`~captum_transformers.model_state.offload.refuse_unloaded`): a
    forward on it computes placeholders, and a map from them would be silently wrong.
    """
    offload.refuse_unloaded(model)
    parts = _compiled_parts(model)
    if parts and model not in _WARNED:
        _WARNED.add(model)
        names = sorted({name or "the model" for name, m in model.named_modules() if any(m is p for p in parts)})
        warnings.warn(
            f"{type(original_module(model)).__name__} has torch.compile-d parts ({', '.join(names)}); they are "
            "explained as the original (uncompiled) modules, run eagerly while explaining: compiled code cannot be "
            "observed. Outputs equal the compiled ones up to float rounding.", UserWarning, stacklevel=4)
    with contextlib.ExitStack() as stack:
        stack.enter_context(offload.offloaded_on_error(model))  # accelerate leaves them loaded on an error
        stack.enter_context(differentiable_kernels(model))
        for module in parts:
            if _is_optimized(module):
                inner = module._orig_mod
                stack.enter_context(patching.instance_forward(module, lambda original, inner=inner: inner.__call__))
            if getattr(module, "_compiled_call_impl", None) is not None:
                stack.enter_context(patching.eager_call(module))
        yield
