r"""Why a language model wrote each token: any method of the package, one forward pass.

:class:`GenerationAttribution` wraps a method (AttnLRP, ConservativeLRP, GenericAttention,
TransformerRelevance, AttentionGradCAM, PartialLRP, TransformerLRP, RawAttention,
AttentionRollout, AttentionFlow, or Captum's IG / Saliency rows of the catalog) and explains
every generated token ``y_t`` of a causal LM (or an encoder-decoder) given the prompt and the
tokens before it:

.. math:: \text{token\_attr}[t] = \mathcal{A}\big(s_t(x, y_{<t})\big)\big|_{x}, \qquad
          \text{target\_attr}[t] = \mathcal{A}\big(s_t(x, y_{<t})\big)\big|_{y_{<t}}

where :math:`s_t` is the step's score (``"logit"``, ``"log_prob"``, ``"prob"``, or a contrast
with foil tokens) and :math:`\mathcal{A}` the wrapped method. The package's methods run one
forward pass over prompt + output and one backward pass per explained token through it
(TransformerRelevance: two, as in its single calls); each row equals a separate call of the
method on the prefix (:mod:`captum_transformers.generation.engine`). Captum's own rows (IG,
Saliency) run one call per step on the prefix.

Example::

    >>> explainer = GenerationAttribution(AttnLRP(llm), tokenizer)
    >>> result = explainer.attribute("k = 3 ; q ?", target="3")       # Captum's LLMAttributionResult
    >>> result.token_attr.shape          # (output tokens, prompt tokens)
    >>> results = explainer.attribute(["a = 1 ?", "b = 2 ; c = 4 ?"])  # generated, one batched pass

Vision-language models (LLaVA): the prompt's ids hold each image's placeholder tokens and
``images=`` (or ``pixel_values=``) the pixels; each result then also has ``image_attr``
(T, H, W) per image (:mod:`captum_transformers.generation.image_inputs`,
:mod:`captum_transformers.generation.vision_steps`)::

    >>> result = GenerationAttribution(GenericAttention(llava), tokenizer).attribute(ids, target=[5], images=pixels)
    >>> result.image_attr.shape, result.token_attr.shape     # (1, H, W), (1, text tokens)
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from captum.attr import Attribution
from captum.log import log_usage

from ..model_state import offload
from ..errors import InputError
from ..methods.base import finished
from ..methods.facts import GenerationSteps
from .assembly import assemble_results, encoder_decoder_model
from .batch import GenerationBatch, decoder_batch, encoder_decoder_batch, padding_id
from .engine import relevance_steps, streamed_pass_plan, trace_steps
from .generate import DEFAULT_GEN_ARGS, generated_targets, refuse_image_token_targets
from .image_inputs import (gathered_image_inputs, moved, placeholder_check, processor_images,
                           vision_language_adapter)
from .positions import refuse_positions_past_the_table
from .prefix_calls import prefix_scores
from .prompts import EncodedPrompt, encode_prompt, encode_target, prompt_list, refuse_unmasked_padding
from .result import GenerationResult
from .steps import SCORE_KINDS, ExplainedSteps, refuse_ids_outside_vocabulary
from .vision_steps import relevance_image_scores, vision_language_scores

Span = Union[slice, Sequence[int]]


def generation_steps(method: Any) -> GenerationSteps:
    """How ``method``'s class says it explains a generation step (``generation_steps``,
    :mod:`~captum_transformers.methods.facts`); an attribution that says nothing (not one of the
    package's) is called once per step on the prefix."""
    return GenerationSteps(getattr(type(method), "generation_steps", GenerationSteps.PREFIX_CALLS))


def _prompt_name(batched: bool) -> str:
    return "the longest prompt" if batched else "the prompt"


class GenerationAttribution(Attribution):
    r"""Explain each generated token of a language model with a method of the package.

    Args:
        method: a method instance built on the model (``AttnLRP(model)``, ``GenericAttention(model)``...).
        tokenizer: the model's tokenizer (a HuggingFace tokenizer: ``__call__``, ``decode``,
            ``convert_ids_to_tokens``, ``pad_token_id``).
        score: ``"logit"`` (default; what LRP conserves), ``"log_prob"`` (Captum's LLM target) or
            ``"prob"``.
        sink_tokens: how many first tokens ``first_token_share`` counts (attention sinks). A model
            with a learned sink slot (GPT-OSS) also gets ``sink_share``: the probability each
            row's query put on the slot (:class:`~captum_transformers.generation.result.GenerationResult`).

    ``attribute`` returns a :class:`~captum_transformers.generation.result.GenerationResult`
    (a ``captum.attr.LLMAttributionResult``) per prompt: one for a single prompt, a list for a
    list of prompts (explained in one batched pass, left padded, equal to the single calls).
    """

    def __init__(self, method: Any, tokenizer: Any, score: str = "logit", sink_tokens: int = 1) -> None:
        model = getattr(method, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"GenerationAttribution wraps a method of the package built on a model (e.g. "
                             f"AttnLRP(model)); got {type(method).__name__}, which has no .model.")
        if score not in SCORE_KINDS:
            raise InputError(f"score must be one of {SCORE_KINDS}, got {score!r}.")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 1:
            raise InputError(f"sink_tokens must be a positive int, got {sink_tokens!r}.")
        super().__init__(model)
        self.method, self.model, self.tokenizer = method, model, tokenizer
        self.score, self.sink_tokens = score, sink_tokens

    @log_usage()
    def attribute(self, inp: Any, target: Any = None, gen_args: Optional[Dict[str, Any]] = None, *,
                  contrast: Any = None, span: Optional[Span] = None, skip_tokens: Optional[Sequence[Any]] = None,
                  score: Optional[str] = None, images: Any = None,
                  **image_keywords: Any) -> Union[GenerationResult, List[GenerationResult]]:
        """Explain the target (or generated) tokens of one prompt or a list of prompts.

        Args:
            inp: a string, token ids (list, tensor, chat-template ids), Captum's ``TextTokenInput``
                or ``TextTemplateInput``; or a batch: a list of those, a (B, N) tensor of ids, or a
                tokenizer's padded batch (each row's padding, marked by its attention mask, removed);
                a vision-language processor's output (its ``pixel_values`` are the images). Id rows
                padded without a mask (runs of the pad id of different lengths at their start or
                end) are refused: give the tokenizer's dict. A prompt and output past a learned
                position table are refused (:mod:`~captum_transformers.generation.positions`);
                rotary and relative positions read any length.
            target: a string, token ids (in ``[0, vocabulary)`` of the model's head), or None (the
                model generates with ``gen_args``, greedy by default); for a batch, one per prompt.
            gen_args: ``generate`` arguments when ``target`` is None (default
                ``{"max_new_tokens": 25, "do_sample": False}``).
            contrast: foil tokens (a string or ids, one per target token, or one token for all):
                each step explains ``score(y_t) - score(foil_t)``.
            span: explain the SUM of the scores of these output steps (a slice or indices) in
                one backward pass; the result then has one row.
            skip_tokens: prompt tokens (strings or ids) left out of ``token_attr`` (e.g. BOS).
            score: overrides the instance's score kind for this call.
            images: a vision-language model's images: (C, H, W), (n, C, H, W), or for a batch a
                list with one entry per prompt (None, or an empty ``(0, C, H, W)`` stack, for a
                prompt without images); the prompts' ids hold their placeholder tokens. Given
                once: not together with ``pixel_values=`` or a processor output's images.
            image_keywords: the model's own image inputs instead (``pixel_values=``), for the batch;
                any other keyword is refused as unexpected.
        """
        kind = self.score if score is None else score
        if isinstance(inp, (list, tuple)) and not inp:
            raise InputError("inp is an empty list; give at least one prompt.")
        listed, batched = prompt_list(inp)
        prompts = [encode_prompt(p, self.tokenizer) for p in listed]
        refuse_unmasked_padding(inp, listed, prompts, self.tokenizer, self.model)
        encoder_decoder = encoder_decoder_model(self.model)
        self._refuse_foil_ids(contrast, batched, len(prompts))  # before any forward (a generation's too)
        adapter = vision_language_adapter(self.method)
        image_keywords = processor_images(inp, adapter, image_keywords, self.method)
        image_inputs = gathered_image_inputs(adapter, images, image_keywords, len(prompts), batched, self.method)
        placeholder_check(self.model, adapter, [p.ids for p in prompts], image_inputs)
        if image_inputs is not None:
            adapter.check_image_inputs(self.model, image_inputs)  # before generating a target with them
            image_inputs = moved(image_inputs, offload.input_device(self.model), offload.input_dtype(self.model))
        targets = self._targets(prompts, target, gen_args, batched, encoder_decoder, image_inputs)
        refuse_positions_past_the_table(self.model, max(len(p.ids) for p in prompts), max(len(t) for t in targets),
                                        encoder_decoder, _prompt_name(batched), "output tokens",
                                        "give at most {room} output token(s)")
        if image_inputs is not None:
            refuse_image_token_targets(targets, adapter.image_token_id(self.model), generated=target is None)
        batch = self._batch(prompts, targets, encoder_decoder)
        images_read = []
        if image_inputs is not None:
            batch = dataclasses.replace(batch, forward_kwargs={**batch.forward_kwargs, **image_inputs})
            images_read = adapter.images(self.model, batch.inputs[0], image_inputs)
        foils = self._foils(contrast, batch, batched)
        groups = None if span is None else (self._span(span, batch.targets.shape[1]),)
        steps = ExplainedSteps(batch.positions, batch.targets, kind, foils, groups)
        per_stream, logits = self._explain(batch, steps, adapter, images_read)
        image_token = None if adapter is None else adapter.image_token_id(self.model)
        results = assemble_results(self, prompts, batch, steps, per_stream, logits, skip_tokens, images_read,
                                   image_token)
        return results if batched else results[0]

    # -- inputs -----------------------------------------------------------------------
    def _targets(self, prompts: List[EncodedPrompt], target: Any, gen_args: Optional[dict], batched: bool,
                 encoder_decoder: bool, image_inputs: Optional[dict] = None) -> List[List[int]]:
        if target is None:
            new_tokens = (gen_args or DEFAULT_GEN_ARGS).get("max_new_tokens")
            known = isinstance(new_tokens, int) and not isinstance(new_tokens, bool) and new_tokens > 0
            refuse_positions_past_the_table(self.model, max(len(p.ids) for p in prompts), new_tokens if known else 1,
                                            encoder_decoder, _prompt_name(batched), "new tokens (max_new_tokens)",
                                            "give gen_args max_new_tokens at most {room}")
            return generated_targets(self.model, self.tokenizer, [p.ids for p in prompts], gen_args, encoder_decoder,
                                     image_inputs, vision_language_adapter(self.method))
        if gen_args is not None:
            raise InputError("gen_args is only used to generate a target; it was given together with a target.")
        if batched:
            if not isinstance(target, (list, tuple)) or len(target) != len(prompts) or \
                    all(isinstance(t, int) for t in target):
                raise InputError(f"For a batch of {len(prompts)} prompts, target must be a list of {len(prompts)} "
                                 f"targets (strings or token ids), one per prompt, or None; got {target!r:.80}.")
            targets = [encode_target(t, self.tokenizer) for t in target]
        else:
            targets = [encode_target(target, self.tokenizer)]
        refuse_ids_outside_vocabulary(targets, self.model, "target", batched)
        return targets

    def _refuse_foil_ids(self, contrast: Any, batched: bool, count: int) -> None:
        """Foil ids outside the output vocabulary, refused before any forward (their layout is
        checked by :meth:`_foils`, which this leaves to say what a malformed contrast lacks)."""
        foils = [contrast] if not batched else contrast
        if contrast is None or not isinstance(foils, (list, tuple)) or len(foils) != count:
            return
        refuse_ids_outside_vocabulary([encode_target(f, self.tokenizer) for f in foils], self.model, "contrast",
                                      batched)

    def _batch(self, prompts: List[EncodedPrompt], targets: List[List[int]], encoder_decoder: bool) -> GenerationBatch:
        device = offload.input_device(self.model)  # not meta (accelerate)
        pad = padding_id(self.tokenizer)
        ids = [p.ids for p in prompts]
        if encoder_decoder:
            start = getattr(self.model.config, "decoder_start_token_id", None)
            if start is None:
                raise InputError(f"{type(self.model).__name__}'s config has no decoder_start_token_id; set it.")
            return encoder_decoder_batch(ids, targets, pad, start, device)
        parameters = inspect.signature(type(self.model).forward).parameters
        # A forward taking **kwargs (a wrapper, a PEFT model) passes position_ids on to the model.
        takes_positions = "position_ids" in parameters or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        return decoder_batch(ids, targets, pad, device, position_ids=takes_positions)

    def _foils(self, contrast: Any, batch: GenerationBatch, batched: bool) -> Optional[torch.Tensor]:
        if contrast is None:
            return None
        foils = contrast if batched else [contrast]
        if not isinstance(foils, (list, tuple)) or len(foils) != len(batch.target_lengths):
            raise InputError(f"For a batch, contrast must be a list with one foil per prompt; got {contrast!r:.80}.")
        rows = []
        for foil, length in zip(foils, batch.target_lengths):
            ids = encode_target(foil, self.tokenizer)
            if len(ids) == 1:
                ids = ids * length
            if len(ids) != length:
                raise InputError(f"The contrast has {len(ids)} tokens but the target has {length}; give one foil token "
                                 "per target token, or a single token used at every step.")
            rows.append(ids + [ids[-1]] * (batch.targets.shape[1] - length))
        foils = torch.tensor(rows, dtype=torch.long, device=batch.targets.device)
        same = [(b, t) for b, length in enumerate(batch.target_lengths) for t in range(length)
                if int(foils[b, t]) == int(batch.targets[b, t])]
        if same:
            raise InputError(f"The foil equals the explained token at (prompt, step) {same[:5]}: the contrast is 0 there "
                             "and its explanation would be empty. Give a foil that differs from every target token.")
        return foils

    @staticmethod
    def _span(span: Span, steps: int) -> tuple:
        chosen = list(range(steps))[span] if isinstance(span, slice) else list(span)
        if not chosen or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < steps for t in chosen):
            raise InputError(f"span must select output steps in [0, {steps}) (a slice or a list of ints); got {span!r}.")
        if len(set(chosen)) != len(chosen):
            raise InputError(f"span names a step twice ({span!r}); each step's score is counted once.")
        return tuple(sorted(chosen))  # the group is read at its latest step's position

    # -- the engine -----------------------------------------------------------------------
    def _explain(self, batch: GenerationBatch, steps: ExplainedSteps, adapter: Any = None, images: list = ()):
        """Scores per explained group and stream, {stream: (G, B, N)} (a vision-language model's
        images too: ``"image:i"`` (G, V), ``"pixels:i"`` (G, H, W)), and the step logits."""
        method, collected = self.method, []
        kind = generation_steps(method)
        if images and kind is GenerationSteps.PREFIX_CALLS:
            raise InputError(f"{type(method).__name__} explains token ids one prefix call at a time and takes no "
                             "images; explain a vision-language model with the package's methods (AttnLRP, "
                             "ConservativeLRP, GenericAttention, ...).")
        keywords = tuple(adapter.image_input_names) if images else ()

        def keep(group: int, value: Any) -> None:
            if kind is GenerationSteps.TRACE:
                scores = vision_language_scores(method, value, images, adapter.feeding_calls(self.model)) \
                    if images else method.stream_scores(value)
            elif images:
                products = {name: value[f"input:{name}"] for name in keywords if f"input:{name}" in value}
                scores = relevance_image_scores(value, adapter.pixel_relevance(self.model, products, images), images)
            else:
                scores = value
            collected.append({name: finished(tensor.detach(), self.model) for name, tensor in scores.items()})

        if kind is GenerationSteps.TRACE:
            if getattr(method, "head_weights", None) == "all":  # AttentionGradCAM(head_weights="all")
                raise InputError("AttentionGradCAM(head_weights='all') weights each head by its gradient averaged over "
                                 "every query row of the sequence, so a step's map depends on the rows after it; use "
                                 "head_weights='row' (the default) for generation.")
            plan = streamed_pass_plan(method, batch.inputs, batch.forward_kwargs)
            with method.stochastic_rule():
                logits = trace_steps(method.adapter, self.model, batch.inputs, (), batch.forward_kwargs, steps, plan,
                                     keep)
        elif kind is GenerationSteps.RELEVANCE:
            if method.relevance_at == "inputs":
                raise InputError("Generation explains token ids: build the method with relevance_at='tokens' or "
                                 "'auto', not 'inputs'.")
            with method.stochastic_rule():
                logits = relevance_steps(method.adapter, self.model, batch.inputs, (), batch.forward_kwargs, steps,
                                         method.rules, keep, keywords)
        else:  # Captum's own methods, any other: one call per step on the prefix (each computes what it computes)
            logits = prefix_scores(method, batch, steps, keep)
        stacked = {name: torch.stack([c[name] for c in collected]) for name in collected[0]}
        return stacked, logits
