"""AUAC of ConservativeLRP (AH+LN) versus Gradient x Input on the movie-snippets test split.

The activation task of Ali et al. (ICML 2022, Sec. 5): start from the sentence with every
non-special token replaced by [UNK], reveal the original tokens from the most to the least
relevant, and record p(true class) at the revealed fractions 0, 0.1, ..., 1 (the first
``round(f * n)`` of the ``n`` real tokens); AUAC is the trapezoid area under the mean curve.
Higher is better. A random ordering is shown for reference.

    python benchmarks/movie_auac_check.py [--cache-dir DIR] [--limit N] [--threads T]

Measured on the saved 2-epoch model (test accuracy 0.872), all 1,007 test sentences, 1 thread,
705 CPU seconds: AH+LN 0.903, GI 0.729, random 0.687 (curves at 0, 0.1, ..., 1 revealed:
AH+LN 0.500 0.885 0.921 0.936 0.942 0.946 0.945 0.939 0.934 0.916 0.837;
GI    0.500 0.617 0.663 0.702 0.730 0.753 0.764 0.776 0.795 0.818 0.837).
"""
from __future__ import annotations

import argparse
import time

import torch

from captum_transformers import ConservativeLRP
from captum_transformers.tasks.movies.model import load_movie_model
from captum_transformers.tasks.movies.snippets import encode, load_movie_snippets

FRACTIONS = torch.linspace(0, 1, 11)


@torch.no_grad()
def activation_curve(model, batch, labels, scores, unk_id: int) -> torch.Tensor:
    """p(true class) after revealing the top ``round(f * n)`` tokens, per fraction: (F, B)."""
    candidate = (batch["attention_mask"] == 1) & (batch["special_tokens_mask"] == 0)
    order = scores.masked_fill(~candidate, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)                                 # 0 = most relevant
    n_real = candidate.sum(-1, keepdim=True)
    curve = []
    for fraction in FRACTIONS:
        revealed = rank < torch.round(fraction * n_real)
        ids = torch.where(candidate & ~revealed, torch.full_like(batch["input_ids"], unk_id), batch["input_ids"])
        probs = model(ids, attention_mask=batch["attention_mask"]).logits.softmax(-1)
        curve.append(probs.gather(1, labels[:, None])[:, 0])
    return torch.stack(curve)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_movie_model(args.cache_dir, train_if_missing=False)
    test = load_movie_snippets("test", cache_dir=args.cache_dir, limit=args.limit)
    methods = {"AH+LN": ConservativeLRP(model, variant="AH+LN"), "GI": ConservativeLRP(model, variant="GI"),
               "random": None}
    curves = {name: [] for name in methods}
    correct, started = 0, time.perf_counter()
    for start in range(0, len(test), args.batch_size):
        part = test[start:start + args.batch_size]
        batch = encode(part, tokenizer)
        with torch.no_grad():
            correct += (model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
                        == part.labels).sum().item()
        for name, method in methods.items():
            if method is None:
                scores = torch.rand(batch["input_ids"].shape)
            else:
                scores = method.attribute(batch["input_ids"], target=part.labels, return_tokens=True,
                                          forward_kwargs={"attention_mask": batch["attention_mask"]}).detach()
            curves[name].append(activation_curve(model, batch, part.labels, scores, tokenizer.unk_token_id))
    print(f"test sentences: {len(test)}, accuracy {correct / len(test):.4f}, {time.perf_counter() - started:.0f} s")
    for name, parts in curves.items():
        mean_curve = torch.cat(parts, dim=1).mean(1)
        auac = torch.trapezoid(mean_curve, FRACTIONS).item()
        print(f"{name:6s} AUAC {auac:.4f}  curve " + " ".join(f"{p:.3f}" for p in mean_curve.tolist()))


if __name__ == "__main__":
    main()
