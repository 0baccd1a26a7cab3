"""The package's methods as inseq attribution methods (``inseq.load_model(model, "ct_attn_lrp")``).

inseq (0.7) finds its methods by subclass: every ``FeatureAttribution`` subclass with a
``method_name`` is in its registry. :func:`register_inseq_methods` defines one subclass per
method class of the package's catalog that reads the model through an adapter (Captum's own
Integrated Gradients and Saliency are inseq's own methods too), named after the class
(``"ct_attn_lrp"``, ``"ct_generic_attention"``, ...; see :data:`INSEQ_METHOD_NAMES`); nothing
is patched, in inseq or in the model. inseq then calls ``attribute_step`` once per generated
token with the prefix it has read, and each step is explained by
:class:`GenerationAttribution` as one step (``span=[last]``: one backward pass):

* decoder-only: the prefix is the prompt, the step's row over it is inseq's target
  attribution ``(batch, prefix)``;
* encoder-decoders: the source row is inseq's source attribution, the decoder row (the start
  token and the outputs so far) its target attribution (``attribute_target=True``).

So inseq's rows are the rows of ``GenerationAttribution.attribute(prompt, target)`` (each row
of that equals the call on the prefix). The score is the package's (``attribution_args=
{"score": "logit" | "log_prob" | "prob"}``, default ``"logit"``); inseq's ``attributed_fn`` is
not used. inseq casts every step to float32 (``FeatureAttributionStepOutput.__post_init__``);
these steps keep the model's dtype (float64 stays float64), so the numbers can be compared.
inseq runs one forward and one backward pass per step on the prefix (its loop), not the
package's one forward pass: for that, call ``GenerationAttribution`` and :mod:`.inseq_export`.

Imported only when inseq is installed (this module imports it).

Example::

    >>> from captum_transformers.integrations.inseq.method import register_inseq_methods
    >>> register_inseq_methods()
    >>> model = inseq.load_model(hf_model, "ct_attn_lrp", tokenizer=tokenizer)
    >>> out = model.attribute("k = 3 ; q ?", generated_texts="k = 3 ; q ? 3", attribute_target=True)
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

import torch

from ...errors import InputError
from ...generation.attribution import GenerationAttribution
from ...methods.catalog import METHOD_CATALOG

try:
    from inseq.attr.feat import FeatureAttribution
    from inseq.data import CoarseFeatureAttributionStepOutput
except ImportError as error:  # the package never needs inseq; this module is only for inseq users
    raise ImportError("captum_transformers.integrations.inseq.method needs inseq (pip install inseq); "
                      f"importing it failed: {error}") from error

# The catalog's package method classes by class name, once each (three catalog names are ConservativeLRP).
METHOD_CLASSES: Dict[str, type] = {entry.method.__name__: entry.method for entry in METHOD_CATALOG.values()
                                   if entry.needs_adapter}
INSEQ_METHOD_NAMES: Dict[str, str] = {
    name: "ct_" + re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower() for name in METHOD_CLASSES}
_REGISTERED: Dict[str, type] = {}


class KeptDtypeStepOutput(CoarseFeatureAttributionStepOutput):
    """inseq's coarse step output without its cast to float32 (one score per token)."""

    def __post_init__(self) -> None:
        if self._num_dimensions is None:
            self._num_dimensions = 0
        if self.step_scores is None:
            self.step_scores = {}
        if self.sequence_scores is None:
            self.sequence_scores = {}


class PackageMethodSteps:
    """What the registered methods do (a mixin, so it is no inseq method itself); each class
    made by :func:`register_inseq_methods` is ``(PackageMethodSteps, FeatureAttribution)`` with
    ``package_method`` naming the package's class (a key of :data:`METHOD_CLASSES`)."""

    package_method: Optional[str] = None

    def __init__(self, attribution_model: Any, **kwargs: Any) -> None:
        super().__init__(attribution_model)
        if self.package_method is None:
            raise InputError("PackageMethodSteps is a mixin; load one of "
                             f"{sorted(INSEQ_METHOD_NAMES.values())}.")
        # The package's methods take token ids; inseq's own forward (step scores) keeps embeddings,
        # which it requires for attribute_target=True.
        self.attribute_batch_ids = True
        self.is_encoder_decoder = bool(attribution_model.is_encoder_decoder)
        method = METHOD_CLASSES[self.package_method](attribution_model.model, **kwargs)
        self.explainer = GenerationAttribution(method, attribution_model.tokenizer)

    def attribute_step(self, attribute_fn_main_args: Dict[str, Any],
                       attribution_args: Dict[str, Any] = {}) -> KeptDtypeStepOutput:
        extra = attribute_fn_main_args["additional_forward_args"]
        score = attribution_args.get("score", "logit")
        with_target = len(attribute_fn_main_args["inputs"]) > 1
        if self.is_encoder_decoder and not with_target:  # inseq puts the decoder embeddings first
            extra = extra[1:]
        if self.is_encoder_decoder:  # (sources, targets, target ids, fn, source mask, target mask, ...)
            sources, decoder, targets, source_mask, decoder_mask = extra[0], extra[1], extra[2], extra[4], extra[5]
        else:  # (ids, target ids, fn, mask, ...)
            sources, targets, source_mask = extra[0], extra[1], extra[3]
            decoder = decoder_mask = None
        source_rows, target_rows = [], []
        for b in range(sources.shape[0]):
            source_ids = sources[b][source_mask[b].bool()].tolist()
            target_id = [int(targets.reshape(sources.shape[0], -1)[b, 0])]
            if self.is_encoder_decoder:
                outputs = decoder[b][decoder_mask[b].bool()].tolist()[1:] + target_id  # after the start token
                result = self.explainer.attribute(source_ids, target=outputs, span=[len(outputs) - 1], score=score)
                source_rows.append(self._placed(result.token_attr[0], source_mask[b]))
                target_rows.append(self._placed(result.target_attr[0], decoder_mask[b]))
            else:
                result = self.explainer.attribute(source_ids, target=target_id, score=score)
                target_rows.append(self._placed(result.token_attr[0], source_mask[b]))
        if self.is_encoder_decoder:
            return KeptDtypeStepOutput(source_attributions=torch.stack(source_rows), step_scores={},
                                       target_attributions=torch.stack(target_rows) if with_target else None)
        return KeptDtypeStepOutput(source_attributions=None, target_attributions=torch.stack(target_rows),
                                   step_scores={})

    @staticmethod
    def _placed(row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``row`` over the real tokens, written at their places in the padded batch (0 on padding)."""
        keep = mask.bool().cpu()
        if int(keep.sum()) != row.shape[0]:
            raise InputError(f"The step explained {row.shape[0]} tokens but inseq's batch row has {int(keep.sum())}; "
                             "skip_tokens and template inputs are not available through inseq.")
        placed = row.new_zeros(keep.shape[0])
        placed[keep] = row
        return placed


def register_inseq_methods() -> Dict[str, type]:
    """Define (once) and return the inseq method classes, by inseq name (``"ct_attn_lrp"``...)."""
    for package_name, inseq_name in INSEQ_METHOD_NAMES.items():
        if inseq_name not in _REGISTERED:
            _REGISTERED[inseq_name] = type(f"Inseq{package_name}", (PackageMethodSteps, FeatureAttribution),
                                           {"method_name": inseq_name, "package_method": package_name,
                                            "__doc__": f"The package's {package_name} as the inseq method "
                                                       f"{inseq_name!r}."})
    return dict(_REGISTERED)


def inseq_method_names() -> List[str]:
    """The names :func:`register_inseq_methods` registers."""
    return sorted(INSEQ_METHOD_NAMES.values())
