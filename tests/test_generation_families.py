"""GenerationAttribution over the model families: every row equals a call on the prefix.

Float64 tiny models (tests/generation_models.py): Llama (GQA, RoPE), GPT-2, Qwen2 with a
sliding window shorter than the sequence, Gemma 3 mixing sliding and full layers, BART, T5.
Row ``t`` of a generation explanation must equal ``Method(model).attribute(prefix, target=y_t)``
to 1e-10, for every method of the package, alone and in a batch of unequal prompts and
answers; plus conservation, contrast, score kinds, pass counts, spans, generated targets and
the model's restore.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from captum.attr import LLMGradientAttribution, TextTokenInput
from generation_models import ENCODER_DECODERS, EOS, IdTokenizer, build
from restore import assert_same, raising_after, snapshot

from captum_transformers import (AttentionFlow, AttentionGradCAM, AttentionRollout, AttnLRP, ConservativeLRP,
                                 GenericAttention, InputError, LayerAttnLRP, PartialLRP, RawAttention, TransformerLRP,
                                 TransformerRelevance)
from captum_transformers.generation import GenerationAttribution

transformers = pytest.importorskip("transformers")

TOL = 1e-10
PROMPT, TARGET = [1, 5, 7, 9, 11, 13], [20, 21, 22]
FAMILIES = ["llama", "gpt2", "qwen2_sliding", "gemma3_mixed", "bart", "t5"]
METHODS = {
    "AttnLRP": AttnLRP,
    "ConservativeLRP-AH+LN": lambda m: ConservativeLRP(m, "AH+LN"),
    "ConservativeLRP-AH": lambda m: ConservativeLRP(m, "AH"),
    "ConservativeLRP-GI": lambda m: ConservativeLRP(m, "GI"),
    "TransformerLRP": TransformerLRP,
    "GenericAttention": GenericAttention,
    "TransformerRelevance": TransformerRelevance,
    "AttentionGradCAM": AttentionGradCAM,
    "PartialLRP": PartialLRP,
    "RawAttention": RawAttention,
    "AttentionRollout": AttentionRollout,
    # discard_ratio ranks a step's (query, key) pairs: tokens after the step must not compete
    "AttentionRollout-discard": lambda m: AttentionRollout(m, head_fusion="max", discard_ratio=0.5),
    "AttentionFlow": AttentionFlow,
}
TOKENIZER = IdTokenizer()
_MODELS: dict = {}


def model_of(family: str, impl: str = "eager") -> torch.nn.Module:
    """Built once per session (the methods leave the model as they found it: test_restored)."""
    if (family, impl) not in _MODELS:
        _MODELS[family, impl] = build(family, impl)
    return _MODELS[family, impl]


def prefix_rows(method, model, prompt, target):
    """Per step t, (prompt scores, output scores) of a single call on the prefix:
    decoder-only: ``prompt + y_<t`` split after the prompt; encoder-decoders: (source scores,
    scores of the decoder input ``start, y_<t``)."""
    rows = []
    for t, token in enumerate(target):
        if getattr(model.config, "is_encoder_decoder", False):
            decoder = torch.tensor([[model.config.decoder_start_token_id] + target[:t]])
            source, read = method.attribute((torch.tensor([prompt]), decoder), target=token, return_tokens=True)
            rows.append((source[0], read[0]))
        else:
            scores = method.attribute(torch.tensor([prompt + target[:t]]), target=token, return_tokens=True)[0]
            rows.append((scores[:len(prompt)], scores[len(prompt):]))
    return rows


def worst_difference(result, rows) -> float:
    """Largest |difference| between the result's rows and the prefix calls' rows; the columns a
    step never read must be exactly zero."""
    worst = 0.0
    for t, (prompt_scores, read_scores) in enumerate(rows):
        n = read_scores.shape[0]
        worst = max(worst, (result.token_attr[t] - prompt_scores).abs().max().item(),
                    (result.target_attr[t, :n] - read_scores).abs().max().item() if n else 0.0)
        assert not result.target_attr[t, n:].any(), f"step {t} credits output tokens it never read"
    return worst


def step_logits(model, prompt, target):
    """(T, V) next-token logits of each step, from a plain forward."""
    with torch.no_grad():
        if getattr(model.config, "is_encoder_decoder", False):
            decoder = torch.tensor([[model.config.decoder_start_token_id] + target[:-1]])
            return model(torch.tensor([prompt]), decoder_input_ids=decoder).logits[0]
        return model(torch.tensor([prompt + target[:-1]])).logits[0, len(prompt) - 1:]


def _cases():
    for family in FAMILIES:
        for name in METHODS:
            yield pytest.param(family, name, id=f"{family}-{name}")


@pytest.mark.parametrize("family,name", list(_cases()))
def test_rows_equal_prefix_calls(family, name):
    model = model_of(family)
    method = METHODS[name](model)
    explainer = GenerationAttribution(method, TOKENIZER)
    if name == "AttentionFlow" and family in ENCODER_DECODERS:  # its single calls refuse two streams too
        with pytest.raises(InputError, match="one token sequence"):
            explainer.attribute(PROMPT, target=TARGET)
        return
    result = explainer.attribute(PROMPT, target=TARGET)
    assert result.token_attr.shape == (len(TARGET), len(PROMPT))
    assert result.target_attr.shape == (len(TARGET), len(TARGET))
    assert result.token_attr.dtype == torch.float64 and result.token_attr.abs().sum() > 0
    assert worst_difference(result, prefix_rows(method, model, PROMPT, TARGET)) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_rows_equal_prefix_calls(family):
    model = model_of(family, "sdpa")
    method = AttnLRP(model)
    result = GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET)
    assert worst_difference(result, prefix_rows(method, model, PROMPT, TARGET)) < TOL


BATCH_PROMPTS = [[1, 5, 7, 9, 11, 13], [1, 6, 8], [1, 4, 10, 12, 3]]
BATCH_TARGETS = [[20, 21, 22], [23], [24, 25]]


@pytest.mark.parametrize("name", ["AttnLRP", "ConservativeLRP-AH+LN", "GenericAttention", "TransformerRelevance",
                                  "AttentionRollout-discard"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_of_unequal_prompts_equals_single_calls(family, name):
    """Left padding and position ids (decoder-only; GPT-2's learned positions included), right-padded
    sources (encoder-decoders), answers of different lengths: each example equals its own calls."""
    model = model_of(family)
    method = METHODS[name](model)
    results = GenerationAttribution(method, TOKENIZER).attribute(BATCH_PROMPTS, target=BATCH_TARGETS)
    assert len(results) == 3
    for result, prompt, target in zip(results, BATCH_PROMPTS, BATCH_TARGETS):
        assert result.token_attr.shape == (len(target), len(prompt)) and result.output_ids == target
        assert worst_difference(result, prefix_rows(method, model, prompt, target)) < TOL


class Float64RMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
    """LlamaRMSNorm without its float32 round trip, so the forward is the map AH+LN differentiates."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_conservative_ah_ln_rows_sum_to_the_logit():
    model = build("llama", seed=3)
    for module in model.modules():
        if type(module) is transformers.models.llama.modeling_llama.LlamaRMSNorm:
            module.__class__ = Float64RMSNorm
    assert not any("bias" in name for name, _ in model.named_parameters())
    result = GenerationAttribution(ConservativeLRP(model, "AH+LN"), TOKENIZER).attribute(PROMPT, target=TARGET)
    expected = step_logits(model, PROMPT, TARGET)[range(len(TARGET)), TARGET]
    # HF's eager attention rounds its softmax through float32; the package's kernel does not.
    assert (result.scores - expected).abs().max() < 1e-7
    totals = result.token_attr.sum(1) + result.target_attr.sum(1)
    assert (totals - result.scores).abs().max() < TOL
    # Plain gradient x input of the same model does not conserve: the check can fail.
    plain = GenerationAttribution(ConservativeLRP(model, "GI"), TOKENIZER).attribute(PROMPT, target=TARGET)
    assert (plain.token_attr.sum(1) + plain.target_attr.sum(1) - expected).abs().max() > 1e-6


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_contrast_is_the_difference_of_two_explanations(family):
    model = model_of(family)
    explainer = GenerationAttribution(AttnLRP(model), TOKENIZER)
    foil = [30, 31, 32]
    contrast = explainer.attribute(PROMPT, target=TARGET, contrast=foil)
    wanted = explainer.attribute(PROMPT, target=TARGET)
    # The foil explained at each step after the same prefix: one prefix call per step.
    foil_rows = []
    method = AttnLRP(model)
    for t in range(len(TARGET)):
        foil_rows.append(prefix_rows(method, model, PROMPT, TARGET[:t] + [foil[t]])[t])
    for t, (prompt_scores, read_scores) in enumerate(foil_rows):
        n = read_scores.shape[0]
        assert (contrast.token_attr[t] - (wanted.token_attr[t] - prompt_scores)).abs().max() < TOL
        assert torch.allclose(contrast.target_attr[t, :n], wanted.target_attr[t, :n] - read_scores, rtol=0, atol=TOL)
    assert contrast.contrast_tokens == ["t30", "t31", "t32"]
    logits = step_logits(model, PROMPT, TARGET)
    expected = logits[range(3), TARGET] - logits[range(3), foil]
    # HF's eager attention rounds its softmax through float32; the package's kernel does not.
    assert (contrast.scores - expected).abs().max() < 1e-7
    assert (contrast.token_attr - wanted.token_attr).abs().max() > 1e-6


WORDS = ["<unk>", "<s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "under", "tree"]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                pad_token="<unk>")


def test_log_prob_rows_equal_captum_llm_gradient_attribution():
    """Captum's wrapper explains log p(y_t) with LayerAttnLRP at the embeddings, one forward per
    step; its token_attr covers the prompt (BOS included) and drops earlier output tokens."""
    model, tokenizer = model_of("llama"), word_tokenizer()
    prompt, target = "the cat sat", "on the mat"
    expected = LLMGradientAttribution(LayerAttnLRP(model), tokenizer).attribute(
        TextTokenInput(prompt, tokenizer), target=target)
    result = GenerationAttribution(AttnLRP(model), tokenizer, score="log_prob").attribute(prompt, target=target)
    assert result.input_tokens == expected.input_tokens == ["<s>", "the", "cat", "sat"]
    assert result.output_tokens == expected.output_tokens
    assert (result.token_attr - expected.token_attr).abs().max() < TOL
    target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    probs = step_logits(model, tokenizer(prompt)["input_ids"], target_ids).softmax(-1)[range(3), target_ids]
    assert (result.output_probs - probs).abs().max() < 1e-7  # HF's eager softmax is float32
    assert (result.scores - result.output_probs.log()).abs().max() < TOL
    logit = GenerationAttribution(AttnLRP(model), tokenizer).attribute(prompt, target=target)
    assert (logit.token_attr - expected.token_attr).abs().max() > 1e-6  # the score kind matters


@contextlib.contextmanager
def counted_passes(model):
    """Counts of the model's forward calls and of top-level backward passes (autograd.grad,
    autograd.backward, Tensor.backward; a call made inside another is not counted)."""
    counts = {"forward": 0, "backward": 0}
    depth = [0]

    def counting(function):
        def wrapper(*args, **kwargs):
            counts["backward"] += depth[0] == 0
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    def forward(*_):
        counts["forward"] += 1

    patches = [(torch.autograd, "grad"), (torch.autograd, "backward"), (torch.Tensor, "backward")]
    originals = [getattr(owner, name) for owner, name in patches]
    handle = model.register_forward_pre_hook(forward)
    try:
        for (owner, name), original in zip(patches, originals):
            setattr(owner, name, counting(original))
        yield counts
    finally:
        for (owner, name), original in zip(patches, originals):
            setattr(owner, name, original)
        handle.remove()


@pytest.mark.parametrize("name,backwards_per_step", [
    ("AttnLRP", 1), ("ConservativeLRP-AH+LN", 1), ("GenericAttention", 1), ("AttentionGradCAM", 1),
    ("TransformerRelevance", 2), ("RawAttention", 0), ("AttentionRollout", 0)])
@pytest.mark.parametrize("family", ["llama", "bart"])
def test_one_forward_and_one_backward_per_step(family, name, backwards_per_step):
    model = model_of(family)
    explainer = GenerationAttribution(METHODS[name](model), TOKENIZER)
    with counted_passes(model) as counts:
        explainer.attribute(PROMPT, target=TARGET)
    assert counts == {"forward": 1, "backward": backwards_per_step * len(TARGET)}


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_span_is_the_sum_of_its_steps(family):
    model = model_of(family)
    explainer = GenerationAttribution(AttnLRP(model), TOKENIZER)
    rows = explainer.attribute(PROMPT, target=TARGET)
    span = explainer.attribute(PROMPT, target=TARGET, span=[0, 2])
    assert span.token_attr.shape == (1, len(PROMPT)) and span.output_tokens == ["t20+t22"]
    assert (span.token_attr[0] - rows.token_attr[[0, 2]].sum(0)).abs().max() < TOL
    assert (span.target_attr[0] - rows.target_attr[[0, 2]].sum(0)).abs().max() < TOL
    assert (span.scores[0] - rows.scores[[0, 2]].sum()).abs().max() < TOL
    assert (span.output_probs - rows.output_probs[[0, 2]].prod()).abs().max() < TOL  # p(t20) p(t22 | ...)


def greedy(model, prompt, args):
    """``model.generate``'s greedy answer to one unpadded prompt, cut after its first EOS."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, **args)
    answer = (out[0, 1:] if model.config.is_encoder_decoder else out[0, len(prompt):]).tolist()
    return answer[:answer.index(EOS) + 1] if EOS in answer else answer


# HF's eager float64 Llama gives NaN logits for left-padded rows (its softmax runs in float32,
# where the float64 mask minimum is -inf, so padded queries give NaN that reaches real tokens
# through zero attention weights): the batch is generated by the sdpa Llama.
@pytest.mark.parametrize("family,impl", [("llama", "eager"), ("llama", "sdpa"), ("gpt2", "eager"),
                                         ("bart", "eager"), ("t5", "eager")])
def test_generated_target_is_greedy_generate(family, impl):
    model = model_of(family, impl)
    args = {"max_new_tokens": 4, "do_sample": False}
    explainer = GenerationAttribution(AttnLRP(model), TOKENIZER)
    result = explainer.attribute(PROMPT, gen_args=args)
    expected = greedy(model, PROMPT, args)
    assert result.output_ids == expected and result.token_attr.shape == (len(expected), len(PROMPT))
    explicit = explainer.attribute(PROMPT, target=expected)
    assert torch.equal(result.token_attr, explicit.token_attr)
    if (family, impl) != ("llama", "eager"):
        results = explainer.attribute(BATCH_PROMPTS, gen_args=args)
        assert [r.output_ids for r in results] == [greedy(model, p, args) for p in BATCH_PROMPTS]


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_model_restored_after_a_call_and_after_an_exception(family):
    model = build(family, seed=4)
    ids = torch.tensor([PROMPT])
    decoder = {"decoder_input_ids": torch.tensor([[2, 20]])} if family in ENCODER_DECODERS else {}
    with torch.no_grad():
        logits = model(ids, **decoder).logits.clone()
    before = snapshot(model)
    GenerationAttribution(AttnLRP(model), TOKENIZER).attribute(PROMPT, target=TARGET)
    assert_same(before, snapshot(model))
    layer = model.model.layers[0] if family == "llama" else model.model.decoder.layers[0]
    for method in (AttnLRP(model), GenericAttention(model)):
        with raising_after(layer, RuntimeError("failure inside the forward")), \
                pytest.raises(RuntimeError, match="failure inside the forward"):
            GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET)
        assert_same(before, snapshot(model))
    # A failure after the forward pass, between two explained steps (the graph still held).
    method = GenericAttention(model)
    reduce, calls = method.reduce, []

    def failing_reduce(trace):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("failure between steps")
        return reduce(trace)

    method.reduce = failing_reduce
    with pytest.raises(RuntimeError, match="failure between steps"):
        GenerationAttribution(method, TOKENIZER).attribute(PROMPT, target=TARGET)
    assert_same(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(ids, **decoder).logits, logits)


def test_a_wrapped_model_taking_kwargs_gets_the_position_ids_of_its_left_padding():
    """A forward(input_ids, attention_mask, **kwargs) (a wrapper, a PEFT model) still receives the
    position ids, so a left-padded batch on learned absolute positions equals the single calls."""
    from captum_transformers import AttnLRP, GenerationAttribution
    from generation_models import IdTokenizer, build

    base = build("gpt2")

    class Wrapped(type(base)):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    model = Wrapped(base.config).double().eval()
    model.load_state_dict(base.state_dict())
    explainer = GenerationAttribution(AttnLRP(model), IdTokenizer())
    prompts, targets = [[1, 5, 7, 9, 11], [1, 6]], [[12, 13], [14, 15]]
    batch = explainer.attribute(prompts, target=targets)
    for result, prompt, target in zip(batch, prompts, targets):
        single = explainer.attribute(prompt, target=target)
        assert torch.allclose(result.token_attr, single.token_attr, atol=1e-10, rtol=0)
