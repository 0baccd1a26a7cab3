"""The gate rule of gated MLPs (CP-LRP, as LXT implements it): ``act(g) * u`` with the
activated gate held constant.

Llama, Qwen, Gemma and Mistral compute their MLP as ``down(act(gate(x)) * up(x))``. Under
gradient x input the product of two input-dependent factors is not linear in ``x``, so no
rule on the attention or the norms makes relevance add up (on a bias-free Llama with AH+LN,
32 % of the logit missing with one layer, 213 % too much with four). Holding ``act(gate(x))``
constant makes the product a linear map of ``up(x)``: all relevance of the product flows into
``up(x)``, ``R_u = u * (act(g) * dR/dy) = R_y``, and the gate branch gets none.

The gate is found by behaviour, not by class or attribute names: an elementwise product
of two relevance-carrying tensors exactly one of which is the output of an activation
(recorded by :class:`GateTracker` while the forward runs under the rule mode). With the gate
rule as the only per-operation rule, the mode runs only inside the modules that hold an
activation module (:func:`gate_scopes`: the MLPs), so the rest of the forward is not
intercepted; a gate activated by a bare function call (``F.silu(...)`` in a module with no
activation child) is then not found and that product keeps its plain gradient.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Optional, Tuple

import torch
from torch import nn

from ...model_state import module_walk
from ..backward_switch import SWITCH
from ..backward_switch import plain_requested as _plain
from .own_output import own_output, saved_tensors


# torch's activation modules (the rule mode sees their functions): their parents hold gated products.
_TORCH_ACTIVATION_MODULES = (nn.GELU, nn.SiLU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish)


class ConstantGateProduct(torch.autograd.Function):
    """``act(g) * u`` with the activated gate held constant: the value's gradient is
    ``grad * act(g)`` (so ``R_u = u * g_u = R``); the gate gets None, so autograd never visits
    its branch. Under a plain backward switch both operands get their plain gradient."""

    @staticmethod
    def forward(ctx, gate, value, func, args, kwargs):
        ctx.switch = SWITCH.get()
        ctx.value_shape = value.shape
        # The value is needed only by the plain gradient of the gate.
        ctx.save_for_backward(gate, value if ctx.switch is not None else None)
        return own_output(func(*args, **kwargs), args, kwargs)  # a model may update it in place

    @staticmethod
    def backward(ctx, grad):
        gate, value = saved_tensors(ctx, "constant gate")
        g_value = (grad * gate).sum_to_size(ctx.value_shape)
        g_gate = (grad * value).sum_to_size(gate.shape) if _plain(ctx) else None
        return g_gate, g_value, None, None, None


class GateTracker:
    """The activation outputs of one forward pass (weakly referenced), and which operand of
    an elementwise product is the gate.

    Products inside an activation module found by probing (a hand-written GELU or
    ``x * sigmoid(x)``) belong to that activation, not to a gated MLP: within
    :meth:`inside_activation` nothing is recorded and no product is split.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._outputs: dict = {}
        self._depth = 0

    def mark(self, output):
        """Remember ``output`` as an activation's output; returns it unchanged."""
        if self.enabled and not self._depth and isinstance(output, torch.Tensor):
            self._outputs[id(output)] = weakref.ref(output)
        return output

    @contextlib.contextmanager
    def inside_activation(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _marked(self, tensor: torch.Tensor) -> bool:
        ref = self._outputs.get(id(tensor))
        return ref is not None and ref() is tensor

    def split(self, args, kwargs) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(gate, value)`` when the product ``args[0] * args[1]`` has exactly one activated
        operand and both carry relevance; None otherwise (the product's own rule applies)."""
        if not self.enabled or self._depth or len(args) != 2 or kwargs:
            return None
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.requires_grad and b.requires_grad
                and a.is_floating_point() and b.is_floating_point()):
            return None
        a_gate, b_gate = self._marked(a), self._marked(b)
        if a_gate == b_gate:  # neither, or both: no operand is singled out as the gate
            return None
        return (a, b) if a_gate else (b, a)


def gate_scopes(model: nn.Module, probed) -> list:
    """The modules holding an activation module as a direct child (or the model itself if it
    is one): where a gated MLP multiplies the activated gate by its value."""
    holds = {id(module) for module in probed}
    scopes, seen = [], set()
    if id(model) in holds or isinstance(model, _TORCH_ACTIVATION_MODULES):
        return [model]
    for parent in module_walk.modules(model):
        if id(parent) in seen:
            continue
        if any(id(child) in holds or isinstance(child, _TORCH_ACTIVATION_MODULES) for child in parent.children()):
            seen.add(id(parent))
            scopes.append(parent)
    return scopes
