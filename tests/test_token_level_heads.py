"""Token-level heads (issue 42, item 4): token classification, extractive QA and masked LM.

Every method reads the row of the explained token, never [CLS]: a target ``(position, label)``
(token classification, masked LM) or ``(0 | 1, position)`` (QA: start or end score, the head's
``start_logits`` / ``end_logits`` read as one (B, 2, N) tensor) explains that position's row.
Checked against the model's own eager attentions at that row (raw attention, rollout), batch
== single on a padded batch for every method of the catalog, and the refusals (a padded target
token, a class-only target).
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from captum.attr import IntegratedGradients  # noqa: E402
from captum_transformers import AttentionRollout, InputError, RawAttention  # noqa: E402
from captum_transformers.methods.catalog import KNOWN_METHOD_NAMES, build_method  # noqa: E402

IDS = torch.tensor([[2, 5, 7, 9, 11, 3], [2, 6, 8, 3, 0, 0]])
MASK = (IDS != 0).long()
HEADS = {  # head class, labels, batch targets (the second example's is inside its 4 real tokens)
    "token-classification": (transformers.BertForTokenClassification, 3, [(4, 1), (2, 2)]),
    "question-answering": (transformers.BertForQuestionAnswering, 2, [(0, 4), (1, 2)]),
    "masked-lm": (transformers.BertForMaskedLM, 2, [(3, 7), (1, 11)]),
}


def _model(head: str):
    cls, labels, _ = HEADS[head]
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, num_labels=labels, attn_implementation="eager",
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return cls(config).double().eval()


def _position(head: str, target) -> int:
    return target[1] if head == "question-answering" else target[0]


def _first(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("name", KNOWN_METHOD_NAMES)
def test_batch_equals_single_for_a_token_target(head, name):
    model, (_, _, targets) = _model(head), HEADS[head]
    method = build_method(name, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # blank Grad-CAM maps on random weights
        batch = _first(method.attribute(IDS, target=targets, forward_kwargs={"attention_mask": MASK}))
        single = _first(method.attribute(IDS[1:, :4], target=[targets[1]],
                                         forward_kwargs={"attention_mask": MASK[1:, :4]}))
    assert torch.isfinite(batch).all()
    torch.testing.assert_close(batch[1, :4], single[0], rtol=0, atol=1e-10)


def _eager_attentions(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, output_attentions=True).attentions


@pytest.mark.parametrize("head", sorted(HEADS))
def test_raw_attention_and_rollout_read_the_target_tokens_row(head):
    model, (_, _, targets) = _model(head), HEADS[head]
    attentions = _eager_attentions(model, IDS, MASK)
    raw = RawAttention(model).attribute(IDS, target=targets, forward_kwargs={"attention_mask": MASK},
                                        return_tokens=True)
    rollout = AttentionRollout(model).attribute(IDS, target=targets, forward_kwargs={"attention_mask": MASK},
                                                return_tokens=True)
    for example, target in enumerate(targets):
        row = _position(head, target)
        real = int(MASK[example].sum())
        fused = [a[example].mean(0)[:real, :real] for a in attentions]
        torch.testing.assert_close(raw[example, :real], fused[-1][row], rtol=0, atol=1e-12)
        chain = torch.eye(real, dtype=torch.float64)
        for layer in fused:
            step = layer + torch.eye(real, dtype=torch.float64)
            chain = (step / step.sum(-1, keepdim=True)) @ chain
        torch.testing.assert_close(rollout[example, :real], chain[row], rtol=0, atol=1e-12)
        if row != 0:  # not the [CLS] row
            assert (raw[example, :real] - fused[-1][0]).abs().max() > 1e-6


def test_a_padded_target_token_and_a_class_only_target_are_refused():
    model = _model("token-classification")
    with pytest.raises(InputError, match="padding"):
        RawAttention(model).attribute(IDS, target=[(4, 1), (5, 0)], forward_kwargs={"attention_mask": MASK})
    with pytest.raises(InputError, match="index"):
        RawAttention(model).attribute(IDS, target=1, forward_kwargs={"attention_mask": MASK})


def test_captum_methods_read_the_start_and_end_scores():
    model = _model("question-answering")
    embeddings = model.get_input_embeddings()(IDS[:1]).detach()

    def forward(inputs_embeds):
        return model(inputs_embeds=inputs_embeds)

    from captum_transformers.capture.targets import output_scores
    scores = output_scores(forward(embeddings))
    assert scores.shape == (1, 2, IDS.shape[1])
    start = IntegratedGradients(lambda e: output_scores(forward(e))).attribute(embeddings, target=(0, 4), n_steps=4)
    assert start.abs().sum() > 0
    assert build_method("saliency", model).attribute(IDS[:1], target=(1, 2)).abs().sum() > 0
