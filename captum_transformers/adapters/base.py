"""The adapter contract, and the capture loop every adapter shares.

An adapter knows one family of models: where attention is computed (:meth:`blocks`), how
to observe it reversibly (:meth:`capture`, built only from :mod:`captum_transformers.model_state.patching`),
how to read logits from the model's output, and how tokens map back to the input
(:meth:`layout`). :meth:`trace` runs one forward and at most one backward per batch.
"""
from __future__ import annotations

import abc
import contextlib
import inspect
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..model_state import patching
from ..compat import stochastic_layers
from ..compat.compiled import uncompiled
from ..model_state.exclusive import exclusive, holding_the_model
from ..errors import CaptureError, InputError
from ..propagation.backward_switch import switchable_backward
from ..propagation.rules.rule_set import refuse_rounding_sensitive
from ..capture.targets import output_scores, select_targets
from ..capture.trace import TOKENS, AttentionRecord, AttentionTrace, Block, CaptureSpec, StreamLayouts, TokenLayout
from ..capture.recorder import Recorder
from ..compat.foreign_patches import check_library_classes
from .model_parts import _enclosing_layer, find_patch_size
from .input_checks import model_dtype, ordinary_tensors, refuse_unexplainable_batch, relevance_carrying
from .query_rows import QueryRows, ReadRows, chosen_rows, refuse_examples_without_tokens
from .relevance_reading import RelevanceResult, input_times_gradient, read_layer_input, seeded, token_sums

if TYPE_CHECKING:  # pragma: no cover
    from ..propagation.rules.rule_set import RuleSet
    from .huggingface.kept_logits import KeptLogitPositions


class Adapter(abc.ABC):
    """Base class of model-family adapters. Subclasses implement :meth:`blocks` and
    :meth:`capture`; the rest has defaults that fit most encoders and decoders.

    Every subclass's :meth:`capture` and :meth:`propagation` are entered holding the model
    (one thread at a time; the holding thread may nest them)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("capture", "propagation"):
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "holds_the_model", False):
                setattr(cls, name, holding_the_model(method))

    name: str = "adapter"
    families: str = ""
    # Whether one token grid, possibly led by prefix tokens (CLS, registers), holds an image's
    # patches in every attention call. False where calls see windows of several grids (Swin).
    single_token_grid: bool = True
    #: The explained rows the user chose (adapters taking ``query_rows``); None: the adapter's default.
    query_rows_choice: QueryRows = None

    @abc.abstractmethod
    def blocks(self, model: nn.Module) -> List[Block]:
        """The attention sites of ``model``, in module order."""

    @abc.abstractmethod
    def capture(self, model: nn.Module, recorder: Recorder) -> ContextManager[None]:
        """A context in which every attention call of ``model`` reports to ``recorder``."""

    def propagation(self, model: nn.Module, rules: "RuleSet") -> ContextManager[None]:
        """A context in which ``model``'s backward pass follows ``rules`` (forward unchanged).

        Any Captum gradient method run inside it becomes the corresponding LRP method.
        """
        raise CaptureError(f"The {self.name} adapter does not implement relevance propagation rules.")

    def first_layer(self, model: nn.Module) -> nn.Module:
        """The first Transformer layer: its input is where token relevance is read.

        The ancestor of the first attention block that is an element of a layer list
        (``encoder.layer.0``, ``blocks.0``, ``layers.0``); the attention module itself if it
        is not inside one.
        """
        return _enclosing_layer(model, self.blocks(model)[0])

    def first_layers(self, model: nn.Module) -> Dict[Optional[str], nn.Module]:
        """The first layer of each token stream, whose input holds that stream's tokens.

        Models with several streams (a CLIP dual encoder, LXMERT, BART, DETR) get one per
        stream, from the first self-attention block :meth:`blocks` assigns to it; other models
        ``{None: first_layer(model)}`` (None: the one stream there is).
        """
        first: Dict[str, Block] = {}
        for block in self.blocks(model):
            if block.streams is not None and block.streams[0] == block.streams[1]:
                first.setdefault(block.streams[0], block)
        if len(first) <= 1:
            return {None: self.first_layer(model)}
        layers = {stream: _enclosing_layer(model, block) for stream, block in first.items()}
        if len({id(layer) for layer in layers.values()}) != len(layers):
            raise CaptureError(
                f"The streams {sorted(layers)} of {type(model).__name__} enter the same layer, so token relevance "
                "cannot be read per stream there; read it at the inputs (relevance_at='inputs') instead."
            )
        return layers

    # -- layout ---------------------------------------------------------------------
    def num_prefix_tokens(self, model: nn.Module) -> Optional[int]:
        """Tokens in front of an image's patch grid, if the model says; None to infer."""
        return None

    def patch_size(self, model: nn.Module) -> Optional[Tuple[int, int]]:
        return find_patch_size(model)

    def query_rows(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder,
                   num_tokens: int, num_prefix: int, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Token positions (B, R) whose rows explain the output, or ``(rows, weights)``.

        Default: the last real token for causal decoders, else the first token (CLS).
        """
        batch = recorder.sites[0].batch_size
        device = inputs[0].device
        if recorder.causal:
            return chosen_rows("last", num_tokens, token_mask, batch, device)
        return torch.zeros(batch, 1, dtype=torch.long, device=device)

    def query_rows_hint(self) -> str:
        """How a user tells this adapter which rows explain the output (for error messages)."""
        if "query_rows" in inspect.signature(type(self).__init__).parameters:
            return (f"Pass adapter={type(self).__name__}(query_rows='mean') for a mean-pooling head, or "
                    "query_rows='last' / a token position for a head that reads one token.")
        return (f"The {self.name} adapter takes no query_rows; explain a model whose head reads the adapter's rows, "
                "or subclass the adapter and override query_rows().")

    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        """The model's token streams. Default: one stream (:meth:`layout`) that every input
        maps onto; adapters of bi-modal, dual-encoder and encoder-decoder models override it."""
        others = sorted({site.streams for site in recorder.sites if site.streams != (TOKENS, TOKENS)})
        if others:
            names = sorted({site.block.name for site in recorder.sites if site.streams != (TOKENS, TOKENS)})
            raise CaptureError(
                f"The {self.name} adapter describes one token sequence, but attention calls of {names} mix the "
                f"streams {others} (cross-attention, e.g. an nn.TransformerDecoder's memory). Explain a model that "
                "attends over one sequence (e.g. the encoder alone), or give the adapter a layout per stream "
                "(Adapter.stream_layouts)."
            )
        return StreamLayouts.single(self.layout(model, inputs, recorder), len(inputs))

    def resolve_target(self, model: nn.Module, logits: torch.Tensor, target: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """The explained score per example (B,) and its index (B, D) for a Captum ``target``.

        Default: Captum's target forms (:func:`~captum_transformers.capture.targets.select_targets`),
        ``None`` meaning the arg-max. Adapters whose outputs need another default override it
        (DETR: the most confident detection, not the arg-max over "no object" too).
        """
        return select_targets(logits, target)

    def rows_for_target(self, model: nn.Module, streams: StreamLayouts, index: torch.Tensor) -> StreamLayouts:
        """The layouts once the target is resolved to ``index`` (B, D), for models whose explained
        row depends on it (DETR: the query of a ``(query_index, class)`` target). Default: as is."""
        return streams

    def layout(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> TokenLayout:
        self_sites = [s for s in recorder.sites if s.streams[0] == s.streams[1]] or recorder.sites
        num_tokens = self_sites[0].num_keys
        if any(s.num_keys != num_tokens or s.num_queries != num_tokens for s in self_sites):
            shapes = sorted({(s.num_queries, s.num_keys) for s in self_sites})
            raise CaptureError(
                f"The self-attention blocks saw sequences of different lengths {shapes}; this method explains "
                "one token sequence. For dual encoders (e.g. CLIP) explain one tower, e.g. model.vision_model."
            )
        token_mask = recorder.key_valid
        if token_mask is not None:
            token_mask = token_mask.to(torch.bool)
        grid = None
        num_prefix = 0
        primary = inputs[0]
        # An image with no patch convolution gets no grid: its token scores are still well
        # defined (return_tokens=True); mapping them onto pixels is refused in span_to_input.
        patch = self.patch_size(model) if primary.dim() == 4 and primary.is_floating_point() else None
        if patch is not None:
            height, width = primary.shape[-2:]
            grid = (height // patch[0], width // patch[1])
            num_prefix = num_tokens - grid[0] * grid[1]
            expected = self.num_prefix_tokens(model)
            if num_prefix < 0 or (expected is not None and num_prefix != expected):
                raise CaptureError(
                    f"The model attends over {num_tokens} tokens but an image of {height}x{width} with patch "
                    f"size {patch} gives a {grid[0]}x{grid[1]} grid plus {expected} prefix tokens. Check that the "
                    "input size matches the model (or that the model interpolates position embeddings)."
                )
        refuse_examples_without_tokens(token_mask)
        rows = self.query_rows(model, inputs, recorder, num_tokens, num_prefix, token_mask)
        weights = None
        if isinstance(rows, tuple):
            rows, weights = rows
        return TokenLayout(num_tokens, rows, token_mask, num_prefix, grid, weights)

    def token_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The first layer's input (or its relevance) as (B, N, ...) tokens; adapters of models
        whose layers take (B, H, W, C) grids (timm Swin) flatten the grid."""
        return hidden

    # -- output ---------------------------------------------------------------------
    def check_output(self, model: nn.Module, output: Any, target: Any) -> None:
        """Refuse an output that ``target`` cannot explain (default: accept every output).

        Adapters override it for outputs that hold no class scores, such as a bare encoder's
        hidden features, where the arg-max (``target=None``) would pick a meaningless feature.
        """

    def logits(self, model: nn.Module, output: Any, layout: TokenLayout, causal: bool) -> torch.Tensor:
        """The (B, ...) score tensor that targets index into: the output itself, its first
        tensor (tuple), or its ``"logits"`` entry (a dict or ``ModelOutput``)."""
        output = output_scores(output)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            output = output[0]
        if not isinstance(output, torch.Tensor):
            raise InputError(
                f"The model returned {type(output).__name__}; expected a tensor of scores. Wrap the model in an "
                "nn.Module whose forward returns the logits tensor."
            )
        if causal and output.dim() == 3:
            # Next-token logits at the explained (last real) position.
            if layout.query_weights is not None or layout.query_rows.shape[1] != 1:
                raise InputError(
                    f"The model returns one score vector per position {tuple(output.shape)}, which a target explains "
                    f"at one position, but the adapter was asked to explain {layout.query_rows.shape[1]} rows (e.g. "
                    "query_rows='mean'). Use query_rows='last' or a token position for per-position outputs, or wrap "
                    "the model so that it returns the pooled score to explain."
                )
            position = layout.query_rows[:, -1]
            output = output[torch.arange(output.shape[0], device=output.device), position.to(output.device)]
        return output

    # -- the capture loop -----------------------------------------------------------
    def _forward(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                 forward_kwargs: Optional[dict], target: Any, recorder: Recorder,
                 contexts: Sequence[ContextManager[None]] = ()):
        """Run the model once under the capture (and ``contexts``); return the layout, the
        logits, the explained score per example and its target index."""
        streams, output, kept = self.captured_forward(model, inputs, additional_forward_args, forward_kwargs,
                                                      recorder, contexts)
        self.check_output(model, output, target)
        logits_layout = streams.layouts[streams.explained[0]]
        if kept is not None:
            logits_layout = kept.layout_for_logits(logits_layout, recorder.causal)
        logits = self.logits(model, output, logits_layout, recorder.causal)
        scores, index = self.resolve_target(model, logits, target)
        return self.rows_for_target(model, streams, index), logits, scores, index

    def captured_forward(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                         additional_forward_args: Sequence[Any], forward_kwargs: Optional[dict], recorder: Recorder,
                         contexts: Sequence[ContextManager[None]] = (), keep_logits: Any = None):
        """The forward pass alone, under the capture (and ``contexts``): ``(streams, output, kept)``,
        ``kept`` the positions whose logits the model computed (None: all); ``keep_logits``
        overrides the adapter's choice with ``"all"`` or positions (the generation steps')."""
        with contextlib.ExitStack() as stack:
            # One explanation of a module at a time; compiled parts run as their originals.
            stack.enter_context(exclusive(model))
            check_library_classes(model)
            stack.enter_context(uncompiled(model))
            stack.enter_context(self.capture(model, recorder))
            for context in contexts:
                stack.enter_context(context)
            # Innermost: a random or batch-dependent forward (training mode) is refused before it runs.
            stack.enter_context(stochastic_layers.watched(model))
            kept = (self.kept_logits(model, inputs, additional_forward_args, forward_kwargs) if keep_logits is None
                    else None if keep_logits == "all" else keep_logits)
            if kept is not None:
                forward_kwargs = {**(forward_kwargs or {}), "logits_to_keep": kept.keep}
            output = self.call_model(model, inputs, additional_forward_args, forward_kwargs)
        if not recorder.sites:
            raise CaptureError(
                f"The forward pass of {type(model).__name__} computed no attention that the {self.name} adapter "
                "could observe. The model may use an attention implementation this adapter does not "
                "intercept; register a custom adapter or pass adapter=."
            )
        streams = self.stream_layouts(model, inputs, recorder)
        for name, layout in streams.layouts.items():
            refuse_examples_without_tokens(layout.token_mask, name)
        return streams, output, kept

    def kept_logits(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                    forward_kwargs: Optional[dict]) -> Optional["KeptLogitPositions"]:
        """The positions whose logits the model need compute (passed as ``logits_to_keep``), or
        None for all (default). The HuggingFace adapter keeps a causal LM's explained position."""
        return None

    def call_model(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                   forward_kwargs: Optional[dict]) -> Any:
        """Run ``model`` on the inputs. Default: ``model(*inputs, *additional_forward_args,
        **forward_kwargs)``; adapters override it to pass an input by keyword (a seq2seq
        model's ``decoder_input_ids``)."""
        return model(*inputs, *additional_forward_args, **(forward_kwargs or {}))

    def trace(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
              target: Any, spec: CaptureSpec, forward_kwargs: Optional[dict] = None,
              rules: Optional["RuleSet"] = None, plain_spec: Optional[CaptureSpec] = None) -> AttentionTrace:
        """One forward (and, if ``spec`` needs gradients, one backward) pass over a batch.

        With ``rules`` the backward pass follows those propagation rules, so the backward
        reduction sees LRP-modified gradients (relevance = probs * gradient).

        With ``rules`` and ``plain_spec`` too, the same graph is differentiated a second time
        with plain gradients (every rule Function switched to its operation's own gradient, the
        explained logit as seed), reduced by ``plain_spec``: one forward, two backward passes.
        ``spec`` reduces the first, ``plain_spec`` the second; the trace holds the second's
        values. Only for rules whose forward graph is the plain one (no detached attention gate).
        """
        refuse_unexplainable_batch(inputs)
        refuse_rounding_sensitive(rules, model_dtype(model))
        additional_forward_args, forward_kwargs = ordinary_tensors(tuple(additional_forward_args)), \
            ordinary_tensors(forward_kwargs)
        if plain_spec is not None and (rules is None or rules.attention_gate != "gradient"):
            raise InputError(
                f"A plain-gradient second pass needs rules whose graph keeps the attention gate (got {rules!r}); "
                "run two traces instead."
            )
        inputs = relevance_carrying(inputs)
        recorder = Recorder(spec)
        recorder.keep_probs = plain_spec is not None
        with contextlib.ExitStack() as stack:
            stack.enter_context(exclusive(model))  # before any flag below changes
            stack.enter_context(torch.enable_grad() if spec.needs_gradient else torch.no_grad())
            if spec.needs_gradient:
                stack.enter_context(patching.parameters_require_grad(model))  # the trainable model's graph
            switch = stack.enter_context(switchable_backward()) if plain_spec is not None else None
            contexts = [self.propagation(model, rules)] if rules is not None else []
            # The rows the score reads are checked where a gradient is taken anyway.
            read_rows = ReadRows() if spec.needs_gradient and self.query_rows_choice is None else None
            if read_rows is not None:
                contexts.append(read_rows.watch(b.module for b in self.blocks(model) if b.kind == "self"))
            streams, logits, scores, index = self._forward(model, inputs, additional_forward_args, forward_kwargs,
                                                           target, recorder, contexts)
            if spec.needs_gradient:
                recorder.streams = streams  # a row stream (spec.row_stream) starts from the explained rows
                if read_rows is not None:
                    read_rows.listen()
                self._backward(recorder, seeded(scores, rules), retain_graph=switch is not None)
            if switch is not None:
                recorder.next_pass(plain_spec)
                with switch.plain_gradient():
                    self._backward(recorder, scores)
        if read_rows is not None and streams.is_single:
            explained = streams.layouts[streams.explained[0]]
            read_rows.refuse_unexplained(explained.num_tokens, explained.query_rows, explained.query_weights,
                                         explained.token_mask, self.query_rows_hint())
        layout = streams.layouts[streams.explained[0]]
        records = AttentionRecord.of_sites(recorder.sites, layout.query_rows.device)
        return AttentionTrace(records, layout, logits.detach(), index, streams)

    def _backward(self, recorder: Recorder, scores: torch.Tensor, retain_graph: bool = False) -> None:
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

    # -- relevance: Gradient x Input under propagation rules ------------------------------
    def relevance(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                  target: Any, rules: "RuleSet", at: str = "tokens",
                  forward_kwargs: Optional[dict] = None) -> "RelevanceResult":
        """One forward and one backward pass of Gradient x Input under ``rules``.

        ``at="tokens"``: relevance of the hidden states entering the first layer of each
        stream (:meth:`first_layers`), summed over the hidden size, (B, N) per stream.
        ``at="inputs"``: ``x * dy/dx`` for every floating-point input.
        """
        with exclusive(model):  # held from the start: every question about the modules reads one walk
            return self._relevance(model, inputs, additional_forward_args, target, rules, at, forward_kwargs)

    def _relevance(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                   target: Any, rules: "RuleSet", at: str, forward_kwargs: Optional[dict]) -> "RelevanceResult":
        refuse_unexplainable_batch(inputs)
        refuse_rounding_sensitive(rules, model_dtype(model))
        additional_forward_args, forward_kwargs = ordinary_tensors(tuple(additional_forward_args)), \
            ordinary_tensors(forward_kwargs)
        if at not in ("tokens", "inputs"):
            raise InputError(f"relevance must be read at 'tokens' or 'inputs', got {at!r}.")
        layers = self.first_layers(model) if at == "tokens" else {}
        entering: Dict[Optional[str], List[torch.Tensor]] = {stream: [] for stream in layers}
        with exclusive(model), torch.enable_grad(), patching.parameters_require_grad(model):  # the trainable graph
            contexts = [self.propagation(model, rules)]
            if at == "inputs":
                if not any(t.is_floating_point() for t in inputs):
                    raise InputError(
                        "relevance at 'inputs' needs floating-point inputs (pixels or embeddings); got dtypes "
                        f"{[str(t.dtype) for t in inputs]}. Use the token relevance (the default) for token ids."
                    )
            inputs = relevance_carrying(inputs)
            if at == "tokens":
                contexts.extend(read_layer_input(layer, entering[stream]) for stream, layer in layers.items())
            streams, _, scores, index = self._forward(model, inputs, additional_forward_args, forward_kwargs,
                                                      target, Recorder(CaptureSpec()), contexts)
            layout = streams.layouts[streams.explained[0]]
            read = {streams.explained[0] if stream is None else stream: store[0]
                    for stream, store in entering.items() if store}
            leaves = list(read.values()) if at == "tokens" else [t for t in inputs if t.is_floating_point()]
            if not leaves:
                raise CaptureError("The first Transformer layer never ran, so no token relevance could be read.")
            if not scores.requires_grad:
                raise CaptureError("The explained output does not depend on the inputs (it does not require grad).")
            explained = seeded(scores, rules)
            grads = torch.autograd.grad(explained.sum(), leaves, allow_unused=True)
        products = [input_times_gradient(leaf, g) for leaf, g in zip(leaves, grads)]
        explained = explained.detach()
        if at == "tokens":
            per_stream = {stream: token_sums(self.token_states, hidden,
                                             streams.layouts[stream].token_mask if stream in streams.layouts else None,
                                             scores.shape[0])
                          for stream, hidden in zip(read, products)}
            first = next(iter(per_stream.values()))
            total = sum(r.sum(-1).to(first.device) for r in per_stream.values())  # streams may start apart
            return RelevanceResult(first, None, layout, explained, index, total, per_stream, streams)
        remaining = iter(products)
        per_input = tuple(next(remaining) if t.is_floating_point() else torch.zeros(t.shape, device=t.device)
                          for t in inputs)
        total = sum(r.reshape(r.shape[0], -1).sum(-1) for r in per_input)
        return RelevanceResult(None, per_input, layout, explained, index, total)
