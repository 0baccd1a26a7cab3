"""SRG, RISE deletion / insertion and completeness error, sharded over 2 gloo processes and reduced with
all_reduce_metrics, equal one process bit for bit."""
import torch
from distributed_runs import assert_reduced_equals_single, sharded_and_reduced_states

from captum_transformers.evaluation.completeness import CompletenessError
from captum_transformers.evaluation.images.deletion_insertion import RiseDeletion, RiseInsertion
from captum_transformers.evaluation.graphs.relevance_gain import GraphRelevanceGain
from captum_transformers.evaluation.images.relevance_gain import ImageRelevanceGain
from captum_transformers.evaluation.tokens.relevance_gain import TokenRelevanceGain

N, SIZE, LENGTH, NODES, UNK = 7, 4, 6, 4, 1
FRACTIONS = (0.0, 0.25, 0.5, 1.0)


def dataset():
    g = torch.Generator().manual_seed(0)
    return dict(
        images=torch.rand(N, 3, SIZE, SIZE, generator=g), maps=torch.randn(N, SIZE, SIZE, generator=g),
        ids=torch.randint(2, 20, (N, LENGTH), generator=g), relevance=torch.randn(N, LENGTH, generator=g),
        labels=torch.randint(0, 3, (N,), generator=g), x=torch.randn(N, NODES, 2, generator=g),
        node_scores=torch.randn(N, NODES, generator=g), scores=torch.randn(N, generator=g) + 5.0,
    )


WEIGHTS = torch.randn(3 * SIZE * SIZE, 3, generator=torch.Generator().manual_seed(1))
EMBED = torch.randn(20, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
NODE_WEIGHTS = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
RING = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])


def image_model(x):
    return x.reshape(x.shape[0], -1) @ WEIGHTS


def token_model(batch):
    return (EMBED[batch["input_ids"]] * batch["attention_mask"][..., None]).sum(dim=1)


def graph_model(x, edge_index, batch):
    messages = torch.zeros_like(x).index_add(0, edge_index[1], x[edge_index[0]])
    return torch.zeros(int(batch.max()) + 1, 3).index_add(0, batch, (x + messages) @ NODE_WEIGHTS)


def new_metrics():
    return [ImageRelevanceGain(image_model, FRACTIONS, occlusion="blur", patch_size=2),
            TokenRelevanceGain(token_model, removal="mask", fractions=FRACTIONS, score="log_prob"),
            GraphRelevanceGain(graph_model, fractions=FRACTIONS),
            RiseDeletion(image_model, FRACTIONS), RiseInsertion(image_model, FRACTIONS), CompletenessError()]


def evaluate(indices, batch_size):
    data, metrics = dataset(), new_metrics()
    indices = list(indices)
    for start in range(0, len(indices), batch_size):
        d = {k: v[indices[start:start + batch_size]] for k, v in data.items()}
        graphs = len(d["ids"])
        mask = torch.ones_like(d["ids"])
        special = torch.zeros_like(d["ids"], dtype=torch.bool)
        special[:, 0] = True
        metrics[0].update(d["images"], d["labels"], d["maps"])
        metrics[1].update(d["ids"], mask, d["relevance"], d["labels"], special)
        edges = torch.cat([RING + NODES * g for g in range(graphs)], dim=1)
        batch = torch.arange(graphs).repeat_interleave(NODES)
        metrics[2].update(d["x"].reshape(-1, 2), edges, batch, d["node_scores"].reshape(-1), d["labels"])
        metrics[3].update(d["images"], d["labels"], d["maps"])
        metrics[4].update(d["images"], d["labels"], d["maps"])
        metrics[5].update(d["maps"], d["scores"])
    return metrics




def test_sharded_and_reduced_equals_single_process_exactly(tmp_path):
    reduced_states = sharded_and_reduced_states(evaluate, N, tmp_path)
    single = evaluate(range(N), batch_size=3)  # other batch boundaries too
    assert_reduced_equals_single(single, reduced_states)
    assert all(metric.compute().count == N for metric in single)
