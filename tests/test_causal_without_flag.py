"""Causal decoders whose attention sets no ``is_causal`` flag (kernel.CAUSAL_WITHOUT_FLAG): Doge.

Doge's dynamic-mask attention adds a learned per-head bias (B, H, Q, K) to its causal mask and
does not say it is causal, so its maps were read at row 0 (an encoder's CLS) and its causal-LM
logits refused. Now raw attention is the model's own eager row at each example's last real
token, and a padded batch equals the single calls.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.coverage.shrink import build_model, small_config  # noqa: E402

from captum_transformers import GenericAttention, RawAttention  # noqa: E402

IDS = torch.tensor([[5, 9, 12, 7, 30, 11], [6, 8, 14, 21, 0, 0]])
MASK = (IDS != 0).long()


@pytest.fixture(scope="module", params=["DogeForCausalLM", "DogeForSequenceClassification"])
def doge(request):
    head = "causal-lm" if request.param.endswith("CausalLM") else "sequence-classification"
    return build_model(small_config("doge", request.param, head), request.param)


def test_raw_attention_is_the_eager_row_of_the_last_real_token(doge):
    target = 7 if isinstance(doge, transformers.DogeForCausalLM) else 1
    maps = RawAttention(doge).attribute(IDS, target=target, forward_kwargs={"attention_mask": MASK})
    with torch.no_grad():
        eager = doge(input_ids=IDS, attention_mask=MASK, output_attentions=True).attentions[-1].mean(1)
    last = MASK.sum(1) - 1
    expected = eager[torch.arange(2), last] * MASK
    torch.testing.assert_close(maps, expected, rtol=0, atol=1e-6)  # its eager softmax runs in float32


def test_padded_batch_equals_single_calls(doge):
    target = 7 if isinstance(doge, transformers.DogeForCausalLM) else 1
    method = GenericAttention(doge)
    batch = method.attribute(IDS, target=target, forward_kwargs={"attention_mask": MASK})
    single = method.attribute(IDS[1:, :4], target=target, forward_kwargs={"attention_mask": MASK[1:, :4]})
    torch.testing.assert_close(batch[1, :4], single[0], rtol=1e-8, atol=1e-12)
