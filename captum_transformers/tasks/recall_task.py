"""Associative recall: a synthetic generation task whose every answer token has known evidence.

A prompt lists ``n`` key-value pairs (``n`` from 4 to 8; distinct keys ``a``..``t``, distinct
values ``0``..``9``), then asks for the values of 1 to 4 distinct listed keys::

    <bos> c = 7 ; q = 2 ; h = 0 ; m = 5 ? h c :        ->   0 7 <eos>

Answer token ``i`` is ``value(query_i)``. Its evidence in the prompt is known exactly: the
value token of the queried pair (primary; the only prompt position that holds the answer
token, since values are distinct), the key token of that pair, and the query token itself.
A model that answers correctly must have read these positions (an induction-style lookup:
query -> matching key -> the value right after it, Olsson et al. 2022, "In-context Learning
and Induction Heads"), so attributions can be scored against them.

Splits are disjoint by construction: every prompt belongs to exactly one split, chosen by a
hash of its text (``split_of``); each split draws from its own seeded stream and keeps only
its own prompts.

Example::

    >>> example = recall_examples(1, seed=0, split="test")[0]
    >>> ids = example.prompt_ids
    >>> [ids[e.value] for e in example.evidence] == example.answer_ids[:-1]
    True
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Dict, List, Tuple

from ..errors import InputError

KEYS: Tuple[str, ...] = tuple("abcdefghijklmnopqrst")
VALUES: Tuple[str, ...] = tuple("0123456789")
PAIR_SEPARATOR, ASSIGN, QUERY_MARK, ANSWER_MARK = ";", "=", "?", ":"
BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIAL_TOKENS: Tuple[str, ...] = (PAD, BOS, EOS, UNK)
MIN_PAIRS, MAX_PAIRS = 4, 8
MIN_QUERIES, MAX_QUERIES = 1, 4
SPLITS: Tuple[str, ...] = ("train", "val", "test")
# Hash buckets of the prompt text (out of 100): test 0-9, val 10-14, train the rest.
_SPLIT_BUCKETS: Dict[str, range] = {"test": range(0, 10), "val": range(10, 15), "train": range(15, 100)}


def vocabulary() -> Dict[str, int]:
    """Token -> id: the special tokens first (``<pad>`` is 0), then separators, keys, values.

    Example::

        >>> vocabulary()["<pad>"], len(vocabulary())
        (0, 38)
    """
    tokens = SPECIAL_TOKENS + (PAIR_SEPARATOR, ASSIGN, QUERY_MARK, ANSWER_MARK) + KEYS + VALUES
    return {token: index for index, token in enumerate(tokens)}


@dataclass(frozen=True)
class RecallEvidence:
    """Prompt positions (indices into ``prompt_ids``, ``<bos>`` is 0) behind one answer token.

    ``value``: the queried pair's value token (the primary evidence, equal to the answer
    token); ``key``: that pair's key token; ``query``: the key's mention after ``?``.
    """

    value: int
    key: int
    query: int

    @property
    def positions(self) -> Tuple[int, int, int]:
        """``(value, key, query)``: primary evidence first."""
        return (self.value, self.key, self.query)


@dataclass(frozen=True)
class RecallExample:
    """One prompt, its answer and the evidence of each answer token.

    ``prompt`` is the text without ``<bos>``; ``prompt_ids`` starts with ``<bos>`` (what the
    tokenizer of :mod:`.recall_model` gives). ``answer`` is the values separated by spaces;
    ``answer_ids`` ends with ``<eos>``. ``evidence[i]`` belongs to ``answer_ids[i]``
    (no evidence for ``<eos>``).
    """

    prompt: str
    answer: str
    prompt_ids: List[int]
    answer_ids: List[int]
    evidence: List[RecallEvidence]
    pairs: List[Tuple[str, str]]
    queries: List[str]


def split_of(prompt: str) -> str:
    """The split that owns ``prompt``: a bucket of the SHA-256 of its text (test 10 %, val 5 %, train 85 %).

    Example::

        >>> split_of("a = 1 ; b = 2 ; c = 3 ; d = 4 ? a :") in SPLITS
        True
    """
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % 100
    return next(name for name, owned in _SPLIT_BUCKETS.items() if bucket in owned)


def make_example(pairs: List[Tuple[str, str]], queries: List[str]) -> RecallExample:
    """The example of ``pairs`` (key, value) queried at ``queries``, with token ids and evidence.

    Example::

        >>> make_example([("a", "1"), ("b", "2"), ("c", "3"), ("d", "4")], ["c", "a"]).answer
        '3 1'
    """
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys) or len({value for _, value in pairs}) != len(pairs):
        raise InputError(f"pairs must have distinct keys and distinct values, received {pairs!r}.")
    if not queries or len(set(queries)) != len(queries) or not set(queries) <= set(keys):
        raise InputError(f"queries must be distinct keys of the pairs {keys!r}, received {queries!r}.")
    tokens, key_position, value_position = [BOS], {}, {}
    for index, (key, value) in enumerate(pairs):
        if index:
            tokens.append(PAIR_SEPARATOR)
        key_position[key] = len(tokens)
        tokens += [key, ASSIGN]
        value_position[key] = len(tokens)
        tokens.append(value)
    tokens.append(QUERY_MARK)
    query_position = {}
    for query in queries:
        query_position[query] = len(tokens)
        tokens.append(query)
    tokens.append(ANSWER_MARK)
    values = dict(pairs)
    answer = [values[query] for query in queries]
    ids = vocabulary()
    return RecallExample(
        prompt=" ".join(tokens[1:]), answer=" ".join(answer),
        prompt_ids=[ids[token] for token in tokens], answer_ids=[ids[token] for token in answer] + [ids[EOS]],
        evidence=[RecallEvidence(value_position[q], key_position[q], query_position[q]) for q in queries],
        pairs=list(pairs), queries=list(queries))


def _draw(rng: random.Random, max_pairs: int, max_queries: int) -> RecallExample:
    n_pairs = rng.randint(MIN_PAIRS, max_pairs)
    keys = rng.sample(KEYS, n_pairs)
    values = rng.sample(VALUES, n_pairs)
    queries = rng.sample(keys, rng.randint(MIN_QUERIES, min(max_queries, n_pairs)))
    return make_example(list(zip(keys, values)), queries)


def recall_examples(n: int, seed: int = 0, split: str = "test", max_pairs: int = MAX_PAIRS,
                    max_queries: int = MAX_QUERIES) -> List[RecallExample]:
    """``n`` examples of ``split`` ("train", "val" or "test"), the same for the same ``seed``.

    Each split draws from its own stream (seeded by split name and ``seed``) and keeps only the
    prompts that :func:`split_of` assigns to it, so no prompt is in two splits. Prompts may
    repeat within a split (the space is large: repeats are rare). ``max_pairs`` and
    ``max_queries`` lower the upper bounds (a training curriculum); the defaults are the task.

    Example::

        >>> [e.prompt for e in recall_examples(2, seed=3)] == [e.prompt for e in recall_examples(2, seed=3)]
        True
    """
    if split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, received {split!r}.")
    if not isinstance(n, int) or n < 0:
        raise InputError(f"n must be a non-negative int, received {n!r}.")
    if not (MIN_PAIRS <= max_pairs <= MAX_PAIRS and MIN_QUERIES <= max_queries <= MAX_QUERIES):
        raise InputError(f"max_pairs must be in [{MIN_PAIRS}, {MAX_PAIRS}] and max_queries in [{MIN_QUERIES}, "
                         f"{MAX_QUERIES}], received {max_pairs!r} and {max_queries!r}.")
    rng = random.Random(f"recall:{split}:{seed}")  # str seeds hash deterministically (SHA-512)
    examples: List[RecallExample] = []
    while len(examples) < n:
        example = _draw(rng, max_pairs, max_queries)
        if split_of(example.prompt) == split:
            examples.append(example)
    return examples
