"""captum_transformers: class-specific Transformer explanations as Captum attributions.

Example::

    >>> from captum_transformers import GenericAttention
    >>> maps = GenericAttention(model).attribute(pixel_values, target=labels)

Importing this package imports torch and captum only; transformers, timm and
torch_geometric are imported when a model of that family is explained.
"""
from .adapters import Adapter, HuggingFaceAdapter
from .errors import CaptumTransformersError, CaptureError, InputError, NotSoftmaxAttentionError, UnsupportedModelError
from .methods import (ATTENTION_METHODS, LRP_ATTENTION_METHODS, RELEVANCE_METHODS, AttentionGradCAM, AttentionRollout,
                      AttnLRP, ConservativeLRP, GenericAttention, PartialLRP, RawAttention, RuleGradientXInput,
                      TraceAttribution, TransformerLRP, TransformerRelevance)
from .methods import AttentionFlow
from .propagation.rules.rule_set import RuleSet
from .adapters.registry import get_adapter, register_adapter, registered_adapters
from .capture.trace import AttentionRecord, AttentionTrace, Block, CaptureSpec, InputSpan, StreamLayouts, TokenLayout

__version__ = "0.1.0"

__all__ = [
    "Adapter", "HuggingFaceAdapter", "CaptumTransformersError", "CaptureError", "InputError",
    "UnsupportedModelError", "NotSoftmaxAttentionError", "ATTENTION_METHODS", "RELEVANCE_METHODS", "ConservativeLRP", "RuleSet",
    "LRP_ATTENTION_METHODS", "AttnLRP", "PartialLRP", "RuleGradientXInput", "TransformerLRP", "TransformerRelevance", "AttentionGradCAM", "AttentionRollout", "GenericAttention",
    "AttentionFlow",
    "RawAttention", "TraceAttribution", "get_adapter", "register_adapter", "registered_adapters",
    "AttentionRecord", "AttentionTrace", "Block", "CaptureSpec", "InputSpan", "StreamLayouts", "TokenLayout", "__version__",
]

from .methods.detection import Detections, explain_detections  # noqa: E402
from .integrations.captum_llm_layers import LayerAttnLRP, LayerConservativeLRP  # noqa: E402
from .generation import GenerationAttribution, GenerationResult  # noqa: E402
from .compat.checkpointing import keep_gradient_checkpointing  # noqa: E402

__all__ += ["Detections", "explain_detections", "LayerAttnLRP", "LayerConservativeLRP", "GenerationAttribution",
            "GenerationResult", "keep_gradient_checkpointing"]
