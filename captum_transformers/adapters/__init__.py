"""Model-family adapters and their registration.

Importing this package registers the built-in adapters by dotted class name, so no
optional dependency (transformers, timm, torch_geometric) is imported until a model of
that family is explained.
"""
from ..registry import register_adapter
from .base import Adapter
from .recorder import Recorder

__all__ = ["Adapter", "Recorder"]

from .huggingface import HuggingFaceAdapter  # noqa: E402

register_adapter("transformers.modeling_utils.PreTrainedModel", HuggingFaceAdapter())

__all__ += ["HuggingFaceAdapter"]
