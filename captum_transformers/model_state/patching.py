"""The only code in the package that mutates a model, always reversibly.

Every helper is a context manager that records the exact prior state and restores it on
exit, whether the body returned normally or raised. Changes are made on *instances*
(instance attributes, hooks, configs), never on classes, so other models of the same class
are untouched. Adapters compose these helpers with :class:`contextlib.ExitStack`.

A change acts only where it was made: every replaced forward, hook, flag and attention
implementation is *gated* by a context variable that the helper sets while it is entered,
so the thread (or ``contextvars`` context) that entered it sees the change and every other
one sees the model's original behaviour, bit for bit (explanations of one model are
serialised by :mod:`.exclusive`). No process-wide flag is changed.

Example::

    >>> with instance_forward(model.layer, lambda original: my_forward):
    ...     model(x)        # runs my_forward in this thread; other threads run the original
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import threading
import warnings
from typing import Any, Callable, Dict, FrozenSet, Iterable, Iterator, List

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..errors import InputError
from . import isolation, module_walk, offload
from .contextual import IMPLEMENTATIONS, ContextualValue, contextual_config_class, entered, is_entered

_MISSING = object()


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
        if is_entered(token):
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    with attributes(module, forward=forward), entered(token):
        yield


@contextlib.contextmanager
def instance_function(obj: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Replace the callable attribute ``obj.name`` by ``make(original)`` in the current context
    only (a HF layer's ``_gradient_checkpointing_func``); elsewhere ``original`` runs."""
    original = getattr(obj, name)
    replacement, token = make(original), object()

    def call(*args: Any, **kwargs: Any):
        return (replacement if is_entered(token) else original)(*args, **kwargs)

    with attributes(obj, **{name: call}), entered(token):
        yield


@contextlib.contextmanager
def forward_hook(module: nn.Module, hook: Callable, *, pre: bool = False, with_kwargs: bool = False) -> Iterator[None]:
    """Register a forward (pre-)hook for the duration of the context, called only in the
    current context (elsewhere it returns None: no change)."""
    token = object()

    def gated(*args: Any):
        return hook(*args) if is_entered(token) else None

    gated.__dict__[_PACKAGE_HOOK] = True  # not the user's: user_hooks_isolated leaves it inside
    if pre:
        handle = module.register_forward_pre_hook(gated, with_kwargs=with_kwargs)
    else:
        handle = module.register_forward_hook(gated, with_kwargs=with_kwargs)
    try:
        with entered(token):
            yield
    finally:
        handle.remove()


# Marks the hooks this module registers (an explanation's own, e.g. the one passing a mapping's
# entries by name): a nested explanation's user_hooks_isolated must not set them outside it.
_PACKAGE_HOOK = "_captum_transformers_patch"

# The hook dictionaries whose entries a user may have registered: nn.Module's and those of
# torch_geometric's MessagePassing.
_MODULE_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_MESSAGE_PASSING_HOOK_DICTS = ("_propagate_forward_pre_hooks", "_propagate_forward_hooks", "_message_forward_pre_hooks",
                               "_message_forward_hooks", "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
                               "_message_and_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
                               "_edge_update_forward_pre_hooks", "_edge_update_forward_hooks")


@contextlib.contextmanager
def user_hooks_isolated(modules: Iterable[nn.Module], owners: FrozenSet[int]) -> Iterator[None]:
    """Every hook registered on ``modules`` now (the user's: the package registers its own
    later) runs outside the explanation in the current context
    (:func:`~captum_transformers.model_state.isolation.isolated_call`, ``owners`` the explained
    model's module ids); elsewhere it runs as it is. Each entry is put back on exit unless the
    user removed or replaced it meanwhile; keys and order never change.

    Example::

        >>> with user_hooks_isolated(model.modules(), frozenset(map(id, model.modules()))):
        ...     model(x)   # a forward hook explaining another model sees no rule of this one
    """
    token = object()
    replaced: List[tuple] = []
    try:
        for module in modules:
            names = _MODULE_HOOK_DICTS
            if "_propagate_forward_hooks" in module.__dict__:
                names += _MESSAGE_PASSING_HOOK_DICTS
            for name in names:
                hooks = module.__dict__.get(name)
                if not hooks:
                    continue
                for key, hook in list(hooks.items()):
                    if getattr(hook, _PACKAGE_HOOK, False):
                        continue
                    wrapper = _isolating(hook, token, owners)
                    hooks[key] = wrapper
                    replaced.append((hooks, key, hook, wrapper))
        with entered(token):
            yield
    finally:
        for hooks, key, hook, wrapper in reversed(replaced):
            if hooks.get(key) is wrapper:
                hooks[key] = hook


def _isolating(hook: Callable, token: object, owners: FrozenSet[int]) -> Callable:
    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any):
        if not is_entered(token):
            return hook(*args, **kwargs)
        return isolation.isolated_call(owners, hook, *args, **kwargs)
    return run


# message_passing_hook's kinds -> the MessagePassing hook dictionary each one's entries live in.
_MESSAGE_PASSING_HOOKS = {"propagate": "_propagate_forward_hooks", "propagate_pre": "_propagate_forward_pre_hooks",
                          "message": "_message_forward_hooks", "edge_update": "_edge_update_forward_hooks"}


@contextlib.contextmanager
def message_passing_hook(module: nn.Module, kind: str, hook: Callable) -> Iterator[None]:
    """Add a torch_geometric ``MessagePassing`` hook (``kind``: ``"propagate"``,
    ``"propagate_pre"``, ``"message"`` or ``"edge_update"``, as the ``register_*_forward_hook``
    / ``register_propagate_forward_pre_hook`` methods would) for the duration of the context,
    called only in the current context; the layer's own dictionary is back on exit, whatever
    the body raised.

    No dictionary another thread may be iterating is ever written: PyG's ``propagate`` calls
    each hook from inside its loop over the dictionary, so a plain forward of the same layer
    in another thread would die with ``OrderedDict mutated during iteration`` if an entry were
    added or removed meanwhile. Instead the layer gets a new dictionary (the one found, then
    this hook) by one attribute assignment, and the very object found is assigned back on exit:
    a thread already inside ``propagate`` keeps walking the dictionary it started with, one
    starting meanwhile walks the copy (where this hook returns None outside the context).
    A hook someone registers on the layer meanwhile lands in the copy and is gone on exit
    (a ``UserWarning`` names it); hooks removed meanwhile stay removed.

    Example::

        >>> with message_passing_hook(conv, "propagate", lambda m, inputs, out: None):
        ...     conv(x, edge_index)
    """
    if kind not in _MESSAGE_PASSING_HOOKS:
        raise InputError(f"kind must be one of {tuple(_MESSAGE_PASSING_HOOKS)}, got {kind!r}: the MessagePassing hooks "
                         "the package installs are propagate (pre-)hooks, message and edge_update forward hooks.")
    name = _MESSAGE_PASSING_HOOKS[kind]
    found = vars(module).get(name)
    if not isinstance(found, dict):
        raise InputError(f"{type(module).__name__} is not a torch_geometric MessagePassing layer (it has no {name} "
                         f"dictionary, found {type(found).__name__}), so no {kind} hook can be added to it; pass the "
                         "MessagePassing module itself.")
    token = object()

    def gated(*args: Any):
        return hook(*args) if is_entered(token) else None

    gated.__dict__[_PACKAGE_HOOK] = True
    replacement = type(found)(found)
    # A key from torch's handle counter, as register_* would take: no user hook has it or will.
    key = RemovableHandle(replacement).id
    replacement[key] = gated
    try:
        with attributes(module, **{name: replacement}), entered(token):
            yield
    finally:
        _report_hooks_added_meanwhile(module, name, replacement, found, key)


def _report_hooks_added_meanwhile(module: nn.Module, name: str, replacement: dict, found: dict, key: int) -> None:
    """Warn when someone registered a hook on ``module``'s copied ``name`` dictionary while it was
    installed (message_passing_hook): the restored dictionary does not hold it."""
    added = [k for k in replacement if k != key and k not in found]
    if added:
        warnings.warn(
            f"{len(added)} hook(s) were registered on {type(module).__name__}.{name} while it was explained (another "
            "thread, or code inside the explanation); the explanation ran on its own copy of that dictionary, and the "
            "layer's own dictionary is back now, without them. Register PyG hooks on an explained layer before or "
            "after the explanation.", UserWarning, stacklevel=4)


@contextlib.contextmanager
def flag(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set the flag ``obj.name`` (a bool or small int) to ``value`` in the current context only.

    Example::

        >>> with flag(vit.blocks[0].attn, "fused_attn", False):
        ...     vit(images)   # explicit attention path here, timm's choice in other threads
    """
    token = object()
    with attributes(obj, **{name: ContextualValue(token, value, getattr(obj, name))}), entered(token):
        yield


def eval_view(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` in eval mode (parameters and children shared), for probes
    that must not draw dropout or update statistics without touching the module itself."""
    view = copy.copy(module)
    view.training = False
    return view


def _floating_parameters(model: nn.Module) -> List[nn.Parameter]:
    """``[p for p in model.parameters() if p.is_floating_point()]``, over the published walk."""
    seen, found = set(), []
    for module in module_walk.modules(model):
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                if parameter.is_floating_point():
                    found.append(parameter)
    return found


def reachable_configs(model: nn.Module) -> List[Any]:
    """Every HF config object used by ``model``'s PreTrainedModels, sub-configs included."""
    return list(module_walk.per_walk(model, "hf_configs", lambda: _find_configs(model)))


def _find_configs(model: nn.Module) -> List[Any]:
    seen: Dict[int, Any] = {}
    # A PreTrainedModel keeps its config in the instance dict; vars() skips the failing
    # attribute lookups nn.Module.__getattr__ would make on every other module.
    stack = [c for c in (vars(m).get("config") for m in module_walk.modules(model))
             if c is not None and hasattr(c, "_attn_implementation_internal")]
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


# id(config) -> [original class, number of contexts using the contextual class].
_SWAPPED_CONFIGS: Dict[int, list] = {}
_CONFIG_GUARD = threading.Lock()


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
    configs = reachable_configs(model)
    with _CONFIG_GUARD:
        for config in configs:
            entry = _SWAPPED_CONFIGS.get(id(config))
            if entry is None:
                entry = _SWAPPED_CONFIGS[id(config)] = [type(config), 0]
                config.__class__ = contextual_config_class(type(config))
            entry[1] += 1
    reset = IMPLEMENTATIONS.set({**IMPLEMENTATIONS.get(), **{id(config): key for config in configs}})
    try:
        yield
    finally:
        IMPLEMENTATIONS.reset(reset)
        with _CONFIG_GUARD:
            for config in configs:
                entry = _SWAPPED_CONFIGS[id(config)]
                entry[1] -= 1
                if entry[1] == 0:
                    config.__class__ = entry[0]
                    del _SWAPPED_CONFIGS[id(config)]


class _NoFastPath(TorchFunctionMode):
    """A pass-through torch-function mode. ``MultiheadAttention.forward`` does not take its
    fused fast path while any torch-function mode is active (``has_torch_function`` is then
    true); modes are per thread, and one handling a call is off inside it, so only the few
    top-level calls of ``MultiheadAttention.forward`` pass through here."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# ids of the modules whose fast path a context of this thread holds off.
_WITHOUT_FAST_PATH: contextvars.ContextVar[FrozenSet[int]] = contextvars.ContextVar(
    "captum_transformers_without_fast_path", default=frozenset())


def _without_fast_path(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any):
        with _NoFastPath():
            return original(*args, **kwargs)
    return forward


@contextlib.contextmanager
def mha_fastpath_disabled(model: nn.Module) -> Iterator[None]:
    """Keep PyTorch's fused MultiheadAttention / TransformerEncoder(Layer) fast paths off for
    ``model`` in the current context (the fast path bypasses ``MultiheadAttention.forward``,
    so no weights would be observed).

    Per instance, through the flags that only the fast paths read: an encoder's
    ``use_nested_tensor`` and a layer's ``activation_relu_or_gelu`` (contextual values), and a
    pass-through torch-function mode around each attention's forward. Other threads keep
    the fast path; ``torch.backends.mha``'s process-wide flag is never written.
    """
    held = _WITHOUT_FAST_PATH.get()
    modules = module_walk.modules(model)
    with contextlib.ExitStack() as stack:
        for module in modules:
            if id(module) in held:  # an enclosing context of this thread already holds it off
                continue
            if isinstance(module, nn.TransformerEncoder) and hasattr(module, "use_nested_tensor"):
                stack.enter_context(flag(module, "use_nested_tensor", False))
            elif isinstance(module, nn.TransformerEncoderLayer) and hasattr(module, "activation_relu_or_gelu"):
                stack.enter_context(flag(module, "activation_relu_or_gelu", 0))
            elif isinstance(module, nn.MultiheadAttention):
                # Innermost around the attention's own forward (an outer one would also route
                # the explicit recomputation of the LRP rules through the mode).
                stack.enter_context(instance_forward(module, _without_fast_path))
        reset = _WITHOUT_FAST_PATH.set(held | {id(m) for m in modules})
        try:
            yield
        finally:
            _WITHOUT_FAST_PATH.reset(reset)


@contextlib.contextmanager
def eager_call(module: nn.Module) -> Iterator[None]:
    """In the current context, a module compiled in place (``module.compile()``) runs its
    eager ``_call_impl`` instead of the compiled one; elsewhere the compiled code runs."""
    compiled = module._compiled_call_impl
    token = object()

    def call(*args: Any, **kwargs: Any):
        if is_entered(token):
            return module._call_impl(*args, **kwargs)
        return compiled(*args, **kwargs)

    with attributes(module, _compiled_call_impl=call), entered(token):
        yield

# Parameters made to require grad by live parameters_require_grad contexts, by id:
# [parameter, its own flag, number of contexts holding it]. Shared by threads explaining
# one model at once, so the last context out restores the flag the first one found.
_FORCED_GRAD: Dict[int, list] = {}
_FORCED_GRAD_LOCK = threading.Lock()


@contextlib.contextmanager
def parameters_require_grad(model: nn.Module) -> Iterator[None]:
    """Every floating-point parameter of ``model`` requires grad inside; each gets its own
    flag back on exit.

    Why: rule Functions apply where their operands require grad, and a graph that starts
    at the first tapped attention (a frozen model) skips the rules of everything below it
    (the residual add and the ``A V`` product of the first layer, Chefer et al.'s
    normalisation). Inside this context the graph of a frozen or partly frozen model is the
    trainable model's, so every method gives one map whatever ``requires_grad`` says.
    Nothing accumulates into ``.grad``: the package differentiates with ``autograd.grad``.
    Safe when several threads explain one model: a flag is restored by the last context out.
    Unlike the other helpers the flag is not per context: a thread training the same model
    meanwhile would see its frozen parameters require grad (explanations are serialised per
    module by :mod:`..capture.exclusive`, training is not).
    """
    # accelerate-offloaded modules get new parameter objects at each onload: their flags are
    # restored by (module, name) as well (capture/offload.py).
    with offload.requires_grad_restored(model), _parameters_forced(model):
        yield


@contextlib.contextmanager
def _parameters_forced(model: nn.Module) -> Iterator[None]:
    """The flags of :func:`parameters_require_grad`, on the parameter objects found on entry."""
    parameters = _floating_parameters(model)
    entered: List[nn.Parameter] = []
    try:
        with _FORCED_GRAD_LOCK:
            for parameter in parameters:
                entry = _FORCED_GRAD.get(id(parameter))
                if entry is None:
                    own = parameter.requires_grad
                    try:
                        parameter.requires_grad_(True)
                    except RuntimeError as error:  # an inference tensor
                        raise InputError(
                            f"A parameter of {type(model).__name__} cannot be made to require grad ({error}). "
                            "Parameters created under torch.inference_mode() can never be differentiated; "
                            "create or load the model outside inference_mode."
                        ) from error
                    entry = _FORCED_GRAD[id(parameter)] = [parameter, own, 0]
                entry[2] += 1
                entered.append(parameter)
        yield
    finally:
        # Every entry is restored even if one restore raises (an interrupt, or a torch-function
        # mode that raises, such as the explorer's cancel check): that flag is then set with torch
        # functions disabled, and the first error is raised again after the loop.
        failure = None
        with _FORCED_GRAD_LOCK:
            for parameter in entered:
                entry = _FORCED_GRAD[id(parameter)]
                entry[2] -= 1
                if entry[2] == 0:
                    del _FORCED_GRAD[id(parameter)]
                    try:
                        parameter.requires_grad_(entry[1])
                    except BaseException as error:  # noqa: B902 - raised again below
                        failure = failure or error
                        with torch._C.DisableTorchFunction():
                            parameter.requires_grad_(entry[1])
        if failure is not None:
            raise failure
