"""LRP as a modified gradient: rule sets and the small autograd Functions that carry them.

The forward pass stays bit-identical (every Function's forward returns exactly what the
original operation computed); only the backward pass changes. Relevance is then
``input * gradient`` at the layer where it is read (Ali et al., ICML 2022, Sec. 3-4):

* ``attention_gate="constant"`` (the AH-rule): the softmax output ``p_ij`` is treated as a
  constant in ``y_j = sum_i x_i p_ij``, i.e. ``p.detach()``; the query/key path receives
  no relevance.
* ``gated_product="constant"`` (the gate rule of CP-LRP): in a gated MLP
  ``act(gate(x)) * up(x)`` (SwiGLU, GeGLU: Llama, Qwen, Gemma, Mistral) the activated gate is
  a constant multiplier, so all relevance of the product flows through ``up``; the gate path
  receives none. Found by behaviour: an elementwise product whose one operand is the output
  of an activation (see :mod:`~captum_transformers.propagation.rules.operations`).
* ``norm="scale_constant"`` (the LN-rule): LayerNorm's / RMSNorm's ``1/sqrt(eps + Var[x])``
  is treated as a constant, so the norm is the linear map ``alpha C x`` (``alpha x`` for
  RMSNorm); ``"scale_and_mean_constant"`` also freezes the mean.

Hand-written norms (the many ``*RMSNorm`` / ``*LayerNorm`` classes that never call
``F.layer_norm``) are found by *behaviour*: every leaf module with a 1-D ``weight`` and an
``eps``-like attribute is probed with a few random rows and kept when its output is an
affine function of the LayerNorm- or RMS-normalised input.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Iterator, List, Literal, Optional

import torch
from torch import nn

from ...model_state import patching
from ...model_state import module_walk, offload
from ...errors import InputError
from ..backward_switch import current_switch, plain_gradient_of
from .operations import IdentityRelevance, paused_rule_mode
from .probe_cache import probed

GateRule = Literal["gradient", "constant"]
GatedProductRule = Literal["gradient", "constant"]
NormRule = Literal["gradient", "scale_constant", "scale_and_mean_constant", "identity"]


@dataclasses.dataclass(frozen=True)
class RuleSet:
    """Which propagation rule sits where. The default is plain gradient everywhere.

    Presets: :attr:`GRADIENT` (Gradient x Input), :attr:`AH` and :attr:`AH_LN`
    (Ali et al. 2022; both hold the gates of gated MLPs constant, as LXT's CP-LRP does, so
    that AH+LN conserves on bias-free gated models too). Example::

        >>> with get_adapter(model).propagation(model, RuleSet.AH_LN):
        ...     relevance = LayerGradientXActivation(forward, layer).attribute(x, target=t)

    LRP-gamma on every linear layer (Ali et al.'s code; with CP-LRP, LXT's ViT recipe)::

        >>> rules = dataclasses.replace(RuleSet.AH_LN, name="AH+LN, gamma", linear="gamma", gamma=0.25)
    """

    name: str = "gradient"
    attention_gate: GateRule = "gradient"
    norm: NormRule = "gradient"
    # Per-operation rules installed by captum_transformers.propagation.rules.operations:
    linear: Literal["gradient", "alpha1beta0", "alpha1beta0_separate", "gamma", "generalized_gamma"] = "gradient"
    activation: Literal["gradient", "identity"] = "gradient"
    softmax: Literal["gradient", "identity"] = "gradient"
    matmul: Literal["gradient", "uniform"] = "gradient"
    add: Literal["gradient", "normalized"] = "gradient"
    # The relevance put on the explained output: its value ("logit") or 1 ("one", as in
    # Chefer et al.'s code, where the map's identity term makes the scale matter).
    seed: Literal["logit", "one"] = "logit"
    # The convolution reading the pixels (only when relevance is read at the pixels).
    pixel_conv: Literal["gradient", "zB"] = "gradient"
    # (Fields added later go last: positional construction keeps working.)
    # The activated gate of a gated MLP, act(gate(x)) * up(x): "constant" holds it fixed, so
    # relevance flows only through up(x) (LXT's CP-LRP). "gradient": the product's own rule.
    gated_product: GatedProductRule = "gradient"
    # The gamma of linear="gamma" (LRP-gamma: z_ij = x_j (w_ij + gamma w_ij^+), bias b + gamma b^+;
    # Ali et al.'s code; 0 is LRP-0) or "generalized_gamma" (contributions of the output's sign
    # amplified, for signed inputs: zennit's Gamma, which LXT's ViT example uses).
    gamma: float = 0.0

    GRADIENT = None  # filled in below (dataclass fields cannot hold instances of the class)
    AH = None
    AH_LN = None
    CHEFER = None
    LRP = None
    ATTN_LRP = None

    def __post_init__(self) -> None:
        gamma = self.gamma
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma >= 0 or gamma == float("inf"):
            raise InputError(f"RuleSet.gamma must be a finite number >= 0, got {gamma!r}.")
        if gamma != 0 and self.linear not in ("gamma", "generalized_gamma"):
            raise InputError(f"RuleSet.gamma={gamma!r} acts only with linear='gamma' or 'generalized_gamma', but "
                             f"linear={self.linear!r}; set linear='gamma' (LRP-gamma on linear layers) or leave gamma "
                             "at 0.")


RuleSet.GRADIENT = RuleSet()
RuleSet.AH = RuleSet("AH", attention_gate="constant", gated_product="constant")
RuleSet.AH_LN = RuleSet("AH+LN", attention_gate="constant", norm="scale_constant", gated_product="constant")
# Chefer et al. (CVPR 2021): alpha=1/beta=0 linear layers, identity activations, norms and
# softmax, halved attention matmuls, normalised residual adds, one-hot seed.
RuleSet.CHEFER = RuleSet("Chefer2021", norm="identity", linear="alpha1beta0", activation="identity",
                         softmax="identity", matmul="uniform", add="normalized", seed="one")
# The "LRP" baseline of Chefer et al.'s tables, as their code computes it: unnormalised adds,
# alpha=1/beta=0 with separate denominators for the positive and negative pairs, z^B at pixels.
RuleSet.LRP = dataclasses.replace(RuleSet.CHEFER, name="LRP", add="gradient", linear="alpha1beta0_separate",
                                  pixel_conv="zB")
# AttnLRP (Achtibat et al., ICML 2024): uniform matmuls, LayerNorm scale held constant,
# identity activations, plain gradient through softmax and linear layers, logit seed.
RuleSet.ATTN_LRP = RuleSet("AttnLRP", norm="scale_constant", activation="identity", matmul="uniform")


def refuse_rounding_sensitive(rules: Optional[RuleSet], dtype: torch.dtype) -> None:
    """Refuse a bfloat16 model under the identity rules of softmax or norms.

    Those rules pass relevance through ``y / x``, unbounded where the operation's input nearly
    cancels (a score ``q . k`` or a residual entry near 0), and Chefer et al.'s normalised add
    flips a branch's sign with its relevance sum. bfloat16's 8-bit mantissa moves the forward
    enough to move those entries: over four random tiny ViTs, TransformerRelevance and
    PartialLRP maps of a bfloat16 model correlated 0.41 to 0.9999 with the float32 maps of
    the same weights, TransformerLRP -0.30 to 0.71, and rounding a float32 forward to bfloat16
    with a float32 backward did as badly: the forward, not the backward's precision, moves
    them. float16 (>= 0.994) and the AH, AH+LN and AttnLRP rules (>= 0.99) hold.
    """
    if rules is None or dtype != torch.bfloat16 or "identity" not in (rules.softmax, rules.norm):
        return
    raise InputError(
        f"The {rules.name!r} rules (identity rule on softmax or norms) amplify bfloat16 rounding until the map no "
        "longer follows the model's weights (correlation with the float32 map of the same weights as low as -0.3), "
        "so a bfloat16 model is not explained with them. Explain a float32 or float16 copy (model.float()), "
        "or use AttnLRP or ConservativeLRP, which hold in bfloat16."
    )


# -- attention gate ------------------------------------------------------------------------
def gate(probs: torch.Tensor, rules: Optional[RuleSet]) -> torch.Tensor:
    """The attention probabilities as the ``A V`` product should see them under ``rules``."""
    if rules is not None and rules.attention_gate == "constant":
        return probs.detach()
    return probs


# -- norms ---------------------------------------------------------------------------------
_EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon")


@dataclasses.dataclass(frozen=True)
class NormSite:
    """A module found to compute ``y = scale * (x - centre) / sqrt(eps + E[(x - centre)^2]) + shift``
    over its last dimension; ``centered`` says whether ``centre`` is the mean (LayerNorm)
    or zero (RMSNorm)."""

    name: str
    module: nn.Module
    centered: bool
    eps: float
    scale: torch.Tensor


def _eps(module: nn.Module) -> Optional[float]:
    for attribute in _EPS_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    if isinstance(module, nn.RMSNorm) and module.eps is None:
        return float(torch.finfo(module.weight.dtype if module.weight is not None else torch.float32).eps)
    return None


def _normalise(x: torch.Tensor, centered: bool, eps: float) -> torch.Tensor:
    if centered:
        x = x - x.mean(dim=-1, keepdim=True)
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


@torch.no_grad()
def _probe(module: nn.Module, size: int, eps: float, like: torch.Tensor) -> Optional[tuple]:
    """Fit ``y = a * normalise(x) + b`` on random rows (dtype and device of ``like``);
    return ``(centered, a)`` if it fits, ``a`` in at least float32.

    A half-precision output is exact only to its rounding (``finfo(dtype).eps``, 2^-7 for
    bfloat16): the fit must tolerate that much, and more rows average the fitted ``a``."""
    dtype, device = like.dtype, like.device
    half = torch.finfo(dtype).bits <= 16
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(64 if half else 6, size, generator=generator) * 3 + 1.5).to(dtype=dtype, device=device)
    try:
        # Not __call__: the user's hooks must not see the probe. Eval mode: the probe must not
        # update running statistics (a BatchNorm1d in training mode would) or draw dropout; on
        # an eval-mode copy, so another thread running the module never sees its mode change.
        view = patching.eval_view(module)
        y = type(view).forward(view, x)
    except Exception:  # not a per-token module: it is simply not a norm
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    x64, y64 = x.double(), y.double()
    for centered in (True, False):
        n = _normalise(x64, centered, eps)
        n_mean, y_mean = n.mean(0), y64.mean(0)
        variance = ((n - n_mean) ** 2).sum(0)
        a = ((n - n_mean) * (y64 - y_mean)).sum(0) / variance.clamp(min=1e-12)
        b = y_mean - a * n_mean
        error = (a * n + b - y64).abs().max()
        tolerance = 4 * torch.finfo(dtype).eps if half else 1e-5
        if error <= tolerance * max(1.0, float(y64.abs().max())):
            return centered, a.to(torch.promote_types(dtype, torch.float32))
    return None


# Leaf modules with a weight that are never norms: skipped before any attribute is read.
_NOT_NORMS = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)


def find_norms(model: nn.Module) -> List[NormSite]:
    """Every LayerNorm- or RMSNorm-like leaf module of ``model``, found by probing."""
    sites = []
    # Norms without a weight (nn.LayerNorm / nn.RMSNorm with elementwise_affine=False) are
    # probed in the dtype and device of the model's first floating-point tensor.
    reference = next((t for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()), None)
    reference = None if reference is None else offload.materialised(reference, model)
    for name, module in module_walk.named_modules(model):
        if isinstance(module, _NOT_NORMS) or not module_walk.is_leaf(module):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            if weight.dim() != 1:
                continue
            size, like = weight.shape[0], weight
        else:
            shape = getattr(module, "normalized_shape", None)
            if weight is not None or not isinstance(shape, tuple) or len(shape) != 1 or reference is None:
                continue
            size, like = int(shape[0]), reference
        eps = _eps(module)
        if eps is None:
            continue
        # An accelerate-offloaded weight is on meta outside the forward: probed onloaded (capture/offload.py).
        with offload.onloaded(module, name) if like.is_meta else contextlib.nullcontext():
            like = module.weight if like is weight else like
            fitted = probed(module, ("norm", size, eps, like.dtype, like.device),
                            lambda: _probe(module, size, eps, like))
        if fitted is not None:
            sites.append(NormSite(name, module, fitted[0], eps, fitted[1]))
    return sites


class _ScaleConstantNorm(torch.autograd.Function):
    """Forward: the module's own output. Backward: the Jacobian with the scale held fixed,
    ``dx = C (dy * a / sigma)`` (LayerNorm; no ``C`` when the mean is frozen too or for RMSNorm)."""

    @staticmethod
    def forward(ctx, x, held, scale, centered, freeze_mean, eps, recompute=None):
        ctx.save_for_backward(x, scale)
        ctx.centered, ctx.freeze_mean, ctx.eps = centered, freeze_mean, eps
        ctx.switch, ctx.recompute = current_switch(), recompute
        # ``held``: ``[output]``, the module's output made without gradients. Not an input of the
        # Function, so it is returned as a new tensor, not a view: a model may update it in place
        # (XLM: ``tensor *= mask`` after its embedding norm), as it updates its own norm's output.
        return held[0]

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        if ctx.switch is not None and ctx.switch.plain:  # the norm's own gradient (one graph, two passes)
            return plain_gradient_of(ctx.recompute, (x,), {}, x, grad), None, None, None, None, None, None
        dtype = torch.promote_types(x.dtype, torch.float32)
        x = x.to(dtype)
        centred = x - x.mean(dim=-1, keepdim=True) if ctx.centered else x
        # sigma = sqrt(mean(centred^2) + eps), from the norm of each row: no squared copy of x.
        sigma = torch.linalg.vector_norm(centred, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(ctx.eps).sqrt_()
        scaled = (grad.to(dtype) * scale.to(device=grad.device, dtype=dtype)).div_(sigma)
        if ctx.centered and not ctx.freeze_mean:
            scaled = scaled - scaled.mean(dim=-1, keepdim=True)
        return scaled.to(grad.dtype), None, None, None, None, None, None


def _norm_forward(site: NormSite, rule: str):
    def make(original):
        def forward(x, *args, **kwargs):
            if not torch.is_grad_enabled() or not x.requires_grad:
                return original(x, *args, **kwargs)
            # The norm gets one rule as a whole; the operation-rule mode has nothing to do inside.
            with paused_rule_mode():
                with torch.no_grad():
                    output = original(x, *args, **kwargs)
                recompute = lambda inputs: original(inputs, *args, **kwargs)  # noqa: E731  (the plain gradient)
                if rule == "identity":
                    # Chefer et al.'s norm rule: relevance passes unchanged, R_x = R_y.
                    return IdentityRelevance.apply(x, [output], recompute)
                return _ScaleConstantNorm.apply(x, [output], site.scale, site.centered,
                                                rule == "scale_and_mean_constant", site.eps, recompute)
        return forward
    return make


@contextlib.contextmanager
def norm_rules(model: nn.Module, rules: RuleSet) -> Iterator[List[NormSite]]:
    """Install the norm rule of ``rules`` on every norm of ``model`` (reversibly)."""
    if rules.norm == "gradient":
        yield []
        return
    sites = find_norms(model)
    with contextlib.ExitStack() as stack:
        for site in sites:
            stack.enter_context(patching.instance_forward(site.module, _norm_forward(site, rules.norm)))
        yield sites
