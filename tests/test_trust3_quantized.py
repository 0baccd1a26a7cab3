"""bitsandbytes 4-bit on CPU after a gradient-free forward (issue 41, item 4).

On an AVX512-BF16 CPU, bitsandbytes repacks a 4-bit weight at the first eval forward without
gradients and from then on computes it in bfloat16 (whatever the compute dtype) with block
scales rounded to bfloat16, a kernel with no backward. The explanation runs the differentiable
kernel on the same weights, so its scores differ from that kernel's logits by its rounding: the
package says so once per model, and predictions inside ``differentiable_kernels(model)`` are
the model the explanation follows, bit for bit.
"""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install captum-transformers[quantized])")

from captum_transformers import AttnLRP, GenericAttention  # noqa: E402
from captum_transformers.compat.quantized_linear import differentiable_kernels, quantized_linears  # noqa: E402

IDS = torch.tensor([[5, 9, 3, 17, 22, 4, 30, 11, 8], [7, 41, 12, 3, 6, 19, 25, 2, 14]])


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, initializer_range=0.2)
    base = transformers.LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base.save_pretrained(folder)
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=torch.float32)
        model = transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                              device_map="cpu", dtype=torch.float32).eval()
    layer = quantized_linears(model)[0][1]
    if not getattr(layer, "support_avx512bf16_for_cpu", False):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks 4-bit weights here")
    return model


def _explain(method, model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        maps = method(model).attribute(IDS, target=3)
    return maps, [str(w.message) for w in caught if "repacked for bitsandbytes" in str(w.message)]


def test_explaining_after_a_gradient_free_forward_says_what_it_explains():
    model = _model()
    with torch.no_grad():
        kernel_logits = model(IDS).logits  # repacks: from now on the bfloat16 inference kernel
    maps, said = _explain(AttnLRP, model)
    assert len(said) == 1 and "computes in bfloat16" in said[0] and "differentiable_kernels(model)" in said[0]
    again, said_again = _explain(AttnLRP, model)
    assert said_again == [] and torch.equal(maps, again)  # once per model; the same model each call
    with torch.no_grad(), differentiable_kernels(model):
        followed = model(IDS).logits
    with torch.enable_grad():
        explained = model(IDS).logits.detach()
    assert torch.equal(followed, explained)  # the model the explanation follows, bit for bit
    assert not torch.equal(kernel_logits, explained)  # (the inference kernel's rounding differs)


def test_a_model_never_repacked_explains_without_a_word():
    model = _model()
    with torch.no_grad(), differentiable_kernels(model):
        model(IDS)  # predictions held on the differentiable kernel repack nothing
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for _, m, _ in quantized_linears(model))
    _, said = _explain(GenericAttention, model)
    assert said == []


def test_generation_attribution_writes_its_tokens_with_the_model_it_explains():
    from generation_models import IdTokenizer
    from captum_transformers import GenerationAttribution

    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = GenerationAttribution(AttnLRP(model), IdTokenizer()).attribute(
            [1, 5, 7, 9], gen_args={"max_new_tokens": 3, "do_sample": False})
    assert not [w for w in caught if "repacked for bitsandbytes" in str(w.message)]
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for _, m, _ in quantized_linears(model))
    ids = torch.tensor([[1, 5, 7, 9] + list(result.output_ids)])
    with torch.no_grad(), differentiable_kernels(model):
        logits = model(ids).logits[0, 3:-1]
    expected = logits.gather(-1, torch.tensor(result.output_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(result.scores.to(expected.dtype), expected, rtol=1e-6, atol=1e-6)
