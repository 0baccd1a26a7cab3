"""The tokens a model generates for a batch of prompts, when no target is given.

Greedy by default (``{"max_new_tokens": 25, "do_sample": False}``, Captum's default), the
prompts left padded as ``generate`` expects, each answer cut after its first end-of-sequence
token (the padding ``generate`` adds after it is not part of the answer).

Example::

    >>> generated_targets(llm, tokenizer, [[1, 5, 6]], None, encoder_decoder=False)   # [[7, 8, 2]]
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..compat.quantized_linear import differentiable_kernels
from ..model_state import offload
from ..errors import InputError
from .batch import padding_id

DEFAULT_GEN_ARGS: Dict[str, Any] = {"max_new_tokens": 25, "do_sample": False}


def _end_ids(model: nn.Module, tokenizer: Any, args: Dict[str, Any]) -> set:
    """The ids ``generate`` stopped at: ``gen_args``' ``eos_token_id`` when given (it overrides the
    model's), else the generation config's, the config's and the tokenizer's."""
    given = args.get("eos_token_id")
    values = [given] if given is not None else [getattr(source, "eos_token_id", None) for source in (
        getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer)]
    ids = set()
    for value in values:
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return {int(v) for v in ids}


def generated_targets(model: nn.Module, tokenizer: Any, prompts: Sequence[Sequence[int]],
                      gen_args: Optional[Dict[str, Any]], encoder_decoder: bool,
                      image_inputs: Optional[Dict[str, Any]] = None, adapter: Any = None) -> List[List[int]]:
    """Per prompt, the generated ids (each cut after its first end token); ``image_inputs``
    (a vision-language model's ``pixel_values``...) are passed to ``generate`` as the
    ``adapter``'s ``generation_inputs`` lay them out (with the per-token keywords the processor
    would return, e.g. Qwen2-VL's ``mm_token_type_ids``), so the answer is the one the model
    writes for the processor's inputs."""
    if not callable(getattr(model, "generate", None)):
        raise InputError(f"{type(model).__name__} has no generate(); pass the target to explain (a string or ids).")
    args = dict(DEFAULT_GEN_ARGS if not gen_args else gen_args)
    unsupported = [name for name in ("stop_strings", "stopping_criteria") if args.get(name) is not None]
    if unsupported or args.get("num_return_sequences", 1) != 1:
        raise InputError(f"gen_args {unsupported or ['num_return_sequences']} are not supported: an answer is cut at "
                         "its end-of-sequence tokens (eos_token_id) and each prompt has one answer. Generate yourself "
                         "and pass the answer as the target.")
    pad = padding_id(tokenizer)
    args.setdefault("pad_token_id", pad)
    device = offload.input_device(model)  # not meta (accelerate)
    longest = max(len(p) for p in prompts)
    if encoder_decoder:  # sources right padded
        ids = [list(p) + [pad] * (longest - len(p)) for p in prompts]
        mask = [[1] * len(p) + [0] * (longest - len(p)) for p in prompts]
    else:
        ids = [[pad] * (longest - len(p)) + list(p) for p in prompts]
        mask = [[0] * (longest - len(p)) + [1] * len(p) for p in prompts]
    args.setdefault("output_scores", True)
    args.setdefault("return_dict_in_generate", True)
    ids_t = torch.tensor(ids, device=device)
    keywords = dict(image_inputs or {})
    if keywords and adapter is not None:  # left padding is fine: pads are not image tokens
        keywords = adapter.generation_inputs(model, ids_t, keywords)
    # bitsandbytes' differentiable 4-bit kernel, not its CPU bfloat16 inference kernel: the tokens
    # are written by the model the explanation then follows (compat.quantized_linear).
    with torch.no_grad(), differentiable_kernels(model):
        out = model.generate(input_ids=ids_t, attention_mask=torch.tensor(mask, device=device), **keywords, **args)
    _refuse_non_finite_scores(out, model)
    sequences = out.sequences if hasattr(out, "sequences") else out
    answers = sequences[:, 1:] if encoder_decoder else sequences[:, longest:]
    ends = _end_ids(model, tokenizer, args)
    targets = []
    for row in answers.tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in ends), len(row))
        targets.append(row[:cut])
    if any(not t for t in targets):
        raise InputError(f"generate() returned no new token for some prompt (arguments {args}); raise max_new_tokens "
                         "or pass the target to explain.")
    return targets


def refuse_image_token_targets(targets: Sequence[Sequence[int]], image_token: int, generated: bool) -> None:
    """An output token equal to the image placeholder id would be read as one more image token
    of the sequence explained (prompt + answer), which then no longer matches the images:
    refused, naming the prompt and output step."""
    for prompt, target in enumerate(targets):
        steps = [t for t, token in enumerate(target) if int(token) == image_token]
        if steps:
            source = "the model generated" if generated else "the target holds"
            advice = f" or generate with gen_args bad_words_ids=[[{image_token}]]" if generated else ""
            raise InputError(
                f"Prompt {prompt}: {source} the image placeholder token (id {image_token}) at output step(s) "
                f"{steps[:5]} of {len(target)}; it would be read as an image token of the explained sequence. "
                f"Pass a target without it{advice}.")


def _refuse_non_finite_scores(out: Any, model: nn.Module) -> None:
    """A generation whose next-token scores held NaN (or +inf) picked its tokens from garbage (e.g.
    a float64 model whose eager attention softmax, computed in float32, turns a left-padded row
    into NaN): refused rather than explained. -inf is a token a logits processor ruled out
    (``bad_words_ids``, ``suppress_tokens``, top-k), not garbage."""
    scores = getattr(out, "scores", None)
    if not scores:
        return
    bad = [step for step, s in enumerate(scores) if bool(torch.isnan(s).any() or torch.isposinf(s).any())]
    if bad:
        raise InputError(
            f"model.generate() produced non-finite next-token scores at step(s) {bad[:5]} of {len(scores)}, so the "
            f"generated tokens are not the model's answer ({type(model).__name__}, dtype "
            f"{next(model.parameters()).dtype}). Generate in float32 or with attn_implementation='sdpa', or pass "
            "the target to explain."
        )
