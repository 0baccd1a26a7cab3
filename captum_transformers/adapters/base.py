"""The adapter contract: what an explanation needs to know about one family of models.

An adapter knows one family of models: where attention is computed (:meth:`blocks`), how
to observe it reversibly (:meth:`capture`, built only from :mod:`captum_transformers.model_state.patching`),
how to read logits from the model's output, and how tokens map back to the input
(:meth:`layout`). It runs the forward pass under its capture (:meth:`captured_forward`,
:meth:`scored_forward`); the passes of an explanation (refusals, backward passes, reading
relevance) are run by :mod:`captum_transformers.engine.runner`, which calls the small hooks
here (:meth:`refuse_trace`, :meth:`trace_spec`, :meth:`trace_context`, :meth:`refuse_relevance`,
:meth:`relevance_reading`, :meth:`finish_relevance`) where a family adds to them.
"""
from __future__ import annotations

import abc
import contextlib
import inspect
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..compat import stochastic_layers
from ..compat.compiled import uncompiled
from ..model_state.exclusive import exclusive, holding_the_model
from ..errors import CaptureError, InputError
from ..capture.targets import output_scores, select_targets
from ..capture.trace import TOKENS, Block, CaptureSpec, StreamLayouts, TokenLayout
from ..capture.recorder import Recorder
from ..compat.foreign_patches import check_library_classes
from .model_parts import enclosing_layer, find_patch_size
from .query_rows import QueryRows, chosen_rows, refuse_examples_without_tokens
from .relevance_reading import InputProducts, LayerInputs, RelevanceReading, RelevanceResult

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
        is not inside one. A model with no attention block is refused (:class:`CaptureError`).
        """
        blocks = self.blocks(model)
        if not blocks:
            raise CaptureError(
                f"The {self.name} adapter finds no attention module in {type(model).__name__}, so it has no "
                "Transformer layer whose input holds the tokens' relevance: the model mixes its tokens some other "
                "way (Fourier mixing as in FNet, a state-space scan as in Mamba, convolutions), which the relevance "
                "rules do not describe. Explain it with a method that needs no attention (Captum's "
                "IntegratedGradients or Saliency), or pass adapter= an adapter that knows its layers."
            )
        return enclosing_layer(model, blocks[0])

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
        layers = {stream: enclosing_layer(model, block) for stream, block in first.items()}
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

    def rows_refusal(self, model: nn.Module) -> Optional[str]:
        """Why no choice of the last layer's rows describes what ``model``'s head reads (a head
        whose classes weigh a concatenation of tokens each their own way), or None (default).
        The methods that weigh those rows (raw attention, rollout, Grad-CAM, GenericAttention
        ...) refuse such a model with it; the relevance methods, which start at the logit, do not."""
        return None

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

    def next_token_rows(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                        forward_kwargs: Optional[dict]) -> Optional[torch.Tensor]:
        """The (B,) position whose scores a model the adapter captures no attention in reads
        as its next-token prediction (a recurrent causal LM's last real token), or None where
        the adapter does not know (default). Gradient methods that need no attention use it
        for a token-id target (:mod:`~captum_transformers.methods.captum_baselines`)."""
        return None

    def target_names_position(self, model: nn.Module, target: Any) -> bool:
        """Whether ``target`` names the position of a model that scores every position, so the
        scores are not read at the next-token position first (default: never; the HuggingFace
        adapter's encoder-decoder LM heads take ``(decoder position, token)``)."""
        return False

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

    # -- the forward pass -----------------------------------------------------------
    def scored_forward(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                 forward_kwargs: Optional[dict], target: Any, recorder: Recorder,
                 contexts: Sequence[ContextManager[None]] = ()):
        """Run the model once under the capture (and ``contexts``); return the layout, the
        logits, the explained score per example and its target index."""
        positional = self.target_names_position(model, target)
        streams, output, kept = self.captured_forward(model, inputs, additional_forward_args, forward_kwargs,
                                                      recorder, contexts, keep_logits="all" if positional else None)
        self.check_output(model, output, target)
        logits_layout = streams.layouts[streams.explained[0]]
        if kept is not None:
            logits_layout = kept.layout_for_logits(logits_layout, recorder.causal)
        logits = self.logits(model, output, logits_layout, recorder.causal and not positional)
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

    def gradient_forward_kwargs(self, model: nn.Module, forward_kwargs: Optional[dict]) -> Optional[dict]:
        """The ``forward_kwargs`` under which ``model``'s scores have a gradient. Default: as
        given; the HuggingFace adapter turns off the cache of models that write it in place
        (RWKV) unless the caller set ``use_cache``."""
        return forward_kwargs

    # -- hooks of the pass runner (captum_transformers.engine.runner) ------------------
    def refuse_trace(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], additional_forward_args: Sequence[Any],
                     forward_kwargs: Optional[dict], rules: Optional["RuleSet"]) -> None:
        """Refuse what this family cannot trace (attention maps under ``rules``), before the
        runner's own refusals. Default: nothing."""

    def trace_spec(self, spec: Optional[CaptureSpec], inputs: Tuple[torch.Tensor, ...]) -> Optional[CaptureSpec]:
        """The spec a trace of ``inputs`` records with (None stays None). Default: ``spec``;
        windowed adapters make each reduction see one example's windows."""
        return spec

    def trace_context(self, model: nn.Module) -> ContextManager[None]:
        """A context held around a whole trace (its refusals, forward and backward passes).
        Default: none; the PyG adapters mark there that the explained rows matter."""
        return contextlib.nullcontext()

    def refuse_relevance(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...],
                         additional_forward_args: Sequence[Any], forward_kwargs: Optional[dict],
                         rules: "RuleSet") -> None:
        """Refuse what this family cannot explain by relevance under ``rules``, before the
        runner's own refusals. Default: nothing."""

    def relevance_reading(self, model: nn.Module, at: str, messages: Optional[list] = None) -> RelevanceReading:
        """Where a relevance pass reads ``x * dy/dx``: ``at="tokens"``, the hidden states entering
        the first layer of each stream (:meth:`first_layers`), summed over the hidden size;
        ``at="inputs"``, every floating-point input. ``messages`` (per-edge message relevance)
        is read by graph adapters only."""
        if messages is not None:
            raise CaptureError(f"The {self.name} adapter reports no per-edge messages.")
        if at == "tokens":
            return LayerInputs(self.first_layers(model), self.token_states)
        return InputProducts()

    def finish_relevance(self, model: nn.Module, result: RelevanceResult) -> RelevanceResult:
        """The result of a relevance pass as returned. Default: as is; the vision-language
        adapters give the vision tower's stream a layout of its own."""
        return result
