r"""Captum's Integrated Gradients and Saliency as benchmark rows, called like the package's methods.

Users compare the attention methods against Captum's own gradient attributions, so the
catalog carries them under ``integrated-gradients`` and ``saliency``. These shells only adapt
the call: ``attribute(inputs, target, additional_forward_args, forward_kwargs, return_tokens)``
as :class:`~captum_transformers.methods.base.TraceAttribution` takes it; the attribution
itself is Captum's.

* Float inputs (pixels, or embeddings): Captum's ``IntegratedGradients`` / ``Saliency`` on the
  inputs; attributions have the shape of the inputs (images: per pixel and channel).
* Token ids, (B, S) integers: the same at the output of the model's input embeddings (what
  Captum's ``LayerIntegratedGradients`` / ``LayerGradientXActivation`` without the activation
  factor compute), summed over the hidden size: (B, S) token scores, zero where
  ``forward_kwargs["attention_mask"]`` is 0. The embedding outputs are replaced through hooks
  that act in the explaining thread only (Captum's layer hooks would act in every thread).
  Every call of an input-embedding module (``get_input_embeddings()`` and the modules that
  share its weight, e.g. an encoder-decoder's ``encoder.embed_tokens`` and
  ``decoder.embed_tokens``) is matched, in one plain forward pass first, to the attributed ids
  it embeds: the ids themselves, their transpose (XLNet embeds sequence-first), or, in the
  decoder of an encoder-decoder given only ``input_ids``, their right shift (the decoder input
  BART- and T5-style heads build); each use sees the attributed embedding, so the gradient sums
  over every use. A call that embeds anything else is refused by name.
* Two id tensors ``(input_ids, decoder_input_ids)`` of a seq2seq model: one attribution per
  input, at the encoder's and at the decoder's embedding call, returned as a tuple of (B, S)
  and (B, T) scores (the second zero where ``decoder_attention_mask`` is 0).

The target: Captum's forms, with the package's convention for models that score every
position (a causal LM's (B, S, V) logits, a seq2seq LM's (B, T, V)): a target naming the
token only (an int, one per example, or None for the predicted token) explains that token's
logit at the last real position of each row (the decoder's, for a seq2seq LM), as the
package's methods do. The position is the adapter's (:meth:`Adapter.scored_forward`, one plain
pass: its explained row and its target resolution); a ``(position, token)`` target is
Captum's as given.

Reformer is refused: its reversible layers' backward pass runs only in training mode.

Integrated Gradients (Sundararajan, Taly and Yan, "Axiomatic Attribution for Deep Networks",
ICML 2017), for a baseline :math:`x'`:

.. math:: \mathrm{IG}_i(x) = (x_i - x'_i) \int_0^1
          \frac{\partial y_t(x' + \alpha (x - x'))}{\partial x_i}\, d\alpha

Settings: ``n_steps=50`` Gauss-Legendre points (Captum's default); ``internal_batch_size=256``
interpolated rows per forward pass (memory bound; the result does not depend on it beyond
float rounding); baseline: zeros of the model input for float inputs (Captum's default; for
normalised images that is the mean colour, not black), and for token ids the model's
``config.pad_token_id`` at every position (the embedding of [PAD], as Captum's BERT
tutorial), so padded positions, which hold that id, have :math:`x - x' = 0`; for a model with
no pad id (GPT-2, CodeGen, RWKV) the all-zero embedding vector, the baseline Sundararajan et
al. (Section 6) use for text, Captum's ``IntegratedGradients`` default on the embeddings
(``baseline_token_id=`` chooses a token instead).

Saliency (Simonyan, Vedaldi and Zisserman, "Deep Inside Convolutional Networks", ICLR
workshop 2014): :math:`S_i(x) = |\partial y_t / \partial x_i|`; for token ids
:math:`S_s = \sum_d |\partial y_t / \partial e_{s,d}|` over the embedding :math:`e_s`. The
benchmark sums image attributions over channels (Simonyan et al. take the channel maximum).

``target=None`` explains the predicted class, as for the package's methods. Tensors in
``forward_kwargs`` with the batch size are passed as expanded positional arguments
(Integrated Gradients runs the batch ``n_steps`` times), others as they are.

Example::

    >>> ig = CaptumIntegratedGradients(bert)
    >>> scores = ig.attribute(input_ids, target=labels, forward_kwargs={"attention_mask": mask})  # (B, S)
    >>> maps = CaptumSaliency(vit).attribute(pixel_values, target=labels)               # (B, 3, H, W)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from captum.attr import Attribution, IntegratedGradients, Saliency
from torch import nn

from ..compat.foreign_patches import check_library_classes
from ..adapters.graph.refusal import MESSAGE_PASSING, class_keys
from ..adapters.huggingface.adapter import takes_decoder_inputs
from ..adapters.registry import get_adapter, registered_adapter
from ..capture.recorder import Recorder
from ..capture.trace import CaptureSpec
from ..model_state import patching
from ..compat.compiled import uncompiled
from ..model_state.exclusive import exclusive
from ..capture.targets import output_scores, select_targets
from ..errors import CaptureError, InputError, UnsupportedModelError
from ..adapters.input_checks import ordinary_tensors, refuse_inference_mode, refuse_non_finite
from ..compat.stochastic_layers import watched
from .base import attribution_dtype, finished
from .facts import GenerationSteps
from .stochastic_opt_in import StochasticOptIn

TensorOrTuple = Union[torch.Tensor, Tuple[torch.Tensor, ...]]

IG_STEPS = 50
IG_INTERNAL_BATCH = 256


def model_logits(output: Any) -> torch.Tensor:
    """The score tensor of a model output: a tensor, the ``"logits"`` entry of a mapping or
    ``ModelOutput`` (:func:`~captum_transformers.capture.targets.output_scores`), or the first
    element of a tuple."""
    output = output_scores(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output
    raise InputError(f"the model returned {type(output).__name__}; Captum's gradient methods need a tensor of "
                     "scores (or an output with logits). Wrap the model to return its logits.")


class _ScoresForward:
    """``model(*inputs, *positional, **forward_kwargs)`` as scores, the per-example keyword
    tensors arriving positionally (last) so that Captum expands them with the inputs. A seq2seq
    model's ``(input_ids, decoder_input_ids)`` is called as the adapter calls it (the decoder
    ids by keyword: positionally they would land on ``attention_mask``)."""

    def __init__(self, model: nn.Module, expanded_names: Tuple[str, ...], fixed: Dict[str, Any],
                 num_inputs: int = 1, call_model: Optional[Callable] = None) -> None:
        self.model, self.expanded_names, self.fixed = model, expanded_names, fixed
        self.num_inputs, self.call_model = num_inputs, call_model

    def __call__(self, *args: Any) -> torch.Tensor:
        split = len(args) - len(self.expanded_names)
        kwargs = dict(self.fixed, **dict(zip(self.expanded_names, args[split:])))
        if self.call_model is None:
            return model_logits(self.model(*args[:split], **kwargs))
        inputs, rest = args[:self.num_inputs], args[self.num_inputs:split]
        return model_logits(self.call_model(self.model, inputs, rest, kwargs))


def _call_ids(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, Callable[[torch.Tensor], Tuple]]:
    """The ids an embedding module was called with, and ``ids -> (args, kwargs)`` for other ids."""
    if args:
        return args[0], lambda ids: ((ids, *args[1:]), kwargs)
    name = next((k for k in ("input", "input_ids", "x") if k in kwargs), None)
    if name is None:
        return None, lambda ids: (args, kwargs)
    return kwargs[name], lambda ids: (args, {**kwargs, name: ids})


def _embedding_value(module: nn.Module, output: Any) -> torch.Tensor:
    """The embedding tensor of an embedding module's output: the output, or the first element of
    a ``(value, None)`` tuple (I-BERT's ``QuantEmbedding`` outside quant mode); a quantized
    output (a tuple carrying a scaling factor) is refused by name."""
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output
    if (isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor)
            and output[0].is_floating_point()):
        if all(part is None for part in output[1:]):
            return output[0]
        raise UnsupportedModelError(
            f"The input embeddings {type(module).__name__} return {len(output)} tensors (a value and its "
            "quantization scaling factor: an integer-only quantized model, e.g. I-BERT with quant_mode=True), and "
            "the gradient through its integer arithmetic is a straight-through estimate, not the model's. Explain "
            "the model built with quant_mode=False.")
    raise UnsupportedModelError(
        f"The input embeddings {type(module).__name__} returned {type(output).__name__}, not a floating-point "
        "tensor, so the gradient methods cannot attribute at their output. Pass the embeddings as float inputs "
        "(inputs_embeds) instead.")


def _with_value(output: Any, value: torch.Tensor) -> Any:
    return value if isinstance(output, torch.Tensor) else type(output)((value, *output[1:]))


#: How an embedding call reads an attributed input: as given, transposed (sequence first),
#: right-shifted by one (a decoder's input built from the encoder's ids, its first token its own),
#: or padded at the end by the model itself (Longformer and LED pad to a multiple of their window).
SAME, TRANSPOSED, SHIFTED, PADDED = "same", "transposed", "shifted", "padded"


@dataclasses.dataclass(frozen=True)
class _Use:
    """One call of an input-embedding module: the attributed input it embeds (None: none, a
    decoder prefix passed by keyword) and how (:data:`SAME`, :data:`TRANSPOSED`, :data:`SHIFTED`)."""

    module: nn.Module
    input: Optional[int]
    layout: str = SAME

    def reads(self, called: Any, ids: torch.Tensor) -> bool:
        """Whether ``called`` (the call's ids) is ``ids`` in this use's layout."""
        if not isinstance(called, torch.Tensor) or called.dim() != 2:
            return False
        if self.layout == SAME:
            return called.shape == ids.shape and torch.equal(called.to(ids.device), ids)
        if self.layout == TRANSPOSED:
            return called.shape == ids.shape[::-1] and torch.equal(called.to(ids.device), ids.t())
        if self.layout == PADDED:
            return (called.shape[0] == ids.shape[0] and called.shape[1] > ids.shape[1]
                    and torch.equal(called[:, :ids.shape[1]].to(ids.device), ids))
        return (called.shape == ids.shape and ids.shape[1] > 0
                and torch.equal(called[:, 1:].to(ids.device), ids[:, :-1]))

    def value(self, embedded: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """The call's output: the attributed embedding ``embedded`` (B, S, D) in this layout, a
        tensor of its own inside the graph (CTRL scales its embedding output in place);
        ``own``: the module's own output (a shifted decoder's first token)."""
        if self.layout == SAME:
            return embedded.clone()
        if self.layout == TRANSPOSED:
            return embedded.transpose(0, 1).contiguous()
        if self.layout == PADDED:
            return torch.cat([embedded.to(own.dtype), own[:, embedded.shape[1]:]], dim=1)
        return torch.cat([own[:, :1], embedded[:, :-1].to(own.dtype)], dim=1)


def _embedding_modules(model: nn.Module, seq2seq: bool) -> Tuple[nn.Module, ...]:
    """The modules that embed token ids: ``get_input_embeddings()``, the embedding modules that
    share its weight (an encoder-decoder's ``encoder.embed_tokens`` and ``decoder.embed_tokens``
    tie it to ``shared``), and for two inputs the decoder's own input embeddings (its
    ``get_input_embeddings()``, else its ``embed_tokens``: FSMT's decoder has its own vocabulary)."""
    first = _input_embeddings(model)
    found = [first]
    weight = getattr(first, "weight", None)
    if isinstance(weight, torch.Tensor):
        found += [module for module in model.modules() if module is not first
                  and getattr(module, "weight", None) is weight
                  and (isinstance(module, nn.Embedding) or type(module) is type(first))]  # not a tied LM head
    decoder = _decoder(model)
    getter = getattr(decoder, "get_input_embeddings", None)
    own = (getter() if callable(getter) else getattr(decoder, "embed_tokens", None)) if seq2seq else None
    if isinstance(own, nn.Module) and all(own is not module for module in found):
        found.append(own)
    return tuple(found)


def _decoder(model: nn.Module) -> Optional[nn.Module]:
    """The decoder of an encoder-decoder (``get_decoder()``), None for other models."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    getter = getattr(model, "get_decoder", None)
    encoder_getter = getattr(model, "get_encoder", None)
    try:
        decoder = getter() if callable(getter) else None
        encoder = encoder_getter() if callable(encoder_getter) else None
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        return None
    if not isinstance(decoder, nn.Module) or decoder is model:
        return None
    # transformers' get_decoder() falls back to the base model: an encoder-only head (UMT5's token
    # classifier, whose config still says is_encoder_decoder) has no decoder.
    return None if isinstance(encoder, nn.Module) and any(m is encoder for m in decoder.modules()) else decoder


@contextlib.contextmanager
def _hooked(modules: Sequence[nn.Module], hook: Callable):
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(patching.forward_hook(module, hook, with_kwargs=True))
        yield


@dataclasses.dataclass
class _EmbeddingCalls:
    """How the attributed ids reach the input embeddings, read off one plain forward pass:
    ``uses`` in call order, ``embedded`` the attributed embedding of each input (B, S, D),
    ``scores`` the model's scores, and each input's defining call (to embed a baseline)."""

    uses: Tuple[_Use, ...]
    embedded: Tuple[torch.Tensor, ...]
    scores: torch.Tensor
    defining: Tuple[Tuple[nn.Module, Callable, str], ...]

    @classmethod
    def recorded(cls, model: nn.Module, forward: Callable, ids: Tuple[torch.Tensor, ...],
                 additional: Tuple[Any, ...], given: Sequence[torch.Tensor]) -> "_EmbeddingCalls":
        modules = _embedding_modules(model, len(ids) == 2)
        decoder = _decoder(model)
        in_decoder = set() if decoder is None else {id(m) for m in decoder.modules()}
        calls: List[Tuple[nn.Module, Any, torch.Tensor, Callable]] = []

        def record(module, args, kwargs, output):
            called, rebuild = _call_ids(args, kwargs)
            calls.append((module, called, _embedding_value(module, output).detach().clone(), rebuild))  # before in-place use

        with _hooked(modules, record), torch.no_grad():
            scores = forward(*ids, *additional)
        uses = tuple(_planned_use(module, called, ids, id(module) in in_decoder, given, model)
                     for module, called, _, _ in calls)
        embedded, defining = [], []
        for k in range(len(ids)):
            first = next((i for i, use in enumerate(uses) if use.input == k and use.layout != SHIFTED), None)
            if first is None:
                raise CaptureError(
                    f"input {k} ({tuple(ids[k].shape)} token ids) reaches none of {type(model).__name__}'s input "
                    f"embeddings ({[type(m).__name__ for m in modules]}) in the forward pass, so the gradient methods "
                    "have nothing to attribute it at. Pass its embeddings as float inputs instead.")
            module, _, value, rebuild = calls[first]
            layout = uses[first].layout
            embedded.append(value.transpose(0, 1).contiguous() if layout == TRANSPOSED
                            else value[:, :ids[k].shape[1]] if layout == PADDED else value)
            defining.append((module, rebuild, uses[first].layout))
        for use, (module, _, value, _) in zip(uses, calls):
            if use.input is not None and not _consistent(use, value, embedded[use.input]):
                raise UnsupportedModelError(
                    f"{type(model).__name__} embeds input {use.input} in {type(module).__name__} to other values than "
                    f"in {type(defining[use.input][0]).__name__} (another scale or table), so there is no one "
                    "embedding to attribute at. Pass the embeddings as float inputs (inputs_embeds, and "
                    "decoder_inputs_embeds) instead.")
        return cls(uses, tuple(embedded), scores, tuple(defining))

    def embed(self, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Other ids (a baseline) for input ``k``, embedded by its defining call, (B, S, D)."""
        module, rebuild, layout = self.defining[k]
        args, kwargs = rebuild(ids.t().contiguous() if layout == TRANSPOSED else ids)
        with torch.no_grad():
            value = _embedding_value(module, module(*args, **kwargs)).detach()
        return value.transpose(0, 1).contiguous() if layout == TRANSPOSED else value


def _consistent(use: _Use, value: torch.Tensor, embedded: torch.Tensor) -> bool:
    if use.layout == PADDED:
        value = value[:, :embedded.shape[1]]
    elif use.layout == SHIFTED:
        value, embedded = value[:, 1:], embedded[:, :-1]
    elif use.layout == TRANSPOSED:
        value = value.transpose(0, 1)
    return value.shape == embedded.shape and torch.allclose(value, embedded)


def _planned_use(module: nn.Module, called: Any, ids: Tuple[torch.Tensor, ...], in_decoder: bool,
                 given: Sequence[torch.Tensor], model: nn.Module) -> _Use:
    """What one embedding call of the plain pass embeds. Ids the caller passed besides the
    attributed ones (``token_type_ids``, a decoder prefix by keyword): nothing attributed. In the
    decoder of an encoder-decoder: the decoder ids (the second input), else the right shift of
    ``input_ids`` the head built; elsewhere the first input, as given or transposed (refused when
    its values cannot tell which)."""
    if _passed(called, given, ids, by_storage=True):
        return _Use(module, None)
    if in_decoder and len(ids) == 1:
        if _Use(module, 0, SHIFTED).reads(called, ids[0]):
            return _Use(module, 0, SHIFTED)
        if _passed(called, given, ids, by_storage=False):
            return _Use(module, None)
        raise CaptureError(
            f"The decoder of {type(model).__name__} embeds ids of shape {_shape(called)} that are not the right "
            f"shift of input_ids {tuple(ids[0].shape)} (the decoder input an encoder-decoder head builds from "
            "them). Pass inputs=(input_ids, decoder_input_ids) to attribute both sequences.")
    k = 1 if in_decoder else 0
    same, transposed = (_Use(module, k, layout).reads(called, ids[k]) for layout in (SAME, TRANSPOSED))
    if same != transposed:
        return _Use(module, k, SAME if same else TRANSPOSED)
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    if (not same and isinstance(pad, int) and _Use(module, k, PADDED).reads(called, ids[k])
            and bool((called[:, ids[k].shape[1]:] == pad).all())):
        return _Use(module, k, PADDED)  # padded by the model to its window size: the padding is its own
    which = "input_ids" if k == 0 else "decoder_input_ids"
    if same:  # a square batch of symmetric ids: as given or transposed reads alike, and attributes differently
        raise InputError(
            f"The {tuple(ids[k].shape)} {which} are symmetric, so it cannot be told whether "
            f"{type(model).__name__} embeds them as given or transposed (sequence first). Explain the examples in a "
            "batch of another size.")
    if _passed(called, given, ids, by_storage=False):
        return _Use(module, None)
    raise CaptureError(
        f"{type(model).__name__}'s input embeddings {type(module).__name__} were called with ids of shape "
        f"{_shape(called)}, which are not the attributed {which} {tuple(ids[k].shape)} (nor their transpose, nor "
        "ids passed in forward_kwargs): attributing would leave that use out. Pass the embeddings as float inputs "
        "(inputs_embeds) instead.")


def _passed(called: Any, given: Sequence[torch.Tensor], ids: Tuple[torch.Tensor, ...], by_storage: bool) -> bool:
    """Whether ``called`` is one of the integer tensors passed besides the attributed ids: the
    same storage (a view of it), or, ``by_storage=False``, equal values."""
    if not isinstance(called, torch.Tensor):
        return False
    if by_storage:
        storage = called.untyped_storage().data_ptr()
        return (any(g.untyped_storage().data_ptr() == storage for g in given)
                and all(t.untyped_storage().data_ptr() != storage for t in ids))
    return any(g.shape == called.shape and torch.equal(g.to(called.device), called) for g in given)


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


class _EmbeddingsForward:
    """Scores of ``forward(*ids, *rest)`` with each input-embedding call's output replaced by
    the attributed embedding of the input it embeds (:class:`_EmbeddingCalls`), so Captum
    differentiates at the embeddings (as its layer methods do) while the replacement acts in
    this thread only: Captum's own layer hooks are process-wide and would change a plain
    forward of the same model running in another thread."""

    def __init__(self, forward: Callable, calls: _EmbeddingCalls) -> None:
        self.forward, self.uses = forward, calls.uses
        self.modules = tuple({id(use.module): use.module for use in calls.uses}.values())
        self.num_inputs = len(calls.embedded)

    def __call__(self, *args: Any) -> torch.Tensor:
        embedded, ids = args[:self.num_inputs], args[self.num_inputs:2 * self.num_inputs]
        rest = args[2 * self.num_inputs:]
        count = [0]

        def replace(module, call_args, call_kwargs, output):
            n = count[0]
            count[0] += 1
            use = self.uses[n] if n < len(self.uses) else None
            called = _call_ids(call_args, call_kwargs)[0]
            if use is None or use.module is not module or (use.input is not None
                                                           and not use.reads(called, ids[use.input])):
                raise CaptureError(
                    f"Embedding call {n} ({type(module).__name__}, ids of shape {_shape(called)}) differs from the "
                    "plain forward pass's, so the attributed embeddings cannot be placed; the model's forward "
                    "depends on more than its inputs. Report this model.")
            if use.input is None:
                return None
            return _with_value(output, use.value(embedded[use.input], _embedding_value(module, output)))

        with _hooked(self.modules, replace):
            scores = self.forward(*ids, *rest)
        if count[0] != len(self.uses):
            raise CaptureError(f"The forward pass called the input embeddings {count[0]} times, the plain pass "
                               f"{len(self.uses)} times; report this model.")
        return scores


class _CaptumGradientBaseline(StochasticOptIn, Attribution):
    """Shared call shape: inputs, target, extra arguments, then Captum on inputs or embeddings."""

    # The method's facts (methods/facts.py): gradients of the target score, read without an
    # adapter, one Captum call per generation step on its prefix; signed is each method's own.
    class_specific: bool = True
    run_by_default: bool = True
    needs_adapter: bool = False
    generation_steps: GenerationSteps = GenerationSteps.PREFIX_CALLS

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.model = model

    def _input_attribution(self, forward: Callable, inputs: TensorOrTuple, target: Any,
                           additional: Tuple[Any, ...]) -> TensorOrTuple:
        raise NotImplementedError

    def _embedding_attribution(self, forward: Callable, calls: _EmbeddingCalls, ids: Tuple[torch.Tensor, ...],
                               target: Any, additional: Tuple[Any, ...]) -> Tuple[torch.Tensor, ...]:
        """Attribution at the embedding output of each id input, (B, S, D) each."""
        raise NotImplementedError

    def attribute(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
                  return_tokens: bool = False, forward_kwargs: Optional[dict] = None) -> TensorOrTuple:
        """Attribute ``target`` (default: the predicted class) to float inputs, or to token ids.

        Returns attributions shaped like float ``inputs``, or (B, S) scores for (B, S) token
        ids (``return_tokens`` is then implied; for float inputs it is refused, there are no
        tokens to read), a tuple of (B, S) and (B, T) scores for a seq2seq model's
        ``(input_ids, decoder_input_ids)``. A token-only target on per-position scores (a
        causal LM's) explains that token at each row's last real position (module docstring).
        """
        # The package's guarantees hold here too: one explanation of a module at a time, another
        # library's replaced class methods refused (they would change these gradients silently),
        # and compiled parts run as their originals (Captum's layer hooks never fire in compiled code).
        # A random or batch-dependent forward (training mode) is refused unless allow_stochastic=True;
        # tensors made under torch.inference_mode() are explained as ordinary copies.
        refuse_inference_mode()
        inputs, additional_forward_args, forward_kwargs = (ordinary_tensors(inputs), ordinary_tensors(
            additional_forward_args), ordinary_tensors(forward_kwargs))
        refuse_non_finite(inputs if isinstance(inputs, tuple) else (inputs,))  # NaN / inf: named, not a map of NaN
        with exclusive(self.model):
            check_library_classes(self.model)
            with uncompiled(self.model), watched(self.model, self.allow_stochastic):
                return self._attribute(inputs, target, additional_forward_args, return_tokens, forward_kwargs)

    def _attribute(self, inputs, target, additional_forward_args, return_tokens, forward_kwargs):
        formatted = inputs if isinstance(inputs, tuple) else (inputs,)
        if not formatted or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in formatted):
            raise InputError(f"inputs must be a tensor or a tuple of tensors with a batch dimension, got "
                             f"{type(inputs).__name__}.")
        _refuse_reversible_layers(self.model, type(self).__name__)
        batch = formatted[0].shape[0]
        token_ids = any(not t.is_floating_point() for t in formatted)
        if token_ids:
            _check_token_inputs(self.model, formatted)
        if not token_ids and return_tokens:
            raise InputError(f"{type(self).__name__} attributes float inputs element by element; "
                             "return_tokens=True needs token-id inputs (B, S). Sum the attributions over "
                             "the dimensions you want instead.")
        forward_kwargs = _without_in_place_cache(self.model, forward_kwargs)
        expanded, fixed = _split_kwargs(forward_kwargs, batch)
        call_model = get_adapter(self.model).call_model if token_ids and len(formatted) == 2 else None
        forward = _ScoresForward(self.model, tuple(expanded), fixed, len(formatted), call_model)
        additional = _as_tuple(additional_forward_args) + tuple(expanded.values())
        if not token_ids:
            if target is None:
                target = _predicted(forward, formatted, additional)
            with _target_named(forward, formatted, additional, target), _differentiable_forward(self.model):
                return self._input_result(forward, inputs, formatted, target, additional)
        given = [t for t in (*additional, *fixed.values()) if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        calls = _EmbeddingCalls.recorded(self.model, forward, formatted, additional, given)
        target = _explained_target(self.model, formatted, additional_forward_args, forward_kwargs, target, calls.scores)
        with _target_named(forward, formatted, additional, target), _differentiable_forward(self.model):
            return self._token_result(forward, calls, formatted, target, additional, forward_kwargs)

    def _input_result(self, forward, inputs, formatted, target, additional):
        attribution = self._input_attribution(forward, inputs, target, additional)
        detached = tuple(a.detach() for a in attribution) if isinstance(attribution, tuple) else None
        return finished(attribution.detach() if detached is None else detached, self.model, formatted[0].device)

    def _token_result(self, forward, calls, formatted, target, additional, forward_kwargs):
        per_dimension = self._embedding_attribution(forward, calls, formatted, target, additional)
        scores = []
        for attribution, name in zip(per_dimension, ("attention_mask", "decoder_attention_mask")):
            summed = attribution.detach().to(attribution_dtype(self.model)).sum(-1)  # summed in >= float32
            mask = (forward_kwargs or {}).get(name)
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == summed.shape[1]:
                # Set, not multiplied: a padded position's score is 0 by definition (IG: x - x' = 0 there;
                # Saliency: a masked token is read by no real one), and the model's own backward may hold
                # NaN there (Gemma 3n: the AltUp magnitude sqrt(mean(e**2)) of the all-zero [PAD] embedding
                # has an infinite derivative, times a zero gradient), which 0 * NaN would keep.
                summed = torch.where(mask.to(device=summed.device) != 0, summed, summed.new_zeros(()))
            scores.append(summed)
        return finished(scores[0] if len(scores) == 1 else tuple(scores), self.model, formatted[0].device)


class CaptumIntegratedGradients(_CaptumGradientBaseline):
    """Captum's Integrated Gradients (Sundararajan et al., ICML 2017), called like the package's
    methods; settings and baselines in the module docstring.

    Example::

        >>> maps = CaptumIntegratedGradients(vit).attribute(pixel_values, target=labels)
    """

    signed: bool = True  # (x - x') times an integrated gradient: either sign

    def __init__(self, model: nn.Module, n_steps: int = IG_STEPS, internal_batch_size: int = IG_INTERNAL_BATCH,
                 baseline_token_id: Optional[int] = None) -> None:
        super().__init__(model)
        if n_steps < 1 or internal_batch_size < 1:
            raise InputError(f"n_steps={n_steps}, internal_batch_size={internal_batch_size}: both must be positive.")
        self.n_steps, self.internal_batch_size = n_steps, internal_batch_size
        self.baseline_token_id = baseline_token_id

    def _input_attribution(self, forward, inputs, target, additional):
        _refuse_graph_batches(self.model)
        return IntegratedGradients(forward).attribute(
            inputs, target=target, additional_forward_args=additional or None, n_steps=self.n_steps,
            internal_batch_size=self.internal_batch_size)

    def _embedding_attribution(self, forward, calls, ids, target, additional):
        token = self._baseline_token()
        # No neutral token known: the all-zero embedding (Sundararajan et al.'s baseline for text).
        baselines = tuple(torch.zeros_like(embedded) if token is None else calls.embed(k, torch.full_like(t, token))
                          for k, (t, embedded) in enumerate(zip(ids, calls.embedded)))
        return IntegratedGradients(_EmbeddingsForward(forward, calls)).attribute(
            calls.embedded, baselines=baselines, target=target, additional_forward_args=(*ids, *additional),
            n_steps=self.n_steps, internal_batch_size=self.internal_batch_size)

    def _baseline_token(self) -> Optional[int]:
        """The baseline token id: ``baseline_token_id``, else ``config.pad_token_id``, else None
        (the all-zero embedding)."""
        if self.baseline_token_id is not None:
            return self.baseline_token_id
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        return None if pad is None else int(pad)


class CaptumSaliency(_CaptumGradientBaseline):
    """Captum's Saliency, ``|d y_t / d x|`` (Simonyan et al., 2014), called like the package's
    methods; for token ids summed over the embedding dimensions (module docstring).

    Example::

        >>> scores = CaptumSaliency(bert).attribute(input_ids, target=labels,
        ...                                         forward_kwargs={"attention_mask": mask})
    """

    signed: bool = False  # an absolute gradient: relevance with no direction

    def _input_attribution(self, forward, inputs, target, additional):
        # Inputs that require gradients, so that Captum does not warn on every call.
        leaves = (tuple(t.detach().requires_grad_() for t in inputs) if isinstance(inputs, tuple)
                  else inputs.detach().requires_grad_())
        return Saliency(forward).attribute(leaves, target=target, abs=True, additional_forward_args=additional or None)

    def _embedding_attribution(self, forward, calls, ids, target, additional):
        leaves = tuple(embedded.clone().requires_grad_() for embedded in calls.embedded)
        return Saliency(_EmbeddingsForward(forward, calls)).attribute(
            leaves, target=target, abs=True, additional_forward_args=(*ids, *additional))


def _refuse_graph_batches(model: nn.Module) -> None:
    """Captum's Integrated Gradients stacks its steps along the first dimension of the inputs,
    which for a PyG model is the node dimension: ``edge_index`` and ``batch`` would no longer
    match the nodes (PyG then fails with an error about indices, or worse, a map of mixed
    graphs). Refuse it in graph words instead."""
    for module in model.modules():
        if MESSAGE_PASSING in class_keys(module):
            raise InputError(f"integrated-gradients on {type(model).__name__}, a graph model ({type(module).__name__} "
                             "layers): Captum's Integrated Gradients stacks its steps along the node dimension, so "
                             "edge_index and batch would no longer match the nodes. Use 'saliency', the package's "
                             "methods (e.g. 'conservative-lrp', 'generic-attention') instead.")


def _as_tuple(value: Any) -> Tuple[Any, ...]:
    if value is None:
        return ()
    return value if isinstance(value, tuple) else (value,)


def _without_in_place_cache(model: nn.Module, forward_kwargs: Optional[dict]) -> Optional[dict]:
    """``forward_kwargs`` as the model's adapter, if any, says its scores have a gradient
    (:meth:`Adapter.gradient_forward_kwargs`); unchanged for a model no adapter knows."""
    adapter = registered_adapter(model)
    return forward_kwargs if adapter is None else adapter.gradient_forward_kwargs(model, forward_kwargs)


def _split_kwargs(forward_kwargs: Optional[dict], batch: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Per-example tensors (expanded by Captum with the inputs) and the rest (passed unchanged)."""
    expanded, fixed = {}, {}
    for name, value in (forward_kwargs or {}).items():
        rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None
        if rows == batch:
            expanded[name] = value
        elif rows in (None, 1):
            fixed[name] = value  # broadcasts over the batch (and over Integrated Gradients' steps)
        else:
            raise InputError(f"forward_kwargs[{name!r}] has batch size {rows} but the inputs have {batch}. "
                             "Pass one row per example (or one row for all).")
    return expanded, fixed


@contextlib.contextmanager
def _target_named(forward: Callable, inputs: Tuple[torch.Tensor, ...], additional: Tuple[Any, ...], target: Any):
    """Captum's assertion on a target that does not name one score per example (an int for a
    causal LM's (B, N, V) logits) as the package's ``InputError``, naming the output's shape
    (checked by one plain forward pass, only then)."""
    try:
        yield
    except AssertionError as error:
        if "Target not provided" not in str(error):
            raise
        with torch.no_grad():
            scores = forward(*inputs, *additional)
        select_targets(scores, target)  # raises the package's message for this shape
        raise InputError(f"target={target!r} does not name one score per example of the model's scores of shape "
                         f"{tuple(scores.shape)}; give one index per non-batch dimension.") from None


@contextlib.contextmanager
def _differentiable_forward(model: nn.Module):
    """Autograd's error on a forward pass that overwrote, in place, a tensor its own backward
    needs (RWKV's recurrent state with ``use_cache=True``) as the package's ``InputError``."""
    try:
        yield
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        raise InputError(
            f"{type(model).__name__}'s own forward pass overwrote in place a tensor that its backward pass needs, so "
            "no gradient of its score exists as called (autograd: one of the variables needed for gradient "
            "computation has been modified by an inplace operation). Models that update a recurrent state or cache "
            "in place compute a differentiable forward without it: pass forward_kwargs={'use_cache': False}."
        ) from error


def _predicted(forward: Callable, inputs: Tuple[torch.Tensor, ...], additional: Tuple[Any, ...]):
    """``None`` -> the arg-max class per example (the package's convention), one plain forward pass."""
    with torch.no_grad():
        return _predicted_class(forward(*inputs, *additional))


def _predicted_class(scores: torch.Tensor):
    """The arg-max class per example of (B, C) scores; None for one score per example."""
    if scores.dim() == 1:
        return None  # one score per example: nothing to choose
    if scores.dim() != 2:
        raise InputError(f"the model's scores have shape {tuple(scores.shape)}; target=None picks the arg-max "
                         "class of (batch, classes) scores. Pass an explicit Captum target.")
    return scores.argmax(-1)


def _explained_target(model: nn.Module, ids: Tuple[torch.Tensor, ...], additional_forward_args: Any,
                      forward_kwargs: Optional[dict], target: Any, scores: torch.Tensor) -> Any:
    """The Captum target for the model's ``scores``. Class scores (B, C): ``target``, or the
    arg-max class for None. Scores per position (B, S, V): a target naming every index is
    Captum's as given; one naming the token only (or None, the predicted token) is resolved by
    the adapter as the package's methods resolve it (:meth:`Adapter.scored_forward`, one plain
    pass): where the adapter reads the logits at one position per example (a causal LM's, or a
    seq2seq decoder's, last real token), the target becomes ``(that position, token)``."""
    if scores.dim() < 3:
        return _predicted_class(scores) if target is None else target
    short = ""
    if target is not None:
        try:
            select_targets(scores, target)
            return target  # one index per non-batch dimension: Captum's own form
        except InputError as error:
            short = f"{error} "
    adapter = None
    try:
        adapter = get_adapter(model)
        with torch.no_grad():
            streams, logits, _, index = adapter.scored_forward(model, ids, _as_tuple(additional_forward_args),
                                                               forward_kwargs, target, Recorder(CaptureSpec()))
    except (CaptureError, UnsupportedModelError) as error:
        known = adapter if adapter is not None else registered_adapter(model)
        positions = None if known is None else known.next_token_rows(model, ids, forward_kwargs)
        if positions is not None and scores.dim() == 3 and scores.shape[1] == ids[0].shape[1]:
            # A causal LM whose token mixing the adapter does not capture (Mamba, RWKV): its
            # next-token scores at each row's last real token, the target a token id there.
            at = scores[torch.arange(scores.shape[0], device=scores.device), positions.to(scores.device)]
            _, index = select_targets(at, target)
            return [(position, *row) for position, row in zip(positions.tolist(), index.tolist())]
        raise InputError(
            f"target={target!r} does not name a position of the model's scores of shape {tuple(scores.shape)}: "
            f"{short}The package's methods take the position from the adapter (a causal LM's last real token), "
            f"which refused {type(model).__name__}: {error} Pass one (position, token) target per example "
            "instead.") from error
    rows = [tuple(row) for row in index.tolist()]
    if logits.dim() != scores.dim() - 1:
        return rows  # the adapter read no position: its index names every dimension
    positions = streams.layouts[streams.explained[0]].query_rows
    if positions.shape[1] != 1:
        raise InputError(f"The adapter explains {positions.shape[1]} rows per example of the model's scores of shape "
                         f"{tuple(scores.shape)}; pass a (position, token) target per example.")
    return [(position, *row) for position, row in zip(positions[:, 0].tolist(), rows)]


def _check_token_inputs(model: nn.Module, inputs: Tuple[torch.Tensor, ...]) -> None:
    """Token ids: one (B, S) tensor, or a seq2seq model's ``(input_ids, decoder_input_ids)``."""
    shapes = [tuple(t.shape) for t in inputs]
    if any(t.is_floating_point() or t.dim() != 2 for t in inputs) or len(inputs) > 2:
        raise InputError(f"integer inputs of shapes {shapes}: token ids must be one (batch, sequence) tensor, or a "
                         "seq2seq model's (input_ids, decoder_input_ids); other model inputs go in "
                         "additional_forward_args or forward_kwargs; images must be float tensors.")
    if len(inputs) == 2:
        if not takes_decoder_inputs(model):
            raise InputError(f"two token-id inputs of shapes {shapes}, but {type(model).__name__}'s forward takes no "
                             "decoder_input_ids: two id tensors are a seq2seq model's (input_ids, "
                             "decoder_input_ids). Pass one (batch, sequence) tensor, other inputs in forward_kwargs.")


def _refuse_reversible_layers(model: nn.Module, method: str) -> None:
    """Reformer's reversible residual layers recompute their activations in a backward pass of
    their own, which HuggingFace runs only in training mode (it asserts ``model.train()``); in
    training mode the LSH attention hashes at random and dropout acts, so there is no
    deterministic forward whose gradient could be explained."""
    for module in model.modules():
        if type(module).__module__.startswith("transformers.models.reformer."):
            raise UnsupportedModelError(
                f"{method} on {type(model).__name__}: Reformer's reversible layers recompute their activations in a "
                "backward pass of their own that transformers runs only in training mode (model.train()), where its "
                "LSH attention hashes at random, so no gradient of the model's deterministic forward exists to "
                "attribute. Reformer is not supported by the gradient methods (nor by the attention methods, "
                "which observe no attention in it).")


def _input_embeddings(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    if not isinstance(embeddings, nn.Module):
        raise InputError(f"token-id inputs: gradient methods attribute at the input embeddings, but "
                         f"{type(model).__name__} has no get_input_embeddings() module (HF models do). Pass the "
                         "embeddings as float inputs, or give the model a get_input_embeddings() method.")
    return embeddings


__all__ = ["CaptumIntegratedGradients", "CaptumSaliency", "IG_STEPS", "IG_INTERNAL_BATCH", "model_logits"]
