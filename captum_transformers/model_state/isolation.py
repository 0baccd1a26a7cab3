"""The user's hooks on an explained model run outside the explanation.

While a model is explained, its forward runs under the package's rules (torch-function modes
for the per-operation LRP rules and the explicit attention kernels) and context variables
(the recorder, the rule set, the backward switch, the patches entered). A forward hook a user
put on one of the model's modules runs inside that forward: without care, a second model it
runs or explains there (a teacher, a detector, an explanation of another model) would get
the first explanation's rules and feed its recorder, and its map would be silently wrong.

:func:`isolated_call` runs such a hook as if no explanation were running in this thread:
the package's torch-function modes are set aside (the user's own modes stay, in order) and
every package context variable (named ``captum_transformers_*``) reads its default; both are
put back when the hook returns or raises. The hook's own computation is therefore never
explained with the model (a hook that *replaces* a module's output changes the model; its
replacement is a constant to the rules, like any value computed outside them).

One package mode stays on in the hook: the train-mode watch of
:mod:`.stochastic_layers` (it holds no recorder or rule). A hook that applies dropout or
noise to the output of a model in training mode makes the explained forward random, and is
refused like the model's own dropout; another model run from the hook follows its own rule.

One thing cannot be isolated: an explanation of the *same* model (or of a model sharing a
module with it) from inside its own explanation would patch and record the very modules that
are running. :func:`refuse_nested` refuses it (:class:`~captum_transformers.errors.CaptureError`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List

import torch

from ..errors import CaptureError

_PREFIX = "captum_transformers"
_NO_DEFAULT = object()
_DEFAULTS: Dict[contextvars.ContextVar, Any] = {}

# ids of the modules of every explanation whose user hook is running now in this context.
_INSIDE_HOOKS_OF: contextvars.ContextVar[FrozenSet[int]] = contextvars.ContextVar(
    "captum_transformers_inside_hooks_of", default=frozenset())


def _default(var: contextvars.ContextVar) -> Any:
    """The value ``var`` has in a context that never set it (``_NO_DEFAULT`` if none)."""
    found = _DEFAULTS.get(var, _NO_DEFAULT)
    if found is _NO_DEFAULT and var not in _DEFAULTS:
        try:
            found = contextvars.Context().run(var.get)
        except LookupError:
            found = _NO_DEFAULT
        _DEFAULTS[var] = found
    return found


def _is_package_mode(mode: Any) -> bool:
    """A mode of the package that a user hook must not see. The train-mode watch
    (``kept_in_user_hooks``) stays: it carries no recorder or rule, and a hook that adds
    dropout or noise to the explained model's output makes its forward random too."""
    return type(mode).__module__.startswith(_PREFIX + ".") and not getattr(mode, "kept_in_user_hooks", False)


@contextlib.contextmanager
def _package_modes_set_aside() -> Iterator[None]:
    """The torch-function mode stack of this thread without the package's modes (the other
    modes keep their order); the whole stack exactly as it was on exit."""
    depth = torch._C._len_torch_function_stack()
    stack = [torch._C._get_function_stack_at(i) for i in range(depth)]
    if not any(_is_package_mode(mode) for mode in stack):
        yield
        return
    for _ in range(depth):
        torch._C._pop_torch_function_stack()
    kept = [mode for mode in stack if not _is_package_mode(mode)]
    for mode in kept:
        torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        for _ in range(torch._C._len_torch_function_stack()):
            torch._C._pop_torch_function_stack()
        for mode in stack:
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _package_variables_reset(owners: FrozenSet[int]) -> Iterator[None]:
    """Every package context variable at its default, and ``owners`` added to the modules
    whose explanation's hook is running; the previous values on exit."""
    inside = _INSIDE_HOOKS_OF.get()
    tokens: List[tuple] = []
    try:
        for var, value in contextvars.copy_context().items():
            if var is _INSIDE_HOOKS_OF or not var.name.startswith(_PREFIX):
                continue
            default = _default(var)
            if default is not _NO_DEFAULT and value is not default:
                tokens.append((var, var.set(default)))
        tokens.append((_INSIDE_HOOKS_OF, _INSIDE_HOOKS_OF.set(inside | owners)))
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def isolated_call(owners: FrozenSet[int], function: Callable, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` as if no explanation ran in this thread (see the module
    docstring); ``owners``: the module ids of the explanation whose hook this is."""
    with _package_modes_set_aside(), _package_variables_reset(owners):
        return function(*args, **kwargs)


def inside_hooks_of() -> FrozenSet[int]:
    """The module ids of every explanation whose user hook is running now in this context."""
    return _INSIDE_HOOKS_OF.get()


def refuse_nested(model: torch.nn.Module, module_ids: Iterable[int]) -> None:
    """:class:`CaptureError` if ``model`` (whose modules are ``module_ids``) shares a module
    with a model whose explanation is running one of its user hooks in this context."""
    inside = _INSIDE_HOOKS_OF.get()
    if not inside:
        return
    if id(model) in inside or not inside.isdisjoint(module_ids):
        raise CaptureError(
            f"{type(model).__name__} is being explained from a hook on one of its own modules (or of a model sharing "
            "modules with it) while an explanation of it runs: the inner explanation would patch and record the "
            "very modules that are running, and neither map would be exact. Explain it after the outer attribute() "
            "returns (collect the inputs in the hook), or explain a separate copy (copy.deepcopy(model))."
        )
