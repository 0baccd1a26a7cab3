"""Prompts and targets as token ids: strings, ids, chat-template ids, Captum's text inputs.

A prompt is a string (tokenized with the tokenizer's special tokens, as Captum's
``TextTokenInput`` does), token ids (a list, a 1-D tensor, or the ids
``tokenizer.apply_chat_template`` returns), or Captum's ``TextTokenInput`` /
``TextTemplateInput``. For a ``TextTemplateInput`` each template segment is one
interpretable feature: its score is the exact sum of its tokens' scores, found from the
tokenizer's character offsets. A target is a string (tokenized without special tokens), ids,
or None (generated).

Example::

    >>> prompt = encode_prompt("k = 3 ; q ?", tokenizer)
    >>> prompt.ids, prompt.features        # ids and, per token, its feature (None: its own)
"""
from __future__ import annotations

import dataclasses
import string
import warnings
from typing import Any, List, Optional, Sequence

import torch

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class EncodedPrompt:
    """One prompt's ids, and per token the interpretable feature it belongs to.

    ``features``: None when every token is its own feature; else a list of feature indices
    (-1: the token belongs to no feature, e.g. the template's fixed text); ``feature_names``:
    the features' display strings. ``inp``: the Captum input it came from, if any.
    """

    ids: List[int]
    features: Optional[List[int]] = None
    feature_names: Optional[List[str]] = None
    inp: Any = None


def _ids(value: Any, what: str) -> List[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1 or value.is_floating_point():
            raise InputError(f"{what} given as a tensor must be one sequence of integer token ids (n,) or (1, n); got "
                             f"shape {tuple(value.shape)} dtype {value.dtype}. Pass a list of prompts for a batch.")
        return [int(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if hasattr(value, "keys") and "input_ids" in value:  # a BatchEncoding from apply_chat_template(return_dict=True)
        return _ids(torch.as_tensor(value["input_ids"]), what)
    raise InputError(f"{what} must be a string, token ids (list or tensor), or Captum's TextTokenInput / "
                     f"TextTemplateInput; got {type(value).__name__}.")


def encode_prompt(prompt: Any, tokenizer: Any) -> EncodedPrompt:
    """The ids and features of one prompt (see the module docstring)."""
    from captum.attr import TextTemplateInput, TextTokenInput

    if isinstance(prompt, TextTokenInput):
        return EncodedPrompt(_ids(prompt.to_model_input(), "TextTokenInput"), inp=prompt)
    if isinstance(prompt, TextTemplateInput):
        return _template_prompt(prompt, tokenizer)
    if isinstance(prompt, str):
        refuse_undecodable_text(prompt, "The prompt")
        return EncodedPrompt(list(tokenizer(prompt, add_special_tokens=True)["input_ids"]))
    return EncodedPrompt(_ids(prompt, "The prompt"))


def refuse_undecodable_text(text: str, what: str) -> None:
    """Refuse text that cannot be written as UTF-8: the surrogate escapes Python makes of bytes
    that were not UTF-8 (a command-line argument such as ``$'\\xff'`` arrives as ``'\\udcff'``)
    or lone surrogates. A tokenizer cannot encode them (it fails with a ``TypeError``)."""
    bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if bad is None:
        return
    code = ord(text[bad])
    byte = f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF else \
        f"a lone surrogate U+{code:04X}"
    raise InputError(f"{what} is not UTF-8 text: character {bad} is {byte}. Give UTF-8 text (re-encode it, e.g. "
                     "iconv -t UTF-8, or set the terminal to UTF-8).")


def encode_target(target: Any, tokenizer: Any) -> List[int]:
    """A target's ids: a string without special tokens (as Captum does), or ids."""
    if isinstance(target, str):
        refuse_undecodable_text(target, "The target")
        ids = list(tokenizer(target, add_special_tokens=False)["input_ids"])
    else:
        ids = _ids(target, "The target")
    if not ids:
        raise InputError(f"The target {target!r} has no tokens; give at least one token to explain.")
    return ids


def _template_spans(template: str, values: Any) -> tuple:
    """(text, [(start, end) per segment]) of a ``str.format`` template filled with ``values``."""
    named = isinstance(values, dict)
    keys = list(values) if named else list(range(len(values)))
    spans = {}
    parts: List[str] = []
    position, auto = 0, 0
    for literal, field, spec, conversion in string.Formatter().parse(template):
        parts.append(literal)
        position += len(literal)
        if field is None:
            continue
        if spec or conversion:
            raise InputError(f"TextTemplateInput fields with a format spec or conversion ({field!r}) are not supported; "
                             "use plain {} or {name} fields.")
        key = field if named else (int(field) if field else auto)
        auto += 0 if field else 1
        if key not in keys:
            raise InputError(f"The template names the field {field!r}, which the values {keys} do not have.")
        text = str(values[key])
        spans[key] = (position, position + len(text))
        parts.append(text)
        position += len(text)
    return "".join(parts), [spans.get(key) for key in keys], keys


def _template_prompt(prompt: Any, tokenizer: Any) -> EncodedPrompt:
    if not isinstance(prompt.template, str):
        raise InputError("A TextTemplateInput with a callable template gives no character positions for its segments, "
                         "so its tokens cannot be assigned to them; use a str.format template ('{} ... {}').")
    values = prompt.values if isinstance(prompt.values, (list, dict)) else list(prompt.values)
    filled = dict(zip(prompt.dict_keys, values)) if getattr(prompt, "dict_keys", None) else values
    text, spans, keys = _template_spans(prompt.template, filled)
    refuse_undecodable_text(text, "The TextTemplateInput's text")
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(f"A TextTemplateInput needs a fast tokenizer (character offsets per token) to assign tokens to "
                         f"segments; {type(tokenizer).__name__} is not one. Pass token ids or a TextTokenInput instead.")
    encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    mask = getattr(prompt, "mask", None)
    segment_feature = list(range(len(keys))) if mask is None else [int(m) for m in mask.tolist()]
    features = []
    for start, end in encoded["offset_mapping"]:
        owner = -1
        for index, span in enumerate(spans):
            if span is not None and start < span[1] and end > span[0] and end > start:
                if owner != -1 and segment_feature[owner] != segment_feature[index]:
                    raise InputError(f"A token of {text[start:end]!r} spans two template segments, so its score cannot "
                                     "be split between them; separate the segments with a space or punctuation.")
                owner = index
        features.append(-1 if owner == -1 else segment_feature[owner])
    names = [str(filled[k]) for k in keys] if mask is None else [str(i) for i in range(max(segment_feature) + 1)]
    return EncodedPrompt(list(encoded["input_ids"]), features, names, prompt)


def prompt_list(inp: Any) -> tuple:
    """``(prompts, batched)``: a list or tuple of prompts (not of ints) is a batch; so is a 2-D
    tensor of ids (one prompt per row) and a tokenizer's batch (``input_ids`` with an
    ``attention_mask``: each row's padding removed, wherever it sits)."""
    if isinstance(inp, (list, tuple)) and inp and not all(isinstance(v, int) for v in inp):
        return list(inp), True
    if isinstance(inp, torch.Tensor) and inp.dim() == 2 and inp.shape[0] > 1:
        return [row for row in inp], True
    if hasattr(inp, "keys") and "input_ids" in inp:
        try:
            ids = torch.as_tensor(inp["input_ids"])
        except (TypeError, ValueError) as error:
            raise InputError(f"The batch's input_ids are rows of different lengths ({error}); tokenize with "
                             "padding=True (its attention_mask marks the padding), or pass a list of prompts.") from None
        mask = inp.get("attention_mask")
        if ids.dim() == 2:  # padding is removed by the mask, also from a batch of one
            mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
            rows = [row[m.to(torch.bool)] for row, m in zip(ids, mask)]
            return (rows, True) if ids.shape[0] > 1 else (rows[:1], False)
    return [inp], False


def special_token_mask(ids: Sequence[int], tokenizer: Any, skip_tokens: Optional[Sequence[Any]]) -> List[bool]:
    """True for the prompt tokens to leave out of ``token_attr`` (``skip_tokens``: token strings
    or ids, as Captum's ``TextTokenInput`` takes them)."""
    if not skip_tokens:
        return [False] * len(ids)
    skipped = set()
    for token in skip_tokens:
        if isinstance(token, str):
            converted = tokenizer.convert_tokens_to_ids(token)
            if converted is None or converted == getattr(tokenizer, "unk_token_id", None) and token != tokenizer.unk_token:
                raise InputError(f"skip_tokens names {token!r}, which is not a token of the tokenizer's vocabulary.")
            skipped.add(int(converted))
        else:
            skipped.add(int(token))
    return [i in skipped for i in ids]


def _given_as_ids(value: Any) -> bool:
    """Whether a prompt came as token ids (which may hold padding), not as text."""
    if isinstance(value, torch.Tensor) or hasattr(value, "keys"):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _special_ids(sources: Sequence[Any], name: str) -> set:
    found = set()
    for source in sources:
        value = getattr(source, name, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                found.add(int(v))
    return found


def _pad_and_allowance(tokenizer: Any, model: Any) -> tuple:
    """``(pad id or None, allowance)``: the tokenizer's pad id, else the model config's; the
    allowance is 1 when that id is also a bos or eos id (one at either end is then that token)."""
    config = getattr(model, "config", None)
    configs = [config, getattr(model, "generation_config", None)]
    if config is not None and callable(getattr(config, "get_text_config", None)):
        configs.append(config.get_text_config())
    pad = getattr(tokenizer, "pad_token_id", None)
    if not isinstance(pad, int) or isinstance(pad, bool):
        pads = _special_ids(configs, "pad_token_id")
        pad = min(pads) if len(pads) == 1 else None
    if pad is None:
        return None, 0
    sources = [tokenizer, *configs]
    ends = _special_ids(sources, "bos_token_id") | _special_ids(sources, "eos_token_id")
    return pad, int(pad in ends)


def _run(row: Sequence[int], pad: int) -> int:
    return next((i for i, token in enumerate(row) if token != pad), len(row))


def refuse_unmasked_padding(inp: Any, listed: Sequence[Any], prompts: Sequence[EncodedPrompt], tokenizer: Any,
                            model: Any) -> None:
    """Padding in token ids given without an attention mask would be explained as prompt tokens.

    A run of pad ids (the tokenizer's ``pad_token_id``, else the model config's) at the start or
    the end of an id row is almost always padding; when the pad id is also a bos or eos id, one
    pad id at either end is that token and only a longer run counts. Refused: rows of one length
    (a (B, N) id tensor, a mask-less ``input_ids`` dict, equal-length id lists) whose runs differ
    (left or right padding); warned: any other id row that starts or ends with such a run (a
    single prompt, or rows padded alike). Text prompts and a tokenizer's dict with its
    ``attention_mask`` (the padding removed) are not read here."""
    if hasattr(inp, "keys") and inp.get("attention_mask") is not None:
        return
    pad, allowance = _pad_and_allowance(tokenizer, model)
    if pad is None:
        return
    rows = [(i, p.ids) for i, (raw, p) in enumerate(zip(listed, prompts)) if _given_as_ids(raw)]
    if not rows:
        return
    lead = {i: max(0, _run(ids, pad) - allowance) for i, ids in rows}
    trail = {i: max(0, _run(ids[::-1], pad) - allowance) for i, ids in rows}
    common = len(rows) > 1 and len({len(ids) for _, ids in rows}) == 1
    for side, runs in (("left", lead), ("right", trail)):
        if common and len(set(runs.values())) > 1:
            padded = [i for i, n in runs.items() if n]
            shown = ", ".join(f"row {i}: {n}" for i, n in list(runs.items())[:6])
            where = "start" if side == "left" else "end"
            raise InputError(
                f"The prompts are {len(rows)} id rows of {len(rows[0][1])} tokens without an attention_mask, and rows "
                f"{padded[:6]} {where} with runs of the pad id {pad} of different lengths ({shown}): that is {side} "
                "padding, and the pad tokens would be explained as prompt tokens. Pass the tokenizer's dict "
                "(tokenizer(prompts, padding=True, return_tensors='pt'), with its attention_mask), "
                "{'input_ids': ids, 'attention_mask': mask}, or the prompts as a list without padding.")
    for i, _ in rows:
        for count, where in ((lead[i], "starts"), (trail[i], "ends")):
            if count:
                who = f"Prompt {i}" if len(listed) > 1 else "The prompt"
                warnings.warn(
                    f"{who} {where} with {count} pad id{'s' if count > 1 else ''} ({pad}) and no attention_mask was "
                    "given: they are explained as prompt tokens. If they are padding, pass the tokenizer's dict "
                    "(input_ids with its attention_mask) or the prompt without its padding.", UserWarning,
                    stacklevel=4)  # this, attribute, Captum's log_usage wrapper, the caller
