"""What the explorer's generation page explains: a causal LM, its tokenizer and cached generations.

A :class:`GenerationWorkspace` answers one kind of request, a :class:`GenerationRequest`
(a prompt, how many tokens to generate greedily, the explained score), with one
:class:`~captum_transformers.generation.GenerationAttribution` per method. Each row ``t`` of a
result explains the score of generated token ``y_t`` given the prompt ``x`` and ``y_{<t}``:

.. math:: \\text{token\\_attr}[t] = \\mathcal{A}(s_t)|_x, \\qquad \\text{target\\_attr}[t] = \\mathcal{A}(s_t)|_{y_{<t}}

with ``s_t`` the logit, the log-probability, or the contrast ``logit(y_t) - logit(foil_t)``.
The greedy answer of a prompt is generated once and reused by every method (so the rows of
two methods explain the same tokens); results are cached per (request, method, arguments).

Bounds (each refused with an ``InputError`` naming it and the fix): a prompt of at most
``max_prompt_tokens`` tokens, at most ``max_new_tokens`` new tokens (``MAX_NEW_TOKENS``, or
fewer where the model's positions run out), and the work of a request, methods x new tokens
x ``n_steps``, within ``method_arguments.WORK_BUDGET`` (``check_generation_work``).

It has the ``cached`` / ``explain`` pair that ``jobs.Jobs`` runs, with ``targets`` holding
the one request as ``{0: request}``, so generation jobs are polled and cancelled as the
classifier's are.

Example::

    >>> workspace = GenerationWorkspace(model, tokenizer, name="recall Llama", samples=["a red fox ; b tan cat ? b"])
    >>> request = workspace.check_request({"prompt": "a red fox ; b tan cat ? b", "max_new_tokens": 3})
    >>> payload = workspace.explain("attn-lrp", {}, {0: request})[0]
    >>> payload["output_tokens"], payload["token_attr"]["shape"]     # (['tan', 'cat', '<eos>'], [3, 10])
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ....errors import InputError
from ....generation import GenerationAttribution
from ....generation.generate import generated_targets
from ....generation.prompts import encode_prompt
from ....generation.positions import position_limit
from ...explaining import Cancelled, catalog_builder, stoppable
from ...method_arguments import WORK_BUDGET, arguments_key, checked_arguments, constructor_arguments

#: The most tokens one request may generate (the page's default is the model's own, if smaller).
MAX_NEW_TOKENS = 16
#: The most prompt tokens, where the model's positions do not bound them lower.
MAX_PROMPT_TOKENS = 256
#: The most characters of a prompt or a foil (checked before tokenizing).
MAX_PROMPT_CHARACTERS = 4000
#: What the page offers as the explained score ("contrast": logit(y_t) - logit(foil_t)).
SCORES = ("logit", "log_prob", "contrast")
#: Results and generations kept (least recently computed dropped first).
MAX_CACHED = 512


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to generate from and explain: ``score`` one of ``SCORES``; ``contrast`` the
    foil text (one token, or one per generated token) when ``score == "contrast"``, else ``""``."""

    prompt: str
    max_new_tokens: int
    score: str = "logit"
    contrast: str = ""


def check_generation_work(requests: Sequence[Tuple[str, Mapping[str, Any]]], new_tokens: int) -> None:
    """Refuse a request whose work, new tokens x ``n_steps`` (1 without steps) summed over its
    methods, exceeds ``WORK_BUDGET``, saying how to fit it."""
    work = sum(new_tokens * int(arguments.get("n_steps") or 1) for _, arguments in requests)
    if work > WORK_BUDGET:
        raise InputError(f"this request asks for {work} explained steps ({new_tokens} new token(s) x n_steps, summed "
                         f"over {len(requests)} method(s)); the explorer's budget is {WORK_BUDGET} per request. Lower "
                         "max_new_tokens or n_steps, or pick fewer methods.")


def _text(body: Mapping[str, Any], key: str, default: str = "") -> str:
    value = body.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, str):
        raise InputError(f'"{key}" must be a string, received a {type(value).__name__}.')
    if len(value) > MAX_PROMPT_CHARACTERS:
        raise InputError(f'"{key}" has {len(value)} characters; at most {MAX_PROMPT_CHARACTERS} are taken. Shorten it.')
    return value


class GenerationWorkspace:
    """A causal LM and its tokenizer to explore (see the module docstring).

    ``samples``: prompts the page offers to pick; ``method_builder(name, model, arguments)``
    builds a method (the catalog by default); ``max_new_tokens``: the bound on new tokens
    (default ``MAX_NEW_TOKENS``); ``default_new_tokens``: what the page starts with.
    """

    modality = "generation"

    def __init__(self, model: nn.Module, tokenizer: Any, name: str = "language model", samples: Sequence[str] = (),
                 method_builder: Callable = catalog_builder, max_new_tokens: int = MAX_NEW_TOKENS,
                 default_new_tokens: Optional[int] = None) -> None:
        from ....generation.assembly import encoder_decoder_model

        if not callable(getattr(model, "generate", None)) or encoder_decoder_model(model):
            raise InputError(f"{type(model).__name__} is not a causal language model (no generate(), or a source and a "
                             "decoder sequence); the generation page shows decoder-only models (AutoModelForCausalLM). "
                             "Explain encoder-decoders with GenerationAttribution or `explain --prompt`.")
        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.samples = [str(sample) for sample in samples]
        self.method_builder = method_builder
        # Only a learned position table limits the length (generation.positions, the API's and the
        # CLI's rule); a prompt of P tokens and T outputs reads P + T - 1 positions.
        positions = position_limit(model)
        self.max_new_tokens = max_new_tokens if positions is None else max(1, min(max_new_tokens, positions // 4))
        self.max_prompt_tokens = MAX_PROMPT_TOKENS if positions is None else \
            max(1, min(MAX_PROMPT_TOKENS, positions - self.max_new_tokens + 1))
        self.default_new_tokens = min(default_new_tokens or self.max_new_tokens, self.max_new_tokens)
        self._cache: "OrderedDict[tuple, Any]" = OrderedDict()
        self._lock = threading.Lock()

    # -- requests --------------------------------------------------------------------------
    def check_request(self, body: Mapping[str, Any]) -> GenerationRequest:
        """``{"prompt", "max_new_tokens", "score", "contrast"}`` from the page, checked against the bounds."""
        prompt = _text(body, "prompt")
        if not prompt.strip():
            raise InputError('"prompt" is empty; type a prompt (or pick a sample) to generate from.')
        new_tokens = body.get("max_new_tokens", self.default_new_tokens)
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise InputError(f'"max_new_tokens" must be a whole number from 1 to {self.max_new_tokens}, received '
                             f"{new_tokens!r}.")
        if new_tokens > self.max_new_tokens:
            raise InputError(f"max_new_tokens={new_tokens} is over the explorer's bound of {self.max_new_tokens} new "
                             f"tokens for {self.name}; ask for {self.max_new_tokens} or fewer.")
        score = body.get("score", "logit")
        if score not in SCORES:
            raise InputError(f'"score" must be one of {", ".join(SCORES)}, received {str(score)[:40]!r}.')
        contrast = _text(body, "contrast")
        if score == "contrast" and not contrast.strip():
            raise InputError('score "contrast" needs a foil in "contrast" (one token, or one per generated token): '
                             "each step then explains logit(token) - logit(foil).")
        if score != "contrast" and contrast:
            raise InputError(f'"contrast" is only read with score "contrast" (received score {score!r}); pick score '
                             '"contrast" or leave the foil empty.')
        count = len(self.prompt_ids(prompt))
        if count > self.max_prompt_tokens:
            raise InputError(f"the prompt has {count} tokens; the explorer's bound is {self.max_prompt_tokens} prompt "
                             f"tokens for {self.name}. Shorten the prompt.")
        return GenerationRequest(prompt, new_tokens, score, contrast if score == "contrast" else "")

    def prompt_ids(self, prompt: str) -> List[int]:
        """The prompt's token ids as the model reads them (special tokens included)."""
        return list(encode_prompt(prompt, self.tokenizer).ids)

    # -- generating and explaining ---------------------------------------------------------
    def generated(self, request: GenerationRequest) -> List[int]:
        """The greedy answer of ``request`` (cut after its end token), generated once."""
        key = ("generated", request.prompt, request.max_new_tokens)
        with self._lock:
            found = self._cache.get(key)
        if found is None:
            found = generated_targets(self.model, self.tokenizer, [self.prompt_ids(request.prompt)],
                                      {"max_new_tokens": request.max_new_tokens, "do_sample": False}, False)[0]
            self._keep(key, found)
        return list(found)

    def cached(self, method: str, arguments: Mapping[str, Any], targets: Mapping[int, GenerationRequest]) -> Dict:
        """The results of ``explain(method, arguments, targets)`` already cached (computes nothing)."""
        key = arguments_key(checked_arguments(method, arguments))
        with self._lock:
            found = {index: self._cache.get((request, method, key)) for index, request in targets.items()}
        return {index: value for index, value in found.items() if value is not None}

    def explain(self, method: str, arguments: Mapping[str, Any], targets: Mapping[int, GenerationRequest],
                should_stop: Optional[Callable[[], bool]] = None) -> Dict[int, Dict[str, Any]]:
        """Per request, ``method``'s explanation of its greedy answer as a JSON-safe dict (see
        ``result_payload``). ``should_stop``: as ``Workspace.explain``'s (a cancelled job raises
        ``Cancelled`` and caches nothing)."""
        checked = checked_arguments(method, arguments)
        key = arguments_key(checked)
        out = {}
        for index, request in targets.items():
            with self._lock:
                found = self._cache.get((request, method, key))
            if found is None:
                found = self._explain_one(method, checked, request, should_stop)
                self._keep((request, method, key), found)
            out[index] = found
        return out

    def _explain_one(self, method: str, checked: Mapping[str, Any], request: GenerationRequest,
                     should_stop: Optional[Callable[[], bool]]) -> Dict[str, Any]:
        stop_check = stoppable(should_stop)
        with stop_check:
            target = self.generated(request)
            explainer = self.method_builder(method, self.model, constructor_arguments(method, checked))
            score = "logit" if request.score == "contrast" else request.score
            result = GenerationAttribution(explainer, self.tokenizer, score=score).attribute(
                request.prompt, target=target, contrast=request.contrast or None)
        if getattr(stop_check, "fired", False):
            raise Cancelled()  # a stop swallowed by code that went on: nothing of it is returned
        if not (torch.isfinite(result.token_attr).all() and torch.isfinite(result.target_attr).all()):
            raise InputError(f"{method}'s explanation of this generation holds NaN or infinite values; it is not "
                             "drawn. Try another method or score.")
        payload = result_payload(result)
        payload.update(request={"prompt": request.prompt, "max_new_tokens": request.max_new_tokens,
                                "score": request.score, "contrast": request.contrast}, method_name=method,
                       arguments=dict(checked))
        return payload

    def _keep(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._cache[key] = value
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)


def result_payload(result) -> Dict[str, Any]:
    """A ``GenerationResult`` as the page reads it: the serialization module's dict."""
    from ....generation.serialization import result_to_dict

    return result_to_dict(result)
