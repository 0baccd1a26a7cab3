"""Frozen parameters get their flags back even when a restore itself is interrupted (a
KeyboardInterrupt, or a torch-function mode that raises during the unwinding, as the explorer's
cancel check once did): every entry is restored and the first error is raised again."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from captum_transformers.model_state import patching


class _InterruptsRestores(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "requires_grad_":
            raise KeyboardInterrupt("interrupted while restoring")
        return func(*args, **(kwargs or {}))


def test_every_flag_is_restored_when_a_restore_raises():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    before = [p.requires_grad for p in model.parameters()]
    mode = _InterruptsRestores()
    with pytest.raises(KeyboardInterrupt, match="interrupted while restoring"):
        with patching.parameters_require_grad(model):
            assert all(p.requires_grad for p in model.parameters())
            mode.__enter__()
    mode.__exit__(None, None, None)
    assert [p.requires_grad for p in model.parameters()] == before
    assert not patching._FORCED_GRAD
