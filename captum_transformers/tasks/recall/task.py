"""Associative recall: a synthetic generation task whose every answer token has known evidence.

A prompt lists ``n`` key-value pairs (``n`` from 4 to 8): distinct single-letter keys
``a``..``t``, each bound to two words drawn from one pool of colours and animals, every word used
at most once per prompt. It ends by repeating one listed key::

    <bos> c red fox ; q blue owl ; h green cat ; m pink bee ? h   ->   green cat <eos>

Every answer token is a copy (an induction step, Olsson et al. 2022, "In-context Learning and
Induction Heads"): the prompt ends with the key ``h``, which appeared earlier followed by
``green``; and ``green`` appeared earlier followed by ``cat``. The evidence of answer token
``i`` is known exactly: the prompt position of that same word (primary; the only position that
holds it, since words are distinct within a prompt), the key token of its pair, and the query
key token. A model that answers correctly must have read these positions, so attributions can
be scored against them.

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

from ...errors import InputError

KEYS: Tuple[str, ...] = tuple("abcdefghijklmnopqrst")
COLOURS: Tuple[str, ...] = ("red", "blue", "green", "pink", "gold", "gray", "teal", "plum", "navy", "jade",
                            "rose", "lime", "tan", "rust", "sand", "mint", "ruby", "cyan", "ivory", "coral")
ANIMALS: Tuple[str, ...] = ("fox", "owl", "cat", "bee", "cow", "dog", "elk", "yak", "ant", "bat",
                            "eel", "hen", "pig", "ram", "emu", "crab", "deer", "frog", "goat", "wolf")
VALUE_WORDS: Tuple[str, ...] = COLOURS + ANIMALS
PAIR_SEPARATOR, QUERY_MARK = ";", "?"
BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
SPECIAL_TOKENS: Tuple[str, ...] = (PAD, BOS, EOS, UNK)
MIN_PAIRS, MAX_PAIRS = 4, 8
VALUE_LENGTH = 2  # words per value, from one pool: a fixed colour-then-animal order let the model
# settle on "some colour of the prompt" and never learn the lookup (0.17 after 1000 steps; 1.0 after 250 without it)
SPLITS: Tuple[str, ...] = ("train", "val", "test")
# Hash buckets of the prompt text (out of 100): test 0-9, val 10-14, train the rest.
_SPLIT_BUCKETS: Dict[str, range] = {"test": range(0, 10), "val": range(10, 15), "train": range(15, 100)}


def vocabulary() -> Dict[str, int]:
    """Token -> id: the special tokens first (``<pad>`` is 0), then separators, keys, colours, animals.

    Example::

        >>> vocabulary()["<pad>"], len(vocabulary())
        (0, 66)
    """
    tokens = SPECIAL_TOKENS + (PAIR_SEPARATOR, QUERY_MARK) + KEYS + VALUE_WORDS
    return {token: index for index, token in enumerate(tokens)}


@dataclass(frozen=True)
class RecallEvidence:
    """Prompt positions (indices into ``prompt_ids``, ``<bos>`` is 0) behind one answer token.

    ``value``: the same word inside the queried pair's value (the primary evidence, equal to
    the answer token: the token an induction head copies); ``key``: that pair's key token;
    ``query``: the key's repetition after ``?``.
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

    ``prompt`` is the text without ``<bos>`` (it ends with ``? key``); ``prompt_ids`` starts
    with ``<bos>`` (what the tokenizer of :mod:`.model` gives). ``answer`` is the queried
    value's words separated by spaces; ``answer_ids`` ends with ``<eos>``. ``evidence[i]``
    belongs to ``answer_ids[i]`` (no evidence for ``<eos>``). ``pairs`` are ``(key, value
    words)``; ``query`` is the asked key.
    """

    prompt: str
    answer: str
    prompt_ids: List[int]
    answer_ids: List[int]
    evidence: List[RecallEvidence]
    pairs: List[Tuple[str, Tuple[str, ...]]]
    query: str


def split_of(prompt: str) -> str:
    """The split that owns ``prompt``: a bucket of the SHA-256 of its text (test 10 %, val 5 %, train 85 %).

    Example::

        >>> split_of("a red fox ; b blue owl ; c tan cat ; d gold bee ? a") in SPLITS
        True
    """
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % 100
    return next(name for name, owned in _SPLIT_BUCKETS.items() if bucket in owned)


def make_example(pairs: List[Tuple[str, Tuple[str, ...]]], query: str) -> RecallExample:
    """The example of ``pairs`` (key, value words) asked for ``query``, with token ids and evidence.

    Example::

        >>> pairs = [("a", ("red", "fox")), ("b", ("blue", "owl")), ("c", ("tan", "cat")), ("d", ("gold", "bee"))]
        >>> example = make_example(pairs, "c")
        >>> example.prompt, example.answer
        ('a red fox ; b blue owl ; c tan cat ; d gold bee ? c', 'tan cat')
        >>> example.evidence[0]
        RecallEvidence(value=10, key=9, query=17)
    """
    keys = [key for key, _ in pairs]
    words = [word for _, value in pairs for word in value]
    if len(set(keys)) != len(keys) or len(set(words)) != len(words):
        raise InputError(f"pairs must have distinct keys and distinct value words, received {pairs!r}.")
    unknown = sorted(set(keys) - set(KEYS)) + sorted(set(words) - set(VALUE_WORDS))
    if unknown or any(not value for _, value in pairs):
        raise InputError(f"keys must be letters a..t and values non-empty tuples of the task's value words "
                         f"(recall_task.VALUE_WORDS); received {pairs!r} (unknown: {unknown!r}).")
    if query not in keys:
        raise InputError(f"query must be a key of the pairs {keys!r}, received {query!r}.")
    tokens, key_position, value_positions = [BOS], {}, {}
    for index, (key, value) in enumerate(pairs):
        if index:
            tokens.append(PAIR_SEPARATOR)
        key_position[key] = len(tokens)
        tokens.append(key)
        value_positions[key] = list(range(len(tokens), len(tokens) + len(value)))
        tokens += list(value)
    tokens += [QUERY_MARK, query]
    query_position = len(tokens) - 1
    answer = list(dict(pairs)[query])
    ids = vocabulary()
    return RecallExample(
        prompt=" ".join(tokens[1:]), answer=" ".join(answer),
        prompt_ids=[ids[token] for token in tokens], answer_ids=[ids[token] for token in answer] + [ids[EOS]],
        evidence=[RecallEvidence(position, key_position[query], query_position)
                  for position in value_positions[query]],
        pairs=[(key, tuple(value)) for key, value in pairs], query=query)


def _draw(rng: random.Random) -> RecallExample:
    n_pairs = rng.randint(MIN_PAIRS, MAX_PAIRS)
    keys = rng.sample(KEYS, n_pairs)
    words = rng.sample(VALUE_WORDS, VALUE_LENGTH * n_pairs)
    values = [tuple(words[i:i + VALUE_LENGTH]) for i in range(0, len(words), VALUE_LENGTH)]
    return make_example(list(zip(keys, values)), rng.choice(keys))


def recall_examples(n: int, seed: int = 0, split: str = "test") -> List[RecallExample]:
    """``n`` examples of ``split`` ("train", "val" or "test"), the same for the same ``seed``.

    Each split draws from its own stream (seeded by split name and ``seed``) and keeps only the
    prompts that :func:`split_of` assigns to it, so no prompt is in two splits. Prompts may
    repeat within a split (the space is large: repeats are rare).

    Example::

        >>> [e.prompt for e in recall_examples(2, seed=3)] == [e.prompt for e in recall_examples(2, seed=3)]
        True
    """
    if split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, received {split!r}.")
    if not isinstance(n, int) or n < 0:
        raise InputError(f"n must be a non-negative int, received {n!r}.")
    rng = random.Random(f"recall:{split}:{seed}")  # str seeds hash deterministically (SHA-512)
    examples: List[RecallExample] = []
    while len(examples) < n:
        example = _draw(rng)
        if split_of(example.prompt) == split:
            examples.append(example)
    return examples
