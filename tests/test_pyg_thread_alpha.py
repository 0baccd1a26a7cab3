"""TransformerConv's attention weights are this thread's, whatever another thread runs.

``TransformerConv`` keeps ``alpha`` in its ``_alpha`` field until its forward returns; a plain
inference call of the same model in another thread overwrites that field. The explanation
must read what its own forward computed. The race is made deterministic, not timed: a message
hook of the test hands control to a plain-inference thread right after the explaining
thread's message ran, and waits until that thread's whole forward (on another graph batch,
so other weights) has written the field; then the explanation goes on.
"""
from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("torch_geometric")

from captum_transformers import AttentionRollout, ConservativeLRP, GenericAttention, RawAttention  # noqa: E402
from captum_transformers.methods.lrp import TransformerLRP  # noqa: E402
from pyg_models import graph_classifier, graphs  # noqa: E402


class Interleaved:
    """Around ``explain()``: after each message of the explaining thread, one plain forward of
    the same model in a second thread runs to completion (its own graphs)."""

    def __init__(self, model, other_inputs):
        self.model, self.other = model, other_inputs
        self.explainer = None
        self.go, self.done, self.stop = threading.Event(), threading.Event(), False
        self.plain_calls = 0

    def _bystander(self):
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            with torch.no_grad():
                self.model(*self.other)
            self.plain_calls += 1
            self.done.set()

    def _hook(self, _module, _inputs, _out):
        if threading.current_thread() is self.explainer:
            self.done.clear()
            self.go.set()
            self.done.wait()
        return None

    def run(self, explain):
        thread = threading.Thread(target=self._bystander)
        thread.start()
        handles = [conv.register_message_forward_hook(self._hook) for conv in self.model.convs]
        self.explainer = threading.current_thread()
        try:
            return explain()
        finally:
            for handle in handles:
                handle.remove()
            self.stop = True
            self.go.set()
            thread.join()


METHODS = {
    "RawAttention": lambda m: RawAttention(m),
    "AttentionRollout": lambda m: AttentionRollout(m),
    "GenericAttention": lambda m: GenericAttention(m),
    "ConservativeLRP": lambda m: ConservativeLRP(m, variant="AH"),
    "TransformerLRP": lambda m: TransformerLRP(m),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_maps_equal_the_single_thread_maps_while_another_thread_runs_inference(method):
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs((3, 5, 4), seed=0)
    _, other = graphs((6, 2), seed=7)
    explain = lambda: METHODS[method](model).attribute(  # noqa: E731
        x, additional_forward_args=(edge_index, batch), target=[0, 1, 0], return_tokens=True)
    alone = explain()
    interleaved = Interleaved(model, other)
    raced = interleaved.run(explain)
    assert interleaved.plain_calls >= 2  # the other thread really ran between messages
    assert torch.equal(raced, alone)
    assert model.convs[0]._alpha is None  # the plain forwards left the module as PyG does


def test_a_plain_inference_loop_beside_explanations_changes_no_map():
    """The brief's form: one thread explains repeatedly while another runs plain inference in
    a bounded loop; every map equals the single-thread one (bit for bit)."""
    model = graph_classifier("TransformerConv")
    _, (x, edge_index, batch) = graphs((3, 5, 4), seed=0)
    _, other = graphs((6, 2), seed=7)
    alone = RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
    finished = threading.Event()

    def bystander():
        for _ in range(2000):
            if finished.is_set():
                return
            with torch.no_grad():
                model(*other)

    thread = threading.Thread(target=bystander)
    thread.start()
    try:
        maps = [RawAttention(model).attribute(x, additional_forward_args=(edge_index, batch), return_tokens=True)
                for _ in range(10)]
    finally:
        finished.set()
        thread.join()
    for found in maps:
        assert torch.equal(found, alone)
