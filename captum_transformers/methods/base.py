"""The Captum-facing shell shared by every attention method.

A method subclasses :class:`TraceAttribution`, says what to capture (:meth:`capture_spec`)
and reduces the trace to token scores (:meth:`reduce`). This module formats inputs and
targets the Captum way, asks the adapter for a trace, and maps token scores back onto the
shape of each input.
"""
from __future__ import annotations

import abc
import threading
import warnings
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from captum.attr import Attribution
from captum.log import log_usage
from torch import nn

from ..adapters.base import Adapter
from ..adapters.input_checks import model_dtype, ordinary_tensors, refuse_inference_mode, refuse_non_finite
from ..errors import CaptureError, InputError, UnsupportedModelError
from ..adapters.query_rows import refuse_masked_explained_rows
from ..adapters.registry import get_adapter
from .math.relevancy_maps import explained_rows
from ..capture.inputs import passed_by_name, split_mapping
from ..capture.trace import AttentionRecord, AttentionTrace, CaptureSpec, InputSpan, TokenLayout
from .. import functional
from ..engine.pass_plan import PassPlan, resolved_target
from ..engine.runner import run_trace
from ..capture.row_chains import record_without_padding, row_layout
from .facts import GenerationSteps
from .stochastic_opt_in import StochasticOptIn, opt_in_flag

#: What :meth:`TraceAttribution.reduce` returns: token scores (B, N) of a one-stream model, or per stream.
StreamScores = Union[torch.Tensor, Dict[str, torch.Tensor]]
#: ``start_layer`` of the layer-wise methods: one value for every stream, or one per stream.
StartLayer = Union[int, Mapping[str, int]]

TensorOrTuple = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def blank_map_warning(method: Any, stream: Optional[str] = None) -> str:
    """The warning given with a map that is 0 everywhere for some explained example (of one
    ``stream`` of a model with several, named; None: the whole map). ``method``: the method's
    class (or instance), whose ``blank_map_reason`` says why its maps can be blank.

    Example::

        >>> blank_map_warning(PartialLRP, "encoder")[:62]
        "PartialLRP: the map of the 'encoder' stream of some explained "
    """
    cls = method if isinstance(method, type) else type(method)
    where = "some explained example" if stream is None else f"the {stream!r} stream of some explained example"
    return (f"{cls.__name__}: the map of {where} is 0 everywhere. {cls.blank_map_reason}: the method finds no "
            "positive evidence there, and the map carries no information about the prediction. GenericAttention, "
            "TransformerRelevance or AttnLRP explain it from every layer.")


def warn_if_blank(scores: Any, method: Any) -> Any:
    """``scores`` (a method's reduced maps: a tensor, or per stream) as they are, after a
    :func:`blank_map_warning` for each example whose map is 0 everywhere: a blank map reads as
    "nothing mattered", which it does not say. An example blank in every stream gets the warning
    for the whole map; a stream blank where another stream of the same example is not gets its
    own warning, naming it (an encoder-decoder's source, a DETR image)."""
    if isinstance(scores, dict):
        named = list(scores.items())
    elif isinstance(scores, (tuple, list)):
        named = [(str(i), value) for i, value in enumerate(scores)]
    else:
        named = [(None, scores)]
    named = [(name, value.detach()) for name, value in named
             if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] and value[0].numel()]
    if not named:
        return scores
    blank = {name: value.flatten(1).abs().amax(1).to("cpu", torch.float64) == 0 for name, value in named}
    if len({tuple(b.shape) for b in blank.values()}) != 1:  # streams of different batches: each on its own
        everywhere = torch.zeros(0, dtype=torch.bool)
    else:
        everywhere = torch.stack(list(blank.values())).all(0)
    if bool(everywhere.any()):
        warnings.warn(blank_map_warning(method), UserWarning, stacklevel=3)
    if len(named) > 1:
        for name, rows in blank.items():
            if bool((rows & ~everywhere if everywhere.numel() else rows).any()):
                warnings.warn(blank_map_warning(method, name), UserWarning, stacklevel=3)
    return scores


def _named_inputs(inputs: Any, additional_forward_args: Any,
                  forward_kwargs: Optional[dict]) -> Tuple[Any, Any, Optional[dict], Optional[str]]:
    """``(inputs, additional_forward_args, forward_kwargs, name)``: a mapping input split into
    its explained tensor, passed by ``name``, and keyword arguments; other inputs as given."""
    if not isinstance(inputs, Mapping):
        return inputs, additional_forward_args, forward_kwargs, None
    named = split_mapping(inputs, additional_forward_args, forward_kwargs)
    return named.tensor, None, named.forward_kwargs, named.name


def _format_inputs(inputs: Any) -> Tuple[Tuple[torch.Tensor, ...], bool]:
    is_tuple = isinstance(inputs, tuple)
    formatted = inputs if is_tuple else (inputs,)
    if not formatted or not all(isinstance(t, torch.Tensor) for t in formatted):
        raise InputError(
            f"inputs must be a tensor, a tuple of tensors, or a mapping such as a tokenizer's BatchEncoding, got "
            f"{type(inputs).__name__}" + (f" of {[type(t).__name__ for t in formatted]}" if is_tuple else "") + "."
        )
    batch = formatted[0].shape[0] if formatted[0].dim() else None
    if batch is None or any(t.dim() == 0 or t.shape[0] != batch for t in formatted):
        raise InputError(
            f"every input needs the same batch size in dimension 0; got shapes {[tuple(t.shape) for t in formatted]}."
        )
    return formatted, is_tuple


def prepared_inputs(inputs: Any, additional_forward_args: Any, forward_kwargs: Optional[dict], adapter: Any = None):
    """The shared preamble of ``attribute`` / ``trace``: ``(formatted, is_tuple,
    additional_forward_args, forward_kwargs, name)``, a mapping input split (its explained
    tensor passed by ``name``), the batch checked, keyword tensors checked against it. A graph
    adapter (``adapter.graph_inputs``) checks its batch of graphs itself, in the words of nodes,
    edges and graphs (``adapters/graph_inputs.py``): its keyword tensors (``edge_attr``) are
    not per example."""
    refuse_inference_mode()  # before anything is copied: a copy made in inference mode is an inference tensor
    inputs, additional_forward_args, forward_kwargs, name = _named_inputs(inputs, additional_forward_args,
                                                                          forward_kwargs)
    formatted, is_tuple = _format_inputs(inputs)
    if not getattr(adapter, "graph_inputs", False):
        _check_forward_kwargs(forward_kwargs, formatted[0].shape[0])
        refuse_non_finite(formatted, None if name is None else [f"inputs[{name!r}]"])
    # Tensors made under torch.inference_mode() cannot be saved for backward: explained as copies.
    formatted = ordinary_tensors(formatted)
    additional_forward_args = ordinary_tensors(additional_forward_args)
    forward_kwargs = ordinary_tensors(forward_kwargs)
    return formatted, is_tuple, additional_forward_args, forward_kwargs, name


def _check_forward_kwargs(forward_kwargs: Optional[dict], batch: int) -> None:
    """Tensors passed by name must match the batch: Captum wrappers (NoiseTunnel, metrics)
    expand ``additional_forward_args`` with the inputs but never ``forward_kwargs``."""
    for name, value in (forward_kwargs or {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] not in (1, batch):
            raise InputError(
                f"forward_kwargs[{name!r}] has batch size {value.shape[0]} but the inputs have {batch}. Captum "
                "wrappers such as NoiseTunnel expand additional_forward_args, not forward_kwargs: pass it "
                "positionally through additional_forward_args (or wrap the model) instead."
            )


def format_additional(additional_forward_args: Any) -> Tuple[Any, ...]:
    """``additional_forward_args`` as a tuple, Captum's way: ``None`` is ``()``, one value is a 1-tuple."""
    if additional_forward_args is None:
        return ()
    return additional_forward_args if isinstance(additional_forward_args, tuple) else (additional_forward_args,)


def span_to_input(scores: torch.Tensor, span: InputSpan, tensor: torch.Tensor) -> torch.Tensor:
    """Map the tokens ``span`` selects from a stream's scores (B, N) onto one input tensor.

    Images (B, C, H, W) with a ``grid``: the tokens as a (gh, gw) map, bilinearly upsampled
    to H x W and expanded over channels (an image without a ``grid`` is refused). Features
    (B, X, Y) with a ``grid`` (Whisper's (mel bins, frames), grid (1, tokens)): upsampled the
    same way to X x Y. Token inputs (B, n) get the scores; embeddings (B, n, D) get them
    repeated over D. Graph node features (N, F) of a span with ``nodes`` get their node's
    score repeated over F. A floating-point input of three or more dimensions whose axis 1 is
    not the tokens (and no grid says how they map) is refused: zeros would say "nothing
    mattered". Any other input with no token correspondence (for example a per-example scalar
    feature) gets zeros: it is not a token the attention mixes.
    """
    batch = scores.shape[0]
    if span.nodes is not None:
        graph, position = span.nodes
        if tensor.dim() == 0 or tensor.shape[0] != graph.shape[0]:
            raise CaptureError(
                f"The adapter describes {graph.shape[0]} nodes but the node input has shape {tuple(tensor.shape)}; "
                "pass the node features (N, F) the model's graph layers read, or return_tokens=True."
            )
        per_node = scores[graph.to(scores.device), position.to(scores.device)]
        return per_node.reshape(-1, *([1] * (tensor.dim() - 1))).expand(*tensor.shape).contiguous()
    tokens = scores[:, span.start:span.stop]
    if span.grid is None and tensor.dim() == 4 and tensor.is_floating_point():
        raise CaptureError(
            f"The {tokens.shape[1]} token scores cannot be mapped onto the image input of shape {tuple(tensor.shape)}: "
            "the adapter knows no patch grid (no patch-embedding convolution with kernel == stride was found). "
            "Pass return_tokens=True for the (B, N) token scores, or override patch_size() in a custom adapter."
        )
    if span.grid is not None and tensor.dim() == 4:
        if tokens.shape[1] != span.grid[0] * span.grid[1]:
            raise CaptureError(
                f"{tokens.shape[1]} tokens cannot form the {span.grid[0]}x{span.grid[1]} grid of an input of shape "
                f"{tuple(tensor.shape)}; the adapter's layout does not match the model. Pass return_tokens=True."
            )
        patches = tokens.reshape(batch, 1, *span.grid)
        upsampled = F.interpolate(patches, size=tensor.shape[-2:], mode="bilinear", align_corners=False)
        return upsampled.expand(-1, tensor.shape[1], -1, -1).contiguous()
    if span.grid is not None and tensor.dim() == 3 and tensor.is_floating_point():
        # Features (B, rows, columns) whose tokens form a grid over them: Whisper's (mel bins, frames)
        # with its (1, tokens) grid, each token's score upsampled over the frames it covers.
        if tokens.shape[1] != span.grid[0] * span.grid[1]:
            raise CaptureError(
                f"{tokens.shape[1]} tokens cannot form the {span.grid[0]}x{span.grid[1]} grid of an input of shape "
                f"{tuple(tensor.shape)}; the adapter's layout does not match the model. Pass return_tokens=True."
            )
        cells = tokens.reshape(batch, 1, *span.grid)
        return F.interpolate(cells, size=tensor.shape[-2:], mode="bilinear", align_corners=False)[:, 0].contiguous()
    if span.fields is not None and tensor.dim() == len(span.fields) + 1 and tensor.is_floating_point():
        return spread_over_fields(tokens, span.fields, span.field_order, tuple(tensor.shape))
    if tensor.dim() >= 2 and tensor.shape[1] == tokens.shape[1]:
        view = tokens.reshape(batch, tokens.shape[1], *([1] * (tensor.dim() - 2)))
        return view.expand(*tensor.shape).contiguous()
    if tensor.is_floating_point() and tensor.dim() >= 3:
        # A sequence of features whose positions are not the tokens (audio frames a strided convolution
        # subsamples, a prefix token added inside the model): zeros would read as "nothing mattered".
        raise CaptureError(
            f"The {tokens.shape[1]} token scores of the {span.stream!r} stream cannot be mapped onto the input of "
            f"shape {tuple(tensor.shape)}: its axis 1 holds {tensor.shape[1]} positions, not one per token, and the "
            "adapter knows no grid that maps the tokens onto it (features that the model turns into another number "
            "of tokens, e.g. by a strided convolution). Pass return_tokens=True for the (B, N) token scores, or "
            "give the input an InputSpan with a grid in a custom adapter's stream_layouts()."
        )
    return torch.zeros(tensor.shape, dtype=scores.dtype, device=scores.device)


def spread_over_fields(tokens: torch.Tensor, fields: Tuple[Tuple[int, int], ...], order: Optional[Tuple[int, ...]],
                       shape: Tuple[int, ...]) -> torch.Tensor:
    """Token scores (B, N) onto an input of ``shape`` (B, L1[, L2]) whose tokens are strided
    patches (:class:`InputSpan`'s ``fields``, one ``(field, hop)`` per axis, the tokens
    enumerated over the axes in ``order``): each token's score spread evenly over its field,
    overlapping fields adding up, so the input's sum is the tokens' sum; positions no field
    covers (a tail shorter than a hop) get 0. A waveform's frames: one axis; AST's patches of
    (time, frequency): two."""
    axes = len(fields)
    counts = [(length - field) // hop + 1 for length, (field, hop) in zip(shape[1:], fields)]
    order = tuple(range(axes)) if order is None else tuple(order)
    if math.prod(counts) != tokens.shape[1] or any(c < 1 for c in counts):
        raise CaptureError(
            f"{tokens.shape[1]} tokens cannot be the {' x '.join(map(str, counts))} patches that fields (field, hop) "
            f"{list(fields)} make of the input of shape {tuple(shape)}; the adapter's layout does not match the model. "
            "Pass return_tokens=True.")
    grid = tokens.reshape(tokens.shape[0], *[counts[a] for a in order])
    grid = grid.permute(0, *[order.index(a) + 1 for a in range(axes)]).unsqueeze(1)  # (B, 1, n1[, n2])
    kernel = torch.full((1, 1, *[f for f, _ in fields]), 1.0 / math.prod(f for f, _ in fields),
                        dtype=tokens.dtype, device=tokens.device)
    transpose = F.conv_transpose1d if axes == 1 else F.conv_transpose2d
    spread = transpose(grid, kernel, stride=tuple(h for _, h in fields))[:, 0]
    padding = [p for length, got in reversed(list(zip(shape[1:], spread.shape[1:]))) for p in (0, length - got)]
    return F.pad(spread, padding).contiguous()


def attribution_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of every method's attributions: the model's (its first floating-point
    parameter's or buffer's, :func:`~captum_transformers.adapters.base.model_dtype`) promoted
    to at least float32 (float32 for bfloat16 and float16 models, float64 for float64 ones).

    Half-precision models keep their own forward; their relevance is accumulated in float32
    and returned so, since a half-precision map would round away what the accumulation kept.
    Example: a bfloat16 ViT gives float32 maps; ``attribution_dtype(vit.double())`` is
    ``torch.float64``.
    """
    return torch.promote_types(model_dtype(model), torch.float32)


def finished(attributions: Any, model: nn.Module, device: Optional[torch.device] = None) -> Any:
    """Attributions (a tensor or a tuple of them) in :func:`attribution_dtype` on ``device`` (the inputs':
    a model spread over devices may end elsewhere), refused if any value is not finite: a half-precision
    backward pass can overflow (float16 tops out at 65504), and an ``inf`` or ``nan`` is no explanation."""
    moved = tuple(a.to(device=device, dtype=attribution_dtype(model))
                  for a in (attributions if isinstance(attributions, tuple) else (attributions,)))
    cast = moved if isinstance(attributions, tuple) else moved[0]
    for tensor in moved:
        if tensor.numel() and not _all_finite(tensor):
            raise CaptureError(
                f"The attributions of this {model_dtype(model)} model contain "
                f"{int((~torch.isfinite(tensor)).sum())} non-finite values (inf or nan): a gradient or relevance "
                "overflowed in the backward pass. Explain a float32 copy of the model (model.float()) instead."
            )
    return cast


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, from the extremes (min and max propagate nan): one read of
    the tensor, no boolean copy of it (4 ms on a batch of 16 image-sized maps, against 0.2 ms)."""
    if not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _query_vectors(layout: TokenLayout, dtype: torch.dtype) -> torch.Tensor:
    """One row vector (B, N) per example mixing the layout's explained rows."""
    return functional.query_vectors(layout.query_rows, layout.num_tokens, dtype, layout.query_weights)


class _PerThreadCall(threading.local):
    """What one ``attribute`` call of a method instance keeps while it runs, separately per thread."""
    streaming_rows, row_stream = False, None


class TraceAttribution(StochasticOptIn, Attribution):
    """Base of the attention methods: Captum's ``Attribution`` over an adapter trace.

    Subclasses implement :meth:`capture_spec` and :meth:`reduce`. A method whose one-sequence
    case is written over :mod:`~captum_transformers.capture.row_chains` (any layout: dense,
    windowed) sets ``uses_row_chains = True``; others read whole maps and are refused on
    layouts that hold none (Swin's windows).

    Output dtype, one rule for every method (this base and
    :class:`~captum_transformers.methods.lrp.RuleGradientXInput`): attributions are float32
    for half-precision (bfloat16, float16) models, else in the model's dtype
    (:func:`attribution_dtype`); the model's forward is its own, in its own dtype. A map with a
    non-finite value (a half-precision backward pass that overflowed) is refused, never returned,
    and so are bfloat16 models under the identity softmax or norm rules (TransformerRelevance,
    PartialLRP, TransformerLRP; :func:`~captum_transformers.propagation.rules.rule_set.refuse_rounding_sensitive`).

    Training mode, one rule for every method (:class:`StochasticOptIn`): a model whose forward is
    random or batch-dependent (active dropout, drop path, batch norm in training mode) is refused
    with :class:`~captum_transformers.errors.StochasticForwardError` naming the layers and the fix,
    ``model.eval()``; every method takes ``allow_stochastic=True`` to explain one random draw on
    purpose (maps then differ from call to call).
    """

    #: True: :meth:`reduce` works on every row layout (:func:`~.row_chains.row_layout`).
    uses_row_chains: bool = False

    # The method's facts (methods/facts.py): attention maps are non-negative and, unless a
    # subclass says otherwise, weighted by the target's gradient (class-specific).
    signed: bool = False
    class_specific: bool = True
    run_by_default: bool = True
    needs_adapter: bool = True
    generation_steps: GenerationSteps = GenerationSteps.TRACE
    #: True: :meth:`reduce` chains every attention layer (not one map), so a vision-language
    #: step's image row goes on through the vision tower's own layers (generation/vision_steps.py).
    chains_every_layer: bool = False

    @property
    def streaming_rows(self) -> bool:
        """True while :meth:`attribute` runs in this thread: a method may then fold its maps into the
        explained rows during the backward pass (:mod:`~.streaming_rows`); :meth:`trace` keeps them."""
        return self._per_thread().streaming_rows

    def streamed_result(self, trace: AttentionTrace) -> Optional[torch.Tensor]:
        """The explained rows a row stream folded while ``trace`` was taken (a generation step's
        stream, or the one :meth:`attribute` gave this thread's call), or None where no stream served it."""
        stream = trace.row_stream or self._row_stream
        return stream.result() if stream is not None and stream.served(trace) else None

    @property
    def _row_stream(self) -> Any:
        """This thread's running call's row stream (one instance may explain in several threads)."""
        return self._per_thread().row_stream

    @_row_stream.setter
    def _row_stream(self, value: Any) -> None:  # set by capture_spec / pass_plan in attribute()
        self._per_thread().row_stream = value

    def _per_thread(self) -> "_PerThreadCall":  # setdefault is atomic: one object for every thread
        return self.__dict__.setdefault("_thread_calls", _PerThreadCall())

    def __init__(self, model: nn.Module, adapter: Union[Adapter, str, None] = None, *,
                 allow_stochastic: bool = False) -> None:
        super().__init__(model)
        self.model = model
        self.adapter = get_adapter(model, adapter)
        self.allow_stochastic = opt_in_flag(allow_stochastic)

    @abc.abstractmethod
    def capture_spec(self) -> CaptureSpec:
        """What to keep from each attention call."""

    @abc.abstractmethod
    def reduce(self, trace: AttentionTrace) -> StreamScores:
        """Token scores (B, N) from a one-stream trace, or a dict of them per stream."""

    def trace(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
              forward_kwargs: Optional[dict] = None) -> AttentionTrace:
        """Run the capture alone and return the raw :class:`AttentionTrace`."""
        formatted, _, additional_forward_args, forward_kwargs, name = prepared_inputs(
            inputs, additional_forward_args, forward_kwargs, self.adapter)
        with passed_by_name(self.model, name), self.stochastic_rule():
            return self._trace(formatted, target, format_additional(additional_forward_args), forward_kwargs)

    def pass_plan(self, inputs: Tuple[torch.Tensor, ...], additional: Tuple[Any, ...],
                  forward_kwargs: Optional[dict]) -> PassPlan:
        """The passes this method's trace takes (:class:`PassPlan`): by default one capture
        with :meth:`capture_spec`; methods with rules or two passes override it."""
        return PassPlan(self.capture_spec())

    def _trace(self, inputs: Tuple[torch.Tensor, ...], target: Any, additional: Tuple[Any, ...],
               forward_kwargs: Optional[dict]) -> AttentionTrace:
        """Run :meth:`pass_plan` on one batch (refused first when no rows describe what the head reads)."""
        refusal = self.adapter.rows_refusal(self.model)
        if refusal is not None:
            raise UnsupportedModelError(refusal)
        plan = self.pass_plan(inputs, additional, forward_kwargs)
        trace = run_trace(self.adapter, self.model, inputs, additional, target, plan.spec, forward_kwargs,
                          rules=plan.rules, plain_spec=plan.plain_spec)
        if plan.then is not None:  # freed before the second trace runs (peak = the larger one)
            target, trace = resolved_target(trace.target), None
            trace = run_trace(self.adapter, self.model, inputs, additional, target, plan.then.spec, forward_kwargs,
                              rules=plan.then.rules, plain_spec=plan.then.plain_spec)
        return trace

    @log_usage()
    def attribute(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
                  return_tokens: bool = False, forward_kwargs: Optional[dict] = None) -> TensorOrTuple:
        """Attribute the target output to the inputs.

        Args:
            inputs: a tensor or a tuple of tensors, batch first (pixel values, token ids or
                embeddings), passed positionally to the model; or a mapping (a tokenizer's
                ``BatchEncoding``) whose ``input_ids``, ``pixel_values`` or ``inputs_embeds`` is
                explained, every entry passed by name (see :mod:`~captum_transformers.capture.inputs`).
            target: any Captum target form; ``None`` explains the predicted class.
            additional_forward_args: extra positional model arguments (e.g. an attention mask).
            return_tokens: return the raw (B, N) token scores instead of input-shaped maps.
            forward_kwargs: extra keyword arguments for the model (e.g. ``{"attention_mask": mask}``
                for a HF model whose second positional argument is something else).

        Returns:
            Attributions with the structure and shapes of ``inputs`` (of the explained tensor
            for a mapping), or (B, N) token scores.
        """
        formatted, is_tuple, additional_forward_args, forward_kwargs, name = prepared_inputs(
            inputs, additional_forward_args, forward_kwargs, self.adapter)
        with passed_by_name(self.model, name), self.stochastic_rule():
            call = self._per_thread()
            call.streaming_rows = True
            try:
                trace = self._trace(formatted, target, format_additional(additional_forward_args), forward_kwargs)
                per_stream = self.stream_scores(trace)
            except BaseException:  # a failed call's rows or replayed calls are never read: freed now
                call.row_stream = None
                raise
            finally:
                call.streaming_rows = False
        streams = trace.streams
        if return_tokens:
            returned = tuple(layout.returned(per_stream[name]) for name, layout in streams.layouts.items())
            return finished(returned[0] if streams.is_single else returned, self.model, formatted[0].device)
        if len(streams.inputs) != len(formatted):
            raise CaptureError(
                f"The {self.adapter.name} adapter described {len(streams.inputs)} input(s) but {len(formatted)} were "
                "given; pass the inputs the adapter documents, or return_tokens=True for per-stream token scores."
            )
        mapped = tuple(
            torch.zeros(t.shape, device=t.device) if span is None else span_to_input(per_stream[span.stream], span, t)
            for span, t in zip(streams.inputs, formatted)
        )
        return finished(mapped if is_tuple else mapped[0], self.model, formatted[0].device)

    def stream_scores(self, trace: AttentionTrace) -> Dict[str, torch.Tensor]:
        """:meth:`reduce` as scores for every stream of the trace, zero at padding.

        A stream the method gives no score (no attention call connects it to an explained
        stream, e.g. raw attention without a cross map) gets zeros.
        """
        streams = trace.streams
        for name in streams.explained:  # a padded explained row would zero the example's whole map
            layout = streams.layouts[name]
            refuse_masked_explained_rows(layout.query_rows, layout.query_weights, layout.token_mask, name)
        if not self.uses_row_chains:
            row_layout(trace).refuse_whole_map_method(type(self).__name__)
        scores = self.reduce(trace)
        if not isinstance(scores, dict):
            scores = {streams.explained[0]: scores}
        reference = next(iter(scores.values()))
        out = {}
        for name, layout in streams.layouts.items():
            value = scores.get(name)
            if value is None:
                value = reference.new_zeros(reference.shape[0], layout.num_tokens)
            if layout.token_mask is not None:
                value = value * layout.token_mask.to(device=value.device, dtype=value.dtype)
            out[name] = value
        return out

    @staticmethod
    def layers_from(trace: AttentionTrace, start_layer: StartLayer) -> StartLayer:
        """Validate ``start_layer`` (an int, or ``{stream: int}``) against the attention calls of
        each query stream: no stream may lose all of its calls."""
        counts: Dict[str, int] = {}
        for record in trace.records:
            counts[record.streams[0]] = counts.get(record.streams[0], 0) + 1
        if isinstance(start_layer, Mapping):
            unknown = sorted(set(start_layer) - set(counts))
            if unknown:
                raise InputError(
                    f"start_layer names streams {unknown} but the model's attention calls query {sorted(counts)}."
                )
        for stream, count in counts.items():
            start = start_layer.get(stream, 0) if isinstance(start_layer, Mapping) else start_layer
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < count:
                if len(counts) == 1:
                    raise InputError(
                        f"start_layer={start_layer} but the model has {count} attention layers; "
                        f"use a value in [0, {count})."
                    )
                raise InputError(
                    f"start_layer={start_layer} leaves the {stream!r} stream none of its {count} attention calls "
                    f"(calls per query stream: {counts}). Give one value per stream, e.g. "
                    f"start_layer={{{stream!r}: {max(count - 1, 0)}}}, each below that stream's count."
                )
        return start_layer

    @staticmethod
    def records_from(trace: AttentionTrace, start_layer: StartLayer) -> List[AttentionRecord]:
        """The calls of each query stream from its ``start_layer``-th call on, in call order
        (``start_layer`` an int for every stream, or ``{stream: int}``, others from 0)."""
        seen: Dict[str, int] = {}
        kept = []
        for record in trace.records:
            stream = record.streams[0]
            index = seen.get(stream, 0)
            seen[stream] = index + 1
            start = start_layer.get(stream, 0) if isinstance(start_layer, Mapping) else start_layer
            if index >= start:
                kept.append(record)
        return kept

    @classmethod
    def values_from(cls, trace: AttentionTrace, start_layer: StartLayer, backward: bool) -> List[Optional[torch.Tensor]]:
        """Each call's value in call order (backward or forward), ``None`` for the calls before
        ``start_layer`` (:meth:`records_from`): the ``values`` of the row chains."""
        kept = {id(record) for record in cls.records_from(trace, start_layer)}
        return [(r.backward_value if backward else r.forward_value) if id(r) in kept else None for r in trace.records]

    @staticmethod
    def is_one_sequence(trace: AttentionTrace) -> bool:
        """True for one stream attending only to itself: the fast row-vector paths apply."""
        return trace.streams.is_single and all(r.is_self for r in trace.records)

    @staticmethod
    def stream_sizes(trace: AttentionTrace) -> Dict[str, int]:
        """Tokens per stream, checked against every recorded call's stream pair."""
        sizes = trace.streams.sizes()
        for record in trace.records:
            unknown = [name for name in record.streams if name not in sizes]
            if unknown:
                raise CaptureError(
                    f"Attention call {record.call_index} ({record.block.name}) mixes streams {record.streams} but the "
                    f"adapter's layouts only describe {sorted(sizes)}; the adapter must give a layout per stream."
                )
        return sizes

    @staticmethod
    def without_padding(trace: AttentionTrace, record: AttentionRecord, value: torch.Tensor) -> torch.Tensor:
        """A fused (B, Q, K) map with padded queries and keys zeroed, from the streams' masks."""
        return record_without_padding(trace, record, value)

    def explained_stream_rows(self, trace: AttentionTrace, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
        """Row vectors (B, N_q) selecting the explained token(s) of each explained stream."""
        return {name: _query_vectors(trace.streams.layouts[name], dtype) for name in trace.streams.explained}

    def last_map_rows(self, trace: AttentionTrace, backward: bool) -> Dict[str, torch.Tensor]:
        """Baselines on the last attention map: per stream ``t``, the explained rows of the last
        call of each explained stream ``q`` over ``t``, summed over ``q`` (one stream: the last
        map's explained row)."""
        last: Dict[Tuple[str, str], AttentionRecord] = {}
        for record in trace.records:
            if (record.backward_value if backward else record.forward_value) is not None:
                last[record.streams] = record
        maps = {}
        for pair, record in last.items():
            value = record.backward_value if backward else record.forward_value
            maps[pair] = self.without_padding(trace, record, value)
        dtype = next(iter(maps.values())).dtype
        return explained_rows(maps, self.explained_stream_rows(trace, dtype))

    @staticmethod
    def start_rows(trace: AttentionTrace, dtype: torch.dtype) -> torch.Tensor:
        """Row vectors selecting the explained token(s) of each example (first explained stream)."""
        return _query_vectors(trace.layout, dtype)
