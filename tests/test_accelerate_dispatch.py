"""Models dispatched by accelerate: ``cpu_offload`` (weights in CPU memory, loaded per module) and
``dispatch_model`` with a device map mixing plain CPU layers and layers offloaded to disk.

Every method gives the undispatched model's map (float64, 1e-10), accelerate's hooks compose
with the package's patches and are intact afterwards (same hook objects, same forwards,
weights back on meta where they were, the offloaded values and flags unchanged), also after an
error inside an offloaded layer's own forward; a weight on meta that no hook loads is refused
with the module's name for every adapter (HuggingFace, timm, torch MHA) and Captum's baselines;
an offloaded LLaVA's images go to the execution device (its image maps are the plain model's).
With a CUDA device, a model spread over it and the CPU (even layers on the GPU, each part computed
where its weights are) gives the CPU model's maps to 1e-5 of their largest value (the forward itself
differs across devices by rounding), on the input's device; skipped without one (as in CI).
"""
from __future__ import annotations

import copy

import pytest
import torch

from captum_transformers import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, AttnLRP, RawAttention
from captum_transformers.errors import CaptureError
from captum_transformers.generation import GenerationAttribution
from generation_models import IdTokenizer
from hf_models import CASES

accelerate = pytest.importorskip("accelerate")

METHODS = ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS
MODELS = ["llama_gqa", "bert", "vit"]
TARGETS = {"llama_gqa": 5, "bert": 1, "vit": 1}


def _device_map(model, even="cpu", odd="disk"):
    """Even layers on ``even``, odd layers on ``odd`` (by default plain on the CPU and offloaded to
    disk); the other top-level parts alternate between the two."""
    layers = {}
    for name, _ in model.named_modules():
        parts = name.split(".")
        if len(parts) > 1 and parts[-1].isdigit() and parts[-2] in ("layer", "layers"):
            layers[name] = even if int(parts[-1]) % 2 == 0 else odd
    prefix = next(iter(layers)).rsplit(".", 2)[0]  # the stack holding the layers
    device_map, turn = dict(layers), 0
    for name, module in model.named_modules():
        inside = any(name == k or name.startswith(k + ".") for k in device_map)
        above = any(k.startswith(name + ".") for k in device_map) or not name
        if inside or above or name == prefix:
            continue
        device_map[name] = odd if turn % 2 else even
        turn += 1
    return device_map


# A model spread over a GPU and the CPU (each part computed where its weights are; the main device
# is the CPU), where the machine has one: run with a GPU, skipped in CI.
ON_TWO_DEVICES = pytest.param("cuda_and_cpu", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a model spread over two devices needs a CUDA device besides the CPU"))
# Across devices the forward itself differs by rounding (transformers computes Llama's rotary angles in
# float32 even in a float64 model): maps are compared relative to their largest value.
TWO_DEVICE_TOLERANCE = 1e-5


def _assert_same_map(found, expected, how, msg=""):
    if how == "cuda_and_cpu":
        assert found.device == expected.device, msg
        gap = float((found - expected).abs().max() / expected.abs().max())
        assert gap <= TWO_DEVICE_TOLERANCE, f"{msg}: relative gap {gap:.2e}"
        return
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-10, msg=msg)


def _dispatched(model, how, folder):
    if how == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device="cpu")
    if how == "cuda_and_cpu":
        return accelerate.dispatch_model(model, device_map=_device_map(model, even=0, odd="cpu"), main_device="cpu")
    return accelerate.dispatch_model(model, device_map=_device_map(model), main_device="cpu", offload_dir=str(folder),
                                     offload_buffers=True)


def _state(model):
    """What accelerate holds per module: its hook object, its forward and saved forward, the device
    of each own parameter, each parameter's requires_grad and grad, and the offloaded values."""
    state = {}
    for name, module in model.named_modules():
        hook = vars(module).get("_hf_hook")
        offloaded = {}
        if hook is not None and getattr(hook, "offload", False):
            offloaded = {k: hook.weights_map[k].clone() for k in hook.weights_map.keys()
                         if k in dict(module.named_parameters(recurse=False))}
        state[name] = dict(
            hook=hook, forward=vars(module).get("forward"), old_forward=vars(module).get("_old_forward"),
            devices={k: p.device.type for k, p in module.named_parameters(recurse=False)},
            requires_grad={k: p.requires_grad for k, p in module.named_parameters(recurse=False)},
            grads={k: p.grad for k, p in module.named_parameters(recurse=False)},
            offloaded=offloaded, hooks=(dict(module._forward_hooks), dict(module._forward_pre_hooks)),
            values={k: p.detach().clone() for k, p in module.named_parameters(recurse=False) if not p.is_meta})
    return state


def _assert_state(before, after):
    assert before.keys() == after.keys()
    for name in before:
        b, a = before[name], after[name]
        assert a["hook"] is b["hook"] and a["forward"] is b["forward"] and a["old_forward"] is b["old_forward"], name
        assert a["devices"] == b["devices"] and a["requires_grad"] == b["requires_grad"], name
        assert all(g is None for g in a["grads"].values()), name
        assert a["hooks"] == b["hooks"], name
        for key in ("offloaded", "values"):
            assert a[key].keys() == b[key].keys(), name
            for k in b[key]:
                assert torch.equal(a[key][k], b[key][k]), (name, k)


@pytest.fixture(scope="module")
def plain_models():
    built = {}
    for name in MODELS:
        spec = CASES[name]
        inputs, kwargs = spec.inputs(dtype=torch.float64)
        built[name] = spec.model(dtype=torch.float64), inputs, kwargs
    return built


def _explain(method, model, inputs, kwargs, target):
    return method(model).attribute(inputs, target=target, forward_kwargs=kwargs, return_tokens=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", ["cpu_offload", "cpu_and_disk", ON_TWO_DEVICES])
@pytest.mark.parametrize("name", MODELS)
def test_every_method_gives_the_undispatched_map_and_leaves_the_hooks_intact(plain_models, name, how, tmp_path):
    model, inputs, kwargs = plain_models[name]
    dispatched = _dispatched(copy.deepcopy(model), how, tmp_path)
    if how == "cuda_and_cpu":
        assert {p.device.type for p in dispatched.parameters()} == {"cuda", "cpu"}, "precondition: two devices"
    else:
        assert any(p.is_meta for p in dispatched.parameters()), "precondition: some weights are offloaded"
    before = _state(dispatched)
    for method in METHODS:
        reference = _explain(method, model, inputs, kwargs, TARGETS[name])
        assert reference.abs().max() > 0, method.__name__
        scores = _explain(method, dispatched, inputs, kwargs, TARGETS[name])
        _assert_same_map(scores, reference, how, f"{method.__name__}")
        _assert_state(before, _state(dispatched))
    # The dispatched model still computes the plain model's output.
    logits = dispatched(inputs, **kwargs).logits.to(inputs.device)
    torch.testing.assert_close(logits, model(inputs, **kwargs).logits, rtol=0,
                               atol=1e-12 if how != "cuda_and_cpu" else 1e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_frozen_offloaded_parameters_stay_frozen(plain_models):
    """accelerate replaces an offloaded parameter at each onload, copying its flag: the flags
    the explanation sets must not stay on the replacements."""
    model, inputs, kwargs = plain_models["llama_gqa"]
    dispatched = accelerate.cpu_offload(copy.deepcopy(model), execution_device="cpu")
    dispatched.requires_grad_(False)
    reference = _explain(AttnLRP, model, inputs, kwargs, 5)
    torch.testing.assert_close(_explain(AttnLRP, dispatched, inputs, kwargs, 5), reference, rtol=0, atol=1e-10)
    assert not any(p.requires_grad for p in dispatched.parameters())


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", ["cpu_offload", "cpu_and_disk", ON_TWO_DEVICES])
def test_generation_attribution_on_a_dispatched_llama(plain_models, how, tmp_path):
    model, _, _ = plain_models["llama_gqa"]
    dispatched = _dispatched(copy.deepcopy(model), how, tmp_path)
    before = _state(dispatched)
    prompt, answer = [1, 5, 7, 9, 11, 13], [20, 21, 22]
    for method in (AttnLRP, RawAttention):
        reference = GenerationAttribution(method(model), IdTokenizer()).attribute(prompt, target=answer)
        result = GenerationAttribution(method(dispatched), IdTokenizer()).attribute(prompt, target=answer)
        _assert_same_map(result.token_attr, reference.token_attr, how, method.__name__)
        _assert_state(before, _state(dispatched))
    generated = GenerationAttribution(AttnLRP(dispatched), IdTokenizer()).attribute(
        prompt, gen_args={"max_new_tokens": 3, "do_sample": False})
    expected = GenerationAttribution(AttnLRP(model), IdTokenizer()).attribute(
        prompt, gen_args={"max_new_tokens": 3, "do_sample": False})
    assert generated.output_tokens == expected.output_tokens
    _assert_same_map(generated.token_attr, expected.token_attr, how, "generated")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", [RawAttention, AttnLRP], ids=lambda m: m.__name__)
def test_a_meta_weight_no_hook_loads_is_refused_with_the_module(plain_models, method, tmp_path):
    model, inputs, kwargs = plain_models["llama_gqa"]
    dispatched = _dispatched(copy.deepcopy(model), "cpu_and_disk", tmp_path)
    accelerate.hooks.remove_hook_from_submodules(dispatched)  # (this loads the offloaded weights back)
    for module in dispatched.model.layers[1].modules():  # a layer whose weights were never loaded
        for key in [k for k, p in module._parameters.items() if p is not None]:
            accelerate.utils.set_module_tensor_to_device(module, key, "meta")
    with pytest.raises(CaptureError, match=r"model\.layers\.1\.\S+ .*meta device and no accelerate offload hook"):
        _explain(method, dispatched, inputs, kwargs, 5)


def _timm_case():
    pytest.importorskip("timm")
    from tiny_models import timm_vit_case

    model, images, _ = timm_vit_case()
    return model.double(), images[:1].double(), "blocks.1.mlp.fc1", 1


def _torch_mha_case():
    from tiny_models import EncoderClassifier

    model = EncoderClassifier().double().eval()
    return model, torch.tensor([[1, 4, 6, 9, 2]]), "encoder.layers.1.linear1", 2


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", [_timm_case, _torch_mha_case], ids=["timm", "torch_mha"])
@pytest.mark.parametrize("method", ["raw-attention", "attn-lrp", "generic-attention", "saliency"])
def test_a_meta_weight_is_refused_for_every_adapter_and_captum_baseline(case, method):
    """A weight on meta that no hook loads (here the first MLP matrix of layer 1) used to give a
    wrong map from placeholders on non-HF adapters (timm AttnLRP: r = 0.41 with the true map)."""
    from captum_transformers.methods.catalog import build_method

    model, inputs, module_name, target = case()
    accelerate.utils.set_module_tensor_to_device(model.get_submodule(module_name), "weight", "meta")
    with pytest.raises(CaptureError, match=rf"{module_name} .*\['weight'\] on the meta device and no accelerate"):
        build_method(method, model).attribute(inputs, target=target)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_generation_attribution_on_an_offloaded_vlm_gives_the_undispatched_image_maps():
    """The images go to the execution device (they went to the first parameter's, meta)."""
    pytest.importorskip("transformers")
    from vlm_models import build_llava, image_prompt, pixels

    model = build_llava().double()
    dispatched = accelerate.cpu_offload(copy.deepcopy(model), execution_device="cpu")
    assert next(dispatched.parameters()).is_meta, "precondition: the first parameter is offloaded"
    prompt, answer, images = image_prompt([1, 5], [7, 9]), [11, 12], pixels(1)
    with torch.no_grad():  # transformers installs its output-capturing hooks at the first forward
        dispatched(input_ids=torch.tensor([prompt]), pixel_values=images.double())
    before = _state(dispatched)
    reference = GenerationAttribution(AttnLRP(model), IdTokenizer()).attribute(prompt, target=answer, images=images)
    result = GenerationAttribution(AttnLRP(dispatched), IdTokenizer()).attribute(prompt, target=answer, images=images)
    assert reference.image_attr.abs().max() > 0
    torch.testing.assert_close(result.image_attr, reference.image_attr, rtol=0, atol=1e-10)
    torch.testing.assert_close(result.token_attr, reference.token_attr, rtol=0, atol=1e-10)
    _assert_state(before, _state(dispatched))


def _raising(*args, **kwargs):
    raise RuntimeError("raised inside the layer's forward")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", ["cpu_offload", "cpu_and_disk"])
@pytest.mark.parametrize("method", [RawAttention, AttnLRP], ids=lambda m: m.__name__)
def test_an_error_inside_an_offloaded_layer_puts_its_weights_back(plain_models, method, how, tmp_path):
    """accelerate runs post_forward only after a forward that returned: the offloaded layer whose
    own forward raised would otherwise keep its weights loaded after the error."""
    model, inputs, kwargs = plain_models["llama_gqa"]
    dispatched = _dispatched(copy.deepcopy(model), how, tmp_path)
    layer = dispatched.model.layers[1].mlp.up_proj
    assert layer.weight.is_meta, "precondition: the layer is offloaded"
    before = _state(dispatched)
    original = layer._old_forward  # what accelerate's hooked forward calls between pre_ and post_forward
    layer._old_forward = _raising
    try:
        with pytest.raises(RuntimeError, match="raised inside the layer's forward"):
            _explain(method, dispatched, inputs, kwargs, 5)
    finally:
        layer._old_forward = original
    assert layer.weight.is_meta
    _assert_state(before, _state(dispatched))
    torch.testing.assert_close(_explain(method, dispatched, inputs, kwargs, 5),
                               _explain(method, model, inputs, kwargs, 5), rtol=0, atol=1e-10)
