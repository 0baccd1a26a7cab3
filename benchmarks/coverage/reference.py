"""Slow references from the model's own eager ``output_attentions``, written from the papers.

* Raw attention: the last attention layer's map, averaged over heads, at the explained row
  (what :class:`~captum_transformers.RawAttention` documents: ``mean_h(A^{(L)})_{q,:}``); for an
  encoder-decoder the pair (source: the last cross-attention's row, decoder prefix: the last
  decoder self-attention's row) of the last real decoder token.
* GenericAttention (Chefer, Gur & Wolf, ICCV 2021, Eq. 5-6), one-sequence models:
  ``R = I``; for each layer in order ``R += mean_h((dA ⊙ A)^+) @ R``, ``dA`` the gradient of the
  explained score at the attention probabilities (the tensors ``output_attentions`` returns,
  differentiated with ``torch.autograd.grad``: what ``retain_grad`` would keep, without writing
  the parameters' ``.grad``); the explained row of ``R``.

The explained row ``q``: the position of a token-level head; otherwise the last real token
when the model's maps are causal (decoders, decoder classifiers), else the first token (CLS).
Padded keys are zeroed in both references (the package's maps are 0 there). A model whose eager
maps are not all probability maps (linear or differential attention layers) gets no reference.

Tolerances: 1e-10 (raw, absolute) and 1e-8 (GenericAttention, relative) where the eager maps
are float64; many eager kernels (Llama-style) run their softmax in float32 and cast back, so
their maps hold float32 values only: there 1e-6 and 1e-5 (:data:`TOLERANCES`; the precision
found is noted in the results). A wrong row, fusion or layer differs by ~1e-2.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from .inputs import Example, call_model, explained_scores, last_real

# (raw attention: absolute, probabilities are in [0, 1]; GenericAttention: relative to the
# reference's largest entry), by the precision of the eager maps: float64, or float32 for
# kernels whose eager softmax runs in float32 (Llama-style: softmax(..., dtype=float32)).
TOLERANCES = {"float64": (1e-10, 1e-8), "float32": (1e-6, 1e-5)}


@dataclasses.dataclass
class Reference:
    """A reference map per input stream (``maps``) and its tolerance; ``relative``: the
    tolerance scales with the reference's largest entry; ``loose_tolerance``: the float32
    tolerance of the same kind, a match to which only is ``consistent``, not ``reference`` (an
    eager kernel that computes in float32 in places, e.g. GPT-J's scores, though its maps are
    float64 values)."""

    maps: Tuple[torch.Tensor, ...]
    tolerance: float
    relative: bool = False
    loose_tolerance: Optional[float] = None

    def difference(self, maps: Tuple[torch.Tensor, ...]) -> float:
        """The largest difference to ``maps`` (inf when the shapes differ), in tolerance units
        already divided out: ``<= 1`` is a match."""
        if len(maps) != len(self.maps) or any(a.shape != b.shape for a, b in zip(maps, self.maps)):
            return float("inf")
        scale = max(float(r.abs().max()) for r in self.maps) if self.relative else 1.0
        worst = max(float((a.detach().double() - b).abs().max()) for a, b in zip(maps, self.maps))
        return worst / (self.tolerance * max(scale, 1e-300))


def eager_precision(attentions: List[torch.Tensor]) -> str:
    """``"float32"`` when every eager map is exactly a float32 value (a float32 softmax cast
    back), else ``"float64"``."""
    exact = all(bool((a.detach() == a.detach().float().double()).all()) for a in attentions)
    return "float32" if exact else "float64"


def non_probability_layers(attentions: List[torch.Tensor], query_mask: torch.Tensor, sinks: bool = False) -> List[int]:
    """The layers whose eager maps are no probability maps (rows of real queries not summing to 1):
    linear or differential attention layers, which no softmax-map reference describes. With
    attention sinks (``sinks``: GPT-OSS) a row sums to 1 - p_sink: non-negative rows summing to at
    most 1 are probability maps."""
    real = query_mask.to(torch.bool)
    odd = []
    for index, a in enumerate(attentions):
        if a.shape[-2] != real.shape[-1]:
            continue
        sums = a.detach().sum(-1)
        rows_ok = (sums <= 1 + 1e-6) & (sums > 0) if sinks else (sums - 1).abs() < 1e-6
        if sinks:
            rows_ok = rows_ok & (a.detach() >= 0).all(-1)
        if not bool(rows_ok.permute(0, 2, 1)[real].all()):
            odd.append(index)
    return odd


# Model types whose eager output_attentions is the softmax before the sink scaling that weights the
# values (Granite SWA: out = sigmoid(lse - sink) * softmax(S) V); the package reports the weights on V.
MAPS_BEFORE_SINK_SCALING = frozenset({"granite_swa", "granitemoe_swa"})


def has_sinks(model: torch.nn.Module) -> bool:
    """Whether an attention module of ``model`` holds per-head sink logits (a ``sinks`` tensor)."""
    return any(isinstance(getattr(module, "sinks", None), torch.Tensor) for module in model.modules())


def is_causal(attentions: List[torch.Tensor]) -> bool:
    """Whether every map is zero above its diagonal (a decoder's causal self-attention)."""
    upper = torch.ones(attentions[0].shape[-2:], dtype=torch.bool).triu(1)
    return all(bool((a.detach()[..., upper] == 0).all()) for a in attentions)


# Sequence classifiers that pool as a config field says (model type -> the field, its values that average
# the real tokens equally; other values read the first token): EuroBERT's classifier_pooling ("mean"
# averages the last layer's states, "late" the per-token logits; "bos" reads token 0).
MEAN_POOLING_CONFIGS: Dict[str, Tuple[str, Tuple[str, ...]]] = {"eurobert": ("classifier_pooling", ("mean", "late"))}


def mean_pooled(model: torch.nn.Module, example: Example) -> bool:
    """Whether ``model``'s head averages the real tokens of the last layer (:data:`MEAN_POOLING_CONFIGS`)."""
    row = MEAN_POOLING_CONFIGS.get(getattr(model.config, "model_type", None))
    return (row is not None and example.score == "class" and example.query_row is None
            and getattr(model.config, row[0], None) in row[1])


def explained_rows(example: Example, attentions: List[torch.Tensor]) -> torch.Tensor:
    """The explained row of each example (B,) of a one-sequence model (see the module docstring)."""
    if example.query_row is not None:
        return torch.full((example.batch_size,), example.query_row)
    if example.score == "next-token" or is_causal(attentions):
        return last_real(example.masks[0])
    return torch.zeros(example.batch_size, dtype=torch.long)


def _row(matrix: torch.Tensor, rows: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
    """``matrix[b, rows[b], :]`` (B, N) with padded keys zeroed; ``rows`` (B, N) weights instead of
    positions (B,): the weighted sum of the rows (a mean-pooling head's real rows, ``1 / n`` each)."""
    if rows.dim() == 2:
        picked = (rows.to(matrix.dtype).unsqueeze(1) @ matrix).squeeze(1)
    else:
        picked = matrix[torch.arange(matrix.shape[0]), rows]
    return picked * key_mask.to(picked.dtype)


def _attention_lists(output, seq2seq: bool) -> Optional[Dict[str, List[torch.Tensor]]]:
    """The eager maps by kind (``self``; or ``encoder``, ``decoder``, ``cross``), None if the
    model returned none."""
    fields = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"} \
        if seq2seq else {"self": "attentions"}
    found = {kind: list(getattr(output, name, None) or ()) for kind, name in fields.items()}
    if any(not maps or any(m is None for m in maps) for maps in found.values()):
        return None
    return found


@dataclasses.dataclass
class EagerReferences:
    """The references by method name, a note for the results file, and the precision of the
    eager maps (``"float64"``, ``"float32"``; None without maps)."""

    references: Dict[str, Reference]
    note: str
    precision: Optional[str] = None


def eager_references(model: torch.nn.Module, example: Example) -> EagerReferences:
    """Raw attention (and GenericAttention for one-sequence models) from the eager
    ``output_attentions``; none, with the reason in the note, where the model gives no attentions."""
    seq2seq = len(example.inputs) == 2
    if not seq2seq and getattr(model.config, "is_encoder_decoder", False):
        # Its head reads a decoder row over the source shifted right; the package explains the source
        # through cross-attention, while some heads (T5Gemma's) return the decoder's self-attention
        # maps alone as their `attentions` (tests/test_encoder_decoder_heads.py checks BART and T5
        # against their cross-attentions).
        return EagerReferences({}, "none: an encoder-decoder given input_ids alone (its decoder runs over them "
                                   "shifted right)")
    if getattr(model.config, "model_type", None) in MAPS_BEFORE_SINK_SCALING:
        return EagerReferences({}, "none: its eager output_attentions is the softmax before the sink scaling "
                                   "that weights the values")
    with torch.enable_grad():
        output = call_model(model, example, output_attentions=True)
        maps = _attention_lists(output, seq2seq)
        if maps is None:
            return EagerReferences({}, "no eager output_attentions")
        precision = eager_precision([a for kind in maps.values() for a in kind])
        raw_tolerance, generic_tolerance = TOLERANCES[precision]
        if seq2seq:
            return EagerReferences({"raw-attention": _seq2seq_raw(maps, example, raw_tolerance)},
                                   f"raw attention ({precision} maps)", precision)
        attentions = maps["self"]
        odd = non_probability_layers(attentions, example.masks[0], has_sinks(model))
        if odd:
            return EagerReferences({}, f"none: the eager maps of layers {odd} are no probability maps "
                                       "(linear or differential attention)", precision)
        rows = explained_rows(example, attentions)
        if mean_pooled(model, example):
            real = example.masks[0].to(attentions[-1].dtype)
            rows = real / real.sum(dim=1, keepdim=True)  # (B, N) weights
        references = {"raw-attention": Reference((_row(attentions[-1].detach().mean(1), rows, example.masks[0]),),
                                                 raw_tolerance, loose_tolerance=TOLERANCES["float32"][0])}
        generic = _generic_attention(output, attentions, example, rows, generic_tolerance)
        if generic is None:
            return EagerReferences(references, f"raw attention ({precision} maps; they hold no gradient)", precision)
        references["generic-attention"] = generic
        return EagerReferences(references, f"raw attention and GenericAttention ({precision} maps)", precision)


def _seq2seq_raw(maps: Dict[str, List[torch.Tensor]], example: Example, tolerance: float) -> Reference:
    rows = last_real(example.masks[1])
    source = _row(maps["cross"][-1].detach().mean(1), rows, example.masks[0])
    prefix = _row(maps["decoder"][-1].detach().mean(1), rows, example.masks[1])
    return Reference((source, prefix), tolerance, loose_tolerance=TOLERANCES["float32"][0])


def _generic_attention(output, attentions: List[torch.Tensor], example: Example, rows: torch.Tensor,
                       tolerance: float) -> Optional[Reference]:
    """ICCV'21 Eq. 5-6 from the eager maps (None when they are not part of the graph)."""
    if not all(a.requires_grad for a in attentions):
        return None
    # The gradient at each map (what retain_grad() would keep), without writing parameters' .grad.
    grads = torch.autograd.grad(explained_scores(output, example).sum(), attentions, allow_unused=True)
    if any(g is None for g in grads):
        return None
    batch, _, tokens, _ = attentions[0].shape
    relevance = torch.eye(tokens, dtype=attentions[0].dtype).expand(batch, tokens, tokens)
    for attention, grad in zip(attentions, grads):
        update = (grad * attention.detach()).clamp(min=0).mean(1)
        relevance = relevance + update @ relevance
    return Reference((_row(relevance, rows, example.masks[0]),), tolerance, relative=True,
                     loose_tolerance=TOLERANCES["float32"][1])
