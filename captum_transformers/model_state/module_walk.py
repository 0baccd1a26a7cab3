"""One walk of a model's modules per explanation.

An explanation asks about the model's modules a dozen times (which classes a library patched,
which modules are compiled, where the configs, norms, activations and attention blocks are);
each ``model.modules()`` walks the whole tree in Python, which on a small model cost about as
much as a few percent of its forward pass, per call. :func:`exclusive` holds the model while
an explanation runs and publishes the walk it makes anyway; :func:`named_modules` answers
from it for that model in this thread, and walks afresh otherwise. The tree is not changed by
anything while the model is held (patches replace attributes, not children).

Facts that follow from the tree alone (where the attention blocks and the HF configs are),
asked several times per explanation, are computed once per hold by :func:`per_walk`.

Example::

    >>> with walked(model, list(model.named_modules())):
    ...     named_modules(model)        # the list above, no walk
    ...     per_walk(model, "blocks", lambda: find_blocks(model))   # found once inside the context
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple

from torch import nn

NamedModules = List[Tuple[str, nn.Module]]

_WALK: contextvars.ContextVar[Optional[Tuple[nn.Module, NamedModules, Dict[Hashable, Any]]]] = \
    contextvars.ContextVar("captum_transformers_module_walk", default=None)


@contextlib.contextmanager
def walked(model: nn.Module, walk: NamedModules) -> Iterator[None]:
    """Answer :func:`named_modules` for ``model`` from ``walk`` inside the context (this thread)."""
    token = _WALK.set((model, walk, {}))
    try:
        yield
    finally:
        _WALK.reset(token)


def named_modules(model: nn.Module) -> NamedModules:
    """``list(model.named_modules())``, from the walk published for ``model`` when there is one."""
    current = _WALK.get()
    if current is not None and current[0] is model:
        return current[1]
    return list(model.named_modules())


def modules(model: nn.Module) -> List[nn.Module]:
    """``list(model.modules())``, from the published walk when there is one."""
    return [module for _, module in named_modules(model)]


def is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` has no child module (``next(module.children(), None) is None``, read
    from its own dict: asked of every module in a walk, per explanation)."""
    return all(child is None for child in module._modules.values())


def per_walk(model: nn.Module, key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, remembered under ``key`` while the walk of ``model`` is published (one
    explanation); computed afresh outside. Only for answers that depend on the module tree
    alone (not on parameter values or flags, which may change between the questions)."""
    current = _WALK.get()
    if current is None or current[0] is not model:
        return compute()
    memo = current[2]
    if key not in memo:
        memo[key] = compute()
    return memo[key]
