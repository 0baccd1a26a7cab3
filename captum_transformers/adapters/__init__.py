"""Model-family adapters and their registration.

Importing this package registers the built-in adapters by dotted class name, so no
optional dependency (transformers, timm, torch_geometric) is imported until a model of
that family is explained.
"""
from .registry import register_adapter
from .base import Adapter
from .huggingface.detr import DetrAdapter
from .graph.graphormer import MODEL_KEYS as _GRAPHORMER_KEYS, GraphormerAdapter
from .huggingface.adapter import HuggingFaceAdapter
from .huggingface.inline_attention import InlineAttentionAdapter
from .vision_language.gemma3 import Gemma3Adapter
from .vision_language.llava import LlavaAdapter
from .vision_language.qwen2_vl import Qwen2VLAdapter
from .huggingface.swin import SwinAdapter, Swinv2Adapter
from ..capture.recorder import Recorder
from .timm.vit import TimmAdapter
from .timm.swin import TimmSwinAdapter
from .torch_mha import TorchMHAAdapter
from .graph.pyg_attention import PyGAttentionAdapter
from .graph.pyg_gps import PyGGPSAdapter
from .graph.refusal import GPS, PYG_ATTENTION

__all__ = ["Adapter", "Recorder", "HuggingFaceAdapter", "TimmAdapter", "TorchMHAAdapter", "InlineAttentionAdapter",
           "DetrAdapter", "PyGAttentionAdapter", "PyGGPSAdapter", "GraphormerAdapter", "SwinAdapter",
           "Swinv2Adapter", "TimmSwinAdapter"]

# (adapter, dotted class names it serves). The registry walks a model's MRO, so the entries
# for LXMERT, VisualBERT and DETR win over the generic PreTrainedModel one.
_BUILT_IN = (
    (HuggingFaceAdapter(), ("transformers.modeling_utils.PreTrainedModel",)),
    (TimmAdapter(), ("timm.models.vision_transformer.VisionTransformer", "timm.models.eva.Eva")),
    # User models are found through their nn.MultiheadAttention submodules.
    (TorchMHAAdapter(), ("torch.nn.modules.activation.MultiheadAttention",)),
    # Inline attention (softmax then self.dropout) is invisible to the AttentionInterface kernel.
    (InlineAttentionAdapter(), ("transformers.models.lxmert.modeling_lxmert.LxmertPreTrainedModel",
                                "transformers.models.visual_bert.modeling_visual_bert.VisualBertPreTrainedModel")),
    (DetrAdapter(), ("transformers.models.detr.modeling_detr.DetrPreTrainedModel",)),
    # Vision-language decoders: a vision tower feeding a causal LM's image tokens.
    (LlavaAdapter(), ("transformers.models.llava.modeling_llava.LlavaForConditionalGeneration",
                      # Refused by it with the reason (crops of each image), not run as text by the generic adapter.
                      "transformers.models.llava_next.modeling_llava_next.LlavaNextForConditionalGeneration",
                      "transformers.models.llava_next_video.modeling_llava_next_video.LlavaNextVideoForConditionalGeneration",
                      "transformers.models.llava_onevision.modeling_llava_onevision.LlavaOnevisionForConditionalGeneration")),
    (Qwen2VLAdapter(), ("transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VLForConditionalGeneration",
                        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLForConditionalGeneration")),
    (Gemma3Adapter(), ("transformers.models.gemma3.modeling_gemma3.Gemma3ForConditionalGeneration",)),
    # PyG's sparse attention layers, found as submodules of the user's graph model.
    (PyGAttentionAdapter(), PYG_ATTENTION),
    (PyGGPSAdapter(), GPS),
    (GraphormerAdapter(), _GRAPHORMER_KEYS),  # the package's Graphormer and transformers 4.x's
    (SwinAdapter(), ("transformers.models.swin.modeling_swin.SwinPreTrainedModel",)),
    (Swinv2Adapter(), ("transformers.models.swinv2.modeling_swinv2.Swinv2PreTrainedModel",)),
    (TimmSwinAdapter(), ("timm.models.swin_transformer.SwinTransformer",
                          "timm.models.swin_transformer_v2.SwinTransformerV2")),
)
for _adapter, _keys in _BUILT_IN:
    for _key in _keys:
        register_adapter(_key, _adapter)
