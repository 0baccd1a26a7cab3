"""Generation workspaces from what the command line names: the built-in recall Llama, or a
HuggingFace causal-LM folder (``--model``), with ``--prompt`` texts offered as samples.

``explore`` opens the generation page when ``--prompt`` or ``--generation`` is given, or when
``--model`` is a folder whose ``config.json`` names a causal LM (``causal_lm_folder``).

Example::

    >>> workspace = builtin_generation_workspace()          # shipped weights, offline
    >>> workspace.samples[0]                                # 'c red fox ; q blue owl ; ... ? h'
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ....errors import InputError
from ...loading import LoadingWorkspace
from .workspace import GenerationWorkspace

#: Sample prompts of the built-in model offered on the page (test split: unseen in training).
BUILTIN_SAMPLES = 6
#: Architecture names that generate left to right (``config.json``'s ``architectures``).
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class LoadingGenerationWorkspace(LoadingWorkspace):
    """A ``LoadingWorkspace`` building a ``GenerationWorkspace``: the explorer serves the
    generation page for it (``explorer.app.PAGES`` picks the page by the workspace's type)."""


def causal_lm_folder(spec: Optional[str]) -> bool:
    """Whether ``spec`` is a local folder whose ``config.json`` names a causal-LM architecture."""
    if not spec:
        return False
    config = Path(spec) / "config.json"
    try:
        names = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(isinstance(name, str) and name.endswith(CAUSAL_SUFFIXES) for name in names)


def builtin_generation_workspace(prompts: Sequence[str] = (), device=None) -> GenerationWorkspace:
    """The shipped recall Llama (``tasks.recall.model``) with ``prompts`` and a few test prompts
    of its task as samples; missing weights are an ``InputError`` naming the training command."""
    from ....model_loading import on_device
    from ....tasks.recall.model import MAX_NEW_TOKENS, load_recall_model
    from ....tasks.recall.task import recall_examples

    model, tokenizer = load_recall_model()
    model, _, _ = on_device(device, model, ())
    samples = list(prompts) + [example.prompt for example in recall_examples(BUILTIN_SAMPLES, seed=0, split="test")]
    return GenerationWorkspace(model, tokenizer, name="built-in recall Llama", samples=samples,
                               default_new_tokens=MAX_NEW_TOKENS)


def loaded_generation_workspace(model: Optional[str], prompts: Sequence[str] = (), device=None) -> GenerationWorkspace:
    """The workspace of ``explore --prompt``/``--generation``: the built-in model without
    ``--model``, else a causal-LM folder loaded with ``AutoModelForCausalLM`` and its tokenizer."""
    if model is None:
        return builtin_generation_workspace(prompts, device)
    if not causal_lm_folder(model):
        raise InputError(f"--model {model!r} is not a folder whose config.json names a causal LM (an architecture "
                         f"ending in {' or '.join(CAUSAL_SUFFIXES)}); the generation page needs one saved with "
                         "save_pretrained, or no --model for the built-in recall Llama.")
    import transformers

    from ....model_loading import on_device

    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(model)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise InputError(f"--model {model!r} could not be loaded as a causal LM with its tokenizer "
                         f"({type(error).__name__}: {str(error).splitlines()[0][:160]}).") from None
    loaded, _, _ = on_device(device, loaded, ())
    return GenerationWorkspace(loaded, tokenizer, name=Path(model).name or str(model), samples=list(prompts))
