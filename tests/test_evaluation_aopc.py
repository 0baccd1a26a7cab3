"""Comprehensiveness and sufficiency (ERASER AOPC) on a bag-of-words toy model with known probabilities."""
import math

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.tokens.aopc import ERASER_FRACTIONS, AOPCResult, Comprehensiveness, Sufficiency
from captum_transformers.evaluation.results import ResultRecord

PAD, UNK, CLS, SEP = 0, 1, 2, 3
WEIGHT = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5], dtype=torch.float64)  # token 4 is neutral; 5..9 count


class BagOfWords:
    """logits = [0, sum of WEIGHT over attended tokens (+ 0.5 per token_type 1)]: p(1) = sigmoid(evidence)."""

    def __init__(self):
        self.batches = []

    def __call__(self, batch):
        self.batches.append(batch)
        evidence = (WEIGHT[batch["input_ids"]] * batch["attention_mask"]).sum(dim=1)
        evidence = evidence + 0.5 * (batch.get("token_type_ids", torch.zeros_like(batch["input_ids"])) *
                                     batch["attention_mask"]).sum(dim=1)
        return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


class FirstTokenModel:
    """Reads only position 1 (after [CLS]): tells dropping (positions shift) from replacing."""

    def __call__(self, batch):
        evidence = WEIGHT[batch["input_ids"][:, 1]]
        return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def one_example():
    ids = torch.tensor([[CLS, 5, 6, 9, 4, SEP, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    special = torch.tensor([[1, 0, 0, 0, 0, 1, 1]]).bool()
    return ids, mask, WEIGHT[ids], torch.tensor([1]), special


def make_batch(n=7, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 10, (n, length), generator=generator)
    lengths = torch.randint(4, length + 1, (n,), generator=generator)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, PAD))
    ids[:, 0] = CLS
    ids[torch.arange(n), lengths - 1] = SEP
    special = (ids == CLS) | (ids == SEP) | (ids == PAD)
    relevance = torch.randn(n, length, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 2, (n,), generator=generator)
    types = (torch.rand(n, length, generator=generator) > 0.5).long()
    return ids, mask, relevance, labels, special, {"token_type_ids": types}


@pytest.mark.parametrize("removal", ["drop", "replace"])
def test_comprehensiveness_hand_computed(removal):
    ids, mask, relevance, labels, special = one_example()
    options = {"replacement_id": UNK} if removal == "replace" else {}
    metric = Comprehensiveness(BagOfWords(), removal=removal, **options)
    metric.update(ids, mask, relevance, labels, special)
    result = metric.compute()
    # 4 changeable tokens of weights 1, 2, 5, 0: ceil(f * 4) = 1, 1, 1, 1, 2 removed, best first
    full = sigmoid(8)
    expected = [full - sigmoid(3)] * 4 + [full - sigmoid(1)]
    assert result.per_bin == pytest.approx(expected, abs=1e-12)
    assert result.aopc == pytest.approx(sum(expected) / 5, abs=1e-12)
    assert result.full_probability == pytest.approx(full, abs=1e-12)
    assert result.count == 1 and result.higher_is_better and result.fractions == ERASER_FRACTIONS


def test_sufficiency_hand_computed_keeps_only_the_rationale():
    ids, mask, relevance, labels, special = one_example()
    metric = Sufficiency(BagOfWords())
    metric.update(ids, mask, relevance, labels, special)
    result = metric.compute()
    full = sigmoid(8)
    assert result.per_bin == pytest.approx([full - sigmoid(5)] * 4 + [full - sigmoid(7)], abs=1e-12)
    assert not result.higher_is_better and result.name == "sufficiency"


def test_drop_removes_tokens_from_the_sequence_and_replace_keeps_positions():
    ids, mask, _, labels, special = one_example()
    relevance = torch.tensor([[0.0, 9.0, 1.0, 0.5, 0.2, 0.0, 0.0]])  # token 5 at position 1 is the top one
    dropped, replaced = Comprehensiveness(FirstTokenModel()), Comprehensiveness(FirstTokenModel(), "replace",
                                                                                 replacement_id=UNK)
    dropped.update(ids, mask, relevance, labels, special)
    replaced.update(ids, mask, relevance, labels, special)
    # drop: token 6 (weight 2) moves to position 1; replace: [UNK] (weight 0) sits there
    assert dropped.compute().per_bin[0] == pytest.approx(sigmoid(1) - sigmoid(2), abs=1e-12)
    assert replaced.compute().per_bin[0] == pytest.approx(sigmoid(1) - sigmoid(0), abs=1e-12)


def test_dropped_batch_is_left_packed_with_its_token_types():
    ids, mask, relevance, labels, special, extra = make_batch(n=3)
    model = BagOfWords()
    metric = Comprehensiveness(model, fractions=(0.5,))
    metric.update(ids, mask, relevance, labels, special, extra)
    batch = model.batches[0]
    assert batch["input_ids"].shape[0] == 2 * 3  # the full input and one bin, stacked in one call
    kept = batch["attention_mask"].bool()
    assert (kept.cumsum(1) == torch.arange(1, kept.shape[1] + 1)[None].clamp(max=kept.sum(1, keepdim=True))).all()
    assert torch.equal(batch["input_ids"][:3][kept[:3]], ids[mask.bool()])  # the full input is unchanged
    assert torch.equal(batch["token_type_ids"][:3][kept[:3]], extra["token_type_ids"][mask.bool()])


@pytest.mark.parametrize("cls", [Comprehensiveness, Sufficiency])
@pytest.mark.parametrize("removal", ["drop", "replace"])
def test_batch_equals_single_updates_bit_for_bit(cls, removal):
    ids, mask, relevance, labels, special, extra = make_batch()
    options = {"replacement_id": UNK} if removal == "replace" else {}
    together, alone = cls(BagOfWords(), removal, **options), cls(BagOfWords(), removal, **options)
    together.update(ids, mask, relevance, labels, special, extra)
    for i in range(len(ids)):
        alone.update(ids[i:i + 1], mask[i:i + 1], relevance[i:i + 1], labels[i:i + 1], special[i:i + 1],
                     {k: v[i:i + 1] for k, v in extra.items()})
    assert all(torch.equal(together.state()[k], alone.state()[k]) for k in together.state())
    assert together.compute() == alone.compute()


def test_max_batch_size_and_merge_are_exact():
    ids, mask, relevance, labels, special, extra = make_batch(n=9)
    whole, small = Comprehensiveness(BagOfWords()), Comprehensiveness(BagOfWords(), max_batch_size=4)
    whole.update(ids, mask, relevance, labels, special, extra)
    small.update(ids, mask, relevance, labels, special, extra)
    first, second = Comprehensiveness(BagOfWords()), Comprehensiveness(BagOfWords())
    first.update(ids[:4], mask[:4], relevance[:4], labels[:4], special[:4], {k: v[:4] for k, v in extra.items()})
    second.update(ids[4:], mask[4:], relevance[4:], labels[4:], special[4:], {k: v[4:] for k, v in extra.items()})
    merged = first.merge(second)
    for other in (small, merged):
        assert all(torch.equal(whole.state()[k], other.state()[k]) for k in whole.state())
    with pytest.raises(InputError, match="Cannot merge"):
        whole.merge(Sufficiency(BagOfWords()))


def test_perfect_ranking_beats_reversed():
    ids, mask, _, _, special, _ = make_batch(n=20, seed=3)
    perfect, reverse = WEIGHT[ids] + 1e-3 * torch.arange(ids.shape[1]), -WEIGHT[ids]
    labels = torch.ones(len(ids), dtype=torch.long)
    results = {}
    for name, relevance in (("perfect", perfect), ("reversed", reverse)):
        comp, suff = Comprehensiveness(BagOfWords()), Sufficiency(BagOfWords())
        comp.update(ids, mask, relevance, labels, special)
        suff.update(ids, mask, relevance, labels, special)
        results[name] = comp.compute().aopc, suff.compute().aopc
    assert results["perfect"][0] > results["reversed"][0]
    assert results["perfect"][1] < results["reversed"][1]


def test_result_serialises_as_a_record():
    ids, mask, relevance, labels, special = one_example()
    metric = Sufficiency(BagOfWords(), removal="replace", replacement_id=UNK)
    metric.update(ids, mask, relevance, labels, special)
    result = metric.compute()
    assert isinstance(result, ResultRecord) and AOPCResult.from_dict(result.to_dict()) == result
    empty = Sufficiency(BagOfWords()).compute()
    assert empty.count == 0 and math.isnan(empty.aopc)


def test_clear_errors():
    ids, mask, relevance, labels, special = one_example()
    with pytest.raises(InputError, match="replacement_id"):
        Comprehensiveness(BagOfWords(), removal="replace")
    with pytest.raises(InputError, match="only used with removal='replace'"):
        Comprehensiveness(BagOfWords(), replacement_id=UNK)
    with pytest.raises(InputError, match="removal"):
        Comprehensiveness(BagOfWords(), removal="blur")
    with pytest.raises(InputError, match="above 0"):
        Comprehensiveness(BagOfWords(), fractions=(0.0, 0.5))
    metric = Comprehensiveness(BagOfWords())
    with pytest.raises(InputError, match="no changeable token"):
        metric.update(ids, mask, relevance, labels, torch.ones_like(special))
    with pytest.raises(InputError, match="NaN"):
        metric.update(ids, mask, relevance * float("nan"), labels, special)
    with pytest.raises(InputError, match="per-token tensor"):
        metric.update(ids, mask, relevance, labels, special, {"token_type_ids": torch.zeros(1, 3)})
    with pytest.raises(InputError, match="no token at all"):
        Comprehensiveness(BagOfWords(), fractions=(1.0,)).update(ids, mask, relevance, labels)
    assert metric.compute().count == 0  # refused batches left no trace
