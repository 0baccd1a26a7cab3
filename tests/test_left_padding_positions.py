"""Left padding and learned absolute positions: a model that numbers tokens from the first
(padding) position explains a left-padded row differently from the same text alone. The
HuggingFace adapter warns, with the fix, when no position_ids come with such a batch."""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from captum_transformers import GenericAttention  # noqa: E402
from captum_transformers.adapters.huggingface.adapter import HuggingFaceAdapter  # noqa: E402
from hf_models import CASES  # noqa: E402


def _left_padded(vocab=99):
    ids = torch.randint(3, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # row 1: three pads in front of four real tokens
    return ids, mask


def _explain(model, ids, **forward_kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Encoders read CLS at position 0, a pad in a left-padded row: explained at the last token here.
        adapter = None if getattr(model.config, "is_decoder", False) or "Causal" in type(model).__name__ \
            else HuggingFaceAdapter(query_rows="last")
        maps = GenericAttention(model, adapter=adapter).attribute(ids, target=1, forward_kwargs=forward_kwargs)
    position_warnings = [w for w in caught if "position" in str(w.message) and issubclass(w.category, UserWarning)]
    return maps, position_warnings


@pytest.mark.parametrize("case", ["gpt2", "bert"])
def test_left_padding_without_position_ids_warns_with_the_fix(case):
    model = CASES[case].model()
    ids, mask = _left_padded()
    _, caught = _explain(model, ids, attention_mask=mask)
    assert len(caught) == 1, [str(w.message) for w in caught]   # once per call, not once per layer
    message = str(caught[0].message)
    assert "rows [1]" in message and "left padding" in message
    assert "position_ids" in message and "cumsum(-1) - 1" in message and "padding_side = 'right'" in message


@pytest.mark.parametrize("case", ["gpt2", "bert"])
def test_no_warning_with_position_ids_or_right_padding(case):
    model = CASES[case].model()
    ids, mask = _left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert _explain(model, ids, attention_mask=mask, position_ids=positions)[1] == []
    right = torch.ones_like(mask)
    right[1, 4:] = 0
    assert _explain(model, ids, attention_mask=right)[1] == []


@pytest.mark.parametrize("case", ["llama_gqa", "roberta"])
def test_no_warning_for_rotary_or_pad_counting_positions(case):
    # Llama: rotary positions, no table; RoBERTa counts positions from the non-pad input ids.
    model = CASES[case].model()
    ids, mask = _left_padded()
    assert _explain(model, ids, attention_mask=mask)[1] == []


def test_the_fix_makes_the_left_padded_row_equal_the_single_call():
    model = CASES["gpt2"].model()
    ids, mask = _left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched, _ = _explain(model, ids, attention_mask=mask, position_ids=positions)
    alone, _ = _explain(model, ids[1:, 3:], attention_mask=mask[1:, 3:])
    torch.testing.assert_close(batched[1, 3:], alone[0], rtol=1e-4, atol=1e-6)
    unfixed, _ = _explain(model, ids, attention_mask=mask)
    assert not torch.allclose(unfixed[1, 3:], alone[0], rtol=1e-4, atol=1e-6)
