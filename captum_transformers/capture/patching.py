"""The only code in the package that mutates a model, always reversibly.

Every helper is a context manager that records the exact prior state and restores it on
exit, whether the body returned normally or raised. Changes are made on *instances*
(instance attributes, hooks, configs), never on classes, so other models of the same class
are untouched. Adapters compose these helpers with :class:`contextlib.ExitStack`.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List

import torch
from torch import nn

from ..errors import InputError

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
    """Replace ``module.forward`` on this instance by ``make_forward(original_forward)``."""
    original = module.forward
    with attributes(module, forward=make_forward(original)):
        yield


@contextlib.contextmanager
def forward_hook(module: nn.Module, hook: Callable, *, pre: bool = False, with_kwargs: bool = False) -> Iterator[None]:
    """Register a forward (pre-)hook for the duration of the context."""
    if pre:
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
    else:
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs)
    try:
        yield
    finally:
        handle.remove()


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


@contextlib.contextmanager
def hf_attention_implementation(model: nn.Module, key: str) -> Iterator[None]:
    """Point every HF config of ``model`` at attention implementation ``key``.

    Writes the config's internal field directly (no validation round trip, no warnings)
    and restores each config's own previous value, so mixed per-tower settings survive.
    """
    configs = _reachable_configs(model)
    previous = [config._attn_implementation_internal for config in configs]
    try:
        for config in configs:
            config._attn_implementation_internal = key
        yield
    finally:
        for config, value in zip(configs, previous):
            config._attn_implementation_internal = value


@contextlib.contextmanager
def mha_fastpath_disabled() -> Iterator[None]:
    """Turn off PyTorch's fused MultiheadAttention / TransformerEncoder fast path.

    The fast path bypasses ``MultiheadAttention.forward`` entirely, so no weights would be
    observed. The flag is process-global; its previous value is restored on exit.
    """
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


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
    """
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    entered: List[torch.Tensor] = []
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
        with _FORCED_GRAD_LOCK:
            for parameter in entered:
                entry = _FORCED_GRAD[id(parameter)]
                entry[2] -= 1
                if entry[2] == 0:
                    del _FORCED_GRAD[id(parameter)]
                    parameter.requires_grad_(entry[1])
