"""An explanation of model B from a hook on model A's modules, while A is explained.

A forward hook that explains (or just runs and differentiates) another model used to run
under A's rules: A's torch-function modes (the per-operation LRP rules, the explicit SDPA
kernel) and A's context variables (rule set, recorder, backward switch) reached B too, and
B's map came out 51-54 % off. Each explanation's rules now act on its own model only: inside
the hook B's map, output and gradient are bit-identical to B's alone, and A's map is the one
A gets without the hook. Every method of the registry is the outer one, on an HF ViT hooking
a timm ViT and the other way round; an explanation of the same model (or of a model sharing
its modules) from its own hook is refused.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import AttnLRP, ConservativeLRP, GenericAttention, TransformerRelevance
from captum_transformers.errors import CaptureError, StochasticForwardError
from captum_transformers.methods.catalog import METHOD_FACTORIES
from hf_models import CASES
from restore import assert_same, snapshot


def _hf_vit():
    return CASES["vit"].model(), CASES["vit"].inputs()[0]


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return model.eval(), torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))


# Hooked modules run inside the outer explanation's rule mode and attention kernel: the HF ViT's
# first MLP input layer, the timm ViT's first qkv projection (inside its SDPA interception).
def _hooked_module(model):
    return model.vit.layers[0].mlp.fc1 if hasattr(model, "vit") else model.blocks[0].attn.qkv


INNER = {
    "generic-attention": lambda model, x: GenericAttention(model).attribute(x, target=[0, 1, 2]),
    "conservative-lrp": lambda model, x: ConservativeLRP(model).attribute(x, target=[0, 1, 2]),
    "attn-lrp": lambda model, x: AttnLRP(model).attribute(x, target=[0, 1, 2]),
    "transformer-relevance": lambda model, x: TransformerRelevance(model).attribute(x, target=[0, 1, 2]),
}


def _plain(model, x):
    """B's plain forward and its input gradient, as a user's hook would compute them."""
    with torch.enable_grad():
        leaf = x.clone().requires_grad_()
        output = model(leaf)
        output = output.logits if hasattr(output, "logits") else output
        (gradient,) = torch.autograd.grad(output[:, 1].sum(), leaf)
    return output.detach(), gradient


def _inner_results(model, x):
    results = {name: inner(model, x) for name, inner in INNER.items()}
    results["plain-output"], results["plain-gradient"] = _plain(model, x)
    return results


PAIRS = {"hf-hooks-timm": (_hf_vit, _timm_vit), "timm-hooks-hf": (_timm_vit, _hf_vit)}
_ALONE = {}


def _alone(pair):
    """(outer maps per method, inner results), each computed with no explanation around it."""
    if pair not in _ALONE:
        build_outer, build_inner = PAIRS[pair]
        (outer, x), (inner, y) = build_outer(), build_inner()
        maps = {name: METHOD_FACTORIES[name](outer).attribute(x, target=[0, 1, 2]) for name in METHOD_FACTORIES}
        _ALONE[pair] = (maps, _inner_results(inner, y))
    return _ALONE[pair]


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("outer_method", sorted(METHOD_FACTORIES))
def test_an_explanation_inside_a_hook_gets_its_map_alone(pair, outer_method):
    outer_maps, inner_alone = _alone(pair)
    build_outer, build_inner = PAIRS[pair]
    (outer, x), (inner, y) = build_outer(), build_inner()
    seen = []
    handle = _hooked_module(outer).register_forward_hook(lambda *_: seen.append(_inner_results(inner, y)))
    try:
        maps = METHOD_FACTORIES[outer_method](outer).attribute(x, target=[0, 1, 2])
    finally:
        handle.remove()
    assert seen, "the hook never ran"
    for results in seen:
        for name, expected in inner_alone.items():
            assert torch.equal(results[name], expected), f"{name} of the inner model differs inside {outer_method}"
    assert torch.equal(maps, outer_maps[outer_method]), f"{outer_method}'s map changed by the hook"


def test_a_plain_forward_of_the_same_model_in_its_own_hook_is_its_plain_forward():
    model, x = _timm_vit()
    with torch.no_grad():
        expected = model(x)
    seen, busy = [], []

    def hook(*_):
        if not busy:  # the hook fires again inside the nested forward
            busy.append(True)
            with torch.no_grad():
                seen.append(model(x))
            busy.pop()

    handle = _hooked_module(model).register_forward_hook(hook)
    try:
        AttnLRP(model).attribute(x, target=[0, 1, 2])
    finally:
        handle.remove()
    assert seen and all(torch.equal(output, expected) for output in seen)


@pytest.mark.parametrize("inner", ["same model", "a wrapper sharing its modules"])
@pytest.mark.parametrize("outer_method", ["generic-attention", "attn-lrp", "transformer-relevance"])
def test_explaining_the_same_model_inside_its_own_explanation_is_refused(inner, outer_method):
    model, x = _timm_vit()
    nested = model if inner == "same model" else torch.nn.Sequential(model)
    before = snapshot(model)

    def hook(*_):
        GenericAttention(nested).attribute(x, target=[0, 1, 2])

    handle = _hooked_module(model).register_forward_hook(hook)
    try:
        with pytest.raises(CaptureError, match="explained from a hook on one of its own modules"):
            METHOD_FACTORIES[outer_method](model).attribute(x, target=[0, 1, 2])
    finally:
        handle.remove()
    assert_same(before, snapshot(model))
    assert torch.equal(METHOD_FACTORIES[outer_method](model).attribute(x, target=[0, 1, 2]),
                       METHOD_FACTORIES[outer_method](_timm_vit()[0]).attribute(x, target=[0, 1, 2]))


@pytest.mark.parametrize("outer_method", ["generic-attention", "attn-lrp", "transformer-relevance"])
def test_an_explanation_inside_a_backward_hook_gets_its_map_alone(outer_method):
    outer, x = _timm_vit()
    inner, y = _hf_vit()
    expected = GenericAttention(inner).attribute(y, target=[0, 1, 2])
    seen = []
    handle = outer.blocks[1].mlp.register_full_backward_hook(
        lambda *_: seen.append(GenericAttention(inner).attribute(y, target=[0, 1, 2])))
    try:
        METHOD_FACTORIES[outer_method](outer).attribute(x, target=[0, 1, 2])
    finally:
        handle.remove()
    assert seen and all(torch.equal(found, expected) for found in seen)


def test_an_explanation_from_a_tensor_hook_of_the_outer_graph_is_refused():
    # A tensor hook runs in the outer backward pass, outside any module hook: it cannot be isolated.
    outer, x = _timm_vit()
    inner, y = _hf_vit()
    before = snapshot(outer)

    def explain_inner(grad):
        GenericAttention(inner).attribute(y, target=[0, 1, 2])

    def hook(module, args, output):
        output.register_hook(explain_inner)

    handle = outer.blocks[1].mlp.register_forward_hook(hook)
    try:
        with pytest.raises(CaptureError, match="outside a hook on that model's modules"):
            TransformerRelevance(outer).attribute(x, target=[0, 1, 2])
    finally:
        handle.remove()
    assert_same(before, snapshot(outer))
    alone = _alone("timm-hooks-hf")[1]["generic-attention"]
    assert torch.equal(GenericAttention(inner).attribute(y, target=[0, 1, 2]), alone)


def test_the_users_hooks_are_put_back_exactly_even_after_an_error_and_a_self_removal():
    model, x = _timm_vit()
    module = _hooked_module(model)
    calls = []

    def observer(*_):
        calls.append("observer")

    def one_shot(*_):
        calls.append("one shot")
        removable.remove()

    def failing(*_):
        raise KeyboardInterrupt

    kept = module.register_forward_hook(observer)
    removable = module.register_forward_hook(one_shot)
    GenericAttention(model).attribute(x, target=[0, 1, 2])
    assert calls == ["observer", "one shot"] and list(module._forward_hooks.values()) == [observer]
    failure = module.register_forward_pre_hook(failing)
    with pytest.raises(KeyboardInterrupt):
        AttnLRP(model).attribute(x, target=[0, 1, 2])
    assert module._forward_hooks[kept.id] is observer and module._forward_pre_hooks[failure.id] is failing
    failure.remove()
    kept.remove()


# -- the train-mode rule stays on inside the hook, for the hooked model only -------------------------

class _SeededNoise(torch.nn.Module):
    """Noise drawn in the forward at any mode, from its own seeded generator (the same numbers
    on every call): a random draw that is this model's business, not the hooked model's."""

    def forward(self, hidden):
        return hidden + 0.1 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))


def _timm_vit_with(p=0.0, noise=False):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              drop_rate=p, attn_drop_rate=p, proj_drop_rate=p)
    if noise:
        model.norm_pre = _SeededNoise()
    return model, torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _explained_in_a_hook_of_a_training_model(outer_method, explain_inner):
    """Explain a timm ViT in training mode without dropout (its train-mode watch is on) whose
    first block runs ``explain_inner`` from a forward hook; the hook's results."""
    outer, x = _timm_vit_with()
    outer.train()
    seen = []
    handle = _hooked_module(outer).register_forward_hook(lambda *_: seen.append(explain_inner()))
    try:
        METHOD_FACTORIES[outer_method](outer).attribute(x, target=[0, 1, 2])
    finally:
        handle.remove()
    assert seen, "the hook never ran"
    return seen


@pytest.mark.parametrize("outer_method", ["generic-attention", "attn-lrp"])
def test_another_model_in_a_hook_follows_its_own_train_mode_rule_not_the_hooked_ones(outer_method):
    # In eval mode, its own random draws are not the hooked model's: explained as alone.
    noisy, y = _timm_vit_with(noise=True)
    noisy.eval()
    alone = GenericAttention(noisy).attribute(y, target=[0, 1, 2])
    inside = _explained_in_a_hook_of_a_training_model(
        outer_method, lambda: GenericAttention(noisy).attribute(y, target=[0, 1, 2]))
    assert all(torch.equal(found, alone) for found in inside)

    # In training mode with dropout and its own opt-in: one draw, the same as alone with the same seed.
    dropping, y = _timm_vit_with(p=0.3)
    dropping.train()

    def allowed():
        torch.manual_seed(7)
        return GenericAttention(dropping, allow_stochastic=True).attribute(y, target=[0, 1, 2])

    alone = allowed()
    inside = _explained_in_a_hook_of_a_training_model(outer_method, allowed)
    assert all(torch.equal(found, alone) for found in inside)

    # Without its opt-in: refused by its own rule, naming its own layer.
    with pytest.raises(StochasticForwardError, match=r"blocks\.0\.attn\.attn_drop: Dropout\(p=0\.3\)"):
        _explained_in_a_hook_of_a_training_model(
            outer_method, lambda: GenericAttention(dropping).attribute(y, target=[0, 1, 2]))
