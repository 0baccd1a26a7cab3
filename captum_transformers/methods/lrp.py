"""Gradient x Input under a RuleSet: the shell shared by the relevance-propagation methods."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from captum.attr import GradientAttribution
from captum.log import log_usage
import torch
from torch import nn

from ..adapters.base import Adapter
from ..errors import CaptureError, InputError
from ..adapters.registry import get_adapter
from ..engine.runner import run_relevance
from ..propagation.rules.rule_set import RuleSet
from ..capture.inputs import passed_by_name
from .base import TensorOrTuple, attribution_dtype, finished, format_additional, prepared_inputs, span_to_input
from .facts import GenerationSteps
from .stochastic_opt_in import StochasticOptIn


class RuleGradientXInput(StochasticOptIn, GradientAttribution):
    r"""Relevance ``R(x) = x * d f_t / d x`` with the backward pass following ``rules``.

    Where relevance is read (``relevance_at``): ``"tokens"``, the hidden states entering the
    first Transformer layer summed over the hidden size (``(B, S)``; for images the patch tokens
    upsampled to ``(B, C, H, W)``); ``"inputs"``, ``x * grad`` at floating-point inputs
    (pixels, embeddings); ``"auto"`` (default): pixels for image batches and node features
    for graph models (the pyg_attention adapter), tokens otherwise and whenever
    ``return_tokens=True``.
    ``return_convergence_delta=True`` also returns ``sum(R) - R_output`` per example, where
    ``R_output`` is the explained logit (or 1 for rule sets seeded with one).
    Relevance is accumulated and returned in float32 for half-precision models, else in
    the model's dtype (the rule of :class:`~captum_transformers.methods.base.TraceAttribution`).

    Example::

        >>> lrp = RuleGradientXInput(model, RuleSet.ATTN_LRP)
        >>> relevance = lrp.attribute(pixel_values, target=labels)
    """

    # The method's facts (methods/facts.py): relevance is signed (for / against the target).
    signed: bool = True
    class_specific: bool = True
    run_by_default: bool = True
    needs_adapter: bool = True
    generation_steps: GenerationSteps = GenerationSteps.RELEVANCE

    def __init__(self, model: nn.Module, rules: RuleSet, adapter: Union[Adapter, str, None] = None,
                 relevance_at: Literal["auto", "tokens", "inputs"] = "auto") -> None:
        if not isinstance(rules, RuleSet):
            raise InputError(f"rules must be a RuleSet, got {type(rules).__name__}.")
        if relevance_at not in ("auto", "tokens", "inputs"):
            raise InputError(f"relevance_at must be 'auto', 'tokens' or 'inputs', got {relevance_at!r}.")
        super().__init__(model)
        self.model = model
        self.adapter = get_adapter(model, adapter)
        self.rules = rules
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
        per-example ``sum(relevance) - relevance of the output``. ``inputs`` may be a mapping
        (a tokenizer's ``BatchEncoding``), as for :meth:`TraceAttribution.attribute`.
        """
        formatted, is_tuple, additional_forward_args, forward_kwargs, name = prepared_inputs(
            inputs, additional_forward_args, forward_kwargs, self.adapter)
        at = self.relevance_at
        if at == "auto":
            image = formatted[0].dim() == 4 and formatted[0].is_floating_point()
            # Adapters whose inputs are read as a whole (graph node features) say so.
            at = "inputs" if (image or getattr(self.adapter, "relevance_at_inputs", False)) and not return_tokens \
                else "tokens"
        elif at == "inputs" and return_tokens:
            raise InputError("return_tokens=True reads token relevance; it cannot be combined with "
                             "relevance_at='inputs'. Use relevance_at='tokens' or 'auto'.")
        with passed_by_name(self.model, name), self.stochastic_rule():
            result = run_relevance(self.adapter, self.model, formatted, format_additional(additional_forward_args),
                                   target, self.rules, at, forward_kwargs)
        if result.tokens is not None:
            per_stream = result.stream_tokens
            if return_tokens:
                layouts = result.streams.layouts if result.streams is not None else {}
                returned = tuple(layouts[name].returned(tokens) if name in layouts else tokens
                                 for name, tokens in per_stream.items())
                attributions: TensorOrTuple = returned[0] if len(returned) == 1 else returned
            else:
                mapped = tuple(self._to_input(per_stream, span, t) for span, t in zip(result.streams.inputs, formatted))
                attributions = mapped if is_tuple else mapped[0]
        else:
            attributions = result.per_input if is_tuple else result.per_input[0]
        attributions = finished(attributions, self.model, formatted[0].device)
        if return_convergence_delta:
            dtype = attribution_dtype(self.model)
            device = formatted[0].device  # a spread model reads its relevance and logits on two devices
            return attributions, result.total.to(device, dtype) - result.scores.to(device, dtype)
        return attributions


    def _to_input(self, per_stream, span, tensor):
        if span is None:
            return torch.zeros(tensor.shape, device=tensor.device)
        if span.stream not in per_stream:
            raise CaptureError(
                f"An input holds tokens of the stream {span.stream!r} but token relevance was read for "
                f"{sorted(per_stream)} only; use relevance_at='inputs' for floating-point inputs."
            )
        return span_to_input(per_stream[span.stream], span, tensor)


class TransformerLRP(RuleGradientXInput):
    r"""Full LRP to the input with the rules of Chefer et al.'s "LRP" baseline (CVPR 2021).

    ``RuleSet.LRP``, as the authors' code computes their tables' "LRP" column: alpha=1/beta=0
    on linear layers with separate denominators for the positive and negative pairs (so
    relevance is not conserved), identity activations, norms and softmax, halved attention
    matmuls, plain residual adds, z^B at the pixel convolution, relevance 1 at the target.
    Relevance at the pixels for images, at the first layer's input tokens otherwise.

    Example::

        >>> relevance = TransformerLRP(vit).attribute(pixel_values, target=labels)
    """

    def __init__(self, model: nn.Module, adapter: Union[Adapter, str, None] = None,
                 relevance_at: Literal["auto", "tokens", "inputs"] = "auto") -> None:
        super().__init__(model, RuleSet.LRP, adapter, relevance_at)


class AttnLRP(RuleGradientXInput):
    r"""AttnLRP (Achtibat et al., "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation
    for Transformers", ICML 2024) as a rule set.

    Uniform (halved) attention matmuls, LayerNorm/RMSNorm scale held constant, identity
    activations, plain gradient through softmax and linear layers, seeded with the logit:
    relevance approximately sums to the explained logit.

    Example::

        >>> relevance, delta = AttnLRP(llm).attribute(input_ids, return_tokens=True,
        ...                                           return_convergence_delta=True)
    """

    def __init__(self, model: nn.Module, adapter: Union[Adapter, str, None] = None,
                 relevance_at: Literal["auto", "tokens", "inputs"] = "auto") -> None:
        super().__init__(model, RuleSet.ATTN_LRP, adapter, relevance_at)
