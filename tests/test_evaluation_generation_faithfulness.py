"""GenerationFaithfulness: hand-computed on a bag-of-tokens causal "LM", and on the built-in recall model."""
import copy

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.generation.faithfulness import (GenerationFaithfulness,
                                                                    GenerationFaithfulnessResult,
                                                                    generation_token_scores)
from captum_transformers.evaluation.relevance_gain import symmetric_relevance_gain

VOCAB, REPLACEMENT, BOS = 12, 0, 1
WEIGHT = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
WEIGHT[REPLACEMENT] = 0  # a replaced token contributes nothing


class BagOfTokensLM:
    """Causal: the logits at position p are the sum of WEIGHT[id_j] over attended j <= p."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        rows = WEIGHT[batch["input_ids"]] * batch["attention_mask"][..., None]
        return rows.cumsum(dim=1)


def toy_data(n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts, outputs, attrs = [], [], []
    for _ in range(n):
        p, t = int(torch.randint(3, 8, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        prompts.append([BOS] + torch.randint(2, VOCAB, (p - 1,), generator=g).tolist())
        outputs.append(torch.randint(2, VOCAB, (t,), generator=g).tolist())
        attrs.append(torch.randn(t, p, generator=g, dtype=torch.float64))
    return prompts, outputs, attrs


def new_metric(**options):
    return GenerationFaithfulness(BagOfTokensLM(), replacement_id=REPLACEMENT, score="logit",
                                  never_removed_ids=[BOS], **options)


def test_hand_computed_drops_curves_and_srg():
    prompt, output = [BOS, 4, 5, 6], [7, 2]
    attr = torch.tensor([[9.0, 3.0, 1.0, 2.0], [0.0, -1.0, 5.0, 4.0]], dtype=torch.float64)
    model = BagOfTokensLM()
    metric = GenerationFaithfulness(model, replacement_id=REPLACEMENT, score="logit", ks=(1, 2, 5),
                                    fractions=(0.0, 0.5, 1.0), never_removed_ids=[BOS])
    metric.update_ids([prompt], [output], [attr])
    result = metric.compute()
    w = lambda token, target: float(WEIGHT[token, target])  # noqa: E731
    reference = [sum(w(i, 7) for i in prompt), sum(w(i, 2) for i in prompt) + w(7, 2)]
    # <bos> is never removed; row 0 ranks 4 > 6 > 5, row 1 ranks 5 > 6 > 4
    removal_0, removal_1 = [4, 6, 5], [5, 6, 4]
    drops = [[sum(w(i, 7) for i in removal_0[:k]), sum(w(i, 2) for i in removal_1[:k])] for k in (1, 2, 3)]
    assert result.score_drop == pytest.approx([sum(d) / 2 for d in drops], abs=1e-12)
    # fractions 0, 0.5, 1 of 3 removable tokens: 0, 2, 3 removed
    mif = [[r - sum(w(i, t) for i in order[:c]) for r, order, t in zip(reference, (removal_0, removal_1), (7, 2))]
           for c in (0, 2, 3)]
    lif = [[r - sum(w(i, t) for i in order[::-1][:c]) for r, order, t in zip(reference, (removal_0, removal_1), (7, 2))]
           for c in (0, 2, 3)]
    mean = lambda rows: [sum(r) / 2 for r in rows]  # noqa: E731
    assert result.mif == pytest.approx(mean(mif), abs=1e-12) and result.lif == pytest.approx(mean(lif), abs=1e-12)
    gain = symmetric_relevance_gain(torch.tensor(mean(mif), dtype=torch.float64),
                                    torch.tensor(mean(lif), dtype=torch.float64), (0.0, 0.5, 1.0))
    assert result.srg == pytest.approx(float(gain.srg), abs=1e-12)
    assert result.srg == pytest.approx(0.5 * ((mean(lif)[1] - mean(mif)[1]) + 0.5 * 0), abs=1e-12)
    assert result.reference_score == pytest.approx(sum(reference) / 2, abs=1e-12)
    assert (result.count, result.examples, result.score) == (2, 1, "logit")
    assert model.calls == 1  # every step of every generated token stacked in one forward
    per_step = GenerationFaithfulness(model, replacement_id=REPLACEMENT, score="logit", ks=(1, 2, 5),
                                      fractions=(0.0, 0.5, 1.0), never_removed_ids=[BOS], max_batch_size=2)
    per_step.update_ids([prompt], [output], [attr])
    assert model.calls == 1 + (1 + 3 + 2 * 3)  # 2 rows a call: one forward per step, not one per token
    assert per_step.compute() == result


def test_batch_equals_single_updates_bit_for_bit_and_merge_is_exact():
    prompts, outputs, attrs = toy_data(n=6)
    together, alone, chunked = new_metric(), new_metric(), new_metric(max_batch_size=5)
    together.update_ids(prompts, outputs, attrs)
    chunked.update_ids(prompts, outputs, attrs)
    for example in zip(prompts, outputs, attrs):
        alone.update_ids(*([x] for x in example))
    first, second = new_metric(), new_metric()
    first.update_ids(prompts[:2], outputs[:2], attrs[:2])
    second.update_ids(prompts[2:], outputs[2:], attrs[2:])
    merged = first.merge(second)
    for other in (alone, chunked, merged):
        assert all(torch.equal(together.state()[k], other.state()[k]) for k in together.state())
        assert other.compute() == together.compute()


def test_per_token_scores_are_the_rows_of_the_metric():
    prompts, outputs, attrs = toy_data(n=3)
    scores = generation_token_scores(BagOfTokensLM(), prompts, outputs, attrs, replacement_id=REPLACEMENT,
                                     never_removed_ids=[BOS], fractions=(0.0, 1.0))
    rows = sum(len(o) for o in outputs)
    assert scores.reference.shape == (rows,) and scores.top_k.shape == (rows, 4) and scores.mif.shape == (rows, 2)
    assert torch.equal(scores.mif[:, 0], scores.reference) and torch.equal(scores.mif[:, 1], scores.lif[:, 1])


@pytest.fixture(scope="module")
def recall_results():
    from captum_transformers import AttnLRP, GenerationAttribution
    from captum_transformers.tasks.recall.model import load_recall_model
    from captum_transformers.tasks.recall.task import recall_examples

    model, tokenizer = load_recall_model()
    examples = recall_examples(6, seed=0)
    results = GenerationAttribution(AttnLRP(model), tokenizer).attribute([e.prompt for e in examples],
                                                                         target=[e.answer for e in examples])
    return model, tokenizer, results


def recall_metric(model, tokenizer, **options):
    return GenerationFaithfulness(model, replacement_id=tokenizer.unk_token_id,
                                  never_removed_ids=[tokenizer.bos_token_id], **options)


def test_recall_model_relevance_beats_random_order(recall_results):
    model, tokenizer, results = recall_results
    explained, shuffled = recall_metric(model, tokenizer), recall_metric(model, tokenizer)
    explained.update(results)
    generator = torch.Generator().manual_seed(0)
    random_results = [copy.copy(r) for r in results]
    for r in random_results:
        r.token_attr = torch.rand(r.token_attr.shape, generator=generator)
    shuffled.update(random_results)
    good, bad = explained.compute(), shuffled.compute()
    assert good.score == "logit" and good.count == sum(len(r.output_ids) for r in results) and good.examples == 6
    assert good.srg > bad.srg + 1.0
    assert good.score_drop[0] > bad.score_drop[0]
    assert good.mif[0] == good.lif[0] == pytest.approx(good.reference_score)
    # the reference equals the score the explanation itself reported (same logit, other batch layout)
    assert good.reference_score == pytest.approx(float(torch.cat([r.scores for r in results]).mean()), abs=1e-4)


def test_recall_batch_equals_single_within_float_noise(recall_results):
    model, tokenizer, results = recall_results
    together, alone = recall_metric(model, tokenizer, fractions=(0.0, 0.5, 1.0)), \
        recall_metric(model, tokenizer, fractions=(0.0, 0.5, 1.0))
    together.update(results[:3])
    for r in results[:3]:
        alone.update(r)
    a, b = together.compute(), alone.compute()
    assert a.srg == pytest.approx(b.srg, abs=1e-4) and a.score_drop == pytest.approx(b.score_drop, abs=1e-4)


def test_clear_errors(recall_results):
    model, tokenizer, results = recall_results
    prompts, outputs, attrs = toy_data(n=2)
    with pytest.raises(InputError, match="expected \\(output tokens, prompt tokens\\)"):
        new_metric().update_ids(prompts, outputs, [a[:, 1:] for a in attrs])
    with pytest.raises(InputError, match="one token_attr per example"):
        new_metric().update_ids(prompts, outputs, attrs[:1])
    with pytest.raises(InputError, match="no removable prompt token"):
        new_metric().update_ids([[BOS]], [[3]], [torch.ones(1, 1)])
    with pytest.raises(InputError, match="NaN"):
        new_metric().update_ids(prompts, outputs, [a * float("nan") for a in attrs])
    with pytest.raises(InputError, match="ks="):
        GenerationFaithfulness(BagOfTokensLM(), replacement_id=0, ks=(3, 1))
    with pytest.raises(InputError, match="replacement_id"):
        GenerationFaithfulness(BagOfTokensLM(), replacement_id=None)
    with pytest.raises(InputError, match="score='logit'"):
        GenerationFaithfulness(BagOfTokensLM(), replacement_id=0).update_ids(prompts, outputs, attrs)
    with pytest.raises(InputError, match="logits \\(rows, length, vocabulary\\)"):
        GenerationFaithfulness(lambda b: b["input_ids"].float(), replacement_id=0, score="prob").update_ids(
            prompts, outputs, attrs)
    mixed = [copy.copy(r) for r in results[:2]]
    mixed[1].score_kind = "log_prob"
    metric = recall_metric(model, tokenizer)
    with pytest.raises(InputError, match="mix score kinds"):
        metric.update(mixed)
    contrast = copy.copy(results[0])
    contrast.contrast_tokens = ["red", "fox", "<eos>"]
    with pytest.raises(InputError, match="contrast"):
        metric.update(contrast)
    with pytest.raises(InputError, match="GenerationResults"):
        metric.update([object()])
    assert metric.compute().count == 0 and metric.score is None  # refused batches left no trace
    metric.update(mixed[:1])
    other = recall_metric(model, tokenizer, score="log_prob")
    with pytest.raises(InputError, match="Cannot merge"):
        metric.merge(other)


def test_result_round_trips_through_a_dict():
    metric = new_metric(fractions=(0.0, 1.0))
    metric.update_ids(*toy_data(n=2))
    result = metric.compute()
    assert GenerationFaithfulnessResult.from_dict(result.to_dict()) == result
    empty = new_metric().compute()
    assert empty.count == 0 and empty.srg != empty.srg  # NaN, never a silent 0


def test_a_constant_map_gives_identical_curves_and_srg_zero():
    prompts, outputs, attrs = toy_data()
    scores = generation_token_scores(BagOfTokensLM(), prompts, outputs, [torch.zeros_like(a) for a in attrs],
                                     replacement_id=REPLACEMENT, never_removed_ids=[BOS])
    assert torch.equal(scores.mif, scores.lif)
    metric = new_metric()
    metric.update_ids(prompts, outputs, [torch.full_like(a, 0.3) for a in attrs])
    result = metric.compute()
    assert result.mif == result.lif and result.srg == 0.0
