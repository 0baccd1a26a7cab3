"""Conservative propagation (Ali et al., ICML 2022): the AH and AH+LN rules."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from captum.attr import GradientAttribution
from captum.log import log_usage
from torch import nn

from ..adapters.base import Adapter
from ..errors import InputError
from ..registry import get_adapter
from ..rules import RuleSet
from .base import TensorOrTuple, _check_forward_kwargs, _format_additional, _format_inputs, scores_to_input

VARIANTS = {"AH": RuleSet.AH, "AH+LN": RuleSet.AH_LN, "GI": RuleSet.GRADIENT}


class ConservativeLRP(GradientAttribution):
    r"""LRP for Transformers that conserves relevance through attention and LayerNorm.

    Gradient x Input with two rules changed in the backward pass only (Ali et al., "XAI for
    Transformers: Better Explanations through Conservative Propagation", ICML 2022, Sec. 4):

    .. math:: y_j = \sum_i x_i\,[p_{ij}]_{\text{const}} \quad\text{(AH)}, \qquad
              y = \frac{x - \mathbb{E}[x]}{[\sqrt{\epsilon + \mathrm{Var}[x]}]_{\text{const}}} \quad\text{(LN)},
              \qquad R(x) = x \odot \frac{\partial f_t}{\partial x}

    With ``variant="AH+LN"`` (default) the relevance of a bias-free model sums to the
    explained logit; ``"AH"`` applies the attention rule only; ``"GI"`` is plain Gradient x
    Input read at the same place, for comparison. LayerNorm- and RMSNorm-like modules are
    found by probing their behaviour (``norm_mean="constant"`` also freezes the mean).

    Relevance is read at the hidden states entering the first Transformer layer and summed
    over the hidden size: ``(B, S)`` for text, the patch tokens upsampled to ``(B, C, H, W)``
    for images (``return_tokens=True`` gives all tokens, prefix tokens included).
    ``relevance_at="inputs"`` reads ``x * grad`` at floating-point inputs instead (pixels or
    embeddings; position embeddings and biases there absorb some relevance).

    Example::

        >>> lrp = ConservativeLRP(model)                      # AH+LN
        >>> relevance, delta = lrp.attribute(input_ids, target=labels, return_tokens=True,
        ...                                  forward_kwargs={"attention_mask": mask},
        ...                                  return_convergence_delta=True)
        >>> # delta = relevance.sum(-1) - logit[target]: ~0 for bias-free models
    """

    def __init__(self, model: nn.Module, variant: Literal["AH+LN", "AH", "GI"] = "AH+LN",
                 adapter: Union[Adapter, str, None] = None, norm_mean: Literal["gradient", "constant"] = "gradient",
                 relevance_at: Literal["tokens", "inputs"] = "tokens") -> None:
        if variant not in VARIANTS:
            raise InputError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}.")
        if norm_mean not in ("gradient", "constant"):
            raise InputError(f"norm_mean must be 'gradient' or 'constant', got {norm_mean!r}.")
        if relevance_at not in ("tokens", "inputs"):
            raise InputError(f"relevance_at must be 'tokens' or 'inputs', got {relevance_at!r}.")
        super().__init__(model)
        self.model = model
        self.adapter = get_adapter(model, adapter)
        rules = VARIANTS[variant]
        if norm_mean == "constant" and rules.norm != "gradient":
            rules = RuleSet(rules.name + " (mean constant)", rules.attention_gate, "scale_and_mean_constant")
        self.rules = rules
        self.variant = variant
        self.relevance_at = relevance_at

    def has_convergence_delta(self) -> bool:
        return True

    @log_usage()
    def attribute(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
                  return_tokens: bool = False, return_convergence_delta: bool = False,
                  forward_kwargs: Optional[dict] = None):
        """Relevance of the inputs for the target output.

        Returns attributions shaped like ``inputs`` (or (B, N) token relevance with
        ``return_tokens=True``), and with ``return_convergence_delta=True`` also the
        per-example ``sum(relevance) - explained output``.
        """
        formatted, is_tuple = _format_inputs(inputs)
        _check_forward_kwargs(forward_kwargs, formatted[0].shape[0])
        result = self.adapter.relevance(self.model, formatted, _format_additional(additional_forward_args), target,
                                        self.rules, "tokens" if self.relevance_at == "tokens" else "inputs",
                                        forward_kwargs)
        if result.tokens is not None:
            if return_tokens:
                attributions: TensorOrTuple = result.tokens
            else:
                mapped = tuple(scores_to_input(result.tokens, result.layout, t) for t in formatted)
                attributions = mapped if is_tuple else mapped[0]
        else:
            attributions = result.per_input if is_tuple else result.per_input[0]
        if return_convergence_delta:
            return attributions, result.total - result.scores.to(result.total.dtype)
        return attributions
