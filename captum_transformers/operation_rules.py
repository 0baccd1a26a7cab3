"""Per-operation LRP rules, installed by intercepting torch functions during the forward pass.

Inside :func:`operation_rules` the model's forward runs under a ``TorchFunctionMode`` that
replaces selected operations by small autograd Functions. Each Function's forward calls the
original operation with the original arguments, so outputs are bit-identical; only its
backward changes. Everything is in gradient x input form: a backward receives ``g_out`` with
``R_out = y * g_out`` and returns ``g_in`` with ``R_in = x * g_in`` (see
``docs/relevance-rules.md``).

Rules (Chefer et al., CVPR 2021, Sec. 3.1-3.2; Achtibat et al., ICML 2024):

* ``linear="alpha1beta0"``: Eq. 5, the positive-subset rule for signed inputs,
  ``R_x = x+ (W+^T s) + x- (W-^T s)``, ``s = R_z / (W+ x+ + W- x-)``; bias gets no relevance.
* ``activation="identity"``: ``R_x = R_y`` (GELU, SiLU, ReLU, tanh...).
* ``softmax="identity"``: ``R_x = R_y``.
* ``matmul="uniform"``: a product of two relevance-carrying tensors splits relevance in
  half: the gradient of each operand is halved (``R_a + R_b = R``).
* ``add="normalized"``: Sec. 3.2 normalisation of ``u + v`` per example,
  ``Rbar_u = R_u |S_u| / (|S_u| + |S_v|) * S / S_u`` with ``S_u = sum R_u``.

Only operations whose tensor operands require grad are touched; an operand that does not
(a mask, a constant) carries no relevance. In-place additions keep the plain gradient.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from . import patching

_TINY = 1e-9


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``a / (b + eps * sign(b))``, and 0 where ``b == 0`` (sign-aware stabiliser)."""
    stabilised = denominator + _TINY * torch.where(denominator >= 0, 1.0, -1.0).to(denominator.dtype)
    return torch.where(denominator == 0, torch.zeros_like(numerator), numerator / stabilised)


class _LinearAlphaBeta(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, func, args, kwargs):
        output = func(*args, **kwargs)
        ctx.save_for_backward(x, weight, output)
        return output

    @staticmethod
    def backward(ctx, grad):
        x, weight, output = ctx.saved_tensors
        dtype = torch.promote_types(x.dtype, torch.float32)
        x, weight, grad, output = x.to(dtype), weight.to(dtype), grad.to(dtype), output.to(dtype)
        relevance = output * grad
        w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
        z_pos = F.linear(x.clamp(min=0), w_pos) + F.linear(x.clamp(max=0), w_neg)
        s = safe_divide(relevance, z_pos)
        g_x = torch.where(x >= 0, s @ w_pos, s @ w_neg)
        return g_x.to(ctx.saved_tensors[0].dtype), None, None, None, None


class _IdentityRule(torch.autograd.Function):
    """``R_in = R_out``: the gradient times ``y / x`` (a closed form where one is known)."""

    @staticmethod
    def forward(ctx, x, ratio_fn, func, args, kwargs):
        output = func(*args, **kwargs)
        ctx.save_for_backward(x, output)
        ctx.ratio_fn = ratio_fn
        return output

    @staticmethod
    def backward(ctx, grad):
        x, output = ctx.saved_tensors
        ratio = ctx.ratio_fn(x, output) if ctx.ratio_fn is not None else safe_divide(output, x)
        return grad * ratio.to(grad.dtype), None, None, None, None


class _UniformProduct(torch.autograd.Function):
    """A product of two relevance-carrying operands: each gets half the plain gradient."""

    @staticmethod
    def forward(ctx, a, b, func, args, kwargs):
        ctx.func, ctx.args, ctx.kwargs = func, args, kwargs
        ctx.save_for_backward(a, b)
        return func(*args, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        with torch.enable_grad():
            a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
            output = _call_with(ctx.func, ctx.args, ctx.kwargs, a, b, a_, b_)
            g_a, g_b = torch.autograd.grad(output, (a_, b_), grad, allow_unused=True)
        half = lambda g, like: torch.zeros_like(like) if g is None else 0.5 * g  # noqa: E731
        return half(g_a, a), half(g_b, b), None, None, None


def _call_with(func, args, kwargs, a, b, new_a, new_b):
    """Call ``func`` with operands ``a``/``b`` replaced by ``new_a``/``new_b``."""
    swap = lambda t: new_a if t is a else new_b if t is b else t  # noqa: E731
    return func(*[swap(t) for t in args], **{k: swap(v) for k, v in kwargs.items()})


class _NormalizedAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, batch_dim, func, args, kwargs):
        output = func(*args, **kwargs)
        ctx.save_for_backward(a, b)
        ctx.batch_dim = batch_dim
        return output

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        dtype = torch.promote_types(grad.dtype, torch.float32)
        g = grad.to(dtype)
        r_a, r_b = (a.to(dtype) * g), (b.to(dtype) * g)

        def per_example(r):
            moved = r.movedim(ctx.batch_dim, 0) if ctx.batch_dim is not None else r.reshape(1, *r.shape)
            total = moved.reshape(moved.shape[0], -1).sum(1)
            shape = [1] * r.dim()
            if ctx.batch_dim is not None:
                shape[ctx.batch_dim] = -1
            return total.reshape(shape) if ctx.batch_dim is not None else total.reshape([1] * r.dim())

        s_a, s_b = per_example(r_a), per_example(r_b)
        s = s_a + s_b
        share_a = safe_divide(s_a.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_a)
        share_b = safe_divide(s_b.abs(), s_a.abs() + s_b.abs()) * safe_divide(s, s_b)
        return (g * share_a).to(grad.dtype), (g * share_b).to(grad.dtype), None, None, None, None


def _gelu_ratio(approximate: str) -> Callable:
    def ratio(x, output):
        if approximate == "tanh":
            return 0.5 * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x.pow(3))))
        return 0.5 * (1 + torch.erf(x * 0.7071067811865476))
    return ratio


_ACTIVATIONS = {
    F.gelu: lambda args, kwargs: _gelu_ratio(kwargs.get("approximate", args[1] if len(args) > 1 else "none")),
    F.silu: lambda args, kwargs: (lambda x, y: torch.sigmoid(x)),
    F.relu: lambda args, kwargs: (lambda x, y: (x > 0).to(x.dtype)),
    torch.relu: lambda args, kwargs: (lambda x, y: (x > 0).to(x.dtype)),
    torch.tanh: lambda args, kwargs: None,
    torch.Tensor.tanh: lambda args, kwargs: None,
    torch.sigmoid: lambda args, kwargs: None,
    F.mish: lambda args, kwargs: None,
}
_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax)
_PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.baddbmm,
             torch.einsum)
_ADDS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, operator.add)
_LINEARS = (F.linear, torch.addmm)


def _grad_tensors(args, kwargs):
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    return [t for t in tensors if t.requires_grad and t.is_floating_point()]


class OperationRules(TorchFunctionMode):
    """The torch-function mode that swaps operations for their rule Functions."""

    def __init__(self, rules, batch_size: Optional[int] = None):
        super().__init__()
        self.rules = rules
        self.batch_size = batch_size

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rules = self.rules
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if rules.linear == "alpha1beta0" and func in _LINEARS:
            if func is F.linear and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                return _LinearAlphaBeta.apply(args[0], args[1], func, args, kwargs)
            if func is torch.addmm and len(args) >= 3 and args[1].requires_grad and not kwargs:
                # addmm(bias, x, W) with W laid out (in, out), as in GPT-2's Conv1D.
                return _LinearAlphaBeta.apply(args[1], args[2].t(), func, args, kwargs)
        if rules.activation == "identity" and func in _ACTIVATIONS and args and isinstance(args[0], torch.Tensor) \
                and args[0].requires_grad:
            return _IdentityRule.apply(args[0], _ACTIVATIONS[func](args, kwargs), func, args, kwargs)
        if rules.softmax == "identity" and func in _SOFTMAX and args[0].requires_grad:
            return _IdentityRule.apply(args[0], None, func, args, kwargs)
        if rules.matmul == "uniform" and func in _PRODUCTS and not (func is torch.einsum and len(args) == 2):
            operands = _grad_tensors(args, kwargs)
            if len(operands) == 2:
                return _UniformProduct.apply(operands[0], operands[1], func, args, kwargs)
        if rules.add == "normalized" and func in _ADDS and len(args) == 2 and not kwargs:
            a, b = args
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.requires_grad and b.requires_grad \
                    and a.shape == b.shape and a.is_floating_point():
                return _NormalizedAdd.apply(a, b, self._batch_dim(a), func, args, kwargs)
        return func(*args, **kwargs)

    def _batch_dim(self, tensor: torch.Tensor) -> Optional[int]:
        if self.batch_size is None:
            return None
        for dim, size in enumerate(tensor.shape):
            if size == self.batch_size:
                return dim
        return None


def needs_operation_rules(rules) -> bool:
    return (rules.linear != "gradient" or rules.activation != "gradient" or rules.softmax == "identity"
            or rules.matmul != "gradient" or rules.add != "gradient")


@contextlib.contextmanager
def operation_rules(model: nn.Module, rules) -> Iterator[None]:
    """Run ``model``'s forward under :class:`OperationRules` (reversibly: instance forward)."""
    if not needs_operation_rules(rules):
        yield
        return

    def make(original):
        def forward(*args: Any, **kwargs: Any):
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            batch = first.shape[0] if first is not None and first.dim() > 0 else None
            with OperationRules(rules, batch):
                return original(*args, **kwargs)
        return forward

    with patching.instance_forward(model, make):
        yield
