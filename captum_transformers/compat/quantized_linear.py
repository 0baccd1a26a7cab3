"""Quantized linear layers: bitsandbytes 4-bit (NF4 / FP4) and 8-bit (LLM.int8()) modules and
torchao weight tensors (``Int8WeightOnlyConfig``), found, dequantized and kept differentiable.

A quantized layer computes ``y = x W_q^T + b`` with ``W_q = dequantize(packed weight)``
(bitsandbytes 4-bit: a 4-bit code per weight times its block's absmax; 8-bit: ``W_q = C s / 127``,
``C`` int8, ``s`` the row's absmax; torchao: the tensor subclass's ``dequantize()``). So:

* gradient methods need nothing: the plain gradient is the layer's own backward, ``g_x = g_y W_q``;
* rules that read the weight (``RuleSet.linear`` alpha=1/beta=0, gamma) get ``W_q``
  (:func:`dequantized_weight`), never the packed bytes; bitsandbytes layers never call
  ``F.linear``, so :func:`~captum_transformers.propagation.rules.quantized.linear_rule_forwards`
  gives them the rule as a whole;
* :func:`differentiable_kernels` keeps bitsandbytes on kernels with a backward while a model is
  explained. On CPUs with AVX512-BF16, a ``Linear4bit`` in eval mode repacks its weight for an
  inference kernel at the first forward whose input does not require grad (``generate``, a
  prediction under ``no_grad``); that kernel has no backward, so every later gradient through
  the layer is silently zero (measured here: only the residual path's gradient arrived). The
  weight is unpacked (the codes by bitsandbytes' own inverse, the block scales put back in row
  order here, since that inverse leaves them transposed: :func:`_unpack_cpu_layout`) and
  repacking is held off while explaining; a bitsandbytes build with no kernel for the weight's
  device is refused by name.

Example::

    >>> model = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(
    ...     load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    >>> [kind for _, _, kind in quantized_linears(model)][:1]
    ['bitsandbytes-4bit']
    >>> AttnLRP(model).attribute(ids, target=5)   # runs through bitsandbytes' own backward
"""
from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..model_state import module_walk, patching
from ..errors import CaptureError

BNB_4BIT, BNB_8BIT, TORCHAO = "bitsandbytes-4bit", "bitsandbytes-8bit", "torchao"
# A bitsandbytes operator each layer kind runs (its kernel must exist for the weight's device).
_WARNED_REPACKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_BNB_OPERATORS = {BNB_4BIT: "bitsandbytes::dequantize_4bit", BNB_8BIT: "bitsandbytes::int8_linear_matmul"}


def quantized_kind(module: nn.Module) -> Optional[str]:
    """``"bitsandbytes-4bit"``, ``"bitsandbytes-8bit"`` or ``"torchao"`` for a quantized linear
    layer, None otherwise. Found by the weight's class, so no import of either library is needed;
    only ``nn.Linear`` subclasses count (bitsandbytes' 4-bit embeddings are not linear layers)."""
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor):
        return None
    names = {cls.__name__ for cls in type(weight).__mro__}
    if "Params4bit" in names:
        return BNB_4BIT
    if "Int8Params" in names:  # int8 codes, or float weights quantized at each call (has_fp16_weights)
        return BNB_8BIT
    if is_torchao_tensor(weight):
        return TORCHAO
    return None


def is_torchao_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torchao quantized tensor subclass (it has ``dequantize()``)."""
    return any(cls.__module__.startswith("torchao") for cls in type(tensor).__mro__) and hasattr(tensor, "dequantize")


def quantized_linears(model: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """``(name, module, kind)`` of every quantized linear layer of ``model``."""
    found = []
    for name, module in module_walk.named_modules(model):
        kind = quantized_kind(module)
        if kind is not None:
            found.append((name, module, kind))
    return found


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as an ordinary tensor: a torchao quantized weight (what a torchao layer passes to
    ``F.linear``) dequantized, anything else unchanged. For rules that read the weight."""
    if is_torchao_tensor(weight):
        return weight.dequantize().detach()
    return weight


def _is_cpu_repacked(module: nn.Module) -> bool:
    return bool(getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False))


def _warn_repacked(model: nn.Module, names: List[str]) -> None:
    """Say once per model that its 4-bit layers ran bitsandbytes' CPU inference kernel, which the
    explanation cannot follow (no backward), so scores differ from that kernel's by its rounding."""
    if model in _WARNED_REPACKED:
        return
    _WARNED_REPACKED.add(model)
    warnings.warn(
        f"{len(names)} bitsandbytes 4-bit layer(s) of this {type(model).__name__} ({', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''}) were repacked for bitsandbytes' CPU inference kernel by an earlier "
        "forward without gradients (a generate() or a prediction under torch.no_grad()). That kernel computes in "
        "bfloat16 whatever the compute dtype and has no backward pass, so the explanation runs bitsandbytes' "
        "differentiable 4-bit kernel on the same weights (block scales as the repacking rounded them): explained "
        "scores differ from the logits that kernel gave by its rounding (about 1e-3 relative). For scores equal "
        "to the model's own, run the predictions inside "
        "captum_transformers.compat.quantized_linear.differentiable_kernels(model), or in a fresh model.",
        stacklevel=4)


def _bnb_4bit_state(module: nn.Module):
    """The packed codes and quant state of a ``Linear4bit`` in bitsandbytes' canonical layout,
    undoing the CPU inference repacking in place first (:func:`_unpack_cpu_layout`)."""
    if _is_cpu_repacked(module):
        _unpack_cpu_layout(module)
    return module.weight.data, module.weight.quant_state


def _unpack_cpu_layout(module: nn.Module) -> None:
    """Put a ``Linear4bit`` weight repacked for bitsandbytes' CPU kernel back in the canonical layout.

    The repacking permutes the 4-bit codes and stores the block scales (absmax) transposed,
    ``(in / blocksize, out)``, in bfloat16 (double quantization undone). bitsandbytes' own inverse
    restores the codes but, without double quantization, leaves the scales transposed (measured:
    every layer with more than one block per row dequantized wrongly), so the codes come from it
    and the scales are put back here, in row order and float32: exactly the bfloat16-rounded
    scales the repacked layer multiplied by, i.e. the model that ran.
    """
    try:
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse as unpack_codes
    except ImportError as error:  # a bitsandbytes release without the inverse
        raise CaptureError(
            f"The {type(module).__name__} weight was repacked for bitsandbytes' CPU inference kernel, which has "
            "no backward pass, and this bitsandbytes release offers no way to undo it. Explain the model before "
            "any forward under torch.no_grad() (or in train() mode), or upgrade bitsandbytes."
        ) from error
    weight, state = module.weight, module.weight.quant_state
    scales = state.absmax  # (in / blocksize, out), bfloat16
    codes, _ = unpack_codes(weight.data, copy.copy(state))  # the copy takes the inverse's changes to the state
    state.absmax = scales.t().reshape(-1).float()
    state.nested, state.dtype, state.packing_format_for_cpu = False, state.original_dtype, False
    weight.data = codes


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The ``(out, in)`` weight a quantized linear layer multiplies by, as an ordinary tensor
    (bitsandbytes 4-bit: its quant state's dtype; 8-bit: float32), detached.

    Raises :class:`CaptureError` for a module that is not a quantized linear layer.
    """
    kind = quantized_kind(module)
    if kind == TORCHAO:
        return plain_weight(module.weight)
    if kind == BNB_4BIT:
        import bitsandbytes.functional as bnb_functional
        data, state = _bnb_4bit_state(module)
        return bnb_functional.dequantize_4bit(data, state).detach()
    if kind == BNB_8BIT and module.weight.is_floating_point():  # kept in float, quantized at each call
        return module.weight.detach()
    if kind == BNB_8BIT:
        import bitsandbytes.functional as bnb_functional
        module_state = getattr(module, "state", None)
        scales = getattr(module_state, "SCB", None)
        codes = getattr(module_state, "CB", None)
        if scales is None:  # not yet moved into the state by a first forward
            scales, codes = module.weight.SCB, module.weight.CB
        if codes is None:
            codes = module.weight.data
        if scales is None:
            raise CaptureError(f"The {type(module).__name__} layer has int8 weights but no row scales (SCB); was it "
                               "quantized (moved to its device) before explaining?")
        return bnb_functional.int8_vectorwise_dequant(codes, scales).detach()
    raise CaptureError(f"{type(module).__name__} is not a quantized linear layer (bitsandbytes Linear4bit / "
                       "Linear8bitLt, or a torchao-quantized weight); its weight needs no dequantization.")


def _kernel_available(operator: str, device: torch.device) -> bool:
    """Whether bitsandbytes can run ``operator`` on ``device``: a kernel for the device's type or
    its portable torch one (bitsandbytes >= 0.46 registers both); a release with no torch
    operators at all (< 0.45) has CUDA kernels only."""
    key = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hpu": "HPU"}.get(device.type)
    try:
        return any(torch._C._dispatch_has_kernel_for_dispatch_key(operator, name)
                   for name in (key, "CompositeExplicitAutograd", "CompositeImplicitAutograd") if name is not None)
    except RuntimeError:  # the operator is not registered: an old CUDA-only bitsandbytes
        return device.type == "cuda"


# Where torchao weight tensors keep how they quantize the layer's input: act_quant_kwargs
# (Int8DynamicActivationInt8WeightConfig), activation_quantization (IntxUnpackedToInt8Tensor of
# Int8DynamicActivationIntxWeightConfig). None / absent: weight-only.
_ACTIVATION_QUANTIZATION_FIELDS = ("act_quant_kwargs", "activation_quantization")


def _activation_quantization_field(weight: torch.Tensor) -> Optional[str]:
    return next((field for field in _ACTIVATION_QUANTIZATION_FIELDS if getattr(weight, field, None) is not None), None)


def _refuse_quantized_activations(found: List[Tuple[str, nn.Module, str]]) -> None:
    """Refuse torchao layers that quantize their inputs too (``Int8DynamicActivationInt8WeightConfig``,
    ``Int8DynamicActivationIntxWeightConfig``): rounding the activations has no gradient in torchao,
    so nothing below them would get one."""
    for name, module, kind in found:
        field = _activation_quantization_field(module.weight) if kind == TORCHAO else None
        if field is not None:
            raise CaptureError(
                f"{name or 'the model'} is a torchao layer that quantizes its activations "
                f"({type(module.weight).__name__} with {field}): torchao passes no gradient through that "
                "rounding, so no gradient or LRP map can be taken. Quantize the weights only "
                "(torchao.quantization.Int8WeightOnlyConfig), or use a method without gradients (RawAttention, "
                "AttentionRollout)."
            )


@contextlib.contextmanager
def differentiable_kernels(model: nn.Module) -> Iterator[None]:
    """While inside: every bitsandbytes layer of ``model`` runs a kernel with a backward pass.

    A ``Linear4bit`` repacked for the CPU inference kernel is unpacked, and the repacking is held
    off (``support_avx512bf16_for_cpu`` false on the instance) until exit; a layer whose weight
    sits on a device bitsandbytes has no kernel for is refused (:class:`CaptureError`), and so,
    where gradients are on, is a torchao layer that quantizes its activations (no gradient).
    Nothing happens for a model without bitsandbytes layers.
    """
    found = quantized_linears(model)
    if torch.is_grad_enabled():
        _refuse_quantized_activations(found)
    layers = [(name, module, kind) for name, module, kind in found if kind != TORCHAO]
    if not layers:
        yield
        return
    repacked = [name for name, module, kind in layers if kind == BNB_4BIT and _is_cpu_repacked(module)]
    if repacked:
        _warn_repacked(model, repacked)
    with contextlib.ExitStack() as stack:
        for name, module, kind in layers:
            device = module.weight.device
            if not _kernel_available(_BNB_OPERATORS[kind], device):
                raise CaptureError(
                    f"{name or 'the model'} is a bitsandbytes {type(module).__name__} ({kind}) on {device}, and this "
                    f"bitsandbytes build has no {device.type} kernel for it: it needs a CUDA build of bitsandbytes "
                    "and the model on a GPU (bitsandbytes >= 0.46 also runs 4-bit and 8-bit layers on CPU)."
                )
            if kind == BNB_4BIT:
                _bnb_4bit_state(module)
                if getattr(module, "support_avx512bf16_for_cpu", False):
                    stack.enter_context(patching.attributes(module, support_avx512bf16_for_cpu=False))
        yield
