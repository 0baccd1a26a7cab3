"""Sharded evaluation over 2 gloo processes, reduced with all_reduce_metrics, equals one process bit for bit."""
import pytest
import torch
from distributed_runs import assert_reduced_equals_single, sharded_and_reduced_states

from captum_transformers.errors import InputError
from captum_transformers.evaluation import (ClassSpecificity, ModalityTokenRemoval, PixelPerturbation, RationaleF1,
                                            SegmentationScores, TokenActivation, TokenPruning, all_reduce_metrics,
                                            shard_indices)

N, SIZE, LENGTH, UNK = 11, 6, 7, 1


def dataset():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(N, 3, SIZE, SIZE, generator=g)
    maps = torch.randn(N, SIZE, SIZE, generator=g)
    masks = torch.rand(N, SIZE, SIZE, generator=g) > 0.5
    ids = torch.randint(2, 20, (N, LENGTH), generator=g)
    relevance = torch.randn(N, LENGTH, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (N,), generator=g)
    word_ids = torch.randint(-1, 4, (N, LENGTH), generator=g)
    gold = torch.rand(N, 4, generator=g) > 0.5
    return dict(images=images, maps=maps, masks=masks, ids=ids, relevance=relevance, labels=labels,
                word_ids=word_ids, gold=gold, other_maps=maps.flip(1), other_masks=~masks)


WEIGHTS = torch.randn(3 * SIZE * SIZE, 3, generator=torch.Generator().manual_seed(1))
EMBED = torch.randn(20, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def image_model(x):
    return x.reshape(x.shape[0], -1) @ WEIGHTS


def token_model(batch):
    return (EMBED[batch["input_ids"]] * batch["attention_mask"][..., None]).sum(dim=1)


def modality_model(inputs):
    tokens, mask = inputs["text"]
    return (EMBED[tokens] * mask[..., None]).sum(dim=1) + inputs["image"][0].sum(dim=(1, 2))[:, None]


def new_metrics():
    return [PixelPerturbation(image_model, "positive"), SegmentationScores(), TokenActivation(token_model, UNK),
            TokenPruning(token_model, UNK), RationaleF1(2), ClassSpecificity(),
            ModalityTokenRemoval(modality_model, "text", "negative")]


def evaluate(indices, batch_size):
    data, metrics = dataset(), new_metrics()
    indices = list(indices)
    for start in range(0, len(indices), batch_size):
        d = {k: v[indices[start:start + batch_size]] for k, v in data.items()}
        mask = torch.ones_like(d["ids"])
        special = torch.zeros_like(d["ids"], dtype=torch.bool)
        special[:, 0] = True
        metrics[0].update(d["images"], d["labels"], d["maps"])
        metrics[1].update(d["maps"], d["masks"])
        metrics[2].update(d["ids"], mask, d["relevance"], d["labels"], special)
        metrics[3].update(d["ids"], mask, d["relevance"], d["labels"], special)
        metrics[4].update(d["relevance"], d["word_ids"], d["gold"])
        metrics[5].update(d["maps"], d["other_maps"], d["masks"], d["other_masks"])
        image = d["images"].reshape(len(d["ids"]), 3, -1)
        metrics[6].update({"text": (d["ids"], mask.bool()), "image": (image, torch.ones(len(image), 3))},
                          d["relevance"], d["labels"], special)
    return metrics




def test_sharded_and_reduced_equals_single_process_exactly(tmp_path):
    reduced_states = sharded_and_reduced_states(evaluate, N, tmp_path)
    single = evaluate(range(N), batch_size=3)  # other batch boundaries too
    assert_reduced_equals_single(single, reduced_states)


def test_all_reduce_is_a_no_op_without_a_process_group():
    metrics = evaluate(range(3), batch_size=3)
    before = [{k: v.clone() for k, v in m.state().items()} for m in metrics]
    all_reduce_metrics(metrics)
    assert all(torch.equal(b[k], m.state()[k]) for b, m in zip(before, metrics) for k in b)


@pytest.mark.parametrize("n, world", [(11, 2), (10, 3), (2, 4), (0, 2)])
def test_shards_are_contiguous_and_cover_everything_once(n, world):
    shards = [shard_indices(n, rank, world) for rank in range(world)]
    assert [i for shard in shards for i in shard] == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shard_indices_rejects_bad_ranks():
    with pytest.raises(InputError, match="rank"):
        shard_indices(10, 2, 2)
    with pytest.raises(InputError, match="int"):
        shard_indices(10.0, 0, 2)
