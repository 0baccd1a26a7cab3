"""How many positions a language model's weights can read: the one prompt-length rule of generation.

A model that looks its positions up in a table (GPT-2's ``wpe``, BART's, OPT's and Marian's
``embed_positions``, BERT's ``position_embeddings``) has no row past the table's end: a longer
sequence is refused before any forward pass (it would fail inside the embedding with an
``IndexError``, or a device-side assert on a GPU). A model whose positions are computed (rotary
embeddings: Llama, Qwen2, Gemma, Mistral, GPT-NeoX; relative biases: T5; ALiBi: BLOOM; a
sinusoidal table that grows: M2M100, XGLM) reads any length: its ``max_position_embeddings`` is
the length it was trained for, not a limit of its weights, so such prompts are explained as the
model computes them. :class:`~captum_transformers.GenerationAttribution` and ``explain --prompt``
both ask this module, so they accept and refuse the same prompts.

Positions read: decoder-only, the longest prompt ``P`` and ``T`` output tokens are one sequence of
``P + T - 1`` positions (the last output token is explained, never read, and ``generate`` reads
the same); encoder-decoders, the source's ``P`` and the decoder's ``T`` (the start token then
``y_0 .. y_{T-2}``).

Example::

    >>> position_limit(gpt2), position_limit(llama)         # 1024, None
    >>> refuse_positions_past_the_table(gpt2, 1020, 10, encoder_decoder=False)   # InputError: 1029 > 1024
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from ..errors import InputError
from ..model_state import module_walk

# The names HF gives a table of absolute positions (learned or fixed sinusoidal, ``nn.Embedding``
# or a subclass of it); tables under a vision tower (a ViT's patch positions) are not the text's.
_TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings", "position_embedding")
_VISION_PARTS = ("vision", "visual", "image", "patch")


def position_table(model: nn.Module) -> Optional[Tuple[str, int]]:
    """``(dotted path(s), positions held)`` of the text's smallest position table(s) (an
    encoder-decoder's two, named together when they hold as many), or None when the model
    computes its positions. A table's rows past an ``offset`` (BART, OPT: 2) or a ``padding_idx``
    (RoBERTa) are the positions it holds."""
    tables = []
    for name, module in module_walk.named_modules(model):
        parts = name.lower().split(".")
        if not isinstance(module, nn.Embedding) or parts[-1] not in _TABLE_NAMES or \
                any(word in part for part in parts for word in _VISION_PARTS):
            continue
        offset = getattr(module, "offset", None)
        if not isinstance(offset, int):
            offset = 0 if module.padding_idx is None else module.padding_idx + 1
        if module.num_embeddings - offset > 0:
            tables.append((name, module.num_embeddings - offset))
    if not tables:
        return None
    held = min(count for _, count in tables)
    return ", ".join(name for name, count in tables if count == held), held


def position_limit(model: nn.Module) -> Optional[int]:
    """The most positions ``model`` can read (its position table's rows), or None: no limit."""
    table = position_table(model)
    return None if table is None else table[1]


def output_room(model: nn.Module, prompt_length: int, encoder_decoder: bool) -> Optional[int]:
    """The most output tokens that fit after a prompt of ``prompt_length`` tokens (at least 1;
    the prompt itself is checked by :func:`refuse_positions_past_the_table`), or None: no limit."""
    limit = position_limit(model)
    if limit is None:
        return None
    return max(1, limit if encoder_decoder else limit - prompt_length + 1)


def refuse_positions_past_the_table(model: nn.Module, prompt_length: int, output_length: int, encoder_decoder: bool,
                                    prompt: str = "the prompt", output: str = "output tokens",
                                    fewer: str = "give at most {room} output token(s)") -> None:
    """Refuse a prompt (``prompt_length`` tokens, the longest of a batch) and output
    (``output_length`` tokens, or the most that will be generated) that need more positions than
    the model's table holds (see the module docstring); nothing for a model without a table.
    ``prompt`` and ``output`` name the inputs in the message (the CLI's flags); ``fewer`` is the
    fix, ``{room}`` in it replaced by the most output tokens that fit."""
    table = position_table(model)
    if table is None:
        return
    limit = table[1]
    tables = "tables" if ", " in table[0] else "table"
    where = f"{type(model).__name__} reads at most {limit} positions (its position {tables} {table[0]} " \
            f"{'have' if tables == 'tables' else 'has'} no row past them)"
    if prompt_length > limit:
        raise InputError(f"{prompt[:1].upper() + prompt[1:]} has {prompt_length} tokens but {where}; give a shorter "
                         "prompt.")
    if encoder_decoder and output_length > limit:
        raise InputError(f"{output_length} {output} need {output_length} decoder positions (the start token, then "
                         f"every output token but the last), but {where}; {fewer.format(room=limit)}.")
    needed = prompt_length + output_length - 1
    if not encoder_decoder and needed > limit:
        raise InputError(f"{prompt[:1].upper() + prompt[1:]}'s {prompt_length} tokens and {output_length} {output} "
                         f"need {needed} positions (every output token but the last is read), but {where}; "
                         f"{fewer.format(room=limit - prompt_length + 1)}, or a shorter prompt.")
