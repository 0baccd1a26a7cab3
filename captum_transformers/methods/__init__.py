"""Captum ``Attribution`` classes over attention traces, and their registry."""
from .base import TraceAttribution
from .generic_attention import GenericAttention
from .grad_cam import AttentionGradCAM
from .raw_attention import RawAttention
from .rollout import AttentionRollout

# Every attention method, for tests and tools that iterate over methods.
ATTENTION_METHODS = (RawAttention, AttentionRollout, AttentionGradCAM, GenericAttention)

__all__ = ["TraceAttribution", "RawAttention", "AttentionRollout", "AttentionGradCAM", "GenericAttention",
           "ATTENTION_METHODS"]
