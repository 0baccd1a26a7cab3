"""What may read the attention weights a HuggingFace attention module returns.

The kernel returns a zero-stride stand-in instead of the (B, H, Q, K) map where the map is streamed
(:mod:`.kernel`) or replayed (:mod:`.replayed_kernel`); either is declined where something outside
the package may read the weights. :func:`weights_reader` names that reader, or gives ''.
"""
from __future__ import annotations

from typing import Any, Dict

from torch import nn


def weights_reader(module: nn.Module, kwargs: Dict[str, Any]) -> str:
    """What may read the weights ``module`` returns ('' if nothing): transformers' output recording
    (``output_attentions=True`` in the call or config), the keyword itself, or a user's forward hook."""
    try:  # before transformers 5, output_attentions reaches the modules as the keyword
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        _active_collector = None
    collected = (_active_collector and _active_collector.get()) or {}
    recorded = sorted(key for key in collected if "attention" in key)
    if recorded:
        return f"transformers records the attention weights ({', '.join(recorded)}: output_attentions=True)"
    if kwargs.get("output_attentions"):
        return "the attention weights are requested (output_attentions=True)"
    hooks = [*module._forward_hooks.values(), *nn.modules.module._global_forward_hooks.values()]
    # The package's hooks and transformers' recording hook (its collector checked above) read none.
    foreign = [hook for hook in hooks if not getattr(getattr(hook, "func", hook), "__module__", "").startswith(
        "captum_transformers") and getattr(hook, "__name__", "") != "output_capturing_hook"]
    return f"a forward hook on {type(module).__name__} may read its attention weights ({foreign})" if foreign else ""
