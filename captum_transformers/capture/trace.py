"""Immutable records of what an attention capture observed.

A method never touches a module: it receives an :class:`AttentionTrace` and reduces it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, Iterable, Literal, Mapping, Optional, Tuple

import torch
from torch import nn

BlockKind = Literal["self", "cross"]

#: The stream of a model with one token sequence.
TOKENS = "tokens"
#: The key stream of a cross-attention block whose adapter names no streams.
CONTEXT = "context"
Streams = Tuple[str, str]


@dataclass(frozen=True)
class Block:
    """One attention site of a model.

    ``name`` is the dotted module path, ``kind`` says whether queries and keys come from
    the same sequence (``"self"``) or not (``"cross"``).
    """

    name: str
    module: nn.Module = field(compare=False, repr=False)
    kind: BlockKind = "self"
    # (query stream, key stream), e.g. ("decoder", "encoder"); None: derived from ``kind``.
    # A module called for several stream pairs (LXMERT's co-attention) names them per call.
    streams: Optional[Streams] = None

    @property
    def default_streams(self) -> Streams:
        if self.streams is not None:
            return self.streams
        return (TOKENS, TOKENS) if self.kind == "self" else (TOKENS, CONTEXT)


@dataclass(frozen=True)
class CaptureSpec:
    """What a method asks an adapter to keep from each attention call.

    ``forward_reduce(probs)`` maps the ``(B, H, Q, K)`` attention probabilities to what is
    stored at forward time (for example the head mean), so raw per-head maps need not be
    kept. ``backward_reduce(probs, grad, valid)`` fuses the heads as soon as the gradient of
    the explained score with respect to ``probs`` arrives; ``valid`` (B, 1, Q, K) is False
    where the query or the key is padding (None when nothing is padded). ``backward_blocks`` chooses which
    calls get a backward reduction: every call or only the last one. A map the explained
    score does not depend on is reduced with a zero gradient; where the adapter's kernel
    keeps no map for the backward pass (HF and timm models), its ``probs`` are zeros too.
    """

    forward_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    backward_reduce: Optional[Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None
    # "last": only the last call of each (query stream, key stream) pair.
    backward_blocks: Literal["all", "last"] = "all"
    # When True, backward_reduce is also given ``call_index=`` (the call's position in the
    # forward pass), for reductions that pair each map with data from an earlier pass.
    pass_call_index: bool = False
    # A :class:`~captum_transformers.capture.row_stream.RowStream` that folds each reduced map
    # into the explained rows and drops it (one-sequence layouts); None: the maps are kept.
    row_stream: Optional[Any] = field(default=None, compare=False)
    # A :class:`~captum_transformers.capture.replayed_rows.ReplayedRows`: forward-only methods whose
    # kernel keeps what recomputes each map (not the map) and replays it after the forward pass.
    replay: Optional[Any] = field(default=None, compare=False)

    @property
    def needs_gradient(self) -> bool:
        return self.backward_reduce is not None


@dataclass(frozen=True)
class AttentionRecord:
    """One attention call: the block, its position in call order, the reductions, and the
    (query stream, key stream) it mixed. Consecutive calls sharing a ``group`` (not None)
    read the same inputs, as LXMERT's two co-attention directions in one cross layer do, so
    relevance rules apply them together, from the maps before the group."""

    block: Block
    call_index: int
    forward_value: Optional[torch.Tensor] = None
    backward_value: Optional[torch.Tensor] = None
    streams: Streams = (TOKENS, TOKENS)
    group: Optional[Hashable] = None

    @property
    def is_self(self) -> bool:
        return self.streams[0] == self.streams[1]

    @classmethod
    def of_sites(cls, sites: Iterable[Any], device: torch.device) -> Tuple["AttentionRecord", ...]:
        """The records of a recorder's sites, their kept values moved to ``device`` (the explained
        rows'): a model spread over devices (accelerate's ``device_map``) keeps each layer's map on
        that layer's device, and a method reduces them on one. A value already there is not copied."""
        def moved(value: Any) -> Any:
            return value.to(device) if isinstance(value, torch.Tensor) else value

        return tuple(cls(s.block, s.call_index, moved(s.forward_value), moved(s.backward_value), s.streams, s.group)
                     for s in sites)


@dataclass(frozen=True)
class TokenLayout:
    """How the model's token sequence maps back onto the input.

    ``query_rows`` (B, R) holds, per example, the token positions whose relevance rows are
    averaged to explain the output (the CLS token; DeiT's CLS and distillation tokens; the
    last real token of a causal decoder; every patch token for mean-pooled models).
    ``query_weights`` (B, R), when given, weighs those rows (each example's weights sum
    to 1), e.g. a mean over a different number of real tokens per example.
    ``token_mask`` (B, N) is False at padding. ``num_prefix_tokens`` counts the non-patch
    tokens in front of an image's patch grid ``grid`` (rows, cols).
    ``returned_tokens`` (start, stop) are the positions ``return_tokens=True`` returns
    (``stop=None``: to the end): every token by default; a Graphormer's nodes, ``(1, None)``,
    since its graph token at position 0 is the explained row, not a node of the input.
    """

    num_tokens: int
    query_rows: torch.Tensor
    token_mask: Optional[torch.Tensor] = None
    num_prefix_tokens: int = 0
    grid: Optional[Tuple[int, int]] = None
    query_weights: Optional[torch.Tensor] = None
    returned_tokens: Tuple[int, Optional[int]] = (0, None)

    @property
    def is_image(self) -> bool:
        return self.grid is not None

    def returned(self, scores: torch.Tensor) -> torch.Tensor:
        """The (B, N) scores of this stream as ``return_tokens=True`` gives them: the
        ``returned_tokens`` positions, e.g. (B, N_max) nodes of (B, 1 + N_max) Graphormer tokens."""
        start, stop = self.returned_tokens
        return scores if (start, stop) == (0, None) else scores[:, start:stop]


@dataclass(frozen=True)
class InputSpan:
    """Which tokens of which stream one input tensor holds: ``stream``'s positions
    ``start:stop`` (``stop=None``: to the end). ``grid`` (rows, cols): those tokens form an
    image's patch or feature grid, mapped onto a 4-D input by bilinear upsampling.
    ``nodes`` (graph, position), two (N,) long tensors: row ``n`` of the input is node
    ``position[n]`` of graph ``graph[n]`` (a PyG batch's flat node list), so the input
    gets each node's score broadcast over its features. ``fields``: the tokens are patches of
    the input's axes 1, 2, ... computed by a strided convolution, one ``(field, hop)`` per
    axis: along an axis, token index ``t`` reads the positions ``[t * hop, t * hop + field)``
    (a waveform's frames: ``((400, 320),)``; AST's spectrogram patches over (time, frequency)).
    ``field_order``: the order of the axes in which the tokens are enumerated, slowest first
    (None: the axes' order; AST enumerates frequency before time: ``(1, 0)``). Each token's
    score is spread evenly over its field, overlapping fields adding up, so the input's sum is
    the tokens' sum."""

    stream: str
    start: int = 0
    stop: Optional[int] = None
    grid: Optional[Tuple[int, int]] = None
    nodes: Optional[Tuple[torch.Tensor, torch.Tensor]] = field(default=None, compare=False, repr=False)
    fields: Optional[Tuple[Tuple[int, int], ...]] = None
    field_order: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class StreamLayouts:
    """The token streams of a model, which of them the output reads, and where inputs sit.

    ``layouts`` maps each stream (``"tokens"`` for one-sequence models; ``"text"`` and
    ``"image"`` for LXMERT; ``"encoder"`` and ``"decoder"`` for DETR and seq2seq models) to
    its :class:`TokenLayout`; the explained rows of a stream are its layout's ``query_rows``.
    ``explained`` lists the streams whose rows the output reads (LXMERT: the text CLS; a
    CLIP similarity: both towers). ``inputs`` gives one :class:`InputSpan` per input tensor
    (None: the input holds no tokens, e.g. LXMERT's box positions, and gets zeros).
    """

    layouts: Mapping[str, TokenLayout]
    explained: Tuple[str, ...]
    inputs: Tuple[Optional[InputSpan], ...]

    @classmethod
    def single(cls, layout: TokenLayout, num_inputs: int) -> "StreamLayouts":
        """One stream, ``"tokens"``: every input maps onto the whole sequence (or its grid)."""
        span = InputSpan(TOKENS, layout.num_prefix_tokens, None, layout.grid) if layout.grid else InputSpan(TOKENS)
        return cls({TOKENS: layout}, (TOKENS,), (span,) * num_inputs)

    @property
    def is_single(self) -> bool:
        return len(self.layouts) == 1

    def sizes(self) -> Dict[str, int]:
        return {name: layout.num_tokens for name, layout in self.layouts.items()}


@dataclass(frozen=True)
class AttentionTrace:
    """Everything one forward (and backward) pass observed, in call order.

    ``layout`` is the first explained stream's layout; ``streams`` has all of them.
    """

    records: Tuple[AttentionRecord, ...]
    layout: TokenLayout
    logits: torch.Tensor
    target: Optional[torch.Tensor]
    streams: Optional[StreamLayouts] = None
    # The RowStream these records were folded into (one per explained group of a generation),
    # read by the method instead of the one its last attribute() left; None: see the method's.
    row_stream: Optional[Any] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.streams is None:
            object.__setattr__(self, "streams", StreamLayouts.single(self.layout, 1))

    def __len__(self) -> int:
        return len(self.records)

    def forward_values(self, start: int = 0) -> list:
        return [r.forward_value for r in self.records[start:]]

    def backward_values(self, start: int = 0) -> list:
        return [r.backward_value for r in self.records[start:]]


def one_self_attending_sequence(blocks: Iterable[Block]) -> bool:
    """Whether attention ``blocks`` are one token sequence attending to itself (one (query, key)
    stream pair, the same stream on both sides): what rows carried or replayed per call need."""
    pairs = {block.default_streams for block in blocks}
    return len(pairs) == 1 and all(query == key for query, key in pairs)
