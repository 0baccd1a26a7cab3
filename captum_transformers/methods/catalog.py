"""Every method under a short, stable name, for command lines, configs and benchmark tables.

Names are lower-case and hyphenated; each maps to a :class:`CatalogEntry`: a method class and
the options it is built with. Gradient x Input is ``ConservativeLRP(variant="GI")`` (Gradient x
Input at the same place the LRP methods read their relevance, so the comparison is like for
like). The last two rows are Captum's own Integrated Gradients and Saliency
(``captum_baselines``), the baselines users compare against: at the pixels, or at the input
embeddings for token ids.

What a method is (signed, class-specific, run by default, read through an adapter, how it
explains a generation step) is declared on its class (:mod:`~captum_transformers.methods.facts`)
and read here through the entry; the name sets below are derived from those facts.

Example::

    >>> from captum_transformers.methods.catalog import build_method, catalog_entry, METHOD_NAMES
    >>> explainer = build_method("generic-attention", model)
    >>> maps = explainer.attribute(pixel_values, target=labels)
    >>> catalog_entry("conservative-lrp").signed
    True
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Mapping, Tuple

from torch import nn

from ..errors import InputError
from .attention_flow import AttentionFlow
from .captum_baselines import CaptumIntegratedGradients, CaptumSaliency
from .conservative_lrp import ConservativeLRP
from .facts import GenerationSteps
from .generic_attention import GenericAttention
from .grad_cam import AttentionGradCAM
from .lrp import AttnLRP, TransformerLRP
from .raw_attention import RawAttention
from .rollout import AttentionRollout
from .transformer_relevance import PartialLRP, TransformerRelevance


def _fact(name: str, doc: str) -> property:
    """A read-only property of a catalog entry that answers with its method class's fact ``name``."""
    return property(lambda entry: getattr(entry.method, name), doc=doc)


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    """One catalog name: the method class and the keyword options it is built with
    (``conservative-lrp-ah`` is ``ConservativeLRP`` with ``variant="AH"``).

    The entry's facts (``signed``, ``class_specific``, ``run_by_default``, ``needs_adapter``,
    ``generation_steps``; :mod:`~captum_transformers.methods.facts`) are its class's: no option
    of a catalog entry changes one (every ``ConservativeLRP`` variant is signed and
    class-specific), so no entry overrides them.
    """

    method: type
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def factory(self) -> Callable[..., object]:
        """``model, **keywords -> method``: the class itself, or the class with the options bound."""
        return partial(self.method, **self.options) if self.options else self.method

    signed = _fact("signed", "Whether the maps take both signs (for / against the explained class).")
    class_specific = _fact("class_specific", "Whether the map depends on the explained class.")
    run_by_default = _fact("run_by_default", 'Whether ``"all"`` (or no choice) runs it.')
    needs_adapter = _fact("needs_adapter", "Whether it reads the model through an adapter (False: Captum's own).")
    generation_steps = _fact("generation_steps", "How it explains a generation's steps (a ``GenerationSteps``).")


METHOD_CATALOG: Dict[str, CatalogEntry] = {
    "raw-attention": CatalogEntry(RawAttention),
    "rollout": CatalogEntry(AttentionRollout),
    "attention-flow": CatalogEntry(AttentionFlow),
    "grad-cam": CatalogEntry(AttentionGradCAM),
    "partial-lrp": CatalogEntry(PartialLRP),
    "lrp": CatalogEntry(TransformerLRP),
    "attn-lrp": CatalogEntry(AttnLRP),
    "gradient-x-input": CatalogEntry(ConservativeLRP, {"variant": "GI"}),
    "conservative-lrp-ah": CatalogEntry(ConservativeLRP, {"variant": "AH"}),
    "conservative-lrp": CatalogEntry(ConservativeLRP, {"variant": "AH+LN"}),
    "generic-attention": CatalogEntry(GenericAttention),
    "transformer-relevance": CatalogEntry(TransformerRelevance),
    "integrated-gradients": CatalogEntry(CaptumIntegratedGradients),
    "saliency": CatalogEntry(CaptumSaliency),
}
# Each name's factory ``model, **keywords -> method`` (the entry's class, options bound).
METHOD_FACTORIES: Dict[str, Callable[..., object]] = {name: entry.factory for name, entry in METHOD_CATALOG.items()}
# Every name build_method accepts.
KNOWN_METHOD_NAMES: Tuple[str, ...] = tuple(METHOD_CATALOG)

# The name sets of the facts, for the modules that ask by name.
# Run only when named (AttentionFlow: exact maximum flows cost seconds per example).
ON_REQUEST = frozenset(name for name, entry in METHOD_CATALOG.items() if not entry.run_by_default)
# Captum's own methods: no adapter (no attention is captured), pixels or input embeddings.
CAPTUM_BASELINES = frozenset(name for name, entry in METHOD_CATALOG.items() if not entry.needs_adapter)
# Methods whose map does not depend on the explained class.
CLASS_AGNOSTIC = frozenset(name for name, entry in METHOD_CATALOG.items() if not entry.class_specific)
# Methods whose maps are signed (positive: evidence for the explained class, negative: against).
SIGNED_METHODS = frozenset(name for name, entry in METHOD_CATALOG.items() if entry.signed)

# What "all" (or no choice) runs.
METHOD_NAMES: Tuple[str, ...] = tuple(name for name, entry in METHOD_CATALOG.items() if entry.run_by_default)
# The package's methods, which read the model through an adapter.
PACKAGE_METHOD_NAMES: Tuple[str, ...] = tuple(name for name, entry in METHOD_CATALOG.items() if entry.needs_adapter)


def resolve_method_names(names: Iterable[str] | None) -> List[str]:
    """Validate ``names`` (``None`` or ``["all"]`` means ``METHOD_NAMES``: every method but those
    run only on request), keeping their order."""
    if names is None:
        return list(METHOD_NAMES)
    names = list(names)
    if names == ["all"]:
        return list(METHOD_NAMES)
    unknown = [name for name in names if name not in METHOD_CATALOG]
    if unknown:
        raise InputError(f"unknown method {', '.join(map(repr, unknown))}; expected one of "
                         f"{', '.join(KNOWN_METHOD_NAMES)} (or 'all').")
    return names


def catalog_entry(name: str) -> CatalogEntry:
    """The entry of the catalog name ``name`` (an unknown name is an :class:`InputError`
    listing the known ones)."""
    (name,) = resolve_method_names([name])
    return METHOD_CATALOG[name]


def build_method(name: str, model: nn.Module):
    """The attribution ``name`` (see ``KNOWN_METHOD_NAMES``) for ``model``."""
    return catalog_entry(name).factory(model)
