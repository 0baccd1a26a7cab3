"""Inputs every faithfulness metric refuses with an InputError naming the problem: class labels the
model does not have, empty batches, examples with nothing to remove, graph ids with gaps, and
completeness errors beyond the exact sums' range."""
import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.evaluation.tokens.aopc import Comprehensiveness, Sufficiency
from captum_transformers.evaluation.completeness import CompletenessError
from captum_transformers.evaluation.images.deletion_insertion import RiseDeletion, RiseInsertion
from captum_transformers.evaluation.monotonicity import Monotonicity
from captum_transformers.evaluation.graphs.node_perturbation import NodeActivation
from captum_transformers.evaluation.images.pixel_flipping import PixelFlipping, RegionPerturbation
from captum_transformers.evaluation.images.pixel_perturbation import PixelPerturbation
from captum_transformers.evaluation.graphs.relevance_gain import GraphRelevanceGain
from captum_transformers.evaluation.images.relevance_gain import ImageRelevanceGain
from captum_transformers.evaluation.tokens.relevance_gain import TokenRelevanceGain
from captum_transformers.evaluation.images.road import ROAD
from captum_transformers.evaluation.tokens.token_flipping import TokenActivation

LINEAR = torch.nn.Linear(3 * 4 * 4, 3).double()  # three classes


def image_model(images):
    return LINEAR(images.reshape(images.shape[0], -1).double())


EMBEDDING = torch.nn.Embedding(10, 3).double()


def token_model(batch):
    return (EMBEDDING(batch["input_ids"]) * batch["attention_mask"][..., None]).sum(dim=1)


def graph_model(x, edge_index, batch):
    return torch.zeros(int(batch.max()) + 1, 3, dtype=torch.float64).index_add(0, batch, x.double().repeat(1, 3))


IMAGE_METRICS = {
    "srg": lambda: ImageRelevanceGain(image_model),
    "rise_deletion": lambda: RiseDeletion(image_model),
    "rise_insertion": lambda: RiseInsertion(image_model),
    "road": lambda: ROAD(image_model, noise=0.0, percentages=(10, 50)),
    "pixel_flipping": lambda: PixelFlipping(image_model, image_size=(4, 4), features_in_step=4),
    "region_perturbation": lambda: RegionPerturbation(image_model, patch_size=2, regions_evaluation=2),
    "monotonicity": lambda: Monotonicity(image_model, features_in_step=4),
    "pixel_perturbation": lambda: PixelPerturbation(image_model),
}
TOKEN_METRICS = {
    "srg": lambda: TokenRelevanceGain(token_model, replacement_id=0),
    "comprehensiveness": lambda: Comprehensiveness(token_model),
    "sufficiency": lambda: Sufficiency(token_model),
    "activation": lambda: TokenActivation(token_model, replacement_id=0),
}


def images(batch=2):
    g = torch.Generator().manual_seed(0)
    return torch.rand(batch, 3, 4, 4, generator=g), torch.rand(batch, 4, 4, generator=g)


def tokens(batch=2):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(1, 10, (batch, 5), generator=g), torch.ones(batch, 5, dtype=torch.long),
            torch.rand(batch, 5, generator=g))


@pytest.mark.parametrize("labels", [[0, 3], [-1, 0]])
@pytest.mark.parametrize("name", sorted(IMAGE_METRICS))
def test_image_metrics_refuse_labels_outside_the_models_classes(name, labels):
    x, maps = images()
    with pytest.raises(InputError, match=rf"labels \[{max(labels) if labels[1] == 3 else -1}\] are outside the "
                                         r"model's 3 classes"):
        IMAGE_METRICS[name]().update(x, torch.tensor(labels), maps)


@pytest.mark.parametrize("name", sorted(TOKEN_METRICS))
def test_token_metrics_refuse_labels_outside_the_models_classes(name):
    ids, mask, relevance = tokens()
    with pytest.raises(InputError, match=r"labels \[5\] are outside the model's 3 classes"):
        TOKEN_METRICS[name]().update(ids, mask, relevance, torch.tensor([0, 5]))


def test_graph_metrics_refuse_labels_outside_the_models_classes():
    x, edge_index, batch = torch.rand(4, 1), torch.tensor([[0, 2], [1, 3]]), torch.tensor([0, 0, 1, 1])
    for metric in (GraphRelevanceGain(graph_model), GraphRelevanceGain(graph_model, removal="zero"),
                   NodeActivation(graph_model)):
        with pytest.raises(InputError, match=r"labels \[3\] are outside the model's 3 classes"):
            metric.update(x, edge_index, batch, torch.rand(4), torch.tensor([0, 3]))


@pytest.mark.parametrize("name", sorted(IMAGE_METRICS))
def test_image_metrics_refuse_an_empty_batch(name):
    x, maps = images()
    with pytest.raises(InputError, match="batch is empty"):
        IMAGE_METRICS[name]().update(x[:0], torch.zeros(0, dtype=torch.long), maps[:0])


@pytest.mark.parametrize("name", sorted(TOKEN_METRICS))
def test_token_metrics_refuse_an_empty_batch(name):
    ids, mask, relevance = tokens()
    with pytest.raises(InputError, match="batch is empty"):
        TOKEN_METRICS[name]().update(ids[:0], mask[:0], relevance[:0], torch.zeros(0, dtype=torch.long))


def test_graphs_and_completeness_refuse_an_empty_batch():
    with pytest.raises(InputError, match="batch is empty"):
        GraphRelevanceGain(graph_model).update(torch.zeros(0, 1), torch.zeros(2, 0, dtype=torch.long),
                                               torch.zeros(0, dtype=torch.long), torch.zeros(0),
                                               torch.zeros(0, dtype=torch.long))
    with pytest.raises(InputError, match="batch is empty"):
        CompletenessError().update(torch.zeros(0, 3), torch.zeros(0))


def test_token_relevance_gain_refuses_an_example_without_removable_tokens():
    ids, mask, relevance = tokens()
    mask[1] = 0
    with pytest.raises(InputError, match=r"Examples \[1\] of the batch have no changeable token"):
        TokenRelevanceGain(token_model, replacement_id=0).update(ids, mask, relevance, torch.tensor([0, 1]))
    special = torch.zeros_like(mask)
    special[0] = 1
    with pytest.raises(InputError, match=r"Examples \[0, 1\]"):
        TokenRelevanceGain(token_model, removal="mask").update(ids, mask, relevance, torch.tensor([0, 1]), special)


def test_graph_ids_with_gaps_are_refused():
    x, edge_index = torch.rand(4, 1), torch.tensor([[0, 2], [1, 3]])
    for metric in (GraphRelevanceGain(graph_model), NodeActivation(graph_model)):
        with pytest.raises(InputError, match=r"batch skips graph ids \[1\]"):
            metric.update(x, edge_index, torch.tensor([0, 0, 2, 2]), torch.rand(4), torch.tensor([0, 1, 2]))


def test_completeness_names_the_example_whose_score_is_near_zero():
    relevance, scores = torch.ones(3, 3), torch.tensor([3.0, 1e-9, 2.0])
    with pytest.raises(InputError, match=r"Example 1 of the batch has score 1e-09.*relative=False"):
        CompletenessError().update(relevance, scores)
    absolute = CompletenessError(relative=False)
    absolute.update(relevance, scores)
    assert absolute.compute().mean_error == pytest.approx((0 + 3 + 1) / 3, abs=1e-9)
    with pytest.raises(InputError, match=r"Example 0 of the batch has relevance sum 3e\+07"):
        absolute.update(torch.full((1, 3), 1e7), torch.tensor([1.0]))
