"""What passes a method's trace takes, declared once and run by whoever explains.

A method says which forward and backward passes it needs (:class:`PassPlan`); the classifier
path (:meth:`TraceAttribution._trace`) runs the plan once per batch, and the generation engine
(:mod:`captum_transformers.generation.engine`) runs the same plan once for many explained
(row, target) pairs: one forward, then the plan's backward pass(es) per pair.

Example::

    >>> plan = PassPlan(CaptureSpec(backward_reduce=functional.gradient_weighted_heads))
    >>> plan.needs_second_trace
    False
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..capture.trace import CaptureSpec
from ..propagation.rules.rule_set import RuleSet


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """One forward pass (under ``rules`` when given) whose backward pass is reduced by ``spec``.

    ``plain_spec``: a second backward pass through the same graph with plain gradients (every
    rule switched off), reduced by ``plain_spec``; the trace then holds its values.
    ``then``: a second, separate trace run after this one (its target the first one's
    resolved target), for rules that change the forward graph itself (a detached attention
    gate), so the plain gradient needs its own forward pass.
    """

    spec: CaptureSpec
    rules: Optional[RuleSet] = None
    plain_spec: Optional[CaptureSpec] = None
    then: Optional["PassPlan"] = None

    @property
    def needs_second_trace(self) -> bool:
        return self.then is not None


def resolved_target(target_index: torch.Tensor) -> Any:
    """The target index of a first trace as a per-example list for the next one."""
    if target_index.numel() == 0:
        return None
    return [tuple(row) for row in target_index.tolist()]
