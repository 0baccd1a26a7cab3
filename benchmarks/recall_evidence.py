"""Does each method point at the evidence of the recall model's answers? Top-1 hit rates.

On ``--n`` test prompts of the built-in recall task (each answer word is a copy of exactly one
prompt word, ``RecallExample.evidence``), every method explains the two answer words of each
prompt (``GenerationAttribution``, the answers given as targets, one batched call per method),
and counts how often a row's most relevant prompt token is the copied word itself (``value``),
its pair's key (``key``) or the query key at the end of the prompt (``query``). A random map
scores about 1 / 18.

Run::

    python benchmarks/recall_evidence.py --n 64

Measured (2026-11-26, CPU, ``--n 64``), hits out of 64 for the first / second answer word::

    method                   value      key      query
    conservative-lrp         64, 64     0, 0     0, 0
    attn-lrp                 32, 58     32, 0    0, 0
    generic-attention        1, 0       11, 0    34, 0
    transformer-relevance    0, 0       0, 0     64, 0
    grad-cam                 0, 0       1, 1     7, 0
    rollout                  0, 0       0, 0     47, 0

The AH+LN rule holds the attention weights constant, so relevance flows through the copied
value; the attention maps follow the query-key match instead.
"""
from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

from captum_transformers.generation import GenerationAttribution
from captum_transformers.methods.catalog import METHOD_FACTORIES
from captum_transformers.tasks.recall.model import load_recall_model
from captum_transformers.tasks.recall.task import recall_examples

METHODS = ("conservative-lrp", "attn-lrp", "generic-attention", "transformer-relevance", "grad-cam", "rollout")


def evidence_hits(n: int, methods=METHODS) -> Dict[str, Tuple[List[int], List[int], List[int]]]:
    """Per method, the hits of the value, the key and the query, each [word 1, word 2]."""
    model, tokenizer = load_recall_model()
    examples = recall_examples(n, seed=3, split="test")
    table = {}
    for name in methods:
        results = GenerationAttribution(METHOD_FACTORIES[name](model), tokenizer).attribute(
            [e.prompt for e in examples], target=[e.answer_ids for e in examples])
        value, key, query = [0, 0], [0, 0], [0, 0]
        for result, example in zip(results, examples):
            for step, evidence in enumerate(example.evidence):
                top = int(result.token_attr[step].argmax())
                value[step] += top == evidence.value
                key[step] += top == evidence.key
                query[step] += top == evidence.query
        table[name] = (value, key, query)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="test prompts")
    args = parser.parse_args(argv)
    print(f"{'method':24s} {'value':10s} {'key':8s} query   (hits of {args.n}: first, second answer word)")
    for name, (value, key, query) in evidence_hits(args.n).items():
        print(f"{name:24s} {value[0]}, {value[1]:<6d} {key[0]}, {key[1]:<4d} {query[0]}, {query[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
