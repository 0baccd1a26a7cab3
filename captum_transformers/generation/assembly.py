"""Per-step token scores of a batch turned into one :class:`GenerationResult` per prompt.

Each explained step gave scores over the explained stream (decoder-only: the left-padded
prompt then the output tokens read so far; encoder-decoders: the source stream and the
decoder stream). Here each example's rows are cut out of the padding: ``token_attr`` over its
prompt tokens (or its template segments, each the sum of its tokens; skipped tokens left
out), ``target_attr`` over the output tokens, ``first_token_share`` over both, ``sink_share``
at each row's position (the engine's, :func:`~captum_transformers.generation.engine.sink_share`),
and the steps past an example's own answer (filler in a batch of unequal answers) dropped.

Example::

    >>> results = assemble_results(explainer, prompts, batch, steps, per_stream, step_logits, None)
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..errors import InputError
from .batch import GenerationBatch
from .engine import StepLogits
from .image_inputs import image_columns
from .prompts import EncodedPrompt, special_token_mask
from .result import GenerationResult, first_token_share
from .steps import ExplainedSteps, group_scores, token_probabilities


def encoder_decoder_model(model: nn.Module) -> bool:
    """True for a seq2seq model whose forward takes a decoder sequence (BART, T5, ...)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_encoder_decoder", False)) and callable(getattr(model, "get_encoder", None))


def signed_method(method: Any) -> bool:
    """Whether ``method``'s scores carry a direction (for or against the token), as its class
    says (``signed``, :mod:`~captum_transformers.methods.facts`): relevance propagation, Gradient
    x Input and Integrated Gradients do, attention maps and Saliency (an absolute gradient) do
    not; an attribution that says nothing counts as unsigned."""
    return bool(getattr(type(method), "signed", False))


def _tokens(tokenizer: Any, ids: Sequence[int]) -> List[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens([int(i) for i in ids])]


def _feature_columns(prompt: EncodedPrompt, scores: torch.Tensor, tokens: List[str], skipped: List[bool]):
    """``scores`` (R, n) over the prompt's tokens as columns over its interpretable features."""
    itp_mask = getattr(prompt.inp, "itp_mask", None)
    keep = [not s for s in skipped]
    if itp_mask is not None:  # Captum's TextTokenInput(skip_tokens=...)
        keep = [k and bool(m) for k, m in zip(keep, itp_mask.reshape(-1).tolist())]
    if prompt.features is None:
        columns = [i for i, k in enumerate(keep) if k]
        return scores[:, columns], [tokens[i] for i in columns]
    count = len(prompt.feature_names)
    summed = scores.new_zeros(scores.shape[0], count)
    for index, feature in enumerate(prompt.features):
        if feature >= 0 and keep[index]:
            summed[:, feature] += scores[:, index]
    return summed, list(prompt.feature_names)


def assemble_results(explainer: Any, prompts: List[EncodedPrompt], batch: GenerationBatch, steps: ExplainedSteps,
                     per_stream: Dict[str, torch.Tensor], step_logits: StepLogits,
                     skip_tokens: Optional[Sequence[Any]], images: Sequence[Any] = (),
                     image_token: Optional[int] = None) -> List[GenerationResult]:
    """One result per prompt (see the module docstring); ``per_stream`` holds (G, B, N) scores.

    A vision-language model's image placeholder tokens (``image_token``) are left out of
    ``token_attr``: their scores are the image's, in ``image_attr`` / ``image_token_attr``
    (per image of ``images``)."""
    tokenizer, groups = explainer.tokenizer, steps.explained_groups
    logits = step_logits.logits
    probabilities = token_probabilities(logits, steps.targets)
    explained_scores = torch.stack([group_scores(logits, steps, group) for group in groups], dim=1)
    if batch.encoder_decoder:
        source, outputs = per_stream["encoder"], per_stream["decoder"]
    else:
        source = outputs = next(iter(per_stream.values())) if len(per_stream) == 1 else per_stream["tokens"]
    start_id = getattr(getattr(explainer.model, "config", None), "decoder_start_token_id", None)
    sinks = getattr(step_logits, "sink_share", None)  # (B, T) per explained position, or None
    results = []
    for b, prompt in enumerate(prompts):
        length, prompt_length = batch.target_lengths[b], batch.prompt_lengths[b]
        rows = [g for g, group in enumerate(groups) if max(group) < length]
        if steps.groups is not None and len(rows) != len(groups):
            raise InputError(f"The span {groups[0]} reaches past the {length} output tokens of prompt {b}; choose "
                             "steps within every answer of the batch.")
        first = batch.prompt_start[b]
        prompt_part = source[rows, b, first:first + prompt_length]
        output_part = outputs[rows, b, batch.output_start:batch.output_start + length]
        if output_part.shape[1] < length:  # decoder-only: the last output token is never read
            output_part = torch.cat([output_part, output_part.new_zeros(len(rows), length - output_part.shape[1])], 1)
        share = first_token_share(torch.cat([prompt_part, output_part], dim=1), explainer.sink_tokens)
        # A row is read at its group's latest step (a span's), as its scores are.
        sink_share = None if sinks is None else sinks[b, [groups[g][-1] for g in rows]].cpu()
        tokens = _tokens(tokenizer, prompt.ids)
        skipped = special_token_mask(prompt.ids, tokenizer, skip_tokens)
        if image_token is not None:
            skipped = [s or int(i) == image_token for s, i in zip(skipped, prompt.ids)]
        token_attr, input_tokens = _feature_columns(prompt, prompt_part, tokens, skipped)
        image_attr, image_token_attr, image_grid = image_columns(per_stream, images, b, rows)
        target = steps.targets[b, :length].tolist()
        output_tokens = _tokens(tokenizer, target)
        read_tokens = (_tokens(tokenizer, [start_id]) + output_tokens[:-1]) if batch.encoder_decoder else output_tokens
        step_probs = probabilities[b, :length]
        if steps.groups is not None:  # one row: its tokens joined, their probabilities multiplied
            output_tokens = ["+".join(output_tokens[t] for t in groups[0])]
            step_probs = step_probs[list(groups[0])].prod().reshape(1)
        contrast = None if steps.foils is None else _tokens(tokenizer, steps.foils[b, :length].tolist())
        results.append(GenerationResult(
            input_tokens=input_tokens, output_tokens=output_tokens, token_attr=token_attr.cpu(),
            target_attr=output_part.cpu(), target_attr_tokens=read_tokens,
            output_probs=step_probs.cpu(), scores=explained_scores[b, rows].cpu(),
            score_kind=steps.score, method=type(explainer.method).__name__, first_token_share=share.cpu(),
            input_ids=list(prompt.ids), output_ids=target, inp=prompt.inp, contrast_tokens=contrast,
            signed=signed_method(explainer.method), encoder_decoder=batch.encoder_decoder, image_attr=image_attr,
            image_token_attr=image_token_attr, image_grid=image_grid, sink_share=sink_share))
    return results
