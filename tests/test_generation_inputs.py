"""GenerationAttribution's inputs and outputs: Captum's text inputs, skipped tokens, templates,
Captum's own LLM wrapper as a cross-check, the result type, and the refusals.

A float64 tiny Llama (eager, grouped-query attention) and a word-level tokenizer built here."""
import matplotlib
import pytest
import torch
from captum.attr import LLMAttributionResult, LLMGradientAttribution, TextTemplateInput, TextTokenInput
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from captum_transformers import (AttentionGradCAM, AttnLRP, GenerationAttribution, GenerationResult, GenericAttention,
                                 LayerAttnLRP)
from captum_transformers.errors import InputError
from captum_transformers.methods.captum_baselines import CaptumSaliency

matplotlib.use("Agg")

WORDS = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "under", "tree", "big"]
PROMPT, TARGET = "the big cat sat", "on the mat"
TOL = 1e-10


@pytest.fixture(scope="module")
def tokenizer():
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager", eos_token_id=2, bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).double().eval()


def test_result_is_captums_type_with_the_generation_parts(model, tokenizer):
    result = GenerationAttribution(AttnLRP(model), tokenizer).attribute(PROMPT, target=TARGET)
    assert isinstance(result, LLMAttributionResult) and isinstance(result, GenerationResult)
    assert result.input_tokens == ["<s>", "the", "big", "cat", "sat"]
    assert result.output_tokens == ["on", "the", "mat"]
    assert result.token_attr.shape == (3, 5) and result.target_attr.shape == (3, 3)
    assert torch.equal(result.seq_attr, result.token_attr.sum(0))
    assert bool((result.target_attr.triu() == 0).all())  # each token sees only the tokens before it
    assert result.output_probs.shape == (3,) and bool(((result.output_probs > 0) & (result.output_probs < 1)).all())
    assert result.first_token_share.shape == (3,)
    row = torch.cat([result.token_attr[1], result.target_attr[1, :1]]).abs()
    assert abs(float(result.first_token_share[1]) - float(row[0] / row.sum())) < TOL
    figure, _ = result.plot_token_attr()
    assert figure is not None
    assert result.signed and not GenerationAttribution(GenericAttention(model), tokenizer).attribute(
        PROMPT, target=TARGET).signed


def test_token_ids_text_token_input_and_skipped_tokens(model, tokenizer):
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    from_text = explainer.attribute(PROMPT, target=TARGET)
    ids = tokenizer(PROMPT)["input_ids"]
    from_ids = explainer.attribute(torch.tensor(ids), target=tokenizer(TARGET, add_special_tokens=False)["input_ids"])
    assert torch.allclose(from_text.token_attr, from_ids.token_attr, atol=TOL, rtol=0)
    skipped = explainer.attribute(TextTokenInput(PROMPT, tokenizer, skip_tokens=["<s>"]), target=TARGET)
    assert skipped.input_tokens == ["the", "big", "cat", "sat"]
    assert torch.allclose(skipped.token_attr, from_text.token_attr[:, 1:], atol=TOL, rtol=0)
    by_argument = explainer.attribute(PROMPT, target=TARGET, skip_tokens=["<s>"])
    assert torch.allclose(by_argument.token_attr, skipped.token_attr, atol=TOL, rtol=0)


def test_template_segment_is_the_sum_of_its_tokens(model, tokenizer):
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    tokens = explainer.attribute(PROMPT, target=TARGET)
    template = explainer.attribute(TextTemplateInput("the {} sat", values=["big cat"]), target=TARGET)
    assert template.input_tokens == ["big cat"]
    assert torch.allclose(template.token_attr[:, 0], tokens.token_attr[:, 2:4].sum(1), atol=TOL, rtol=0)


def test_equals_captums_wrapper_with_the_package_rules_on_the_log_probability(model, tokenizer):
    captum = LLMGradientAttribution(LayerAttnLRP(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer),
                                                                             target=TARGET)
    ours = GenerationAttribution(AttnLRP(model), tokenizer, score="log_prob").attribute(PROMPT, target=TARGET)
    assert captum.token_attr.shape == ours.token_attr.shape
    assert float((captum.token_attr.double() - ours.token_attr).abs().max()) < TOL
    logits = GenerationAttribution(AttnLRP(model), tokenizer).attribute(PROMPT, target=TARGET)
    assert float((logits.token_attr - ours.token_attr).abs().max()) > 1e-4  # the score kind matters


def test_generated_target_is_the_greedy_answer(model, tokenizer):
    result = GenerationAttribution(GenericAttention(model), tokenizer).attribute(PROMPT,
                                                                                gen_args={"max_new_tokens": 4})
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    if 2 in greedy:
        greedy = greedy[:greedy.index(2) + 1]
    assert result.output_ids == greedy and result.token_attr.shape[0] == len(greedy)


def test_captum_rows_run_one_call_per_prefix(model, tokenizer):
    result = GenerationAttribution(CaptumSaliency(model), tokenizer).attribute(PROMPT, target=TARGET)
    ids = tokenizer(PROMPT)["input_ids"] + tokenizer(TARGET, add_special_tokens=False)["input_ids"]
    for t, token in enumerate(ids[5:]):
        single = CaptumSaliency(model).attribute(torch.tensor([ids[:5 + t]]), target=[(4 + t, token)],
                                                 return_tokens=True)[0]
        assert torch.allclose(torch.cat([result.token_attr[t], result.target_attr[t, :t]]), single, atol=TOL, rtol=0)
    with pytest.raises(InputError, match="score='log_prob'"):
        GenerationAttribution(CaptumSaliency(model), tokenizer, score="log_prob").attribute(PROMPT, target=TARGET)


@pytest.mark.parametrize("call, message", [
    (lambda e: e.attribute(PROMPT, target=""), "no tokens"),
    (lambda e: e.attribute([PROMPT, PROMPT], target=TARGET), "one per prompt"),
    (lambda e: e.attribute(PROMPT, target=TARGET, contrast="the mat"), "contrast has 2 tokens"),
    (lambda e: e.attribute(PROMPT, target=TARGET, span=[5]), "span must select"),
    (lambda e: e.attribute(PROMPT, target=TARGET, gen_args={"max_new_tokens": 2}), "gen_args"),
    (lambda e: e.attribute(PROMPT, target=TARGET, score="probability"), "score must be one of"),
    (lambda e: e.attribute(torch.zeros(1, 2, 3, dtype=torch.long), target=TARGET), "one sequence"),
    (lambda e: e.attribute(PROMPT, target=TARGET, skip_tokens=["zebra"]), "not a token"),
])
def test_bad_input_is_refused_with_the_fix(model, tokenizer, call, message):
    with pytest.raises(InputError, match=message):
        call(GenerationAttribution(AttnLRP(model), tokenizer))


def test_refusals_of_the_wrapper(model, tokenizer):
    with pytest.raises(InputError, match="has no .model"):
        GenerationAttribution(object(), tokenizer)
    with pytest.raises(InputError, match="head_weights='row'"):
        GenerationAttribution(AttentionGradCAM(model, head_weights="all"), tokenizer).attribute(PROMPT, target=TARGET)


def test_a_generation_with_non_finite_scores_is_refused(model, tokenizer):
    # A float64 eager Llama computes its softmax in float32: a left-padded row's -inf mask becomes NaN.
    with pytest.raises(InputError, match="non-finite next-token scores"):
        GenerationAttribution(AttnLRP(model), tokenizer).attribute([PROMPT, "the cat"], gen_args={"max_new_tokens": 2})


def test_a_tokenizers_padded_batch_is_a_list_of_prompts(model, tokenizer):
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    prompts, targets = [PROMPT, "the dog ran"], [TARGET, "under a tree"]
    tokenizer.padding_side = "right"  # padding on either side is read from the mask
    encoded = tokenizer(prompts, padding=True, return_tensors="pt")
    from_batch = explainer.attribute(encoded, target=targets)
    from_list = explainer.attribute(prompts, target=targets)
    for ours, expected in zip(from_batch, from_list):
        assert ours.input_tokens == expected.input_tokens
        assert torch.allclose(ours.token_attr, expected.token_attr, atol=TOL, rtol=0)


def test_a_span_is_read_at_its_latest_step_whatever_its_order(model, tokenizer):
    explainer = GenerationAttribution(GenericAttention(model), tokenizer)
    forward = explainer.attribute(PROMPT, target=TARGET, span=[0, 2])
    backward = explainer.attribute(PROMPT, target=TARGET, span=[2, 0])
    assert torch.equal(forward.token_attr, backward.token_attr) and torch.equal(forward.target_attr, backward.target_attr)
    with pytest.raises(InputError, match="twice"):
        explainer.attribute(PROMPT, target=TARGET, span=[0, 0])


def test_a_foil_equal_to_the_target_is_refused(model, tokenizer):
    with pytest.raises(InputError, match="foil equals the explained token"):
        GenerationAttribution(AttnLRP(model), tokenizer).attribute(PROMPT, target=TARGET, contrast="on dog mat")


def test_a_one_row_padded_batch_drops_its_padding(model, tokenizer):
    tokenizer.padding_side = "left"
    encoded = tokenizer([PROMPT], padding="max_length", max_length=8, return_tensors="pt")
    result = GenerationAttribution(AttnLRP(model), tokenizer).attribute(encoded, target=TARGET)
    assert result.input_tokens == ["<s>", "the", "big", "cat", "sat"]


def test_template_with_named_values(model, tokenizer):
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    named = explainer.attribute(TextTemplateInput("the {size} sat", values={"size": "big cat"}), target=TARGET)
    listed = explainer.attribute(TextTemplateInput("the {} sat", values=["big cat"]), target=TARGET)
    assert named.input_tokens == ["big cat"] and torch.allclose(named.token_attr, listed.token_attr, atol=TOL, rtol=0)


def test_generation_arguments_the_cut_cannot_follow_are_refused(model, tokenizer):
    explainer = GenerationAttribution(AttnLRP(model), tokenizer)
    with pytest.raises(InputError, match="num_return_sequences"):
        explainer.attribute(PROMPT, gen_args={"max_new_tokens": 2, "num_return_sequences": 2, "do_sample": True})
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        first = int(model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
    result = explainer.attribute(PROMPT, gen_args={"max_new_tokens": 3, "eos_token_id": first})
    assert result.output_ids == [first]  # cut at the end token gen_args gave


def test_chat_template_ids_are_a_prompt():
    from captum_transformers.tasks.recall.model import load_recall_model

    recall, recall_tokenizer = load_recall_model()
    prompt = "c red fox ; q blue owl ; h green cat ; m pink bee ? h"
    ids = recall_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    explainer = GenerationAttribution(AttnLRP(recall), recall_tokenizer)
    from_template, from_text = explainer.attribute(ids), explainer.attribute(prompt)
    assert from_template.input_ids == from_text.input_ids and from_template.output_tokens == ["green", "cat", "<eos>"]
    assert torch.allclose(from_template.token_attr, from_text.token_attr, atol=1e-6, rtol=0)
