"""Gradient checkpointing kept on while explaining (opt-in): :func:`keep_gradient_checkpointing`.

By default a HF layer with ``gradient_checkpointing`` runs plainly inside a capture (its flag
off in that thread): torch re-runs a checkpointed layer's forward in the backward pass, and
there the package's patches, rules and recorder, all gated by context variables and
torch-function modes of the forward, would be gone (torch raises ``CheckpointError``: the
recomputation saves other tensors). Under :func:`keep_gradient_checkpointing` the flags stay
on and each checkpointed layer's ``_gradient_checkpointing_func`` is, in this context only,
torch's non-reentrant ``checkpoint`` whose recomputation re-enters what the forward saw
(``context_fn``): every ``captum_transformers_*`` context variable at its forward value and
the package's torch-function modes on the stack. The recomputation then applies the same
rules and saves the same tensors; the graph the backward walks is the forward's
(non-reentrant checkpointing only refills its saved tensors), so hooks and records made in
the forward are the ones read, and the recorder's entries made during the recomputation are
dropped (:func:`recomputing` tells the recorder). The maps equal those without
checkpointing; the layers' activations are freed after the forward, as in training.

HF needs train mode for checkpointing, so dropout must be off by configuration (p = 0) or
the explanation is refused as random (``allow_stochastic=True`` explains one seeded draw).

Example::

    >>> model.gradient_checkpointing_enable(); model.train()
    >>> with keep_gradient_checkpointing():
    ...     relevance = AttnLRP(model).attribute(ids, target=5)
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
from typing import Any, Callable, Iterator, List, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model_state import offload, patching
from ..model_state.contextual import IMPLEMENTATIONS
from ..capture.recorder import Recorder

_PREFIX = "captum_transformers"

_KEPT: contextvars.ContextVar[bool] = contextvars.ContextVar("captum_transformers_checkpointing_kept", default=False)
# True while a checkpointed layer's forward is being recomputed in the backward pass.
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("captum_transformers_recomputing", default=False)


@contextlib.contextmanager
def keep_gradient_checkpointing() -> Iterator[None]:
    """Explanations entered inside keep HF gradient checkpointing on (see the module docstring)."""
    reset = _KEPT.set(True)
    try:
        yield
    finally:
        _KEPT.reset(reset)


def kept() -> bool:
    """Whether explanations in this context keep gradient checkpointing on."""
    return _KEPT.get()


def recomputing() -> bool:
    """Whether the forward running now is a checkpointed layer's recomputation (backward pass)."""
    return _RECOMPUTING.get()


def _is_package_mode(mode: Any) -> bool:
    return type(mode).__module__.startswith(_PREFIX + ".")


def _throwaway(value: Any) -> Any:
    """A recorder (or an ``(recorder, blocks)`` entry) as a copy with no sites: the recomputed
    attention calls go through the same code, and what they record is dropped."""
    if isinstance(value, Recorder):
        copied = copy.copy(value)
        copied.sites, copied.anchors, copied.stream_valid = [], dict(value.anchors), dict(value.stream_valid)
        copied.recomputation = True
        return copied
    if isinstance(value, tuple) and value and isinstance(value[0], Recorder):
        return (_throwaway(value[0]), *value[1:])
    return value


@contextlib.contextmanager
def _as_in_forward(variables: List[Tuple[contextvars.ContextVar, Any]], modes: List[Any],
                   forwards: List[Tuple[nn.Module, Any]], model: nn.Module, key: Any) -> Iterator[None]:
    """The package's context variables, torch-function modes, the layer's instance forwards and
    the configs' attention implementation ``key`` as the forward had them (the backward may run
    after the explanation's patches were taken off); all as before on exit."""
    tokens = [(var, var.set(_throwaway(value))) for var, value in variables]
    tokens.append((_RECOMPUTING, _RECOMPUTING.set(True)))
    depth = torch._C._len_torch_function_stack()
    current = [torch._C._get_function_stack_at(i) for i in range(depth)]
    missing = [mode for mode in modes if not any(mode is c for c in current)]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(offload.offloaded_on_error(model))  # an error mid-recomputation
            for module, forward in forwards:
                if vars(module).get("forward") is not forward:
                    stack.enter_context(patching.attributes(module, forward=forward))
            if key is not None:  # the configs answer the forward's kernel key (here only)
                stack.enter_context(patching.hf_attention_implementation(model, key))
            for mode in missing:
                torch._C._push_on_torch_function_stack(mode)
            try:
                yield
            finally:
                for _ in missing:
                    torch._C._pop_torch_function_stack()
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


class _Reenterable:
    """A context manager entered afresh each time: a second backward pass through the same
    graph (TransformerRelevance's) recomputes the layer again under the same context."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make, self.entered = make, []

    def __enter__(self) -> Any:
        manager = self.make()
        self.entered.append(manager)
        return manager.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.entered.pop().__exit__(*exc)


def _context_fn(layer: nn.Module, model: nn.Module) -> Callable:
    def contexts() -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(forward context, recomputation context): called by ``checkpoint`` as the forward runs."""
        variables = [(var, value) for var, value in contextvars.copy_context().items()
                     if var.name.startswith(_PREFIX) and var is not _RECOMPUTING]
        depth = torch._C._len_torch_function_stack()
        modes = [m for m in (torch._C._get_function_stack_at(i) for i in range(depth)) if _is_package_mode(m)]
        forwards = [(m, vars(m)["forward"]) for m in layer.modules() if "forward" in vars(m)]
        configs = patching.reachable_configs(model)
        key = IMPLEMENTATIONS.get().get(id(configs[0])) if configs else None
        return contextlib.nullcontext(), _Reenterable(lambda: _as_in_forward(variables, modes, forwards, model, key))
    return contexts


def explained_checkpoint(layer: nn.Module, model: nn.Module) -> Callable[[Callable], Callable]:
    """For :func:`~.patching.instance_function`: ``layer``'s ``_gradient_checkpointing_func``
    while explaining ``model``: torch's non-reentrant checkpoint, recomputing under the
    forward's rules (the user's other keyword arguments, e.g. ``preserve_rng_state``, kept)."""
    def make(original: Callable) -> Callable:
        keywords = dict(getattr(original, "keywords", {}) or {})
        keywords.pop("use_reentrant", None)
        keywords.pop("context_fn", None)
        return functools.partial(checkpoint, use_reentrant=False, context_fn=_context_fn(layer, model), **keywords)
    return make


__all__ = ["keep_gradient_checkpointing", "kept", "recomputing", "explained_checkpoint"]
