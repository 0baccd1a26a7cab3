"""LRP rules as autograd Functions whose forward is the operation's own: one file per rule, the
:class:`~.rule_set.RuleSet` table that says which rule sits where, and the installer that intercepts
torch operations while a model runs.
"""
from .rule_set import RuleSet

__all__ = ["RuleSet"]
