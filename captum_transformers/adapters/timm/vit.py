"""timm Vision Transformers (ViT, DeiT, DeiT-distilled, EVA / EVA-02), through attention hooks.

timm's attention modules (``Attention``, ``AttentionRope``, ``EvaAttention`` and the
fused ``ParallelScalingBlock``) have two code paths chosen by the instance flag
``fused_attn``: ``F.scaled_dot_product_attention``, or an explicit ``softmax(q * scale @ k^T)``
passed through ``self.attn_drop`` before multiplying by ``v``. Inside
:meth:`TimmAdapter.capture` we

* run each attention module's SDPA call (the fused path, timm's default) as an explicit
  softmax attention that keeps no map for the backward pass and reports it to the recorder
  (:mod:`.sdpa_kernel`; outputs equal the explicit path's),
* record the probabilities entering ``attn_drop`` (a forward pre-hook on it) when the module
  takes the explicit path instead (``fused_attn = False``: the user's choice, or a rule set
  that detaches the attention gate (AH), which switches it on per *instance*:
  ``timm.layers.set_fused_attn`` only affects modules created afterwards),
* tap each attention module's input with :meth:`Recorder.connect` (a forward pre-hook),
  so that gradients reach every attention map even when the parameters are frozen.

Every change goes through :mod:`captum_transformers.model_state.patching` on one
:class:`contextlib.ExitStack`, so flags and hooks are restored however the forward ends.
timm is imported lazily: importing :mod:`captum_transformers` never imports it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ...model_state import patching
from ...compat.compiled import original_module
from ...errors import CaptureError
from ...propagation.rules.operations import needs_operation_rules, operation_rules
from ...propagation.rules.rule_set import RuleSet, norm_rules
from ...capture.trace import Block
from ..base import Adapter
from ...capture.recorder import Recorder
from .sdpa_kernel import explicit_sdpa

# Pooling heads whose output is a mean/max over tokens: every pooled token explains it.
_MEAN_POOLS = ("avg", "max", "avgmax")
# Pooling heads that attend with a learned latent query: no token row stands for them.
_ATTENTION_POOLS = ("map", "prr")


def is_attention(module: nn.Module) -> bool:
    """timm attention with a switchable explicit path: ``fused_attn`` flag + ``attn_drop`` module."""
    return hasattr(module, "fused_attn") and isinstance(getattr(module, "attn_drop", None), nn.Module)


def _backbone(model: nn.Module) -> nn.Module:
    """The timm ViT/EVA inside ``model`` (``model`` itself, or a module of a user wrapper).

    Recognised by its structure (``blocks`` + ``patch_embed``), so subclasses and other
    timm models built the same way work with ``adapter="timm"`` too.
    """
    for module in model.modules():
        if isinstance(getattr(module, "blocks", None), nn.Module) and isinstance(
                getattr(module, "patch_embed", None), nn.Module):
            return module
    raise CaptureError(
        f"{type(model).__name__} contains no timm Vision Transformer (a module with `blocks` and `patch_embed`). "
        "The timm adapter supports timm VisionTransformer, VisionTransformerDistilled and Eva models."
    )


class TimmAdapter(Adapter):
    """Adapter for timm ``VisionTransformer`` (incl. register tokens and mean pooling),
    ``VisionTransformerDistilled`` (DeiT with a distillation token) and ``Eva``
    (EVA / EVA-02, with or without rotary embeddings).

    The explained token rows follow the classifier head: the class token for
    ``global_pool='token'``; the class *and* distillation tokens for distilled DeiT at
    inference (its head averages both); every pooled patch token for ``'avg'``, ``'max'``
    and ``'avgmax'``. Attention-pooling heads (``'map'``, ``'prr'``) read the tokens
    through a learned latent query that is no token, and raise :class:`CaptureError`.
    Non-square inputs work; the patch grid is read from the actual input size.

    Example::

        >>> import timm, torch
        >>> from captum_transformers import GenericAttention
        >>> vit = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
        >>> maps = GenericAttention(vit).attribute(torch.randn(2, 3, 224, 224), target=[1, 2])
    """

    name = "timm"
    families = "timm VisionTransformer (ViT, DeiT, DeiT-distilled, registers, avg pool) and Eva (EVA, EVA-02)"

    # -- sites ----------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> List[Block]:
        backbone = _backbone(model)
        names = {id(m): name for name, m in model.named_modules()}
        blocks: List[Block] = []
        for index, layer in enumerate(original_module(backbone.blocks).children()):
            found = [m for m in layer.modules() if is_attention(m)]
            if len(found) != 1:
                # Parallel attention branches (ParallelThingsBlock) are summed, not chained;
                # the methods here would wrongly treat them as consecutive layers.
                raise CaptureError(
                    f"Block {index} ({type(layer).__name__}) of {type(backbone).__name__} has {len(found)} "
                    "attention modules with a `fused_attn` flag; the timm adapter needs exactly one per block "
                    "(parallel attention branches are not supported)."
                )
            module = found[0]
            if hasattr(module, "lambda_init"):
                # Differential attention subtracts two softmax maps: its mixing weights are no
                # probabilities, and attn_drop sees twice the heads.
                raise CaptureError(
                    f"Block {index} ({type(module).__name__}) uses differential attention, whose mixing "
                    "matrix is a difference of two softmax maps; attention methods do not apply to it."
                )
            blocks.append(Block(names[id(module)], module, "self"))
        if not blocks:
            raise CaptureError(
                f"{type(backbone).__name__}.blocks holds no timm attention module (a module with `fused_attn` and "
                "`attn_drop`), so its attention cannot be observed. Pass a custom adapter with adapter=."
            )
        return blocks

    def backbone(self, model: nn.Module) -> nn.Module:
        """The timm model whose attention is captured (overridden for other timm families)."""
        return _backbone(model)

    @contextlib.contextmanager
    def capture(self, model: nn.Module, recorder: Recorder) -> Iterator[None]:
        backbone = self.backbone(model)
        self._check_pooling(backbone)
        blocks = self.blocks(model)
        # Number of records made by each attention call still running (keyed by module id).
        open_calls: Dict[int, List[int]] = {}

        def make_hooks(block: Block):
            key = id(block.module)

            def tap_input(module, args, kwargs):
                # The anchor tap makes autograd visit this block's attention even in a frozen model.
                open_calls.setdefault(key, []).append(len(recorder.sites))
                if args:
                    return (recorder.connect(args[0]), *args[1:]), kwargs
                if "x" in kwargs:
                    return args, {**kwargs, "x": recorder.connect(kwargs["x"])}
                return None

            def check_recorded(module, args, kwargs, output):
                before = open_calls[key].pop()
                if len(recorder.sites) == before:
                    raise CaptureError(
                        f"Attention module {block.name!r} ({type(module).__name__}) neither called "
                        "F.scaled_dot_product_attention (fused_attn=True) nor passed its probabilities through "
                        "attn_drop (fused_attn=False), so its attention could not be observed. Its forward differs "
                        "from timm's attention paths; pass a custom adapter with adapter=."
                    )
                return None

            def record(dropout, args):
                # The explicit path: the probabilities before dropout, inside the graph.
                recorder.record(block, args[0])
                return None

            def report(probs, observer):
                recorder.record(block, probs, observer=observer)

            return tap_input, check_recorded, record, report

        with contextlib.ExitStack() as stack:
            if getattr(backbone, "grad_checkpointing", False):
                # Checkpointed blocks re-run their forward in the backward pass, outside this
                # context; run them plainly so the observed maps are the ones differentiated.
                stack.enter_context(patching.flag(backbone, "grad_checkpointing", False))
            for block in blocks:
                tap_input, check_recorded, record, report = make_hooks(block)
                stack.enter_context(explicit_sdpa(block.module, report))
                stack.enter_context(patching.forward_hook(block.module, tap_input, pre=True, with_kwargs=True))
                stack.enter_context(patching.forward_hook(block.module, check_recorded, with_kwargs=True))
                stack.enter_context(patching.forward_hook(block.module.attn_drop, record, pre=True))
            yield

    @contextlib.contextmanager
    def propagation(self, model: nn.Module, rules: RuleSet) -> Iterator[None]:
        blocks = self.blocks(model)

        def constant_gate(dropout, args, output):
            # The AH-rule: `attn @ v` sees the probabilities as a constant (same values).
            return output.detach()

        with contextlib.ExitStack() as stack:
            for block in blocks:
                if rules.attention_gate != "gradient":
                    # The explicit attention path, whose attn_drop output A V reads: detached there.
                    stack.enter_context(patching.flag(block.module, "fused_attn", False))
                    stack.enter_context(patching.forward_hook(block.module.attn_drop, constant_gate))
                elif needs_operation_rules(rules):
                    # SDPA as an explicit softmax attention, so the rules reach its softmax and products.
                    stack.enter_context(patching.flag(block.module, "fused_attn", True))
                    stack.enter_context(explicit_sdpa(block.module))
            stack.enter_context(norm_rules(model, rules))
            stack.enter_context(operation_rules(model, rules))
            yield

    @staticmethod
    def _check_pooling(backbone: nn.Module) -> None:
        pool = getattr(backbone, "global_pool", "token")
        if pool in _ATTENTION_POOLS or getattr(backbone, "attn_pool", None) is not None:
            raise CaptureError(
                f"{type(backbone).__name__} pools its tokens with an attention-pooling head "
                f"(global_pool={pool!r}): the classifier reads a learned latent query, not a token, so no token "
                "row explains the output. Use a model with global_pool='token' or 'avg'."
            )
        if not pool and not hasattr(backbone, "dist_token"):
            raise CaptureError(
                f"{type(backbone).__name__} has global_pool='' and returns one output per token, not per image. "
                "Wrap the model so that its forward returns (B, classes) scores."
            )

    # -- layout ---------------------------------------------------------------------
    def num_prefix_tokens(self, model: nn.Module) -> Optional[int]:
        return int(getattr(_backbone(model), "num_prefix_tokens", 1))

    def patch_size(self, model: nn.Module) -> Optional[Tuple[int, int]]:
        embed = _backbone(model).patch_embed
        if hasattr(embed, "feat_ratio"):
            # The total stride: hybrid (CNN-stem) embeddings reduce before their patch conv.
            ratio = embed.feat_ratio(as_scalar=False)
            return (int(ratio[0]), int(ratio[1]))
        size = getattr(embed, "patch_size", None)
        if size is not None:
            return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        return super().patch_size(model)

    def query_rows(self, model: nn.Module, inputs: Tuple[torch.Tensor, ...], recorder: Recorder,
                   num_tokens: int, num_prefix: int, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
        backbone = _backbone(model)
        batch = recorder.sites[0].batch_size
        device = inputs[0].device
        if hasattr(backbone, "dist_token"):
            # DeiT-distilled averages its CLS and distillation heads, except when training
            # with distillation, where the first returned output is the CLS head alone.
            distilled_training = getattr(backbone, "distilled_training", False) and backbone.training
            rows: Any = (0,) if distilled_training else (0, 1)
        elif getattr(backbone, "global_pool", "token") in _MEAN_POOLS:
            prefix = int(getattr(backbone, "num_prefix_tokens", num_prefix))
            start = 0 if getattr(backbone, "pool_include_prefix", False) else prefix
            rows = range(start, num_tokens)
        else:
            rows = (0,)
        return torch.tensor(list(rows), dtype=torch.long, device=device).expand(batch, -1)
