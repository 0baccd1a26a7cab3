"""A causal LM's head runs only at the explained position (``logits_to_keep``), and the maps are
the ones the full logits give.

The positions are chosen before the forward pass from the attention mask and checked against
the layout after it; a user's own ``logits_to_keep`` (0 keeps all) is passed through untouched.
"""
from __future__ import annotations

import pytest
import torch

from captum_transformers import (ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, AttnLRP, CaptureError,
                                 HuggingFaceAdapter)
from captum_transformers.adapters.huggingface.kept_logits import KeptLogitPositions, kept_logit_positions
from captum_transformers.capture.trace import TokenLayout
from hf_models import CASES

METHODS = [pytest.param(m, id=m.__name__) for m in ATTENTION_METHODS + LRP_ATTENTION_METHODS + RELEVANCE_METHODS]
PADDINGS = {
    "none": None,
    "left": [[0, 0, 1, 1, 1, 1, 1], [1] * 7, [0, 1, 1, 1, 1, 1, 1]],
    "right": [[1, 1, 1, 1, 0, 0, 0], [1] * 7, [1, 1, 1, 1, 1, 1, 0]],
}


def _head_positions(model, run):
    """Run ``run()`` and return how many positions each call of the LM head saw."""
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    try:
        result = run()
    finally:
        handle.remove()
    return result, seen


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("case", ["llama_gqa", "gpt2"])
@pytest.mark.parametrize("method", METHODS)
def test_maps_equal_those_of_the_full_logits(method, case, padding):
    model = CASES[case].model("eager", dtype=torch.float64)
    ids, _ = CASES[case].inputs(batch=3)
    mask = PADDINGS[padding]
    kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
    target = torch.tensor([4, 9, 2])
    explainer = method(model)

    def explain(**extra):
        return explainer.attribute(ids, target=target, forward_kwargs={**kwargs, **extra}, return_tokens=True)

    kept, kept_sizes = _head_positions(model, explain)
    full, full_sizes = _head_positions(model, lambda: explain(logits_to_keep=0))
    assert full_sizes == [7]
    expected = {"none": 1, "left": 1, "right": 3}[padding]  # right: positions 3, 6 and 5
    assert kept_sizes == [expected]
    torch.testing.assert_close(kept, full, rtol=0, atol=1e-12)


def test_an_explicit_position_is_kept():
    model = CASES["llama_gqa"].model("eager", dtype=torch.float64)
    ids, _ = CASES["llama_gqa"].inputs(batch=2)
    adapter = HuggingFaceAdapter(query_rows=2)
    kept, sizes = _head_positions(model, lambda: AttnLRP(model, adapter=adapter).attribute(ids, target=5,
                                                                                          return_tokens=True))
    full = AttnLRP(model, adapter=adapter).attribute(ids, target=5, forward_kwargs={"logits_to_keep": 0},
                                                     return_tokens=True)
    assert sizes == [1]
    assert kept[:, 3:].abs().max() == 0  # causal: nothing after the explained position
    torch.testing.assert_close(kept, full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("forward_kwargs", [
    {"labels": torch.zeros(2, 7, dtype=torch.long)},                    # the loss needs every position
    {"attention_mask": torch.ones(2, 1, 7, 7)},                         # a 4-D mask: positions not read here
    {"logits_to_keep": 0},                                              # the user's own choice
], ids=["labels", "4d-mask", "user-choice"])
def test_every_position_is_kept_where_the_choice_is_not_ours(forward_kwargs):
    model = CASES["llama_gqa"].model("eager")
    ids, _ = CASES["llama_gqa"].inputs(batch=2)
    assert kept_logit_positions(model, (ids,), (), forward_kwargs, None) is None


def test_a_model_without_logits_to_keep_and_mean_rows_keep_every_position():
    ids, _ = CASES["bert"].inputs(batch=2)
    assert kept_logit_positions(CASES["bert"].model("eager"), (ids,), (), {}, None) is None
    assert kept_logit_positions(CASES["llama_gqa"].model("eager"), (ids,), (), {}, "mean") is None


def test_the_mask_given_positionally_is_read():
    model = CASES["llama_gqa"].model("eager")
    ids, _ = CASES["llama_gqa"].inputs(batch=2)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    kept = kept_logit_positions(model, (ids,), (mask,), {}, None)
    assert kept.positions == (2, 6) and kept.keep.tolist() == [2, 6]


def test_a_layout_explaining_another_position_is_refused():
    kept = KeptLogitPositions(1, (6,))
    layout = TokenLayout(7, torch.tensor([[6], [4]]), None, 0, None, None)
    with pytest.raises(CaptureError, match=r"explained positions \[6, 4\] are not among .*\[6\]"):
        kept.layout_for_logits(layout, causal=True)
    with pytest.raises(CaptureError, match="was not causal"):
        kept.layout_for_logits(TokenLayout(7, torch.tensor([[6], [6]]), None, 0, None, None), causal=False)
    renumbered = KeptLogitPositions(torch.tensor([3, 6]), (3, 6)).layout_for_logits(
        TokenLayout(7, torch.tensor([[6], [3]]), None, 0, None, None), causal=True)
    assert renumbered.query_rows.tolist() == [[1], [0]]


def test_a_classifier_that_takes_logits_to_keep_keeps_every_position():
    """BioGPT's sequence classifier takes logits_to_keep and then reads its last real token
    itself: keeping one position made it index past the kept logits (a raw IndexError)."""
    import transformers
    from captum_transformers import AttentionRollout, GenericAttention

    torch.manual_seed(0)
    config = transformers.BioGptConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, num_labels=3, pad_token_id=0,
                                       attn_implementation="eager")
    model = transformers.BioGptForSequenceClassification(config).double().eval()
    ids = torch.tensor([[2, 5, 7, 9, 11, 3], [2, 6, 8, 3, 0, 0]])
    mask = (ids != 0).long()
    assert kept_logit_positions(model, (ids,), (), {"attention_mask": mask}, None) is None
    for method in (GenericAttention, AttnLRP, AttentionRollout):
        batch = method(model).attribute(ids, target=[1, 2], forward_kwargs={"attention_mask": mask})
        single = method(model).attribute(ids[1:, :4], target=[2], forward_kwargs={"attention_mask": mask[1:, :4]})
        torch.testing.assert_close(batch[1, :4], single[0], rtol=0, atol=1e-10)
