"""Activation modules found by probing what they compute, not by class name.

With ``RuleSet.activation == "identity"`` every activation module gets the identity rule as a
whole, hand-written ones included (GPT-2's ``gelu_new`` is products and sums inside).
"""
from __future__ import annotations

import torch
from torch import nn

from ...model_state import module_walk
from .probe_cache import probed

# Not activations, or activations whose torch function the mode already rules (closed-form ratio).
_NOT_ACTIVATIONS = (nn.Dropout, nn.Identity, nn.Softmax, nn.LogSoftmax, nn.Flatten, nn.Unflatten,
                    nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish)


def is_activation(module: nn.Module, like: torch.Tensor) -> bool:
    """An elementwise, parameter-free map with ``f(0) = 0`` that is not the identity:
    found by probing what it computes (hand-written GELUs such as GPT-2's ``gelu_new``);
    the answer is remembered while the module's state is unchanged (probe_cache)."""
    if isinstance(module, _NOT_ACTIVATIONS) or not module_walk.is_leaf(module) or _holds_tensors(module):
        return False  # what the probe would answer, without looking up its cache (a Linear, a norm)
    return probed(module, ("activation", like.dtype, like.device), lambda: _probe_activation(module, like))


def _holds_tensors(module: nn.Module) -> bool:
    """Own parameters or floating-point buffers: not a parameter-free activation."""
    return any(p is not None for p in module._parameters.values()) or any(
        b is not None and b.is_floating_point() for b in module._buffers.values())


@torch.no_grad()
def _probe_activation(module: nn.Module, like: torch.Tensor) -> bool:
    """Called for leaf modules without tensors of their own (``is_activation`` checks that)."""
    x = torch.linspace(-6, 6, 241, dtype=like.dtype, device=like.device).reshape(1, 241)
    try:
        y = module.forward(x)  # not __call__: the user's hooks must not see the probe
        y_permuted = module.forward(x.flip(-1))
        y_zero = module.forward(torch.zeros(1, 3, dtype=x.dtype, device=x.device))
    except Exception:
        return False
    if not all(isinstance(t, torch.Tensor) for t in (y, y_permuted, y_zero)) or y.shape != x.shape:
        return False
    elementwise = torch.allclose(y_permuted, y.flip(-1), rtol=1e-5, atol=1e-6)
    return bool(elementwise and torch.isfinite(y).all() and y_zero.abs().max() <= 1e-6
                and (y - x).abs().max() > 1e-3)
