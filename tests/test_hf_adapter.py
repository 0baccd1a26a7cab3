"""HF adapter x every attention method: shapes, batching, padding, restore, eager == sdpa."""
from __future__ import annotations

import pytest
import torch

from captum_transformers import ATTENTION_METHODS, AttentionRollout, CaptureError, GenericAttention, get_adapter
from hf_models import CASES
from restore import assert_same, raising_after, snapshot

CASE_NAMES = sorted(CASES)
METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS]


def _targets(model, inputs, kwargs, batch):
    with torch.no_grad():
        logits = GenericAttention(model).trace(inputs, forward_kwargs=kwargs, target=0).logits
    return [(3 * i + 1) % logits.shape[-1] for i in range(batch)]


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("method", METHODS)
def test_output_shape_follows_input(case, method):
    spec = CASES[case]
    model = spec.model()
    inputs, kwargs = spec.inputs()
    attributions = method(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    if spec.kind == "image":
        assert attributions.shape == inputs.shape
        assert attributions.is_contiguous()
    else:
        assert attributions.shape == inputs.shape and attributions.is_floating_point()
    assert torch.isfinite(attributions).all()
    if method.__name__ != "AttentionGradCAM":  # Grad-CAM's ReLU can legitimately zero a random model's map
        assert attributions.abs().sum() > 0, "a method must never return an all-zero map"


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("method", METHODS)
def test_batch_equals_single(case, method):
    spec = CASES[case]
    model = spec.model()
    inputs, kwargs = spec.inputs(batch=3)
    targets = _targets(model, inputs, kwargs, 3)
    explainer = method(model)
    batched = explainer.attribute(inputs, target=targets, forward_kwargs=kwargs, return_tokens=True)
    for i in range(3):
        single_kwargs = {k: v[i:i + 1] for k, v in kwargs.items()}
        single = explainer.attribute(inputs[i:i + 1], target=targets[i], forward_kwargs=single_kwargs,
                                     return_tokens=True)
        torch.testing.assert_close(batched[i:i + 1], single, rtol=1e-4, atol=1e-6)


def test_rollout_with_discard_ratio_ignores_padding():
    """A padded example's rollout equals the example's real tokens alone, discard included."""
    spec = CASES["bert"]
    model = spec.model()
    inputs, kwargs = spec.inputs(batch=3)  # example 1 is padded after 5 tokens
    explainer = AttentionRollout(model, discard_ratio=0.5)
    batched = explainer.attribute(inputs, forward_kwargs=kwargs, return_tokens=True)
    alone = explainer.attribute(inputs[1:2, :5], forward_kwargs={"attention_mask": kwargs["attention_mask"][1:2, :5]},
                                return_tokens=True)
    torch.testing.assert_close(batched[1, :5], alone[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_eager_and_sdpa_give_the_same_trace(case):
    spec = CASES[case]
    inputs, kwargs = spec.inputs()
    traces = [GenericAttention(spec.model(impl)).trace(inputs, target=1, forward_kwargs=kwargs)
              for impl in ("eager", "sdpa")]
    assert len(traces[0]) == len(traces[1]) > 0
    for a, b in zip(traces[0].records, traces[1].records):
        assert a.block.name == b.block.name
        torch.testing.assert_close(a.backward_value, b.backward_value, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(traces[0].logits, traces[1].logits)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_forward_unchanged_inside_capture(case):
    spec = CASES[case]
    model = spec.model("sdpa")
    inputs, kwargs = spec.inputs()
    trace = GenericAttention(model).trace(inputs, target=1, forward_kwargs=kwargs)
    with torch.no_grad():
        reference = get_adapter(model).logits(model, model(inputs, **kwargs), trace.layout, causal=any(
            getattr(b.module, "is_causal", False) for b in get_adapter(model).blocks(model)))
    torch.testing.assert_close(trace.logits, reference, rtol=1e-5, atol=1e-6)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mid_forward_error", [False, True], ids=["normal_exit", "exception_mid_forward"])
def test_exact_restore(case, method, mid_forward_error):
    spec = CASES[case]
    model = spec.model("sdpa")
    inputs, kwargs = spec.inputs()
    with torch.no_grad():
        before_out = model(inputs, **kwargs)
    before = snapshot(model)
    if mid_forward_error:
        with raising_after(get_adapter(model).blocks(model)[-1].module, Boom("raised mid-forward")):
            with pytest.raises(Boom):
                method(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    else:
        method(model).attribute(inputs, target=0, forward_kwargs=kwargs)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(before_out[0], model(inputs, **kwargs)[0])


@pytest.mark.parametrize("case", [n for n in CASE_NAMES if CASES[n].kind == "text"])
def test_padding_is_respected(case):
    spec = CASES[case]
    model = spec.model()
    inputs, kwargs = spec.inputs()
    scores = GenericAttention(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)
    assert (scores[1, 5:] == 0).all()
    changed = inputs.clone()
    changed[1, 5:] = (changed[1, 5:] + 7) % spec.vocab
    again = GenericAttention(model).attribute(changed, target=1, forward_kwargs=kwargs, return_tokens=True)
    torch.testing.assert_close(scores[1], again[1], rtol=1e-5, atol=1e-7)


def test_layouts_follow_the_classifier():
    vit = CASES["vit"]
    trace = GenericAttention(vit.model()).trace(vit.inputs()[0], target=0)
    assert trace.layout.num_prefix_tokens == 1 and trace.layout.grid == (4, 4)
    assert trace.layout.query_rows.tolist() == [[0]] * 3

    deit = CASES["deit_distilled"]
    trace = GenericAttention(deit.model()).trace(deit.inputs()[0], target=0)
    assert trace.layout.num_prefix_tokens == 2 and trace.layout.query_rows.tolist() == [[0, 1]] * 3
    plain = CASES["deit"]
    trace = GenericAttention(plain.model()).trace(plain.inputs()[0], target=0)
    assert trace.layout.num_prefix_tokens == 2 and trace.layout.query_rows.tolist() == [[0]] * 3

    gpt = CASES["gpt2"]
    inputs, kwargs = gpt.inputs()
    trace = GenericAttention(gpt.model()).trace(inputs, target=0, forward_kwargs=kwargs)
    assert trace.layout.query_rows[:, 0].tolist() == [6, 4, 6]

    clip = CASES["clip_text"]
    ids, kwargs = clip.inputs()
    ids[:, 3] = 98  # the end-of-text token
    trace = GenericAttention(clip.model()).trace(ids, target=0, forward_kwargs=kwargs)
    assert trace.layout.query_rows[:, 0].tolist() == [3, 3, 3]


def test_gqa_heads_are_expanded():
    spec = CASES["llama_gqa"]
    model = spec.model()
    inputs, kwargs = spec.inputs()
    trace = RawAttentionProbe(model).trace(inputs, forward_kwargs=kwargs)
    assert trace.records[0].forward_value.shape[1] == 4  # four query heads over two key/value heads


class RawAttentionProbe(GenericAttention):
    """Keeps the raw per-head probabilities, to inspect shapes."""

    def capture_spec(self):
        from captum_transformers.capture.trace import CaptureSpec
        return CaptureSpec(forward_reduce=lambda probs: probs.clone())


def test_model_with_inline_attention_raises_capture_error():
    # The AttentionInterface kernel cannot see inline attention; the registry gives such models
    # the inline_attention adapter (tests/test_inline_attention_adapter.py), so ask for this one.
    transformers = pytest.importorskip("transformers")
    config = transformers.VisualBertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64, visual_embedding_dim=8, vocab_size=99)
    model = transformers.VisualBertModel(config).eval()
    with pytest.raises(CaptureError, match="computed no attention"):
        GenericAttention(model, adapter="huggingface").attribute(torch.randint(0, 99, (1, 5)), target=0)


@pytest.mark.parametrize("method", METHODS)
def test_non_square_images_with_interpolated_positions(method):
    model = CASES["vit"].model()
    x = torch.randn(2, 3, 32, 48)
    out = method(model).attribute(x, target=1, forward_kwargs={"interpolate_pos_encoding": True})
    assert out.shape == x.shape
    trace = GenericAttention(model).trace(x, target=1, forward_kwargs={"interpolate_pos_encoding": True})
    assert trace.layout.grid == (4, 6) and trace.layout.num_tokens == 25


@pytest.mark.parametrize("case", [n for n in CASE_NAMES if CASES[n].kind == "text" and n != "clip_text"])
@pytest.mark.parametrize("method", METHODS)
def test_padded_example_equals_the_unpadded_sequence(case, method):
    spec = CASES[case]
    model = spec.model()
    inputs, kwargs = spec.inputs()
    padded = method(model).attribute(inputs, target=1, forward_kwargs=kwargs, return_tokens=True)[1]
    alone = method(model).attribute(inputs[1:2, :5], target=1, return_tokens=True)[0]
    torch.testing.assert_close(padded[:5], alone, rtol=1e-4, atol=1e-6)
