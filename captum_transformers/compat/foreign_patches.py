"""Library classes whose methods another library replaced in this process, found and refused.

Libraries such as LXT apply their own LRP rules by assigning new functions to transformers'
(and torch's) classes, e.g. ``LlamaRMSNorm.forward = rms_norm_forward``, and never undo it.
Every model of that class then runs the replacement: the forward values may even be equal,
but its gradient is the other library's, so every gradient-based map here would silently
change. A method defined on a class of ``transformers``, ``torch`` or ``timm`` must be a
function of those libraries (checked by the function's ``__module__``); anything else is
refused before the model runs, naming the method, the replacement and how to undo it.

Instance attributes are not checked: per-instance forwards are how device-placement
libraries (accelerate) and this package's own reversible patches work.

Example::

    >>> LlamaRMSNorm.forward = my_forward       # done by another library
    >>> check_library_classes(llama)            # CaptureError naming LlamaRMSNorm.forward
"""
from __future__ import annotations

import functools
import operator
import types
from typing import Dict, Iterator, Optional, Tuple

from torch import nn

from ..errors import CaptureError
from ..model_state import module_walk

# Libraries whose classes are checked, and whose functions their methods may be.
_LIBRARIES = ("transformers", "torch", "timm")
# transformers >= 5.25 depends on the ``kernels`` library and registers hub kernels on its classes
# when they are defined: ``kernel_condition`` (``replace_kernel_forward_from_hub``) and an
# ``__init__`` wrapper (``use_kernelized_func``) that keeps transformers' own function as the
# layer's default. Neither changes what the layer computes unless ``kernels.kernelize(model)`` is
# called, which replaces ``forward`` (that stays refused). (attribute, the shim's qualname part).
_KERNEL_SHIMS = (("kernel_condition", "replace_kernel_forward_from_hub"), ("__init__", "use_kernelized_func"))


def _kernel_shim(name: str, origin: object) -> bool:
    """Whether ``origin`` at class attribute ``name`` is one of transformers' own hub-kernel
    registrations (:data:`_KERNEL_SHIMS`), not a replacement by another library."""
    if (getattr(origin, "__module__", None) or "").split(".")[0] != "kernels":
        return False
    qualname = getattr(origin, "__qualname__", "")
    return any(name == attribute and part in qualname for attribute, part in _KERNEL_SHIMS)


def _library(module_name: Optional[str]) -> Optional[str]:
    top = (module_name or "").split(".")[0]
    return top if top in _LIBRARIES else None


def _function(value) -> Optional[object]:
    """The function behind a class attribute (plain, static, class method or partial)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, (types.FunctionType, functools.partial, functools.partialmethod)):
        return value
    return None


def _foreign_methods(owner: type) -> Iterator[Tuple[str, object]]:
    """(name, replacement) for each method defined on the library class ``owner`` that is
    a function from outside the libraries."""
    for name, value in vars(owner).items():
        function = _function(value)
        if function is None:
            continue
        origin = function.func if isinstance(function, (functools.partial, functools.partialmethod)) else function
        if _library(getattr(origin, "__module__", None)) is None and not _kernel_shim(name, origin):
            yield name, origin


# Library classes in a class's MRO, and per library class its (names, values) last found to be
# the library's own: re-checked by identity, fully when any entry changed.
_LIBRARY_OWNERS: Dict[type, Tuple[type, ...]] = {}
_VERIFIED: Dict[type, Tuple[Tuple[str, ...], Tuple[object, ...]]] = {}


def _library_owners(cls: type) -> Tuple[type, ...]:
    owners = _LIBRARY_OWNERS.get(cls)
    if owners is None:
        owners = _LIBRARY_OWNERS[cls] = tuple(o for o in cls.__mro__ if _library(o.__module__) is not None)
    return owners


def _unchanged(owner: type) -> bool:
    """Whether every entry of ``owner``'s dict is the object verified last time (any entry: a
    non-function attribute replaced by a foreign function is a change too)."""
    verified = _VERIFIED.get(owner)
    if verified is None:
        return False
    entries = vars(owner)
    return len(entries) == len(verified[0]) and tuple(entries) == verified[0] \
        and all(map(operator.is_, entries.values(), verified[1]))


def check_library_classes(model: nn.Module) -> None:
    """Raise :class:`CaptureError` if a method of a transformers / torch / timm class used by
    ``model`` is a function from elsewhere (replaced in this process by another library)."""
    owners = {owner for cls in {type(module) for module in module_walk.modules(model)} for owner in _library_owners(cls)}
    for owner in owners:
        if _unchanged(owner):
            continue
        for name, origin in _foreign_methods(owner):
            where = f"{owner.__module__}.{owner.__qualname__}.{name}"
            by = f"{getattr(origin, '__module__', '?')}.{getattr(origin, '__qualname__', repr(origin))}"
            raise CaptureError(
                f"{where} is {by}, not the function {_library(owner.__module__)} ships: another library replaced it "
                f"in this process (as LXT's monkey_patch does), so {type(model).__name__} would be explained through "
                "that code and its gradient, not the model's. Undo the patch (the patching library's own restore, "
                f"or assign the original function back to {owner.__qualname__}.{name}), or start a fresh Python "
                "process that does not apply it; importlib.reload does not change models already built."
            )
        entries = dict(vars(owner))
        _VERIFIED[owner] = (tuple(entries), tuple(entries.values()))
