r"""Graphormer: the package's (:mod:`captum_transformers.models.graphormer`) and transformers
4.x's (``transformers.models[.deprecated].graphormer``, found by dotted key: nothing absent is
imported). Both share module names and call structure, which is all this adapter reads.

Tokens. One sequence of ``T = 1 + N_max`` tokens per graph: the graph token at position 0,
whose last state feeds the head (the explained row), then the nodes; padded nodes (first
feature index 0) are padding keys. ``attribute(input_nodes, ...)`` returns a map shaped like
``input_nodes`` (B, N_max, F), each node's score repeated over its F features (read
``[..., 0]`` for (B, N_max)); ``return_tokens=True`` gives the same (B, N_max) node scores, as the
PyG adapters do (the layout's ``returned_tokens`` leaves the graph token out). Padded nodes
score exactly 0. The collator's dict is a mapping input (its
``input_nodes`` explained, every entry passed by name), or the other inputs go by name::

    >>> batch = GraphormerCollator()(graphs)
    >>> maps = GenericAttention(model).attribute(batch, target=labels)       # like batch["input_nodes"]
    >>> nodes = batch.pop("input_nodes")
    >>> maps = GenericAttention(model).attribute(nodes, target=labels, forward_kwargs=batch)

Where a method takes a gradient, the rows the score reads at the last attention output are
checked as for every adapter: a head that pools the nodes (a user's wrapper) instead of
reading the graph token is refused with :class:`InputError`, not explained at the wrong row.

Capture (only :mod:`~captum_transformers.model_state.patching` hooks, removed on exit or error):
a pre-hook on each ``GraphormerMultiheadAttention`` taps its query through
:meth:`Recorder.connect` and notes ``key_padding_mask``; a forward hook on its
``attention_dropout_module`` child records the probabilities entering it, ``(B * H, T, T)``,
as ``(B, H, T, T)`` (the tensor ``bmm(probs, v)`` differentiates, in eval mode). The
attention modules of other classes (4.x's) run the package's attention forward while
captured: the same operations, except that ``q * scaling`` is not written in place, which
the rule Functions that keep a projection's output (alpha-beta linears) need; and they carry
``batch_first = False`` (the package's modules say it themselves), so that the check of the
rows a score reads knows their outputs are (T, B, C).

Relevance (the LRP methods) is read at the token embeddings entering the encoder's
``dropout_module`` (after ``embed_scale`` and ``emb_layer_norm``): per node the sum over its
feature embeddings plus its degree embeddings, summed over the hidden size.

The attention bias ``B`` (spatial, edge and virtual-distance encodings) is a per-head
additive term of the scores ``S = q k^T / sqrt(d) + B``, built from the graph's structure and
parameters only: no node's hidden state enters it. It is added in place (as 4.x does), so
every rule set differentiates that add plainly: relevance that reaches ``S`` is shared in
gradient x input form, ``(q k^T / sqrt(d)) * dS`` towards the nodes and ``B * dS`` to the bias,
and the bias share leaves the explanation (it is the structure's, not a node's). Under the
AH and AH+LN rules (``ConservativeLRP``) the probabilities are constants, nothing reaches
``S`` and the bias takes no relevance: with bias-free weights and ReLU activations the graph
token's and the nodes' relevance sums to the explained logit, whatever the encodings.
Under GI, AttnLRP, TransformerLRP and PartialLRP the bias share (and GI's and the
activations' non-conservation) makes the sum differ from the logit.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...capture.recorder import Recorder
from ...capture.trace import TOKENS, Block, InputSpan, StreamLayouts, TokenLayout
from ...errors import CaptureError, InputError
from ...propagation.rules.operations import operation_rules
from ...propagation.rules.rule_set import RuleSet, gate, norm_rules
from ..base import Adapter

ATTENTION_CLASS = "GraphormerMultiheadAttention"
ENCODER_CLASS = "GraphormerGraphEncoder"
NODE_FEATURE_CLASS = "GraphormerGraphNodeFeature"
#: The packages whose Graphormer classes this adapter serves (registered by dotted key).
MODEL_MODULES = ("captum_transformers.models.graphormer", "transformers.models.graphormer.modeling_graphormer",
                 "transformers.models.deprecated.graphormer.modeling_graphormer")
MODEL_KEYS = tuple(f"{module}.GraphormerPreTrainedModel" for module in MODEL_MODULES)


def _package_attention_forward():
    from ...models.graphormer import GraphormerMultiheadAttention

    return GraphormerMultiheadAttention.forward


class _Entered:
    """The ``input_nodes`` tensor that entered the node-feature module during one capture."""

    def __init__(self) -> None:
        self.tensor: Optional[torch.Tensor] = None


class GraphormerAdapter(Adapter):
    """Adapter for Graphormer graph classifiers (see the module docstring). The explained
    row is the graph token (position 0): the readout of ``GraphormerForGraphClassification``.
    Call ``model.eval()`` first (dropout would make the recorded maps differ from the used ones).
    """

    name = "graphormer"
    families = "Graphormer (captum_transformers.models, transformers 4.x)"

    def __init__(self) -> None:
        self._entered: "weakref.WeakKeyDictionary[Recorder, _Entered]" = weakref.WeakKeyDictionary()

    # -- sites ----------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> List[Block]:
        blocks = [Block(name, module, "self") for name, module in model.named_modules()
                  if type(module).__name__ == ATTENTION_CLASS]
        if not blocks:
            raise CaptureError(f"{type(model).__name__} has no {ATTENTION_CLASS} module; the graphormer adapter "
                               "explains Graphormer models (captum_transformers.models.graphormer or transformers 4.x).")
        for block in blocks:
            if not isinstance(getattr(block.module, "attention_dropout_module", None), nn.Module):
                raise CaptureError(f"{block.name!r} has no attention_dropout_module child, where the adapter reads "
                                   "the attention probabilities; this Graphormer computes attention differently.")
        return blocks

    def _encoder(self, model: nn.Module) -> nn.Module:
        encoder = next((m for m in model.modules() if type(m).__name__ == ENCODER_CLASS), None)
        if encoder is None or not isinstance(getattr(encoder, "dropout_module", None), nn.Module):
            raise CaptureError(f"{type(model).__name__} has no {ENCODER_CLASS} with a dropout_module, where token "
                               "relevance is read.")
        return encoder

    def first_layers(self, model: nn.Module) -> Dict[Optional[str], nn.Module]:
        # Batch-first token embeddings (B, T, C), just before the transpose to (T, B, C).
        return {None: self._encoder(model).dropout_module}

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        entered = _Entered()
        self._entered[recorder] = entered
        package_forward = _package_attention_forward()
        with contextlib.ExitStack() as stack:
            for block in self.blocks(model):
                module = block.module
                if type(module).forward is not package_forward:  # 4.x: the same operations, no in-place scaling
                    stack.enter_context(patching.instance_forward(
                        module, lambda original, module=module: package_forward.__get__(module)))
                if getattr(module, "batch_first", None) is not False:
                    # 4.x's module does not say its outputs are (T, B, C); the check of the rows
                    # the score reads (ReadRows, inside the explanation) needs it. 4.x never reads it.
                    stack.enter_context(patching.attributes(module, batch_first=False))
                call = _Call(block, recorder)
                stack.enter_context(patching.forward_hook(module, call.before, pre=True, with_kwargs=True))
                stack.enter_context(patching.forward_hook(module.attention_dropout_module, call.after))
            for module in model.modules():
                if type(module).__name__ == NODE_FEATURE_CLASS:
                    stack.enter_context(patching.forward_hook(module, _note_nodes(entered), pre=True,
                                                              with_kwargs=True))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        """The AH gate returns the dropout's output detached (same values), so ``bmm(A, v)``
        treats ``A`` as a constant; norms get their rule by probing; per-operation rules see
        the explicit ``bmm`` / ``softmax`` / ``linear`` calls."""
        with contextlib.ExitStack() as stack:
            if rules.attention_gate != "gradient":
                for block in self.blocks(model):
                    stack.enter_context(patching.forward_hook(
                        block.module.attention_dropout_module, lambda module, args, output: gate(output, rules)))
            stack.enter_context(norm_rules(model, rules))
            stack.enter_context(operation_rules(model, rules))
            yield

    # -- layout ---------------------------------------------------------------------------
    def stream_layouts(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder) -> StreamLayouts:
        num_tokens = recorder.stream_length(TOKENS)
        batch = recorder.sites[0].batch_size
        mask = recorder.stream_mask(TOKENS)
        device = inputs[0].device
        rows = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # return_tokens=True gives the nodes (B, N_max), like the PyG adapters: the graph token
        # is the explained row, a learned parameter, not a node of the input.
        layout = TokenLayout(num_tokens, rows, mask, returned_tokens=(1, None))
        entered = self._entered.get(recorder)
        nodes = entered.tensor if entered is not None else None
        spans = []
        for tensor in inputs:
            same = tensor is nodes or (nodes is None and tensor.dim() >= 2 and tuple(tensor.shape[:2])
                                       == (batch, num_tokens - 1) and not tensor.is_floating_point())
            spans.append(InputSpan(TOKENS, 1, None) if same else None)
        return StreamLayouts({TOKENS: layout}, (TOKENS,), tuple(spans))

    def check_output(self, model: nn.Module, output: Any, target: Any) -> None:
        if isinstance(output, torch.Tensor):
            return
        logits = output.get("logits") if hasattr(output, "get") else None
        if not isinstance(logits, torch.Tensor) and not isinstance(output, (tuple, list)):
            raise InputError(f"{type(model).__name__} returned {type(output).__name__} without logits (a bare "
                             "GraphormerModel returns hidden states). Explain GraphormerForGraphClassification, or "
                             "a wrapper whose forward returns the scores read from the graph token.")


class _Call:
    """The hooks of one attention module: tap the query and note the padding before it
    runs; record the probabilities entering its dropout child."""

    def __init__(self, block: Block, recorder: Recorder):
        self.block, self.recorder = block, recorder
        self.pending: List[Optional[torch.Tensor]] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        padding = kwargs.get("key_padding_mask", args[4] if len(args) > 4 else None)
        self.pending.append(None if not isinstance(padding, torch.Tensor) else ~padding.to(torch.bool))
        query = kwargs.get("query", args[0] if args else None)
        if not isinstance(query, torch.Tensor):
            return None
        tapped = self.recorder.connect(query)
        if tapped is query:
            return None
        # The layer passes one tensor as query, key and value: all get the tapped one.
        args = tuple(tapped if a is query else a for a in args)
        kwargs = {k: (tapped if v is query else v) for k, v in kwargs.items()}
        return args, kwargs

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self.pending:
            return  # the dropout ran outside its attention module's forward
        key_valid = self.pending.pop()
        probs = args[0]
        heads = self.block.module.num_heads
        batch, length = probs.shape[0] // heads, probs.shape[-1]
        self.recorder.record(self.block, probs.view(batch, heads, length, probs.shape[-1]), grad_tensor=probs,
                             grad_view=lambda grad: grad.view(batch, heads, length, -1), key_valid=key_valid)


def _note_nodes(entered: _Entered):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        nodes = kwargs.get("input_nodes", args[0] if args else None)
        if isinstance(nodes, torch.Tensor) and entered.tensor is None:
            entered.tensor = nodes
        return None

    return hook
