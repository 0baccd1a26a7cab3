"""One explanation of a module at a time: the modules of an explained model are held by one thread.

Patches act only in the thread that made them (:mod:`.patching`), but two explanations
patching the *same* module would still restore it in the wrong order, and interleave their
recordings. :func:`exclusive` makes a second thread explaining the model, or any model that
shares a module with it, wait until the first is done. In the same thread, an explanation of
another model from a hook on the explained model's modules runs isolated from this one (the
user's hooks are wrapped through :mod:`.patching`, see :mod:`.isolation`); one of the same
model, or of a model sharing a module with it, is refused (:class:`CaptureError`).

Example::

    >>> with exclusive(model):      # another thread's exclusive(model) waits here
    ...     explain_once(model)
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Tuple

from torch import nn

from ..errors import CaptureError
from . import isolation, patching
from .module_walk import walked

# id(module) -> [thread holding it, how many nested exclusive() contexts of that thread].
_HOLDERS: Dict[int, List[int]] = {}
_HOLDERS_CHANGED = threading.Condition()
# This thread's explanations now running, outermost first: (model class name, its module ids).
_RUNNING = threading.local()


@contextlib.contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """Hold every module of ``model`` for this thread until the context exits.

    All modules are taken at once (or none), so two explanations of overlapping models
    cannot deadlock; the holding thread may re-enter (the package nests its own contexts).
    """
    isolation.refuse_nested(model, ())
    me = threading.get_ident()
    with _HOLDERS_CHANGED:
        root = _HOLDERS.get(id(model))
        nested = root is not None and root[0] == me
        if nested:  # this thread took every module of model already: count the root only
            root[1] += 1
    if nested:
        # Each explanation enters several nested contexts; walking the modules for each cost a
        # small model's explanation as much as its forward pass.
        try:
            yield
        finally:
            with _HOLDERS_CHANGED:
                root[1] -= 1
        return
    walk = list(model.named_modules())
    ids = [id(module) for _, module in walk]
    isolation.refuse_nested(model, ids)
    running = _running_here()
    _refuse_unisolated(model, running)
    with _HOLDERS_CHANGED:
        _HOLDERS_CHANGED.wait_for(lambda: all(_HOLDERS.get(i, (me,))[0] == me for i in ids))
        for i in ids:
            holder = _HOLDERS.setdefault(i, [me, 0])
            holder[1] += 1
    running.append((type(model).__name__, frozenset(ids)))
    try:
        # The user's hooks on the model run outside the explanation (another model explained there
        # gets none of this one's rules); the explanation's other questions about the modules read this walk.
        with patching.user_hooks_isolated((module for _, module in walk), frozenset(ids)), walked(model, walk):
            yield
    finally:
        running.pop()
        with _HOLDERS_CHANGED:
            for i in ids:
                holder = _HOLDERS[i]
                holder[1] -= 1
                if holder[1] == 0:
                    del _HOLDERS[i]
            _HOLDERS_CHANGED.notify_all()


def _running_here() -> List[Tuple[str, FrozenSet[int]]]:
    running = getattr(_RUNNING, "explanations", None)
    if running is None:
        running = _RUNNING.explanations = []
    return running


def _refuse_unisolated(model: nn.Module, running: List[Tuple[str, FrozenSet[int]]]) -> None:
    """:class:`CaptureError` if another explanation runs in this thread and ``model``'s would
    start outside an isolated hook of it (a tensor hook, a global module hook, the outer
    model's own code, a user's ``adapter.propagation`` block): its rules, recorder and backward
    switch would reach this one."""
    inside = isolation.inside_hooks_of()
    outer = [name for name, ids in running if not ids <= inside]
    if outer:
        raise CaptureError(
            f"{type(model).__name__} is being explained while an explanation of {outer[-1]} runs in this thread, "
            "outside a hook on that model's modules (from a tensor hook, a global module hook, the model's own "
            "forward, or inside an adapter.propagation(...) block): the outer explanation's rules, recorder and "
            f"backward switch would reach this one and its map would be wrong. Explain {type(model).__name__} after "
            f"the outer attribute() returns, or from a forward or backward hook registered on one of {outer[-1]}'s "
            "modules (such hooks run isolated from the explanation)."
        )


def holding_the_model(method: Callable) -> Callable:
    """``method(self, model, ...)``, a context manager, entered while this thread holds
    ``model`` (:func:`exclusive`, re-entrant).

    Patches restore what they found on exit, which is right only if contexts on one model exit
    in reverse order: a user's ``adapter.propagation(model, rules)`` block in one thread and an
    explanation in another would otherwise undo each other's patches."""

    @functools.wraps(method)
    @contextlib.contextmanager
    def holding(self, model: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
        with exclusive(model), method(self, model, *args, **kwargs):
            yield

    holding.holds_the_model = True
    return holding
