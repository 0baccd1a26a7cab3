"""MIF / LIF curves and SRG (Blücher et al., TMLR 2024) on toy models whose scores are known by hand."""
import math

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.images.occlusion import gaussian_blur, occlusion_fill
from captum_transformers.evaluation.relevance_gain import (RelevanceGainResult, class_scores, removal_masks,
                                                           symmetric_relevance_gain)
from captum_transformers.evaluation.graphs.relevance_gain import GraphRelevanceGain
from captum_transformers.evaluation.images.relevance_gain import ImageRelevanceGain
from captum_transformers.evaluation.tokens.relevance_gain import TokenRelevanceGain

HALVES = (0.0, 0.5, 1.0)


def area(curve, x=HALVES):
    return sum((x[i + 1] - x[i]) * (curve[i] + curve[i + 1]) / 2 for i in range(len(x) - 1))


def states_equal(a, b):
    return a.state().keys() == b.state().keys() and all(torch.equal(a.state()[k], b.state()[k]) for k in a.state())


# ---- the curve math ----------------------------------------------------------------------------------------------

def test_symmetric_relevance_gain_by_hand_and_per_example():
    gain = symmetric_relevance_gain([[10.0, 3.0, 0.0], [1.0, 1.0, 1.0]], [[10.0, 7.0, 0.0], [1.0, 0.0, 1.0]], HALVES)
    assert gain.area_mif.tolist() == [4.0, 1.0]
    assert gain.area_lif.tolist() == [6.0, 0.5]
    assert gain.srg.tolist() == [2.0, -0.5]
    uneven = symmetric_relevance_gain([1.0, 0.0, 0.0], [1.0, 1.0, 0.0], (0.0, 0.1, 1.0))
    assert float(uneven.srg) == pytest.approx(0.55 - 0.05)


def test_symmetric_relevance_gain_rejects_mismatched_curves():
    with pytest.raises(InputError, match="one score per removal step"):
        symmetric_relevance_gain([1.0, 0.0], [1.0, 0.0], HALVES)
    with pytest.raises(InputError, match="differ in shape"):
        symmetric_relevance_gain(torch.ones(2, 3), torch.ones(3), HALVES)
    with pytest.raises(InputError, match="strictly increasing"):
        symmetric_relevance_gain([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], (0.0, 1.0, 0.5))


def test_removal_masks_order_ties_alike_and_never_touch_unremovable_features():
    relevance = torch.tensor([[0.5, 0.5, 0.5, 9.0], [3.0, 1.0, 2.0, 0.0]])
    removable = torch.tensor([[True, True, True, False], [True, True, True, True]])
    masks = removal_masks(relevance, removable, (0.0, 0.25, 0.5, 1.0))
    assert not masks[:, 0, 3].any()  # never removable, however relevant
    # ties: MIF and LIF both take the earlier feature first (a stable sort each way)
    assert masks[1, 0].tolist() == [True, False, False, False] and masks[5, 0].tolist() == [True, False, False, False]
    assert masks[2, 1].tolist() == [True, False, True, False] and masks[6, 1].tolist() == [False, True, False, True]
    assert masks[3].all(dim=1).tolist() == [False, True] and masks[3, 0, :3].all() and masks[7, 0, :3].all()


def position_weighted_tokens(batch):
    """Logits [s, -s] with s the position-weighted count of kept tokens: tokens differ, so tie order matters."""
    kept = (batch["input_ids"] != 0).double() * batch["attention_mask"].double()
    evidence = kept @ torch.linspace(0.0, 1.0, batch["input_ids"].shape[1], dtype=torch.float64)
    return torch.stack([evidence, -evidence], dim=1)


@pytest.mark.parametrize("score", ["prob", "logit"])
def test_a_constant_map_gives_identical_curves_and_srg_zero(score):
    ids, mask = torch.randint(1, 10, (4, 8), generator=torch.Generator().manual_seed(0)), torch.ones(4, 8).long()
    tokens = TokenRelevanceGain(position_weighted_tokens, replacement_id=0, score=score)
    tokens.update(ids, mask, torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    images = ImageRelevanceGain(pixel_model, occlusion="zero", score=score)
    images.update(torch.rand(3, 1, 2, 2, generator=torch.Generator().manual_seed(1)), torch.ones(3, dtype=torch.long),
                  torch.full((3, 2, 2), 0.7))
    x, edge_index, batch, labels = graph_batch()
    graphs = GraphRelevanceGain(graph_model, score=score)
    graphs.update(x, edge_index, batch, torch.ones(5), labels)
    for result in (tokens.compute(), images.compute(), graphs.compute()):
        assert result.mif == result.lif and result.srg == 0.0


def test_class_scores():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert class_scores(logits, torch.tensor([1]), "prob").item() == pytest.approx(0.75)
    assert class_scores(logits, torch.tensor([1]), "logit").item() == pytest.approx(math.log(3.0))
    assert class_scores(logits, torch.tensor([0]), "log_prob").item() == pytest.approx(math.log(0.25))


# ---- images -----------------------------------------------------------------------------------------------------

PIXEL_WEIGHTS = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)


def pixel_model(images):
    """logits = [0, sum of channel-summed pixels weighted by PIXEL_WEIGHTS (row-major 2 x 2)]."""
    evidence = images.to(torch.float64).sum(dim=1).reshape(images.shape[0], -1) @ PIXEL_WEIGHTS
    return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


def test_images_by_hand_with_logits_and_zero_occlusion():
    metric = ImageRelevanceGain(pixel_model, fractions=HALVES, occlusion="zero", score="logit")
    images = torch.ones(1, 1, 2, 2)
    metric.update(images, torch.tensor([1]), PIXEL_WEIGHTS.reshape(1, 2, 2))
    result = metric.compute()
    # MIF drops weights 4, 3 then all: 10, 3, 0; LIF drops 1, 2 first: 10, 7, 0.
    assert result.mif == (10.0, 3.0, 0.0) and result.lif == (10.0, 7.0, 0.0)
    assert (result.area_mif, result.area_lif, result.srg, result.count) == (4.0, 6.0, 2.0, 1)
    assert result.higher_is_better and result.score == "logit"


def test_images_probability_patches_and_ordering():
    images = torch.ones(2, 3, 4, 4)
    weights = torch.arange(16.0).reshape(4, 4)

    def model(x):
        evidence = (x.sum(dim=1) * weights).sum(dim=(1, 2)) / 60
        return torch.stack([torch.zeros_like(evidence), evidence], dim=1)

    results = {}
    for name, maps in (("perfect", weights), ("reversed", -weights)):
        metric = ImageRelevanceGain(model, fractions=(0.0, 0.25, 0.5, 1.0), occlusion=0.0, patch_size=2)
        metric.update(images, torch.tensor([1, 1]), maps.expand(2, 4, 4))
        results[name] = metric.compute()
    perfect = results["perfect"]
    # 2 x 2 patches hold weight sums 10, 18, 42, 50 (x 3 channels / 60); MIF drops 50, then 42, ...
    logit = [3 * 120 / 60, 3 * 70 / 60, 3 * 28 / 60, 0.0]
    assert perfect.mif == pytest.approx([1 / (1 + math.exp(-v)) for v in logit], abs=1e-6)
    assert perfect.srg > 0 and results["reversed"].srg == pytest.approx(-perfect.srg, abs=1e-12)


def test_blur_is_rises_gkern_through_a_zero_padded_convolution():
    ndimage = pytest.importorskip("scipy.ndimage")
    impulse = torch.zeros(11, 11, dtype=torch.float64)
    impulse[5, 5] = 1.0
    rise_kernel = torch.from_numpy(ndimage.gaussian_filter(impulse.numpy(), 5))  # RISE's gkern(11, 5)
    assert rise_kernel[0, 0].item() == pytest.approx(0.00774, abs=1e-5)
    images = torch.rand(2, 3, 7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(images, (5, 5, 5, 5))  # zero padding, as conv2d(..., padding=klen // 2)
    expected = torch.stack([
        torch.stack([(padded[b, c, i:i + 11, j:j + 11] * rise_kernel).sum() for i in range(7) for j in range(9)])
        for b in range(2) for c in range(3)]).reshape(images.shape)
    assert torch.allclose(gaussian_blur(images), expected, rtol=0, atol=1e-14)


def test_image_occlusion_fills():
    images = torch.rand(2, 3, 5, 6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(occlusion_fill(images, "zero"), torch.zeros_like(images))
    assert torch.allclose(occlusion_fill(images, "mean")[:, :, 4, 5], images.mean(dim=(2, 3)))
    assert torch.equal(occlusion_fill(images, 0.5), torch.full_like(images, 0.5))
    assert torch.equal(occlusion_fill(images, "blur"), gaussian_blur(images))
    assert torch.equal(occlusion_fill(images, lambda x: x.flip(-1)), images.flip(-1))
    seen = []

    def recording(x):
        seen.append(x)
        return pixel_model(x[:, :, :2, :2])

    metric = ImageRelevanceGain(recording, fractions=(0.0, 1.0), occlusion=lambda x: x + 7.0)
    metric.update(images, torch.tensor([1, 0]), torch.randn(2, 5, 6))
    assert len(seen) == 1 and seen[0].shape == (8, 3, 5, 6)  # 2 curves x 2 steps x 2 images, one call
    assert torch.equal(seen[0][2], images[0] + 7.0) and torch.equal(seen[0][0], images[0])


def test_images_batch_of_three_equals_three_updates_and_merge_is_exact():
    generator = torch.Generator().manual_seed(1)
    images, maps = torch.rand(3, 1, 2, 2, generator=generator), torch.randn(3, 2, 2, generator=generator)
    labels = torch.tensor([1, 0, 1])
    whole, split = (ImageRelevanceGain(pixel_model, fractions=HALVES, occlusion="mean") for _ in range(2))
    whole.update(images, labels, maps)
    parts = [ImageRelevanceGain(pixel_model, fractions=HALVES, occlusion="mean") for _ in range(3)]
    for i in range(3):
        split.update(images[i:i + 1], labels[i:i + 1], maps[i:i + 1])
        parts[i].update(images[i:i + 1], labels[i:i + 1], maps[i:i + 1])
    assert states_equal(whole, split)
    assert states_equal(whole, parts[2].merge(parts[0]).merge(parts[1]))
    assert whole.compute() == split.compute()
    bounded = ImageRelevanceGain(pixel_model, fractions=HALVES, occlusion="mean", max_batch_size=4)
    bounded.update(images, labels, maps)
    assert states_equal(whole, bounded)


def test_images_bad_inputs():
    with pytest.raises(InputError, match="score"):
        ImageRelevanceGain(pixel_model, score="probability")
    with pytest.raises(InputError, match="occlusion"):
        ImageRelevanceGain(pixel_model, occlusion="noise")
    with pytest.raises(InputError, match="patch_size"):
        ImageRelevanceGain(pixel_model, patch_size=0)
    metric = ImageRelevanceGain(pixel_model, patch_size=3)
    with pytest.raises(InputError, match="does not divide"):
        metric.update(torch.ones(1, 1, 4, 4), torch.tensor([1]), torch.ones(1, 4, 4))
    metric = ImageRelevanceGain(pixel_model)
    with pytest.raises(InputError, match="spatial size"):
        metric.update(torch.ones(1, 1, 2, 2), torch.tensor([1]), torch.ones(1, 3, 3))
    with pytest.raises(InputError, match="NaN"):
        metric.update(torch.ones(1, 1, 2, 2), torch.tensor([1]), torch.full((1, 2, 2), float("nan")))
    with pytest.raises(InputError, match="labels"):
        metric.update(torch.ones(2, 1, 2, 2), torch.tensor([1]), torch.ones(2, 2, 2))
    with pytest.raises(InputError, match="same shape"):
        ImageRelevanceGain(pixel_model, occlusion=lambda x: x[:, :1]).update(
            torch.ones(1, 3, 2, 2), torch.tensor([1]), torch.ones(1, 2, 2))
    empty = ImageRelevanceGain(pixel_model).compute()
    assert empty.count == 0 and math.isnan(empty.srg)


# ---- tokens -----------------------------------------------------------------------------------------------------

PAD, UNK, CLS, SEP = 0, 1, 2, 3
TOKEN_WEIGHTS = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 4, 5], dtype=torch.float64)


def bag_of_words(batch):
    evidence = (TOKEN_WEIGHTS[batch["input_ids"]] * batch["attention_mask"]).sum(dim=1)
    return torch.stack([torch.zeros_like(evidence), evidence + batch["token_type_ids"][:, 0]], dim=1)


def token_batch():
    ids = torch.tensor([[CLS, 5, 6, 9, SEP, PAD], [CLS, 9, 8, 7, 5, SEP]])
    mask = (ids != PAD).long()
    special = (ids == CLS) | (ids == SEP) | (ids == PAD)
    return ids, mask, special, {"token_type_ids": torch.zeros_like(ids)}


@pytest.mark.parametrize("removal", ["replace", "mask"])
def test_tokens_by_hand(removal):
    ids, mask, special, extra = token_batch()
    metric = TokenRelevanceGain(bag_of_words, replacement_id=UNK, removal=removal, fractions=HALVES, score="logit")
    metric.update(ids[:1], mask[:1], TOKEN_WEIGHTS[ids[:1]], torch.tensor([1]), special[:1],
                  {k: v[:1] for k, v in extra.items()})
    result = metric.compute()
    # 3 removable tokens of weights 1, 2, 5; ceil(0.5 * 3) = 2 removed at the middle step.
    assert result.mif == (8.0, 1.0, 0.0) and result.lif == (8.0, 5.0, 0.0)
    assert result.srg == area([8.0, 5.0, 0.0]) - area([8.0, 1.0, 0.0]) == 2.0


def test_tokens_special_tokens_stay_and_batch_equals_single():
    ids, mask, special, extra = token_batch()
    relevance = torch.randn(2, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    batches = []

    def recording(batch):
        batches.append(batch)
        return bag_of_words(batch)

    whole = TokenRelevanceGain(recording, replacement_id=UNK)
    whole.update(ids, mask, relevance, torch.tensor([1, 0]), special, extra)
    stacked = batches[0]["input_ids"]
    assert stacked.shape == (2 * 21 * 2, 6) and (stacked[ids.repeat(42, 1) == CLS] == CLS).all()
    assert (stacked[special.repeat(42, 1)] == ids.repeat(42, 1)[special.repeat(42, 1)]).all()
    split = TokenRelevanceGain(bag_of_words, replacement_id=UNK)
    for i in range(2):
        split.update(ids[i:i + 1], mask[i:i + 1], relevance[i:i + 1], torch.tensor([1, 0])[i:i + 1],
                     special[i:i + 1], {k: v[i:i + 1] for k, v in extra.items()})
    assert states_equal(whole, split)


def test_tokens_bad_inputs():
    ids, mask, special, extra = token_batch()
    with pytest.raises(InputError, match="replacement_id"):
        TokenRelevanceGain(bag_of_words)
    with pytest.raises(InputError, match="removal"):
        TokenRelevanceGain(bag_of_words, UNK, removal="drop")
    metric = TokenRelevanceGain(bag_of_words, removal="mask")
    with pytest.raises(InputError, match="shape"):
        metric.update(ids, mask, torch.ones(2, 3), torch.tensor([1, 1]), special, extra)
    with pytest.raises(InputError, match="extra_inputs"):
        metric.update(ids, mask, torch.ones(2, 6), torch.tensor([1, 1]), special, {"input_ids": ids})


# ---- graphs -----------------------------------------------------------------------------------------------------

def graph_model(x, edge_index, batch):
    """logit 1 = sum of node features + 0.5 per directed edge, per graph."""
    graphs = int(batch.max()) + 1
    evidence = torch.zeros(graphs, dtype=torch.float64).index_add(0, batch, x[:, 0].to(torch.float64))
    evidence = evidence.index_add(0, batch[edge_index[0]], torch.full((edge_index.shape[1],), 0.5, dtype=torch.float64))
    return torch.stack([torch.zeros_like(evidence), evidence], dim=1)


def graph_batch():
    x = torch.tensor([[3.0], [1.0], [2.0], [1.0], [4.0]])
    edge_index = torch.tensor([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]])
    return x, edge_index, torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 1])


@pytest.mark.parametrize("removal, mif, lif", [
    # graph 0 (nodes 3, 1, 2; 4 edges) and graph 1 (nodes 1, 4; 2 edges); the middle step removes 2 resp. 1 nodes
    ("zero", [[8.0, 3.0, 2.0], [6.0, 2.0, 1.0]], [[8.0, 5.0, 2.0], [6.0, 5.0, 1.0]]),
    ("drop", [[8.0, 1.0, 0.0], [6.0, 1.0, 0.0]], [[8.0, 3.0, 0.0], [6.0, 4.0, 0.0]]),
])
def test_graphs_by_hand(removal, mif, lif):
    x, edge_index, batch, labels = graph_batch()
    metric = GraphRelevanceGain(graph_model, removal=removal, fractions=HALVES, score="logit")
    metric.update(x, edge_index, batch, x[:, 0], labels)
    result = metric.compute()
    assert result.mif == tuple((a + b) / 2 for a, b in zip(*mif))
    assert result.lif == tuple((a + b) / 2 for a, b in zip(*lif))
    assert result.srg == pytest.approx((area(lif[0]) + area(lif[1]) - area(mif[0]) - area(mif[1])) / 2, abs=1e-12)


def test_graphs_batch_equals_single_and_bad_inputs():
    x, edge_index, batch, labels = graph_batch()
    scores = torch.tensor([0.3, -1.0, 2.0, 0.1, 0.1])
    whole, split = GraphRelevanceGain(graph_model), GraphRelevanceGain(graph_model)
    whole.update(x, edge_index, batch, scores, labels)
    split.update(x[:3], edge_index[:, :4], batch[:3], scores[:3], labels[:1])
    split.update(x[3:], edge_index[:, 4:] - 3, batch[3:] - 1, scores[3:], labels[1:])
    assert states_equal(whole, split)
    with pytest.raises(InputError, match="removal"):
        GraphRelevanceGain(graph_model, removal="mask")
    with pytest.raises(InputError, match="one per node"):
        whole.update(x, edge_index, batch, scores[:3], labels)


def test_result_round_trips_through_a_dict():
    result = ImageRelevanceGain(pixel_model, fractions=HALVES, occlusion="zero")
    result.update(torch.ones(1, 1, 2, 2), torch.tensor([1]), PIXEL_WEIGHTS.reshape(1, 2, 2))
    computed = result.compute()
    assert RelevanceGainResult.from_dict(computed.to_dict()) == computed
    assert computed.to_dict()["kind"] == "RelevanceGainResult" and "mif" not in computed.scalars()
