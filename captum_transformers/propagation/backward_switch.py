"""One forward, two backward passes: rule Functions that can also give the plain gradient.

TransformerRelevance needs the LRP relevance and the plain gradient of the same attention
maps. Rather than two forward passes, rule Functions built inside :func:`switchable_backward`
keep a :class:`BackwardSwitch` and read it when their backward runs, so one graph is
differentiated twice (``retain_graph=True``): under the rules, then plainly.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Optional

import torch


class BackwardSwitch:
    """Which backward the rule Functions of one forward pass compute: their rule (``plain``
    False) or the plain gradient of the operation they wrap (``plain`` True).

    Every rule Function built while :func:`switchable_backward` is active keeps a reference
    to the switch and reads it when its backward runs (on whatever thread autograd uses), so
    one graph answers both questions: ``autograd.grad(..., retain_graph=True)`` for the
    relevance, then flip the switch and differentiate the same graph again for the gradient.
    The forward is computed once; both backward passes are exact (the plain one recomputes
    or reuses exactly what autograd would have saved).
    """

    def __init__(self) -> None:
        self.plain = False

    @contextlib.contextmanager
    def plain_gradient(self) -> Iterator[None]:
        """Within this context, backward passes through the graph are plain gradients."""
        previous, self.plain = self.plain, True
        try:
            yield
        finally:
            self.plain = previous


# The switch of the innermost switchable_backward in this context (None outside one): rule
# Functions keep it at forward; a recomputation in the backward sets the forward's switch again.
SWITCH: contextvars.ContextVar[Optional[BackwardSwitch]] = contextvars.ContextVar(
    "captum_transformers_backward_switch", default=None)


@contextlib.contextmanager
def switchable_backward() -> Iterator[BackwardSwitch]:
    """Rule Functions built inside this context can also give the plain gradient.

    Example::

        >>> with switchable_backward() as switch, operation_rules(model, RuleSet.CHEFER):
        ...     y = model(x)
        >>> relevance_grad, = torch.autograd.grad(y.sum(), x, retain_graph=True)   # LRP rules
        >>> with switch.plain_gradient():
        ...     plain_grad, = torch.autograd.grad(y.sum(), x)                       # dy/dx
    """
    switch = BackwardSwitch()
    token = SWITCH.set(switch)
    try:
        yield switch
    finally:
        SWITCH.reset(token)


def current_switch() -> Optional[BackwardSwitch]:
    """The switch rule Functions built now will read (None outside :func:`switchable_backward`)."""
    return SWITCH.get()


def plain_requested(ctx) -> bool:
    """Whether the rule Function whose ``ctx`` kept a switch must give the plain gradient now."""
    return ctx.switch is not None and ctx.switch.plain


def plain_gradient_of(func: Callable, args, kwargs, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The plain gradient of ``func(*args, **kwargs)`` with respect to its operand ``x``
    (the tensor in ``args`` or ``kwargs`` that *is* ``x``), by recomputing it: exactly what
    autograd would have computed, for the operations whose rule keeps only ``x``."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        swap = lambda t: leaf if t is x else t  # noqa: E731
        output = func(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
        (g,) = torch.autograd.grad(output, leaf, grad)
    return g
