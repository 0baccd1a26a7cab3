"""The routing weights of mixture-of-experts blocks under the gate-constant rules.

An MoE block computes ``y = sum_e g_e(x) E_e(x)`` (Qwen3-MoE, DeepSeek-V3, Mixtral, GPT-OSS:
the top-k experts' outputs times their routing weights) or ``y = E(g(x) x)`` (Llama 4: the
expert reads its input scaled by the routing score). The weights ``g`` depend on ``x`` only
through the block's router. Under ``gated_product="constant"`` (the presets AH and AH+LN, as
LXT's CP-LRP holds the activated gate of a gated MLP fixed) they are a constant multiplier of
each expert's contribution: the router's outputs are returned detached, the same values, so
all relevance of the product flows through the experts and the router receives none. Experts
with zero routing weight then get exactly zero relevance, also where the model evaluates every
expert. With that, ConservativeLRP AH+LN conserves on bias-free MoE models (shared experts
included), as on dense gated models.

Found by structure: a module with an ``experts`` child is an MoE block; its children whose
class name ends with ``Router`` or ``Gate`` (``Qwen3MoeTopKRouter``, ``Llama4Router``,
``HunYuanMoEV1Gate``), or named ``gate``, ``router`` or ``shared_expert_gate`` (Qwen2-MoE's
sigmoid gate of its shared expert), are its routers. Other rule sets leave routers alone:
AttnLRP's products take their uniform rule where :mod:`.operations` finds them.

Under AttnLRP (``matmul="uniform"`` with plain-gradient linear layers) the routing-weight product
``E_e(x) * g_e(x)`` is a product of two relevance-carrying tensors and takes the uniform rule:
half its relevance to the expert's output, half to the routing weight, whose half reaches the
block's input through the router (softmax, top-k, renormalisation and the router's linear
layer) by the plain gradient. An expert with zero routing weight gets exactly zero. The
experts' own weights are constants there, as a linear layer's weight is: inside an MoE block's
``experts`` module every parameter is read detached, so that a kernel that multiplies a weight
by the activations with ``torch.bmm`` or ``matmul`` (transformers' ``batched_mm`` experts kernel,
the eager experts of Llama 4 and GPT-OSS) keeps the linear layer's plain gradient instead of
halving it as a product of two relevance-carrying tensors. Halved, the experts' path kept a
quarter of its relevance: on tiny Qwen3-MoE models the ``batched_mm`` map was 3-48 % of its
largest entry away from the ``eager`` and ``grouped_mm`` kernels' and from LXT's MoE rule
(``benchmarks/lxt_moe_parity.py``), which all agree. The other rule sets with
``matmul="uniform"`` (Chefer et al.'s, with alpha-beta linear layers) are left as they are.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...model_state import module_walk, patching

_ROUTER_SUFFIXES = ("Router", "Gate")
_ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate"})


def routers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(dotted name, module) of every MoE router of ``model`` (see the module docstring)."""
    found = []
    for name, block in module_walk.named_modules(model):
        if not isinstance(getattr(block, "experts", None), nn.Module):
            continue
        for child_name, child in block.named_children():
            if child_name in _ROUTER_NAMES or type(child).__name__.endswith(_ROUTER_SUFFIXES):
                found.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def experts_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(dotted name, module) of the ``experts`` child of every MoE block of ``model``."""
    found = []
    for name, block in module_walk.named_modules(model):
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.Module):
            found.append((f"{name}.experts" if name else "experts", experts))
    return found


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, tuple):
        return type(output)(*(_detached(item) for item in output)) if hasattr(output, "_fields") \
            else tuple(_detached(item) for item in output)
    if isinstance(output, list):
        return [_detached(item) for item in output]
    return output


@contextlib.contextmanager
def router_rules(model: nn.Module, rules: Optional[Any]) -> Iterator[None]:
    """Routers' outputs detached under ``rules.gated_product == "constant"`` (forward hooks of
    :mod:`~captum_transformers.model_state.patching`, removed on exit); under AttnLRP's
    ``matmul="uniform"`` with plain-gradient linear layers, the experts' weights read as
    constants inside each ``experts`` module's forward (instance forwards, put back on exit);
    nothing otherwise."""
    if _uniform_with_plain_linear(rules):
        with contextlib.ExitStack() as stack:
            for _, experts in experts_modules(model):
                stack.enter_context(patching.instance_forward(experts, _constant_weights_forward))
            yield
        return
    if rules is None or getattr(rules, "gated_product", "gradient") != "constant":
        yield
        return
    with contextlib.ExitStack() as stack:
        for _, router in routers(model):
            stack.enter_context(patching.forward_hook(router, lambda module, args, output: _detached(output)))
        yield


def _constant(value: Any) -> Any:
    if isinstance(value, nn.Parameter):
        return value.detach()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields") \
            and any(isinstance(item, nn.Parameter) for item in value):
        return type(value)(item.detach() if isinstance(item, nn.Parameter) else item for item in value)
    return value


class _ConstantWeights(TorchFunctionMode):
    """Every parameter an operation reads is passed to it detached (same values, no gradient).

    Pushed on top of the operation-rule mode for the length of an experts module's forward, so
    that mode sees a weight as what it is, a constant: one relevance-carrying operand, no uniform
    split. Operations without gradients (the rules' own recomputations) pass unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            args = tuple(_constant(item) for item in args)
            kwargs = {key: _constant(item) for key, item in kwargs.items()}
        return func(*args, **kwargs)


def _constant_weights_forward(original):
    def forward(*args: Any, **kwargs: Any):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        with _ConstantWeights():
            return original(*args, **kwargs)
    return forward


def _uniform_with_plain_linear(rules: Optional[Any]) -> bool:
    """AttnLRP's combination: uniform products, plain-gradient linear layers."""
    return rules is not None and getattr(rules, "matmul", "gradient") == "uniform" \
        and getattr(rules, "linear", "gradient") == "gradient"
