"""Mixture-of-experts routers under the gate-constant rules (issue 42, item 3: the MoE router rule).

Under AH and AH+LN the routing weights are a constant multiplier of each expert's output (the
router's outputs detached, propagation/rules/routers.py), so ConservativeLRP AH+LN conserves on
bias-free float64 MoE models as on dense gated ones: every generation step's prompt and output
relevance sum to its logit (1e-10), top-k routers (Qwen3-MoE, Mixtral), a shared expert with its
own sigmoid gate (Qwen2-MoE), shared experts and grouped routing (DeepSeek-V3), and a router that
scales the experts' input (Llama 4). Before the rule the sums missed by 5e-6 to 1e-4.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage.shrink import build_model, small_config  # noqa: E402
from generation_models import IdTokenizer  # noqa: E402

from captum_transformers import ConservativeLRP  # noqa: E402
from captum_transformers.generation import GenerationAttribution  # noqa: E402
from captum_transformers.propagation.rules.routers import routers  # noqa: E402

FAMILIES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
PROMPT, TARGET = [1, 5, 7, 9, 11, 13], [20, 21, 22]


def _float64_forward(self, hidden):
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps))


def _float64_rms(module: torch.nn.Module) -> None:
    """The norm's class without its float32 round trip, so the forward is the map AH+LN differentiates."""
    cls = type(module)
    module.__class__ = type(f"Float64{cls.__name__}", (cls,), {"forward": _float64_forward})


def _bias_free(model_type: str) -> torch.nn.Module:
    config = small_config(model_type, FAMILIES[model_type], "causal-lm")
    for flag in ("attention_bias", "mlp_bias"):
        if hasattr(config, flag):
            setattr(config, flag, False)
    model = build_model(config, FAMILIES[model_type])
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            _float64_rms(module)
    with torch.no_grad():  # Qwen2-MoE's q/k/v projections always carry a bias: zero it
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_ah_ln_generation_rows_sum_to_the_logit(model_type):
    model = _bias_free(model_type)
    assert routers(model), "the rule finds the model's routers"
    result = GenerationAttribution(ConservativeLRP(model, "AH+LN"), IdTokenizer()).attribute(PROMPT, target=TARGET)
    totals = result.token_attr.sum(1) + result.target_attr.sum(1)
    assert (totals - result.scores).abs().max() < 1e-10
    # Plain gradient x input of the same model does not conserve: the check can fail.
    plain = GenerationAttribution(ConservativeLRP(model, "GI"), IdTokenizer()).attribute(PROMPT, target=TARGET)
    assert (plain.token_attr.sum(1) + plain.target_attr.sum(1) - plain.scores).abs().max() > 1e-6


def test_routers_are_found_by_structure():
    """The routers of each block with experts; a dense model has none."""
    model = _bias_free("qwen2_moe")
    names = [name for name, _ in routers(model)]
    assert names and all(name.endswith((".gate", ".shared_expert_gate")) for name in names)
    assert any(name.endswith(".shared_expert_gate") for name in names)
    dense = build_model(small_config("llama", "LlamaForCausalLM", "causal-lm"), "LlamaForCausalLM")
    assert routers(dense) == []


def test_forward_unchanged_and_router_restored():
    """The rule changes the backward pass only: the same logits, and no hook left behind."""
    model = _bias_free("qwen3_moe")
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        before = model(ids).logits
    ConservativeLRP(model, "AH+LN").attribute(ids, target=7)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert all(not router._forward_hooks for _, router in routers(model))
