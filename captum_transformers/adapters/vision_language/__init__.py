"""Vision-language decoders: a vision tower's tokens inside a causal decoder (LLaVA, Qwen2-VL,
Gemma 3), mapped back to the image's pixels.
"""
from .gemma3 import Gemma3Adapter
from .llava import LlavaAdapter
from .qwen2_vl import Qwen2VLAdapter

__all__ = ["Gemma3Adapter", "LlavaAdapter", "Qwen2VLAdapter"]
