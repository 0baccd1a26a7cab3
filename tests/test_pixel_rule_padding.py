"""The z^B pixel rule (PixelBoundedConv) under each conv2d padding it accepts, and its refusal of uneven 'same'.

Its forward must be the convolution's own, and its backward (relevance R_x = x * grad) must conserve
the relevance put on the output (sum R_x == sum R_y, R_y = y * grad): z^B's denominator z carries
the bias-free part, so all of R_y reaches the pixels.
"""
import pytest
import torch
import torch.nn.functional as F

from captum_transformers.errors import CaptureError
from captum_transformers.propagation.rules.pixel import PixelBoundedConv


def _conv(padding, kernel, dilation, stride, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=generator).requires_grad_()
    weight = torch.randn(5, 3, kernel, kernel, dtype=torch.float64, generator=generator)
    bias = torch.randn(5, dtype=torch.float64, generator=generator)
    args = (x, weight, bias, stride, padding, dilation, 1)
    return x, weight, args, generator


@pytest.mark.parametrize("padding, kernel, dilation, stride", [
    ("valid", 4, 1, 4),    # SigLIP-style patch embedding
    ("same", 3, 1, 1),
    ("same", 3, 2, 1),
    ("same", 2, 2, 1),     # even kernel, but dilation * (k - 1) = 2 pads evenly
    (1, 3, 1, 1),
])
def test_forward_is_conv2d_and_relevance_is_conserved(padding, kernel, dilation, stride):
    x, weight, args, generator = _conv(padding, kernel, dilation, stride)
    y = PixelBoundedConv.apply(x, weight, F.conv2d, args, {})
    assert torch.equal(y, F.conv2d(*args))
    grad = torch.randn(y.shape, dtype=torch.float64, generator=generator)
    (ratio,) = torch.autograd.grad(y, x, grad)
    relevance_in = (ratio * x).sum()
    relevance_out = (y * grad).sum()
    torch.testing.assert_close(relevance_in, relevance_out, rtol=0, atol=1e-6)
    # The rule differs from the plain gradient (the test could tell them apart).
    (plain,) = torch.autograd.grad(F.conv2d(*args), x, grad)
    assert not torch.allclose(ratio, plain)


def test_keyword_padding_is_read_too():
    x, weight, args, generator = _conv("same", 3, 2, 1)
    kwargs = dict(stride=1, padding="same", dilation=2, groups=1)
    y = PixelBoundedConv.apply(x, weight, F.conv2d, (x, weight, args[2]), kwargs)
    grad = torch.randn(y.shape, dtype=torch.float64, generator=generator)
    (ratio,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close((ratio * x).sum(), (y * grad).sum(), rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:Using padding=.same.")
def test_uneven_same_padding_is_refused_with_the_fix():
    x, weight, args, _ = _conv("same", 4, 1, 1)
    with pytest.raises(CaptureError, match="unevenly") as error:
        PixelBoundedConv.apply(x, weight, F.conv2d, args, {})
    message = str(error.value)
    assert "(4, 4)" in message and "pixel_conv='gradient'" in message


def test_a_copy_of_the_input_pixels_gets_the_rule_too():
    """accelerate moves the pixels to the patch embedding's device (a ToCopy node, not a leaf); a
    cast does the same. Before, such a copy silently got the plain gradient."""
    import dataclasses

    from captum_transformers.propagation.rules.operations import OperationRules
    from captum_transformers.propagation.rules.pixel import is_input_pixels
    from captum_transformers.propagation.rules.rule_set import RuleSet

    x, weight, args, generator = _conv("valid", 4, 1, 4)
    rules = dataclasses.replace(RuleSet.GRADIENT, pixel_conv="zB")
    copied = x.to(torch.float32).to(torch.float64)  # two copies back to the input leaf
    assert is_input_pixels(x) and is_input_pixels(copied) and not is_input_pixels(x * 2.0)
    grad = torch.randn(2, 5, 4, 4, dtype=torch.float64, generator=generator)
    with OperationRules(rules, batch_size=2):
        y_leaf = F.conv2d(x, *args[1:])
        y_copy = F.conv2d(copied, *args[1:])
    (g_leaf,) = torch.autograd.grad(y_leaf, x, grad)
    (g_copy,) = torch.autograd.grad(y_copy, x, grad)
    expected = torch.autograd.grad(PixelBoundedConv.apply(x, weight, F.conv2d, args, {}), x, grad)[0]
    torch.testing.assert_close(g_leaf, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_copy, expected, rtol=1e-6, atol=1e-6)  # the float32 round trip rounds x
