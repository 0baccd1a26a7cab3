"""Comprehensiveness, Sufficiency and GenerationFaithfulness sharded over 2 gloo processes and reduced with
all_reduce_metrics equal one process bit for bit."""
import torch
from distributed_runs import assert_reduced_equals_single, sharded_and_reduced_states

from captum_transformers.evaluation.tokens.aopc import Comprehensiveness, Sufficiency
from captum_transformers.evaluation.generation.faithfulness import GenerationFaithfulness

N, LENGTH, VOCAB, UNK, CLS = 11, 7, 20, 1, 2
EMBED = torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
LM_WEIGHT = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def classifier(batch):
    return (EMBED[batch["input_ids"]] * batch["attention_mask"][..., None]).sum(dim=1)


def causal_lm(batch):
    return (LM_WEIGHT[batch["input_ids"]] * batch["attention_mask"][..., None]).cumsum(dim=1)


def dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (N, LENGTH), generator=g)
    ids[:, 0] = CLS
    lengths = torch.randint(3, LENGTH + 1, (N,), generator=g)
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    relevance = torch.randn(N, LENGTH, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (N,), generator=g)
    outputs = [torch.randint(3, VOCAB, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
               for _ in range(N)]
    attrs = [torch.randn(len(o), int(n), generator=g, dtype=torch.float64) for o, n in zip(outputs, lengths)]
    return ids, mask, relevance, labels, outputs, attrs, lengths


def new_metrics():
    return [Comprehensiveness(classifier), Sufficiency(classifier, "replace", replacement_id=UNK),
            GenerationFaithfulness(causal_lm, replacement_id=UNK, score="log_prob", never_removed_ids=[CLS])]


def evaluate(indices, batch_size):
    ids, mask, relevance, labels, outputs, attrs, lengths = dataset()
    special = ids == CLS
    metrics, indices = new_metrics(), list(indices)
    for start in range(0, len(indices), batch_size):
        chosen = indices[start:start + batch_size]
        for metric in metrics[:2]:
            metric.update(ids[chosen], mask[chosen], relevance[chosen], labels[chosen], special[chosen])
        metrics[2].update_ids([ids[i, :lengths[i]].tolist() for i in chosen], [outputs[i] for i in chosen],
                              [attrs[i] for i in chosen])
    return metrics




def test_sharded_and_reduced_equals_single_process_exactly(tmp_path):
    reduced_states = sharded_and_reduced_states(evaluate, N, tmp_path)
    single = evaluate(range(N), batch_size=3)  # other batch boundaries too
    assert_reduced_equals_single(single, reduced_states)
