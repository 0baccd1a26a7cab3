r"""Captum's Integrated Gradients and Saliency as benchmark rows, called like the package's methods.

Users compare the attention methods against Captum's own gradient attributions, so the
catalog carries them under ``integrated-gradients`` and ``saliency``. These shells only adapt
the call: ``attribute(inputs, target, additional_forward_args, forward_kwargs, return_tokens)``
as :class:`~captum_transformers.methods.base.TraceAttribution` takes it; the attribution
itself is Captum's.

* Float inputs (pixels, or embeddings): Captum's ``IntegratedGradients`` / ``Saliency`` on the
  inputs; attributions have the shape of the inputs (images: per pixel and channel).
* Token ids, (B, S) integers: the same at the output of ``model.get_input_embeddings()``
  (what Captum's ``LayerIntegratedGradients`` / ``LayerGradientXActivation`` without the
  activation factor compute), summed over the hidden size: (B, S) token scores, zero where
  ``forward_kwargs["attention_mask"]`` is 0. The embedding output is replaced through a hook
  that acts in the explaining thread only (Captum's layer hooks would act in every thread).

Integrated Gradients (Sundararajan, Taly and Yan, "Axiomatic Attribution for Deep Networks",
ICML 2017), for a baseline :math:`x'`:

.. math:: \mathrm{IG}_i(x) = (x_i - x'_i) \int_0^1
          \frac{\partial y_t(x' + \alpha (x - x'))}{\partial x_i}\, d\alpha

Settings: ``n_steps=50`` Gauss-Legendre points (Captum's default); ``internal_batch_size=256``
interpolated rows per forward pass (memory bound; the result does not depend on it beyond
float rounding); baseline: zeros of the model input for float inputs (Captum's default; for
normalised images that is the mean colour, not black), and for token ids the model's
``config.pad_token_id`` at every position (the embedding of [PAD], as Captum's BERT
tutorial), so padded positions, which hold that id, have :math:`x - x' = 0`.

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

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from captum.attr import Attribution, IntegratedGradients, Saliency
from torch import nn

from ..compat.foreign_patches import check_library_classes
from ..adapters.graph.refusal import MESSAGE_PASSING, class_keys
from ..model_state import patching
from ..compat.compiled import uncompiled
from ..model_state.exclusive import exclusive
from ..capture.targets import output_scores, select_targets
from ..errors import InputError
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
    """``model(*positional, **forward_kwargs)`` as scores, the per-example keyword tensors
    arriving positionally (last) so that Captum expands them with the inputs."""

    def __init__(self, model: nn.Module, expanded_names: Tuple[str, ...], fixed: Dict[str, Any]) -> None:
        self.model, self.expanded_names, self.fixed = model, expanded_names, fixed

    def __call__(self, *args: Any) -> torch.Tensor:
        split = len(args) - len(self.expanded_names)
        kwargs = dict(self.fixed, **dict(zip(self.expanded_names, args[split:])))
        return model_logits(self.model(*args[:split], **kwargs))


def _embed(embeddings: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return embeddings(ids).detach()


class _EmbeddingsForward:
    """Scores of ``forward(ids, *rest)`` with the input-embedding module's output replaced by
    ``embedded``, so Captum differentiates at the embeddings (as its layer methods do) while
    the replacement acts in this thread only: Captum's own layer hooks are process-wide and
    would change a plain forward of the same model running in another thread."""

    def __init__(self, forward: Callable, embeddings: nn.Module) -> None:
        self.forward, self.embeddings = forward, embeddings

    def __call__(self, embedded: torch.Tensor, ids: torch.Tensor, *rest: Any) -> torch.Tensor:
        with patching.forward_hook(self.embeddings, lambda module, args, output: embedded):
            return self.forward(ids, *rest)


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

    def _embedding_attribution(self, forward: Callable, embeddings: nn.Module, ids: torch.Tensor, target: Any,
                               additional: Tuple[Any, ...]) -> torch.Tensor:
        """Attribution at the embedding output, (B, S, D)."""
        raise NotImplementedError

    def attribute(self, inputs: TensorOrTuple, target: Any = None, additional_forward_args: Any = None,
                  return_tokens: bool = False, forward_kwargs: Optional[dict] = None) -> TensorOrTuple:
        """Attribute ``target`` (default: the predicted class) to float inputs, or to token ids.

        Returns attributions shaped like float ``inputs``, or (B, S) scores for (B, S) token
        ids (``return_tokens`` is then implied; for float inputs it is refused, there are no
        tokens to read).
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
        batch = formatted[0].shape[0]
        token_ids = any(not t.is_floating_point() for t in formatted)
        if token_ids and (len(formatted) != 1 or formatted[0].dim() != 2):
            raise InputError(f"integer inputs of shapes {[tuple(t.shape) for t in formatted]}: token ids must be one "
                             "(batch, sequence) tensor, other model inputs go in additional_forward_args or "
                             "forward_kwargs; images must be float tensors.")
        if not token_ids and return_tokens:
            raise InputError(f"{type(self).__name__} attributes float inputs element by element; "
                             "return_tokens=True needs token-id inputs (B, S). Sum the attributions over "
                             "the dimensions you want instead.")
        embeddings = _input_embeddings(self.model) if token_ids else None
        expanded, fixed = _split_kwargs(forward_kwargs, batch)
        forward = _ScoresForward(self.model, tuple(expanded), fixed)
        additional = _as_tuple(additional_forward_args) + tuple(expanded.values())
        if target is None:
            target = _predicted(forward, formatted, additional)
        with _target_named(forward, formatted, additional, target):
            return self._attributed(forward, inputs, formatted, embeddings, target, additional, forward_kwargs)

    def _attributed(self, forward, inputs, formatted, embeddings, target, additional, forward_kwargs):
        if embeddings is None:
            attribution = self._input_attribution(forward, inputs, target, additional)
            detached = tuple(a.detach() for a in attribution) if isinstance(attribution, tuple) else None
            return finished(attribution.detach() if detached is None else detached, self.model, formatted[0].device)
        per_dimension = self._embedding_attribution(forward, embeddings, formatted[0], target, additional)
        scores = per_dimension.detach().to(attribution_dtype(self.model)).sum(-1)  # summed in >= float32
        mask = (forward_kwargs or {}).get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == scores.shape[1]:
            scores = scores * mask.to(device=scores.device, dtype=scores.dtype)  # (B, S) or one (1, S) row for all
        return finished(scores, self.model, formatted[0].device)


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

    def _embedding_attribution(self, forward, embeddings, ids, target, additional):
        embedded, baseline = _embed(embeddings, ids), _embed(embeddings, torch.full_like(ids, self._baseline_token()))
        return IntegratedGradients(_EmbeddingsForward(forward, embeddings)).attribute(
            embedded, baselines=baseline, target=target, additional_forward_args=(ids, *additional),
            n_steps=self.n_steps, internal_batch_size=self.internal_batch_size)

    def _baseline_token(self) -> int:
        if self.baseline_token_id is not None:
            return self.baseline_token_id
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if pad is None:
            raise InputError(f"{type(self.model).__name__} has no config.pad_token_id, the default baseline token of "
                             "Integrated Gradients on token ids. Pass CaptumIntegratedGradients(model, "
                             "baseline_token_id=ID) with the id of a neutral token (e.g. the tokenizer's pad or "
                             "unk id).")
        return int(pad)


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

    def _embedding_attribution(self, forward, embeddings, ids, target, additional):
        return Saliency(_EmbeddingsForward(forward, embeddings)).attribute(
            _embed(embeddings, ids).requires_grad_(), target=target, abs=True, additional_forward_args=(ids, *additional))


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


def _predicted(forward: Callable, inputs: Tuple[torch.Tensor, ...], additional: Tuple[Any, ...]):
    """``None`` -> the arg-max class per example (the package's convention), one plain forward pass."""
    with torch.no_grad():
        scores = forward(*inputs, *additional)
    if scores.dim() == 1:
        return None  # one score per example: nothing to choose
    if scores.dim() != 2:
        raise InputError(f"the model's scores have shape {tuple(scores.shape)}; target=None picks the arg-max "
                         "class of (batch, classes) scores. Pass an explicit Captum target.")
    return scores.argmax(-1)


def _input_embeddings(model: nn.Module) -> nn.Module:
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    if not isinstance(embeddings, nn.Module):
        raise InputError(f"token-id inputs: gradient methods attribute at the input embeddings, but "
                         f"{type(model).__name__} has no get_input_embeddings() module (HF models do). Pass the "
                         "embeddings as float inputs, or give the model a get_input_embeddings() method.")
    return embeddings


__all__ = ["CaptumIntegratedGradients", "CaptumSaliency", "IG_STEPS", "IG_INTERNAL_BATCH", "model_logits"]
