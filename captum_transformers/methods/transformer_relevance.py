"""Chefer et al. (CVPR 2021): gradient-weighted attention relevance, and Partial LRP."""
from __future__ import annotations

from typing import Dict, Mapping

import torch

from .math import relevancy_maps
from ..errors import InputError
from ..propagation.rules.rule_set import RuleSet
from ..capture.trace import TOKENS, AttentionTrace, CaptureSpec
from .base import StartLayer, TraceAttribution, warn_if_blank
from ..engine.pass_plan import PassPlan
from ..capture.row_chains import last_map_row, relevance_chain, rollout_chain, row_layout
from ..capture.row_stream import RowStream


def _relevance(probs: torch.Tensor, lrp_grad: torch.Tensor) -> torch.Tensor:
    """LRP relevance at an attention map in gradient x input form: ``R_A = A * g_A``."""
    dtype = torch.promote_types(lrp_grad.dtype, torch.float32)
    return probs.to(dtype) * lrp_grad.to(dtype)


class TransformerRelevance(TraceAttribution):
    r"""Transformer attribution of Chefer, Gur & Wolf, "Transformer Interpretability Beyond
    Attention Visualization" (CVPR 2021), Eq. 13-14.

    .. math:: \bar A^{(b)} = I + \mathbb{E}_h\big[(\nabla A^{(b)} \odot R^{A^{(b)}})^+\big], \qquad
              C = \bar A^{(B)} \cdots \bar A^{(s)}

    read at the classification row. ``R^A`` is the LRP relevance at each attention map from
    a pass with the paper's rules (``RuleSet.CHEFER``: alpha=1/beta=0 linear layers, identity
    activations, norms and softmax, halved matmuls, normalised residual adds, relevance 1 at
    the target), ``\nabla A`` the plain gradient of the target logit. One forward pass
    under the rules and two backward passes through its graph (relevance, then the plain
    gradient); class-specific. Later blocks
    multiply on the left, as in the authors' code; ``start_layer`` skips the first blocks.

    ``row_normalize=True`` divides each row of every ``I + Abar`` by its sum before the
    product, as the authors' BERT generator does (``BERT_explainability/modules/BERT/
    ExplanationGenerator.py``, ``generate_LRP``; their ERASER movie-review results). With
    ``start_layer`` = the last layer (their default, 11 for BERT-base) it is their ERASER
    configuration; their generator then also overwrites the CLS entry of the row with the
    row's minimum, a ranking step this option leaves to the caller. Their ViT code and the
    paper's Eq. 14 do not normalise (the default, ``False``). One-sequence models only.

    Several streams, as the baseline of Chefer et al., ICCV 2021 (Sec. 4, Eq. 13): each
    explained stream's self-attention maps are chained as above; for any other stream the
    last map of the explained stream over it is taken, its heads fused by Eq. 13.

    Example::

        >>> maps = TransformerRelevance(vit).attribute(pixel_values, target=labels)   # (B, 3, H, W)
    """

    uses_row_chains = True
    chains_every_layer = True

    def __init__(self, model, adapter=None, start_layer: StartLayer = 0, rules: RuleSet = RuleSet.CHEFER,
                 row_normalize: bool = False) -> None:
        if not isinstance(row_normalize, bool):
            raise InputError(f"row_normalize must be True or False, got {row_normalize!r}.")
        super().__init__(model, adapter)
        self.start_layer = start_layer
        self.rules = rules
        self.row_normalize = row_normalize

    def capture_spec(self) -> CaptureSpec:  # the relevance pass
        return CaptureSpec(backward_reduce=lambda probs, lrp_grad, valid: _relevance(probs, lrp_grad))

    def pass_plan(self, inputs, additional, forward_kwargs) -> PassPlan:
        # Per-head R_A of each map, kept from the relevance pass until its gradient arrives.
        by_call: Dict[int, torch.Tensor] = {}

        def keep_relevance(probs, lrp_grad, valid, call_index):
            by_call[call_index] = _relevance(probs, lrp_grad)

        def weighted(probs, grad, valid, call_index):
            # functional.gradient_weighted_heads(R_A, grad), in the popped R_A's own buffer.
            relevance = by_call.pop(call_index)
            return relevance.mul_(grad.to(relevance.dtype)).clamp_(min=0).mean(dim=1)

        # In attribute(), one-sequence maps are folded into the explained rows as the plain pass
        # reaches them, each chunk of rows paired with the relevance pass's (streaming_rows, paired):
        # no per-layer map is kept. rownorm(I + Abar) (row_normalize) is not a row update: dense path.
        self._row_stream = None
        if self.streaming_rows and self.rules.attention_gate == "gradient" and not self.row_normalize \
                and isinstance(self.start_layer, (int, Mapping)):
            start = self.start_layer.get(TOKENS, 0) if isinstance(self.start_layer, Mapping) else self.start_layer
            self._row_stream = RowStream(start, paired=True)
        keep_relevance.row_separable = weighted.row_separable = True  # each row's value reads that row alone
        relevance_spec = CaptureSpec(backward_reduce=keep_relevance, pass_call_index=True, row_stream=self._row_stream)
        gradient_spec = CaptureSpec(backward_reduce=weighted, pass_call_index=True, row_stream=self._row_stream)
        if self.rules.attention_gate == "gradient":
            # One forward under the rules, then two backward passes through the same graph:
            # the relevance (rules), then the plain gradient (every rule switched off).
            return PassPlan(relevance_spec, self.rules, plain_spec=gradient_spec)
        # A detached attention gate changes the graph itself: a separate plain pass. The
        # relevance pass runs first and is freed before the gradient pass (peak = the larger).
        return PassPlan(relevance_spec, self.rules, then=PassPlan(gradient_spec))

    def reduce(self, trace: AttentionTrace):
        self.layers_from(trace, self.start_layer)
        if (streamed := self.streamed_result(trace)) is not None:
            return streamed
        if self.is_one_sequence(trace):
            values = self.values_from(trace, self.start_layer, backward=True)
            if self.row_normalize:  # the authors' BERT generator: rownorm(I + Abar) at every layer
                return rollout_chain(row_layout(trace), values)
            return relevance_chain(row_layout(trace), values)
        if self.row_normalize:
            raise InputError("row_normalize=True follows the authors' BERT generator, defined for one token sequence "
                             "attending to itself; this model mixes several streams "
                             f"({sorted(trace.streams.layouts)}). Use row_normalize=False (ICCV'21 rules between "
                             "streams).")
        records = self.records_from(trace, self.start_layer)
        steps = [(r.streams, self.without_padding(trace, r, r.backward_value)) for r in records]
        self_steps = [step for step in steps if step[0][0] == step[0][1]]
        if not self_steps:
            raise InputError(f"start_layer={self.start_layer} leaves no self-attention call to chain; lower it.")
        maps = relevancy_maps.accumulate(self_steps, self.stream_sizes(trace), dtype=steps[0][1].dtype)
        maps.update({pair: value for pair, value in steps if pair[0] != pair[1]})  # the last cross map wins
        return relevancy_maps.explained_rows(maps, self.explained_stream_rows(trace, steps[0][1].dtype))


class PartialLRP(TraceAttribution):
    r"""Partial LRP (Voita et al., ACL 2019, as the baseline of Chefer et al., CVPR 2021).

    .. math:: R = \mathbb{E}_h\big[(R^{A^{(L)}})^+\big]_{q,:}

    the LRP relevance of the last attention map, positive part, averaged over heads, read at
    the classification row; one forward and one backward pass. The default rules are those of
    the authors' LRP baseline (``RuleSet.LRP``, which produced the paper's "partial LRP"
    column); ``rules=RuleSet.CHEFER`` gives the relevance of their own method's pass. A map that
    the positive part leaves 0 everywhere is returned with a warning, as Grad-CAM's is
    (:func:`~captum_transformers.methods.base.blank_map_warning`), per stream where a model has several.

    Example::

        >>> maps = PartialLRP(vit).attribute(pixel_values, target=labels)
    """

    uses_row_chains = True
    #: Why a map can be 0 everywhere (:func:`~captum_transformers.methods.base.blank_map_warning`).
    blank_map_reason = ("At each of its tokens every head's relevance of the last attention map (A times its "
                        "gradient under the rules) is <= 0, and Partial LRP keeps only the positive part (Chefer et "
                        "al.'s baseline)")

    def __init__(self, model, adapter=None, rules: RuleSet = RuleSet.LRP) -> None:
        super().__init__(model, adapter)
        self.rules = rules

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(backward_reduce=lambda probs, grad, valid: _relevance(probs, grad).clamp_(min=0).mean(1),
                           backward_blocks="last")

    def pass_plan(self, inputs, additional, forward_kwargs) -> PassPlan:
        return PassPlan(self.capture_spec(), self.rules)

    def reduce(self, trace: AttentionTrace):
        if self.is_one_sequence(trace):
            return warn_if_blank(last_map_row(row_layout(trace), [r.backward_value for r in trace.records]), self)
        return warn_if_blank(self.last_map_rows(trace, backward=True), self)
