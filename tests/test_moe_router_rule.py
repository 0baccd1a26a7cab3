"""Mixture-of-experts routers under the gate-constant rules (issue 42, item 3: the MoE router rule).

Under AH and AH+LN the routing weights are a constant multiplier of each expert's output (the
router's outputs detached, propagation/rules/routers.py), so ConservativeLRP AH+LN conserves on
bias-free float64 MoE models as on dense gated ones: every generation step's prompt and output
relevance sum to its logit (1e-10), top-k routers (Qwen3-MoE, Mixtral), a shared expert with its
own sigmoid gate (Qwen2-MoE), shared experts and grouped routing (DeepSeek-V3), and a router that
scales the experts' input (Llama 4). Before the rule the sums missed by 5e-6 to 1e-4.

Under AttnLRP the routing-weight product takes the uniform rule (half to the expert, half to the
routing weight and through the router), as LXT's Qwen3-MoE rule does: the map equals a slow
reference written from the rules to 1e-9 with the eager and batched_mm experts kernels, and the
routing weights receive exactly half of each block's relevance.
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


# --------------------------------------------------------------------------- AttnLRP's MoE rule
# Under AttnLRP the routing-weight product of Qwen3-MoE, expert output x routing weight, takes the
# uniform rule (LXT's AttnLRP for Qwen3-MoE: benchmarks/lxt_moe_parity.py, 3e-7 of the largest
# relevance in float32 rounding, 5e-10 with the float32 casts removed): half its relevance to the
# expert, half to the routing weight, whose half reaches the block's input through the router by
# the plain gradient. The experts' weights are constants of the rule whichever experts kernel the
# model runs: transformers' batched_mm kernel multiplies them with torch.bmm, which the uniform
# rule halved (the experts' path kept 1/4, the map 3-48 % of its largest entry off).
import torch.nn.functional as F  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from captum_transformers import AttnLRP, RuleSet, get_adapter  # noqa: E402

KERNELS = ("eager", "batched_mm")  # grouped_mm takes no float64


def _router_in_own_dtype(self, hidden_states):
    """Qwen3-MoE's router with its softmax in float64 (transformers rounds it to float32)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    top, indices = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, indices


def _qwen3_moe(norm_topk_prob: bool, kernel: str, seed: int = 0) -> torch.nn.Module:
    """A float64 Qwen3-MoE (2 layers, width 32, 4 experts, top-2) whose norms and router compute
    in float64, weights drawn at 1/sqrt(fan in) (the router's twice that) so every path carries
    relevance."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)
    model = transformers.Qwen3MoeForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation=kernel).double().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.copy_(1 + 0.2 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
            else:
                scale = (2.0 if name.endswith("gate.weight") else 1.0) / parameter.shape[-1] ** 0.5
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            _float64_rms(module)
        elif isinstance(module, modeling_qwen3_moe.Qwen3MoeTopKRouter):
            module.__class__ = type("Float64Qwen3MoeTopKRouter", (type(module),), {"forward": _router_in_own_dtype})
    return model


def _gradient_times(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` (the same values) with its gradient multiplied by ``factor``."""
    return tensor.detach() + factor * (tensor - tensor.detach())


def _halved(product: torch.Tensor) -> torch.Tensor:
    """The uniform rule of a product of two relevance-carrying factors: each gets half."""
    return _gradient_times(product, 0.5)


def _norm_rule(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """AttnLRP's norm rule: RMSNorm's scale 1/sqrt(mean(x^2) + eps) a constant."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).detach())


def _silu_rule(x: torch.Tensor) -> torch.Tensor:
    """The identity rule of an activation: R_in = R_out (SiLU's y / x = sigmoid(x) a constant)."""
    return x * torch.sigmoid(x).detach()


def _moe_reference(block: torch.nn.Module, h: torch.Tensor, router_share: bool) -> torch.Tensor:
    """The MoE block token by token, expert by expert: each selected expert's output times its
    routing weight with the uniform rule (``router_share=False``: the routing weights constants)."""
    router, experts = block.gate, block.experts
    flat = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(F.linear(flat, router.weight), dim=-1)  # the router: plain gradient
    top, indices = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    if not router_share:
        top = top.detach()
    rows = []
    for token in range(flat.shape[0]):
        total = torch.zeros_like(flat[token])
        for slot in range(router.top_k):
            e = int(indices[token, slot])
            gate, up = F.linear(flat[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
            out = F.linear(_halved(_silu_rule(gate) * up), experts.down_proj[e])
            weighted = out * top[token, slot]
            total = total + (_halved(weighted) if router_share else weighted)
        rows.append(total)
    return torch.stack(rows).view_as(h)


def _attn_lrp_reference(model: torch.nn.Module, ids: torch.Tensor, target: int, router_share: bool = True):
    """AttnLRP on Qwen3-MoE written out from its rules (gradient x input at the embeddings): norms'
    scale constant, identity rule on SiLU, uniform rule on q.k, on probs.v and on every product of
    two relevance-carrying tensors, plain gradient through softmax and linear layers."""
    inner = model.model
    embeddings = inner.embed_tokens(ids).detach().requires_grad_()
    cos, sin = inner.rotary_emb(embeddings, torch.arange(ids.shape[1])[None])
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
    x = embeddings
    for layer in inner.layers:
        attention = layer.self_attn
        h = _norm_rule(layer.input_layernorm, x)
        heads = (*h.shape[:-1], -1, attention.head_dim)
        q = _norm_rule(attention.q_norm, F.linear(h, attention.q_proj.weight).view(heads)).transpose(1, 2)
        k = _norm_rule(attention.k_norm, F.linear(h, attention.k_proj.weight).view(heads)).transpose(1, 2)
        v = F.linear(h, attention.v_proj.weight).view(heads).transpose(1, 2)
        q, k = modeling_qwen3_moe.apply_rotary_pos_emb(q, k, cos, sin)
        k = modeling_qwen3_moe.repeat_kv(k, attention.num_key_value_groups)
        v = modeling_qwen3_moe.repeat_kv(v, attention.num_key_value_groups)
        scores = _halved(q @ k.transpose(-1, -2)) * attention.scaling
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        mixed = _halved(probs @ v).transpose(1, 2).reshape(*h.shape[:-1], -1)
        x = x + F.linear(mixed, attention.o_proj.weight)
        x = x + _moe_reference(layer.mlp, _norm_rule(layer.post_attention_layernorm, x), router_share)
    logits = F.linear(_norm_rule(inner.norm, x), model.lm_head.weight)
    (gradient,) = torch.autograd.grad(logits[0, -1, target], embeddings)
    return (embeddings * gradient).sum(-1)[0]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_attn_lrp_moe_equals_the_rule_written_out(norm_topk_prob, kernel):
    """AttnLRP's map of a Qwen3-MoE equals the slow reference above (1e-9 of its largest entry),
    with either experts kernel; without the router's share the reference is far off (the check
    sees the router's half)."""
    model = _qwen3_moe(norm_topk_prob, kernel)
    ids = torch.tensor([[3, 17, 40, 8, 25, 61, 12]])
    with torch.no_grad():
        target = int(model(ids).logits[0, -1].argmax())
    relevance = AttnLRP(model).attribute(ids, target=torch.tensor([target]), return_tokens=True)[0].double()
    reference = _attn_lrp_reference(model, ids, target)
    scale = reference.abs().max()
    assert (relevance - reference).abs().max() < 1e-9 * scale
    without_router = _attn_lrp_reference(model, ids, target, router_share=False)
    assert (without_router - reference).abs().max() > 1e-2 * scale


class _ObservedMoe(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock):
    """The sparse MoE block, keeping its experts' input, routing weights and output (and zeroing
    the routing weights of the tokens in ``silenced``)."""

    def forward(self, hidden_states):
        batch, length, width = hidden_states.shape
        flat = hidden_states.view(-1, width)
        _, weights, indices = self.gate(flat)
        keep = torch.ones(weights.shape[0], 1, dtype=weights.dtype)
        keep[list(self.silenced)] = 0
        weights = weights * keep  # a constant mask: routing weight exactly 0
        experts_input = flat.view_as(flat)  # the experts' own reference to the block's input
        output = self.experts(experts_input, indices, weights)
        self.kept = (flat, experts_input, weights, output)
        return output.reshape(batch, length, width)


@pytest.mark.parametrize("kernel", KERNELS)
def test_attn_lrp_routing_product_splits_in_half(kernel):
    """In each MoE block, per token: the routing weights receive half the relevance of the
    experts' output and the experts' path the other half (bias-free experts conserve it); the
    router passes its half on to the block's input; a token whose routing weights are 0 gets
    exactly 0 from the experts and its weights."""
    model = _qwen3_moe(True, kernel, seed=1)
    blocks = [layer.mlp for layer in model.model.layers]
    for block in blocks:
        block.__class__ = _ObservedMoe
        block.silenced = (2,)
    ids = torch.tensor([[3, 17, 40, 8, 25, 61]])
    embeddings = model.model.embed_tokens(ids).detach().requires_grad_()
    with get_adapter(model).propagation(model, RuleSet.ATTN_LRP):
        logit = model(inputs_embeds=embeddings).logits[0, -1].max()
        kept = [tensor for block in blocks for tensor in block.kept]
        gradients = torch.autograd.grad(logit, kept)
    for index in range(len(blocks)):
        flat, experts_input, weights, output = kept[4 * index: 4 * index + 4]
        g_flat, g_input, g_weights, g_output = gradients[4 * index: 4 * index + 4]
        r_output = (output * g_output).sum(-1)
        r_weights = (weights * g_weights).sum(-1)
        r_experts = (experts_input * g_input).sum(-1)
        r_block_input = (flat * g_flat).sum(-1)  # the experts' path and the router's
        scale = r_output.abs().max()
        assert scale > 0
        assert (r_weights - r_output / 2).abs().max() < 1e-10 * scale
        assert (r_experts - r_output / 2).abs().max() < 1e-10 * scale
        assert (r_block_input - r_experts).abs().max() > 1e-3 * scale  # the router's share reaches the input
        assert r_experts[2] == 0 and r_weights[2] == 0 and r_output[2] == 0


def test_attn_lrp_experts_weights_not_left_detached():
    """The experts' weights are read as constants only inside the explanation: afterwards the
    model's own gradients (training) reach them again, and the forward is unchanged."""
    model = _qwen3_moe(True, "batched_mm")
    ids = torch.tensor([[3, 17, 40, 8]])
    with torch.no_grad():
        before = model(ids).logits
    AttnLRP(model).attribute(ids, target=torch.tensor([5]), return_tokens=True)
    experts = model.model.layers[0].mlp.experts
    assert "forward" not in experts.__dict__
    logits = model(ids).logits
    assert torch.equal(logits.detach(), before)
    (gradient,) = torch.autograd.grad(logits[0, -1, 5], experts.gate_up_proj)
    assert gradient.abs().max() > 0
