"""The only code in the package that mutates a model, always reversibly.

Every helper is a context manager that records the exact prior state and restores it on
exit, whether the body returned normally or raised. Changes are made on *instances*
(instance attributes, hooks, configs), never on classes, so other models of the same class
are untouched. Adapters compose these helpers with :class:`contextlib.ExitStack`.

A change acts only where it was made: every replaced forward, hook, flag and attention
implementation is *gated* by a context variable that the helper sets while it is entered,
so the thread (or ``contextvars`` context) that entered it sees the change and every other
one sees the model's original behaviour, bit for bit. Explanations of one model are
serialised by :func:`exclusive` (re-entrant, so the package may nest its own contexts).
No process-wide flag is changed.

Example::

    >>> with exclusive(model), instance_forward(model.layer, lambda original: my_forward):
    ...     model(x)        # runs my_forward in this thread; other threads run the original
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, FrozenSet, Iterator, List

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_MISSING = object()

# The changes entered in the current context (one opaque token per helper call).
_ENTERED: contextvars.ContextVar[FrozenSet[object]] = contextvars.ContextVar(
    "captum_transformers_entered_patches", default=frozenset())


@contextlib.contextmanager
def _entered(token: object) -> Iterator[None]:
    reset = _ENTERED.set(_ENTERED.get() | {token})
    try:
        yield
    finally:
        _ENTERED.reset(reset)


def _is_entered(token: object) -> bool:
    return token in _ENTERED.get()


# -- one explanation of a module at a time ------------------------------------------------
# id(module) -> [thread holding it, how many nested exclusive() contexts of that thread].
_HOLDERS: Dict[int, List[int]] = {}
_HOLDERS_CHANGED = threading.Condition()


@contextlib.contextmanager
def exclusive(model: nn.Module) -> Iterator[None]:
    """Hold every module of ``model`` for this thread: another thread explaining ``model``,
    or any model sharing a module with it, waits until this context exits.

    All modules are taken at once (or none), so two explanations of overlapping models
    cannot deadlock; the holding thread may re-enter (the package nests its own contexts).
    """
    ids = [id(module) for module in model.modules()]
    me = threading.get_ident()
    with _HOLDERS_CHANGED:
        _HOLDERS_CHANGED.wait_for(lambda: all(_HOLDERS.get(i, (me,))[0] == me for i in ids))
        for i in ids:
            holder = _HOLDERS.setdefault(i, [me, 0])
            holder[1] += 1
    try:
        yield
    finally:
        with _HOLDERS_CHANGED:
            for i in ids:
                holder = _HOLDERS[i]
                holder[1] -= 1
                if holder[1] == 0:
                    del _HOLDERS[i]
            _HOLDERS_CHANGED.notify_all()


@contextlib.contextmanager
def attributes(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes on one object; restore (or delete) them on exit.

    An attribute that lived only on the class is deleted from the instance on exit, so
    the class value shows through again exactly as before.
    """
    before: Dict[str, Any] = {}
    instance_dict = getattr(obj, "__dict__", {})
    for name in values:
        before[name] = instance_dict[name] if name in instance_dict else _MISSING
    try:
        for name, value in values.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in before.items():
            if value is _MISSING:
                if name in getattr(obj, "__dict__", {}):
                    delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextlib.contextmanager
def instance_forward(module: nn.Module, make_forward: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace ``module.forward`` on this instance by ``make_forward(original_forward)``,
    in the current context only: elsewhere the instance runs ``original_forward``."""
    original = module.forward
    replacement = make_forward(original)
    token = object()

    # wraps: the replacement's markers and signature (through __wrapped__) stay visible.
    @functools.wraps(replacement)
    def forward(*args: Any, **kwargs: Any):
        if _is_entered(token):
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    with attributes(module, forward=forward), _entered(token):
        yield


@contextlib.contextmanager
def forward_hook(module: nn.Module, hook: Callable, *, pre: bool = False, with_kwargs: bool = False) -> Iterator[None]:
    """Register a forward (pre-)hook for the duration of the context, called only in the
    current context (elsewhere it returns None: no change)."""
    token = object()

    def gated(*args: Any):
        return hook(*args) if _is_entered(token) else None

    if pre:
        handle = module.register_forward_pre_hook(gated, with_kwargs=with_kwargs)
    else:
        handle = module.register_forward_hook(gated, with_kwargs=with_kwargs)
    try:
        with _entered(token):
            yield
    finally:
        handle.remove()


class _ContextualFlag:
    """A truth value that is ``value`` where its context is entered and ``original`` elsewhere.

    Stands in for a boolean instance flag read as ``if module.flag:`` (timm's ``fused_attn``
    and ``grad_checkpointing``)."""

    __slots__ = ("token", "value", "original")

    def __init__(self, token: object, value: bool, original: Any):
        self.token, self.value, self.original = token, value, original

    def __bool__(self) -> bool:
        return bool(self.value if _is_entered(self.token) else self.original)

    def __repr__(self) -> str:
        return f"{bool(self)} (captum_transformers: {self.value} while explaining, else {self.original!r})"


@contextlib.contextmanager
def flag(obj: Any, name: str, value: bool) -> Iterator[None]:
    """Set the boolean flag ``obj.name`` to ``value`` in the current context only.

    Example::

        >>> with flag(vit.blocks[0].attn, "fused_attn", False):
        ...     vit(images)   # explicit attention path here, timm's choice in other threads
    """
    token = object()
    with attributes(obj, **{name: _ContextualFlag(token, value, getattr(obj, name))}), _entered(token):
        yield


def eval_view(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` in eval mode (parameters and children shared), for probes
    that must not draw dropout or update statistics without touching the module itself."""
    import copy

    view = copy.copy(module)
    view.training = False
    return view


def _reachable_configs(model: nn.Module) -> List[Any]:
    """Every HF config object used by ``model``'s PreTrainedModels, sub-configs included."""
    seen: Dict[int, Any] = {}
    stack = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation_internal")]
    while stack:
        config = stack.pop()
        if id(config) in seen:
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                stack.append(sub)
    return list(seen.values())


# Per context: id(config) -> the attention implementation it reports there.
_IMPLEMENTATIONS: contextvars.ContextVar[Dict[int, str]] = contextvars.ContextVar(
    "captum_transformers_attn_implementations", default={})
_CONTEXTUAL_CONFIG_CLASSES: Dict[type, type] = {}
# id(config) -> [original class, number of contexts using the contextual class].
_SWAPPED_CONFIGS: Dict[int, list] = {}
_CONFIG_GUARD = threading.Lock()


def _contextual_config_class(cls: type) -> type:
    """``cls`` with an ``_attn_implementation`` that reads this context's choice first."""
    found = _CONTEXTUAL_CONFIG_CLASSES.get(cls)
    if found is None:
        inherited = cls._attn_implementation

        def read(config):
            chosen = _IMPLEMENTATIONS.get().get(id(config))
            return inherited.fget(config) if chosen is None else chosen

        found = type(cls.__name__, (cls,), {"_attn_implementation": property(read, inherited.fset),
                                            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        _CONTEXTUAL_CONFIG_CLASSES[cls] = found
    return found


@contextlib.contextmanager
def hf_attention_implementation(model: nn.Module, key: str) -> Iterator[None]:
    """Point every HF config of ``model`` at attention implementation ``key``, in the
    current context only.

    transformers reads ``config._attn_implementation`` (a property) wherever it dispatches
    attention or builds masks. For the duration, each config's class is a subclass whose
    property answers ``key`` in this context and the stored value elsewhere; nothing stored
    changes. Configs shared by several models (or threads) are swapped once and restored by
    the last context that leaves.
    """
    configs = _reachable_configs(model)
    with _CONFIG_GUARD:
        for config in configs:
            entry = _SWAPPED_CONFIGS.get(id(config))
            if entry is None:
                entry = _SWAPPED_CONFIGS[id(config)] = [type(config), 0]
                config.__class__ = _contextual_config_class(type(config))
            entry[1] += 1
    reset = _IMPLEMENTATIONS.set({**_IMPLEMENTATIONS.get(), **{id(config): key for config in configs}})
    try:
        yield
    finally:
        _IMPLEMENTATIONS.reset(reset)
        with _CONFIG_GUARD:
            for config in configs:
                entry = _SWAPPED_CONFIGS[id(config)]
                entry[1] -= 1
                if entry[1] == 0:
                    config.__class__ = entry[0]
                    del _SWAPPED_CONFIGS[id(config)]


class _NoFastPath(TorchFunctionMode):
    """A pass-through torch-function mode. PyTorch's fused MultiheadAttention /
    TransformerEncoder(Layer) fast paths are not taken while any torch-function mode is
    active (``has_torch_function`` is then true), and modes are per thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def mha_fastpath_disabled() -> Iterator[None]:
    """Keep PyTorch's fused MultiheadAttention / TransformerEncoder fast path off in this
    thread (the fast path bypasses ``MultiheadAttention.forward``, so no weights would be
    observed). ``torch.backends.mha``'s process-wide flag is left alone: other threads
    keep the fast path."""
    with _NoFastPath():
        yield


# -- compiled modules -------------------------------------------------------------------
_WARNED_COMPILED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _is_optimized(module: nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None), nn.Module)


def original_module(module: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` wrapped (``module`` itself if not compiled so)."""
    while _is_optimized(module):
        module = module._orig_mod
    return module


def _compiled_parts(model: nn.Module) -> List[nn.Module]:
    from_compile = []
    for module in model.modules():
        if _is_optimized(module) or getattr(module, "_compiled_call_impl", None) is not None:
            from_compile.append(module)
    return from_compile


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s ``torch.compile``-d parts as their original modules, in this context.

    A compiled graph cannot see the hooks, wrapped forwards and torch-function modes an
    explanation relies on (captured before they existed or traced through), so its maps
    would be wrong (all zeros for a compiled timm ViT). Inside, an ``OptimizedModule``
    (``torch.compile(module)``) calls its ``_orig_mod`` eagerly and a module compiled in
    place (``module.compile()``) runs its eager ``_call_impl``; other threads keep the
    compiled code. A one-time warning per model says so: the explanation is that of the
    original module, whose outputs equal the compiled ones up to float rounding.
    """
    parts = _compiled_parts(model)
    if not parts:
        yield
        return
    if model not in _WARNED_COMPILED:
        _WARNED_COMPILED.add(model)
        names = sorted({name or "the model" for name, m in model.named_modules() if any(m is p for p in parts)})
        warnings.warn(
            f"{type(original_module(model)).__name__} has torch.compile-d parts ({', '.join(names)}); they are explained as the "
            "original (uncompiled) modules, run eagerly while explaining: compiled code cannot be observed. "
            "Outputs equal the compiled ones up to float rounding.", UserWarning, stacklevel=4)
    with contextlib.ExitStack() as stack:
        for module in parts:
            if _is_optimized(module):
                inner = module._orig_mod
                stack.enter_context(instance_forward(module, lambda original, inner=inner: inner.__call__))
            if getattr(module, "_compiled_call_impl", None) is not None:
                token = object()
                compiled = module._compiled_call_impl

                def call(*args: Any, module=module, token=token, compiled=compiled, **kwargs: Any):
                    if _is_entered(token):
                        return module._call_impl(*args, **kwargs)
                    return compiled(*args, **kwargs)

                stack.enter_context(attributes(module, _compiled_call_impl=call))
                stack.enter_context(_entered(token))
        yield
