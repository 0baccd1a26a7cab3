"""TokenActivation (AUAC) and TokenPruning (AU-MSE) on a bag-of-words toy model with known logits."""
import math

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import TokenActivation, TokenPruning
from captum_transformers.evaluation.tokens.token_flipping import flip_counts

PAD, UNK, CLS, SEP = 0, 1, 2, 3
WEIGHT = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5], dtype=torch.float64)  # token 4 is neutral; 5..9 count


class BagOfWords:
    """logits = [0, sum of WEIGHT[id] over attended tokens]; records what it was given."""

    def __init__(self):
        self.calls, self.batches = 0, []

    def __call__(self, batch):
        self.calls += 1
        self.batches.append(batch)
        evidence = (WEIGHT[batch["input_ids"]] * batch["attention_mask"]).sum(dim=1)
        return torch.stack([torch.zeros_like(evidence), evidence + 0.5 * batch["token_type_ids"][:, 0]], dim=1)


def make_batch(n=10, length=9, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 10, (n, length), generator=generator)
    lengths = torch.randint(4, length + 1, (n,), generator=generator)
    positions = torch.arange(length)[None]
    mask = (positions < lengths[:, None]).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, PAD))
    ids[:, 0] = CLS
    ids[torch.arange(n), lengths - 1] = SEP
    special = (ids == CLS) | (ids == SEP) | (ids == PAD)
    weights = WEIGHT[ids] + 0.01 * torch.rand(n, length, generator=generator, dtype=torch.float64)  # no ties
    relevance = {"perfect": weights, "random": torch.rand(n, length, generator=generator), "reversed": -weights}
    extra = {"token_type_ids": torch.zeros(n, length, dtype=torch.long)}
    return ids, mask, special, torch.ones(n, dtype=torch.long), relevance, extra


def activation(relevance_name, **options):
    ids, mask, special, labels, relevance, extra = make_batch()
    metric = TokenActivation(BagOfWords(), replacement_id=UNK, **options)
    metric.update(ids, mask, relevance[relevance_name], labels, special, extra)
    return metric.compute()


def pruning(relevance, **options):
    ids, mask, special, labels, _, extra = make_batch()
    metric = TokenPruning(BagOfWords(), replacement_id=UNK, **options)
    metric.update(ids, mask, relevance, labels, special, extra)
    return metric.compute()


def test_flip_counts_use_ceil_without_float_noise():
    changeable = torch.tensor([[True] * 10, [True] * 3 + [False] * 7])
    counts = flip_counts(tuple(i / 10 for i in range(11)), changeable)
    assert counts[:, 0].tolist() == list(range(11))
    assert counts[:, 1].tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]


def test_auac_orders_perfect_random_reversed():
    perfect, random, reversed_ = (activation(k) for k in ("perfect", "random", "reversed"))
    assert perfect.auc > random.auc > reversed_.auc
    assert perfect.y[-1] == random.y[-1] == reversed_.y[-1]  # everything revealed: the original input
    assert perfect.y[0] == random.y[0] == reversed_.y[0] == 0.5  # all [UNK]: logits [0, 0]


def test_auac_known_curve_for_one_example():
    ids = torch.tensor([[CLS, 5, 6, 9, 4, SEP, PAD]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    special = torch.tensor([[1, 0, 0, 0, 0, 1, 1]]).bool()
    relevance = WEIGHT[ids]
    model = BagOfWords()
    metric = TokenActivation(model, replacement_id=UNK)
    metric.update(ids, mask, relevance, torch.tensor([1]), special, {"token_type_ids": torch.zeros_like(ids)})
    # 4 changeable tokens revealed best first (weights 5, 2, 1, 0); ceil(f * 4) of them at f = 0, 0.1, ..., 1.
    evidence = [0, 5, 7, 8, 8]
    revealed = [0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4]
    expected = [1 / (1 + math.exp(-evidence[k])) for k in revealed]
    result = metric.compute()
    assert result.y == pytest.approx(expected, abs=1e-9)
    assert result.auc == pytest.approx(sum((a + b) / 2 * 0.1 for a, b in zip(expected, expected[1:])), abs=1e-9)
    assert model.calls == 1
    stacked = model.batches[0]["input_ids"]
    assert (stacked[:, 0] == CLS).all() and (stacked[:, 5] == SEP).all() and (stacked[:, 6] == PAD).all()
    assert stacked[0, 1:5].tolist() == [UNK] * 4 and stacked[3, 1:5].tolist() == [UNK, 6, 9, UNK]


def test_au_mse_orders_perfect_random_reversed():
    ids, mask, special, labels, relevance, extra = make_batch()
    perfect = pruning(relevance["perfect"])
    reversed_ = pruning(10.0 - relevance["perfect"])  # largest |relevance| on the least important tokens
    random = pruning(relevance["random"])
    assert perfect.auc < random.auc < reversed_.auc
    assert perfect.y[0] == 0.0 and not perfect.higher_is_better


def test_au_mse_known_value_is_the_summed_squared_logit_change():
    ids = torch.tensor([[CLS, 5, 9, SEP]])
    mask = torch.ones_like(ids)
    special = torch.tensor([[True, False, False, True]])
    metric = TokenPruning(BagOfWords(), replacement_id=UNK, fractions=(0.0, 0.5, 1.0))
    metric.update(ids, mask, torch.tensor([[0.0, -1.0, 2.0, 0.0]]), torch.tensor([1]), special,
                  {"token_type_ids": torch.zeros_like(ids)})
    # |relevance| prunes token 5 (weight 1) first, then 9 (weight 5): logit1 goes 6 -> 5 -> 0.
    assert metric.compute().y == (0.0, 1.0, 36.0)


def test_two_updates_equal_one_update_and_max_batch_size_gives_the_same_state():
    ids, mask, special, labels, relevance, extra = make_batch()
    whole, split = TokenActivation(BagOfWords(), UNK), TokenActivation(BagOfWords(), UNK)
    whole.update(ids, mask, relevance["random"], labels, special, extra)
    split.update(ids[:3], mask[:3], relevance["random"][:3], labels[:3], special[:3],
                 {k: v[:3] for k, v in extra.items()})
    split.update(ids[3:], mask[3:], relevance["random"][3:], labels[3:], special[3:],
                 {k: v[3:] for k, v in extra.items()})
    assert all(torch.equal(whole.state()[k], split.state()[k]) for k in whole.state())
    model = BagOfWords()
    bounded = TokenPruning(model, UNK, max_batch_size=7)
    bounded.update(ids, mask, relevance["random"], labels, special, extra)
    unbounded = TokenPruning(BagOfWords(), UNK)
    unbounded.update(ids, mask, relevance["random"], labels, special, extra)
    assert model.calls == 11 * 2 and all(b["input_ids"].shape[0] <= 7 for b in model.batches)
    assert torch.equal(bounded.state()["sums"], unbounded.state()["sums"])


def test_bad_inputs_raise_input_error():
    ids, mask, special, labels, relevance, extra = make_batch()
    with pytest.raises(InputError, match="replacement_id"):
        TokenActivation(BagOfWords(), replacement_id="[UNK]")
    with pytest.raises(InputError, match="start at 0.0"):
        TokenPruning(BagOfWords(), UNK, fractions=(0.5, 1.0))
    metric = TokenActivation(BagOfWords(), UNK)
    with pytest.raises(InputError, match="shape"):
        metric.update(ids, mask, relevance["random"][:, :3], labels, special, extra)
    with pytest.raises(InputError, match="labels"):
        metric.update(ids, mask, relevance["random"], labels[:2], special, extra)
    with pytest.raises(InputError, match="extra_inputs"):
        metric.update(ids, mask, relevance["random"], labels, special, {"input_ids": ids})
    with pytest.raises(InputError, match="logits"):
        TokenActivation(lambda batch: batch["input_ids"].sum(1), UNK).update(ids, mask, relevance["random"], labels)
