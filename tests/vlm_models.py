"""Tiny float64 vision-language models (random weights, built from configs) for the VLM tests.

LLaVA: a 2-layer CLIP vision tower over 16x16 images with 4x4 patches (a 4x4 grid, one CLS
token; ``build_siglip_llava``: a SigLIP tower, no CLS), the 2-layer Llama decoder of tests/generation_models.py, a bias-free projector. The
image token id is ``IMAGE``; a prompt holds ``IMAGE_TOKENS`` copies of it per image.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, PAD, EOS, IMAGE = 40, 0, 2, 39
IMAGE_SIZE, PATCH = 16, 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # the "default" strategy drops the CLS token


def llava_config(feature_layer: int = -1, strategy: str = "default") -> "transformers.LlavaConfig":
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                                           num_channels=3)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    return transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                    vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                    multimodal_projector_bias=False, projector_hidden_act="gelu",
                                    attn_implementation="eager")


def build_llava(seed: int = 0, **config) -> torch.nn.Module:
    """A float64 LLaVA in eval mode."""
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(llava_config(**config)).to(torch.float64).eval()
    with torch.no_grad():  # larger weights than the 0.02 init: maps that differ between tokens, images that matter
        for name, parameter in model.named_parameters():
            if "embed" in name or "position" in name:
                parameter.normal_(0, 1)
            elif name.endswith("weight") and parameter.dim() == 2 and ("vision_tower" in name or "layers" in name):
                parameter.normal_(0, 0.4)
            elif name.endswith("weight") and "projector" in name:  # image features about as large as text embeddings
                parameter.normal_(0, 0.1)
    return model


def build_siglip_llava(strategy: str = "default", seed: int = 0) -> torch.nn.Module:
    """A float64 LLaVA with a 2-layer SigLIP tower (no CLS token; 16 patch tokens)."""
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                                             num_channels=3)
    config = transformers.LlavaConfig(vision_config=vision, text_config=llava_config().text_config,
                                      image_token_id=IMAGE, vision_feature_layer=-1,
                                      vision_feature_select_strategy=strategy, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlavaForConditionalGeneration(config).to(torch.float64).eval()


def image_prompt(text_before: List[int], text_after: List[int], images: int = 1) -> List[int]:
    """``text_before``, the placeholder tokens of ``images`` images, ``text_after``."""
    return list(text_before) + [IMAGE] * (IMAGE_TOKENS * images) + list(text_after)


def pixels(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)


def llava_processor() -> "transformers.LlavaProcessor":
    """A LlavaProcessor built offline: a word-level tokenizer over ``t0 .. t38`` and ``<image>``
    (id ``IMAGE``), a CLIP image processor at 16x16; it expands ``<image>`` to the image's tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(IMAGE)}
    vocab["<image>"] = IMAGE
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="t0", eos_token="t2",
                                                     bos_token="t1", unk_token="t3",
                                                     extra_special_tokens={"image_token": "<image>"})
    images = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                             crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
