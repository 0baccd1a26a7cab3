"""What both explorer pages' workspaces use to explain: the catalog's methods and the stop
check that cancels a job.

``catalog_builder`` builds a catalog method for a model (the default ``method_builder`` of
both workspaces); ``available_methods`` names those that can explain a model. ``stoppable``
is the context a workspace explains in: every torch operation of the thread first asks the
job's ``should_stop``, and once it is true the explanation raises ``Cancelled``.

Example::

    >>> with stoppable(lambda: cancelled.is_set()):   # raises Cancelled once the event is set
    ...     maps = catalog_builder("rollout", model, {}).attribute(pixels, target=3)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Mapping, Optional

from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import CaptumTransformersError
from ..methods.catalog import METHOD_FACTORIES, resolve_method_names


class Cancelled(BaseException):
    """An explanation stopped because its job was cancelled (``should_stop`` turned true).
    A ``BaseException`` (as ``KeyboardInterrupt``): code that catches ``Exception`` around a
    probe or a fallback must not swallow it and go on computing."""


#: Torch calls that only set or read state, never compute: the stop check does not fire on
#: them (see ``_StopCheck``). ``__get__`` / ``__set__`` are tensor attribute reads and writes
#: (``.requires_grad``, ``.grad``, ``.data``).
_STATE_SETTERS = frozenset({"requires_grad_", "_set_grad_enabled", "set_grad_enabled", "_set_fwd_grad_enabled",
                            "__get__", "__set__", "__delete__", "register_hook"})


def _name_of(func) -> str:
    return getattr(func, "__name__", "") or ""


class _StopCheck(TorchFunctionMode):
    """Asks ``should_stop`` before each torch function this thread runs (torch-function modes
    are per thread), raising ``Cancelled`` once it is true. It changes no model and no result:
    every call goes on unchanged.

    It raises ONCE: the explanation then unwinds through the package's context managers, and
    their cleanup runs torch calls too (``Tensor.requires_grad_`` restoring a frozen
    parameter, ``torch._C._set_grad_enabled`` leaving ``no_grad``); raising again there would
    stop that cleanup half-way and leave the model and the thread changed. For the same
    reason it never fires on a call that only sets state (``_STATE_SETTERS``): such a call
    may be the first of a cleanup that has already begun, and the stop waits for the next
    computing call instead."""

    def __init__(self, should_stop: Callable[[], bool]) -> None:
        super().__init__()
        self.should_stop = should_stop
        self.fired = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.fired and _name_of(func) not in _STATE_SETTERS and self.should_stop():
            self.fired = True
            raise Cancelled()
        return func(*args, **(kwargs or {}))


def catalog_builder(name: str, model: nn.Module, arguments: Mapping[str, Any]):
    """The catalog's attribution ``name`` for ``model``, built with ``arguments``."""
    resolve_method_names([name])  # an unknown name is an InputError listing the known ones
    return METHOD_FACTORIES[name](model, **arguments)


def available_methods(model: nn.Module) -> List[str]:
    """The catalog names that can explain ``model``: every method when an adapter knows it,
    else Captum's baselines only (a model with no attention, e.g. a CNN)."""
    from ..adapters.registry import get_adapter
    from ..methods.catalog import CAPTUM_BASELINES, METHOD_NAMES

    try:
        get_adapter(model)
    except CaptumTransformersError:
        return [name for name in METHOD_NAMES if name in CAPTUM_BASELINES]
    return list(METHOD_NAMES)


def stoppable(should_stop: Optional[Callable[[], bool]]):
    """A context in which every torch operation of this thread first asks ``should_stop``
    (``_StopCheck``): a cancelled job stops inside the forward pass it is in (Integrated
    Gradients' internal batch, or a method's single pass) instead of after every step. Its
    ``fired`` attribute says whether it raised ``Cancelled`` (a no-op context without
    ``should_stop``). No hook is put on the model: the package treats hooks present when an
    explanation starts as the user's and runs them outside it."""
    return contextlib.nullcontext() if should_stop is None else _StopCheck(should_stop)
