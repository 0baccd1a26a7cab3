"""Gradient checkpointing kept on while explaining (``keep_gradient_checkpointing``, opt-in).

HF checkpoints only in train mode, so the models have dropout p = 0 by configuration. Every
method gives the map of the model without checkpointing (float64, 1e-10) while each
checkpointed layer really is recomputed in the backward pass (counted), under the same rules;
the flags, the layers' checkpoint functions and the model's state are as before, and
training with checkpointing goes on. Without the option the layers run plainly
(tests/test_gradient_checkpointing.py).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from captum_transformers import ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS
from captum_transformers.compat import checkpointing
from captum_transformers.compat.checkpointing import keep_gradient_checkpointing
from captum_transformers.capture.recorder import Recorder
from hf_models import CASES, SMALL
from restore import assert_same, snapshot

METHODS = ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS
# Methods whose forward runs without gradients: nothing is checkpointed (HF runs the layers plainly).
FORWARD_ONLY = {"RawAttention", "AttentionRollout"}


def _bert():
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        **SMALL, num_labels=3, attn_implementation="eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


BUILDERS = {"llama_gqa": CASES["llama_gqa"].model, "bert": _bert, "gpt2": _gpt2, "vit": CASES["vit"].model}
TARGETS = {"llama_gqa": 5, "bert": 1, "gpt2": 5, "vit": 1}


def _state(model):
    return {name: (vars(m).get("gradient_checkpointing"), vars(m).get("_gradient_checkpointing_func"))
            for name, m in model.named_modules() if "_gradient_checkpointing_func" in vars(m)}


@pytest.fixture
def recomputations(monkeypatch):
    """How many times a checkpointed layer was recomputed under the explanation's context."""
    count = [0]
    original = checkpointing._as_in_forward

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "_as_in_forward", counted)
    return count


@pytest.fixture
def records(monkeypatch):
    """Attention calls recorded: {False: by the explanation's recorder, True: by a recomputation's copy}."""
    count = {False: 0, True: 0}
    original = Recorder.record

    def counted(self, *args, **kwargs):
        count[vars(self).get("recomputation", False)] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Recorder, "record", counted)
    return count


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_method_gives_the_unchecked_map_with_the_layers_recomputed(name, recomputations, records):
    model = BUILDERS[name]().to(torch.float64).train()
    inputs, kwargs = CASES[name].inputs(dtype=torch.float64)
    target = TARGETS[name]
    references, recorded = {}, {}
    for method in METHODS:
        records[False] = 0
        references[method] = method(model).attribute(inputs, target=target, forward_kwargs=kwargs)
        recorded[method] = records[False]
    model.gradient_checkpointing_enable()
    state, before = _state(model), snapshot(model)
    assert state and all(flag is True for flag, _ in state.values()), "precondition: checkpointing is on"
    for method in METHODS:
        recomputations[0] = records[False] = records[True] = 0
        assert references[method].abs().max() > 0, method.__name__
        with keep_gradient_checkpointing():
            scores = method(model).attribute(inputs, target=target, forward_kwargs=kwargs)
        torch.testing.assert_close(scores, references[method], rtol=0, atol=1e-10, msg=method.__name__)
        if method.__name__ not in FORWARD_ONLY:
            assert recomputations[0] >= 2, method.__name__  # each of the 2 layers re-ran in the backward pass
        # The recomputed attention calls are not recorded a second time by the explanation.
        assert records[False] == recorded[method] and (records[True] > 0) == (method.__name__ not in FORWARD_ONLY)
        assert _state(model) == state and model.training
        assert_same(before, snapshot(model))
    # Training with checkpointing still works afterwards.
    output = model(inputs, **kwargs)
    output.logits.sum().backward()
    # Every parameter of the freshly built model is trainable and gets its gradient.
    assert [name for name, p in model.named_parameters() if not p.requires_grad or p.grad is None] == []


def test_without_the_option_the_layers_run_plainly(recomputations):
    model = BUILDERS["llama_gqa"]().to(torch.float64).train()
    model.gradient_checkpointing_enable()
    inputs, kwargs = CASES["llama_gqa"].inputs(dtype=torch.float64)
    LRP = RELEVANCE_METHODS[-1]
    LRP(model).attribute(inputs, target=5, forward_kwargs=kwargs)
    assert recomputations[0] == 0 and not checkpointing.kept()
    with keep_gradient_checkpointing():
        assert checkpointing.kept()
    assert not checkpointing.kept()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_generation_attribution_with_checkpointing_kept(recomputations):
    from captum_transformers import AttnLRP, TransformerRelevance
    from captum_transformers.generation import GenerationAttribution
    from generation_models import IdTokenizer

    model = BUILDERS["llama_gqa"]().to(torch.float64).train()
    prompt, answer = [1, 5, 7, 9, 11, 13], [20, 21, 22]
    references = {m: GenerationAttribution(m(model), IdTokenizer()).attribute(prompt, target=answer)
                  for m in (AttnLRP, TransformerRelevance)}
    model.gradient_checkpointing_enable()
    for method, reference in references.items():
        with keep_gradient_checkpointing():
            result = GenerationAttribution(method(model), IdTokenizer()).attribute(prompt, target=answer)
        torch.testing.assert_close(result.token_attr, reference.token_attr, rtol=0, atol=1e-10)
    assert recomputations[0] > 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpointing_kept_on_an_offloaded_model(recomputations):
    """accelerate's hooks onload the weights again in the recomputation."""
    import copy

    accelerate = pytest.importorskip("accelerate")
    from captum_transformers import AttnLRP, GenericAttention

    model = BUILDERS["llama_gqa"]().to(torch.float64).train()
    inputs, kwargs = CASES["llama_gqa"].inputs(dtype=torch.float64)
    offloaded = copy.deepcopy(model)
    offloaded.gradient_checkpointing_enable()
    offloaded = accelerate.cpu_offload(offloaded, execution_device="cpu")
    for method in (AttnLRP, GenericAttention):
        reference = method(model).attribute(inputs, target=5, forward_kwargs=kwargs)
        with keep_gradient_checkpointing():
            scores = method(offloaded).attribute(inputs, target=5, forward_kwargs=kwargs)
        torch.testing.assert_close(scores, reference, rtol=0, atol=1e-10)
    assert recomputations[0] > 0 and any(p.is_meta for p in offloaded.parameters())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_error_in_the_recomputation_of_an_offloaded_layer_puts_its_weights_back():
    """accelerate runs post_forward only after a forward that returned: a layer whose recomputation
    raised (in the backward pass) would otherwise keep its weights loaded."""
    import copy

    accelerate = pytest.importorskip("accelerate")
    from captum_transformers import AttnLRP

    model = BUILDERS["llama_gqa"]().to(torch.float64).train()
    inputs, kwargs = CASES["llama_gqa"].inputs(dtype=torch.float64)
    model.gradient_checkpointing_enable()
    offloaded = accelerate.cpu_offload(model, execution_device="cpu")
    up_proj = offloaded.model.layers[1].mlp.up_proj
    original = up_proj._old_forward  # what accelerate's hooked forward calls between pre_ and post_forward

    def raising_when_recomputed(*args, **kwargs):
        if checkpointing.recomputing():
            raise RuntimeError("raised in the recomputation")
        return original(*args, **kwargs)

    up_proj._old_forward = raising_when_recomputed
    try:
        with keep_gradient_checkpointing(), pytest.raises(RuntimeError, match="raised in the recomputation"):
            AttnLRP(offloaded).attribute(inputs, target=5, forward_kwargs=kwargs)
    finally:
        up_proj._old_forward = original
    assert up_proj.weight.is_meta and all(p.is_meta for p in offloaded.model.layers.parameters())
