"""The corpus job for language models: prompts in, generated answers and per-token maps out.

``explain_generations(model, tokenizer, prompts, method, out)`` lets the model answer every
prompt of a :class:`~.sources.PromptSource` greedily (``max_new_tokens`` at most, cut after its
end-of-sequence token) and explains each answer token with
:class:`~captum_transformers.generation.GenerationAttribution` over the prompt and the tokens
before it: one call per batch of ``batch_size`` prompts (one batched generation, then one
forward pass and one backward pass per output step for the whole batch). Each row of the store
holds what ``GenerationAttribution(method, tokenizer).attribute(prompt)`` returns for that
prompt alone (equal to it up to float32 rounding of a batched pass; bit for bit at
``batch_size=1``), in the columns :data:`~.store.GENERATION_SCHEMA_DOC` documents. Shards,
manifest, resumption and ``torchrun`` ranks are the classifier job's (:func:`~.job.run_shards`).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

from torch import nn

from ..errors import InputError
from ..methods.catalog import CAPTUM_BASELINES, build_method, catalog_entry
from .job import CorpusRun, job_settings, run_shards
from .sources import PromptSource

SCORES = ("logit", "log_prob", "prob")


def tokenizer_sha256(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's class and vocabulary (token -> id): two tokenizers that split
    the same text into other ids give other maps, so a resumed run must use the same one."""
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else getattr(tokenizer, "vocab", None)
    if not isinstance(vocabulary, dict):
        raise InputError(f"{type(tokenizer).__name__} has no get_vocab(); a generation job needs a HuggingFace "
                         "tokenizer (its vocabulary is part of the run's provenance).")
    payload = json.dumps({"class": type(tokenizer).__name__, "vocab": sorted(vocabulary.items())})
    return hashlib.sha256(payload.encode()).hexdigest()


def explain_generations(model: nn.Module, tokenizer: Any, source: PromptSource, method: str,
                        out: Union[str, Path], *, max_new_tokens: int = 20, score: str = "logit",
                        batch_size: int = 8, shard_rows: int = 256, rank: Optional[int] = None,
                        world_size: Optional[int] = None, progress: bool = True) -> CorpusRun:
    """Generate an answer to every prompt of ``source`` and explain its tokens with the catalog
    method ``method``, written to the store ``out`` (kind ``"generation"``).

    ``score``: what each step explains (``"logit"``, ``"log_prob"`` or ``"prob"`` of the output
    token). Resuming, refusal of other settings (now also the tokenizer, ``max_new_tokens`` and
    ``score``) and ``torchrun`` ranks work as in :func:`~.job.explain_dataset`.
    """
    if not isinstance(source, PromptSource):
        raise InputError(f"explain_generations reads a PromptSource (recall_prompt_source, prompt_table_source), "
                         f"received {type(source).__name__}; classifier inputs go to explain_dataset.")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, received {max_new_tokens!r}.")
    if score not in SCORES:
        raise InputError(f"score must be one of {SCORES}, received {score!r}.")
    catalog_entry(method)  # an unknown name is refused before any work
    if method in CAPTUM_BASELINES and score != "logit":  # before the folder is claimed for this run
        raise InputError(f"{method} explains the next-token logit only (one Captum call per step on the prefix); "
                         f"use score='logit' with it, or a method of the package for score={score!r}.")
    from ..generation import GenerationAttribution

    settings = job_settings(model, "generation", method, source.fingerprint, source.rows, shard_rows, batch_size,
                            tokenizer_sha256=tokenizer_sha256(tokenizer), max_new_tokens=max_new_tokens, score=score)
    explainer = GenerationAttribution(build_method(method, model), tokenizer, score=score)
    gen_args = {"max_new_tokens": max_new_tokens, "do_sample": False}

    def explain_rows(low: int, high: int) -> Dict[str, list]:
        prompts = source.prompts(low, high)
        results = explainer.attribute(prompts, gen_args=gen_args)
        columns: Dict[str, list] = {name: [] for name in (
            "row_id", "prompt", "input_tokens", "input_ids", "output_tokens", "output_ids", "token_attr",
            "target_attr", "target_attr_tokens", "scores", "output_probs", "method")}
        for offset, (prompt, result) in enumerate(zip(prompts, results)):
            columns["row_id"].append(low + offset)
            columns["prompt"].append(prompt)
            columns["input_tokens"].append([str(t) for t in result.input_tokens])
            columns["input_ids"].append([int(i) for i in result.input_ids])
            columns["output_tokens"].append([str(t) for t in result.output_tokens])
            columns["output_ids"].append([int(i) for i in result.output_ids])
            columns["token_attr"].append(result.token_attr.detach().float().cpu().reshape(-1).numpy())
            columns["target_attr"].append(result.target_attr.detach().float().cpu().reshape(-1).numpy())
            columns["target_attr_tokens"].append([str(t) for t in result.target_attr_tokens])
            columns["scores"].append(result.scores.detach().double().cpu().tolist())
            columns["output_probs"].append(result.output_probs.detach().double().cpu().tolist())
            columns["method"].append(method)
        return columns

    return run_shards(model, out, settings, explain_rows, rank=rank, world_size=world_size, progress=progress)
