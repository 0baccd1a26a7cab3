"""Captum ``Attribution`` classes over attention traces, and their registry."""
from .base import TraceAttribution
from .conservative_lrp import ConservativeLRP
from .generic_attention import GenericAttention
from .grad_cam import AttentionGradCAM
from .raw_attention import RawAttention
from .rollout import AttentionRollout

# Every attention method, for tests and tools that iterate over methods.
ATTENTION_METHODS = (RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention)

# Relevance-propagation methods (Gradient x Input under LRP rules).
RELEVANCE_METHODS = (ConservativeLRP,)

__all__ = ["ConservativeLRP", "RELEVANCE_METHODS", "TraceAttribution", "RawAttention", "AttentionRollout", "AttentionGradCAM", "GenericAttention",
           "ATTENTION_METHODS"]
