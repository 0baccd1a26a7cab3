"""One forward pass, then one backward pass per explained generation step.

A method's classifier path runs its :class:`~captum_transformers.engine.pass_plan.PassPlan`
once per batch. Here the plan's forward pass runs once over prompt + generated tokens (the
language-model head computed only at the explained positions: at a 32k vocabulary it costs
more than the layers), and for each explained step (or span of steps) the plan's backward
pass(es) run through the same graph, seeded with that step's score. The recorder reduces each
map as its gradient arrives, and the step's :class:`AttentionTrace` (the same records, the
explained row moved to the step's position) is handed to the method's own reduction before
the next step starts: every method is reused as it is, with no per-step forward.

Because the model is causal, nothing after position ``P + t - 1`` reaches step ``t``'s score,
so each step's maps and relevance equal those of a separate call on the prefix (the tests
check it to 1e-10 in float64).

The passes are the pass runner's (:mod:`captum_transformers.engine.runner`: the same refusals,
held state, backward passes and relevance reading as a classifier's batch); what is added here
is the generation's: the logits kept at the explained positions, the causal check, and the loop
over explained groups, each with its score and its layouts.

Example::

    >>> trace_steps(adapter, model, (ids,), (), {"attention_mask": mask}, steps, plan, on_step)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..adapters.base import Adapter
from ..adapters.huggingface.kept_logits import KeptLogitPositions, forward_signature
from ..adapters.relevance_reading import input_times_gradient
from ..capture.recorder import Recorder
from ..capture.trace import CaptureSpec, StreamLayouts
from ..errors import CaptureError
from ..engine.pass_plan import PassPlan
from ..engine.runner import backward_passes, captured_passes, explained_arguments, relevance_gradients, \
    relevance_passes, traced
from ..propagation.rules.rule_set import RuleSet
from .steps import ExplainedSteps, group_scores

#: Called with (group index, the group's trace) for trace methods, or (group index, token
#: relevance per stream (B, N)) for relevance methods, before the next group is explained.
OnStep = Callable[[int, Any], None]


@dataclasses.dataclass
class StepLogits:
    """What the forward pass gave: the explained positions' logits (B, T, V), detached, the
    streams' layouts, and ``sink_share`` (B, T): per explained position the probability its query
    put on the attention-sink slot, averaged over heads and layers (:func:`sink_share`), or None."""

    logits: torch.Tensor
    streams: StreamLayouts
    sink_share: Optional[torch.Tensor] = None


def has_sink_slot(module: nn.Module) -> bool:
    """Whether an attention module passes learned sink logits to its kernel: a ``sinks`` tensor,
    the attribute every model of :mod:`~captum_transformers.propagation.attention.sinks` keeps them
    under (GPT-OSS, DeepSeek-V4, MiMo-V2-Flash's sliding layers, HunYuan-V4, Flint, Granite SWA...)."""
    return isinstance(getattr(module, "sinks", None), torch.Tensor)


def sink_share(recorder: Recorder, streams: StreamLayouts) -> Optional[torch.Tensor]:
    """(B, T): at each watched position (:meth:`Recorder.watch_rows`, the explained positions), the
    mean over the explained stream's self-attention calls and their heads of ``p_sink = 1 - sum_k
    A_qk``; calls of layers without a sink slot count 0. None where no call has a sink slot, or where
    a sink call's map was never made at those rows (AttentionGradCAM's streamed maps, whose backward
    recomputes only the last layer's)."""
    explained = streams.explained[0]
    own = [s for s in recorder.sites if streams.is_single or s.streams == (explained, explained)]
    if not any(has_sink_slot(s.block.module) for s in own):
        return None
    shares = []
    for site in own:
        if not has_sink_slot(site.block.module):
            shares.append(None)
            continue
        entry = recorder.row_sums.get(site.call_index)
        if entry is None or not bool(entry[1].all()):
            return None
        shares.append((1 - entry[0]).mean(1).cpu())  # (B, T)
    reference = next(s for s in shares if s is not None)
    return torch.stack([torch.zeros_like(reference) if s is None else s for s in shares]).mean(0)


def kept_positions(model: nn.Module, positions: torch.Tensor) -> Any:
    """``logits_to_keep`` for the explained positions when the model takes it, else ``"all"``."""
    signature = forward_signature(type(model))
    if signature is None or "logits_to_keep" not in signature.parameters:
        return "all"
    listed = tuple(sorted({int(p) for p in positions.tolist()}))
    return KeptLogitPositions(torch.tensor(listed, dtype=torch.long), listed)  # CPU: any device accepts it


def _step_logits(adapter: Adapter, model: nn.Module, output: Any, kept: Optional[KeptLogitPositions],
                 positions: torch.Tensor, streams: StreamLayouts) -> torch.Tensor:
    """The logits (B, T, V) at the explained positions, with their graph."""
    logits = adapter.logits(model, output, streams.layouts[streams.explained[0]], False)
    if logits.dim() != 3:
        raise CaptureError(
            f"{type(model).__name__} returned scores of shape {tuple(logits.shape)}; explaining generated tokens needs "
            "next-token logits per position (batch, positions, vocabulary), as a causal or seq2seq LM returns."
        )
    if kept is not None:
        index = {position: i for i, position in enumerate(kept.positions)}
        rows = torch.tensor([index[int(p)] for p in positions.tolist()], device=logits.device)
    else:
        rows = positions.to(logits.device)
    return logits.index_select(1, rows)


def _step_streams(streams: StreamLayouts, position: int) -> StreamLayouts:
    """The layouts with the explained stream's row moved to ``position`` for every example, and
    the tokens after it masked as padding: the step's prefix call never saw them, and a
    reduction that reads other rows than the explained one (rollout's ``(R^{qq})^T`` between
    streams, Chefer et al. Eq. 12) would otherwise count their attention."""
    name = streams.explained[0]
    layout = streams.layouts[name]
    batch, device = layout.query_rows.shape[0], layout.query_rows.device
    rows = torch.full((batch, 1), position, dtype=torch.long, device=device)
    prefix = (torch.arange(layout.num_tokens, device=device) <= position)[None].expand(batch, -1)
    mask = prefix if layout.token_mask is None else layout.token_mask.to(torch.bool) & prefix
    moved = dataclasses.replace(layout, query_rows=rows, query_weights=None, token_mask=mask)
    return StreamLayouts({**streams.layouts, name: moved}, streams.explained, streams.inputs)


def _refuse_non_causal(recorder: Recorder, streams: StreamLayouts) -> None:
    """The explained stream's self-attention must be causal. Other streams may attend freely:
    a seq2seq encoder or a vision tower reads no generated token (the tower's rows feed the
    decoder's image tokens, which sit in the prompt)."""
    explained = streams.explained[0]
    own = [s for s in recorder.sites if s.streams == (explained, explained)] if not streams.is_single else \
        list(recorder.sites)
    if not own or not all(s.causal for s in own):
        raise CaptureError(
            "The explained stream's attention is not causal, so one forward pass over prompt + generated tokens would "
            "let later tokens change earlier scores: explaining generated tokens needs a causal decoder (a causal LM, "
            f"the decoder of a seq2seq model, or a vision-language decoder). Streams seen: {sorted(streams.layouts)}."
        )


def _steps_forward(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional: Sequence[Any],
                   forward_kwargs: Any, recorder: Recorder, contexts: Sequence[Any],
                   steps: ExplainedSteps) -> Tuple[StreamLayouts, torch.Tensor]:
    """The one forward pass over prompt + generated tokens (the head only at the explained
    positions where the model allows it), its causality checked: ``(streams, logits (B, T, V))``.
    The recorder keeps the maps' sums over keys at the explained positions (:func:`sink_share`)."""
    recorder.watch_rows(steps.positions, lambda block: has_sink_slot(block.module))
    streams, output, kept = adapter.captured_forward(model, inputs, additional, forward_kwargs, recorder, contexts,
                                                     keep_logits=kept_positions(model, steps.positions))
    _refuse_non_causal(recorder, streams)
    return streams, _step_logits(adapter, model, output, kept, steps.positions, streams)


def streamed_pass_plan(method: Any, inputs: Tuple[torch.Tensor, ...], forward_kwargs: Optional[dict]) -> PassPlan:
    """``method``'s pass plan with the row stream its ``attribute`` would use (each explained group
    then folds its maps into a fresh copy: :meth:`RowStream.fresh`, no per-layer map kept); a
    replay (rollout, raw attention: one explained row per forward pass) is left out."""
    call = method._per_thread()
    call.streaming_rows = True
    try:
        plan = method.pass_plan(inputs, (), forward_kwargs)
    finally:
        call.streaming_rows = False
    if getattr(plan.spec, "replay", None) is not None:
        plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, replay=None))
    return plan


def trace_steps(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional: Sequence[Any],
                forward_kwargs: Optional[dict], steps: ExplainedSteps, plan: PassPlan, on_step: OnStep) -> StepLogits:
    """Run ``plan`` for every explained group of ``steps`` from one forward pass.

    ``on_step(g, trace)`` receives group ``g``'s :class:`AttentionTrace` (its records are
    overwritten by the next group's backward pass: reduce it there). A plan with a second,
    separate trace (``plan.then``: a detached attention gate) is refused; its single calls
    need two forward passes per step.
    """
    if plan.then is not None:
        raise CaptureError(
            "This method's rules detach the attention gate, so its plain gradient needs a forward pass of its own for "
            "every explained token; use rules whose attention gate is 'gradient' (the default) for generation."
        )
    spec, plain_spec = plan.spec, plan.plain_spec
    groups = steps.explained_groups
    # Every step's backward pass goes through the same graph: the maps are kept.
    with captured_passes(adapter, model, inputs, additional, forward_kwargs, spec, plan.rules, plain_spec,
                         keep_maps=True) as capture:
        recorder = capture.recorder
        streams, logits = _steps_forward(adapter, model, capture.inputs, capture.additional, capture.forward_kwargs,
                                         recorder, capture.contexts, steps)
        for g, group in enumerate(groups):
            last = g == len(groups) - 1
            step_streams = _step_streams(streams, int(steps.positions[group[-1]]))
            # A method that streams its rows folds each group's maps into a stream of its own.
            stream = None if spec.row_stream is None else spec.row_stream.fresh()
            step_spec, step_plain = (spec, plain_spec) if stream is None else (
                dataclasses.replace(spec, row_stream=stream),
                None if plain_spec is None else dataclasses.replace(plain_spec, row_stream=stream))
            if spec.needs_gradient:
                recorder.streams = step_streams  # the rows a stream starts from: this group's
                backward_passes(capture, group_scores(logits, steps, group), plan.rules, step_spec, step_plain,
                                keep_graph=not last)
            layout = step_streams.layouts[step_streams.explained[0]]
            target = steps.targets[:, list(group)]
            on_step(g, traced(recorder, layout, logits[:, group[-1]].detach(), target, step_streams,
                              row_stream=stream))
    return StepLogits(logits.detach(), streams, sink_share(recorder, streams))


def relevance_steps(adapter: Adapter, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional: Sequence[Any],
                    forward_kwargs: Optional[dict], steps: ExplainedSteps, rules: RuleSet,
                    on_step: OnStep, input_keywords: Sequence[str] = ()) -> StepLogits:
    """Gradient x Input under ``rules`` at the hidden states entering each stream's first
    layer, one backward pass per explained group from one forward pass.

    ``on_step(g, relevance)`` receives ``{stream: (B, N)}`` (the hidden size summed, padding
    zeroed) for group ``g``; the explained score's relevance is its value under rules seeded
    with the score (AttnLRP, ConservativeLRP) and 1 under rules seeded with one. The
    floating-point ``forward_kwargs`` named in ``input_keywords`` (a VLM's pixel values) are
    explained too: ``"input:<name>"`` holds their ``x * dy/dx`` (same shape).
    """
    additional, forward_kwargs = explained_arguments(model, inputs, additional, forward_kwargs, rules)
    forward_kwargs = dict(forward_kwargs or {})
    extra = {name: forward_kwargs[name].detach().requires_grad_() for name in input_keywords
             if isinstance(forward_kwargs.get(name), torch.Tensor) and forward_kwargs[name].is_floating_point()}
    forward_kwargs.update(extra)
    # Image inputs explained too: the tapped tensors stay in the graph (a detached leaf would cut the image path).
    reading = adapter.relevance_reading(model, "tokens").for_steps(in_graph=bool(extra))
    groups = steps.explained_groups
    with relevance_passes(adapter, model, inputs, rules, reading) as (inputs, contexts):
        recorder = Recorder(CaptureSpec())
        streams, logits = _steps_forward(adapter, model, inputs, additional, forward_kwargs, recorder, contexts, steps)
        read = reading.read(streams)
        for g, group in enumerate(groups):
            _, grads = relevance_gradients(group_scores(logits, steps, group), rules,
                                           list(read.values()) + list(extra.values()),
                                           retain_graph=g < len(groups) - 1, what="score")
            relevance = reading.token_relevance(streams, grads[:len(read)])
            relevance.update({f"input:{name}": input_times_gradient(leaf, grad)
                              for (name, leaf), grad in zip(extra.items(), grads[len(read):])})
            on_step(g, relevance)
    return StepLogits(logits.detach(), streams, sink_share(recorder, streams))
