"""Snapshot everything a capture could leave behind on a model, to prove exact restore, and
make a forward pass fail midway."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def snapshot(model: nn.Module) -> dict:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hooks = {
        name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
               len(getattr(m, "_forward_hooks_with_kwargs", {})))
        for name, m in model.named_modules()
    }
    instance_attrs = {name: sorted(k for k in vars(m) if k in ("forward", "fused_attn")) for name, m in model.named_modules()}
    flags = {name: getattr(m, "fused_attn", None) for name, m in model.named_modules()}
    impls = {}
    for name, m in model.named_modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            # The class too: the HF adapter gives a config a per-context subclass while explaining.
            impls[name] = (type(config), config._attn_implementation_internal)
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    requires_grad = {k: p.requires_grad for k, p in model.named_parameters()}
    return dict(state=state, hooks=hooks, instance_attrs=instance_attrs, flags=flags, impls=impls, grads=grads,
                requires_grad=requires_grad,
                training=model.training, fastpath=torch.backends.mha.get_fastpath_enabled())


@contextlib.contextmanager
def raising_after(module: nn.Module, error: BaseException) -> Iterator[None]:
    """Inside, every forward of ``module`` raises ``error`` once it has run (the hook is
    removed on the way out): a capture or rule context dies mid-forward."""

    def explode(*_):
        raise error

    handle = module.register_forward_hook(explode)
    try:
        yield
    finally:
        handle.remove()


def assert_same(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for key in before["state"]:
        assert torch.equal(before["state"][key], after["state"][key]), key
    for key in ("hooks", "instance_attrs", "flags", "impls", "training", "fastpath", "requires_grad"):
        assert before[key] == after[key], key
    for key, grad in before["grads"].items():
        other = after["grads"][key]
        assert (grad is None and other is None) or torch.equal(grad, other), key
