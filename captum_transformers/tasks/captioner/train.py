"""Reproducible CPU training of the built-in digit captioner (the shipped ``assets/digit_captioner.pt``).

Run::

    python -m captum_transformers.tasks.captioner.train [--steps N] [--seed S] [--threads T] [--out PATH]

Recipe: the vision tower starts from the shipped DigitCanvas ViT
(:func:`.digit_captioner.vision_tower_from_digit_vit`), the projector and the Llama decoder from
random weights. Every step draws fresh two-digit train canvases (:func:`.digit_canvas.digit_canvases`,
seeded by the step), appends the reading-order answer ``d1 d2 <eos>`` to the prompt and
minimises the next-token cross-entropy on those three tokens only. AdamW with a lower learning
rate for the pretrained tower, linear warm-up then cosine decay; deterministic algorithms, so
the same seed and thread count give the same weights on the same software. Every
``EVAL_EVERY`` steps the teacher-forced digit accuracy on fixed val canvases is measured; the
best weights are kept, and training stops early once it reaches ``TARGET_VAL_ACCURACY``. Those
weights are rounded to float16 and *that* model captions the test canvases by greedy
``generate``; its accuracies go into the JSON record next to the weights.

Example::

    >>> from captum_transformers.tasks.captioner.train import train
    >>> result = train(steps=2, evaluate_n=16)
    >>> sorted(result["test"])
    ['canvases', 'digit_accuracy', 'exact_caption']
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ...errors import InputError
from ..digits.canvas import DigitCanvasSet, digit_canvases
from .model import (LLAVA_CONFIG, PRE_NORM_GAIN, RECORD_FILE, TEXT_CONFIG, VISION_CONFIG, WEIGHTS_FILE,
                              answer_ids, build_digit_captioner, caption_accuracy, caption_inputs, caption_targets,
                              captioner_tokenizer, vision_tower_from_digit_vit)
from ..digits.model import load_digit_model
from ..shipped_weights import save_shipped
from ..training_command import parse_training_command
from ..training_loop import deterministic_algorithms, round_to_float16, train_keeping_best

DEFAULT_STEPS = 5000
DEFAULT_SEED = 0
DEFAULT_THREADS = 1
BATCH_SIZE = 64
LEARNING_RATE = 2e-3  # projector and decoder (random init)
TOWER_LEARNING_RATE = 5e-4  # the vision tower starts trained: smaller steps keep what it knows
WEIGHT_DECAY = 0.01
WARMUP_STEPS = 100
EVAL_EVERY = 250
TARGET_VAL_ACCURACY = 0.97  # stop once the val digits are this accurate (teacher forced)
VAL_N = 512
EVALUATE_N = 2000  # test canvases captioned by generate for the record
# Fixed canvas seeds: val and test never move with the training seed.
VAL_SEED = 0
TEST_SEED = 0
IGNORE_INDEX = -100


def training_batch(tokenizer, data: DigitCanvasSet) -> Dict[str, torch.Tensor]:
    """Prompt + answer ids, attention mask, ``pixel_values`` and labels on the three answer tokens only.

    Example::

        >>> batch = training_batch(captioner_tokenizer(), digit_canvases("train", "two", n=2))
        >>> (batch["labels"] != IGNORE_INDEX).sum().item()
        6
    """
    labels, _ = caption_targets(data)
    inputs = caption_inputs(tokenizer, data.images)
    answers = answer_ids(labels)
    ids = torch.cat([inputs["input_ids"], answers], dim=1)
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, -answers.shape[1]:] = answers
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": inputs["pixel_values"],
            "labels": targets}


@torch.no_grad()
def teacher_forced_accuracy(model: torch.nn.Module, tokenizer, data: DigitCanvasSet, batch_size: int = 256) -> float:
    """Fraction of the digits (not ``<eos>``) that are the arg-max next token given the true prefix."""
    correct = total = 0
    for part in data.batches(batch_size):
        batch = training_batch(tokenizer, part)
        labels = batch.pop("labels")
        predicted = model(**batch).logits[:, -4:-2].argmax(-1)  # the positions that predict d1 and d2
        correct += (predicted == labels[:, -3:-1]).sum().item()
        total += labels[:, -3:-1].numel()
    return correct / max(1, total)


def _learning_rate(step: int, total: int) -> float:
    """Multiplier: linear warm-up over ``WARMUP_STEPS`` (at most a tenth of the steps), then cosine decay to zero."""
    warmup = max(1, min(WARMUP_STEPS, total // 10))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train(steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED, evaluate_n: Optional[int] = None,
          log=None) -> Dict[str, Any]:
    """Fine-tune a captioner; returns the best-on-val model (float16-rounded) and its scores.

    Returns a dict with ``model`` (eval mode), ``losses``, ``best_step``, ``steps_run`` (fewer
    than ``steps`` when val reached ``TARGET_VAL_ACCURACY``), ``val`` (teacher-forced digit
    accuracy), ``test`` (:func:`.digit_captioner.caption_accuracy`), ``train_seconds`` (wall
    clock) and ``train_cpu_seconds`` (this process's CPU time: the machine may be shared).
    """
    evaluate_n = EVALUATE_N if evaluate_n is None else evaluate_n
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InputError(f"steps must be a positive int, received {steps!r}.")
    tokenizer = captioner_tokenizer()
    val = digit_canvases("val", "two", n=min(VAL_N, evaluate_n), seed=VAL_SEED)
    torch.manual_seed(seed)
    with deterministic_algorithms():
        model = build_digit_captioner()
        vision_tower_from_digit_vit(model, load_digit_model())
        tower = [p for name, p in model.named_parameters() if ".vision_tower." in f".{name}"]
        rest = [p for name, p in model.named_parameters() if ".vision_tower." not in f".{name}"]
        optimizer = torch.optim.AdamW([{"params": tower, "base_lr": TOWER_LEARNING_RATE},
                                       {"params": rest, "base_lr": LEARNING_RATE}], lr=LEARNING_RATE,
                                      weight_decay=WEIGHT_DECAY)
        # Each step's canvases come from their own seeded stream: fresh data, reproducible.
        run = train_keeping_best(
            model, optimizer, steps,
            batch_at=lambda step: training_batch(tokenizer, digit_canvases("train", "two", n=BATCH_SIZE,
                                                                           seed=seed * 1_000_003 + step)),
            learning_rate=lambda step, group: group["base_lr"] * _learning_rate(step, steps),
            validate=lambda trained: teacher_forced_accuracy(trained, tokenizer, val),
            eval_every=EVAL_EVERY, target=TARGET_VAL_ACCURACY, log=log, score_name="val digit accuracy")
        shipped = round_to_float16(model)
        test = caption_accuracy(shipped, tokenizer, digit_canvases("test", "two", n=evaluate_n, seed=TEST_SEED))
    return {"model": shipped, **run, "test": test}


def save(result: Dict[str, Any], out: Path, command: str, steps: int, seed: int) -> Path:
    """Write the float16 state dict to ``out`` and its JSON record beside it (same stem, ``.json``)."""
    import tokenizers
    import transformers
    record = {
        "test_digit_accuracy": round(result["test"]["digit_accuracy"], 4),
        "test_exact_caption_accuracy": round(result["test"]["exact_caption"], 4),
        "test_canvases": result["test"]["canvases"], "test_canvas_seed": TEST_SEED, "test_split": "test",
        "test_scoring": "greedy generate on two-digit canvases; digit = each of the two digits at its place in "
                        "reading order (left to right, top to bottom when stacked), exact caption = both digits "
                        "then eos; the train / val / test splits are disjoint samples of sklearn load_digits "
                        "(60 / 20 / 20 %, seed 0), not disjoint writers (load_digits carries no writer ids, so a "
                        "test digit's writer may also have written training digits)",
        "val_teacher_forced_digit_accuracy": round(result["val"], 4), "val_canvases": VAL_N, "val_seed": VAL_SEED,
        "target_val_accuracy": TARGET_VAL_ACCURACY, "best_step": result["best_step"],
        "steps_run": result["steps_run"], "steps": steps, "batch_size": BATCH_SIZE,
        "learning_rate": LEARNING_RATE, "tower_learning_rate": TOWER_LEARNING_RATE, "warmup_steps": WARMUP_STEPS,
        "weight_decay": WEIGHT_DECAY, "seed": seed, "train_seconds": round(result["train_seconds"], 1),
        "train_cpu_seconds": round(result["train_cpu_seconds"], 1), "threads": torch.get_num_threads(),
        "command": command, "vision_init": "assets/digit_vit.pt (pre-norm gain %.2f)" % PRE_NORM_GAIN,
        "model_config": {"vision": VISION_CONFIG, "text": TEXT_CONFIG, "llava": LLAVA_CONFIG},
        "storage": "float16 state dict, loaded as float32",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    }
    return save_shipped({k: v.half() if v.is_floating_point() else v
                         for k, v in result["model"].state_dict().items()}, out, record)


def main(argv=None) -> int:
    args, command = parse_training_command("captioner.train", __doc__.split("\n\n")[0], WEIGHTS_FILE, RECORD_FILE,
                                           DEFAULT_STEPS, DEFAULT_SEED, DEFAULT_THREADS, argv)
    result = train(args.steps, args.seed, log=lambda line: print(line, file=sys.stderr, flush=True))
    path = save(result, args.out, command, args.steps, args.seed)
    print(f"test digit accuracy {result['test']['digit_accuracy']:.4f}, exact captions "
          f"{result['test']['exact_caption']:.4f} ({result['test']['canvases']} canvases), best step "
          f"{result['best_step']} of {result['steps_run']} run, {result['train_seconds']:.0f} s -> {path} "
          f"({os.path.getsize(path) / 1024:.0f} KiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
