"""quantus_explain_func: Quantus' explain_func signature around the package's methods (Quantus itself
is not needed: the adapter is called as Quantus calls it)."""
import numpy as np
import pytest
import torch
from torch import nn

from captum_transformers.errors import InputError
from captum_transformers.evaluation.quantus_bridge import quantus_explain_func


class FakeExplainer:
    built = 0

    def __init__(self, model):
        FakeExplainer.built += 1
        FakeExplainer.last = self
        self.calls = []

    def attribute(self, inputs, target=None, **kwargs):
        self.calls.append((inputs, target, kwargs))
        channel = torch.arange(inputs.shape[1], dtype=inputs.dtype).reshape(1, -1, 1, 1)
        return inputs * 0 + channel + target.reshape(-1, 1, 1, 1).to(inputs.dtype)


def tiny():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).eval()


def test_quantus_signature_numpy_in_numpy_out_and_channel_reduction():
    model = tiny()
    x = np.random.RandomState(0).rand(2, 3, 4, 4).astype(np.float32)
    y = np.array([1, 0])
    summed = quantus_explain_func(FakeExplainer)(model=model, inputs=x, targets=y, device="cpu")
    assert isinstance(summed, np.ndarray) and summed.shape == (2, 1, 4, 4) and summed.dtype == np.float32
    assert summed[0, 0, 0, 0] == (0 + 1 + 2) + 3 * 1 and summed[1, 0, 0, 0] == 3
    mean = quantus_explain_func(FakeExplainer, channel_reduce="mean")(model, x, y)
    assert mean[0, 0, 0, 0] == pytest.approx(2.0)
    kept = quantus_explain_func(FakeExplainer, channel_reduce="none")(model, x, y)
    assert kept.shape == (2, 3, 4, 4)


def test_explainer_is_built_once_per_model_and_kwargs_reach_attribute():
    FakeExplainer.built = 0
    explain = quantus_explain_func(FakeExplainer, start=1)
    model, x, y = tiny(), np.zeros((1, 3, 4, 4), np.float32), np.array([0])
    explain(model, x, y)
    explain(model, x, y, extra=2, device="cpu")
    assert FakeExplainer.built == 1
    assert [call[2] for call in FakeExplainer.last.calls] == [{"start": 1}, {"start": 1, "extra": 2}]
    explain(tiny(), x, y)
    assert FakeExplainer.built == 2


def test_package_method_by_name_matches_calling_it_directly():
    pytest.importorskip("timm")
    from captum_transformers import GenericAttention
    from captum_transformers.tasks.digits.model import build_digit_model
    torch.manual_seed(0)
    model = build_digit_model().eval()
    x = torch.rand(2, 3, 32, 32)
    y = torch.tensor([3, 7])
    maps = quantus_explain_func("generic-attention")(model, x.numpy(), y.numpy())
    direct = GenericAttention(model).attribute(x, target=y).sum(dim=1, keepdim=True)
    assert maps.shape == (2, 1, 32, 32)
    assert np.allclose(maps, direct.detach().numpy(), atol=1e-6)
    by_class = quantus_explain_func(GenericAttention)(model, x, y)   # tensors are accepted too
    assert np.allclose(by_class, maps, atol=1e-6)


def test_clear_errors():
    x, y = np.zeros((2, 3, 4, 4), np.float32), np.array([0, 1])
    with pytest.raises(InputError, match="channel_reduce"):
        quantus_explain_func(FakeExplainer, channel_reduce="max")
    with pytest.raises(InputError, match="unknown method"):
        quantus_explain_func("no-such-method")
    with pytest.raises(InputError, match="neither"):
        quantus_explain_func(42)
    with pytest.raises(InputError, match="targets"):
        quantus_explain_func(FakeExplainer)(tiny(), x, y[:1])
    with pytest.raises(InputError, match="nn.Module"):
        quantus_explain_func(FakeExplainer)(lambda v: v, x, y)


class GradientTimesInput:
    def __init__(self, model):
        self.model = model

    def attribute(self, inputs, target=None):
        inputs = inputs.clone().requires_grad_(True)
        self.model(inputs).gather(1, target[:, None]).sum().backward()
        return inputs * inputs.grad


@pytest.mark.parametrize("model_dtype, input_dtype", [(torch.float64, np.float32), (torch.float32, np.float64)])
def test_inputs_take_the_dtype_of_the_models_parameters(model_dtype, input_dtype):
    model = tiny().to(model_dtype)
    x = np.random.RandomState(0).rand(2, 3, 4, 4).astype(input_dtype)
    maps = quantus_explain_func(GradientTimesInput)(model=model, inputs=x, targets=np.array([0, 1]))
    weight = model[1].weight.detach().double().numpy()
    expected = (x.reshape(2, -1) * weight[[0, 1]]).reshape(2, 3, 4, 4).sum(axis=1, keepdims=True)
    assert maps.dtype == np.float32 and np.allclose(maps, expected, atol=1e-5)
