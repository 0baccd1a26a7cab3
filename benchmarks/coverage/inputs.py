"""The inputs of every check: a batch of two token rows, the second right-padded, and its target.

Rows of :data:`LENGTH` ids drawn (seeded) from the ids the config gives no special meaning;
the second row is real for :data:`SECOND_LENGTH` tokens, then padded with the config's
``pad_token_id`` (HF decoder classifiers find their last token from it). Encoder-decoders get
a decoder prefix too (:data:`DECODER_LENGTH`, the second row real for
:data:`DECODER_SECOND_LENGTH`), starting with the decoder start token. Every padding is
right padding, given by ``attention_mask`` (and ``decoder_attention_mask``). The rows of an
encoder-decoder's sequence classifier end with ``eos_token_id`` (BART-style heads classify from
the last one).

The explained score (the package's documented call for each head):

* ``class``: class :data:`CLASS_TARGET` of the sequence.
* ``next-token``: the logit of token :data:`TOKEN_TARGET` at the last real position (of the
  decoder, for an encoder-decoder).
* ``token``: ``(POSITION, label)``, the label at position :data:`POSITION` (real in every row),
  the package's target of token-level heads (``docs/explained-tokens.md``).
* ``span-start``: ``(0, POSITION)``, the start score of that token (the package reads
  ``start_logits`` and ``end_logits`` as one (B, 2, N) tensor).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from .entries import Head

LENGTH, SECOND_LENGTH = 8, 5
DECODER_LENGTH, DECODER_SECOND_LENGTH = 5, 3
POSITION = 2
CLASS_TARGET, TOKEN_TARGET = 1, 7
FIRST_ID, LAST_ID = 3, 99  # ids drawn from [FIRST_ID, LAST_ID), special ids left out
SEED = 1


@dataclasses.dataclass
class Example:
    """A batch (or one example of it) and what is explained.

    Attributes:
        inputs: ``(input_ids,)``, or ``(input_ids, decoder_input_ids)`` for encoder-decoders.
        masks: one 0/1 mask per input (1: a real token).
        target: the Captum target of every row.
        query_row: the position a token-level head's target names (None: the head reads the
            default row: CLS, or a decoder's last real token).
        score: ``"class"``, ``"next-token"``, ``"token"`` or ``"span-start"`` (see the module docstring).
        names: the model's keyword of each input (``pixel_values`` for images, ...).
        extra: other keyword tensors of the model, one row per example (Siglip 2's
            ``pixel_attention_mask`` and ``spatial_shapes``).
    """

    inputs: Tuple[torch.Tensor, ...]
    masks: Tuple[torch.Tensor, ...]
    target: Any
    query_row: Optional[int]
    score: str
    names: Tuple[str, ...] = ("input_ids", "decoder_input_ids")
    extra: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.inputs[0].shape[0]

    @property
    def method_inputs(self):
        """What ``attribute`` takes: the ids, or the (source, decoder prefix) pair."""
        return self.inputs[0] if len(self.inputs) == 1 else self.inputs

    @property
    def forward_kwargs(self) -> Dict[str, torch.Tensor]:
        """The masks by keyword (``attention_mask``, ``decoder_attention_mask``), and :attr:`extra`."""
        names = ("attention_mask", "decoder_attention_mask")
        return {**dict(zip(names, self.masks)), **self.extra}

    @property
    def model_kwargs(self) -> Dict[str, torch.Tensor]:
        """Every input by keyword, for calling the model directly."""
        return {**dict(zip(self.names, self.inputs)), **self.forward_kwargs}

    def lengths(self, row: int) -> List[int]:
        """The real length of each input of ``row`` (an input without a mask: its whole length)."""
        return [int(mask[row].sum()) for mask in self.masks] + [t.shape[1] for t in self.inputs[len(self.masks):]]

    def single(self, row: int) -> "Example":
        """Example ``row`` alone, its padding cut off."""
        cut = [slice(0, n) for n in self.lengths(row)]
        return dataclasses.replace(
            self, inputs=tuple(t[row:row + 1, c] for t, c in zip(self.inputs, cut)),
            masks=tuple(m[row:row + 1, c] for m, c in zip(self.masks, cut)),
            extra={name: t[row:row + 1] for name, t in self.extra.items()})


def special_ids(config) -> set:
    """Every ``*_token_id`` of ``config`` and of its sub-configs."""
    found = set()
    for key, value in vars(config).items():
        if key.endswith("_token_id") and isinstance(value, int):
            found.add(value)
        elif key.endswith("_token_id") and isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
        elif hasattr(value, "to_dict") and hasattr(value, "sub_configs"):
            found |= special_ids(value)
    return found


def _token_rows(allowed: torch.Tensor, length: int, second_length: int, pad: int, first: Optional[int],
                generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two id rows of ``length`` (the second real for ``second_length``, then ``pad``) and their mask;
    ``first``: the id every row starts with (a decoder start token), None for none."""
    ids = allowed[torch.randint(len(allowed), (2, length), generator=generator)]
    if first is not None:
        ids[:, 0] = first
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, second_length:] = 0
    ids[1, second_length:] = pad
    return ids, mask


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def target_of(head: Head) -> Any:
    """The Captum target of ``head`` (see the module docstring)."""
    return {
        "class": CLASS_TARGET,
        "next-token": TOKEN_TARGET,
        "token": (POSITION, CLASS_TARGET if head.name == "token-classification" else TOKEN_TARGET),
        "span-start": (0, POSITION),
    }[head.target]


def make_example(config, head: Head, seed: int = SEED, model: Optional[torch.nn.Module] = None) -> Example:
    """The batch of two rows for a model of ``config`` under ``head`` (images and audio: the
    inputs of :func:`.media.media_inputs` for ``model``, no padding)."""
    if head.modality != "text":
        from .media import media_inputs

        name, values, extra = media_inputs(model, seed)
        return Example((values,), (), target_of(head), None, head.target, names=(name,), extra=extra)
    generator = torch.Generator().manual_seed(seed)
    specials = special_ids(config)
    allowed = torch.tensor([i for i in range(FIRST_ID, LAST_ID) if i not in specials])
    pad = _int_or(getattr(config, "pad_token_id", None), 0)
    ids, mask = _token_rows(allowed, LENGTH, SECOND_LENGTH, pad, None, generator)
    eos = getattr(config, "eos_token_id", None)
    if head.name == "sequence-classification" and getattr(config, "is_encoder_decoder", False) \
            and isinstance(eos, int) and eos != pad:
        ids[torch.arange(2), last_real(mask)] = eos  # BART-style classifiers read the last <eos>
    inputs, masks = [ids], [mask]
    if head.seq2seq:
        start = _int_or(getattr(config, "decoder_start_token_id", None), pad)
        decoder_ids, decoder_mask = _token_rows(allowed, DECODER_LENGTH, DECODER_SECOND_LENGTH, pad, start, generator)
        inputs.append(decoder_ids)
        masks.append(decoder_mask)
    return Example(tuple(inputs), tuple(masks), target_of(head), POSITION if head.token_level else None, head.target)


def call_model(model: torch.nn.Module, example: Example, **extra):
    """The model's own forward on ``example`` (every input by keyword)."""
    return model(**example.model_kwargs, **extra)


def last_real(mask: torch.Tensor) -> torch.Tensor:
    """The last real position of each row of a right-padded mask (B,)."""
    return mask.sum(dim=1) - 1


def explained_scores(output, example: Example) -> torch.Tensor:
    """The explained score of each row (B,), read from the model's own output as the package
    documents it (:class:`Example`'s ``score``)."""
    rows = torch.arange(example.batch_size)
    if example.score == "span-start":
        return output.start_logits[:, POSITION]
    logits = output.logits
    if example.score == "class":
        return logits[:, CLASS_TARGET]
    if example.score == "token":
        return logits[rows, POSITION, example.target[1]]
    return logits[rows, last_real(example.masks[-1]), TOKEN_TARGET]
