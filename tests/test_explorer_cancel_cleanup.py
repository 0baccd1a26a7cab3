"""A job cancelled at ANY torch call leaves the model and the worker thread as they were.

The explorer cancels a running explanation by raising ``Cancelled`` from a torch-function
mode at the next torch call (``explaining.stoppable``). The explanation unwinds through the
package's context managers (frozen parameters made to require grad, grad mode, the
``exclusive`` holders, the mode itself); their cleanup runs torch calls too, so a stop check
that kept raising on every call left frozen parameters requiring grad, ``patching._FORCED_GRAD``
holding them forever, and the thread in no-grad mode. No timing: ``should_stop`` turns true
after a counted number of torch calls, and every count through a full run is tried."""
from __future__ import annotations

import pytest
import torch

from captum_transformers.model_state import exclusive, patching
from captum_transformers.explorer.explaining import Cancelled
from captum_transformers.methods.catalog import METHOD_FACTORIES
from explorer_workspaces import image_workspace

# a gradient method with frozen-parameter forcing, an LRP method, a grad-mode-only method,
# and Integrated Gradients (internal batches)
METHODS = ("grad-cam", "lrp", "rollout", "raw-attention", "integrated-gradients")
STRIDE = 7


def frozen_workspace():
    """The explorer's tiny ViT with every parameter but the head's frozen (a fine-tuned head)."""
    workspace = image_workspace(batch=2)
    for name, parameter in workspace.model.named_parameters():
        parameter.requires_grad_(name.startswith("head"))
    return workspace


def thread_and_model_state(model):
    return {"grad mode": torch.is_grad_enabled(),
            "requires_grad": [p.requires_grad for p in model.parameters()],
            "forced grad entries": len(patching._FORCED_GRAD),
            "exclusive holders": len(exclusive._HOLDERS),
            "explanations running here": len(exclusive._running_here()),
            "torch-function modes": torch._C._len_torch_function_stack()}


def stop_after(calls: int):
    """A ``should_stop`` that turns true at its ``calls + 1``-th question, and counts them."""
    asked = [0]

    def should_stop():
        asked[0] += 1
        return asked[0] > calls
    return should_stop, asked


def plain_attribution(workspace, method):
    explainer = METHOD_FACTORIES[method](workspace.model)
    return explainer.attribute(workspace.inputs[0][:1], target=torch.tensor([1])).detach()


@pytest.mark.parametrize("method", METHODS)
def test_a_cancel_at_any_torch_call_restores_the_model_and_the_thread(method):
    workspace = frozen_workspace()
    before_state = thread_and_model_state(workspace.model)
    before_map = plain_attribution(workspace, method)
    never, asked = stop_after(10 ** 9)
    workspace.explain(method, {}, {0: 1}, should_stop=never)
    full_run = asked[0]
    assert full_run > 50, f"{method} asked the stop check only {full_run} times"
    workspace._cache.clear()
    for calls in range(0, full_run, STRIDE):
        should_stop, _ = stop_after(calls)
        with pytest.raises(Cancelled):
            workspace.explain(method, {}, {0: 1}, should_stop=should_stop)
        assert thread_and_model_state(workspace.model) == before_state, (method, calls)
        assert workspace.cached(method, {}, {0: 1}) == {}, (method, calls)
        after_map = plain_attribution(workspace, method)
        assert torch.equal(after_map, before_map), (method, calls)


def test_a_map_computed_after_a_swallowed_cancel_is_neither_returned_nor_cached():
    """The stop check raises once; a method that caught ``Cancelled`` and tried again would
    finish its map after the stop. ``explain`` refuses it (``Cancelled``) and caches nothing."""

    def retrying_builder(name, model, arguments):
        explainer = METHOD_FACTORIES[name](model, **arguments)
        original = explainer.attribute

        def attribute(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except BaseException:  # a careless fallback: tries again
                return original(*args, **kwargs)
        explainer.attribute = attribute
        return explainer

    workspace = frozen_workspace()
    workspace.method_builder = retrying_builder
    should_stop, _ = stop_after(20)
    with pytest.raises(Cancelled):
        workspace.explain("rollout", {}, {0: 1}, should_stop=should_stop)
    assert workspace.cached("rollout", {}, {0: 1}) == {}
    assert workspace.explain("rollout", {}, {0: 1})[0]["values"]  # a normal call still answers
