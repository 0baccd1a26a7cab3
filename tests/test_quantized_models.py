"""Quantized linear layers: bitsandbytes 4-bit NF4 and 8-bit (LLM.int8()), torchao int8 weight-only.

A tiny HF Llama is saved and loaded back quantized (``BitsAndBytesConfig`` / ``TorchAoConfig``,
transformers' own path), in bfloat16 and float32 compute. Every method of the catalog then runs
(the identity-rule methods refuse bfloat16, as on unquantized models) and its maps correlate
>= 0.95 per example with the maps of the unquantized model holding the dequantized weights
(measured, worst method per kind: bfloat16 0.970 (int8) to 0.992 (torchao), float32 0.987 (int8) to
1.0000; medians 0.999-1.0). Against the weights before quantization they correlate less where the
quantization itself changes the model (NF4 on this tiny random model: median 0.92, Grad-CAM 0.15;
int8 and torchao: medians 0.998). Rules that read a weight read the dequantized one; the
CPU inference repacking of 4-bit weights (no backward) is undone; a bitsandbytes build without
a kernel for the device is refused by name. Skipped with the reason where a library or its CPU
backend is missing. ``CAPTUM_TRANSFORMERS_TEST_DEVICE=cuda`` runs the correlation and dequantization
tests on a GPU's kernels instead (the other tests are about the CPU backend).
"""
from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum_transformers import AttnLRP, CaptureError, ConservativeLRP, GenericAttention, InputError  # noqa: E402
from captum_transformers.compat import quantized_linear
from captum_transformers.generation import GenerationAttribution  # noqa: E402
from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES, build_method  # noqa: E402
from generation_models import IdTokenizer  # noqa: E402

KINDS = ("nf4", "nf4-double", "int8", "torchao")  # nf4-double: double quantization (nested scales)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
DEVICE = torch.device(os.environ.get("CAPTUM_TRANSFORMERS_TEST_DEVICE", "cpu"))
ROUNDING_SENSITIVE = {"partial-lrp", "lrp", "transformer-relevance"}  # refuse bfloat16 models, quantized or not
_CONFIG = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, initializer_range=0.2)


def _require(kind: str) -> None:
    """Skip, naming what is missing, where ``kind`` cannot run on this machine's CPU."""
    if kind == "torchao":
        pytest.importorskip("torchao", reason="torchao is not installed (pip install captum-transformers[quantized])")
        return
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install captum-transformers[quantized])")
    operator = quantized_linear._BNB_OPERATORS[quantized_linear.BNB_4BIT if kind.startswith("nf4") else quantized_linear.BNB_8BIT]
    if not quantized_linear._kernel_available(operator, DEVICE):
        pytest.skip(f"this bitsandbytes build has no {DEVICE.type} backend for {operator} "
                    "(CAPTUM_TRANSFORMERS_TEST_DEVICE=cuda runs these tests on a GPU)")


def _quantization_config(kind: str, dtype: torch.dtype):
    if kind.startswith("nf4"):
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                               bnb_4bit_use_double_quant=kind == "nf4-double")
    if kind == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    from torchao.quantization import Int8WeightOnlyConfig
    return transformers.TorchAoConfig(Int8WeightOnlyConfig())


_PAIRS: dict = {}


def _pair(kind: str, dtype_name: str, head: str = "classifier"):
    """(quantized model, unquantized model holding its dequantized weights), built once."""
    key = (kind, dtype_name, head)
    if key not in _PAIRS:
        _require(kind)
        dtype = DTYPES[dtype_name]
        torch.manual_seed(0)
        cls = transformers.LlamaForSequenceClassification if head == "classifier" else transformers.LlamaForCausalLM
        config = transformers.LlamaConfig(**_CONFIG, num_labels=3)
        base = cls(config).to(dtype).eval().to(DEVICE)
        import tempfile
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            base.save_pretrained(folder)
            quantized = cls.from_pretrained(folder, quantization_config=_quantization_config(kind, dtype),
                                            device_map=str(DEVICE), dtype=dtype).eval()
        reference = copy.deepcopy(base)
        modules = dict(reference.named_modules())
        layers = quantized_linear.quantized_linears(quantized)
        assert len(layers) == 7 * config.num_hidden_layers  # q, k, v, o, gate, up, down
        for name, module, _ in layers:
            modules[name].weight.data.copy_(quantized_linear.dequantized_weight(module).to(dtype))
        _PAIRS[key] = quantized, reference, base
    return _PAIRS[key]


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


IDS = torch.tensor([[5, 9, 3, 17, 22, 4, 30, 11, 8], [7, 41, 12, 3, 6, 19, 25, 2, 14]])
TARGET = torch.tensor([1, 2])


def _map(name: str, model: torch.nn.Module) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' int8 cast notice
        result = build_method(name, model).attribute(IDS.to(DEVICE), target=TARGET.to(DEVICE))
    return (result[0] if isinstance(result, tuple) else result).cpu()


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", KNOWN_METHOD_NAMES)
def test_every_method_follows_the_dequantized_model(name, kind, dtype_name):
    quantized, reference, _ = _pair(kind, dtype_name)
    if dtype_name == "bfloat16" and name in ROUNDING_SENSITIVE:
        with pytest.raises(InputError, match="bfloat16"):
            _map(name, quantized)
        return
    maps, expected = _map(name, quantized), _map(name, reference)
    assert maps.dtype == torch.float32 and maps.shape == expected.shape  # relevance accumulated in float32
    assert torch.isfinite(maps).all() and maps.abs().sum() > 0
    worst = min(_pearson(a, b) for a, b in zip(maps, expected))
    assert worst >= 0.95, f"{name} on {kind} ({dtype_name}): worst per-example correlation {worst:.4f}"


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_weight_is_the_weight_the_forward_multiplies_by(kind):
    quantized, _, _ = _pair(kind, "float32")
    name, module, _ = quantized_linear.quantized_linears(quantized)[0]
    x = torch.randn(3, module.in_features, device=DEVICE)
    # (The kernels an explanation runs: a CPU-repacked 4-bit weight computes in bfloat16.)
    with torch.no_grad(), warnings.catch_warnings(), quantized_linear.differentiable_kernels(quantized):
        warnings.simplefilter("ignore")
        expected = torch.nn.functional.linear(x, quantized_linear.dequantized_weight(module).float())
        got = module(x).float()
    # int8 also quantizes the activations (LLM.int8()): equal to their rounding.
    tolerance = 2e-2 if kind == "int8" else 1e-4
    assert (got - expected).abs().max() <= tolerance * expected.abs().max(), name


@pytest.mark.parametrize("kind", ("nf4", "nf4-double", "int8"))
def test_bitsandbytes_layers_get_the_linear_rule(kind, monkeypatch):
    """Chefer et al.'s LRP reads every linear weight; bitsandbytes layers never call F.linear, so
    without their own rule forwards they would pass the plain gradient: a different map."""
    quantized, reference, _ = _pair(kind, "float32")
    expected = _map("lrp", reference)
    ruled = _map("lrp", quantized)
    monkeypatch.setattr("captum_transformers.propagation.rules.operations.linear_rule_forwards",
                        lambda model, rules: contextlib.nullcontext())
    plain = _map("lrp", quantized)
    ruled_r = min(_pearson(a, b) for a, b in zip(ruled, expected))
    plain_r = min(_pearson(a, b) for a, b in zip(plain, expected))
    print(f"{kind}: with the rule r >= {ruled_r:.4f}, error {(ruled - expected).norm() / expected.norm():.3f}; "
          f"without r >= {plain_r:.4f}, error {(plain - expected).norm() / expected.norm():.3f}")
    assert ruled_r >= 0.99 and (plain - expected).norm() > 3 * (ruled - expected).norm()


@pytest.mark.parametrize("kind", ("nf4", "nf4-double"))
def test_cpu_repacked_4bit_weights_are_unpacked_for_the_gradient(kind):
    """bitsandbytes repacks a 4-bit weight for its CPU inference kernel (no backward) at an eval
    forward without gradients; the gradient through it would then be silently zero. Its own
    inverse leaves the block scales transposed (wrong weights wherever a row has several blocks)."""
    quantized, _, _ = _pair(kind, "bfloat16")
    fresh = copy.deepcopy(quantized)
    module = quantized.model.layers[0].mlp.down_proj
    with torch.no_grad():
        quantized(IDS)  # a prediction first, as generate() does
    repacked = getattr(module.weight.quant_state, "packing_format_for_cpu", False)
    if repacked:  # an AVX512-BF16 CPU: show the hazard the package guards against
        x = torch.randn(2, module.in_features, dtype=torch.bfloat16, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            through = torch.autograd.grad(module(x).float().sum(), x, allow_unused=True)[0]
        assert through is None or through.abs().sum() == 0
    for method in (AttnLRP, GenericAttention):
        after, never_packed = method(quantized).attribute(IDS, target=TARGET), method(fresh).attribute(IDS, target=TARGET)
        if kind == "nf4":
            assert torch.equal(after, never_packed)
        else:  # the repacking rounded the dequantized (nested) block scales to bfloat16: the model that ran
            assert min(_pearson(a, b) for a, b in zip(after, never_packed)) >= 0.999
    for (_, unpacked, _), (_, original, _) in zip(quantized_linear.quantized_linears(quantized),
                                                  quantized_linear.quantized_linears(fresh)):
        weight, expected = quantized_linear.dequantized_weight(unpacked), quantized_linear.dequantized_weight(original)
        assert ((weight.float() - expected.float()).abs() <= 2 ** -7 * expected.float().abs()).all()
    if repacked:  # unpacked for good: bitsandbytes repacks at the next gradient-free forward
        assert not module.weight.quant_state.packing_format_for_cpu
        assert module.support_avx512bf16_for_cpu  # the instance's flag given back


def test_a_bitsandbytes_build_without_a_kernel_for_the_device_is_refused(monkeypatch):
    quantized, _, _ = _pair("nf4", "bfloat16")
    monkeypatch.setattr(quantized_linear, "_kernel_available", lambda operator, device: False)
    for method in (AttnLRP, GenericAttention, lambda m: build_method("saliency", m)):
        with pytest.raises(CaptureError, match=r"Linear4bit.*CUDA build of bitsandbytes"):
            method(quantized).attribute(IDS, target=TARGET)


def test_dequantizing_an_ordinary_layer_is_refused():
    with pytest.raises(CaptureError, match="Linear is not a quantized linear layer"):
        quantized_linear.dequantized_weight(torch.nn.Linear(3, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_generation_attribution_follows_the_dequantized_model(kind):
    quantized, reference, _ = _pair(kind, "bfloat16", head="lm")
    prompt, target = [1, 5, 7, 9, 11, 13], [20, 21, 22]
    for method in (AttnLRP, ConservativeLRP, GenericAttention):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = GenerationAttribution(method(quantized), IdTokenizer()).attribute(prompt, target=target)
            expected = GenerationAttribution(method(reference), IdTokenizer()).attribute(prompt, target=target)
        assert got.token_attr.dtype == torch.float32 and got.token_attr.shape == (3, 6)
        worst = min(_pearson(a, b) for a, b in zip(got.token_attr, expected.token_attr))
        assert worst >= 0.95, f"{method.__name__} on {kind}: worst per-step correlation {worst:.4f}"


def test_generate_then_explain_a_4bit_model():
    """generate() runs without gradients (repacking 4-bit weights on AVX512-BF16 CPUs); the
    explanation of what it wrote still follows the dequantized model."""
    quantized, reference, _ = _pair("nf4", "bfloat16", head="lm")
    arguments = {"max_new_tokens": 3, "do_sample": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = GenerationAttribution(AttnLRP(quantized), IdTokenizer()).attribute([1, 5, 7, 9], gen_args=arguments)
        expected = GenerationAttribution(AttnLRP(reference), IdTokenizer()).attribute(
            [1, 5, 7, 9], target=got.output_ids)
    assert min(_pearson(a, b) for a, b in zip(got.token_attr, expected.token_attr)) >= 0.95


def test_an_8bit_layer_kept_in_float_gives_its_float_weight():
    _require("int8")
    import bitsandbytes as bnb
    layer = bnb.nn.Linear8bitLt(8, 4, has_fp16_weights=True)
    assert quantized_linear.quantized_kind(layer) == quantized_linear.BNB_8BIT
    assert torch.equal(quantized_linear.dequantized_weight(layer), layer.weight.detach())
    assert quantized_linear.quantized_kind(torch.nn.Linear(8, 4)) is None


def test_a_bitsandbytes_without_torch_operators_is_taken_for_cuda_only(monkeypatch):
    def unregistered(operator, key):
        raise RuntimeError(f"operator {operator} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", unregistered)
    operator = quantized_linear._BNB_OPERATORS[quantized_linear.BNB_4BIT]
    assert not quantized_linear._kernel_available(operator, torch.device("cpu"))
    assert quantized_linear._kernel_available(operator, torch.device("cuda"))


@pytest.mark.parametrize("config_name, field", [("Int8DynamicActivationInt8WeightConfig", "act_quant_kwargs"),
                                                ("Int8DynamicActivationIntxWeightConfig", "activation_quantization")])
def test_torchao_activation_quantization_is_refused_where_gradients_are_needed(config_name, field):
    """torchao rounds the activations of these layers without a gradient (measured: an input's
    grad stays None): gradient methods are refused by name, maps without gradients still run."""
    _require("torchao")
    import torchao.quantization
    from captum_transformers import AttentionRollout

    config = getattr(torchao.quantization, config_name, None)
    if config is None:
        pytest.skip(f"this torchao release has no {config_name}")
    _, _, base = _pair("torchao", "bfloat16")
    model = copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchao.quantization.quantize_(model, config())
    for method in (AttnLRP, GenericAttention, lambda m: build_method("saliency", m)):
        with pytest.raises(CaptureError, match=f"quantizes its activations.*{field}.*Int8WeightOnlyConfig"):
            method(model).attribute(IDS, target=TARGET)
    rollout = AttentionRollout(model).attribute(IDS)
    assert torch.isfinite(rollout).all() and rollout.abs().sum() > 0
