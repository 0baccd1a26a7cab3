"""TransformerConv's recomputed message is checked against the layer's: bit for bit on the CPU
and under deterministic algorithms; within a few units of rounding elsewhere (CUDA), where
PyG's softmax sums each target's edges with an atomic scatter_add_ whose order changes from
call to call, so a node with 3+ incoming edges may get an alpha one rounding step away.

The CUDA path is reached here by replacing the device check (no GPU needed); the messages are
built to differ by one unit of rounding, or by 1e-2.
"""
from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("torch_geometric")

from captum_transformers.adapters.graph import pyg_transformer_alpha
from captum_transformers.adapters.graph.pyg_transformer_alpha import (exact_message_required,  # noqa: E402
                                                                refuse_unless_layer_message)
from captum_transformers.errors import CaptureError  # noqa: E402

BLOCK = types.SimpleNamespace(name="convs.0")


def _messages(step):
    """The layer's message and one moved by ``step`` at a single entry (``"ulp"``: to the next float)."""
    out = torch.randn(12, 2, 4, generator=torch.Generator().manual_seed(0))
    moved = out.clone()
    moved[5, 1, 2] = (torch.nextafter(out[5, 1, 2], torch.tensor(float("inf"))) if step == "ulp"
                      else out[5, 1, 2] + step)
    return moved, out


def _check(message, out):
    refuse_unless_layer_message(BLOCK, message, out, "so its attention weights cannot be read", "Call model.eval().")


def test_on_the_cpu_one_unit_of_rounding_is_refused_and_the_message_names_the_difference():
    message, out = _messages("ulp")
    assert exact_message_required(out)
    with pytest.raises(CaptureError, match=r"differs from the layer's by up to [0-9.e-]+ \([0-9.e-]+ of the largest "
                                           r"value.*bit-for-bit equality is required on the CPU.*dropout"):
        _check(message, out)
    _check(out.clone(), out)  # the same values: accepted


def test_off_the_cpu_a_few_units_of_rounding_are_accepted_and_a_real_difference_is_not(monkeypatch):
    monkeypatch.setattr(pyg_transformer_alpha, "exact_message_required", lambda tensor: False)
    _check(*_messages("ulp"))
    message, out = _messages(1e-2)
    with pytest.raises(CaptureError, match=r"by up to 0\.01 .*8 units of rounding of torch\.float32 .*are allowed"):
        _check(message, out)
    # Dropout zeroes whole messages: far beyond rounding.
    dropped = out.clone()
    dropped[3] = 0
    with pytest.raises(CaptureError, match="dropout"):
        _check(dropped, out)


def test_deterministic_algorithms_require_exact_equality_on_any_device():
    elsewhere = torch.empty(3, device="meta")  # a tensor off the CPU, as a CUDA one is
    mode = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert not exact_message_required(elsewhere)
        torch.use_deterministic_algorithms(True)
        assert exact_message_required(elsewhere)
    finally:
        torch.use_deterministic_algorithms(mode)


def test_a_message_of_another_shape_is_refused_with_both_shapes():
    out = torch.zeros(12, 2, 4)
    with pytest.raises(CaptureError, match=r"shape \(12, 8\).*\(12, 2, 4\)"):
        _check(torch.zeros(12, 8), out)


def test_attention_dropout_in_training_mode_is_refused_also_where_rounding_is_allowed(monkeypatch):
    import torch_geometric.nn as pyg

    from captum_transformers import RawAttention
    from pyg_models import graph_classifier, graphs

    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs((3, 5, 4))
    expected = RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    monkeypatch.setattr(pyg_transformer_alpha, "exact_message_required", lambda tensor: False)
    # The same model explained through the tolerant path gives the same maps (its messages are equal).
    found = RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    assert torch.equal(found, expected)
    for conv in model.convs:
        assert isinstance(conv, pyg.TransformerConv)
        conv.dropout = 0.5
    model.train()
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="recomputed from its arguments differs from the layer's by up to .*dropout"):
        # (allow_stochastic: past the training-mode refusal, to the message check itself)
        RawAttention(model, allow_stochastic=True).attribute(x, additional_forward_args=(edge_index, batch))
