"""A model that updates a ruled module's output in place (issue 42, item 5).

XLM multiplies its embedding norm's output by the mask in place (``tensor *= mask``). The norm
and activation rules used to return a view of that output, which autograd forbids updating in
place (a raw "is a view and is being modified inplace" RuntimeError from every LRP method).
Their outputs are new tensors now: every method explains such a model exactly as the same
model written out of place; the identity rule, which needs the output it saw, refuses an update
of that output by name at the backward pass.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from captum_transformers import CaptureError
from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES, build_method
from captum_transformers.propagation.rules.operations import IdentityRelevance


class MaskedEmbeddingEncoder(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        torch.manual_seed(0)
        self.in_place = in_place
        self.embed = nn.Embedding(20, 16)
        self.norm = nn.LayerNorm(16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        mask = (ids != 0).to(h.dtype)[..., None]
        if self.in_place:
            h *= mask
        else:
            h = h * mask
        return self.head(self.encoder(h)[:, 0])


IDS = torch.tensor([[1, 5, 7, 9, 3], [1, 6, 8, 3, 2]])


METHODS = [name for name in KNOWN_METHOD_NAMES if name not in ("integrated-gradients", "saliency")]


@pytest.mark.parametrize("name", METHODS)
def test_every_method_explains_an_in_place_update_as_the_out_of_place_model(name):
    in_place, out_of_place = MaskedEmbeddingEncoder(True).double().eval(), MaskedEmbeddingEncoder(False).double().eval()
    got = build_method(name, in_place).attribute(IDS, target=1)
    expected = build_method(name, out_of_place).attribute(IDS, target=1)
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_identity_rule_refuses_an_update_of_the_output_it_read():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        y = torch.tanh(x)
    ruled = IdentityRelevance.apply(x, [y])
    assert ruled._base is None  # a tensor of its own, not a view: in-place updates are allowed
    (ruled * 1).sum().backward()
    torch.testing.assert_close(x.grad, y / x)
    x.grad = None
    with torch.no_grad():
        y = torch.tanh(x)
    ruled = IdentityRelevance.apply(x, [y])
    ruled *= 2
    with pytest.raises(CaptureError, match="in place"):
        ruled.sum().backward()
