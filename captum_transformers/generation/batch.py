"""Prompts and targets laid out as one batch for a causal LM or an encoder-decoder.

Decoder-only models: prompts are left-padded to a common length ``P`` (padding masked, the
position ids counted from each prompt's first real token, as ``generate`` does), followed by
the targets ``y_0 .. y_{T-2}`` (the last target token is explained but never read). Targets
shorter than the longest are filled with their last token, unmasked: a causal model's earlier
positions cannot see the filler, and those steps are dropped from the example's result. Step
``t`` is then read at position ``P - 1 + t`` for every example.

Encoder-decoders: sources right-padded and masked; the decoder reads the start token then
``y_0 .. y_{T-2}``; step ``t`` is read at decoder position ``t``.

Example::

    >>> batch = decoder_batch([[1, 5, 6], [1, 7]], [[8, 9], [8]], pad_id=0)
    >>> batch.ids.shape, batch.positions.tolist()     # (2, 4), [2, 3]
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

import torch

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class GenerationBatch:
    """``inputs`` for the model (a tuple), its ``forward_kwargs``, the explained ``positions``
    (T,) and ``targets`` (B, T), per example its prompt and target lengths; ``prompt_start``:
    where each example's prompt starts in the explained stream (left padding), ``output_start``:
    where the read output tokens start (decoder-only: ``P``; encoder-decoders: 0, the start token)."""

    inputs: tuple
    forward_kwargs: dict
    positions: torch.Tensor
    targets: torch.Tensor
    prompt_lengths: List[int]
    target_lengths: List[int]
    prompt_start: List[int]
    output_start: int
    encoder_decoder: bool


def padding_id(tokenizer: Any) -> int:
    """The id that fills padded positions: the tokenizer's pad token, else its end-of-sequence
    token (as ``generate`` does), else 0. Padded positions are masked, so any id serves."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def _pad_id(pad_id: Optional[int]) -> int:
    return 0 if pad_id is None else int(pad_id)


def _filled(targets: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    return torch.tensor([list(t) + [t[-1]] * (length - len(t)) for t in targets], dtype=torch.long)


def decoder_batch(prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pad_id: Optional[int],
                  device: torch.device = torch.device("cpu"), position_ids: bool = True) -> GenerationBatch:
    """The batch of a causal LM (see the module docstring)."""
    if any(len(p) == 0 for p in prompts):
        raise InputError("A prompt has no tokens; a causal LM needs at least one token before its first output.")
    longest, steps = max(len(p) for p in prompts), max(len(t) for t in targets)
    pad = _pad_id(pad_id)
    prompt_ids = torch.tensor([[pad] * (longest - len(p)) + list(p) for p in prompts], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    read_targets = _filled(targets, steps)[:, :steps - 1]
    ids = torch.cat([prompt_ids, read_targets], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(read_targets)], dim=1)
    kwargs = {"attention_mask": mask.to(device)}
    if position_ids:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(device)
    return GenerationBatch((ids.to(device),), kwargs, torch.arange(longest - 1, longest - 1 + steps, device=device),
                           _filled(targets, steps).to(device), [len(p) for p in prompts], [len(t) for t in targets],
                           [longest - len(p) for p in prompts], longest, False)


def encoder_decoder_batch(prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pad_id: Optional[int],
                          decoder_start_id: int, device: torch.device = torch.device("cpu")) -> GenerationBatch:
    """The batch of an encoder-decoder (see the module docstring)."""
    longest, steps = max(len(p) for p in prompts), max(len(t) for t in targets)
    pad = _pad_id(pad_id)
    source = torch.tensor([list(p) + [pad] * (longest - len(p)) for p in prompts], dtype=torch.long)
    source_mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts], dtype=torch.long)
    filled = _filled(targets, steps)
    start = torch.full((len(prompts), 1), int(decoder_start_id), dtype=torch.long)
    decoder = torch.cat([start, filled[:, :steps - 1]], dim=1)
    return GenerationBatch((source.to(device), decoder.to(device)), {"attention_mask": source_mask.to(device)},
                           torch.arange(steps, device=device), filled.to(device), [len(p) for p in prompts],
                           [len(t) for t in targets], [0] * len(prompts), 0, True)
