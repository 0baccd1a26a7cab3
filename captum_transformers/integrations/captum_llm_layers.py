r"""The package's LRP rules as Captum layer methods, so Captum's LLM wrapper accepts them.

Captum's ``LLMGradientAttribution(attr_method, tokenizer)`` takes only its own layer gradient
methods (``LayerGradientXActivation`` among them): it copies the method, replaces its
``forward_func`` by a function returning the log-probability of each target token, runs the
method's ``attribute`` once per target token and sums the layer attribution over the hidden
size. :class:`LayerAttnLRP` and :class:`LayerConservativeLRP` are ``LayerGradientXActivation``
whose backward pass follows the package's propagation rules (:class:`~captum_transformers.
propagation.rules.RuleSet`), installed on the original model around every call, so that

.. math:: R(h) = h \odot \frac{\partial^{\mathrm{rules}} s}{\partial h}, \qquad
          s = \log \mathrm{softmax}(z_{-1})_{t} \ \text{(Captum's wrapper)} \ \text{or any score of the forward}

at the layer output :math:`h` (default: the input embeddings). AttnLRP: Achtibat et al.,
"AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML 2024.
AH / AH+LN: Ali et al., "XAI for Transformers: Better Explanations through Conservative
Propagation", ICML 2022. With the logit as the score, the rules conserve it (AH+LN: exactly
for bias-free models); through ``log_softmax`` the relevance is that of the log-probability,
whose own gradient (one-hot minus softmax) Captum's wrapper applies by plain autograd.

Example::

    >>> from captum.attr import LLMGradientAttribution, TextTokenInput
    >>> llm_attr = LLMGradientAttribution(LayerAttnLRP(llama), tokenizer)
    >>> result = llm_attr.attribute(TextTokenInput("The capital of France is", tokenizer), target=" Paris")
    >>> result.token_attr          # (target tokens, prompt tokens) AttnLRP relevance of log p
"""
from __future__ import annotations

import contextlib
from typing import Any, List, Literal, Optional, Tuple, Union

import torch
from captum.attr import LayerGradientXActivation
from captum.log import log_usage
from torch import nn

from ..adapters.base import Adapter
from ..compat.foreign_patches import check_library_classes
from ..adapters.input_checks import model_dtype, refuse_inference_mode
from ..adapters.registry import get_adapter
from ..model_state import patching
from ..compat.compiled import uncompiled
from ..model_state.exclusive import exclusive
from ..compat.stochastic_layers import watched
from ..errors import InputError
from ..propagation.rules.rule_set import RuleSet, refuse_rounding_sensitive
from ..methods.base import attribution_dtype, finished
from ..methods.conservative_lrp import ConservativeLRP
from ..methods.stochastic_opt_in import StochasticOptIn

LayerOrLayers = Union[nn.Module, List[nn.Module]]


def _input_embeddings(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    if not isinstance(embeddings, nn.Module):
        raise InputError(
            f"{type(model).__name__} has no input embeddings (get_input_embeddings() gave "
            f"{type(embeddings).__name__ if getter is not None else 'nothing: no such method'}), so the layer to read "
            "relevance at cannot be chosen for it. Pass layer= (the module whose output holds the token embeddings)."
        )
    return embeddings


class RuleLayerGradientXActivation(StochasticOptIn, LayerGradientXActivation):
    r"""Captum's ``LayerGradientXActivation`` with the backward pass following ``rules``.

    ``R(h) = h * d^rules f / d h`` at the output of ``layer`` (default
    ``model.get_input_embeddings()``; ``attribute_to_layer_input=True`` reads its input). Every
    call runs Captum's ``attribute`` on :attr:`model`, the model given here, inside the rule
    context of the model's adapter and the contexts every package method holds: one
    explanation of the model at a time, gradients on (also for frozen parameters), compiled
    parts as their originals, a random training-mode forward refused unless
    ``allow_stochastic=True``. ``forward_func`` may be replaced (Captum's LLM wrapper does) by
    any function that calls :attr:`model`; the rules act on that call. The model is restored
    on exit, also after an exception.

    Rule sets seeded with one (``rules.seed == "one"``: Chefer et al.'s, ``RuleSet.LRP``) are
    refused: the seed rescales the explained score, which this shell does not see (Captum's
    wrapper explains a log-probability). Attributions are the product in at least float32
    (half-precision models), refused if not finite.

    Example::

        >>> method = RuleLayerGradientXActivation(llama, RuleSet.AH_LN)
        >>> relevance = method.attribute(input_ids, target=token_id)   # (B, S, hidden) at the embeddings
    """

    def __init__(self, model: nn.Module, rules: RuleSet, layer: Optional[LayerOrLayers] = None,
                 adapter: Union[Adapter, str, None] = None) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"model must be a torch.nn.Module (the rules are installed on its modules), got "
                             f"{type(model).__name__}.")
        if not isinstance(rules, RuleSet):
            raise InputError(f"rules must be a RuleSet, got {type(rules).__name__}.")
        if rules.seed == "one":
            raise InputError(
                f"The {rules.name!r} rules put relevance 1 on the explained score (seed='one'), which needs the score "
                "itself; a Captum layer method only sees the gradient of whatever its forward returns. Use rules "
                "seeded with the score (RuleSet.ATTN_LRP, AH, AH_LN), or the package's RuleGradientXInput."
            )
        if layer is None:
            layer = _input_embeddings(model)
        LayerGradientXActivation.__init__(self, model, layer)
        self.model = model
        self.adapter = get_adapter(model, adapter)
        self.rules = rules

    @log_usage()
    def attribute(self, inputs: Any, target: Any = None, additional_forward_args: Any = None,
                  attribute_to_layer_input: bool = False, grad_kwargs: Optional[dict] = None) -> Any:
        """Captum's ``LayerGradientXActivation.attribute`` (same arguments, same shapes) with the
        backward pass of :attr:`model` following :attr:`rules`."""
        refuse_inference_mode()
        refuse_rounding_sensitive(self.rules, model_dtype(self.model))
        with exclusive(self.model):  # before any flag below changes
            check_library_classes(self.model)
            with contextlib.ExitStack() as stack:
                stack.enter_context(uncompiled(self.model))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(patching.parameters_require_grad(self.model))
                stack.enter_context(self.adapter.propagation(self.model, self.rules))
                stack.enter_context(self.stochastic_rule())
                stack.enter_context(watched(self.model))
                attributions = super().attribute(inputs, target, additional_forward_args,
                                                 attribute_to_layer_input, grad_kwargs)
        if isinstance(attributions, list):
            return [finished(_detached(a), self.model) for a in attributions]
        return finished(_detached(attributions), self.model)

    def multiply_gradient_acts(self, gradients: Tuple[torch.Tensor, ...],
                               evals: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        # In at least float32: half-precision products lose what the sum over the hidden size keeps.
        dtype = attribution_dtype(self.model)
        return tuple(g.to(dtype) * e.to(dtype) if self.multiplies_by_inputs else g.to(dtype)
                     for g, e in zip(gradients, evals))


def _detached(attributions: Any) -> Any:
    return tuple(a.detach() for a in attributions) if isinstance(attributions, tuple) else attributions.detach()


class LayerAttnLRP(RuleLayerGradientXActivation):
    r"""AttnLRP (Achtibat et al., ICML 2024) as a Captum layer method: Captum's
    ``LLMGradientAttribution`` accepts it.

    ``R(h) = h * d^AttnLRP f / d h`` at ``layer`` (default: the input embeddings): uniform
    (halved) attention matmuls, RMSNorm/LayerNorm scale held constant, identity activations.
    For Llama-like models the embedding output is the first layer's input, where
    :class:`~captum_transformers.methods.lrp.AttnLRP` reads token relevance: summed over the
    hidden size the two agree when the forward returns the logit.

    Example::

        >>> from captum.attr import LLMGradientAttribution, TextTokenInput
        >>> llm_attr = LLMGradientAttribution(LayerAttnLRP(llama), tokenizer)
        >>> result = llm_attr.attribute(TextTokenInput("2 + 2 =", tokenizer), target=" 4")
    """

    def __init__(self, model: nn.Module, layer: Optional[LayerOrLayers] = None,
                 adapter: Union[Adapter, str, None] = None) -> None:
        super().__init__(model, RuleSet.ATTN_LRP, layer, adapter)


class LayerConservativeLRP(RuleLayerGradientXActivation):
    r"""Ali et al.'s conservative propagation (ICML 2022) as a Captum layer method.

    ``variant="AH+LN"`` (default): attention probabilities and the norm scale held constant
    (and the activated gate of gated MLPs), so for a bias-free model the relevance at the
    embeddings sums to the explained logit; ``"AH"``: the attention rule only; ``"GI"``: plain
    Gradient x Activation. ``norm_mean`` and ``activation_rule`` as for
    :class:`~captum_transformers.methods.conservative_lrp.ConservativeLRP`.

    .. math:: y_j = \sum_i x_i\,[p_{ij}]_{\text{const}}, \qquad
              y = \frac{x - \mathbb{E}[x]}{[\sqrt{\epsilon + \mathrm{Var}[x]}]_{\text{const}}}, \qquad
              R(h) = h \odot \frac{\partial f}{\partial h}

    Example::

        >>> relevance = LayerConservativeLRP(llama).attribute(input_ids, target=token_id)
        >>> relevance.sum()            # the logit of token_id (bias-free model)
    """

    def __init__(self, model: nn.Module, variant: Literal["AH+LN", "AH", "GI"] = "AH+LN",
                 layer: Optional[LayerOrLayers] = None, adapter: Union[Adapter, str, None] = None,
                 norm_mean: Literal["gradient", "constant"] = "gradient",
                 activation_rule: Literal["gradient", "identity"] = "gradient") -> None:
        # ConservativeLRP checks the options and builds the rule set; one place for both.
        rules = ConservativeLRP(model, variant, adapter, norm_mean=norm_mean, activation_rule=activation_rule).rules
        super().__init__(model, rules, layer, adapter)
        self.variant = variant
