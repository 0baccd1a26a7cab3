"""Captum's Integrated Gradients and Saliency as catalog rows: called like the package's
methods, on pixels and on token ids (at the input embeddings, padding respected)."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.methods.captum_baselines import CaptumIntegratedGradients, CaptumSaliency
from captum_transformers.methods.catalog import CLASS_AGNOSTIC, METHOD_NAMES, build_method

from hf_models import CASES
from lrp_models import _images, _timm_vit

TARGETS = torch.tensor([0, 1, 2])


def _bert(dtype=torch.float64):
    case = CASES["bert"]
    ids, kwargs = case.inputs()  # example 1 is padded after 5 tokens (its ids there are not [PAD])
    return case.model(dtype=dtype), ids, kwargs


def _scores(model, ids, mask, targets=TARGETS):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.gather(1, targets[:, None])[:, 0]


def test_catalog_names_build_the_captum_rows():
    assert {"integrated-gradients", "saliency"} <= set(METHOD_NAMES)
    assert not {"integrated-gradients", "saliency"} & CLASS_AGNOSTIC
    model, _, _ = _bert()
    assert isinstance(build_method("integrated-gradients", model), CaptumIntegratedGradients)
    assert isinstance(build_method("saliency", model), CaptumSaliency)


def test_integrated_gradients_on_token_ids_is_complete_against_the_pad_baseline():
    # sum_s IG_s = y_t(ids) - y_t([PAD] everywhere), per example, with the mask of each example:
    # holds only if the attention mask travels with its example through the interpolation steps.
    model, ids, kwargs = _bert()
    scores = CaptumIntegratedGradients(model).attribute(ids, target=TARGETS, forward_kwargs=kwargs)
    assert scores.shape == ids.shape
    pad = torch.full_like(ids, model.config.pad_token_id)
    expected = _scores(model, ids, kwargs["attention_mask"]) - _scores(model, pad, kwargs["attention_mask"])
    torch.testing.assert_close(scores.sum(1), expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method", [CaptumIntegratedGradients, CaptumSaliency])
def test_token_scores_are_zero_at_padding_and_equal_to_the_unpadded_example(method):
    model, ids, kwargs = _bert()
    mask = kwargs["attention_mask"]
    padded = method(model).attribute(ids, target=TARGETS, forward_kwargs=kwargs, return_tokens=True)
    assert torch.equal(padded[1, 5:], torch.zeros(2, dtype=padded.dtype))
    alone = method(model).attribute(ids[1:2, :5], target=TARGETS[1:2],
                                    forward_kwargs={"attention_mask": mask[1:2, :5]})
    torch.testing.assert_close(padded[1:2, :5], alone, rtol=1e-6, atol=1e-10)
    assert bool((padded[1, :5] != 0).all())


def test_saliency_on_token_ids_sums_the_absolute_embedding_gradient():
    model, ids, kwargs = _bert()
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeddings, attention_mask=kwargs["attention_mask"]).logits
    (gradient,) = torch.autograd.grad(logits.gather(1, TARGETS[:, None]).sum(), embeddings)
    expected = gradient.abs().sum(-1) * kwargs["attention_mask"]
    scores = CaptumSaliency(model).attribute(ids, target=TARGETS, forward_kwargs=kwargs)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=1e-12)


def test_pixel_inputs_give_pixel_maps_and_integrated_gradients_is_complete_against_zeros():
    vit, images = _timm_vit(), _images()
    attribution = CaptumIntegratedGradients(vit).attribute(images, target=TARGETS)
    assert attribution.shape == images.shape
    with torch.no_grad():
        expected = (vit(images) - vit(torch.zeros_like(images))).gather(1, TARGETS[:, None])[:, 0]
    torch.testing.assert_close(attribution.sum((1, 2, 3)), expected, rtol=1e-4, atol=1e-7)
    leaf = images.clone().requires_grad_()
    (gradient,) = torch.autograd.grad(vit(leaf).gather(1, TARGETS[:, None]).sum(), leaf)
    torch.testing.assert_close(CaptumSaliency(vit).attribute(images, target=TARGETS), gradient.abs())


@pytest.mark.parametrize("method", [CaptumIntegratedGradients, CaptumSaliency])
def test_target_none_explains_the_predicted_class(method):
    vit, images = _timm_vit(), _images()
    with torch.no_grad():
        predicted = vit(images).argmax(-1)
    torch.testing.assert_close(method(vit).attribute(images), method(vit).attribute(images, target=predicted))


def test_refusals_say_what_was_received_and_how_to_fix_it():
    vit, images = _timm_vit(), _images()
    with pytest.raises(InputError, match="return_tokens=True needs token-id inputs"):
        CaptumSaliency(vit).attribute(images, target=TARGETS, return_tokens=True)
    with pytest.raises(InputError, match="no get_input_embeddings"):
        CaptumSaliency(vit).attribute(torch.zeros(3, 5, dtype=torch.long), target=TARGETS)
    model, ids, kwargs = _bert()
    with pytest.raises(InputError, match="has batch size 2 but the inputs have 3"):
        CaptumSaliency(model).attribute(ids, target=TARGETS,
                                        forward_kwargs={"attention_mask": kwargs["attention_mask"][:2]})
    with pytest.raises(InputError, match="token ids must be one"):
        CaptumSaliency(model).attribute(ids[:, :, None], target=TARGETS)


def test_a_model_without_a_pad_id_is_integrated_from_the_all_zero_embedding():
    """GPT-2 has no pad id: the baseline is the zero embedding vector (Sundararajan et al.'s text
    baseline), which is Captum's IntegratedGradients on the embeddings with its default (zero)
    baselines; a ``baseline_token_id`` still chooses a token."""
    from captum.attr import IntegratedGradients

    gpt2 = CASES["gpt2"].model(dtype=torch.float64)
    assert gpt2.config.pad_token_id is None
    ids = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    target = [(6, 1), (4, 2)]
    ours = CaptumIntegratedGradients(gpt2, n_steps=16).attribute(ids, target=target)
    embedded = gpt2.get_input_embeddings()(ids).detach()
    reference = IntegratedGradients(lambda e: gpt2(inputs_embeds=e).logits).attribute(
        embedded, target=target, n_steps=16).sum(-1)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)
    by_token = CaptumIntegratedGradients(gpt2, baseline_token_id=0, n_steps=16).attribute(ids, target=target)
    assert (by_token - ours).abs().max() > 1e-6


def test_token_ids_equal_captums_layer_integrated_gradients_without_its_process_wide_hook():
    from captum.attr import LayerIntegratedGradients
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64, num_labels=3)).eval()
    ids = torch.randint(1, 50, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    target = torch.tensor([0, 1, 2])
    ours = CaptumIntegratedGradients(model).attribute(ids, target=target,
                                                      forward_kwargs={"attention_mask": mask})
    reference = LayerIntegratedGradients(lambda i, a: model(i, attention_mask=a).logits,
                                         model.get_input_embeddings()).attribute(
        ids, baselines=torch.zeros_like(ids), target=target, additional_forward_args=(mask,), n_steps=50,
        internal_batch_size=256).sum(-1) * mask  # pad_token_id is 0
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-7)


def test_integrated_gradients_on_a_graph_batch_is_refused_in_graph_words():
    """Captum's IG stacks its steps along dim 0, the node dimension of a PyG batch: edge_index and
    batch would no longer match the nodes. Refused, naming the graph model and what to use."""
    pytest.importorskip("torch_geometric")
    from pyg_models import graph_classifier, graphs

    from captum_transformers.errors import InputError
    from captum_transformers.methods.captum_baselines import CaptumIntegratedGradients, CaptumSaliency

    _, (x, edge_index, batch) = graphs()
    model = graph_classifier("TransformerConv")
    with pytest.raises(InputError, match="graph model .*node dimension.*saliency"):
        CaptumIntegratedGradients(model).attribute(x, target=[0, 1, 1], additional_forward_args=(edge_index, batch))
    saliency = CaptumSaliency(model).attribute(x, target=[0, 1, 1], additional_forward_args=(edge_index, batch))
    assert saliency.shape == x.shape  # one step: no expansion, explained as usual
