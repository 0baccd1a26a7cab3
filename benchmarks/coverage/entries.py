"""The (model type, head) pairs of the sweep, read from transformers' auto mappings.

Each head kind names one ``MODEL_FOR_*_MAPPING_NAMES`` table of
``transformers.models.auto.modeling_auto`` (model type -> model class name) and says how its
output is explained (:class:`Head`): a class of the whole sequence, a token at one position,
or the next token after the last real one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Head:
    """One head kind of the sweep.

    Attributes:
        name: the command-line name (``causal-lm``).
        mapping: the ``modeling_auto`` table it enumerates.
        target: how the explained score is chosen: ``"class"`` (one class of the sequence),
            ``"next-token"`` (a token id at the last real position, decoder of a seq2seq model
            included), ``"token"`` (a label at one position, read through ``query_rows``),
            ``"span-start"`` (a start position of extractive QA).
        seq2seq: whether the model takes ``decoder_input_ids`` too.
        modality: ``"text"`` (token ids), ``"image"`` or ``"audio"`` (:mod:`.media`).
    """

    name: str
    mapping: str
    target: str
    seq2seq: bool = False
    modality: str = "text"

    @property
    def token_level(self) -> bool:
        """Whether the score is read at one chosen position (token classification, masked LM, QA)."""
        return self.target in ("token", "span-start")


HEADS: Dict[str, Head] = {head.name: head for head in [
    Head("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "next-token"),
    Head("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "class"),
    Head("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token"),
    Head("question-answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "span-start"),
    Head("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "token"),
    Head("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "next-token", seq2seq=True),
    Head("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "class", modality="image"),
    Head("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "class", modality="audio"),
]}
# The sweeps: each its heads, results file and page.
SUITES: Dict[str, Dict[str, Any]] = {
    "text": {"heads": [h for h in HEADS if HEADS[h].modality == "text"], "out": "benchmarks/coverage/results.json",
             "markdown": "docs/coverage.md"},
    "vision-audio": {"heads": ["image-classification", "audio-classification"],
                     "out": "benchmarks/coverage/results-vision-audio.json", "markdown": "docs/coverage-vision-audio.md"},
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One architecture under one head: ``model_type`` (the config's), its model class name."""

    model_type: str
    head: str
    class_name: str

    @property
    def key(self) -> str:
        """``model_type/head``, the entry's key in the results file."""
        return f"{self.model_type}/{self.head}"


def mapping(head: Head) -> Dict[str, str]:
    """The head's ``model type -> class name`` table (a class list keeps its first class)."""
    from transformers.models.auto import modeling_auto

    table = getattr(modeling_auto, head.mapping)
    return {model_type: names[0] if isinstance(names, (tuple, list)) else names for model_type, names in table.items()}


def enumerate_entries(heads: Sequence[str], only: Optional[Iterable[str]] = None) -> List[Entry]:
    """Every (model type, head) of ``heads`` (names of :data:`HEADS`), in mapping order,
    restricted to the model types in ``only`` when given."""
    wanted = None if only is None else set(only)
    entries = []
    for name in heads:
        for model_type, class_name in mapping(HEADS[name]).items():
            if wanted is None or model_type in wanted:
                entries.append(Entry(model_type, name, class_name))
    return entries
