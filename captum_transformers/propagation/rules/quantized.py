"""The linear rules on bitsandbytes layers, which multiply through their own operators.

bitsandbytes' ``Linear4bit`` / ``Linear8bitLt`` never call ``F.linear``, so the torch-function
mode that gives ``F.linear`` its rule (:mod:`.operation_rules`) does not see them; while a rule
set with a non-gradient ``linear`` rule is on, their forward is the rule as a whole over the
dequantized weight (:func:`~captum_transformers.compat.quantized_linear.dequantized_weight`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ...model_state import patching
from ...compat.quantized_linear import TORCHAO, dequantized_weight, quantized_linears
from .linear import linear_rule


def _rule_forward(module: nn.Module, rules):
    def make(original):
        def forward(x, *args, **kwargs):
            if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or not x.requires_grad:
                return original(x, *args, **kwargs)
            bias = getattr(module, "bias", None)
            return linear_rule(rules, x, dequantized_weight(module), None if bias is None else bias.detach(), original,
                               (x, *args), kwargs)
        return forward
    return make


@contextlib.contextmanager
def linear_rule_forwards(model: nn.Module, rules) -> Iterator[None]:
    """Give every bitsandbytes layer of ``model`` the linear rule of ``rules`` (a
    :class:`~captum_transformers.propagation.rules.rule_set.RuleSet` whose ``linear`` is not
    ``"gradient"``) as a whole, its weight dequantized, its forward its own (reversibly).

    bitsandbytes layers multiply through their own operators, never ``F.linear``, so the
    torch-function mode that gives ``F.linear`` its rule does not see them; torchao layers call
    ``F.linear`` with their quantized weight and need no patch (see :func:`plain_weight`).
    """
    with contextlib.ExitStack() as stack:
        for _, module, kind in quantized_linears(model):
            if kind != TORCHAO:
                stack.enter_context(patching.instance_forward(module, _rule_forward(module, rules)))
        yield
