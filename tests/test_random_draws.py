"""Random draws in a train-mode forward (``capture/random_calls.py``, the rule of
``capture/stochastic_layers.py``): inline samplers, hand-written masks and Gumbel noise are
refused and explained on request, a one-number coin passes while a coin that skips layers is
refused by its ``layerdrop``, draw sizes are counted per sampler, and dropout or noise added by
a user's hook on the model is part of the forward. Split from ``test_train_mode.py``, whose
tiny models and builders are shared by import.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import captum_transformers as ct
from captum_transformers.compat import stochastic_layers
from captum_transformers.errors import StochasticForwardError
from restore import assert_same, snapshot
from test_train_mode import P, _build, _timm_vit

pyg = pytest.importorskip("torch_geometric.nn")


# -- random draws other than Bernoulli (router jitter, Gumbel noise, hand-written dropout) -----------

class _Noise(nn.Module):
    """Noise or a mask drawn inline in the forward, where no module walk sees it (as MoE router
    jitter, Gumbel sampling or ``h * (torch.rand_like(h) > p)`` are written)."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def forward(self, hidden):
        return self.draw(hidden) if self.training else hidden


DRAWS = {
    "torch.rand": lambda h: h * (torch.rand(h.shape) > 0.2),
    "torch.rand_like": lambda h: h * (torch.rand_like(h) > 0.2),
    "torch.randn": lambda h: h + 0.1 * torch.randn(*h.shape),
    "torch.randn_like": lambda h: h + 0.1 * torch.randn_like(h),
    "torch.randint": lambda h: h * torch.randint(0, 2, h.shape),
    "torch.randint_like": lambda h: h * torch.randint_like(h, 0, 2),
    "torch.randperm": lambda h: h[:, torch.randperm(h.shape[1])],
    "torch.multinomial": lambda h: h * torch.multinomial(torch.ones(h.shape[0], 4), h.shape[-1], replacement=True)
    .unsqueeze(1),
    "Tensor.multinomial": lambda h: h * torch.ones(h.shape[0], 4).multinomial(h.shape[-1], replacement=True)
    .unsqueeze(1),
    "torch.normal": lambda h: h + torch.normal(0.0, 0.1, size=h.shape),
    "torch.normal(tensors)": lambda h: torch.normal(h, 0.1),
    "torch.poisson": lambda h: h + torch.poisson(torch.ones_like(h)),
    "Tensor.uniform_": lambda h: h * torch.empty_like(h).uniform_(0.5, 1.5),
    "Tensor.normal_": lambda h: h + torch.empty_like(h).normal_(0, 0.1),
    "Tensor.exponential_": lambda h: h + torch.empty_like(h).exponential_(),
    "Tensor.random_": lambda h: h * torch.empty_like(h).random_(0, 2),
    "Tensor.geometric_": lambda h: h * torch.empty_like(h).geometric_(0.5),
    "Tensor.log_normal_": lambda h: h * torch.empty_like(h).log_normal_(0, 0.1),
    "Tensor.cauchy_": lambda h: h + 0.01 * torch.empty_like(h).cauchy_(),
    "F.gumbel_softmax": lambda h: F.gumbel_softmax(h, tau=1.0),
    "nn.init.normal_": lambda h: h + nn.init.normal_(torch.empty_like(h), 0, 0.1),
}


def _noisy_vit(draw):
    model, inputs, _ = _timm_vit(0.0)  # no dropout anywhere: only the inline draw is random
    model.norm_pre = _Noise(draw)
    return model.train(), inputs


@pytest.mark.parametrize("label", list(DRAWS))
def test_random_draws_in_the_forward_are_refused_and_allowed_on_request(label):
    model, inputs = _noisy_vit(DRAWS[label])
    before = snapshot(model)
    with pytest.raises(StochasticForwardError) as caught:
        ct.GenericAttention(model).attribute(inputs, target=1)
    message = str(caught.value)
    assert f"norm_pre (_Noise): {label.split('(')[0]} drawing" in message and "model.eval()" in message
    assert_same(before, snapshot(model))
    allowed = ct.GenericAttention(model, allow_stochastic=True)
    torch.manual_seed(1)
    first = allowed.attribute(inputs, target=1)
    torch.manual_seed(2)
    second = allowed.attribute(inputs, target=1)
    assert torch.isfinite(first).all() and not torch.equal(first, second)  # genuinely another draw per call


def test_the_reported_pyg_model_with_uniform_noise_and_a_hand_written_mask_is_refused():
    class Jittered(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.att, self.att2, self.out = pyg.TransformerConv(4, 4), pyg.TransformerConv(4, 4), nn.Linear(4, 2)

        def forward(self, x, edge_index, batch):
            h = self.att(x, edge_index)
            if self.training:
                h = h * torch.empty_like(h).uniform_(0.5, 1.5) * (torch.rand_like(h) > 0.2)
            return self.out(pyg.global_mean_pool(self.att2(h, edge_index), batch))

    model = Jittered().train()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    edge_index, batch = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]]), torch.zeros(4, dtype=torch.long)
    with pytest.raises(StochasticForwardError, match=r"the model \(Jittered\): Tensor\.uniform_ drawing 16"):
        ct.GenericAttention(model).attribute(x, additional_forward_args=(edge_index, batch), target=0)


class _Coin(nn.Module):
    """HuggingFace's layer-skip coin: ``torch.rand([])`` drawn in training mode, compared to
    ``layerdrop`` (older HF layers draw it even at ``layerdrop=0``, where it skips nothing)."""

    def __init__(self, layer, layerdrop):
        super().__init__()
        self.layer, self.layerdrop = layer, layerdrop

    def forward(self, hidden):
        if self.training and torch.rand([]) < self.layerdrop:
            return hidden
        return self.layer(hidden)


@pytest.mark.parametrize("shape", [[], [1], (1, 1)], ids=["rand([])", "rand(1)", "rand(1, 1)"])
def test_a_one_number_coin_at_layerdrop_zero_is_explained_as_in_eval_mode(shape):
    model, inputs, _ = _timm_vit(0.0)
    model.blocks[1] = _Coin(model.blocks[1], 0.0)
    draws = []
    original = model.blocks[1].forward

    def counted(hidden):
        draws.append(torch.rand(shape))  # the coin in the other shapes too
        return original(hidden)

    model.blocks[1].forward = counted
    model.train()
    trained = ct.GenericAttention(model).attribute(inputs, target=1)
    assert draws  # the forward did draw, in training mode
    model.eval()
    torch.testing.assert_close(trained, ct.GenericAttention(model).attribute(inputs, target=1), rtol=1e-5, atol=1e-6)


def test_a_coin_that_skips_layers_is_refused_by_its_layerdrop():
    model, inputs, _ = _timm_vit(0.0)
    model.blocks[1] = _Coin(model.blocks[1], P)
    with pytest.raises(StochasticForwardError, match=r"blocks\.1: _Coin with layerdrop=0\.3"):
        ct.GenericAttention(model.train()).attribute(inputs, target=1)


# -- the user's hooks on the explained model are part of its forward ---------------------------------

@pytest.mark.parametrize("method", ["generic-attention", "attn-lrp", "transformer-relevance"])
def test_dropout_in_a_users_hook_is_refused_and_allowed_on_request(method):
    """The user's hooks run outside the explanation's rules (``capture/isolation.py``) but not
    outside the train-mode rule: a hook that returns a dropped-out output makes the forward random."""
    model, inputs, _ = _timm_vit(0.0)
    model.train()
    handle = model.blocks[0].mlp.register_forward_hook(lambda module, args, output: F.dropout(output, P, True))
    try:
        with pytest.raises(StochasticForwardError, match=r"blocks\.0\.mlp \(Mlp\): F\.dropout\(p=0\.3"):
            _build(method, model).attribute(inputs, target=1)
        allowed = _build(method, model, allow_stochastic=True)
        torch.manual_seed(1)
        first = allowed.attribute(inputs, target=1)
        torch.manual_seed(2)
        assert not torch.equal(first, allowed.attribute(inputs, target=1))
    finally:
        handle.remove()
    assert torch.isfinite(first).all()


def test_noise_drawn_in_a_users_hook_is_refused():
    model, inputs, _ = _timm_vit(0.0)
    handle = model.blocks[0].mlp.register_forward_hook(
        lambda module, args, output: output + 0.1 * torch.randn_like(output))
    try:
        with pytest.raises(StochasticForwardError, match=r"blocks\.0\.mlp \(Mlp\): torch\.randn_like drawing"):
            ct.AttnLRP(model.train()).attribute(inputs, target=1)
    finally:
        handle.remove()


_IMAGE = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(1))
_OFFSETS = torch.rand(1, 2, 2, generator=torch.Generator().manual_seed(2))  # given: nothing drawn


@pytest.mark.parametrize("draw, refused", [
    (lambda: torch.rand([]), False), (lambda: torch.rand(1), False), (lambda: torch.randn(size=(1, 1)), False),
    (lambda: torch.randint(0, 5, ()), False), (lambda: torch.randperm(1), False),
    (lambda: torch.empty(()).uniform_(), False), (lambda: torch.normal(0.0, 1.0, (1,)), False),
    (lambda: torch.rand(2), True), (lambda: torch.randn(size=(1, 2)), True), (lambda: torch.randint(0, 5, (1, 2)), True),
    (lambda: torch.randperm(2), True), (lambda: torch.empty(2).uniform_(), True),
    (lambda: torch.normal(torch.zeros(2), 1.0), True), (lambda: torch.multinomial(torch.ones(2, 3), 1), True),
    (lambda: F.fractional_max_pool2d(_IMAGE, 2, output_size=4), True),
    (lambda: nn.FractionalMaxPool3d(2, output_size=2, return_indices=True)(_IMAGE), True),
    (lambda: F.fractional_max_pool2d(_IMAGE, 2, output_size=4, _random_samples=_OFFSETS), False),
])
def test_a_draw_is_refused_from_two_numbers_up(draw, refused):
    """A one-number draw is a coin (HF's ``torch.rand([])`` layerdrop coin); two or more are noise."""
    model = nn.Linear(2, 2).train()
    if not refused:
        with stochastic_layers.watched(model):
            draw()
        return
    with pytest.raises(StochasticForwardError, match="random numbers"):
        with stochastic_layers.watched(model):
            draw()
