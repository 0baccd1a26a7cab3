"""Tiny float64 Qwen2-VL, Qwen2.5-VL and Gemma 3 vision-language models (random weights, built
from configs) for the VLM family tests.

Qwen2-VL / 2.5-VL: a 2-layer vision tower over 4x4 patches (temporal patch 2), 2x2 patch
merging, the decoder a 2-layer Qwen2 with M-RoPE (``mrope_section`` over its 2 rotary pairs).
An image of ``(h, w)`` patches enters as ``h * w`` flat patch rows and fills ``h * w / 4``
placeholder tokens. Qwen2.5-VL's windows hold 2x2 merged cells (16 patches); its second layer
attends over the whole image (``fullatt_block_indexes=[1]``).

Gemma 3: a 2-layer SigLIP tower over 16x16 images with 4x4 patches (a 4x4 grid), average pooled
to ``GEMMA_TOKENS`` = 4 image tokens; the decoder has a sliding layer (window 3) and a full one.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, PAD, BOS, EOS = 40, 0, 1, 2
VISION_START, VISION_END, IMAGE, VIDEO = 33, 34, 35, 36
PATCH, TEMPORAL, MERGE = 4, 2, 2
GEMMA_SIZE, GEMMA_TOKENS = 16, 4

_TEXT = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
_MROPE = {"rope_type": "default", "mrope_section": [1, 1, 0], "rope_theta": 10000.0}
_QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
                 vision_end_token_id=VISION_END)


def _randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """float64, eval mode, weights drawn at unit scale (embeddings N(0, 1), matrices N(0, 1/fan_in)) instead
    of the 0.02 init, so attention maps and relevance differ clearly between tokens."""
    model = model.to(torch.float64).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                continue
            scale = 1.0 if "embed" in name else parameter[0].numel() ** -0.5
            parameter.copy_(scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model


def build_qwen2_vl(seed: int = 0, impl: str = "eager") -> torch.nn.Module:
    torch.manual_seed(seed)
    vision = dict(depth=2, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                  temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, in_channels=3)
    config = transformers.Qwen2VLConfig(vision_config=vision, text_config={**_TEXT, "rope_parameters": _MROPE},
                                        attn_implementation=impl, **_QWEN_IDS)
    return _randomized(transformers.Qwen2VLForConditionalGeneration(config), seed)


def build_qwen2_5_vl(seed: int = 0, impl: str = "eager") -> torch.nn.Module:
    torch.manual_seed(seed)
    vision = dict(depth=2, hidden_size=16, out_hidden_size=16, intermediate_size=32, num_heads=2, patch_size=PATCH,
                  temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, in_channels=3,
                  window_size=PATCH * MERGE * 2, fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config={**_TEXT, "rope_parameters": _MROPE},
                                           attn_implementation=impl, **_QWEN_IDS)
    return _randomized(transformers.Qwen2_5_VLForConditionalGeneration(config), seed)


def build_gemma3(seed: int = 0, impl: str = "eager") -> torch.nn.Module:
    torch.manual_seed(seed)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=GEMMA_SIZE, patch_size=PATCH, num_channels=3, vision_use_head=False)
    text = dict(_TEXT, head_dim=4, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    config = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=GEMMA_TOKENS,
                                       image_token_id=IMAGE, boi_token_index=VISION_START,
                                       eoi_token_index=VISION_END, attn_implementation=impl)
    return _randomized(transformers.Gemma3ForConditionalGeneration(config), seed)


BUILDERS = {"qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl, "gemma3": build_gemma3}


def qwen_prompt(before: List[int], grid: Tuple[int, int], after: List[int]) -> List[int]:
    """``before``, vision start, the ``h * w / MERGE**2`` placeholders of a (h, w)-patch image, vision end, ``after``."""
    return list(before) + [VISION_START] + [IMAGE] * (grid[0] * grid[1] // MERGE ** 2) + [VISION_END] + list(after)


def gemma_prompt(before: List[int], after: List[int]) -> List[int]:
    return list(before) + [VISION_START] + [IMAGE] * GEMMA_TOKENS + [VISION_END] + list(after)


def qwen_pixels(grids: List[Tuple[int, int]], seed: int = 0) -> Dict[str, torch.Tensor]:
    """``pixel_values`` (patch rows of every image, processor layout) and ``image_grid_thw``."""
    generator = torch.Generator().manual_seed(seed)
    rows = sum(h * w for h, w in grids)
    values = torch.randn(rows, 3 * TEMPORAL * PATCH * PATCH, generator=generator, dtype=torch.float64)
    return {"pixel_values": values, "image_grid_thw": torch.tensor([[1, h, w] for h, w in grids])}


def gemma_pixels(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, GEMMA_SIZE, GEMMA_SIZE, generator=generator, dtype=torch.float64)
