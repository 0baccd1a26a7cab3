"""Every method's ``allow_stochastic`` keyword: :class:`StochasticOptIn` and the wrapper that
adds the keyword to a subclass's ``__init__``.

One rule for the attention methods (:class:`~captum_transformers.methods.base.TraceAttribution`),
the LRP shell and the Captum baselines: a model whose training-mode forward is random or
batch-dependent is refused unless the method was built with ``allow_stochastic=True``
(:mod:`~captum_transformers.compat.stochastic_layers`). Held apart from the Captum shell of
``base.py``, which inherits it.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ..compat.stochastic_layers import OPT_IN, allowing
from ..errors import InputError


def _taking_opt_in(init: Any) -> Any:
    """``init`` taking the keyword-only ``allow_stochastic`` too, stored on the instance after
    ``init`` ran (so an outer subclass's value wins over the default its ``super().__init__`` set)."""

    @functools.wraps(init)
    def __init__(self, *args: Any, allow_stochastic: bool = False, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.allow_stochastic = opt_in_flag(allow_stochastic)

    signature = inspect.signature(init)
    parameters = list(signature.parameters.values())
    keyword = inspect.Parameter(OPT_IN, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    __init__.__signature__ = signature.replace(parameters=parameters[:at] + [keyword] + parameters[at:])
    __init__._takes_opt_in = True
    return __init__


def opt_in_flag(value: Any) -> bool:
    """``value`` of an ``allow_stochastic`` keyword, checked: True or False, anything else refused."""
    if not isinstance(value, bool):
        raise InputError(f"{OPT_IN} must be True or False, got {value!r}.")
    return value


class StochasticOptIn:
    """Every method's ``allow_stochastic`` keyword (default False), one rule for all of them.

    A model in training mode whose forward is random or batch-dependent (active dropout, drop
    path, batch norm on batch statistics) is refused by every method
    (:mod:`~captum_transformers.compat.stochastic_layers`): each call would explain another
    forward. ``Method(model, ..., allow_stochastic=True)`` explains it on purpose, one random
    draw per call (layers that would update running statistics stay refused). Training mode
    without such layers (gradient checkpointing, dropouts with ``p = 0``) needs no opt-in.

    Subclasses get the keyword on their own ``__init__`` without forwarding it (it is added
    here, when the subclass is defined), and run their passes inside :meth:`stochastic_rule`.
    """

    allow_stochastic: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_takes_opt_in", False) \
                and OPT_IN not in inspect.signature(init).parameters:
            cls.__init__ = _taking_opt_in(init)

    def stochastic_rule(self):
        """The context the method's forward passes run in: refused or allowed, as chosen."""
        return allowing(self.allow_stochastic)
