"""Tiny float64 language models (random weights, built from configs) for the generation tests,
and a stand-in tokenizer that reads space-separated token ids.

One builder per family: Llama (grouped-query attention, RoPE), GPT-2 (learned positions),
Qwen2 with a sliding window shorter than the sequence, Gemma 3 with sliding and full layers,
BART and T5 (encoder-decoders). Every builder takes the attention implementation.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 40
PAD, EOS = 0, 2
WINDOW = 3  # Qwen2 / Gemma 3 sliding window: shorter than every prompt + output of the tests
_DECODER = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=EOS,
                pad_token_id=PAD)


class IdTokenizer:
    """Reads ``"1 5 7"`` as the ids [1, 5, 7] and names id ``i`` ``"t{i}"``."""

    pad_token_id, eos_token_id = PAD, EOS

    def convert_ids_to_tokens(self, ids: List[int]) -> List[str]:
        return [f"t{i}" for i in ids]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [int(x) for x in text.split()]}


def _llama(impl: str) -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER, attn_implementation=impl))


def _gpt2(impl: str) -> torch.nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=1, eos_token_id=EOS,
        attn_implementation=impl))


def _qwen2(impl: str) -> torch.nn.Module:
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **_DECODER, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0, attn_implementation=impl))


def _gemma3(impl: str) -> torch.nn.Module:
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **_DECODER, head_dim=4, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        attn_implementation=impl))


def _bart(impl: str) -> torch.nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        init_std=0.1, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS, decoder_start_token_id=EOS,
        forced_eos_token_id=None, attn_implementation=impl))


def _t5(impl: str) -> torch.nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD, attn_implementation=impl))


BUILDERS: Dict[str, Callable[[str], torch.nn.Module]] = {
    "llama": _llama, "gpt2": _gpt2, "qwen2_sliding": _qwen2, "gemma3_mixed": _gemma3, "bart": _bart, "t5": _t5,
}
ENCODER_DECODERS = ("bart", "t5")


def build(family: str, impl: str = "eager", seed: int = 0) -> torch.nn.Module:
    """A float64 model of ``family`` in eval mode."""
    torch.manual_seed(seed)
    return BUILDERS[family](impl).double().eval()
