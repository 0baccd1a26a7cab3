"""Reproducible CPU training of the built-in recall Llama (the shipped ``assets/recall_llama.pt``).

Run::

    python -m captum_transformers.tasks.train_recall [--steps N] [--seed S] [--threads T] [--out PATH]

Recipe: every step draws a fresh batch of train-split prompts (:func:`.recall_task.recall_examples`,
seeded by the step; a curriculum, ``CURRICULUM``, first caps the pairs and queries and reaches
the full task after ``CURRICULUM_FRACTION`` of the steps), left padded as ``generate`` sees them, and minimises the next-token
cross-entropy on the answer tokens only (values and ``<eos>``; the prompt is context, not
target). AdamW with linear warm-up then cosine decay; deterministic algorithms, so the same
seed and thread count give the same weights on the same software. Every ``EVAL_EVERY`` steps
the teacher-forced answer accuracy on fixed val prompts is measured and the best weights are
kept. Those are rounded to float16 and *that* model answers the test prompts by greedy
``generate``; its accuracies go into the JSON record next to the weights.

Example::

    >>> from captum_transformers.tasks.train_recall import train
    >>> result = train(steps=2, evaluate_n=16)
    >>> sorted(result["test"])
    ['exact_answer', 'examples', 'tokens']
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..errors import InputError
from .recall_model import MODEL_CONFIG, RECORD_FILE, WEIGHTS_FILE, build_recall_model, recall_tokenizer
from .recall_task import MAX_PAIRS, MAX_QUERIES, RecallExample, recall_examples
from .shipped_weights import save_shipped

DEFAULT_STEPS = 6000
DEFAULT_SEED = 0
DEFAULT_THREADS = 1
BATCH_SIZE = 64
LEARNING_RATE = 2e-3
WEIGHT_DECAY = 0.01
WARMUP_FRACTION = 0.05
EVAL_EVERY = 250
VAL_N = 512
EVALUATE_N = 2000  # test prompts answered by generate for the record
# Fixed evaluation seeds: val and test prompts never move with the training seed.
VAL_SEED = 0
TEST_SEED = 0
# (max pairs, max queries) of each equal stage of the first CURRICULUM_FRACTION of the steps;
# on the full task from the start the model sat on the "any value of the prompt" plateau.
CURRICULUM = ((4, 1), (6, 2), (8, 3))
CURRICULUM_FRACTION = 0.3
IGNORE_INDEX = -100  # the label of prompt and padding positions (no loss)


def collate(examples: Sequence[RecallExample], pad_id: int) -> Dict[str, torch.Tensor]:
    """Left-padded ``prompt_ids + answer_ids`` with attention mask, position ids and answer-only labels.

    ``labels[t]`` is the token at ``t`` where it is an answer token and ``IGNORE_INDEX``
    elsewhere (the model shifts labels by one itself). Position ids count from ``<bos>``, as
    ``generate`` counts them on left-padded input.

    Example::

        >>> batch = collate(recall_examples(2, seed=1), pad_id=0)
        >>> (batch["labels"] != IGNORE_INDEX).sum(-1).tolist() == [len(e.answer_ids) for e in recall_examples(2, seed=1)]
        True
    """
    length = max(len(e.prompt_ids) + len(e.answer_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        sequence = example.prompt_ids + example.answer_ids
        start = length - len(sequence)
        ids[row, start:] = torch.tensor(sequence)
        mask[row, start:] = 1
        labels[row, length - len(example.answer_ids):] = torch.tensor(example.answer_ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


@torch.no_grad()
def teacher_forced_accuracy(model: torch.nn.Module, examples: Sequence[RecallExample], pad_id: int,
                            batch_size: int = 256) -> float:
    """Fraction of answer tokens (values and ``<eos>``) that are the arg-max next token given the true prefix."""
    correct = total = 0
    for first in range(0, len(examples), batch_size):
        batch = collate(examples[first:first + batch_size], pad_id)
        labels = batch.pop("labels")
        predicted = model(**batch).logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        scored = target != IGNORE_INDEX
        correct += (predicted[scored] == target[scored]).sum().item()
        total += scored.sum().item()
    return correct / max(1, total)


@torch.no_grad()
def generated_answers(model: torch.nn.Module, tokenizer, prompts: Sequence[str], batch_size: int = 256,
                      max_new_tokens: int = 5) -> List[List[int]]:
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
    """Linear warm-up over ``WARMUP_FRACTION`` of the steps, then cosine decay to zero."""
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step < warmup:
        return LEARNING_RATE * (step + 1) / warmup
    return LEARNING_RATE * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def curriculum_at(step: int, total: int) -> tuple:
    """``(max_pairs, max_queries)`` of the train prompts at ``step``: ``CURRICULUM`` stages, then the full task.

    Example::

        >>> curriculum_at(0, 100), curriculum_at(99, 100)
        ((4, 1), (8, 4))
    """
    stage = int(step / max(1.0, CURRICULUM_FRACTION * total) * len(CURRICULUM))
    return CURRICULUM[stage] if stage < len(CURRICULUM) else (MAX_PAIRS, MAX_QUERIES)


def _round_to_float16(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter rounded through float16: what the shipped file holds."""
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    return rounded.eval()


def train(steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED, evaluate_n: Optional[int] = None,
          log=None) -> Dict[str, Any]:
    """Train a recall Llama from scratch; returns the best-on-val model (float16-rounded) and its scores.

    Returns a dict with ``model`` (eval mode), ``losses`` (per step), ``best_step``,
    ``val`` (teacher-forced answer accuracy), ``test`` (:func:`generation_accuracy`) and
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
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model = build_recall_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
        losses, best, best_score, best_step = [], None, -1.0, 0
        start, cpu_start = time.perf_counter(), time.process_time()
        for step in range(steps):
            model.train()
            # Each step's prompts come from their own seeded stream: fresh data, reproducible.
            max_pairs, max_queries = curriculum_at(step, steps)
            batch = collate(recall_examples(BATCH_SIZE, seed=seed * 1_000_003 + step, split="train",
                                            max_pairs=max_pairs, max_queries=max_queries), pad_id)
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, steps)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
                model.eval()
                score = teacher_forced_accuracy(model, val_examples, pad_id)
                if log is not None:
                    recent = losses[-EVAL_EVERY:]
                    log(f"step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f} val answer-token "
                        f"accuracy {score:.4f} ({time.perf_counter() - start:.0f} s)")
                if score > best_score:
                    best, best_score, best_step = copy.deepcopy(model.state_dict()), score, step + 1
        train_seconds, train_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        model.load_state_dict(best)
        shipped = _round_to_float16(model)
        test = generation_accuracy(shipped, tokenizer, recall_examples(evaluate_n, seed=TEST_SEED, split="test"))
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return {"model": shipped, "losses": losses, "best_step": best_step, "val": best_score, "test": test,
            "train_seconds": train_seconds, "train_cpu_seconds": train_cpu_seconds}


def save(result: Dict[str, Any], out: Path, command: str, steps: int, seed: int) -> Path:
    """Write the float16 state dict to ``out`` and its JSON record beside it (same stem, ``.json``)."""
    import tokenizers
    import transformers
    record = {
        "test_token_accuracy": round(result["test"]["tokens"], 4),
        "test_exact_answer_accuracy": round(result["test"]["exact_answer"], 4),
        "test_examples": result["test"]["examples"], "test_seed": TEST_SEED,
        "test_scoring": "greedy generate, batched and left padded; token = value tokens at their place "
                        "(eos excluded), exact answer = all values then eos",
        "val_teacher_forced_answer_accuracy": round(result["val"], 4), "val_examples": VAL_N, "val_seed": VAL_SEED,
        "best_step": result["best_step"], "steps": steps, "batch_size": BATCH_SIZE, "learning_rate": LEARNING_RATE,
        "curriculum": {"stages_max_pairs_queries": CURRICULUM, "fraction_of_steps": CURRICULUM_FRACTION},
        "seed": seed, "train_seconds": round(result["train_seconds"], 1),
        "train_cpu_seconds": round(result["train_cpu_seconds"], 1), "threads": torch.get_num_threads(),
        "command": command, "model_config": MODEL_CONFIG, "storage": "float16 state dict, loaded as float32",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    return save_shipped({k: v.half() for k, v in result["model"].state_dict().items()}, out, record)


def main(argv=None) -> int:
    default_out = Path(__file__).resolve().parent.parent / "assets" / WEIGHTS_FILE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=default_out,
                        help=f"weights path (default: {default_out}); the record goes beside it with suffix "
                             f".json ({RECORD_FILE} for the default)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help="CPU threads (the same seed and thread count give the same weights)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python -m captum_transformers.tasks.train_recall " + " ".join(
        f"--{name} {getattr(args, name)}" for name in ("steps", "seed", "threads"))
    result = train(args.steps, args.seed, log=lambda line: print(line, flush=True))
    path = save(result, args.out, command, args.steps, args.seed)
    print(f"test token accuracy {result['test']['tokens']:.4f}, exact answers {result['test']['exact_answer']:.4f} "
          f"({result['test']['examples']} prompts), best step {result['best_step']}, "
          f"{result['train_seconds']:.0f} s -> {path} ({os.path.getsize(path) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
