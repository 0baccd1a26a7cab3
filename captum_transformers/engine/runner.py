"""The pass runner: the one loop that runs a capture, for a classifier's batch and for
each explained group of a generation.

An adapter knows a family of models (its blocks, capture, rule contexts, layouts, logits and
:meth:`~captum_transformers.adapters.base.Adapter.captured_forward`); the runner runs the
passes of an explanation over it, always in this order:

1. the adapter's own refusals (:meth:`Adapter.refuse_trace` / :meth:`Adapter.refuse_relevance`;
   a trace then takes the adapter's spec, :meth:`Adapter.trace_spec`, and runs inside its
   :meth:`Adapter.trace_context`), then the batch's (:func:`explained_arguments`: inference
   mode, an empty batch, integer pixels, non-finite values; rules the model's precision cannot
   follow; a plain pass the rules' graph cannot take), the arguments made ordinary tensors, and
   the inputs made relevance-carrying leaves (where relevance is read at the inputs: the
   adapter's :meth:`Adapter.relevance_reading`);
2. the passes held (:func:`passes_held`): the model held by this thread, gradients on for a
   pass that takes them (off otherwise), the parameters requiring grad, and a switchable
   backward pass when the plain gradient follows the rules' pass through the same graph;
3. the forward pass under the capture, the propagation rules and the taps of the tensors
   relevance is read at;
4. per explained group (a batch has one; a generation one per explained step or span), the
   backward pass(es): under the rules, seeded with the explained score, reduced by the spec;
   then, with a ``plain_spec``, the plain gradient through the same graph
   (:func:`backward_passes`, each pass :func:`backward_to_maps`); relevance passes take
   the gradient at the tapped tensors instead (:func:`relevance_gradients`);
5. the result: an :class:`AttentionTrace` (:func:`traced`; the adapter's default explained
   rows, when the user chose none, checked against the rows the score reads), or a relevance result (read by
   the adapter's reading, finished by :meth:`Adapter.finish_relevance`).

:func:`run_trace` and :func:`run_relevance` run one batch; the generation engine
(:mod:`captum_transformers.generation.engine`) runs one forward over prompt + generated tokens
and loops steps 4-5 over its explained groups with the same functions.

Example::

    >>> trace = run_trace(adapter, model, (ids,), (), None, spec, {"attention_mask": mask})
    >>> result = run_relevance(adapter, model, (ids,), (), None, RuleSet.ATTN_LRP)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..adapters.base import Adapter
from ..adapters.input_checks import model_dtype, ordinary_tensors, refuse_unexplainable_batch, relevance_carrying
from ..adapters.query_rows import ReadRows
from ..adapters.relevance_reading import RelevanceResult, seeded
from ..capture.recorder import Recorder
from ..capture.trace import AttentionRecord, AttentionTrace, CaptureSpec, StreamLayouts, TokenLayout
from ..errors import CaptureError, InputError
from ..model_state import patching
from ..model_state.exclusive import exclusive
from ..propagation.backward_switch import BackwardSwitch, switchable_backward
from ..propagation.rules.normalized_add import NormalizedAdd
from ..propagation.rules.rule_set import RuleSet, refuse_rounding_sensitive


def explained_arguments(model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                        forward_kwargs: Optional[dict], rules: Optional[RuleSet]) -> Tuple[Tuple[Any, ...], Any]:
    """The refusals every explanation meets first (the batch, then the rules in the model's
    precision), and the additional and keyword arguments with inference tensors made ordinary."""
    refuse_unexplainable_batch(inputs)
    refuse_rounding_sensitive(rules, model_dtype(model))
    return ordinary_tensors(tuple(additional_forward_args)), ordinary_tensors(forward_kwargs)


@contextlib.contextmanager
def passes_held(model: nn.Module, needs_gradient: bool = True,
                switchable: bool = False) -> Iterator[Optional[BackwardSwitch]]:
    """The state the passes run in: ``model`` held by this thread (before any flag below
    changes), gradients on (off when no pass takes one), the parameters requiring grad (the
    trainable model's graph) and, if ``switchable``, a backward pass whose rule Functions can
    be switched to plain gradients; yields the switch (None when not switchable)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(exclusive(model))
        stack.enter_context(torch.enable_grad() if needs_gradient else torch.no_grad())
        if needs_gradient:
            stack.enter_context(patching.parameters_require_grad(model))
        yield stack.enter_context(switchable_backward()) if switchable else None


@dataclasses.dataclass
class Capture:
    """A capture being run: the inputs and arguments as the forward takes them, the recorder,
    the backward switch (None without a plain pass) and the contexts the forward enters (the
    propagation rules)."""

    inputs: Tuple[torch.Tensor, ...]
    additional: Tuple[Any, ...]
    forward_kwargs: Any
    recorder: Recorder
    switch: Optional[BackwardSwitch]
    contexts: List[ContextManager[None]]


@contextlib.contextmanager
def captured_passes(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                    additional_forward_args: Sequence[Any], forward_kwargs: Optional[dict], spec: CaptureSpec,
                    rules: Optional[RuleSet] = None, plain_spec: Optional[CaptureSpec] = None,
                    keep_maps: bool = False) -> Iterator[Capture]:
    """Steps 1-2 of a trace (see the module docstring), held while the caller runs the forward
    and the backward passes. ``keep_maps``: every map is kept for a later backward pass through
    the same graph (several explained groups); with a ``plain_spec`` they are kept anyway."""
    additional, forward_kwargs = explained_arguments(model, inputs, additional_forward_args, forward_kwargs, rules)
    if plain_spec is not None and (rules is None or rules.attention_gate != "gradient"):
        raise InputError(
            f"A plain-gradient second pass needs rules whose graph keeps the attention gate (got {rules!r}); "
            "run two traces instead."
        )
    inputs = relevance_carrying(inputs)
    recorder = Recorder(spec)
    recorder.keep_probs = keep_maps or plain_spec is not None
    with passes_held(model, spec.needs_gradient, plain_spec is not None) as switch:
        contexts = [adapter.propagation(model, rules)] if rules is not None else []
        yield Capture(inputs, additional, forward_kwargs, recorder, switch, contexts)


def _mixes_examples(shape: Tuple[int, ...], batch_dim: Optional[int], batch: int) -> bool:
    """Whether a normalised add over operands of ``shape``, normalised along ``batch_dim`` (None:
    the whole tensor one example), sums over several of ``batch`` examples: its first axis holds
    a whole number (> 1) of rows per example (a (B, N, D) tensor flattened to (B * N, D), heads
    folded into the batch) and no axis was read as the examples'."""
    if len(shape) == 0 or shape[0] <= batch or shape[0] % batch:
        return False
    return batch_dim is None or (batch_dim != 0 and len(shape) == 2)


def refuse_batch_mixing_adds(scores: torch.Tensor, rules: Optional[RuleSet]) -> None:
    """:class:`CaptureError` when the graph of ``scores`` (B,) holds a normalised add (Chefer et al.'s
    rule, ``add="normalized"``) that normalises the relevance of several examples together.

    The rule divides each operand's relevance by sums over its example: along the axis of batch
    size, or, where the model flattened its (B, N, D) hidden states to (B * N, D) rows (OPT's
    decoder layers around their feed-forward block; MoE experts' selected rows), by the example of
    each row, which the rule mode follows through reshapes, row-wise operations and row selections
    (:class:`~captum_transformers.propagation.rules.normalized_add.ExampleRows`). An add whose rows
    it could not attribute to examples (token-major rows after a transpose) would sum over the
    whole batch, so each example's map would depend on the others: refused. Checked before the
    backward pass, by walking the graph; a batch of one and rules with plain adds are never refused."""
    if rules is None or rules.add != "normalized" or scores.dim() == 0 or scores.shape[0] < 2 \
            or scores.grad_fn is None:
        return
    batch = scores.shape[0]
    seen = set()
    stack = [scores.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))  # the graph (held by scores) keeps every node alive: ids stay unique
        if getattr(type(node), "_forward_cls", None) is NormalizedAdd and getattr(node, "groups", None) is None:
            shape = tuple(getattr(node, "second_shape", ()))
            if _mixes_examples(shape, getattr(node, "batch_dim", None), batch):
                raise CaptureError(
                    f"The normalised add rule of {rules.name} (TransformerRelevance's default) divides relevance by "
                    f"sums over each example, but the model adds tensors of shape {shape}, whose {shape[0]} rows hold "
                    f"the tokens of all {batch} examples of the batch in an order the rule could not attribute to "
                    "examples (rows of (batch, tokens, features) hidden states after a transpose or another "
                    "reshuffle), so each example's normalisation would mix the others' and its map would depend on "
                    "the batch. Explain "
                    "one example at a time (a batch of one), or use rules with plain adds (AttnLRP, ConservativeLRP, "
                    "GenericAttention)."
                )
        stack.extend(next_node for next_node, _ in node.next_functions)


def backward_to_maps(recorder: Recorder, scores: torch.Tensor, retain_graph: bool = False) -> None:
    """One backward pass from ``scores`` (B,) to the recorded attention maps, each reduced by
    the recorder's spec as its gradient arrives; a map the scores do not reach is reduced
    with a zero gradient. Every map (or, with ``spec.backward_blocks != "all"``, the last of
    each pair of streams) must be in the graph, and some gradient must reach one."""
    sites = recorder.sites if recorder.spec.backward_blocks == "all" else recorder.last_per_streams()
    for site in sites:
        if not site.requires_grad or not recorder.anchors:
            raise CaptureError(
                f"The attention of block {site.block.name!r} does not require grad, so its gradient cannot be "
                "taken. Make the model's parameters or the inputs require grad, or use the adapter's capture."
            )
        recorder.hook(site)
    if not scores.requires_grad:
        raise CaptureError(
            "The explained output does not depend on any observed attention (it does not require grad)."
        )
    torch.autograd.grad(scores.sum(), inputs=list(recorder.anchors.values()), allow_unused=True,
                        retain_graph=retain_graph)
    if not any(s.received_gradient for s in sites):
        raise CaptureError(
            "No gradient reached any observed attention map: the explained output does not depend on the "
            "attention the adapter captured."
        )
    for site in sites:
        if not site.received_gradient:
            recorder.zero_gradient(site)  # not connected: the gradient is zero


def backward_passes(capture: Capture, scores: torch.Tensor, rules: Optional[RuleSet], spec: CaptureSpec,
                    plain_spec: Optional[CaptureSpec] = None, keep_graph: bool = False) -> None:
    """The backward pass(es) of one explained group: under the rules, seeded with ``scores``
    and reduced by ``spec``; then, with a ``plain_spec``, the plain gradient of ``scores``
    through the same graph (every rule switched off), reduced by ``plain_spec``, the two
    reduced as a pair. ``keep_graph``: a later group's passes go through the same graph."""
    refuse_batch_mixing_adds(scores, rules)
    recorder = capture.recorder
    paired = plain_spec is not None
    recorder.begin_pass(spec, None, keep_probs=keep_graph or paired, pair_first=paired)
    backward_to_maps(recorder, seeded(scores, rules), retain_graph=keep_graph or capture.switch is not None)
    if capture.switch is not None:
        recorder.begin_pass(plain_spec, spec, keep_probs=keep_graph)
        with capture.switch.plain_gradient():
            backward_to_maps(recorder, scores, retain_graph=keep_graph)


def traced(recorder: Recorder, layout: TokenLayout, logits: torch.Tensor, target: torch.Tensor,
           streams: StreamLayouts, row_stream: Any = None) -> AttentionTrace:
    """The trace of the last backward pass: the recorder's sites as records (on the explained
    rows' device), with the (detached) logits, the target index and the layouts."""
    records = AttentionRecord.of_sites(recorder.sites, layout.query_rows.device)
    return AttentionTrace(records, layout, logits, target, streams, row_stream=row_stream)


def run_trace(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
              additional_forward_args: Sequence[Any], target: Any, spec: CaptureSpec,
              forward_kwargs: Optional[dict] = None, rules: Optional[RuleSet] = None,
              plain_spec: Optional[CaptureSpec] = None) -> AttentionTrace:
    """One forward (and, if ``spec`` needs gradients, one backward) pass over a batch.

    With ``rules`` the backward pass follows those propagation rules, so the backward
    reduction sees LRP-modified gradients (relevance = probs * gradient).

    With ``rules`` and ``plain_spec`` too, the same graph is differentiated a second time
    with plain gradients (every rule Function switched to its operation's own gradient, the
    explained logit as seed), reduced by ``plain_spec``: one forward, two backward passes.
    ``spec`` reduces the first, ``plain_spec`` the second; the trace holds the second's
    values. Only for rules whose forward graph is the plain one (no detached attention gate).
    """
    adapter.refuse_trace(model, inputs, additional_forward_args, forward_kwargs, rules)
    spec, plain_spec = adapter.trace_spec(spec, inputs), adapter.trace_spec(plain_spec, inputs)
    with adapter.trace_context(model):
        with captured_passes(adapter, model, inputs, additional_forward_args, forward_kwargs, spec, rules,
                             plain_spec) as capture:
            recorder, contexts = capture.recorder, list(capture.contexts)
            # The rows the score reads are checked where a gradient is taken anyway.
            read_rows = ReadRows() if spec.needs_gradient and adapter.query_rows_choice is None else None
            if read_rows is not None:
                contexts.append(read_rows.watch(b.module for b in adapter.blocks(model) if b.kind == "self"))
            streams, logits, scores, index = adapter.scored_forward(model, capture.inputs, capture.additional,
                                                                    capture.forward_kwargs, target, recorder,
                                                                    contexts)
            if spec.needs_gradient:
                recorder.streams = streams  # a row stream (spec.row_stream) starts from the explained rows
                if read_rows is not None:
                    read_rows.listen()
                backward_passes(capture, scores, rules, spec, plain_spec)
        explained = streams.layouts[streams.explained[0]]
        if read_rows is not None and streams.is_single:
            read_rows.refuse_unexplained(explained.num_tokens, explained.query_rows, explained.query_weights,
                                         explained.token_mask, adapter.query_rows_hint())
        return traced(recorder, explained, logits.detach(), index, streams)


@contextlib.contextmanager
def relevance_passes(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...], rules: RuleSet,
                     reading: Any) -> Iterator[Tuple[Tuple[torch.Tensor, ...], List[ContextManager[None]]]]:
    """Step 2 of a relevance pass, held while the caller runs the forward and the backward
    pass(es): yields the inputs as the forward takes them (``reading.carrying``) and the
    contexts it enters (the propagation rules, then ``reading``'s taps)."""
    with passes_held(model):
        contexts = [adapter.propagation(model, rules)]
        inputs = reading.carrying(inputs)
        contexts.extend(reading.contexts())
        yield inputs, contexts


def relevance_gradients(scores: torch.Tensor, rules: RuleSet, leaves: Sequence[torch.Tensor],
                        retain_graph: bool = False, what: str = "output") -> Tuple[torch.Tensor, tuple]:
    """The explained ``scores`` seeded for ``rules`` (:func:`seeded`) and their gradient at
    ``leaves`` (None where unreached); ``what`` names the scores in the refusal of scores
    that do not depend on the inputs."""
    if not scores.requires_grad:
        raise CaptureError(f"The explained {what} does not depend on the inputs (it does not require grad).")
    refuse_batch_mixing_adds(scores, rules)
    explained = seeded(scores, rules)
    return explained, torch.autograd.grad(explained.sum(), list(leaves), allow_unused=True,
                                          retain_graph=retain_graph)


def run_relevance(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                  additional_forward_args: Sequence[Any], target: Any, rules: RuleSet, at: str = "tokens",
                  forward_kwargs: Optional[dict] = None, messages: Optional[list] = None) -> RelevanceResult:
    """One forward and one backward pass of Gradient x Input under ``rules``.

    ``at="tokens"``: relevance of the hidden states entering the first layer of each
    stream (:meth:`Adapter.first_layers`), summed over the hidden size, (B, N) per stream.
    ``at="inputs"``: ``x * dy/dx`` for every floating-point input. Where exactly is the
    adapter's (:meth:`Adapter.relevance_reading`: a graph's node features for the PyG
    adapters, which alone take ``messages``, a list receiving each message's relevance).
    """
    with exclusive(model):  # held from the start: every question about the modules reads one walk
        adapter.refuse_relevance(model, inputs, additional_forward_args, forward_kwargs, rules)
        additional, forward_kwargs = explained_arguments(model, inputs, additional_forward_args, forward_kwargs,
                                                         rules)
        if at not in ("tokens", "inputs"):
            raise InputError(f"relevance must be read at 'tokens' or 'inputs', got {at!r}.")
        reading = adapter.relevance_reading(model, at, messages)
        with relevance_passes(adapter, model, inputs, rules, reading) as (inputs, contexts):
            streams, _, scores, index = adapter.scored_forward(model, inputs, additional, forward_kwargs, target,
                                                               Recorder(CaptureSpec()), contexts)
            leaves = reading.leaves(streams, inputs)
            explained, grads = relevance_gradients(scores, rules, leaves)
        result = reading.result(streams, inputs, grads, explained.detach(), index)
    return adapter.finish_relevance(model, result)
