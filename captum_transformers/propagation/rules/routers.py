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
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn

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
    :mod:`~captum_transformers.model_state.patching`, removed on exit); nothing otherwise."""
    if rules is None or getattr(rules, "gated_product", "gradient") != "constant":
        yield
        return
    with contextlib.ExitStack() as stack:
        for _, router in routers(model):
            stack.enter_context(patching.forward_hook(router, lambda module, args, output: _detached(output)))
        yield
