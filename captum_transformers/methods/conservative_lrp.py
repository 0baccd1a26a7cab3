"""Conservative propagation (Ali et al., ICML 2022): the AH and AH+LN rules."""
from __future__ import annotations

import dataclasses
from typing import Literal, Union

from torch import nn

from ..adapters.base import Adapter
from ..errors import InputError
from ..propagation.rules.rule_set import RuleSet
from .lrp import RuleGradientXInput

VARIANTS = {"AH": RuleSet.AH, "AH+LN": RuleSet.AH_LN, "GI": RuleSet.GRADIENT}


class ConservativeLRP(RuleGradientXInput):
    r"""LRP for Transformers that conserves relevance through attention and LayerNorm.

    Gradient x Input with two rules changed in the backward pass only (Ali et al., "XAI for
    Transformers: Better Explanations through Conservative Propagation", ICML 2022, Sec. 4):

    .. math:: y_j = \sum_i x_i\,[p_{ij}]_{\text{const}} \quad\text{(AH)}, \qquad
              y = \frac{x - \mathbb{E}[x]}{[\sqrt{\epsilon + \mathrm{Var}[x]}]_{\text{const}}} \quad\text{(LN)},
              \qquad R(x) = x \odot \frac{\partial f_t}{\partial x}

    Both variants also hold the activated gate of gated MLPs (SwiGLU, GeGLU:
    ``act(gate(x)) * up(x)``) constant, as LXT's CP-LRP does (``RuleSet.gated_product``).
    With ``variant="AH+LN"`` (default) the relevance of a bias-free model, gated or not, sums
    to the explained logit; ``"AH"`` applies the attention rule only; ``"GI"`` is plain Gradient x
    Input read at the same place, for comparison. LayerNorm- and RMSNorm-like modules are
    found by probing their behaviour (``norm_mean="constant"`` also freezes the mean).

    ``activation_rule="identity"`` (default ``"gradient"``) adds the identity rule on every
    element-wise nonlinearity (GELU, SiLU, ReLU, hand-written GELUs found by probing, and the
    ``tanh`` of BERT's pooler), as LXT / AttnLRP do: for ``y = \sigma(x)`` element-wise

    .. math:: R(x_k) = R(y_k), \qquad\text{i.e.}\quad
              \frac{\partial y_k}{\partial x_k} \;\to\; \frac{\sigma(x_k)}{x_k}
              \quad\text{so that}\quad x_k \frac{\partial f}{\partial x_k} = y_k \frac{\partial f}{\partial y_k}

    (0 where ``x_k = 0``). Under plain gradient a nonlinearity that is not homogeneous of
    degree one (GELU, tanh) loses or creates relevance (``x * sigma'(x) != sigma(x)``); with the
    identity rule a bias-free model conserves exactly whatever its activations. The default
    keeps Ali et al.'s rules (parity with their reference implementation); biases still absorb
    relevance either way (docs/relevance-rules.md measures both on the shipped MiniLM).

    Relevance is read at the input embeddings: for text the hidden states entering the first
    Transformer layer, summed over the hidden size, ``(B, S)``; for images the pixels
    (``x * grad``, ``(B, C, H, W)``; the patch embedding's bias and the position embeddings
    absorb some relevance there). ``relevance_at="tokens"`` or ``return_tokens=True`` gives
    the token relevance for images too (all tokens, prefix tokens included), which is where
    conservation is exact; ``relevance_at="inputs"`` forces floating-point inputs.

    Example::

        >>> lrp = ConservativeLRP(model)                      # AH+LN
        >>> relevance, delta = lrp.attribute(input_ids, target=labels, return_tokens=True,
        ...                                  forward_kwargs={"attention_mask": mask},
        ...                                  return_convergence_delta=True)
        >>> # delta = relevance.sum(-1) - logit[target]: ~0 for bias-free models
    """

    def __init__(self, model: nn.Module, variant: Literal["AH+LN", "AH", "GI"] = "AH+LN",
                 adapter: Union[Adapter, str, None] = None, norm_mean: Literal["gradient", "constant"] = "gradient",
                 relevance_at: Literal["auto", "tokens", "inputs"] = "auto",
                 activation_rule: Literal["gradient", "identity"] = "gradient") -> None:
        if variant not in VARIANTS:
            raise InputError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}.")
        if norm_mean not in ("gradient", "constant"):
            raise InputError(f"norm_mean must be 'gradient' or 'constant', got {norm_mean!r}.")
        if activation_rule not in ("gradient", "identity"):
            raise InputError(f"activation_rule must be 'gradient' (Ali et al.'s rules) or 'identity' (relevance passes "
                             f"element-wise nonlinearities unchanged), got {activation_rule!r}.")
        rules = VARIANTS[variant]
        if activation_rule == "identity":
            rules = dataclasses.replace(rules, name=rules.name + " (identity activations)", activation="identity")
        if norm_mean == "constant" and rules.norm != "gradient":
            rules = dataclasses.replace(rules, name=rules.name + " (mean constant)", norm="scale_and_mean_constant")
        super().__init__(model, rules, adapter, relevance_at)
        self.variant = variant
        self.activation_rule = activation_rule
