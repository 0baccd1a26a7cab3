"""What a method class says about itself: the facts the catalog, generation and pictures read.

Every method class of the package declares, as class attributes (defaults on the shells
:class:`~captum_transformers.methods.base.TraceAttribution`,
:class:`~captum_transformers.methods.lrp.RuleGradientXInput` and the Captum baselines of
:mod:`~captum_transformers.methods.captum_baselines`, overridden where a method differs):

* ``signed`` (bool): its maps take both signs (positive: evidence for the explained class,
  negative: against it). Unsigned maps are non-negative relevance with no direction, and a
  picture of them must not read red as "for the class".
* ``class_specific`` (bool): its map depends on the explained class (``target``).
* ``run_by_default`` (bool): ``"all"`` (the CLI's and the benchmark tables' default) runs it;
  False for methods too slow for that, run only when named.
* ``needs_adapter`` (bool): it reads the model through an adapter (False for Captum's own
  methods, which explain any model with a score).
* ``generation_steps`` (:class:`GenerationSteps`): how
  :class:`~captum_transformers.generation.attribution.GenerationAttribution` explains each
  generated token with it.

The attention methods (``TraceAttribution``) also declare ``chains_every_layer`` (bool): their
map chains every attention layer rather than reading one, so a vision-language generation step
carries the image row on through the vision tower's layers
(:mod:`~captum_transformers.generation.vision_steps`).

:data:`FACT_NAMES` lists the facts of every catalog class. Example::

    >>> from captum_transformers.methods.rollout import AttentionRollout
    >>> AttentionRollout.signed, AttentionRollout.class_specific, AttentionRollout.generation_steps
    (False, False, <GenerationSteps.TRACE: 'trace'>)
"""
from __future__ import annotations

import enum


class GenerationSteps(str, enum.Enum):
    """How a method explains the steps of a generation (:mod:`captum_transformers.generation`)."""

    #: One forward pass over prompt + output, a backward pass per step; each step's attention
    #: trace is reduced by the method (``stream_scores``). The package's attention methods.
    TRACE = "trace"
    #: One forward pass, a backward pass per step under the method's rules; relevance read at the
    #: tokens. The relevance-propagation methods (Gradient x Input under a ``RuleSet``).
    RELEVANCE = "relevance"
    #: One call of the method per step on the prefix (prompt + the tokens before the step), the
    #: step's next-token logit as the target. Captum's own methods (and any other attribution).
    PREFIX_CALLS = "prefix-calls"


#: The class attributes every method class of the catalog declares (module docstring).
FACT_NAMES = ("signed", "class_specific", "run_by_default", "needs_adapter", "generation_steps")
