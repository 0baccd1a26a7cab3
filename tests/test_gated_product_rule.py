"""The gate rule of gated MLPs (``RuleSet.gated_product="constant"``, LXT's CP-LRP).

1. On a bias-free Llama (float64, RMSNorm in float64) AH+LN relevance sums to the explained
   logit to 1e-12 with 1 and 4 layers, for a gate activation that is a torch function (SiLU)
   and for a hand-written activation module (``gelu_new``); without the gate rule it misses
   by percents.
2. The forward is bit-identical inside propagation (float32, eager reference).
3. The rule itself: the value operand gets ``grad * act(g)``, the gate nothing; products
   inside an activation module are not gates; under the backward switch, the plain gradient.
4. AttnLRP keeps the uniform rule on the gate product (LXT's AttnLRP: half to each factor).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from captum_transformers import ConservativeLRP, RuleSet, get_adapter  # noqa: E402
from captum_transformers.methods.lrp import RuleGradientXInput  # noqa: E402
from captum_transformers.propagation.backward_switch import switchable_backward  # noqa: E402
from captum_transformers.propagation.rules.operations import operation_rules  # noqa: E402

F64 = torch.float64
TARGET = 1
NO_GATE_RULE = dataclasses.replace(RuleSet.AH_LN, name="AH+LN without gate", gated_product="gradient")


def _gated_llama(layers: int, hidden_act: str = "silu", dtype=F64) -> nn.Module:
    """Bias-free Llama whose RMSNorms are ``nn.RMSNorm`` (LlamaRMSNorm normalises in float32
    even in a float64 model, which alone leaves 1e-7 of the logit unexplained), with norm
    weights away from 1 so a rule that forgot them could not pass."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=layers, num_key_value_heads=2,
        vocab_size=99, max_position_embeddings=16, mlp_bias=False, attention_bias=False, hidden_act=hidden_act,
        tie_word_embeddings=False, attn_implementation="eager")).to(dtype).eval()
    generator = torch.Generator().manual_seed(3)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "LlamaRMSNorm":
                norm = nn.RMSNorm(child.weight.shape[0], eps=child.variance_epsilon, dtype=dtype)
                with torch.no_grad():
                    norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=generator, dtype=dtype))
                setattr(parent, name, norm)
    return model


def _ids(batch=3, seq=7):
    return torch.randint(3, 99, (batch, seq), generator=torch.Generator().manual_seed(1))


# == 1. conservation ===========================================================================
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_new"])
@pytest.mark.parametrize("layers", [1, 4])
def test_ah_ln_conserves_on_a_bias_free_gated_llama(layers, hidden_act):
    model = _gated_llama(layers, hidden_act)
    ids = _ids()
    relevance, delta = ConservativeLRP(model, "AH+LN").attribute(ids, target=TARGET, return_tokens=True,
                                                                 return_convergence_delta=True)
    logits = model(ids).logits[:, -1, TARGET].detach()
    # delta: against the logit of the explained forward (the package's attention kernel runs
    # its softmax in float64; Llama's eager one in float32, hence the looser second bound).
    # Measured: delta 1.5e-15 (1 layer) and 3e-14 (4 layers) of the logit with SiLU.
    assert (delta.abs() / logits.abs()).max() <= 1e-12
    assert ((relevance.sum(-1) - logits).abs() / logits.abs()).max() <= 1e-5

    # Without the gate rule the same model misses (measured 6 % with one layer, 8x with four).
    without = RuleGradientXInput(model, NO_GATE_RULE).attribute(ids, target=TARGET, return_tokens=True)
    assert ((without.sum(-1) - logits).abs() / logits.abs()).max() > 1e-2


def test_ah_ln_conserves_on_a_timm_vit_with_swiglu_mlps():
    # timm's SwiGLU: act(fc1_g(x)) * fc1_x(x), the activation an nn.SiLU child of the MLP.
    timm = pytest.importorskip("timm")
    from lrp_models import _images, _random_norm_weights, _zero_biases

    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_ratio=2, num_classes=5,
        mlp_layer=timm.layers.SwiGLU, act_layer=nn.SiLU).to(F64).eval()
    model = _random_norm_weights(_zero_biases(model))
    x = _images()
    logits = model(x)[:, TARGET].detach()
    _, delta = ConservativeLRP(model, "AH+LN").attribute(x, target=TARGET, return_tokens=True,
                                                         return_convergence_delta=True)
    assert (delta.abs() / logits.abs()).max() <= 1e-12  # measured 3.6e-15
    _, without = RuleGradientXInput(model, NO_GATE_RULE).attribute(x, target=TARGET, return_tokens=True,
                                                                   return_convergence_delta=True)
    assert (without.abs() / logits.abs()).max() > 1e-6  # measured 3.4e-5 (small random weights)


def test_ah_ln_conserves_with_padding_and_batch_equals_single():
    model = _gated_llama(2)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    lrp = ConservativeLRP(model, "AH+LN")
    relevance, delta = lrp.attribute(ids, target=TARGET, return_tokens=True, return_convergence_delta=True,
                                     forward_kwargs={"attention_mask": mask})
    assert delta.abs().max() <= 1e-12 * relevance.sum(-1).abs().max()
    single = lrp.attribute(ids[1:2, :5], target=TARGET, return_tokens=True)
    torch.testing.assert_close(relevance[1, :5], single[0], rtol=1e-10, atol=1e-12)


# == 2. forward unchanged ======================================================================
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_new"])
def test_forward_bit_identical_under_the_gate_rule(hidden_act):
    model = _gated_llama(2, hidden_act, dtype=torch.float32)
    ids = _ids()
    with torch.enable_grad(), get_adapter(model).propagation(model, RuleSet.AH_LN):
        inside = model(ids).logits
    assert torch.equal(inside, model(ids).logits)


# == 3. the rule ===============================================================================
class HandWrittenGELU(nn.Module):
    """``0.5 x (1 + tanh(...))``: products inside, found as an activation by probing."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x.pow(3))))


class GatedMLP(nn.Module):
    def __init__(self, act: nn.Module, width=6, hidden=10):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, 1, bias=False)
        self.act = act
        self.seen = {}

    def forward(self, x):
        gate, up = self.act(self.gate(x)), self.up(x)
        self.seen.update(gate=gate, up=up)
        for tensor in (gate, up):
            tensor.retain_grad()
        return self.down(gate * up)


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(), HandWrittenGELU()], ids=["silu", "gelu", "hand-written"])
def test_the_value_gets_all_relevance_and_the_gate_none(act):
    model = GatedMLP(act).double()
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    with operation_rules(model, RuleSet.AH_LN):
        y = model(x)
    y.sum().backward()
    gate, up = model.seen["gate"], model.seen["up"]
    assert gate.grad is None  # never visited: the gate branch is a constant
    product_relevance = (gate * up).detach() * (model.down.weight[0].detach())
    torch.testing.assert_close(up * up.grad, product_relevance, rtol=1e-12, atol=1e-14)
    # Everything reaches x through `up` alone: x * dx sums to y (a bias-free linear map of x).
    torch.testing.assert_close((x * x.grad).sum(-1), y.detach().squeeze(-1), rtol=1e-12, atol=1e-14)


def test_the_hand_written_activation_inside_keeps_its_plain_gradient():
    # x * sigmoid(x) inside an activation module is that activation, not a gate: no rule
    # inside it (the gradient rule applies, as for F.silu).
    class HandWrittenSiLU(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    x = torch.randn(5, 6, dtype=F64)
    outputs = []
    for act in (HandWrittenSiLU(), nn.SiLU()):
        model = nn.Sequential(nn.Linear(6, 6, bias=False), act).double()
        torch.manual_seed(0)
        nn.init.normal_(model[0].weight)
        leaf = x.clone().requires_grad_()
        with operation_rules(model, RuleSet.AH_LN):
            model(leaf).sum().backward()
        outputs.append(leaf.grad)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-14)


def test_plain_switch_gives_the_products_plain_gradient():
    model = GatedMLP(nn.SiLU()).double()
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    with switchable_backward() as switch, operation_rules(model, RuleSet.AH_LN):
        y = model(x)
    (rule,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    with switch.plain_gradient():
        (plain,) = torch.autograd.grad(y.sum(), x)
    leaf = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(model(leaf).sum(), leaf)
    torch.testing.assert_close(plain, expected, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(rule, expected)


# == 4. AttnLRP: the uniform rule on the gate product ==========================================
def test_attn_lrp_splits_the_gate_product_in_half():
    model = GatedMLP(nn.SiLU()).double()
    x = torch.randn(4, 6, dtype=F64, requires_grad=True)
    with operation_rules(model, RuleSet.ATTN_LRP):
        y = model(x)
    y.sum().backward()
    gate, up = model.seen["gate"], model.seen["up"]
    half = 0.5 * (gate * up).detach() * model.down.weight[0].detach()
    torch.testing.assert_close(up * up.grad, half, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gate * gate.grad, half, rtol=1e-12, atol=1e-14)

