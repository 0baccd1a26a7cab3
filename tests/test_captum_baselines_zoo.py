"""Captum's Integrated Gradients and Saliency across the HuggingFace zoo: the package's target
convention for per-position scores (a causal LM's, a seq2seq LM's decoder), both id tensors of a
seq2seq model, encoder-decoder heads that embed their input twice (encoder, shifted decoder),
and the families whose embeddings are unusual (I-BERT's tuple, XLNet's sequence-first, CTRL's
in-place scaling) or whose backward pass is not the model's (Reformer, refused)."""
import pytest
import torch

from captum_transformers.errors import CaptureError, InputError, UnsupportedModelError
from captum_transformers.methods.captum_baselines import CaptumIntegratedGradients, CaptumSaliency

transformers = pytest.importorskip("transformers")

METHODS = [CaptumIntegratedGradients, CaptumSaliency]
TOKEN = 7
TOL = dict(rtol=1e-7, atol=1e-10)


def _built(model_class, config):
    torch.manual_seed(0)
    return model_class(config).to(torch.float64).eval()


def _llama():
    return _built(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def _bart(model_class, **extra):
    return _built(model_class, transformers.BartConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=16,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **extra))


def _t5():
    return _built(transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def _ids(batch, length, real, pad, seed=1):
    """(batch, length) ids in [3, 40), row 1 right-padded after ``real`` tokens, and its mask."""
    ids = torch.randint(3, 40, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, real:] = 0
    ids[mask == 0] = pad
    return ids, mask


def _made(method, model):
    return method(model, n_steps=8) if method is CaptumIntegratedGradients else method(model)


def _gradient(score, leaves):
    return torch.autograd.grad(score.sum(), leaves)


# -- causal LMs: target=token explains the logit at the last real position ---------------------
@pytest.mark.parametrize("method", METHODS)
def test_causal_lm_token_target_is_the_last_real_position(method):
    model = _llama()
    ids, mask = _ids(3, 6, 4, pad=0)
    kwargs = {"attention_mask": mask}
    by_token = _made(method, model).attribute(ids, target=TOKEN, forward_kwargs=kwargs)
    last = (mask.sum(1) - 1).tolist()
    explicit = _made(method, model).attribute(ids, target=[(p, TOKEN) for p in last], forward_kwargs=kwargs)
    torch.testing.assert_close(by_token, explicit, rtol=0, atol=0)
    assert bool((by_token[1, 4:] == 0).all()) and bool((by_token[:, :4] != 0).all())
    alone = _made(method, model).attribute(ids[1:2, :4], target=TOKEN, forward_kwargs={"attention_mask": mask[1:2, :4]})
    torch.testing.assert_close(by_token[1:2, :4], alone, rtol=1e-6, atol=1e-10)
    per_row = _made(method, model).attribute(ids, target=torch.tensor([TOKEN, 3, 9]), forward_kwargs=kwargs)
    rows = _made(method, model).attribute(ids, target=[(last[0], TOKEN), (last[1], 3), (last[2], 9)], forward_kwargs=kwargs)
    torch.testing.assert_close(per_row, rows, rtol=0, atol=0)


def test_causal_lm_left_padding_and_the_predicted_token():
    model = _llama()
    ids, _ = _ids(2, 6, 6, pad=0)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    kwargs = {"attention_mask": mask}
    saliency = CaptumSaliency(model)
    torch.testing.assert_close(saliency.attribute(ids, target=TOKEN, forward_kwargs=kwargs),
                               saliency.attribute(ids, target=(5, TOKEN), forward_kwargs=kwargs), rtol=0, atol=0)
    with torch.no_grad():
        predicted = model(ids, attention_mask=mask).logits[:, -1].argmax(-1).tolist()
    torch.testing.assert_close(saliency.attribute(ids, forward_kwargs=kwargs),
                               saliency.attribute(ids, target=[(5, t) for t in predicted], forward_kwargs=kwargs),
                               rtol=0, atol=0)


# -- seq2seq LMs: (input_ids, decoder_input_ids), one map each --------------------------------------
@pytest.mark.parametrize("build", [lambda: _bart(transformers.BartForConditionalGeneration), _t5],
                         ids=["bart", "t5"])
def test_seq2seq_saliency_is_the_gradient_at_both_embeddings(build):
    model = build()
    pad = model.config.pad_token_id
    ids, mask = _ids(2, 7, 5, pad)
    decoder_ids, decoder_mask = _ids(2, 4, 3, pad, seed=2)
    kwargs = {"attention_mask": mask, "decoder_attention_mask": decoder_mask}
    source, prefix = CaptumSaliency(model).attribute((ids, decoder_ids), target=TOKEN, forward_kwargs=kwargs)
    embeddings = model.get_input_embeddings()
    leaves = [embeddings(ids).detach().requires_grad_(), embeddings(decoder_ids).detach().requires_grad_()]
    logits = model(inputs_embeds=leaves[0], decoder_inputs_embeds=leaves[1], **kwargs).logits
    grads = _gradient(logits[torch.arange(2), decoder_mask.sum(1) - 1, TOKEN], leaves)
    torch.testing.assert_close(source, grads[0].abs().sum(-1) * mask, **TOL)
    torch.testing.assert_close(prefix, grads[1].abs().sum(-1) * decoder_mask, **TOL)
    assert bool((prefix[1, 3:] == 0).all()) and bool((prefix[:, :3] != 0).all())


def test_seq2seq_integrated_gradients_is_complete_over_both_inputs():
    model = _bart(transformers.BartForConditionalGeneration)
    ids, mask = _ids(2, 7, 5, 1)
    decoder_ids, decoder_mask = _ids(2, 4, 3, 1, seed=2)
    kwargs = {"attention_mask": mask, "decoder_attention_mask": decoder_mask}
    source, prefix = CaptumIntegratedGradients(model, n_steps=200).attribute(
        (ids, decoder_ids), target=TOKEN, forward_kwargs=kwargs)
    last = decoder_mask.sum(1) - 1
    with torch.no_grad():
        def score(a, b):
            return model(a, decoder_input_ids=b, **kwargs).logits[torch.arange(2), last, TOKEN]
        expected = score(ids, decoder_ids) - score(torch.ones_like(ids), torch.ones_like(decoder_ids))
    torch.testing.assert_close(source.sum(1) + prefix.sum(1), expected, rtol=1e-4, atol=1e-7)


# -- encoder-decoder heads given input_ids only: the encoder and the shifted decoder both count ------
def test_encoder_decoder_head_attributes_both_uses_of_the_ids():
    model = _bart(transformers.BartForQuestionAnswering)
    ids, mask = _ids(2, 7, 5, 1)
    target = (0, 2)  # the start score of token 2
    saliency = CaptumSaliency(model).attribute(ids, target=target, forward_kwargs={"attention_mask": mask})
    embeddings = model.get_input_embeddings()
    leaf = embeddings(ids).detach().requires_grad_()
    start = embeddings(torch.full_like(ids[:, :1], model.config.decoder_start_token_id)).detach()
    decoder = torch.cat([start, leaf[:, :-1]], dim=1)  # the decoder input BART builds: input_ids shifted right
    output = model(inputs_embeds=leaf, decoder_inputs_embeds=decoder, attention_mask=mask)
    (grad,) = _gradient(output.start_logits[:, 2], [leaf])
    torch.testing.assert_close(saliency, grad.abs().sum(-1) * mask, **TOL)
    ig = CaptumIntegratedGradients(model, n_steps=200).attribute(ids, target=target,
                                                                 forward_kwargs={"attention_mask": mask})
    with torch.no_grad():
        expected = (model(ids, attention_mask=mask).start_logits[:, 2]
                    - model(torch.ones_like(ids), attention_mask=mask).start_logits[:, 2])
    torch.testing.assert_close(ig.sum(1), expected, rtol=1e-4, atol=1e-7)


# -- unusual embeddings ----------------------------------------------------------------------------
def _ibert():
    return _built(transformers.IBertForSequenceClassification, transformers.IBertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        max_position_embeddings=20, pad_token_id=1, num_labels=3))


def _xlnet():  # token classification: its sequence classifier reads the last position, padding in row 1
    return _built(transformers.XLNetForTokenClassification, transformers.XLNetConfig(
        vocab_size=40, d_model=16, n_layer=1, n_head=2, d_inner=24, pad_token_id=5, num_labels=3))


def _ctrl():  # a causal LM: CTRL's classifier finds its last token from input_ids, absent from the reference
    return _built(transformers.CTRLLMHeadModel, transformers.CTRLConfig(
        vocab_size=40, n_embd=16, n_layer=1, n_head=2, dff=24, n_positions=16, pad_token_id=0))


def _class_one(logits, mask):
    return logits[:, 1]


def _token_two_class_one(logits, mask):
    return logits[:, 2, 1]


def _last_real_token(logits, mask):
    return logits[torch.arange(logits.shape[0]), mask.sum(1) - 1, TOKEN]


@pytest.mark.parametrize("build, target, score", [(_ibert, 1, _class_one), (_xlnet, (2, 1), _token_two_class_one),
                                                  (_ctrl, TOKEN, _last_real_token)], ids=["ibert", "xlnet", "ctrl"])
def test_saliency_is_the_embedding_gradient_for_unusual_embeddings(build, target, score):
    model = build()
    ids, mask = _ids(3, 6, 4, model.config.pad_token_id)
    kwargs = {"attention_mask": mask}
    saliency = CaptumSaliency(model).attribute(ids, target=target, forward_kwargs=kwargs)
    value = model.get_input_embeddings()(ids)
    value = value[0] if isinstance(value, tuple) else value  # I-BERT: (embedding, scaling factor None)
    leaf = value.detach().requires_grad_()
    (grad,) = _gradient(score(model(inputs_embeds=leaf.clone(), attention_mask=mask).logits, mask), [leaf])
    torch.testing.assert_close(saliency, grad.abs().sum(-1) * mask, **TOL)
    ig = CaptumIntegratedGradients(model, n_steps=8).attribute(ids, target=target, forward_kwargs=kwargs)
    alone = CaptumIntegratedGradients(model, n_steps=8).attribute(ids[1:2, :4], target=target,
                                                                  forward_kwargs={"attention_mask": mask[1:2, :4]})
    assert ig.shape == ids.shape and bool(torch.isfinite(ig).all())
    torch.testing.assert_close(ig[1:2, :4], alone, rtol=1e-6, atol=1e-10)


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_reformer_is_refused_by_name(method):
    model = _built(transformers.ReformerForSequenceClassification, transformers.ReformerConfig(
        vocab_size=40, hidden_size=16, num_attention_heads=2, attention_head_size=8, feed_forward_size=24,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=16, local_attn_chunk_length=4,
        pad_token_id=0, num_labels=3, is_decoder=False))
    ids, mask = _ids(2, 8, 8, 0)
    with pytest.raises(UnsupportedModelError, match="Reformer's reversible layers"):
        method(model).attribute(ids, target=1, forward_kwargs={"attention_mask": mask})


def test_two_id_inputs_of_a_model_without_a_decoder_are_refused():
    model = _llama()
    ids, mask = _ids(2, 6, 4, 0)
    with pytest.raises(InputError, match="takes no decoder_input_ids"):
        CaptumSaliency(model).attribute((ids, ids), target=(5, TOKEN), forward_kwargs={"attention_mask": mask})


def test_a_token_target_without_a_position_rule_is_refused_with_the_fix():
    model = _built(transformers.XLNetLMHeadModel, transformers.XLNetConfig(
        vocab_size=40, d_model=16, n_layer=1, n_head=2, d_inner=24, pad_token_id=5))
    ids, mask = _ids(2, 6, 4, 5)
    with pytest.raises(InputError, match=r"Pass one \(position, token\) target per example"):
        CaptumSaliency(model).attribute(ids, target=TOKEN, forward_kwargs={"attention_mask": mask})
    scores = CaptumSaliency(model).attribute(ids, target=[(5, TOKEN), (3, TOKEN)], forward_kwargs={"attention_mask": mask})
    assert scores.shape == ids.shape


# -- embedding calls that are not the attributed ids ---------------------------------------------
def test_ids_passed_by_keyword_are_embedded_but_not_attributed():
    # CTRL embeds token_type_ids with its input embeddings; a BART decoder prefix given by keyword
    # goes through the shared embeddings too: both keep their own embeddings, unattributed.
    model = _ctrl()
    ids, mask = _ids(2, 6, 4, 0)
    types = torch.randint(3, 40, ids.shape, generator=torch.Generator().manual_seed(3))
    kwargs = {"attention_mask": mask, "token_type_ids": types}
    saliency = CaptumSaliency(model).attribute(ids, target=TOKEN, forward_kwargs=kwargs)
    leaf = model.get_input_embeddings()(ids).detach().requires_grad_()
    (grad,) = _gradient(_last_real_token(model(inputs_embeds=leaf.clone(), **kwargs).logits, mask), [leaf])
    torch.testing.assert_close(saliency, grad.abs().sum(-1) * mask, **TOL)

    bart = _bart(transformers.BartForConditionalGeneration)
    ids, mask = _ids(2, 7, 5, 1)
    decoder_ids, decoder_mask = _ids(2, 4, 3, 1, seed=2)
    kwargs = {"attention_mask": mask, "decoder_input_ids": decoder_ids, "decoder_attention_mask": decoder_mask}
    saliency = CaptumSaliency(bart).attribute(ids, target=TOKEN, forward_kwargs=kwargs)
    leaf = bart.get_input_embeddings()(ids).detach().requires_grad_()
    logits = bart(inputs_embeds=leaf, **kwargs).logits
    (grad,) = _gradient(logits[torch.arange(2), decoder_mask.sum(1) - 1, TOKEN], [leaf])
    torch.testing.assert_close(saliency, grad.abs().sum(-1) * mask, **TOL)


class _TwoLookups(torch.nn.Module):
    """Embeds its ids and, through the same table, ids derived from them: a use the
    attribution cannot place."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 3)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, ids):
        return self.head((self.embed(ids) + self.embed((ids + 1) % 40)).mean(1))


@pytest.mark.parametrize("method", METHODS)
def test_an_embedding_call_on_other_ids_is_refused_by_name(method):
    model = _TwoLookups().double().eval()
    with pytest.raises(CaptureError, match=r"not the attributed input_ids .* attributing would leave that use out"):
        method(model, **({"baseline_token_id": 0} if method is CaptumIntegratedGradients else {})).attribute(
            torch.tensor([[3, 4, 5]]), target=1)


def test_ids_the_model_pads_itself_are_attributed_at_their_own_positions():
    # Longformer pads input_ids to a multiple of its attention window before embedding them.
    model = _built(transformers.LongformerForTokenClassification, transformers.LongformerConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
        attention_window=8, max_position_embeddings=24, pad_token_id=1, num_labels=3))
    ids = torch.randint(3, 40, (1, 5), generator=torch.Generator().manual_seed(1))
    saliency = CaptumSaliency(model).attribute(ids, target=(2, 1))
    leaf = model.get_input_embeddings()(ids).detach().requires_grad_()
    (grad,) = _gradient(model(inputs_embeds=leaf).logits[:, 2, 1], [leaf])
    torch.testing.assert_close(saliency, grad.abs().sum(-1), **TOL)
    ig = CaptumIntegratedGradients(model, n_steps=100).attribute(ids, target=(2, 1))
    with torch.no_grad():  # the [PAD] baseline replaces the word embeddings only (Longformer's positions
        # come from input_ids, and would count [PAD] as padding): the reference embeds them itself
        def score(embedded):
            return model(inputs_embeds=embedded).logits[:, 2, 1]
        embeddings = model.get_input_embeddings()
        expected = score(embeddings(ids)) - score(embeddings(torch.ones_like(ids)))
    torch.testing.assert_close(ig.sum(1), expected, rtol=1e-3, atol=1e-6)


def test_an_encoder_only_head_of_an_encoder_decoder_config_is_attributed_once():
    # UMT5's token classifier is an encoder with is_encoder_decoder=True: get_decoder() falls back to it.
    model = _built(transformers.UMT5ForTokenClassification, transformers.UMT5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_heads=2, pad_token_id=0, num_labels=3))
    ids, mask = _ids(2, 6, 4, 0)
    saliency = CaptumSaliency(model).attribute(ids, target=(2, 1), forward_kwargs={"attention_mask": mask})
    leaf = model.get_input_embeddings()(ids).detach().requires_grad_()
    (grad,) = _gradient(model(inputs_embeds=leaf, attention_mask=mask).logits[:, 2, 1], [leaf])
    torch.testing.assert_close(saliency, grad.abs().sum(-1) * mask, **TOL)


# -- causal LMs without attention: the next-token position from the family's construction ----------
def _mamba():
    return _built(transformers.MambaForCausalLM, transformers.MambaConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, state_size=4, conv_kernel=3, pad_token_id=0))


@pytest.mark.parametrize("method", METHODS)
def test_a_recurrent_causal_lm_token_target_is_the_last_real_position(method):
    """Mamba has no attention for the adapter to read its causal layout from; a token target still
    explains the next-token logit at each row's last real token (the explicit (position, token)
    form's attribution), padding stays zero and a padded row equals the example alone."""
    model = _mamba()
    ids, mask = _ids(2, 6, 4, pad=0)
    kwargs = {"attention_mask": mask}
    by_token = _made(method, model).attribute(ids, target=TOKEN, forward_kwargs=kwargs)
    explicit = _made(method, model).attribute(ids, target=[(5, TOKEN), (3, TOKEN)], forward_kwargs=kwargs)
    torch.testing.assert_close(by_token, explicit, rtol=0, atol=0)
    last_column = _made(method, model).attribute(ids, target=[(5, TOKEN), (5, TOKEN)], forward_kwargs=kwargs)
    assert (by_token[1] - last_column[1]).abs().max() > 0  # not the last column of the padded row
    assert bool((by_token[1, 4:] == 0).all()) and bool((by_token[:, :4] != 0).all())
    alone = _made(method, model).attribute(ids[1:, :4], target=TOKEN, forward_kwargs={"attention_mask": mask[1:, :4]})
    torch.testing.assert_close(by_token[1:, :4], alone, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_a_forward_that_breaks_its_own_backward_runs_without_its_cache(method):
    """RWKV's forward with use_cache=True overwrites its recurrent state in place, which its own
    backward pass needs: by default it is called without the cache (the same scores); asked for
    explicitly, the cache is refused naming the model and use_cache=False."""
    model = _built(transformers.RwkvForCausalLM, transformers.RwkvConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=24))
    assert getattr(model.config, "pad_token_id", None) is None  # Integrated Gradients: the all-zero embedding
    ids, mask = _ids(2, 6, 4, pad=0)
    with pytest.raises(InputError, match=r"RwkvForCausalLM's own forward pass overwrote.*'use_cache': False"):
        _made(method, model).attribute(ids, target=TOKEN, forward_kwargs={"attention_mask": mask, "use_cache": True})
    scores = _made(method, model).attribute(ids, target=TOKEN, forward_kwargs={"attention_mask": mask})
    explicit = _made(method, model).attribute(ids, target=TOKEN, forward_kwargs={"attention_mask": mask,
                                                                                "use_cache": False})
    torch.testing.assert_close(scores, explicit, rtol=0, atol=0)
    assert bool((scores[1, 4:] == 0).all()) and bool((scores[:, :4] != 0).all())
