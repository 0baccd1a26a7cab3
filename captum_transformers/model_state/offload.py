"""Models dispatched by accelerate (``dispatch_model``, ``device_map``, ``cpu_offload``, disk offload).

accelerate puts a hook (``module._hf_hook``, an ``AlignDevicesHook`` or a ``SequentialHook``
holding one) on each module whose weights live elsewhere: with offload the module's own
parameters are ``meta`` tensors, and the hook loads them from its ``weights_map`` (CPU memory
or a folder on disk) just before the module's forward and puts them back on ``meta`` just
after (transformers PR #46978). Inside the forward the package's rules see real weights,
like the plain model's. Outside a forward, a weight read directly (the norm probes of
:func:`~captum_transformers.propagation.rules.rule_set.find_norms`) would be a ``meta`` tensor, whose
values do not exist: it is onloaded through the module's own hook here (:func:`onloaded`),
or the read is refused with the module's name (:class:`~captum_transformers.errors.CaptureError`),
never computed on ``meta``.

Each onload replaces a parameter by a new object (accelerate's ``set_module_tensor_to_device``),
so a flag set on the parameter seen before a forward does not reach the one seen after:
:func:`requires_grad_restored` puts each offloaded slot's ``requires_grad`` back by
(module, name). accelerate's hooked forward has no ``finally``: after an exception inside an
offloaded module's forward, :func:`offloaded_on_error` puts its weights back on ``meta``
through the module's own ``post_forward``. A weight on ``meta`` that no hook loads is refused
for every adapter and method (:func:`refuse_unloaded`, entered with
:func:`~captum_transformers.compat.compiled.uncompiled`).

Example::

    >>> model = accelerate.cpu_offload(model, execution_device="cpu")
    >>> with onloaded(model.model.norm):
    ...     model.model.norm.weight      # the real weight, on the execution device
    >>> model.model.norm.weight.device   # back on meta
    device(type='meta')
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..errors import CaptureError
from . import module_walk


def offloading_hook(module: nn.Module) -> Optional[Any]:
    """The accelerate ``AlignDevicesHook`` with ``offload=True`` on ``module`` (also inside a
    ``SequentialHook``), or None: such a hook keeps the module's weights on ``meta`` outside its forward."""
    hook = vars(module).get("_hf_hook")
    stack = [hook]
    while stack:
        hook = stack.pop()
        if hook is None:
            continue
        if type(hook).__name__ == "AlignDevicesHook" and getattr(hook, "offload", False):
            return hook
        stack.extend(getattr(hook, "hooks", ()) or ())
    return None


def is_dispatched(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries an accelerate hook (``_hf_hook``)."""
    return any("_hf_hook" in vars(m) for m in module_walk.modules(model))


def _own_meta_tensors(module: nn.Module) -> List[str]:
    return [name for name, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None and t.is_meta]


@contextlib.contextmanager
def onloaded(module: nn.Module, name: str = "") -> Iterator[None]:
    """Inside, ``module``'s own weights are real tensors on its execution device: loaded by its
    accelerate hook (``pre_forward``) and put back on ``meta`` on exit (``post_forward``), as
    around its forward. A module without such a hook runs as it is, unless a weight of its own
    is on ``meta`` (a model loaded empty, or a hook removed): then :class:`CaptureError`, since
    a value computed from a ``meta`` tensor does not exist. ``name``: the module's path, for the
    message."""
    hook = offloading_hook(module)
    if hook is None:
        meta = _own_meta_tensors(module)
        if meta:
            raise _unloaded(module, name, meta)
        yield
        return
    hook.pre_forward(module)
    try:
        yield
    finally:
        hook.post_forward(module, None)


def _holds_meta(module: nn.Module, hook: Any) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=hook.place_submodules))


@contextlib.contextmanager
def offloaded_on_error(model: nn.Module) -> Iterator[None]:
    """On an exception inside, every offloaded module of ``model`` that was on ``meta`` on entry
    and holds loaded weights now is put back through its own hook's ``post_forward``.

    Why: accelerate's hooked forward runs ``pre_forward``, the forward, then ``post_forward``
    with no ``finally``: an exception raised inside the module's forward (a refusal of the
    package, an interrupt) would leave its weights loaded, so an offloaded model would keep
    growing in memory after each failed explanation.
    """
    offloaded = [(module, hook) for module in module_walk.modules(model)
                 for hook in (offloading_hook(module),) if hook is not None and _holds_meta(module, hook)]
    try:
        yield
    except BaseException:
        for module, hook in offloaded:
            if not _holds_meta(module, hook):
                hook.post_forward(module, None)
        raise


def refuse_unloaded(model: nn.Module) -> None:
    """:class:`CaptureError` naming the first module of ``model`` with a weight on ``meta`` that no
    accelerate offload hook (its own, or an ancestor's that places its submodules) loads for its
    forward: computed on ``meta``, every value downstream would be a placeholder."""
    stack = [(model, "")]
    while stack:
        module, name = stack.pop()
        hook = offloading_hook(module)
        if hook is not None and hook.place_submodules:
            continue  # the whole subtree is loaded by this hook
        meta = [] if hook is not None else _own_meta_tensors(module)
        if meta:
            raise _unloaded(module, name, meta)
        stack.extend((child, f"{name}.{key}" if name else key) for key, child in module._modules.items()
                     if child is not None)


def _unloaded(module: nn.Module, name: str, meta: List[str]) -> CaptureError:
    return CaptureError(
        f"The module {name or type(module).__name__} ({type(module).__name__}) has its {meta} on the meta device and "
        "no accelerate offload hook to load them, so the values the explanation would read from it do not exist. "
        "Load the weights (accelerate.load_checkpoint_and_dispatch, from_pretrained(device_map=...)) or dispatch the "
        "model with accelerate.dispatch_model / cpu_offload so that they are loaded where they are used."
    )


def materialised(tensor: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """``tensor``, or an empty tensor of its dtype on ``model``'s first execution device when it
    is on ``meta``: a probe made "like" a weight must run where the weights are loaded."""
    if not tensor.is_meta:
        return tensor
    return torch.empty(0, dtype=tensor.dtype, device=execution_device(model))


def input_device(model: nn.Module) -> torch.device:
    """Where ``model``'s inputs go: its first parameter's device, or, when that parameter is
    offloaded (on ``meta``), the execution device of its first accelerate hook."""
    first = next(model.parameters(), None)
    if first is None:
        return torch.device("cpu")
    return materialised(first, model).device


def input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype floating inputs (pixels) take for ``model``: its first floating parameter's
    (offloaded ones keep their dtype on ``meta``), float32 if it has none."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def execution_device(model: nn.Module) -> torch.device:
    """The execution device of the first accelerate hook of ``model`` (where its first offloaded
    module computes); :class:`CaptureError` if ``model`` has none."""
    for module in module_walk.modules(model):
        hook = offloading_hook(module)
        if hook is not None and hook.execution_device is not None:
            device = hook.execution_device
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    raise CaptureError(
        f"{type(model).__name__} has weights on the meta device but no accelerate offload hook names an execution "
        "device for them. Load the weights, or dispatch the model with accelerate.dispatch_model / cpu_offload."
    )


@contextlib.contextmanager
def requires_grad_restored(model: nn.Module) -> Iterator[None]:
    """Every offloaded parameter slot's ``requires_grad`` (by module and name) as on entry, on exit.

    accelerate replaces an offloaded module's parameters by new objects at each onload, and
    the new object copies the flag of the one it replaces: a flag the explanation set on the
    parameters it saw before the forward would otherwise stay on the ones left after it.
    """
    slots: List[Tuple[nn.Module, str, bool]] = [
        (module, name, parameter.requires_grad)
        for module in module_walk.modules(model) if offloading_hook(module) is not None
        for name, parameter in module._parameters.items() if parameter is not None]
    try:
        yield
    finally:
        for module, name, flag in slots:
            parameter = module._parameters.get(name)
            if parameter is not None and parameter.requires_grad != flag:
                with torch._C.DisableTorchFunction():  # as patching restores flags: no mode may refuse it
                    parameter.requires_grad_(flag)


__all__ = ["offloading_hook", "is_dispatched", "onloaded", "offloaded_on_error", "refuse_unloaded", "materialised",
           "input_device", "input_dtype", "execution_device", "requires_grad_restored"]
