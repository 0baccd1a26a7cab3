"""Movie snippets: ~10k Rotten Tomatoes sentences rated by humans, as a sentiment task.

The sentences and their ratings are the ``movieReviewSnippets_GroundTruth.txt`` file of
Hutto & Gilbert (ICWSM 2014), which ships only inside the vaderSentiment 3.3.2 *source*
distribution on PyPI (``additional_resources/hutto_ICWSM_2014.tar.gz``). Each line is
``id <TAB> mean rating <TAB> sentence`` (UTF-8, CRLF), the rating being the mean of about
20 human ratings on a -4 (very negative) .. +4 (very positive) scale.

The task (what :func:`load_movie_snippets` returns):

* sentences with ``|rating| >= 0.5`` (:data:`MIN_ABS_RATING`) are kept, 10,072 of 10,605;
* ``label = 1 if rating > 0 else 0``;
* a fixed 80/10/10 train/val/test split: ids ordered by a salted BLAKE2 hash
  (:data:`SPLIT_SALT`), so the split is the same on every machine and Python version;
* **silver** rationales, not human ones: a word is marked when its lowercase form is in
  the VADER lexicon (the ``vader_lexicon.txt`` of the same sdist) with
  ``|mean valence| >= 1.0`` (:data:`SILVER_VALENCE_THRESHOLD`, valences span -4 .. 4).

Words are the matches of :data:`WORD_PATTERN`: runs of letters/digits joined by inner
apostrophes (``don't``, ``Jackson's``); punctuation and whitespace separate words and are
not words. :func:`encode` maps every word piece of a HuggingFace fast tokenizer to the
word containing its first character (``word_ids``; -1 for special tokens, padding and
punctuation), so a metric can max-pool piece scores per word.

The sdist is fetched with ``python -m pip download`` when the data are first needed and
the two extracted files are cached under ``$CAPTUM_TRANSFORMERS_CACHE`` (default
``~/.cache/captum_transformers``) in ``vader-3.3.2/``.

Example::

    >>> test = load_movie_snippets("test")
    >>> len(test), test.texts[0][:30], bool(test.labels[0]), test.words[0][:3]
    >>> batch = encode(test[:8], tokenizer)          # input_ids, attention_mask, ..., word_ids
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from ...errors import InputError

VADER_REQUIREMENT = "vaderSentiment==3.3.2"
SDIST_NAME = "vaderSentiment-3.3.2.tar.gz"
# Paths inside the sdist (outer tar) and inside its nested ICWSM archive.
_SDIST_LEXICON = "vaderSentiment-3.3.2/vaderSentiment/vader_lexicon.txt"
_SDIST_ICWSM_ARCHIVE = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_ICWSM_SNIPPETS = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"

SNIPPETS_FILE = "movieReviewSnippets_GroundTruth.txt"
LEXICON_FILE = "vader_lexicon.txt"
CACHE_SUBDIR = "vader-3.3.2"
CACHE_ENV = "CAPTUM_TRANSFORMERS_CACHE"

MIN_ABS_RATING = 0.5
SILVER_VALENCE_THRESHOLD = 1.0
SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
SPLIT_SALT = "captum-transformers/movie-snippets/v1"
WORD_PATTERN = re.compile(r"\w+(?:['\u2019]\w+)*")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``$CAPTUM_TRANSFORMERS_CACHE``, else
    ``~/.cache/captum_transformers``.

    Example::

        >>> cache_root("/tmp/c")
        PosixPath('/tmp/c')
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "captum_transformers"


def pip_download_command(dest: str | os.PathLike) -> list[str]:
    """The pip command that fetches the vaderSentiment 3.3.2 sdist into ``dest``.

    ``--no-binary :all:`` because the wheel lacks ``additional_resources/``.

    Example::

        >>> " ".join(pip_download_command("/tmp/d")[1:])
        '-m pip download --no-deps --no-binary :all: vaderSentiment==3.3.2 -d /tmp/d'
    """
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            VADER_REQUIREMENT, "-d", str(dest)]


def download_vader_sdist(dest: str | os.PathLike) -> Path:
    """Run :func:`pip_download_command` and return the path of the downloaded sdist.

    Raises :class:`InputError` naming the command when pip fails (no index reachable).

    Example::

        >>> download_vader_sdist("/tmp/d")
        PosixPath('/tmp/d/vaderSentiment-3.3.2.tar.gz')
    """
    command = pip_download_command(dest)
    shown = "python " + " ".join(command[1:])
    done = subprocess.run(command, capture_output=True, text=True)
    sdist = Path(dest) / SDIST_NAME
    if done.returncode != 0 or not sdist.is_file():
        last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        raise InputError(
            f"could not download the movie-snippets data: `{shown}` exited with code {done.returncode} "
            f"({last}). The sentences ship only inside the vaderSentiment 3.3.2 source distribution, "
            f"which this command fetches from a PyPI index. Fix: run `python -m pip download --no-deps "
            f"--no-binary :all: {VADER_REQUIREMENT} -d DIR` on a machine that reaches PyPI and pass "
            f"the file: load_movie_snippets(..., sdist='DIR/{SDIST_NAME}').")
    return sdist


def extract_vader_files(sdist: str | os.PathLike, dest: str | os.PathLike) -> tuple[Path, Path]:
    """Copy the snippets file and the VADER lexicon out of the sdist into ``dest``.

    Only those two members are read (the nested ICWSM archive is opened in memory), and
    each file is written under a temporary name then renamed, so a cache is never half
    written. Returns ``(snippets_path, lexicon_path)``.

    Example::

        >>> extract_vader_files("vaderSentiment-3.3.2.tar.gz", "/tmp/cache/vader-3.3.2")
    """
    sdist = Path(sdist)
    if not sdist.is_file():
        raise InputError(f"sdist={str(sdist)!r} is not a file; expected the path of {SDIST_NAME} "
                         f"(get it with `python -m pip download --no-deps --no-binary :all: "
                         f"{VADER_REQUIREMENT} -d DIR`).")
    try:
        with tarfile.open(sdist, "r:gz") as outer:
            lexicon = outer.extractfile(_SDIST_LEXICON).read()
            icwsm = outer.extractfile(_SDIST_ICWSM_ARCHIVE).read()
        with tarfile.open(fileobj=io.BytesIO(icwsm), mode="r:gz") as inner:
            snippets = inner.extractfile(_ICWSM_SNIPPETS).read()
    except (tarfile.TarError, KeyError, AttributeError, OSError) as error:
        raise InputError(f"sdist={str(sdist)!r} is not the vaderSentiment 3.3.2 source distribution "
                         f"({type(error).__name__}: {error}); expected {SDIST_NAME} containing "
                         f"{_SDIST_LEXICON} and {_SDIST_ICWSM_ARCHIVE}. Fix: download it again with "
                         f"`python -m pip download --no-deps --no-binary :all: {VADER_REQUIREMENT} -d DIR`.")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = dest / SNIPPETS_FILE, dest / LEXICON_FILE
    for path, data in zip(paths, (snippets, lexicon)):
        partial = path.with_name(path.name + f".{os.getpid()}.partial")
        partial.write_bytes(data)
        partial.replace(path)
    return paths


def vader_files(cache_dir: str | os.PathLike | None = None,
                sdist: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """The cached ``(snippets_path, lexicon_path)``, extracted from ``sdist`` or from a
    freshly pip-downloaded sdist the first time.

    Example::

        >>> snippets, lexicon = vader_files()
    """
    dest = cache_root(cache_dir) / CACHE_SUBDIR
    paths = dest / SNIPPETS_FILE, dest / LEXICON_FILE
    if all(path.is_file() for path in paths):
        return paths
    if sdist is not None:
        return extract_vader_files(sdist, dest)
    with tempfile.TemporaryDirectory(prefix="vader-sdist-") as download_dir:
        return extract_vader_files(download_vader_sdist(download_dir), dest)


def parse_snippets(text: str) -> list[tuple[int, float, str]]:
    """Parse the ground-truth file: one ``id <TAB> mean rating <TAB> sentence`` per line.

    Example::

        >>> parse_snippets("1\\t2.5\\tGreat fun.\\r\\n2\\t-0.2\\tMeh.\\r\\n")
        [(1, 2.5, 'Great fun.'), (2, -0.2, 'Meh.')]
    """
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split("\t", 2)
        if len(fields) != 3:
            raise InputError(f"line {number} of the movie snippets file has {len(fields)} tab-separated "
                             f"field(s): {line[:80]!r}; expected 'id<TAB>rating<TAB>sentence'. Fix: delete "
                             f"the cached {SNIPPETS_FILE} so that it is extracted again.")
        rows.append((int(fields[0]), float(fields[1]), fields[2].strip()))
    return rows


def parse_lexicon(text: str) -> dict[str, float]:
    """Parse ``vader_lexicon.txt``: ``token <TAB> mean valence <TAB> std <TAB> ratings``.

    Example::

        >>> parse_lexicon("good\\t1.9\\t0.9\\t[2, 2]\\nbad\\t-2.5\\t0.7\\t[-2, -3]\\n")
        {'good': 1.9, 'bad': -2.5}
    """
    lexicon = {}
    for line in text.splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and fields[0]:
            lexicon[fields[0]] = float(fields[1])
    return lexicon


def split_words(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """Words of a sentence (matches of :data:`WORD_PATTERN`) and their character spans.

    Example::

        >>> split_words("It's ''great'' fun!")
        (["It's", 'great', 'fun'], [(0, 4), (7, 12), (15, 18)])
    """
    matches = list(WORD_PATTERN.finditer(text))
    return [m.group() for m in matches], [m.span() for m in matches]


def silver_rationale(words: list[str], lexicon: dict[str, float],
                     threshold: float = SILVER_VALENCE_THRESHOLD) -> list[bool]:
    """Silver (lexicon-derived, not human) rationale of one sentence:
    ``r_w = |valence(lower(w))| >= threshold`` for words in the lexicon, else False.

    Example::

        >>> silver_rationale(["A", "GOOD", "okay", "film"], {"good": 1.9, "okay": 0.9})
        [False, True, False, False]
    """
    return [abs(lexicon.get(word.lower(), 0.0)) >= threshold for word in words]


def _hashed_rank(snippet_id: int, salt: str = SPLIT_SALT) -> bytes:
    return hashlib.blake2b(f"{salt}:{snippet_id}".encode(), digest_size=16).digest()


def split_of_ids(ids: list[int], salt: str = SPLIT_SALT) -> dict[int, str]:
    """Assign each id to ``train``/``val``/``test`` (80/10/10 of ``len(ids)``).

    Ids are ordered by ``blake2b(f"{salt}:{id}")``: a seeded permutation that does not
    depend on the machine, the Python version or the order of ``ids``.

    Example::

        >>> sorted(collections.Counter(split_of_ids(list(range(100))).values()).items())
        [('test', 10), ('train', 80), ('val', 10)]
    """
    ordered = sorted(ids, key=lambda i: _hashed_rank(i, salt))
    n_train = round(SPLIT_FRACTIONS[0] * len(ordered))
    n_val = round(SPLIT_FRACTIONS[1] * len(ordered))
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, len(ordered))}
    return {i: name for name, (lo, hi) in bounds.items() for i in ordered[lo:hi]}


@dataclass(frozen=True)
class MovieSnippets:
    """One split of the movie-snippets task (see the module docstring).

    ``rationales`` are **silver**: VADER-lexicon words, not human annotations.
    Indexing with a slice (or a list of positions) returns a ``MovieSnippets``; with an int,
    a dict of that example's fields.

    Example::

        >>> snippets[:4].labels
        tensor([1, 1, 0, 1])
    """

    # Shown next to any score computed against the rationales: they are not human annotations.
    rationale_kind: ClassVar[str] = (f"silver: VADER-lexicon words with |valence| >= {SILVER_VALENCE_THRESHOLD}, "
                                     f"not human rationales")

    ids: list[int]
    texts: list[str]
    labels: torch.Tensor  # LongTensor (N,): 1 positive, 0 negative
    ratings: torch.Tensor  # float64 (N,): mean human rating in [-4, 4]
    words: list[list[str]]
    rationales: list[list[bool]]  # silver, one bool per word

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index):
        if isinstance(index, int):
            return {"id": self.ids[index], "text": self.texts[index], "label": int(self.labels[index]),
                    "rating": float(self.ratings[index]), "words": self.words[index],
                    "rationale": self.rationales[index]}
        positions = range(len(self))[index] if isinstance(index, slice) else list(index)
        rows = torch.as_tensor(list(positions), dtype=torch.long)
        return MovieSnippets(ids=[self.ids[i] for i in positions], texts=[self.texts[i] for i in positions],
                             labels=self.labels[rows], ratings=self.ratings[rows],
                             words=[self.words[i] for i in positions],
                             rationales=[self.rationales[i] for i in positions])


def build_movie_snippets(snippets_text: str, lexicon_text: str, split: str = "test",
                         limit: int | None = None) -> MovieSnippets:
    """The task built from the texts of the two data files (no I/O; see the module docstring).

    Example::

        >>> build_movie_snippets("1\\t2.5\\tGreat fun.\\n", "great\\t3.1\\t0.7\\t[3]\\n", "train").words
        [['Great', 'fun']]
    """
    if split not in SPLITS:
        raise InputError(f"split={split!r} is not a split of the movie snippets; expected one of {SPLITS}.")
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise InputError(f"limit={limit!r}; expected None or a non-negative int (`limit` examples of the "
                         f"split, a seeded sample of both classes).")
    rows = [row for row in parse_snippets(snippets_text) if abs(row[1]) >= MIN_ABS_RATING]
    split_of = split_of_ids([row[0] for row in rows])
    rows = [row for row in rows if split_of[row[0]] == split]
    if limit is not None and limit < len(rows):
        # The data file lists the positive snippets first, so its first 100 test rows are 96 %
        # positive: take the first `limit` rows of the split's hashed order instead (a seeded
        # sample of both classes), kept in file order.
        chosen = set(sorted((row[0] for row in rows), key=_hashed_rank)[:limit])
        rows = [row for row in rows if row[0] in chosen]
    lexicon = parse_lexicon(lexicon_text)
    words = [split_words(text)[0] for _, _, text in rows]
    ratings = torch.tensor([rating for _, rating, _ in rows], dtype=torch.float64)
    return MovieSnippets(ids=[row[0] for row in rows], texts=[row[2] for row in rows],
                         labels=(ratings > 0).long(), ratings=ratings, words=words,
                         rationales=[silver_rationale(w, lexicon) for w in words])


def load_movie_snippets(split: str = "test", cache_dir: str | os.PathLike | None = None,
                        sdist: str | os.PathLike | None = None, limit: int | None = None) -> MovieSnippets:
    """Load one split of the movie-snippets task, fetching and caching the data if needed.

    Args:
        split: ``"train"`` (8,058 sentences), ``"val"`` (1,007) or ``"test"`` (1,007).
        cache_dir: where the extracted files live (default: :func:`cache_root`).
        sdist: path of a pre-downloaded ``vaderSentiment-3.3.2.tar.gz`` (for machines
            without a PyPI index); else pip downloads it when the cache is empty.
        limit: keep ``limit`` examples of the split: the first ``limit`` of its seeded hashed
            order (the data file lists positive snippets first, so a prefix would be one class).

    Example::

        >>> test = load_movie_snippets("test", limit=100)
        >>> len(test), test.labels.float().mean()
    """
    if split not in SPLITS:
        raise InputError(f"split={split!r} is not a split of the movie snippets; expected one of {SPLITS}.")
    snippets_path, lexicon_path = vader_files(cache_dir, sdist)
    return build_movie_snippets(snippets_path.read_text(encoding="utf-8"),
                                lexicon_path.read_text(encoding="utf-8"), split, limit)


def _texts_and_words(snippets) -> tuple[list[str], list[list[tuple[int, int]]]]:
    texts = snippets.texts if isinstance(snippets, MovieSnippets) else snippets
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise InputError(f"encode() received {type(snippets).__name__}; expected MovieSnippets or a list "
                         f"of str. Fix: pass load_movie_snippets(...) or a slice of it.")
    return list(texts), [split_words(text)[1] for text in texts]


def encode(snippets, tokenizer, max_length: int = 64) -> dict[str, torch.Tensor]:
    """Tokenize sentences for a BERT-like model, with the piece -> word map.

    Sequences are truncated to ``max_length`` and padded to the longest in the batch.
    ``word_ids[b, t]`` is the index (into ``snippets.words[b]``) of the word containing
    the first character of piece ``t``, or -1 for special tokens, padding and punctuation
    pieces, from the fast tokenizer's character offsets. Word scores for a metric:
    ``max_{t : word_ids[b, t] = w} score[b, t]``.

    Returns a dict of LongTensors (B, S): ``input_ids``, ``attention_mask``,
    ``special_tokens_mask``, ``word_ids``.

    Example::

        >>> batch = encode(["Not bad, really."], tokenizer)
        >>> batch["word_ids"]          # [CLS] not bad , really . [SEP]
        tensor([[-1,  0,  1, -1,  2, -1, -1]])
    """
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(f"encode() needs a HuggingFace *fast* tokenizer (for character offsets); received "
                         f"{type(tokenizer).__name__}. Fix: AutoTokenizer.from_pretrained(path, use_fast=True).")
    texts, spans = _texts_and_words(snippets)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt",
                      return_offsets_mapping=True, return_special_tokens_mask=True)
    piece_start, piece_end = batch["offset_mapping"].unbind(-1)  # (B, S) character offsets
    n_words = max([len(s) for s in spans] + [1])
    # Padded word spans; empty slots get start = end = a huge offset, so no piece falls inside.
    far = torch.iinfo(torch.long).max
    word_start = torch.full((len(texts), n_words), far, dtype=torch.long)
    word_end = torch.full((len(texts), n_words), far, dtype=torch.long)
    for b, sentence_spans in enumerate(spans):
        if sentence_spans:
            word_start[b, :len(sentence_spans)], word_end[b, :len(sentence_spans)] = \
                torch.tensor(sentence_spans, dtype=torch.long).T
    # The last word starting at or before each piece's first character, if the piece lies inside it.
    word = torch.searchsorted(word_start, piece_start.contiguous(), right=True) - 1
    inside = (word >= 0) & (piece_end > piece_start)
    inside &= piece_start < word_end.gather(1, word.clamp(min=0))
    inside &= (batch["special_tokens_mask"] == 0) & (batch["attention_mask"] == 1)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "special_tokens_mask": batch["special_tokens_mask"],
            "word_ids": torch.where(inside, word, torch.full_like(word, -1))}
