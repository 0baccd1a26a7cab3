"""Reproducible CPU training of the built-in recall Llama (the shipped ``assets/recall_llama.pt``).

Run::

    python -m captum_transformers.tasks.recall.train [--steps N] [--seed S] [--threads T] [--out PATH]

Recipe: every step draws a fresh batch of train-split prompts (:func:`.recall_task.recall_examples`,
seeded by the step), each followed by its answer and then ``EXTRA_QUERIES`` more of its keys
asked and answered (:func:`answered_sequence`: more copy targets per forward pass), left padded
as ``generate`` sees them (position ids follow the mask), and minimises the next-token
cross-entropy on the answer tokens only (value words and the final ``<eos>``; the prompt is
context, not target). AdamW with ``WARMUP_STEPS`` of linear warm-up then cosine
decay over ``--steps``; deterministic algorithms, so the same seed and thread count give the
same weights on the same software. Every ``EVAL_EVERY`` steps the teacher-forced accuracy of
the value words on fixed val prompts is measured; the best weights are kept, and training
stops early once it reaches ``TARGET_VAL_ACCURACY``. Those weights are rounded to float16 and
*that* model answers the test prompts by greedy ``generate``; its accuracies go into the JSON
record next to the weights.

Example::

    >>> from captum_transformers.tasks.recall.train import train
    >>> result = train(steps=2, evaluate_n=16)
    >>> sorted(result["test"])
    ['exact_answer', 'examples', 'tokens']
"""
from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...errors import InputError
from .model import MAX_NEW_TOKENS, MODEL_CONFIG, RECORD_FILE, WEIGHTS_FILE, build_recall_model, recall_tokenizer
from .task import EOS, QUERY_MARK, RecallExample, recall_examples, vocabulary
from ..shipped_weights import save_shipped
from ..training_command import parse_training_command
from ..training_loop import deterministic_algorithms, round_to_float16, train_keeping_best

DEFAULT_STEPS = 3000
DEFAULT_SEED = 0
DEFAULT_THREADS = 1
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.0
WARMUP_STEPS = 200
EVAL_EVERY = 250
TARGET_VAL_ACCURACY = 0.99  # stop once the val value words are this accurate
EXTRA_QUERIES = 10  # keys asked (with replacement) after the first answer of each training row (answered_sequence)
VAL_N = 512
EVALUATE_N = 2000  # test prompts answered by generate for the record
# Fixed evaluation seeds: val and test prompts never move with the training seed.
VAL_SEED = 0
TEST_SEED = 0
IGNORE_INDEX = -100  # the label of prompt and padding positions (no loss)


def answered_sequence(example: RecallExample, extra_queries: Sequence[str] = ()) -> Tuple[List[int], List[int]]:
    """``(ids, labels)`` of the prompt and its answer, then ``? key words <eos>`` for each of
    ``extra_queries``.

    ``labels`` hold every answer's words and its ``<eos>``, ``IGNORE_INDEX`` elsewhere (the model
    shifts labels by one itself). Up to the first answer the row is exactly what the model sees
    when asked (causal attention cannot look ahead); the extra queries add copy targets to the
    same prompt (with one answer per row the 2-layer model sat on the "any value word of the
    prompt" plateau, val accuracy ~0.17, for thousands of steps), and a key asked again is a
    plain copy of its earlier answer, which forms the induction circuit. Every answer ends with
    ``<eos>``, so that is what the model learns to write after an answer.

    Example::

        >>> example = recall_examples(1, seed=1)[0]
        >>> ids, labels = answered_sequence(example)
        >>> ids == example.prompt_ids + example.answer_ids
        True
    """
    vocab = vocabulary()
    values = dict(example.pairs)
    unknown = [key for key in extra_queries if key not in values]
    if unknown:
        raise InputError(f"extra_queries must be keys of the example's pairs {sorted(values)!r}, "
                         f"received {list(extra_queries)!r}.")
    ids = list(example.prompt_ids) + list(example.answer_ids)
    labels = [IGNORE_INDEX] * len(example.prompt_ids) + list(example.answer_ids)
    for key in extra_queries:
        words = [vocab[word] for word in values[key]] + [vocab[EOS]]
        ids += [vocab[QUERY_MARK], vocab[key]] + words
        labels += [IGNORE_INDEX] * 2 + words
    return ids, labels


def collate(examples: Sequence[RecallExample], pad_id: int,
            extra_queries: Optional[Sequence[Sequence[str]]] = None) -> Dict[str, torch.Tensor]:
    """Left-padded :func:`answered_sequence` rows with attention mask, position ids and answer-only labels.

    ``extra_queries[row]`` (default: none) are the keys asked after the first answer of that
    row. Position ids count from ``<bos>``, as ``generate`` counts them on left-padded input.

    Example::

        >>> batch = collate(recall_examples(2, seed=1), pad_id=0)
        >>> (batch["labels"] != IGNORE_INDEX).sum(-1).tolist() == [len(e.answer_ids) for e in recall_examples(2, seed=1)]
        True
    """
    rows = [answered_sequence(example, extra_queries[row] if extra_queries else ())
            for row, example in enumerate(examples)]
    length = max(len(row_ids) for row_ids, _ in rows)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (row_ids, row_labels) in enumerate(rows):
        start = length - len(row_ids)
        ids[row, start:] = torch.tensor(row_ids)
        labels[row, start:] = torch.tensor(row_labels)
        mask[row, start:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


@torch.no_grad()
def teacher_forced_accuracy(model: torch.nn.Module, examples: Sequence[RecallExample], pad_id: int,
                            batch_size: int = 256) -> float:
    """Fraction of value words (answer tokens but ``<eos>``) that are the arg-max next token given the true prefix."""
    correct = total = 0
    for first in range(0, len(examples), batch_size):
        batch = collate(examples[first:first + batch_size], pad_id)
        labels = batch.pop("labels")
        predicted = model(**batch).logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        scored = (target != IGNORE_INDEX) & (target != model.generation_config.eos_token_id)
        correct += (predicted[scored] == target[scored]).sum().item()
        total += scored.sum().item()
    return correct / max(1, total)


@torch.no_grad()
def generated_answers(model: torch.nn.Module, tokenizer, prompts: Sequence[str], batch_size: int = 256,
                      max_new_tokens: int = MAX_NEW_TOKENS) -> List[List[int]]:
    """The greedy continuation ids of each prompt (through its first ``<eos>``), batched and left padded."""
    answers: List[List[int]] = []
    for first in range(0, len(prompts), batch_size):
        batch = tokenizer(list(prompts[first:first + batch_size]), return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
        for row in out[:, batch["input_ids"].shape[1]:].tolist():
            answers.append(row[:row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return answers


def generation_accuracy(model: torch.nn.Module, tokenizer, examples: Sequence[RecallExample]) -> Dict[str, Any]:
    """Greedy ``generate`` scored against the answers.

    ``tokens``: fraction of value tokens (answer tokens with evidence, not ``<eos>``) generated
    at their place; ``exact_answer``: fraction of prompts whose continuation is exactly
    ``answer_ids`` (values, then ``<eos>``, nothing else).

    Example::

        >>> generation_accuracy(model, recall_tokenizer(), recall_examples(8))["examples"]
        8
    """
    answers = generated_answers(model, tokenizer, [e.prompt for e in examples])
    tokens = sum(sum(1 for i, t in enumerate(e.answer_ids[:-1]) if i < len(got) and got[i] == t)
                 for e, got in zip(examples, answers))
    total = sum(len(e.answer_ids) - 1 for e in examples)
    exact = sum(got == e.answer_ids for e, got in zip(examples, answers))
    return {"tokens": tokens / max(1, total), "exact_answer": exact / max(1, len(examples)), "examples": len(examples)}


def _learning_rate(step: int, total: int) -> float:
    """Linear warm-up over ``WARMUP_STEPS`` (at most a tenth of the steps), then cosine decay to zero."""
    warmup = max(1, min(WARMUP_STEPS, total // 10))
    if step < warmup:
        return LEARNING_RATE * (step + 1) / warmup
    return LEARNING_RATE * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train(steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED, evaluate_n: Optional[int] = None,
          log=None) -> Dict[str, Any]:
    """Train a recall Llama from scratch; returns the best-on-val model (float16-rounded) and its scores.

    Returns a dict with ``model`` (eval mode), ``losses`` (per step run), ``best_step``,
    ``steps_run`` (fewer than ``steps`` when val reached ``TARGET_VAL_ACCURACY``), ``val``
    (teacher-forced value-word accuracy), ``test`` (:func:`generation_accuracy`),
    ``train_seconds`` (wall clock) and ``train_cpu_seconds`` (this process's CPU time: the
    machine may be shared).
    """
    evaluate_n = EVALUATE_N if evaluate_n is None else evaluate_n
    if not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive int, received {steps!r}.")
    tokenizer = recall_tokenizer()
    pad_id = tokenizer.pad_token_id
    val_examples = recall_examples(min(VAL_N, evaluate_n), seed=VAL_SEED, split="val")
    torch.manual_seed(seed)

    def batch_at(step: int) -> Dict[str, torch.Tensor]:
        # Each step's prompts come from their own seeded stream: fresh data, reproducible.
        examples = recall_examples(BATCH_SIZE, seed=seed * 1_000_003 + step, split="train")
        asked = random.Random(f"extra:{seed}:{step}")
        # Keys asked again with replacement: a key asked twice is a plain copy of its earlier
        # answer, which forms the induction circuit the first answer needs (without repeats the
        # model sat on the "any value word" plateau; with them, val 0.99 in ~500 steps).
        extra = [[asked.choice([key for key, _ in e.pairs]) for _ in range(EXTRA_QUERIES)] for e in examples]
        return collate(examples, pad_id, extra)

    with deterministic_algorithms():
        model = build_recall_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
        run = train_keeping_best(model, optimizer, steps, batch_at,
                                 learning_rate=lambda step, group: _learning_rate(step, steps),
                                 validate=lambda trained: teacher_forced_accuracy(trained, val_examples, pad_id),
                                 eval_every=EVAL_EVERY, target=TARGET_VAL_ACCURACY, log=log,
                                 score_name="val value-word accuracy")
        shipped = round_to_float16(model)
        test = generation_accuracy(shipped, tokenizer, recall_examples(evaluate_n, seed=TEST_SEED, split="test"))
    return {"model": shipped, **run, "test": test}


def save(result: Dict[str, Any], out: Path, command: str, steps: int, seed: int) -> Path:
    """Write the float16 state dict to ``out`` and its JSON record beside it (same stem, ``.json``)."""
    import tokenizers
    import transformers
    record = {
        "test_token_accuracy": round(result["test"]["tokens"], 4),
        "test_exact_answer_accuracy": round(result["test"]["exact_answer"], 4),
        "test_examples": result["test"]["examples"], "test_seed": TEST_SEED,
        "test_scoring": "greedy generate, batched and left padded; token = value words at their place "
                        "(eos excluded), exact answer = both value words then eos",
        "val_teacher_forced_value_word_accuracy": round(result["val"], 4), "val_examples": VAL_N,
        "val_seed": VAL_SEED, "target_val_accuracy": TARGET_VAL_ACCURACY, "best_step": result["best_step"],
        "steps_run": result["steps_run"], "steps": steps, "batch_size": BATCH_SIZE, "learning_rate": LEARNING_RATE,
        "warmup_steps": WARMUP_STEPS, "weight_decay": WEIGHT_DECAY,
        "seed": seed, "train_seconds": round(result["train_seconds"], 1),
        "train_cpu_seconds": round(result["train_cpu_seconds"], 1), "threads": torch.get_num_threads(),
        "command": command, "model_config": MODEL_CONFIG, "storage": "float16 state dict, loaded as float32",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    return save_shipped({k: v.half() for k, v in result["model"].state_dict().items()}, out, record)


def main(argv=None) -> int:
    args, command = parse_training_command("recall.train", __doc__.split("\n\n")[0], WEIGHTS_FILE, RECORD_FILE,
                                           DEFAULT_STEPS, DEFAULT_SEED, DEFAULT_THREADS, argv)
    result = train(args.steps, args.seed, log=lambda line: print(line, flush=True))
    path = save(result, args.out, command, args.steps, args.seed)
    print(f"test token accuracy {result['test']['tokens']:.4f}, exact answers {result['test']['exact_answer']:.4f} "
          f"({result['test']['examples']} prompts), best step {result['best_step']} of {result['steps_run']} run, "
          f"{result['train_seconds']:.0f} s -> {path} ({os.path.getsize(path) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
