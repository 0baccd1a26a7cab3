"""Workspaces from what the command line names: the built-in model by default, any model
``cli.model_loading`` loads with ``--image`` / ``--text`` inputs.

Example::

    >>> workspace = builtin_workspace(samples=48)   # DigitCanvas test canvases, offline
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..errors import InputError
from .workspace import Workspace


def builtin_workspace(samples: int = 48, seed: int = 0) -> Workspace:
    """The built-in DigitCanvas ViT on ``samples`` test canvases (one digit each)."""
    if samples < 1:
        raise InputError(f"--samples {samples}: expected at least 1.")
    from ..cli.model_loading import load_model
    from ..tasks.digit_canvas import digit_canvases, normalize

    loaded = load_model(None)
    canvases = digit_canvases(split="test", variant="one", n=samples, seed=seed)
    return Workspace(loaded.model, (normalize(canvases.images),), list(canvases.images), "image",
                     labels=canvases.labels, class_names=loaded.class_names, name=loaded.name)


def loaded_workspace(model: Optional[str], arch: Optional[str] = None, random_init: bool = False,
                     images: Sequence[str] = (), texts: Sequence[str] = (), samples: int = 48) -> Workspace:
    """The workspace ``captum-transformers explore`` opens for these arguments."""
    if images and texts:
        raise InputError("give either --image or --text, not both.")
    if model is None and not images and not texts:
        return builtin_workspace(samples)
    from ..cli.model_loading import load_model, read_image

    loaded = load_model(model, arch, random_init)
    if loaded.modality == "image" and texts:
        raise InputError(f"{loaded.name} is an image model but got --text; give --image FILE or a text model.")
    if loaded.modality == "text" and images:
        raise InputError(f"{loaded.name} is a text model but got --image; give --text STRING or an image model.")
    if not images and not texts:
        raise InputError(f"nothing to explore: give --image FILE or --text STRING (repeatable) for {loaded.name}.")
    raws = [read_image(path) for path in images] if images else list(texts)
    inputs, forward_kwargs, displays = loaded.prepare(raws)
    classes = loaded.class_names
    if classes is None:
        import torch

        with torch.no_grad():
            from ..capture.targets import output_scores

            out = output_scores(loaded.model(*inputs, **forward_kwargs))
        classes = [str(c) for c in range((out[0] if isinstance(out, (tuple, list)) else out).shape[-1])]
    return Workspace(loaded.model, tuple(inputs), displays, loaded.modality, class_names=classes,
                     forward_kwargs=forward_kwargs, name=loaded.name, special_tokens=loaded.special_tokens)
