"""How a change to a model is seen only in the context (thread) that entered it.

Every helper of :mod:`.patching` gates its change by a token: :func:`entered` adds the token
to this context's set while the helper is entered, and the replaced forward, hook or flag
asks :func:`is_entered` which behaviour to show. This module holds that gate and the
stand-ins placed on a model that answer from it: :class:`ContextualValue` (a flag that is one
value in the entering context and the original elsewhere) and the contextual HF config class
(an ``_attn_implementation`` read from this context's choice first). None of it touches a
model; :mod:`.patching`, the only code that mutates one, puts these stand-ins in place.
"""
from __future__ import annotations

import contextlib
import contextvars
import copyreg
from typing import Any, Dict, FrozenSet, Iterator

# The changes entered in the current context (one opaque token per helper call).
_ENTERED: contextvars.ContextVar[FrozenSet[object]] = contextvars.ContextVar(
    "captum_transformers_entered_patches", default=frozenset())


@contextlib.contextmanager
def entered(token: object) -> Iterator[None]:
    """Add ``token`` to this context's entered set for the duration of the ``with`` block."""
    reset = _ENTERED.set(_ENTERED.get() | {token})
    try:
        yield
    finally:
        _ENTERED.reset(reset)


def is_entered(token: object) -> bool:
    """Whether the current context is inside an :func:`entered` block of ``token``."""
    return token in _ENTERED.get()


class ContextualValue:
    """A flag that is ``value`` where its context is entered and ``original`` elsewhere.

    Stands in for an instance flag read as ``if module.flag:`` or compared (timm's
    ``fused_attn`` and ``grad_checkpointing``; torch's ``use_nested_tensor`` and
    ``activation_relu_or_gelu``, an int compared with ``== 2``)."""

    __slots__ = ("token", "value", "original")

    def __init__(self, token: object, value: Any, original: Any):
        self.token, self.value, self.original = token, value, original

    def current(self) -> Any:
        return self.value if is_entered(self.token) else self.original

    def __bool__(self) -> bool:
        return bool(self.current())

    def __eq__(self, other: Any) -> bool:
        return self.current() == other

    def __ne__(self, other: Any) -> bool:
        return self.current() != other

    def __hash__(self) -> int:
        return hash(self.current())

    def __int__(self) -> int:
        return int(self.current())

    def __index__(self) -> int:
        return int(self.current())

    def __repr__(self) -> str:
        return f"{self.current()!r} (captum_transformers: {self.value!r} while explaining, else {self.original!r})"


# Per context: id(config) -> the attention implementation it reports there. Set by
# :func:`.patching.hf_attention_implementation`; read by the contextual config class and by the
# code that needs the key a config points at in this context.
IMPLEMENTATIONS: contextvars.ContextVar[Dict[int, str]] = contextvars.ContextVar(
    "captum_transformers_attn_implementations", default={})
_CONTEXTUAL_CONFIG_CLASSES: Dict[type, type] = {}


def contextual_config_class(cls: type) -> type:
    """``cls`` with an ``_attn_implementation`` that reads this context's choice first."""
    found = _CONTEXTUAL_CONFIG_CLASSES.get(cls)
    if found is None:
        inherited = cls._attn_implementation

        def read(config):
            chosen = IMPLEMENTATIONS.get().get(id(config))
            return inherited.fget(config) if chosen is None else chosen

        def reduce_ex(config, protocol):
            # Pickled (and copied) as the original class: another thread may save the config now.
            constructor, arguments, *rest = cls.__reduce_ex__(config, protocol)
            if arguments and arguments[0] is found:
                constructor, arguments = copyreg._reconstructor, (cls, object, None)
            return (constructor, arguments, *rest)

        found = type(cls.__name__, (cls,), {"_attn_implementation": property(read, inherited.fset),
                                            "__reduce_ex__": reduce_ex,
                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _CONTEXTUAL_CONFIG_CLASSES[cls] = found
    return found
