"""Which of the package's two HF kernel keys a captured model runs under, and why.

transformers builds each model's attention mask for the implementation its config names. Under
:data:`~.hf_kernel.ATTENTION_KEY` that is the eager mask: an additive float (B, 1, N, N) tensor
(64 MiB at 4k tokens). Under :data:`~.hf_kernel.SDPA_KEY` it is SDPA's: boolean where something is
masked, None for a causal unpadded sequence (the kernel then makes one boolean causal mask shared
by the layers, or one per chunk of rows). An sdpa model runs under SDPA_KEY

* in its rule contexts, where the rules are a scaling of the attention operands (the fused
  kernel runs: :func:`~captum_transformers.propagation.attention.fused.fusable`);
* in a capture whose maps are replayed or streamed into the explained rows (one token sequence,
  :mod:`~captum_transformers.capture.replayed_rows`, :mod:`~captum_transformers.capture.row_stream`),
  and in the rule contexts inside such a capture;

and every other model, or capture, under ATTENTION_KEY (the maps are those of the eager attention).

Example::

    >>> with patching.hf_attention_implementation(model, capture_key(recorder, blocks, model)): ...
"""
from __future__ import annotations

from typing import Iterable, Optional

from torch import nn

from ...model_state import patching
from ...model_state.contextual import IMPLEMENTATIONS
from ...capture.recorder import Recorder
from ...capture.trace import Block, one_self_attending_sequence
from ...propagation.attention.fused import fusable
from ...propagation.rules.rule_set import RuleSet
from .kernel import ATTENTION_KEY, SDPA_KEY


def capture_key(recorder: Recorder, blocks: Iterable[Block], model: nn.Module) -> str:
    """The key of a capture: SDPA_KEY for an sdpa model whose maps are replayed or streamed."""
    return SDPA_KEY if runs_sdpa(model) and _rows_of_one_sequence(recorder, list(blocks)) else ATTENTION_KEY


def propagation_key(model: nn.Module, rules: RuleSet) -> str:
    """The key of a rule context: SDPA_KEY for an sdpa model under fusable rules, or inside a
    capture that chose SDPA_KEY (it is entered first: its masks stay)."""
    inside_sdpa_capture = attention_implementation_now(model) == SDPA_KEY
    return SDPA_KEY if runs_sdpa(model) and (fusable(rules) or inside_sdpa_capture) else ATTENTION_KEY


def _rows_of_one_sequence(recorder: Recorder, blocks) -> bool:
    replay = getattr(recorder.spec, "replay", None)
    if replay is not None:
        return replay.one_sequence(blocks)
    return recorder.spec.row_stream is not None and one_self_attending_sequence(blocks)


def runs_sdpa(model: nn.Module) -> bool:
    """Whether every HF config of ``model`` stores the "sdpa" implementation (read past any
    context that points it at the package's kernels)."""
    configs = patching.reachable_configs(model)  # the configs the kernel key is switched on
    return bool(configs) and all(getattr(c, "_attn_implementation_internal", None) == "sdpa" for c in configs)


def attention_implementation_now(model: nn.Module) -> Optional[str]:
    """The key :func:`~captum_transformers.model_state.patching.hf_attention_implementation` points
    ``model``'s HF configs at in this context (None outside one, or where they disagree)."""
    current = IMPLEMENTATIONS.get()
    keys = {current.get(id(config)) for config in patching.reachable_configs(model)}
    return keys.pop() if len(keys) == 1 else None
