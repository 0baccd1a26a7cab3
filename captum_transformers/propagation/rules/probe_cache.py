"""Behavioural probes remembered per module while the module's state is unchanged.

Norms and activations are found by probing what they compute (:func:`rules.find_norms`,
:func:`activation_discovery.is_activation`): a few small forward calls per module and per
explanation. On a small model those probes cost more than the explanation itself (a 2-layer
Llama: 11 ms of probes per 25 ms call), so one batch of 32 examples was cheaper per example
than 32 calls mostly because of them. The answer depends only on the module's class, its own
parameters and buffers, and the probe's dtype and device, so it is kept against exactly that:
a parameter changed in place (its version counter moves), replaced (its storage moves), or a
module of another class gives a fresh probe. Modules are held weakly.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Hashable

from torch import nn

_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def module_state(module: nn.Module) -> tuple:
    """What a probe of ``module`` depends on: its class and its own tensors' identity and version."""
    # The module's own entries, read directly (what parameters(recurse=False) and
    # buffers(recurse=False) yield, without their generators): asked for every norm per call.
    tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    return (type(module), tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in tensors))


def probed(module: nn.Module, key: Hashable, probe: Callable[[], Any]) -> Any:
    """``probe()`` for ``module``, or its remembered answer for the same ``key`` and module state.

    Example::

        >>> fitted = probed(norm, ("norm", size, eps, dtype, device), lambda: _probe(norm, ...))
    """
    state = (key, module_state(module))
    with _LOCK:
        answers = _CACHE.get(module)
        if answers is not None and state in answers:
            return answers[state]
    answer = probe()
    with _LOCK:
        answers = _CACHE.setdefault(module, {})
        if len(answers) > 8:  # states of a module being trained: keep only recent ones
            answers.clear()
        answers[state] = answer
    return answer


def forget(module: nn.Module) -> None:
    """Drop what was remembered for ``module`` (tests)."""
    with _LOCK:
        _CACHE.pop(module, None)


__all__ = ["probed", "module_state", "forget"]
