"""A model that updates, in place, the output of an operation a relevance rule replaced (issue 42).

The rule Functions run the operation itself, and many operations return a view of a temporary:
``F.linear`` with a bias on a 3-D input (its 2-D product viewed back), ``einsum`` (a permuted or reshaped
product). autograd refuses an in-place update of a view returned by a
custom Function, so RoCBERT (``embedding_in += ...`` after a linear layer), Funnel
(``positional_attn *= cls_mask`` after a slice of an einsum) and LongT5 (``scores += bias`` after a
product) ended in a raw "Output 0 of LinearAlphaBeta is a view and is being modified inplace".
The rules' outputs are tensors of their own now: each model below is explained exactly as its
out-of-place twin, rule by rule, with the forward values bit for bit the model's own.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captum_transformers import CaptureError
from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES, build_method
from captum_transformers.propagation.rules.operations import operation_rules
from captum_transformers.propagation.rules.own_output import own_output
from captum_transformers.propagation.rules.rule_set import RuleSet


SEED = 1


class InPlaceAfterRules(nn.Module):
    """Embeddings, then the three patterns of the harness's failures before a Transformer encoder:
    ``+=`` on a biased linear layer's output (RoCBERT), ``*=`` on a slice of an einsum of two
    relevance-carrying operands (Funnel), ``-=`` on another einsum of two of them (LongT5). The
    updates add constants: an in-place add of two relevance-carrying tensors keeps the plain
    gradient, where the out-of-place one gets the normalised add rule (operations.py)."""

    def __init__(self, in_place: bool, seed: int = SEED):
        super().__init__()
        torch.manual_seed(seed)
        self.in_place = in_place
        self.embed = nn.Embedding(20, 16)
        self.proj = nn.Linear(16, 16)
        self.mix = nn.Parameter(torch.randn(16, 4, 4) / 4)
        self.mix2 = nn.Parameter(torch.randn(16, 16) / 4)
        self.register_buffer("offset", torch.randn(16))
        self.norm = nn.LayerNorm(16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        e = self.embed(ids)
        mask = (ids != 0).to(e.dtype)[..., None]
        h = self.proj(e)  # F.linear with a bias on (B, N, D): a view of its 2-D product
        if self.in_place:  # (a constant: an add of two relevance-carrying tensors gets its own rule out of place)
            h += self.offset
        else:
            h = h + self.offset
        mixed = torch.einsum("bnd,dij->bnij", h, self.mix)[..., 1:, :].flatten(2)  # a slice of an einsum
        if self.in_place:
            mixed *= mask
        else:
            mixed = mixed * mask
        product = torch.einsum("bnd,de->bne", e, self.mix2)  # a view of its 2-D product
        if self.in_place:
            product -= mask
        else:
            product = product - mask
        x = self.norm(torch.cat([mixed, product[..., 12:]], dim=-1) + h)
        return self.head(self.encoder(x)[:, 0])


IDS = torch.tensor([[1, 5, 7, 9, 3], [1, 6, 8, 3, 0]])
METHODS = [name for name in KNOWN_METHOD_NAMES if name not in ("integrated-gradients", "saliency")]


def test_the_rules_outputs_are_views_without_the_fix():
    """The patterns above do return views inside the rule Functions (what made them fail)."""
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        assert F.linear(x, torch.randn(16, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64))._base \
            is not None
        assert torch.einsum("bnd,de->bne", x, torch.randn(16, 16, dtype=torch.float64))._base is not None


@pytest.mark.parametrize("name", METHODS)
def test_every_method_explains_in_place_updates_of_rule_outputs_as_the_out_of_place_model(name):
    in_place, out_of_place = InPlaceAfterRules(True).double().eval(), InPlaceAfterRules(False).double().eval()
    got = build_method(name, in_place).attribute(IDS, target=1)
    expected = build_method(name, out_of_place).attribute(IDS, target=1)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("rules", [
    RuleSet.CHEFER, RuleSet.LRP, RuleSet.ATTN_LRP,
    dataclasses.replace(RuleSet.AH_LN, name="AH+LN, gamma", linear="gamma", gamma=0.25),
    dataclasses.replace(RuleSet.AH_LN, name="AH+LN, generalized gamma", linear="generalized_gamma", gamma=0.25),
], ids=lambda rules: rules.name)
def test_each_rule_gives_the_out_of_place_gradient_and_the_model_forward(rules):
    """Rule by rule, under the operation-rule mode alone: the forward values are bit for bit the
    model's own, and the rule's gradient at the embeddings equals the out-of-place twin's."""
    ids = IDS[:1]
    results = []
    for in_place in (True, False):
        model = InPlaceAfterRules(in_place).double().eval()
        embedded = model.embed(ids).detach().requires_grad_()
        model.embed.forward = lambda _ids, e=embedded: e
        plain = model(ids)  # with gradients (no_grad takes nn.TransformerEncoderLayer's fused path)
        with operation_rules(model, rules):
            out = model(ids)
        assert torch.equal(out, plain)
        (grad,) = torch.autograd.grad(out[0, 1], embedded)
        results.append(grad)
    assert results[0].abs().sum() > 0
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_a_view_of_a_temporary_becomes_a_tensor_of_its_own_without_a_copy():
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    weight, bias = torch.randn(16, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    with torch.no_grad():
        output = F.linear(x, weight, bias)
        owned = own_output(output, (x, weight, bias), {})
    assert owned._base is None and owned.data_ptr() == output.data_ptr()
    assert torch.equal(owned, output)


def test_a_view_of_an_operand_is_left_a_view_and_its_update_refused_by_name():
    """A rule output that views one of its operands cannot become a tensor of its own (an update
    would change the operand as well): it stays a view, and an in-place update of it is refused by
    name by the rule mode, not autograd's raw RuntimeError."""
    x = torch.randn(3, 4, dtype=torch.float64)
    assert own_output(x[:, :2], (x,), {})._base is x

    class SliceOfOperand(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return own_output(x[:, :2], (x,), {})

        @staticmethod
        def backward(ctx, grad):
            return F.pad(grad, (0, 2))

    class Model(nn.Module):
        def forward(self, x):
            y = SliceOfOperand.apply(x * 1)
            y += 1
            return y

    model = Model()
    with operation_rules(model, RuleSet.CHEFER):
        with pytest.raises(CaptureError, match="in place"):
            model(x.requires_grad_())


def test_an_update_of_a_saved_rule_output_is_refused_by_name():
    """The softmax identity rule keeps the softmax's output: a model that then changes it in place
    would make the rule read values the forward pass did not have; refused at the backward pass."""

    class Model(nn.Module):
        def forward(self, s):
            a = torch.softmax(s, dim=-1)
            a *= 2
            return a

    model = Model()
    s = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    with operation_rules(model, RuleSet.CHEFER):
        out = model(s)
    with pytest.raises(CaptureError, match="identity rule kept it"):
        out.sum().backward()


def test_the_attention_functions_output_may_be_updated_in_place():
    """The HF kernel returns ``O`` of the attention Function transposed back to (B, Q, H, d) (a
    streamed map writes it a few rows at a time into a (B, Q, H, d) buffer): a model that scales it
    in place (``attn_output *= gate``) gets the same gradient as out of place."""
    from captum_transformers.propagation.attention.core import softmax_attention

    grads = []
    for in_place in (True, False):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64).requires_grad_() for _ in range(3))
        def scores(a, b):
            return a @ b.transpose(-1, -2)

        scores.row_sliceable = True  # the streamed forward: O written a few rows at a time into (B, Q, H, d)
        output, _ = softmax_attention(scores, q, k, v, keep_map=False)
        output = output.transpose(1, 2).contiguous()
        if in_place:
            output *= 2
        else:
            output = output * 2
        grads.append(torch.autograd.grad(output.sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
