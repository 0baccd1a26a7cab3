"""Tiny HuggingFace models built from configs (random weights, no hub), one per family.

Each case gives a model factory and an input factory. Text cases carry an attention
mask with padding in the second example, so padding handling is always exercised.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@dataclasses.dataclass
class Case:
    name: str
    build: Callable[[str], torch.nn.Module]  # attn_implementation -> model
    kind: str  # "text" or "image"
    mask_kwarg: Optional[str] = "attention_mask"
    vocab: int = 99
    image_size: int = 32

    def model(self, attn_implementation: str = "eager", seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self.build(attn_implementation).to(dtype).eval()

    def inputs(self, batch: int = 3, seq: int = 7, seed: int = 1, dtype=torch.float32):
        """(inputs, forward_kwargs) for a batch; text example 1 is padded after 5 tokens."""
        generator = torch.Generator().manual_seed(seed)
        if self.kind == "image":
            return torch.randn(batch, 3, self.image_size, self.image_size, generator=generator, dtype=dtype), {}
        ids = torch.randint(3, self.vocab, (batch, seq), generator=generator)
        mask = torch.ones(batch, seq, dtype=torch.long)
        if batch > 1:
            mask[1, 5:] = 0
        return ids, {self.mask_kwarg: mask}


def _bert(impl):
    return transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=3, attn_implementation=impl))


def _roberta(impl):
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        **SMALL, num_labels=3, vocab_size=99, pad_token_id=1, attn_implementation=impl))


def _distilbert(impl):
    return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_labels=3, vocab_size=99, attn_implementation=impl))


def _vit(impl):
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        **SMALL, image_size=32, patch_size=8, num_labels=5, attn_implementation=impl))


def _deit(impl):
    return transformers.DeiTForImageClassification(transformers.DeiTConfig(
        **SMALL, image_size=32, patch_size=8, num_labels=5, attn_implementation=impl))


def _deit_distilled(impl):
    return transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(
        **SMALL, image_size=32, patch_size=8, num_labels=5, attn_implementation=impl))


def _clip_vision(impl):
    return transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(
        **SMALL, image_size=32, patch_size=8, projection_dim=6, attn_implementation=impl))


def _clip_text(impl):
    return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        **SMALL, vocab_size=99, max_position_embeddings=16, projection_dim=6, eos_token_id=98,
        pad_token_id=0, bos_token_id=97, attn_implementation=impl))


def _gpt2(impl):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=16, bos_token_id=0, eos_token_id=0,
        attn_implementation=impl))


def _llama(impl):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, vocab_size=99, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attn_implementation=impl))


CASES: Dict[str, Case] = {c.name: c for c in [
    Case("bert", _bert, "text"),
    Case("roberta", _roberta, "text"),
    Case("distilbert", _distilbert, "text"),
    Case("vit", _vit, "image"),
    Case("deit", _deit, "image"),
    Case("deit_distilled", _deit_distilled, "image"),
    Case("clip_vision", _clip_vision, "image"),
    Case("clip_text", _clip_text, "text"),
    Case("gpt2", _gpt2, "text"),
    Case("llama_gqa", _llama, "text"),
]}


def decoder_llm(family: str, impl: str, dtype=torch.float32) -> torch.nn.Module:
    """A 2-layer causal LM of ``family`` (llama, qwen2, gemma, mistral) with grouped-query heads,
    vocabulary 53, attention ``impl``, norms moved away from 1 so that norm rules matter."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    config = config_class(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                          attn_implementation=impl, pad_token_id=0)
    torch.manual_seed(0)
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():  # norms away from 1, so the norm rule matters
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.rand_like(parameter) * 0.5)
    return model
