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

from .timm import TimmAdapter  # noqa: E402

_TIMM = TimmAdapter()
register_adapter("timm.models.vision_transformer.VisionTransformer", _TIMM)
register_adapter("timm.models.eva.Eva", _TIMM)

__all__ += ["TimmAdapter"]

from .torch_mha import TorchMHAAdapter  # noqa: E402

# User models are found through their nn.MultiheadAttention submodules.
register_adapter("torch.nn.modules.activation.MultiheadAttention", TorchMHAAdapter())

__all__ += ["TorchMHAAdapter"]

from .inline_attention import InlineAttentionAdapter  # noqa: E402

# Inline attention (softmax then self.dropout) is invisible to the AttentionInterface kernel.
_INLINE = InlineAttentionAdapter()
register_adapter("transformers.models.lxmert.modeling_lxmert.LxmertPreTrainedModel", _INLINE)
register_adapter("transformers.models.visual_bert.modeling_visual_bert.VisualBertPreTrainedModel", _INLINE)

__all__ += ["InlineAttentionAdapter"]

from .detr import DetrAdapter  # noqa: E402

# Before the generic PreTrainedModel entry in the MRO of every DETR class.
register_adapter("transformers.models.detr.modeling_detr.DetrPreTrainedModel", DetrAdapter())

__all__ += ["DetrAdapter"]
