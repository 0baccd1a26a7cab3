"""How far the relevance sum is from the explained logit on the shipped fine-tuned MiniLM.

Conservation (``sum_t R_t = f_target(x)``) holds exactly for ConservativeLRP AH+LN only on a
model without biases whose nonlinearities are homogeneous of degree one (ReLU); the shipped
movie model (``captum_transformers.tasks.movies.model``, all-MiniLM-L6-v2 fine-tuned) has
biases everywhere, GELU MLPs and a tanh pooler. This script measures, on the first ``--limit``
test sentences (default 64), for the explained class = the model's predicted class and = 1
("positive"):

* the fraction of sentences whose relevance sum has the sign of the explained logit,
* the median and worst ``|sum - logit|`` (logit of the model's own forward, no rules) and
  ``|convergence delta|`` (``sum - logit`` of the explained forward, as the method returns it),
* the median ``|logit|`` for scale,

for ConservativeLRP AH+LN (Ali et al.'s rules, the default), AH+LN with
``activation_rule="identity"`` (relevance passes GELU and tanh unchanged) and AttnLRP.
Prints a markdown table (docs/relevance-rules.md, "Conservation on the shipped text model").

    python benchmarks/conservation_movie.py [--cache-dir DIR] [--limit 64] [--threads 1] [--zero-biases]

``--zero-biases`` measures the same architecture and weights with every bias set to zero (a
different model, with other logits): where AH+LN with ``activation_rule="identity"`` must
conserve exactly (to float32 rounding), it shows that the gap on the shipped model is the
biases' share.

Needs the fine-tuned model in the cache (``python -m captum_transformers.tasks.movies.model``);
it does not train one.
"""
from __future__ import annotations

import argparse
import time

import torch

from captum_transformers import AttnLRP, ConservativeLRP
from captum_transformers.tasks.movies.model import load_movie_model
from captum_transformers.tasks.movies.snippets import encode, load_movie_snippets


def methods(model) -> dict:
    return {"ConservativeLRP AH+LN (default)": ConservativeLRP(model, variant="AH+LN"),
            "ConservativeLRP AH+LN, activation_rule=\"identity\"": ConservativeLRP(
                model, variant="AH+LN", activation_rule="identity"),
            "AttnLRP": AttnLRP(model)}


def measure(model, batches, target_of) -> dict:
    """Per method: relevance sums, convergence deltas and the eager logits, over all batches."""
    sums, deltas, logits = {}, {}, []
    explainers = methods(model)
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            out = model(ids, attention_mask=mask).logits
        target = target_of(out)
        logits.append(out.gather(1, target[:, None])[:, 0])
        for name, method in explainers.items():
            relevance, delta = method.attribute(ids, target=target, return_tokens=True,
                                                return_convergence_delta=True,
                                                forward_kwargs={"attention_mask": mask})
            sums.setdefault(name, []).append(relevance.detach().sum(-1))
            deltas.setdefault(name, []).append(delta.detach().reshape(-1))
    logits = torch.cat(logits).double()
    return {name: (torch.cat(sums[name]).double(), torch.cat(deltas[name]).double(), logits) for name in sums}


def _number(value) -> str:
    """Three decimals, or two significant digits for what rounds to 0 there (float32 rounding)."""
    value = float(value)
    return f"{value:.3f}" if value >= 5e-4 or value == 0 else f"{value:.1e}"


def rows(results: dict, target_label: str) -> list[str]:
    lines = []
    for name, (sums, deltas, logits) in results.items():
        same_sign = (torch.sign(sums) == torch.sign(logits)).double().mean().item()
        gap, delta = (sums - logits).abs(), deltas.abs()
        numbers = " | ".join(_number(v) for v in (gap.median(), gap.max(), delta.median(), delta.max(),
                                                   logits.abs().median()))
        lines.append(f"| {target_label} | {name} | {same_sign:.0%} | {numbers} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--zero-biases", action="store_true", help="every bias set to 0 (not the shipped model)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_movie_model(args.cache_dir, train_if_missing=False)
    if args.zero_biases:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.rsplit(".", 1)[-1] == "bias":
                    parameter.zero_()
    test = load_movie_snippets("test", cache_dir=args.cache_dir, limit=args.limit)
    batches = [encode(test[start:start + args.batch_size], tokenizer)
               for start in range(0, len(test), args.batch_size)]
    started = time.perf_counter()
    table = ["| explained class | method | sum has the logit's sign | median \\|sum - logit\\| | "
             "worst \\|sum - logit\\| | median \\|delta\\| | worst \\|delta\\| | median \\|logit\\| |",
             "|---|---|---|---|---|---|---|---|"]
    table += rows(measure(model, batches, lambda out: out.argmax(-1)), "predicted")
    table += rows(measure(model, batches, lambda out: torch.ones(len(out), dtype=torch.long)), "1 (positive)")
    what = "every bias set to 0 (not the shipped model)" if args.zero_biases else "as shipped"
    print(f"{len(test)} test sentences, float32 model {what}, {time.perf_counter() - started:.0f} s\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
