"""Properties of the pure math, against slow references written from the papers."""
from __future__ import annotations

import pytest
import torch

from captum_transformers import functional as F


def _random_maps(layers=3, batch=2, tokens=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(batch, tokens, tokens, generator=generator, dtype=torch.float64), -1)
            for _ in range(layers)]


def test_rollout_rows_sum_to_one():
    maps = [F.add_identity_and_normalize(m) for m in _random_maps()]
    start = F.query_vectors(torch.tensor([[0], [2]]), 5, torch.float64)
    rows = F.rollout_rows(maps, start)
    torch.testing.assert_close(rows.sum(-1), torch.ones(2, dtype=torch.float64))
    for layer_map in maps:
        torch.testing.assert_close(layer_map.sum(-1), torch.ones(2, 5, dtype=torch.float64))


def test_identity_attention_gives_identity_rollout():
    eye = torch.eye(5, dtype=torch.float64).expand(2, 5, 5)
    maps = [F.add_identity_and_normalize(eye) for _ in range(4)]
    for token in range(5):
        start = F.query_vectors(torch.tensor([[token], [token]]), 5, torch.float64)
        torch.testing.assert_close(F.rollout_rows(maps, start), start)


def _rollout_matrix_reference(maps):
    """Abnar & Zuidema: Ahat = 0.5 A + 0.5 I, Atilde_l = Ahat_l Atilde_{l-1}, one example at a time."""
    batch, tokens, _ = maps[0].shape
    out = []
    for b in range(batch):
        joint = torch.eye(tokens, dtype=maps[0].dtype)
        for layer_map in maps:
            a_hat = 0.5 * layer_map[b] + 0.5 * torch.eye(tokens, dtype=maps[0].dtype)
            joint = a_hat @ joint
        out.append(joint)
    return torch.stack(out)


def test_rollout_rows_equal_the_matrix_chain():
    raw = _random_maps()
    maps = [F.add_identity_and_normalize(m) for m in raw]
    reference = _rollout_matrix_reference(raw)
    start = F.query_vectors(torch.tensor([[0], [3]]), 5, torch.float64)
    rows = F.rollout_rows(maps, start)
    torch.testing.assert_close(rows[0], reference[0, 0])
    torch.testing.assert_close(rows[1], reference[1, 3])


def _generic_reference(fused):
    """ICCV'21 Eq. 6: R = I; for each layer R <- R + Abar R; one example at a time."""
    batch, tokens, _ = fused[0].shape
    out = []
    for b in range(batch):
        relevance = torch.eye(tokens, dtype=fused[0].dtype)
        for layer_map in fused:
            relevance = relevance + layer_map[b] @ relevance
        out.append(relevance)
    return torch.stack(out)


def test_self_attention_rows_equal_eq6_loop():
    fused = [m * 0.3 for m in _random_maps(layers=4)]
    reference = _generic_reference(fused)
    start = F.query_vectors(torch.tensor([[0, 1], [4, 4]]), 5, torch.float64)
    rows = F.self_attention_relevance_rows(fused, start)
    torch.testing.assert_close(rows[0], 0.5 * (reference[0, 0] + reference[0, 1]))
    torch.testing.assert_close(rows[1], reference[1, 4])


def test_gradient_weighted_heads_is_eq5():
    generator = torch.Generator().manual_seed(3)
    probs = torch.rand(2, 3, 4, 4, generator=generator, dtype=torch.float64)
    grad = torch.randn(2, 3, 4, 4, generator=generator, dtype=torch.float64)
    expected = torch.zeros(2, 4, 4, dtype=torch.float64)
    for b in range(2):
        for h in range(3):
            expected[b] += torch.clamp(grad[b, h] * probs[b, h], min=0) / 3
    torch.testing.assert_close(F.gradient_weighted_heads(probs, grad), expected)


def test_gradcam_heads_weights_each_head_by_its_mean_gradient():
    generator = torch.Generator().manual_seed(4)
    probs = torch.rand(1, 2, 3, 3, generator=generator, dtype=torch.float64)
    grad = torch.randn(1, 2, 3, 3, generator=generator, dtype=torch.float64)
    expected = (grad[0, 0].mean() * probs[0, 0] + grad[0, 1].mean() * probs[0, 1]) / 2
    torch.testing.assert_close(F.gradcam_heads(probs, grad)[0], expected.clamp(min=0))


def test_gradcam_heads_by_row_weights_each_head_by_its_rows_mean_gradient_over_the_columns():
    probs = torch.rand(2, 3, 4, 5)
    grad = torch.randn(2, 3, 4, 5)
    columns = torch.tensor([[False, True, True, True, True], [False, True, True, False, False]])
    got = F.gradcam_heads_by_row(probs, grad, columns)
    for b in range(2):
        for q in range(4):
            kept = columns[b].nonzero().squeeze(1)
            weights = [grad[b, h, q, kept].mean() for h in range(3)]
            expected = (sum(weights[h] * probs[b, h, q] for h in range(3)) / 3).clamp(min=0)
            torch.testing.assert_close(got[b, q], expected)



def test_discard_lowest_is_per_example_and_keeps_the_diagonal():
    maps = _random_maps(layers=1, batch=2, tokens=4)[0]
    out = F.discard_lowest(maps, [0.5, 0.0])
    torch.testing.assert_close(out[1], maps[1])
    off_diagonal = ~torch.eye(4, dtype=torch.bool)
    assert int((out[0][off_diagonal] == 0).sum()) == 6
    torch.testing.assert_close(torch.diagonal(out[0]), torch.diagonal(maps[0]))
    kept = out[0][off_diagonal]
    assert kept[kept > 0].min() >= maps[0][off_diagonal].sort().values[6 - 1]


def test_discard_lowest_counts_only_valid_pairs():
    """With a mask, a padded example's map equals the map of its real tokens alone."""
    maps = _random_maps(layers=1, batch=1, tokens=5)[0]
    real = 3
    padded = maps.clone()
    padded[:, real:, :] = 0.3  # padded queries: anything
    padded[:, :, real:] = 0.0  # padded keys: attention 0
    token_mask = torch.arange(5) < real
    valid = (token_mask[:, None] & token_mask[None, :]).unsqueeze(0)
    masked = F.discard_lowest(padded, 0.5, valid)[:, :real, :real]
    alone = F.discard_lowest(maps[:, :real, :real].clone(), 0.5)
    torch.testing.assert_close(masked, alone)
    assert not torch.equal(F.discard_lowest(padded, 0.5)[:, :real, :real], alone)  # without it they differ


@pytest.mark.parametrize("bad", [1.0, -0.1, [0.1, 0.2, 0.3]])
def test_discard_ratio_is_validated(bad):
    with pytest.raises(ValueError, match="discard_ratio"):
        F.discard_lowest(_random_maps(layers=1)[0], bad)


def test_head_fusions():
    probs = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(F.fuse_heads(probs, "mean"), probs.mean(1))
    torch.testing.assert_close(F.fuse_heads(probs, "max"), probs.max(1).values)
    torch.testing.assert_close(F.fuse_heads(probs, "min"), probs.min(1).values)
    with pytest.raises(ValueError, match="head_fusion"):
        F.fuse_heads(probs, "median")


def test_half_precision_accumulates_in_float32():
    probs = torch.rand(1, 2, 3, 3).half()
    assert F.fuse_heads(probs).dtype == torch.float32
    assert F.gradient_weighted_heads(probs, probs).dtype == torch.float32


@pytest.mark.parametrize("discard", [0.0, 0.5])
def test_rollout_rows_from_the_attention_equal_the_corrected_chain(discard):
    """(r / s) A + r / s, s = rowsum(A) + 1, equals r rownorm(I + A) layer by layer, also for
    maps whose rows do not sum to one (after discarding)."""
    maps = [F.discard_lowest(m, discard) for m in _random_maps(layers=4, batch=3, tokens=6, seed=3)]
    start = F.query_vectors(torch.tensor([[0], [2], [5]]), 6, torch.float64)
    expected = F.rollout_rows([F.add_identity_and_normalize(m) for m in maps], start)
    torch.testing.assert_close(F.rollout_rows_of_attention(maps, start), expected, rtol=0, atol=1e-14)
