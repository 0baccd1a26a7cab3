"""LayerAttnLRP / LayerConservativeLRP: the package's rules inside Captum's LLMGradientAttribution.

A float64 tiny Llama (eager attention, grouped-query attention: 4 query heads, 2 key/value
heads) built from a config, and a word-level tokenizer built here."""
import pytest
import torch
from captum.attr import LayerGradientXActivation, LLMGradientAttribution, TextTokenInput
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from captum_transformers.adapters.registry import get_adapter
from captum_transformers.model_state import patching
from captum_transformers.model_state.exclusive import exclusive
from captum_transformers.errors import InputError, StochasticForwardError
from captum_transformers.integrations.captum_llm_layers import (LayerAttnLRP, LayerConservativeLRP,
                                                           RuleLayerGradientXActivation)
from captum_transformers.methods.conservative_lrp import ConservativeLRP
from captum_transformers.methods.lrp import AttnLRP
from captum_transformers.propagation.rules.rule_set import RuleSet

WORDS = ["<unk>", "<s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "under", "tree"]
PROMPT, TARGET = "the cat sat", "on the mat"
TOL = 1e-10


@pytest.fixture(scope="module")
def tokenizer():
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    # A BOS in front of every encoded text, as Llama's tokenizer does.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")


def tiny_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager", **overrides)
    return LlamaForCausalLM(config).double().eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def last_logits(model):
    return lambda ids: model(ids).logits[:, -1]


def log_prob_rows(model, prompt_ids, target_ids, rules):
    """Row t: relevance (summed over hidden) of log p(target[t] | prompt, target[:t]) at the
    prompt's embeddings, one plain autograd pass per row under ``rules`` (None: plain gradient)."""
    embeddings = model.get_input_embeddings()
    rows = []
    for t in range(len(target_ids)):
        ids = torch.cat([prompt_ids, target_ids[:t]])[None]
        with exclusive(model), torch.enable_grad(), patching.parameters_require_grad(model):
            context = get_adapter(model).propagation(model, rules) if rules is not None else torch.enable_grad()
            with context:
                hidden = embeddings(ids).detach().requires_grad_()
                log_p = torch.log_softmax(model(inputs_embeds=hidden).logits[:, -1], -1)[0, target_ids[t]]
                (gradient,) = torch.autograd.grad(log_p, hidden)
        rows.append((hidden * gradient).sum(-1)[0, :len(prompt_ids)].detach())
    return torch.stack(rows)


def test_llm_gradient_attribution_gives_attnlrp_of_the_log_probability(model, tokenizer):
    result = LLMGradientAttribution(LayerAttnLRP(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer),
                                                                              target=TARGET)
    prompt_ids = tokenizer.encode(PROMPT, return_tensors="pt")[0]
    target_ids = torch.tensor(tokenizer.encode(TARGET, add_special_tokens=False))
    expected = log_prob_rows(model, prompt_ids, target_ids, RuleSet.ATTN_LRP)
    assert result.input_tokens == ["<s>", "the", "cat", "sat"] and result.output_tokens == ["on", "the", "mat"]
    assert result.token_attr.shape == (3, 4) and result.token_attr.dtype == torch.float64
    assert (result.token_attr - expected).abs().max() < TOL
    assert (result.seq_attr - expected.sum(0)).abs().max() < TOL
    # The rules act: plain Gradient x Input of the same log-probabilities differs.
    plain = log_prob_rows(model, prompt_ids, target_ids, None)
    assert (result.token_attr - plain).abs().max() > 1e-6


def test_skipped_bos_drops_its_column(model, tokenizer):
    full = LLMGradientAttribution(LayerAttnLRP(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer),
                                                                            target=TARGET)
    skipped = LLMGradientAttribution(LayerAttnLRP(model), tokenizer).attribute(
        TextTokenInput(PROMPT, tokenizer, skip_tokens=["<s>"]), target=TARGET)
    assert skipped.input_tokens == ["the", "cat", "sat"]
    assert (skipped.token_attr - full.token_attr[:, 1:]).abs().max() < TOL


def test_logit_forward_equals_attnlrp_token_relevance(model):
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 8, 9, 10, 11]])
    method = LayerAttnLRP(model)
    method.forward_func = last_logits(model)
    for token in (6, 3):
        layer = method.attribute(ids, target=token)
        assert layer.shape == (2, 5, 16)
        expected = AttnLRP(model).attribute(ids, target=token, return_tokens=True)
        assert (layer.sum(-1) - expected).abs().max() < TOL


class Float64RMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm without its float32 round trip: HF's norm computes in float32 even in a float64
    model, so the forward differs from the linear map the AH+LN rules differentiate by ~1e-9."""

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def explained_logits(model, store):
    def forward(ids):
        logits = model(ids).logits[:, -1]
        store.append(logits.detach())
        return logits
    return forward


def test_conservative_ah_ln_conserves_the_logit_of_a_bias_free_llama(model):
    exact = tiny_llama()
    for module in exact.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = Float64RMSNorm
    assert not any("bias" in name for name, _ in exact.named_parameters())
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 7, 8, 9, 2]])
    token = 6
    per_token, logits = {}, {}
    for variant in ("AH+LN", "GI"):
        method = LayerConservativeLRP(exact, variant)
        method.forward_func = explained_logits(exact, logits.setdefault(variant, []))
        per_token[variant] = method.attribute(ids, target=token).sum(-1)
    explained = logits["AH+LN"][0][:, token]  # the logit of the forward the relevance explains
    assert (per_token["AH+LN"].sum(-1) - explained).abs().max() < TOL
    assert (per_token["GI"].sum(-1) - explained).abs().max() > 1e-6  # plain gradient x input does not conserve
    # The stock model (float32 norms): the package's ConservativeLRP gives the same token relevance.
    method = LayerConservativeLRP(model)
    method.forward_func = last_logits(model)
    expected = ConservativeLRP(model).attribute(ids, target=token, return_tokens=True)
    assert (method.attribute(ids, target=token).sum(-1) - expected).abs().max() < TOL


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {name: p.requires_grad for name, p in model.named_parameters()},
            model.config._attn_implementation)


def _assert_restored(model, before, ids, logits_before):
    state, flags, implementation = before
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert model.config._attn_implementation == implementation
    assert all(not m._forward_hooks and not m._forward_pre_hooks and "forward" not in vars(m)
               for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits_before)


def test_model_restored_after_a_call_and_after_an_exception(tokenizer):
    model = tiny_llama(seed=1)
    model.requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)  # a partly frozen model keeps each flag
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits_before = model(ids).logits.clone()
    before = _snapshot(model)
    LLMGradientAttribution(LayerAttnLRP(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer), target="on")
    _assert_restored(model, before, ids, logits_before)

    def failing(ids):
        model(ids)
        raise RuntimeError("failure inside the forward")

    method = LayerConservativeLRP(model)
    method.forward_func = failing
    with pytest.raises(RuntimeError, match="failure inside the forward"):
        method.attribute(ids, target=0)
    _assert_restored(model, before, ids, logits_before)


def test_train_mode_is_refused_unless_allowed():
    model = tiny_llama(attention_dropout=0.2).train()
    ids = torch.tensor([[1, 2, 3, 4]])
    refused = LayerAttnLRP(model)
    refused.forward_func = last_logits(model)
    with pytest.raises(StochasticForwardError, match="dropout"):
        refused.attribute(ids, target=5)
    allowed = LayerAttnLRP(model, allow_stochastic=True)
    allowed.forward_func = last_logits(model)
    assert torch.isfinite(allowed.attribute(ids, target=5)).all()
    assert model.training


def test_refusals(model):
    with pytest.raises(InputError, match="seed"):
        RuleLayerGradientXActivation(model, RuleSet.LRP)
    with pytest.raises(InputError, match="variant"):
        LayerConservativeLRP(model, "LN")
    with pytest.raises(InputError, match="layer="):
        LayerAttnLRP(torch.nn.Linear(2, 2), adapter="huggingface")


def test_defaults_and_captum_own_refusal_of_the_package_method(model, tokenizer):
    method = LayerAttnLRP(model)
    assert isinstance(method, LayerGradientXActivation)
    assert method.layer is model.get_input_embeddings() and method.forward_func is model
    custom = LayerConservativeLRP(model, "AH", layer=model.model.layers[1])
    assert custom.layer is model.model.layers[1] and custom.rules is RuleSet.AH
    # Captum's wrapper accepts only its own layer methods: the package's AttnLRP is refused there,
    # which is why the layer classes exist (Captum's behaviour, pinned so the docs stay right).
    with pytest.raises(AssertionError):
        LLMGradientAttribution(AttnLRP(model), tokenizer)
