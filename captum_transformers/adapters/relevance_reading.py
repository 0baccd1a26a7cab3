"""Reading relevance out of a rule-modified backward pass: the seed on the explained scores,
the hidden states entering a layer tapped (:func:`read_layer_input`), where a relevance pass
reads ``x * dy/dx`` (:class:`RelevanceReading`: at the first layers' inputs, at the inputs),
and what it returns (:class:`RelevanceResult`).

The pass itself (refusals, forward, backward) is run by
:func:`captum_transformers.engine.runner.run_relevance`; an adapter says only where it is read
(:meth:`Adapter.relevance_reading <captum_transformers.adapters.base.Adapter.relevance_reading>`).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..model_state import patching
from ..capture.trace import StreamLayouts, TokenLayout
from ..errors import CaptureError, InputError
from .input_checks import relevance_carrying

if TYPE_CHECKING:  # pragma: no cover
    from ..propagation.rules.rule_set import RuleSet


def seeded(scores: torch.Tensor, rules: Optional["RuleSet"]) -> torch.Tensor:
    """The explained scores, rescaled so their relevance is 1 under a one-hot seed.

    Gradient x Input puts relevance ``y * dy/dy = y`` on the output; Chefer et al. seed the
    relevance with 1 instead, i.e. backpropagate ``1 / y`` (0 where ``y == 0``).
    """
    if rules is None or rules.seed != "one":
        return scores
    scale = torch.where(scores == 0, torch.zeros_like(scores), 1.0 / scores.detach())
    return scores * scale


@contextlib.contextmanager
def read_layer_input(layer: nn.Module, store: List[torch.Tensor], in_graph: bool = False):
    """Keep the hidden states entering ``layer`` (first call only) in ``store``, so
    ``d score / d hidden`` can be read there.

    By default they are replaced by a leaf that requires grad, with the same values. With
    ``in_graph`` a tensor that already requires grad is kept as it is, in the graph: a
    vision-language decoder's first layer reads image tokens whose relevance must go on into
    the vision tower (a tensor that requires no grad still becomes a leaf: nothing before it
    carries relevance).

    A wrapped forward, not a pre-hook: a registered hook is seen by every thread (PyTorch's
    TransformerEncoderLayer leaves its fast path when any module has one)."""

    def make(original):
        def forward(*args, **kwargs):
            if store:
                return original(*args, **kwargs)
            if args and isinstance(args[0], torch.Tensor):
                source = args[0]
            elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
                source = kwargs["hidden_states"]
            else:
                return original(*args, **kwargs)
            if in_graph and source.requires_grad:
                store.append(source)
                return original(*args, **kwargs)
            leaf = source.detach().requires_grad_()
            store.append(leaf)
            # Every argument that is the same tensor (query is key is value) gets the leaf.
            args = tuple(leaf if a is source else a for a in args)
            kwargs = {k: (leaf if v is source else v) for k, v in kwargs.items()}
            return original(*args, **kwargs)
        return forward

    with patching.instance_forward(layer, make):
        yield


@dataclasses.dataclass(frozen=True)
class RelevanceResult:
    """What a relevance pass returns: token relevance (B, N) (of the first stream) or
    per-input relevance, the layout, the relevance put on the output (B,) (the logit, or 1
    under a one-hot seed), the target index, the relevance sums (B,) over every stream, the
    token relevance of every stream read, and the streams."""

    tokens: Optional[torch.Tensor]
    per_input: Optional[Tuple[torch.Tensor, ...]]
    layout: TokenLayout
    scores: torch.Tensor
    target: torch.Tensor
    total: torch.Tensor
    stream_tokens: Optional[Dict[str, torch.Tensor]] = None
    streams: Optional[StreamLayouts] = None


def input_times_gradient(leaf: torch.Tensor, grad: Optional[torch.Tensor]) -> torch.Tensor:
    """``x * dy/dx`` in at least float32 (a half-precision sum over the hidden size loses the small
    total of large terms of both signs); a leaf the score does not reach has a zero gradient."""
    dtype = torch.promote_types(leaf.dtype, torch.float32)
    g = torch.zeros((), dtype=dtype, device=leaf.device) if grad is None else grad.to(dtype)
    return leaf.detach().to(dtype) * g


def token_sums(token_states, product: torch.Tensor, mask: Optional[torch.Tensor],
               batch: Optional[int] = None) -> torch.Tensor:
    """(B, N) per-token sums of a relevance product over the hidden size, padding set to zero.

    ``token_states`` is the adapter's (grids flattened to tokens); a sequence-first product
    (N, B, ...) is transposed when ``batch`` says so."""
    if batch is not None and product.shape[0] != batch and product.shape[1] == batch:
        product = product.transpose(0, 1)  # sequence-first layers
    hidden = token_states(product)
    tokens = hidden.reshape(hidden.shape[0], hidden.shape[1], -1).sum(-1)
    if mask is not None and mask.shape == tokens.shape:
        # Zero at padding, also where the model's own backward is not finite there (Gemma 3n: the
        # gradient of an RMS of a zero pad embedding); layer 0's device may differ.
        tokens = torch.where(mask.to(device=tokens.device, dtype=torch.bool), tokens, torch.zeros((), dtype=tokens.dtype,
                                                                                                    device=tokens.device))
    return tokens


class RelevanceReading:
    """Where one relevance pass reads ``x * dy/dx``, and what it makes of the gradients.

    The runner (:func:`captum_transformers.engine.runner.run_relevance`) calls, in order:
    :meth:`carrying` on the inputs, enters :meth:`contexts` around the forward, takes the
    gradient of the explained score at :meth:`leaves`, and hands the gradients to
    :meth:`result`. Subclasses say where (the first layers' inputs, the inputs, a graph's
    node features).
    """

    def carrying(self, inputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        """The inputs as the forward takes them: floating-point ones made relevance-carrying leaves."""
        return relevance_carrying(inputs)

    def contexts(self) -> List[ContextManager[None]]:
        """Contexts entered around the forward (taps on the modules whose input is read)."""
        return []

    def leaves(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        """The tensors whose gradient the backward pass reads, once the forward has run."""
        raise NotImplementedError

    def result(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...],
               grads: Sequence[Optional[torch.Tensor]], scores: torch.Tensor, index: torch.Tensor) -> RelevanceResult:
        """The :class:`RelevanceResult` from the gradients at :meth:`leaves`; ``scores`` (B,): the
        relevance put on the output (detached), ``index``: the target index."""
        raise NotImplementedError

    def for_steps(self, in_graph: bool) -> "RelevanceReading":
        """This reading for the generation engine, which calls ``read(streams)`` and
        ``token_relevance(streams, grads)`` once per explained step; ``in_graph``: keep the read
        tensors in the graph (image inputs explained too). Token readings only."""
        raise CaptureError(f"{type(self).__name__} reads no token relevance, so no generation step can use it.")


class LayerInputs(RelevanceReading):
    """Relevance of the hidden states entering the first layer of each stream (``layers``:
    ``{stream or None: layer}``, None: the explained stream), summed over the hidden size,
    (B, N) per stream. ``token_states``: the adapter's (grids flattened to tokens);
    ``in_graph``: keep the tapped tensors in the graph (:func:`read_layer_input`)."""

    def __init__(self, layers: Dict[Optional[str], nn.Module], token_states: Callable[[torch.Tensor], torch.Tensor],
                 in_graph: bool = False) -> None:
        self.layers = layers
        self.token_states = token_states
        self.in_graph = in_graph
        self.entering: Dict[Optional[str], List[torch.Tensor]] = {stream: [] for stream in layers}
        self.read_tensors: Dict[str, torch.Tensor] = {}

    def contexts(self) -> List[ContextManager[None]]:
        return [read_layer_input(layer, self.entering[stream], self.in_graph) for stream, layer in self.layers.items()]

    def read(self, streams: StreamLayouts) -> Dict[str, torch.Tensor]:
        """``{stream: the tensor entering its first layer}``, refused when no first layer ran."""
        self.read_tensors = {streams.explained[0] if stream is None else stream: store[0]
                             for stream, store in self.entering.items() if store}
        if not self.read_tensors:
            raise CaptureError("The first Transformer layer never ran, so no token relevance could be read.")
        return self.read_tensors

    def leaves(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        return list(self.read(streams).values())

    def for_steps(self, in_graph: bool) -> "LayerInputs":
        return LayerInputs(self.layers, self.token_states, in_graph)

    def token_relevance(self, streams: StreamLayouts, grads: Sequence[Optional[torch.Tensor]],
                        batch: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """``sum_d x * g`` per token (B, N) and stream read, in at least float32, padding zeroed;
        ``batch``: transpose sequence-first tensors (:func:`token_sums`). A first-layer input
        that is not (B, N, ...) tokens of its stream is refused, not summed along another axis."""
        relevance = {}
        for (stream, leaf), grad in zip(self.read_tensors.items(), grads):
            tokens = token_sums(self.token_states, input_times_gradient(leaf, grad),
                                streams.layouts[stream].token_mask if stream in streams.layouts else None, batch)
            layout = streams.layouts.get(stream)
            expected = (batch if batch is not None else tokens.shape[0], layout.num_tokens) if layout else None
            if expected is not None and tuple(tokens.shape) != expected:
                raise CaptureError(
                    f"The hidden states entering the first layer of the {stream!r} stream have the shape "
                    f"{tuple(leaf.shape)}, which is not (batch, {layout.num_tokens} tokens, ...) as its attention "
                    f"saw them (expected (batch, tokens) sums {expected}, got {tuple(tokens.shape)}): the model "
                    "stacks or reshapes its hidden states between layers. Read relevance at the inputs "
                    "(relevance_at='inputs' with inputs_embeds), or use an attention method."
                )
            relevance[stream] = tokens
        return relevance

    def result(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...],
               grads: Sequence[Optional[torch.Tensor]], scores: torch.Tensor, index: torch.Tensor) -> RelevanceResult:
        per_stream = self.token_relevance(streams, grads, scores.shape[0])
        first = next(iter(per_stream.values()))
        total = sum(r.sum(-1).to(first.device) for r in per_stream.values())  # streams may start apart
        layout = streams.layouts[streams.explained[0]]
        return RelevanceResult(first, None, layout, scores, index, total, per_stream, streams)


class ModuleOutputs(RelevanceReading):
    """Token relevance read at the outputs of the modules that embed the token ids (B, N, ...):
    ``sum_d x * g`` per token, summed over the modules. For models whose layers take more than
    the hidden states from the ids: Gemma 3n stacks its AltUp copies of the embeddings (a
    (copies, B, N, D) first-layer input) and feeds each layer a per-layer embedding of the ids,
    so every token's relevance leaves through ``embed_tokens`` and ``embed_tokens_per_layer``.
    Each module's output (first call) is replaced by a leaf of the same values."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = list(modules)
        self.outputs: List[List[torch.Tensor]] = [[] for _ in self.modules]

    def contexts(self) -> List[ContextManager[None]]:
        def make(store: List[torch.Tensor]):
            def wrap(original):
                def forward(*args, **kwargs):
                    output = original(*args, **kwargs)
                    if store or not isinstance(output, torch.Tensor):
                        return output
                    leaf = output.detach().requires_grad_()
                    store.append(leaf)
                    return leaf
                return forward
            return wrap
        return [patching.instance_forward(module, make(store)) for module, store in zip(self.modules, self.outputs)]

    def leaves(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        if not all(self.outputs):
            missing = [type(m).__name__ for m, store in zip(self.modules, self.outputs) if not store]
            raise CaptureError(f"The embedding modules {missing} never ran, so no token relevance could be read.")
        return [store[0] for store in self.outputs]

    def for_steps(self, in_graph: bool) -> "ModuleOutputs":
        """A fresh reading (the embeddings' outputs are leaves of their own: ``in_graph`` changes nothing)."""
        return ModuleOutputs(self.modules)

    def read(self, streams: StreamLayouts) -> Dict[str, torch.Tensor]:
        """The leaves by name, as :meth:`LayerInputs.read` gives its (the generation engine's interface)."""
        return {f"{streams.explained[0]}:{i}": leaf for i, leaf in enumerate(self.leaves(streams, ()))}

    def token_relevance(self, streams: StreamLayouts, grads: Sequence[Optional[torch.Tensor]],
                        batch: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """``{explained stream: sum over the modules of sum_d x * g}`` (B, N), padding set to zero."""
        layout = streams.layouts[streams.explained[0]]
        tokens = None
        for leaf, grad in zip(self.leaves(streams, ()), grads):
            if leaf.shape[1] != layout.num_tokens or (batch is not None and leaf.shape[0] != batch):
                raise CaptureError(
                    f"An embedding output of shape {tuple(leaf.shape)} is not (batch, {layout.num_tokens} tokens, "
                    "...), so its relevance cannot be read per token."
                )
            part = token_sums(lambda hidden: hidden, input_times_gradient(leaf, grad), layout.token_mask)
            tokens = part if tokens is None else tokens + part.to(tokens.device)
        return {streams.explained[0]: tokens}

    def result(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...],
               grads: Sequence[Optional[torch.Tensor]], scores: torch.Tensor, index: torch.Tensor) -> RelevanceResult:
        layout = streams.layouts[streams.explained[0]]
        streams_read = self.token_relevance(streams, grads, scores.shape[0])
        tokens = streams_read[streams.explained[0]]
        return RelevanceResult(tokens, None, layout, scores, index, tokens.sum(-1), streams_read, streams)


class InputProducts(RelevanceReading):
    """Relevance ``x * dy/dx`` of every floating-point input (others: zeros), shaped like it."""

    def carrying(self, inputs: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        if not any(t.is_floating_point() for t in inputs):
            raise InputError(
                "relevance at 'inputs' needs floating-point inputs (pixels or embeddings); got dtypes "
                f"{[str(t.dtype) for t in inputs]}. Use the token relevance (the default) for token ids."
            )
        return relevance_carrying(inputs)

    def leaves(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        return [t for t in inputs if t.is_floating_point()]

    def result(self, streams: StreamLayouts, inputs: Tuple[torch.Tensor, ...],
               grads: Sequence[Optional[torch.Tensor]], scores: torch.Tensor, index: torch.Tensor) -> RelevanceResult:
        products = [input_times_gradient(leaf, g) for leaf, g in zip(self.leaves(streams, inputs), grads)]
        remaining = iter(products)
        per_input = tuple(next(remaining) if t.is_floating_point() else torch.zeros(t.shape, device=t.device)
                          for t in inputs)
        total = sum(r.reshape(r.shape[0], -1).sum(-1) for r in per_input)
        return RelevanceResult(None, per_input, streams.layouts[streams.explained[0]], scores, index, total)
