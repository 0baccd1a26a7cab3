"""RationaleF1: word pooling, top-k selection, macro/micro F1 against hand-computed answers."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation import RationaleF1
from captum_transformers.evaluation.tokens.rationale_f1 import word_scores

# Two examples, 6 pieces, 4 words. -1 marks [CLS]/[SEP]/padding pieces.
WORD_IDS = torch.tensor([[-1, 0, 0, 1, 2, -1],
                         [-1, 0, 1, 2, 3, -1]])
GOLD = torch.tensor([[True, False, True, False],     # word 3 has no pieces in example 0
                     [False, True, True, False]])


def f1_of(token_scores, k="gold", word_ids=WORD_IDS, gold=GOLD):
    metric = RationaleF1(k)
    metric.update(token_scores, word_ids, gold)
    return metric.compute()


def test_word_score_is_max_over_pieces():
    token_scores = torch.tensor([[9.0, 0.2, 0.7, 0.1, 0.3, 9.0]], dtype=torch.float64)
    scores, has_piece = word_scores(token_scores, WORD_IDS[:1], 4)
    assert scores[0, :3].tolist() == [0.7, 0.1, 0.3] and has_piece[0].tolist() == [True, True, True, False]


def test_perfect_reversed_and_known_partial():
    perfect = torch.where(torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]]).bool(), 1.0, 0.0)
    assert f1_of(perfect).macro_f1 == 1.0 and f1_of(perfect).micro_f1 == 1.0
    reversed_ = -perfect
    # Example 0 has 2 gold words among 3 scorable ones, so any 2 words hit one: F1 = 1/2; example 1: F1 = 0.
    assert f1_of(reversed_).macro_f1 == 0.25 and f1_of(reversed_).micro_f1 == pytest.approx(0.25)
    # k = 1: example 0 picks word 0 (one of 2 gold): F1 = 2/3; example 1 picks word 1 (1 of 2): 2/3.
    partial = f1_of(perfect + torch.tensor([[0, 0.5, 0, 0, 0, 0], [0, 0, 0.5, 0, 0, 0]]), k=1)
    assert partial.macro_f1 == pytest.approx(2 / 3, abs=1e-9)
    assert partial.micro_precision == 1.0 and partial.micro_recall == 0.5
    assert partial.micro_f1 == pytest.approx(2 / 3)


def test_random_scores_match_a_loop_reference():
    generator = torch.Generator().manual_seed(0)
    batch, pieces, words = 16, 12, 8
    word_ids = torch.randint(-1, words, (batch, pieces), generator=generator)
    gold = torch.rand(batch, words, generator=generator) > 0.6
    scores = torch.rand(batch, pieces, generator=generator)
    result = f1_of(scores, k=3, word_ids=word_ids, gold=gold)
    f1s, tp_all, fp_all, fn_all = [], 0, 0, 0
    for b in range(batch):
        best = {}
        for s, w in zip(scores[b].tolist(), word_ids[b].tolist()):
            if w >= 0:
                best[w] = max(best.get(w, -1e9), s)
        chosen = set(sorted(best, key=lambda w: -best[w])[:3])
        truth = {w for w in range(words) if gold[b, w]}
        tp, fp, fn = len(chosen & truth), len(chosen - truth), len(truth - chosen)
        f1s.append(1.0 if 2 * tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn))
        tp_all, fp_all, fn_all = tp_all + tp, fp_all + fp, fn_all + fn
    assert result.macro_f1 == pytest.approx(sum(f1s) / batch, abs=1e-9)
    assert result.micro_f1 == pytest.approx(2 * tp_all / (2 * tp_all + fp_all + fn_all))


def test_empty_gold_and_empty_prediction_is_f1_one():
    no_gold = torch.zeros(2, 4, dtype=torch.bool)
    assert f1_of(torch.rand(2, 6), k="gold", gold=no_gold).macro_f1 == 1.0
    assert f1_of(torch.rand(2, 6), k=1, gold=no_gold).macro_f1 == 0.0


def test_ties_prefer_earlier_words_and_k_is_clipped():
    flat = torch.ones(2, 6)
    assert f1_of(flat, k=1).micro_precision == 0.5  # word 0 in both: gold in example 0 only
    many = f1_of(flat, k=10)  # clipped to the words that have pieces: 3 + 4 predicted
    assert many.micro_recall == 1.0 and many.micro_precision == 4 / 7
    pieceless_gold = GOLD.clone()
    pieceless_gold[0, 3] = True  # word 3 has no piece in example 0: it can only be missed
    assert f1_of(flat, k=10, gold=pieceless_gold).micro_recall == 4 / 5


def test_two_updates_equal_one_update_on_the_concatenation():
    scores = torch.rand(2, 6)
    whole, split = RationaleF1(2), RationaleF1(2)
    whole.update(scores, WORD_IDS, GOLD)
    split.update(scores[:1], WORD_IDS[:1], GOLD[:1])
    split.update(scores[1:], WORD_IDS[1:], GOLD[1:])
    assert all(torch.equal(whole.state()[k], split.state()[k]) for k in whole.state())


def test_bad_inputs_raise_input_error():
    with pytest.raises(InputError, match="k="):
        RationaleF1(k="all")
    with pytest.raises(InputError, match="word_ids must lie"):
        RationaleF1().update(torch.rand(2, 6), WORD_IDS + 4, GOLD)
    with pytest.raises(InputError, match="NaN"):
        RationaleF1().update(torch.full((2, 6), float("nan")), WORD_IDS, GOLD)
    with pytest.raises(InputError, match="shape"):
        RationaleF1().update(torch.rand(2, 5), WORD_IDS, GOLD)
