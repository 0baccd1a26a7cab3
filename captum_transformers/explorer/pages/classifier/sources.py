"""Workspaces from what the command line names: the built-in model by default, a benchmark
task (``--task``), or any model ``model_loading`` loads with ``--image`` / ``--text`` inputs.

Example::

    >>> workspace = builtin_workspace(samples=48)   # DigitCanvas test canvases, offline
"""
from __future__ import annotations

from typing import Optional, Sequence

from ....model_loading import on_device
from ....errors import InputError
from .workspace import Workspace


def builtin_workspace(samples: int = 48, seed: int = 0, variant: str = "one", device=None) -> Workspace:
    """The built-in DigitCanvas ViT on ``samples`` test canvases (``variant`` "one" digit each,
    or "two": both digits are true labels)."""
    if samples < 1:
        raise InputError(f"--samples {samples}: expected at least 1.")
    from ....model_loading import load_model
    from ....tasks.digits.canvas import digit_canvases, normalize

    loaded = load_model(None)
    canvases = digit_canvases(split="test", variant=variant, n=samples, seed=seed)
    name = loaded.name if variant == "one" else f"{loaded.name}, two-digit canvases"
    model, inputs, _ = on_device(device, loaded.model, (normalize(canvases.images),))
    return Workspace(model, inputs, list(canvases.images), "image",
                     labels=canvases.labels, class_names=loaded.class_names, name=name)


def movie_workspace(samples: int = 48, cache_dir: Optional[str] = None, device=None) -> Workspace:
    """The fine-tuned MiniLM on ``samples`` movie-snippet test sentences (from the cache of
    ``captum-transformers benchmark --task movies``; a missing model is an error naming the
    training command, never a silent training run)."""
    from ....tasks.movies.model import load_movie_model
    from ....tasks.movies.snippets import encode, load_movie_snippets

    data = load_movie_snippets(split="test", limit=samples, cache_dir=cache_dir)
    model, tokenizer = load_movie_model(cache_dir, train_if_missing=False)
    encoded = encode(data, tokenizer)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    tokens = [tokenizer.convert_ids_to_tokens(row[keep.bool()]) for row, keep in zip(ids, mask)]
    model, inputs, forward_kwargs = on_device(device, model, (ids,), {"attention_mask": mask})
    return Workspace(model, inputs, tokens, "text", labels=data.labels, class_names=["negative", "positive"],
                     forward_kwargs=forward_kwargs, name="fine-tuned MiniLM, movie snippets",
                     special_tokens=frozenset(tokenizer.all_special_tokens),
                     removed_token_id=tokenizer.unk_token_id)  # as the benchmark's token metrics


def task_workspace(task: str, samples: int = 48, cache_dir: Optional[str] = None, device=None) -> Workspace:
    """The workspace of a benchmark task name (``tasks.runner.TASKS``)."""
    if task == "digits":
        return builtin_workspace(samples, device=device)
    if task == "digits-two":
        return builtin_workspace(samples, variant="two", device=device)
    if task == "movies":
        return movie_workspace(samples, cache_dir, device)
    from ....tasks.runner import TASKS

    raise InputError(f"--task {task!r}: expected one of {', '.join(TASKS)}.")


def loaded_workspace(model: Optional[str], arch: Optional[str] = None, random_init: bool = False,
                     images: Sequence[str] = (), texts: Sequence[str] = (), samples: int = 48,
                     task: Optional[str] = None, cache_dir: Optional[str] = None, device=None,
                     trust_pickle: bool = False) -> Workspace:
    """The workspace ``captum-transformers explore`` opens for these arguments, its model on
    ``device`` (a checked ``torch.device``; default the CPU); ``trust_pickle``: as for
    ``model_loading.load_model`` (``--trust-pickle``: a checkpoint file read as a full pickle runs
    its code)."""
    if images and texts:
        raise InputError("give either --image or --text, not both.")
    if task is not None:
        if model is not None or images or texts:
            raise InputError(f"--task {task} brings its own model and inputs; give either --task or --model with "
                             "--image/--text.")
        return task_workspace(task, samples, cache_dir, device)
    if model is None and not images and not texts:
        return builtin_workspace(samples, device=device)
    from ....model_loading import load_model, read_image

    loaded = load_model(model, arch, random_init, trust_pickle=trust_pickle)
    if loaded.modality == "image" and texts:
        raise InputError(f"{loaded.name} is an image model but got --text; give --image FILE or a text model.")
    if loaded.modality == "text" and images:
        raise InputError(f"{loaded.name} is a text model but got --image; give --text STRING or an image model.")
    if not images and not texts:
        raise InputError(f"nothing to explore: give --image FILE or --text STRING (repeatable) for {loaded.name}.")
    raws = [read_image(path) for path in images] if images else list(texts)
    inputs, forward_kwargs, displays = loaded.prepare(raws)
    model, inputs, forward_kwargs = on_device(device, loaded.model, inputs, forward_kwargs)
    classes = loaded.class_names
    if classes is None:
        import torch

        with torch.no_grad():
            from ....capture.targets import output_scores

            out = output_scores(model(*inputs, **forward_kwargs))
        classes = [str(c) for c in range((out[0] if isinstance(out, (tuple, list)) else out).shape[-1])]
    return Workspace(model, tuple(inputs), displays, loaded.modality, class_names=classes,
                     forward_kwargs=forward_kwargs, name=loaded.name, special_tokens=loaded.special_tokens)
