"""Captum ``Attribution`` classes over attention traces, and their registry."""
from .base import TraceAttribution
from .conservative_lrp import ConservativeLRP
from .lrp import AttnLRP, RuleGradientXInput, TransformerLRP
from .transformer_relevance import PartialLRP, TransformerRelevance
from .generic_attention import GenericAttention
from .grad_cam import AttentionGradCAM
from .raw_attention import RawAttention
from .rollout import AttentionRollout
from .attention_flow import AttentionFlow

# Every attention method, for tests and tools that iterate over methods.
ATTENTION_METHODS = (RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention)

# Relevance-propagation methods (Gradient x Input under LRP rules).
RELEVANCE_METHODS = (ConservativeLRP, TransformerLRP, AttnLRP)
# Attention maps weighted by LRP relevance (need per-operation rules: HF and timm models).
LRP_ATTENTION_METHODS = (TransformerRelevance, PartialLRP)

__all__ = ["ConservativeLRP", "RELEVANCE_METHODS", "LRP_ATTENTION_METHODS", "AttnLRP", "RuleGradientXInput",
           "TransformerLRP", "PartialLRP", "TransformerRelevance", "TraceAttribution", "RawAttention", "AttentionRollout", "AttentionGradCAM", "GenericAttention",
           "AttentionFlow", "ATTENTION_METHODS"]
