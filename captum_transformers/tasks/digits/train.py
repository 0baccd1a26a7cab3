"""Reproducible training of the built-in DigitCanvas ViT (the shipped ``assets/digit_vit.pt``).

Run::

    python -m captum_transformers.tasks.digits.train [--out PATH] [--epochs N] [--seed S] [--model vit|swin]

(``--model swin``: the DigitCanvas Swin of :mod:`.swin`, shipped as ``assets/digit_swin.pt``.)

Recipe: every epoch draws *fresh* train canvases (half one-digit, half two-digit, new
layouts, textures and colours from the train source digits only; this is the augmentation;
the texture and distractors fade in over the first ``CLUTTER_RAMP_EPOCHS`` epochs),
and the model learns them as label distributions: cross-entropy of the softmax against the
one-hot (one digit) or half-half two-hot (two digits) target, so on a two-digit canvas both
classes become the top-2 logits.
AdamW with linear warm-up then cosine decay; one thread and deterministic algorithms, so
the same seed gives the same weights on the same software. After each epoch the model is
scored on fixed validation canvases (mean of one-digit top-1 and two-digit top-2 set
accuracy) and the best epoch is kept. The kept weights are rounded to float16, reloaded, and
*that* model is scored on test canvases; the numbers, seed, time and command go to the JSON
record next to the weights.

Example::

    >>> from captum_transformers.tasks.digits.train import train
    >>> result = train(epochs=1, canvases_per_epoch=256, max_steps=2, evaluate_n=64)
    >>> sorted(result)[:3]
    ['best_epoch', 'losses', 'model']
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from ...errors import InputError
from .canvas import DigitCanvasSet, digit_canvases, normalize
from . import swin as digit_swin
from .model import MODEL_CONFIG, RECORD_FILE, WEIGHTS_FILE, build_digit_model
from ..shipped_weights import save_shipped

# --model: (builder, weights file, configuration recorded).
ARCHITECTURES = {"vit": (build_digit_model, WEIGHTS_FILE, MODEL_CONFIG),
                 "swin": (digit_swin.build_digit_swin, digit_swin.WEIGHTS_FILE, digit_swin.MODEL_CONFIG)}

DEFAULT_EPOCHS = 200  # the shipped model (assets/digit_vit.json); 80 epochs reached 0.874 / 38 %
DEFAULT_SEED = 0
CANVASES_PER_EPOCH = 4096
BATCH_SIZE = 64
LEARNING_RATE = 2e-3
# Curriculum: the clutter (texture and distractors) fades in linearly over the first epochs;
# on full canvases from the start the ViT sat at chance for hundreds of steps.
CLUTTER_RAMP_EPOCHS = 20
WEIGHT_DECAY = 0.05
WARMUP_FRACTION = 0.05
EVALUATE_N = 2000  # canvases per variant for the test scores
VAL_N = 1000  # canvases per variant scored after every epoch
# Fixed canvas seeds: validation and test never move with the training seed.
VAL_SEED = 0
TEST_SEED = 0


def multi_hot(labels: torch.Tensor, num_classes: int = 10) -> torch.Tensor:
    """Float targets (N, C): one-hot for labels (N,), two-hot for labels (N, 2).

    Example::

        >>> multi_hot(torch.tensor([[1, 3]]), 4)
        tensor([[0., 1., 0., 1.]])
    """
    labels = labels.reshape(len(labels), -1)
    return torch.zeros(len(labels), num_classes).scatter_(1, labels, 1.0)


def soft_target_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``-sum_c q_c log softmax(z)_c`` with ``q = targets / targets.sum()`` per row.

    Example::

        >>> soft_target_cross_entropy(torch.zeros(1, 4), torch.tensor([[1., 0., 1., 0.]]))
        tensor(1.3863)
    """
    q = targets / targets.sum(dim=1, keepdim=True)
    return -(q * logits.log_softmax(dim=-1)).sum(dim=1).mean()


@torch.no_grad()
def logits_of(model: torch.nn.Module, data: DigitCanvasSet, batch_size: int = 512) -> torch.Tensor:
    """The model's logits (N, 10) on ``normalize(data.images)``, batch by batch."""
    return torch.cat([model(normalize(batch.images)) for batch in data.batches(batch_size)])


def top1_accuracy(model: torch.nn.Module, data: DigitCanvasSet) -> float:
    """Fraction of one-digit canvases whose arg-max logit is the label."""
    return (logits_of(model, data).argmax(-1) == data.labels).float().mean().item()


def top2_set_accuracy(model: torch.nn.Module, data: DigitCanvasSet) -> float:
    """Fraction of two-digit canvases whose two largest logits are exactly the two labels (any order)."""
    top2 = logits_of(model, data).topk(2, dim=-1).indices.sort(-1).values
    return (top2 == data.labels.sort(-1).values).all(-1).float().mean().item()


def _learning_rate(step: int, total: int) -> float:
    """Linear warm-up over ``WARMUP_FRACTION`` of the steps, then cosine decay to zero."""
    warmup = max(1, int(WARMUP_FRACTION * total))
    if step < warmup:
        return LEARNING_RATE * (step + 1) / warmup
    return LEARNING_RATE * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                  targets: torch.Tensor, learning_rate: float) -> float:
    """One optimiser step on ``soft_target_cross_entropy(model(inputs), targets)``; returns the loss before it."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    loss = soft_target_cross_entropy(model(inputs), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def clutter_at(epoch: int) -> float:
    """The curriculum: clutter ``min(1, epoch / CLUTTER_RAMP_EPOCHS)`` of the canvases of ``epoch`` (from 0)."""
    return min(1.0, epoch / CLUTTER_RAMP_EPOCHS)


def _epoch_data(seed: int, epoch: int, count: int) -> tuple:
    """Fresh train canvases of one epoch (at the curriculum's clutter): inputs and multi-hot targets, shuffled."""
    clutter = clutter_at(epoch)
    one = digit_canvases("train", "one", n=count // 2, seed=seed * 10_000 + epoch, clutter=clutter)
    two = digit_canvases("train", "two", n=count - count // 2, seed=seed * 10_000 + epoch, clutter=clutter)
    inputs = normalize(torch.cat([one.images, two.images]))
    targets = torch.cat([multi_hot(one.labels), multi_hot(two.labels)])
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed * 10_000 + epoch))
    return inputs[order], targets[order]


def _round_to_float16(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter rounded through float16: what the shipped file holds."""
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
    return rounded.eval()


def _scores(model: torch.nn.Module, split: str, seed: int, n: int) -> Dict[str, float]:
    return {"top1_one": top1_accuracy(model, digit_canvases(split, "one", n=n, seed=seed)),
            "top2_two": top2_set_accuracy(model, digit_canvases(split, "two", n=n, seed=seed))}


def train(epochs: int = DEFAULT_EPOCHS, seed: int = DEFAULT_SEED, canvases_per_epoch: Optional[int] = None,
          max_steps: Optional[int] = None, evaluate_n: Optional[int] = None, log=None,
          architecture: str = "vit") -> Dict[str, Any]:
    """Train a DigitCanvas ViT from scratch; returns the best-on-val model (float16-rounded) and its record.

    Returns a dict with ``model`` (eval mode), ``losses`` (per step), ``best_epoch``,
    ``val`` and ``test`` scores (``top1_one``, ``top2_two``) and ``train_seconds``.
    ``max_steps`` stops early (for smoke tests); ``canvases_per_epoch`` and ``evaluate_n``
    default to ``CANVASES_PER_EPOCH`` and ``EVALUATE_N``.
    """
    canvases_per_epoch = CANVASES_PER_EPOCH if canvases_per_epoch is None else canvases_per_epoch
    evaluate_n = EVALUATE_N if evaluate_n is None else evaluate_n
    if not isinstance(epochs, int) or epochs < 1:
        raise InputError(f"epochs must be a positive int, received {epochs!r}.")
    torch.manual_seed(seed)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model = ARCHITECTURES[architecture][0]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
        steps_per_epoch = math.ceil(canvases_per_epoch / BATCH_SIZE)
        total = epochs * steps_per_epoch if max_steps is None else min(max_steps, epochs * steps_per_epoch)
        losses, step, best, best_score, best_epoch, val = [], 0, None, -1.0, -1, {}
        start = time.perf_counter()
        for epoch in range(epochs):
            inputs, targets = _epoch_data(seed, epoch, canvases_per_epoch)
            model.train()
            for first in range(0, len(inputs), BATCH_SIZE):
                if step >= total:
                    break
                losses.append(training_step(model, optimizer, inputs[first:first + BATCH_SIZE],
                                            targets[first:first + BATCH_SIZE], _learning_rate(step, total)))
                step += 1
            model.eval()
            scores = _scores(model, "val", VAL_SEED, min(VAL_N, evaluate_n))
            score = (scores["top1_one"] + scores["top2_two"]) / 2
            if log is not None:
                log(f"epoch {epoch + 1}/{epochs} step {step} loss {sum(losses[-steps_per_epoch:]) / max(1, len(losses[-steps_per_epoch:])):.4f} "
                    f"val top1 {scores['top1_one']:.4f} top2 {scores['top2_two']:.4f} "
                    f"({time.perf_counter() - start:.0f} s)")
            if score > best_score:
                best, best_score, best_epoch, val = copy.deepcopy(model.state_dict()), score, epoch + 1, scores
            if step >= total:
                break
        train_seconds = time.perf_counter() - start
        model.load_state_dict(best)
        shipped = _round_to_float16(model)
        test = _scores(shipped, "test", TEST_SEED, evaluate_n)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    return {"model": shipped, "losses": losses, "best_epoch": best_epoch, "val": val, "test": test,
            "train_seconds": train_seconds, "evaluate_n": evaluate_n}


def save(result: Dict[str, Any], out: Path, command: str, epochs: int, seed: int,
         model_config: Optional[Dict[str, Any]] = None) -> Path:
    """Write the float16 state dict to ``out`` and its JSON record beside it (same stem, ``.json``)."""
    import timm
    record = {
        "test_top1_one_digit": round(result["test"]["top1_one"], 4),
        "test_top2_set_two_digit": round(result["test"]["top2_two"], 4),
        "test_canvases_per_variant": result["evaluate_n"], "test_canvas_seed": TEST_SEED,
        "val_top1_one_digit": round(result["val"]["top1_one"], 4),
        "val_top2_set_two_digit": round(result["val"]["top2_two"], 4),
        "best_epoch": result["best_epoch"], "epochs": epochs, "seed": seed,
        "train_seconds": round(result["train_seconds"], 1), "threads": torch.get_num_threads(),
        "command": command, "model_config": MODEL_CONFIG if model_config is None else model_config, "storage": "float16 state dict, loaded as float32",
        "versions": {"torch": torch.__version__, "timm": timm.__version__},
    }
    return save_shipped({k: v.half() for k, v in result["model"].state_dict().items()}, out, record)


def main(argv=None) -> int:
    default_out = Path(__file__).resolve().parents[2] / "assets" / WEIGHTS_FILE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"weights path (default: {default_out}, or "
                        f"{digit_swin.WEIGHTS_FILE} beside it for --model swin); the record goes beside it with "
                        f"suffix .json ({RECORD_FILE} for the default)")
    parser.add_argument("--model", choices=sorted(ARCHITECTURES), default="vit")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (the same seed and thread count give the same weights)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, weights_file, model_config = ARCHITECTURES[args.model]
    out = args.out if args.out is not None else default_out.with_name(weights_file)
    command = "python -m captum_transformers.tasks.digits.train " + " ".join(
        f"--{name} {getattr(args, name)}" for name in ("epochs", "seed", "threads"))
    if args.model != "vit":
        command += f" --model {args.model}"
    result = train(args.epochs, args.seed, log=lambda line: print(line, flush=True), architecture=args.model)
    path = save(result, out, command, args.epochs, args.seed, model_config)
    print(f"test top-1 (one digit) {result['test']['top1_one']:.4f}, top-2 set (two digits) "
          f"{result['test']['top2_two']:.4f}, best epoch {result['best_epoch']}, "
          f"{result['train_seconds']:.0f} s -> {path} ({os.path.getsize(path) / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
