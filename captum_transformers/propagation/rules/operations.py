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
* ``matmul="uniform"``: a product (matrix or elementwise) of two relevance-carrying tensors
  splits relevance in half: the gradient of each operand is halved (``R_a + R_b = R``).
* ``linear="alpha1beta0_separate"``: the authors' LRP baseline, separate denominators.
* ``linear="gamma"``: LRP-gamma, ``z_ij = x_j (w_ij + gamma w_ij^+)``, bias ``b + gamma b^+``
  in the denominator (Ali et al.'s code; ``RuleSet.gamma``); ``"generalized_gamma"``: the
  sign-aware form of zennit's ``Gamma`` (LXT's ViT example).
* ``pixel_conv="zB"``: the z^B rule on the convolution reading the (leaf) pixel input.
* ``add="normalized"``: Sec. 3.2 normalisation of ``u + v`` per example,
  ``Rbar_u = R_u |S_u| / (|S_u| + |S_v|) * S / S_u`` with ``S_u = sum R_u``.
* ``gated_product="constant"`` (CP-LRP's gate rule, as in LXT): in ``act(g) * u`` the
  activated gate ``act(g)`` is a constant multiplier, ``R_u = R`` and the gate path gets
  nothing. The gate is found by behaviour: an elementwise product of two relevance-carrying
  tensors exactly one of which is the output of an activation (a torch activation function,
  or an activation module found by probing; products *inside* such a module are its own
  business and are left alone). It takes precedence over ``matmul="uniform"`` on that product.

Only operations whose tensor operands require grad are touched; an operand that does not
(a mask, a constant) carries no relevance. In-place additions keep the plain gradient.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import operator
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...compat.quantized_linear import plain_weight
from .quantized import linear_rule_forwards
from ...model_state import patching
from ...model_state import module_walk, offload
from ...errors import CaptureError
from .activation_discovery import is_activation
from ..backward_switch import SWITCH, plain_gradient_of
from ..backward_switch import plain_requested as _plain
from .gated_product import ConstantGateProduct, GateTracker, gate_scopes
from .identity_ratio import identity_ratio
from .linear import LinearAlphaBeta, LinearGamma, linear_rule, safe_divide  # noqa: F401  (part of this API)
from .normalized_add import ExampleRows, NormalizedAdd, row_groups
from .pixel import PixelBoundedConv, is_input_pixels
from .own_output import VIEW_UPDATE_REFUSAL, keep_outputs_overwritten_by, own_output, saved_tensors


class _IdentityRule(torch.autograd.Function):
    """``R_in = R_out``: the gradient times ``y / x`` (a closed form where one is known)."""

    @staticmethod
    def forward(ctx, x, ratio_fn, func, args, kwargs):
        output = own_output(func(*args, **kwargs), args, kwargs)  # a model may update it in place
        # A closed-form ratio needs only x: keeping the output too would cost memory.
        ctx.save_for_backward(x, output if ratio_fn is None else None)
        ctx.ratio_fn = ratio_fn
        ctx.switch = SWITCH.get()
        if ctx.switch is not None:  # the plain gradient recomputes the operation from x
            ctx.func, ctx.args, ctx.kwargs = func, args, kwargs
        return output

    @staticmethod
    def backward(ctx, grad):
        x, output = saved_tensors(ctx, "identity")
        if _plain(ctx):
            if ctx.func in _SOFTMAX and output is not None and output.dtype == x.dtype:
                # What autograd computes for a softmax, from the output kept for the rule.
                dim = ctx.kwargs.get("dim", ctx.args[1] if len(ctx.args) > 1 else None)
                if isinstance(dim, int):
                    return torch._softmax_backward_data(grad, output, dim, x.dtype), None, None, None, None
            by_hand = _PLAIN_ACTIVATION_GRADIENTS.get(ctx.func)
            if by_hand is not None and ctx.args and ctx.args[0] is x and grad.dtype == x.dtype:
                return by_hand(grad, x, ctx.args, ctx.kwargs), None, None, None, None
            return plain_gradient_of(ctx.func, ctx.args, ctx.kwargs, x, grad), None, None, None, None
        ratio = ctx.ratio_fn(x, output) if ctx.ratio_fn is not None else identity_ratio(output, x)
        return ratio.to(grad.dtype).mul_(grad), None, None, None, None
    # No keep_before_overwrite: an in-place update of a softmax's or activation function's output
    # that this rule kept stays refused by name (tests/test_inplace_views_rules.py); only the module
    # rule (IdentityRelevance, a norm's output: XLM's ``tensor *= mask``) keeps its output first.


def keep_output(node) -> None:
    """Before the model updates in place the output of an identity-rule node ``node`` (XLM's
    ``tensor *= mask`` after its norms; seen by the rule mode,
    :func:`.own_output.keep_outputs_overwritten_by`): keep a copy of that output as the forward
    pass produced it, with the input, on the node. The backward pass then reads them
    (:func:`kept_or_saved`): the update's own gradient (``* mask``) arrives first, then
    ``R_x = R_y`` on the output the norm had, exactly as on the out-of-place twin ``y = y * mask``
    (which keeps both tensors too). Nothing is kept where the node keeps no output (a closed-form
    ratio) or has kept it already; an update the mode did not see is refused at the backward pass."""
    if node.kept is not None:
        return
    try:
        x, output = node.saved_tensors
    except RuntimeError:  # already updated by an operation the mode did not see: refused at the backward pass
        return
    if output is not None:
        node.kept = (x, output.detach().clone(), x._version)


def kept_or_saved(ctx, rule: str) -> tuple:
    """``(x, output)`` of an identity-rule node: those :func:`keep_output` kept before an update
    in place of the output, else its saved tensors (refused by name where either was updated in
    place since, unseen)."""
    if ctx.kept is None:
        return saved_tensors(ctx, rule)
    x, output, version = ctx.kept
    if x._version != version:
        return saved_tensors(ctx, rule)  # the input updated in place since: refused by name
    return x, output


class _UniformProduct(torch.autograd.Function):
    """A product of two relevance-carrying operands: each gets half the plain gradient."""

    @staticmethod
    def forward(ctx, a, b, func, args, kwargs):
        ctx.func, ctx.args, ctx.kwargs = func, args, kwargs
        ctx.save_for_backward(a, b)
        ctx.switch = SWITCH.get()
        return own_output(func(*args, **kwargs), args, kwargs)  # a model may update it in place

    @staticmethod
    def backward(ctx, grad):
        a, b = saved_tensors(ctx, "uniform product")
        func, args = ctx.func, ctx.args
        if func in _ELEMENTWISE_PRODUCTS and len(args) == 2 and not ctx.kwargs:
            g_a, g_b = grad * b, grad * a
        elif func in _MATMULS and len(args) == 2 and args[0] is a and args[1] is b and a.dim() >= 2 and b.dim() >= 2:
            g_a, g_b = grad @ b.transpose(-1, -2), a.transpose(-1, -2) @ grad
        else:  # anything else (einsum, baddbmm, unusual argument orders): differentiate a recomputation
            with torch.enable_grad():
                a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
                output = _call_with(func, args, ctx.kwargs, a, b, a_, b_)
                g_a, g_b = torch.autograd.grad(output, (a_, b_), grad, allow_unused=True)
        plain = _plain(ctx)
        fresh = func in _ELEMENTWISE_PRODUCTS or func in _MATMULS  # g_a, g_b made above: halved in place

        def share(g, like):
            if g is None:
                return torch.zeros_like(like)
            summed = g.sum_to_size(like.shape)
            if plain:
                return summed
            return summed.mul_(0.5) if fresh or summed is not g else 0.5 * summed

        return share(g_a, a), share(g_b, b), None, None, None


def _call_with(func, args, kwargs, a, b, new_a, new_b):
    """Call ``func`` with operands ``a``/``b`` replaced by ``new_a``/``new_b``."""
    swap = lambda t: new_a if t is a else new_b if t is b else t  # noqa: E731
    return func(*[swap(t) for t in args], **{k: swap(v) for k, v in kwargs.items()})


def _gelu_ratio(approximate: str) -> Callable:
    def ratio(x, output):
        # y / x with y recomputed (one vectorised pass, where the closed form 0.5 (1 + erf(x /
        # sqrt 2)) takes four): R_x = x g y / x = R_y exactly, for the y the forward produced.
        # 0 / 0 at x = 0 becomes 0 (x = 0 carries no relevance).
        return F.gelu(x, approximate=approximate).div_(x).nan_to_num_(nan=0.0)
    return ratio


def _gelu_approximation(args, kwargs) -> str:
    return kwargs.get("approximate", args[1] if len(args) > 1 else "none")


_ACTIVATIONS = {
    F.gelu: lambda args, kwargs: _gelu_ratio(_gelu_approximation(args, kwargs)),
    F.silu: lambda args, kwargs: (lambda x, y: torch.sigmoid(x)),
    F.relu: lambda args, kwargs: (lambda x, y: (x > 0).to(x.dtype)),
    torch.relu: lambda args, kwargs: (lambda x, y: (x > 0).to(x.dtype)),
    torch.tanh: lambda args, kwargs: None,
    torch.Tensor.tanh: lambda args, kwargs: None,
    torch.sigmoid: lambda args, kwargs: None,
    F.mish: lambda args, kwargs: None,
}
# The plain gradient of an activation from its input, as autograd computes it, without
# running the activation again (the backward switch's plain pass).
_PLAIN_ACTIVATION_GRADIENTS = {
    F.gelu: lambda grad, x, args, kwargs: torch.ops.aten.gelu_backward(grad, x,
                                                                       approximate=_gelu_approximation(args, kwargs)),
    F.silu: lambda grad, x, args, kwargs: torch.ops.aten.silu_backward(grad, x),
}
_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax)
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
_PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.baddbmm,
             torch.einsum)
# A gate times a value (SwiGLU's act(gate(x)) * up(x)): the uniform rule of AttnLRP, Prop. 3.2.
_ELEMENTWISE_PRODUCTS = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, operator.mul)
_ADDS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, operator.add)
_LINEARS = (F.linear, torch.addmm)


def _handled_operations(rules) -> frozenset:
    """The operations :class:`OperationRules` may replace under ``rules``; all others run as they are."""
    handled = set(_ACTIVATIONS)  # rule or not, an activation's output is a gate candidate
    if rules.linear != "gradient":
        handled.update(_LINEARS)
    if rules.pixel_conv == "zB":
        handled.add(F.conv2d)
    if rules.gated_product == "constant" or rules.matmul == "uniform":
        handled.update(_ELEMENTWISE_PRODUCTS)
    if rules.softmax == "identity":
        handled.update(_SOFTMAX)
    if rules.matmul == "uniform":
        handled.update(_PRODUCTS)
    if rules.add == "normalized":
        handled.update(_ADDS)
    return frozenset(handled)


def _grad_tensors(args, kwargs):
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    return [t for t in tensors if t.requires_grad and t.is_floating_point()]


class OperationRules(TorchFunctionMode):
    """The torch-function mode that swaps operations for their rule Functions."""

    def __init__(self, rules, batch_size: Optional[int] = None, groups: Optional[torch.Tensor] = None):
        super().__init__()
        if groups is not None and (groups.dim() != 1 or groups.shape[0] != batch_size):
            raise CaptureError(f"{tuple(groups.shape)} example indices (graphs) for a forward whose first input has "
                               f"{batch_size} rows; the normalised add rule needs one per row.")
        self.rules = rules
        self.batch_size = batch_size
        self.groups = groups  # (batch_size,) each row's example (a PyG batch: node -> graph), or None
        # The examples of flattened rows ((B, N, D) hidden states as (B * N, D)), for the add rule.
        self.rows = ExampleRows(batch_size if rules.add == "normalized" and groups is None else None)
        self._tokens: list = []
        self.gates = GateTracker(rules.gated_product == "constant")
        self.handled = _handled_operations(rules)

    def __enter__(self):
        # Published to the attention kernels only when there are per-operation rules for them:
        # the gate rule alone leaves the kernels on their plain path.
        self._tokens.append(ACTIVE_RULES.set(self if needs_operation_rules(self.rules) else ACTIVE_RULES.get()))
        return super().__enter__()

    def __exit__(self, *exc_info):
        ACTIVE_RULES.reset(self._tokens.pop())
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # An output a rule reads back (the add rule's sum, the identity rule's output), about to
        # be updated in place: the rule keeps what it needs first.
        keep_outputs_overwritten_by(func, args, kwargs)
        result = self._dispatch(func, args, kwargs)
        if self.rows.active:
            self.rows.observe(func, args, kwargs, result)
        return result

    def _dispatch(self, func, args, kwargs):
        """``func(*args, **kwargs)``, through its rule Function where the rules give it one."""
        if func not in self.handled or not torch.is_grad_enabled():  # most operations: no rule
            try:
                return func(*args, **kwargs)
            except RuntimeError as error:
                if VIEW_UPDATE_REFUSAL not in str(error):
                    raise
                raise CaptureError(
                    f"The model updates in place ({getattr(func, '__name__', func)}) a view that a relevance rule "
                    "returned of one of its operation's operands, which the rule cannot follow (the update would "
                    "change that operand too). Make that update out of place in the model, or explain it with "
                    "plain gradients.") from None
        rules = self.rules
        if rules.linear != "gradient" and func in _LINEARS:
            # (x, weight (out, in), bias) of the layer, or None.
            layer = None
            if func is F.linear:
                # Positional or keyword (EVA and BEiT call F.linear(x, weight=..., bias=...)).
                x = args[0] if args else kwargs.get("input")
                weight = args[1] if len(args) > 1 else kwargs.get("weight")
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    layer = (x, weight, bias)
            elif func is torch.addmm and len(args) >= 3 and args[1].requires_grad and not kwargs:
                # addmm(bias, x, W) with W laid out (in, out), as in GPT-2's Conv1D.
                layer = (args[1], args[2].t(), args[0])
            if layer is not None:
                # A torchao layer passes its quantized weight: the rule reads the dequantized one.
                return linear_rule(rules, layer[0], plain_weight(layer[1]), layer[2], func, args, kwargs)
        if rules.pixel_conv == "zB" and func is F.conv2d and isinstance(args[0], torch.Tensor) \
                and args[0].requires_grad and is_input_pixels(args[0]) and args[0].dim() == 4:
            return PixelBoundedConv.apply(args[0], args[1], func, args, kwargs)
        if func in _ACTIVATIONS and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            if rules.activation == "identity":
                return self.gates.mark(_IdentityRule.apply(args[0], _ACTIVATIONS[func](args, kwargs), func, args,
                                                           kwargs))
            return self.gates.mark(func(*args, **kwargs))
        if rules.gated_product == "constant" and func in _ELEMENTWISE_PRODUCTS:
            gated = self.gates.split(args, kwargs)
            if gated is not None:
                return ConstantGateProduct.apply(gated[0], gated[1], func, args, kwargs)
        if rules.softmax == "identity" and func in _SOFTMAX and args[0].requires_grad:
            return _IdentityRule.apply(args[0], None, func, args, kwargs)
        if rules.matmul == "uniform" and (func in _PRODUCTS or func in _ELEMENTWISE_PRODUCTS) \
                and not (func is torch.einsum and len(args) == 2):
            operands = _grad_tensors(args, kwargs)
            if len(operands) == 2:
                return _UniformProduct.apply(operands[0], operands[1], func, args, kwargs)
        if rules.add == "normalized" and func in _ADDS and len(args) == 2 and not kwargs:
            a, b = args
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.requires_grad and b.requires_grad \
                    and a.is_floating_point() and (a.shape == b.shape or self._batch_broadcast(a, b)):
                if a.dim() == 0:  # two scalars: one example (no batch dimension to read)
                    return NormalizedAdd.apply(a, b, None, func, args, kwargs)
                wide = a if a.shape[0] >= b.shape[0] else b
                if self.groups is not None:
                    return NormalizedAdd.apply(a, b, 0, func, args, kwargs, row_groups(self.groups, wide))
                rows = self.rows.add_groups(a, b)
                if rows is not None:  # flattened rows (B * N, D): each example over its own rows
                    return NormalizedAdd.apply(a, b, 0, func, args, kwargs, rows, self.batch_size)
                return NormalizedAdd.apply(a, b, self._batch_dim(wide), func, args, kwargs)
        return func(*args, **kwargs)

    def _batch_broadcast(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """``(B, ...) + (1, ...)``: one operand is shared by every example (a position embedding).
        Normalised per example like equal shapes, so the rule does not depend on the batch size
        (with B = 1 the shapes are equal)."""
        return (self.batch_size is not None and a.dim() == b.dim() >= 1 and a.shape[1:] == b.shape[1:]
                and sorted((a.shape[0], b.shape[0])) == sorted((1, self.batch_size)))

    def _batch_dim(self, tensor: torch.Tensor) -> Optional[int]:
        if self.batch_size is None:
            return None
        for dim, size in enumerate(tensor.shape):
            if size == self.batch_size:
                return dim
        return None


# The OperationRules published to the operations of the forward running now (None where none
# asks for per-operation rules): read by the rule Functions and the attention kernels at forward.
ACTIVE_RULES: contextvars.ContextVar[Optional[OperationRules]] = contextvars.ContextVar(
    "captum_transformers_operation_rules", default=None)
# The mode of the forward running now, whether or not it publishes per-operation rules.
_ACTIVE_MODE: contextvars.ContextVar[Optional[OperationRules]] = contextvars.ContextVar(
    "captum_transformers_rule_mode", default=None)


class paused_rule_mode:
    """Inside: the :class:`OperationRules` mode, when it is the innermost torch-function mode of
    this thread, is set aside; it is put back on exit, also after an error. Anything else
    (another mode on top, no mode) is left as it is.

    For code whose operations can get no rule from the mode: a norm's or activation's forward
    under ``no_grad`` (the mode replaces nothing without gradients), an attention kernel whose
    rules live in its operands' gradients. Their operations then skip the mode's Python dispatch
    (about 1 us each; a Llama layer runs some sixty of them there). The mode's gate tracking is
    unaffected (:data:`_ACTIVE_MODE` stays set).

    Example::

        >>> with paused_rule_mode():
        ...     output = norm_forward(x)   # under no_grad: no rule applies inside
    """

    __slots__ = ("_mode",)

    def __enter__(self) -> "paused_rule_mode":
        self._mode = None
        depth = torch._C._len_torch_function_stack()
        if depth and isinstance(torch._C._get_function_stack_at(depth - 1), OperationRules):
            self._mode = torch._C._pop_torch_function_stack()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._mode is not None:
            torch._C._push_on_torch_function_stack(self._mode)
            self._mode = None


def active_rules():
    """The rule set of the :class:`OperationRules` mode active now (None outside one)."""
    mode = ACTIVE_RULES.get()
    return None if mode is None else mode.rules


def needs_operation_rules(rules) -> bool:
    return (rules.linear != "gradient" or rules.activation != "gradient" or rules.softmax == "identity"
            or rules.matmul != "gradient" or rules.add != "gradient" or rules.pixel_conv != "gradient")


def needs_rule_mode(rules) -> bool:
    """Whether the forward must run under :class:`OperationRules` (per-operation rules, or the
    gate rule, which only watches activations and elementwise products)."""
    return needs_operation_rules(rules) or rules.gated_product != "gradient"


class IdentityRelevance(torch.autograd.Function):
    """The identity rule around a whole module (a norm, an activation): ``R_x = R_y``, i.e.
    ``dx = dy * y / x`` given the module's input ``x`` and its already computed output ``y``.

    ``recompute(x)`` (the module's own forward) gives the plain gradient when the pass runs
    under a :class:`BackwardSwitch` set to ``plain``."""

    @staticmethod
    def forward(ctx, x, held, recompute=None):
        # ``held``: ``[output]``, made without gradients. Not an input of the Function, so it is
        # returned as a new tensor, not a view, which a model may update in place (XLM's
        # ``tensor *= mask``): the rule mode keeps the output first (keep_before_overwrite), an
        # update it does not see is refused at the backward pass.
        output = held[0]
        ctx.save_for_backward(x, output)
        ctx.switch, ctx.recompute, ctx.kept = SWITCH.get(), recompute, None
        return output

    @staticmethod
    def keep_before_overwrite(node) -> None:
        """The model is about to update the output in place (XLM's ``tensor *= mask`` after a
        norm, seen by the rule mode): keep it as the norm produced it (:func:`keep_output`)."""
        keep_output(node)

    @staticmethod
    def backward(ctx, grad):
        try:
            x, output = kept_or_saved(ctx, "identity")
        except CaptureError:
            raise CaptureError(
                "The model changed a module's output in place after the identity rule read it (e.g. a mask "
                "multiplied into a norm's output with *=), so R_x = R_y cannot be applied to the output it "
                "had (an update inside the model's forward, which the rule mode sees, is followed exactly; this "
                "one was not seen). Explain it with rules that keep the norm's own gradient (ConservativeLRP, "
                "AttnLRP), or make the update out of place.") from None
        if _plain(ctx):
            return plain_gradient_of(ctx.recompute, (x,), {}, x, grad), None, None
        return identity_ratio(output, x).to(grad.dtype).mul_(grad), None, None


def _activation_forward(identity: bool):
    """An activation module's forward: the identity rule as a whole (``identity``) and/or its
    output remembered as a gate candidate; the products inside it are not gates."""
    def make(original):
        def forward(x, *args, **kwargs):
            if not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or not x.requires_grad:
                return original(x, *args, **kwargs)
            mode = _ACTIVE_MODE.get()
            if identity:
                with paused_rule_mode():  # the whole module gets one rule: none inside it
                    with torch.no_grad():
                        output = original(x, *args, **kwargs)
                    output = IdentityRelevance.apply(x, [output], lambda inputs: original(inputs, *args, **kwargs))
                    if mode is not None and mode.rows.active:
                        mode.rows.follow(x, output)  # an activation keeps the rows' examples
            elif mode is not None:
                with mode.gates.inside_activation():
                    output = original(x, *args, **kwargs)
            else:
                output = original(x, *args, **kwargs)
            return output if mode is None else mode.gates.mark(output)
        return forward
    return make


@contextlib.contextmanager
def operation_rules(model: nn.Module, rules,
                    groups: Optional[Callable[[], Optional[torch.Tensor]]] = None) -> Iterator[None]:
    """Run ``model``'s forward under :class:`OperationRules` (reversibly: instance forward).

    ``groups``, if given, returns each row's example for the forward about to run (a PyG batch:
    each node's graph), so that the normalised add sums per example.

    With ``activation="identity"``, activation *modules* found by probing (parameter-free,
    elementwise, ``f(0) = 0``) get the identity rule as a whole, so hand-written activations
    whose inner operations are products and sums are covered too.

    With the gate rule as the only rule (``RuleSet.AH``, ``RuleSet.AH_LN``) the mode runs only
    inside the modules that hold an activation module (the MLPs, where ``act(gate(x)) * up(x)``
    is computed), so the rest of the forward pays no interception; an activation called as a
    function in a module without an activation child is then not seen.
    """
    if not needs_rule_mode(rules):
        yield
        return

    def make(original):
        def forward(*args: Any, **kwargs: Any):
            if _ACTIVE_MODE.get() is not None:  # a scope inside another scope: one mode is enough
                return original(*args, **kwargs)
            first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
            batch = first.shape[0] if first is not None and first.dim() > 0 else None
            mode = OperationRules(rules, batch, groups() if groups is not None else None)
            token = _ACTIVE_MODE.set(mode)
            try:
                with mode:
                    return original(*args, **kwargs)
            finally:
                _ACTIVE_MODE.reset(token)
        return forward

    with contextlib.ExitStack() as stack:
        probed = []
        if rules.activation == "identity" or rules.gated_product == "constant":
            like = next((t for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()), None)
            like = None if like is None else offload.materialised(like, model)  # not meta (accelerate offload)
            probed = [module for module in module_walk.modules(model) if like is not None and is_activation(module, like)]
            for module in probed:
                stack.enter_context(patching.instance_forward(
                    module, _activation_forward(rules.activation == "identity")))
        if needs_operation_rules(rules):
            stack.enter_context(patching.instance_forward(model, make))
            if rules.linear != "gradient":  # bitsandbytes layers never call F.linear
                stack.enter_context(linear_rule_forwards(model, rules))
        else:
            for scope in gate_scopes(model, probed):
                stack.enter_context(patching.instance_forward(scope, make))
        yield

