"""Every method under a short, stable name, for command lines, configs and benchmark tables.

Names are lower-case and hyphenated; each maps to a factory ``model -> Attribution``.
Gradient x Input is ``ConservativeLRP(variant="GI")`` (Gradient x Input at the same place
the LRP methods read their relevance, so the comparison is like for like). The last two rows
are Captum's own Integrated Gradients and Saliency (``captum_baselines``), the baselines
users compare against: at the pixels, or at the input embeddings for token ids.

Example::

    >>> from captum_transformers.methods.catalog import build_method, METHOD_NAMES
    >>> explainer = build_method("generic-attention", model)
    >>> maps = explainer.attribute(pixel_values, target=labels)
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Dict, Iterable, List, Tuple

from torch import nn

from ..errors import InputError
from .attention_flow import AttentionFlow
from .captum_baselines import CaptumIntegratedGradients, CaptumSaliency
from .conservative_lrp import ConservativeLRP
from .generic_attention import GenericAttention
from .grad_cam import AttentionGradCAM
from .lrp import AttnLRP, TransformerLRP
from .raw_attention import RawAttention
from .rollout import AttentionRollout
from .transformer_relevance import PartialLRP, TransformerRelevance

METHOD_FACTORIES: Dict[str, Callable[[nn.Module], object]] = {
    "raw-attention": RawAttention,
    "rollout": AttentionRollout,
    "attention-flow": AttentionFlow,
    "grad-cam": AttentionGradCAM,
    "partial-lrp": PartialLRP,
    "lrp": TransformerLRP,
    "attn-lrp": AttnLRP,
    "gradient-x-input": partial(ConservativeLRP, variant="GI"),
    "conservative-lrp-ah": partial(ConservativeLRP, variant="AH"),
    "conservative-lrp": partial(ConservativeLRP, variant="AH+LN"),
    "generic-attention": GenericAttention,
    "transformer-relevance": TransformerRelevance,
    "integrated-gradients": CaptumIntegratedGradients,
    "saliency": CaptumSaliency,
}
# Run only when named: exact maximum flows cost seconds per example (AttentionFlow), too slow
# for "all" (the default of the CLI and of benchmark tables).
ON_REQUEST = frozenset({"attention-flow"})
# What "all" (or no choice) runs.
METHOD_NAMES: Tuple[str, ...] = tuple(name for name in METHOD_FACTORIES if name not in ON_REQUEST)
# Every name build_method accepts.
KNOWN_METHOD_NAMES: Tuple[str, ...] = tuple(METHOD_FACTORIES)

# Captum's own methods: they need no adapter (no attention is captured), explain pixels
# or, for token ids, the input embeddings, and have no token scores for float inputs.
CAPTUM_BASELINES = frozenset({"integrated-gradients", "saliency"})
# The package's methods, which read the model through an adapter.
PACKAGE_METHOD_NAMES: Tuple[str, ...] = tuple(name for name in KNOWN_METHOD_NAMES if name not in CAPTUM_BASELINES)

# Methods whose map does not depend on the explained class (the rest, Captum's gradient
# baselines included, differentiate the target score).
CLASS_AGNOSTIC = frozenset({"raw-attention", "rollout", "attention-flow"})

# Methods whose maps are signed (positive: evidence for the explained class, negative: against).
# The others return non-negative relevance with no direction (Saliency is an absolute gradient),
# so a picture of them must not read red as "for the class".
SIGNED_METHODS = frozenset({"lrp", "attn-lrp", "gradient-x-input", "conservative-lrp-ah", "conservative-lrp",
                            "integrated-gradients"})


def resolve_method_names(names: Iterable[str] | None) -> List[str]:
    """Validate ``names`` (``None`` or ``["all"]`` means ``METHOD_NAMES``: every method but those
    run only on request), keeping their order."""
    if names is None:
        return list(METHOD_NAMES)
    names = list(names)
    if names == ["all"]:
        return list(METHOD_NAMES)
    unknown = [name for name in names if name not in METHOD_FACTORIES]
    if unknown:
        raise InputError(f"unknown method {', '.join(map(repr, unknown))}; expected one of "
                         f"{', '.join(KNOWN_METHOD_NAMES)} (or 'all').")
    return names


def build_method(name: str, model: nn.Module):
    """The attribution ``name`` (see ``KNOWN_METHOD_NAMES``) for ``model``."""
    (name,) = resolve_method_names([name])
    return METHOD_FACTORIES[name](model)
