"""``paused_rule_mode``: code that can get no rule from the operation-rule mode runs outside it.

1. Inside, the innermost :class:`OperationRules` mode is set aside (a product of two
   relevance-carrying tensors is a plain product) and it is back after the block, also after
   an error; another torch-function mode on top, or none, is left alone.
2. The norm rule, the activation rule and the attention kernels pause the mode: the mode sees
   none of their operations on a Llama under AttnLRP (sdpa and eager).
3. Pausing changes no map: AttnLRP, ConservativeLRP and Chefer's rules give bit-identical
   relevance with the pause disabled.
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from captum_transformers import AttnLRP, ConservativeLRP, RuleSet
from captum_transformers.propagation.rules import operations as operation_rules
from captum_transformers.propagation.rules.operations import OperationRules, paused_rule_mode

transformers = pytest.importorskip("transformers")
from hf_models import decoder_llm  # noqa: E402


def _product_rule_applied(a: torch.Tensor, b: torch.Tensor) -> bool:
    return type((a * b).grad_fn).__name__ != "MulBackward0"


def _operands():
    return torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)


# == 1. what is paused, and that it comes back ====================================================
def test_pauses_the_innermost_rule_mode_and_restores_it():
    a, b = _operands()
    with OperationRules(RuleSet.ATTN_LRP, 1) as mode:
        assert _product_rule_applied(a, b)
        with paused_rule_mode():
            assert not _product_rule_applied(a, b)
            assert torch.overrides._get_current_function_mode() is None
        assert torch.overrides._get_current_function_mode() is mode
        assert _product_rule_applied(a, b)


def test_restores_the_mode_after_an_error():
    a, b = _operands()
    with OperationRules(RuleSet.ATTN_LRP, 1) as mode:
        with pytest.raises(RuntimeError, match="inside"):
            with paused_rule_mode():
                raise RuntimeError("inside")
        assert torch.overrides._get_current_function_mode() is mode
        assert _product_rule_applied(a, b)


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_leaves_another_mode_on_top_alone():
    a, b = _operands()
    with OperationRules(RuleSet.ATTN_LRP, 1), _Counting() as counting:
        with paused_rule_mode():
            calls = counting.calls
            # The foreign mode still sees the operation, and the rule mode under it still acts.
            assert _product_rule_applied(a, b)
            assert counting.calls > calls
        assert torch.overrides._get_current_function_mode() is counting


def test_without_a_mode_is_a_no_op():
    a, b = _operands()
    with paused_rule_mode():
        assert not _product_rule_applied(a, b)
    assert torch.overrides._get_current_function_mode() is None


# == 2. the rule patches and kernels pause the mode ===============================================
def _llama(impl: str, dtype=torch.float32) -> torch.nn.Module:
    return decoder_llm("llama", impl, dtype)


def _ids():
    ids = torch.randint(1, 53, (3, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    return ids, {"attention_mask": mask}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_mode_sees_no_operation_of_norms_activations_or_attention(impl, monkeypatch):
    """Inside norms, activations and the attention kernels the mode sees only the patches'
    own guard (``x.requires_grad``, read before the pause: without gradients nothing is paused)."""
    import sys

    model = _llama(impl)
    watched = {id(m) for m in model.modules() if type(m).__name__ in ("LlamaRMSNorm", "SiLUActivation")}
    kernels = ("sdpa_attention_forward", "_explicit_attention", "_fused_sdpa")
    seen, inside_watched = [], []
    original = OperationRules.__torch_function__

    def watching(self, func, types, args=(), kwargs=None):
        frame, place = sys._getframe(1), None
        while frame is not None and place is None:
            if id(frame.f_locals.get("self")) in watched:
                place = type(frame.f_locals["self"]).__name__
            elif frame.f_code.co_name in kernels:
                place = frame.f_code.co_name
            frame = frame.f_back
        seen.append(func)
        guard = getattr(func, "__self__", None) is torch._C.TensorBase.requires_grad
        if place is not None and not guard:
            inside_watched.append((place, getattr(func, "__name__", repr(func))))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(OperationRules, "__torch_function__", watching)
    ids, kwargs = _ids()
    AttnLRP(model).attribute(ids, target=3, return_tokens=True, forward_kwargs=kwargs)
    assert len(seen) > 50, "the operation-rule mode saw almost nothing: the check below would pass vacuously"
    assert inside_watched == []


# == 3. no map changes ===========================================================================
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("method", [AttnLRP, ConservativeLRP], ids=lambda m: m.__name__)
def test_pausing_changes_no_map(method, impl, monkeypatch):
    model = _llama(impl, torch.float64)
    ids, kwargs = _ids()
    paused = method(model).attribute(ids, target=3, return_tokens=True, forward_kwargs=kwargs)
    monkeypatch.setattr(operation_rules.paused_rule_mode, "__enter__", lambda self: self)
    monkeypatch.setattr(operation_rules.paused_rule_mode, "__exit__", lambda self, *exc: None)
    unpaused = method(model).attribute(ids, target=3, return_tokens=True, forward_kwargs=kwargs)
    assert paused.abs().max() > 0
    assert torch.equal(paused, unpaused)
