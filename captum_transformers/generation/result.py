"""What a generation explanation returns: Captum's ``LLMAttributionResult``, with the rest.

:class:`GenerationResult` is a ``captum.attr.LLMAttributionResult`` (so ``plot_token_attr()``,
``plot_seq_attr()`` and every tool that reads Captum's type keep working) that also carries:

* ``target_attr`` (T, T): each generated token's attribution to the output tokens the model
  had already read (inseq's target attributions). Decoder-only models: column ``j`` is the
  generated token ``j``, nonzero only below the diagonal. Encoder-decoders: column ``j`` is
  the decoder's input ``j`` (the start token, then the generated tokens), so row ``t`` is
  nonzero up to the diagonal; ``target_attr_tokens`` names the columns.
* ``first_token_share`` (T,): per row, the share ``sum_{j<k} |a_j| / sum_j |a_j|`` of the
  first ``k = sink_tokens`` tokens of the sequence among every token the step read (prompt and
  earlier output): attention sinks (Xiao et al., ICLR 2024) show up as a large share.
* ``sink_share`` (T,) or None: for models with a learned attention-sink slot (GPT-OSS's
  ``sinks`` / ``s_aux``, :mod:`~captum_transformers.propagation.attention.sinks`), per row the
  probability ``p_sink = 1 - sum_k A_qk`` that the row's query (the position whose logits the
  step explains; a span's latest step) puts on the slot, averaged over heads and over the
  explained stream's self-attention layers (a layer without a slot counts 0). It is read from the
  attention maps of the explanation's own forward pass, so it does not depend on the method and
  equals the model's eager ``output_attentions`` (``1 - rows.sum(-1)``). None for a model without
  a sink slot, and for methods whose maps are never made at those rows: Captum's IG / Saliency
  rows (prefix calls) and AttentionGradCAM (its streamed backward recomputes only the last layer).
* ``scores`` (T,): the explained score of each step (logit, log-probability or probability,
  or the contrast); ``score_kind``; ``method`` (the wrapped method's class name);
  ``signed`` (whether the method's scores have a direction: relevance and gradient x input do,
  attention maps do not); ``encoder_decoder`` (the model reads a source and a decoder
  sequence); ``input_ids`` and ``output_ids``.
* vision-language models: ``image_attr`` (T, H, W) per image in the input image's pixel
  layout (a list for a prompt with several images; None without images), ``image_token_attr``
  (T, V) over the vision tower's tokens (CLS first when the tower has one, then the patch grid
  row-major), and ``image_grid`` (rows, cols). ``image_attr`` covers the patch grid only: the
  CLS token has no pixel location, so its score is in ``image_token_attr`` (column 0) and not
  in ``image_attr`` (methods whose relevance reaches the pixels themselves, LRP and Gradient x
  Input, give the pixels' own relevance instead). ``token_attr`` then covers the text tokens only (the image
  placeholder tokens are left out: their scores are the image's).

Example::

    >>> result = GenerationAttribution(AttnLRP(llm), tokenizer).attribute("k = 3 ; q ?")
    >>> result.token_attr.shape, result.target_attr.shape, result.first_token_share
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from captum.attr import LLMAttributionResult


class GenerationResult(LLMAttributionResult):
    """Captum's result type with the generation-specific parts (see the module docstring)."""

    def __init__(self, *, input_tokens: List[str], output_tokens: List[str], token_attr: torch.Tensor,
                 target_attr: torch.Tensor, target_attr_tokens: List[str], output_probs: torch.Tensor,
                 scores: torch.Tensor, score_kind: str, method: str, first_token_share: torch.Tensor,
                 input_ids: List[int], output_ids: List[int], inp: Any = None,
                 contrast_tokens: Optional[List[str]] = None, signed: bool = False,
                 encoder_decoder: bool = False, image_attr: Any = None, image_token_attr: Any = None,
                 image_grid: Any = None, sink_share: Optional[torch.Tensor] = None) -> None:
        super().__init__(input_tokens=input_tokens, output_tokens=output_tokens, seq_attr=token_attr.sum(0),
                         token_attr=token_attr, output_probs=output_probs, inp=inp)
        self.target_attr = target_attr
        self.target_attr_tokens = target_attr_tokens
        self.scores = scores
        self.score_kind = score_kind
        self.method = method
        self.first_token_share = first_token_share
        self.input_ids = input_ids
        self.output_ids = output_ids
        self.contrast_tokens = contrast_tokens
        self.signed = signed
        self.encoder_decoder = encoder_decoder
        self.image_attr = image_attr
        self.image_token_attr = image_token_attr
        self.image_grid = image_grid
        self.sink_share = sink_share

    def __repr__(self) -> str:
        return (f"GenerationResult(method={self.method}, score={self.score_kind}, "
                f"{len(self.output_tokens)} output x {len(self.input_tokens)} input tokens)")


def first_token_share(rows: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Per row of ``rows`` (T, n) over every token a step read, the share of the absolute
    attribution on the first ``sink_tokens`` columns (0 for an all-zero row)."""
    magnitude = rows.abs()
    total = magnitude.sum(-1)
    first = magnitude[:, :sink_tokens].sum(-1)
    return torch.where(total > 0, first / torch.where(total > 0, total, torch.ones_like(total)),
                       torch.zeros_like(total))
