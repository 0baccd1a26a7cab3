"""The z^B rule (Montavon et al., "Explaining nonlinear classification decisions with deep
Taylor decomposition", 2017) on the convolution that reads the pixels: relevance bounded by
each image's lowest and highest pixel value, as a Function whose forward is the convolution's own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import CaptureError
from ..backward_switch import SWITCH
from ..backward_switch import plain_requested as _plain
from .identity_ratio import identity_ratio
from .linear import safe_divide
from .own_output import own_output, saved_tensors


def _numeric_padding(padding, weight: torch.Tensor, dilation):
    """A conv2d ``padding`` as numbers, which ``conv2d_input`` takes: ``"valid"`` (SigLIP's patch
    embedding) is 0; ``"same"`` (stride 1) pads ``dilation * (k - 1) / 2`` per side."""
    if padding == "valid":
        return 0
    if padding == "same":
        dilation = (dilation, dilation) if isinstance(dilation, int) else tuple(dilation)
        total = [d * (k - 1) for d, k in zip(dilation, weight.shape[-2:])]
        if any(t % 2 for t in total):
            raise CaptureError(f"The pixel convolution pads 'same' unevenly (kernel {tuple(weight.shape[-2:])}, "
                               f"dilation {dilation}: dilation * (kernel - 1) is odd), which the z^B rule's backward "
                               "convolution cannot express (it pads both sides equally). Use the gradient rule at "
                               "the pixels instead: dataclasses.replace(rules, pixel_conv='gradient') (e.g. "
                               "RuleSet.LRP -> pixel_conv='gradient'), or give the model an odd kernel or an "
                               "explicit F.pad followed by padding=0.")
        return tuple(t // 2 for t in total)
    return padding


def is_input_pixels(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an input leaf, or a device or dtype copy of one (accelerate moving the
    pixels to the patch embedding's device, a cast): the conv that reads the pixels. Before, such
    a copy silently got the plain gradient instead of the z^B rule."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ == "ToCopyBackward0":
        node = node.next_functions[0][0]
    return tensor.is_leaf or (node is not None and type(node).__name__ == "AccumulateGrad")


class PixelBoundedConv(torch.autograd.Function):
    """The z^B rule (Montavon et al. 2017) on the convolution that reads the pixels, with
    per-image bounds L = min(x), H = max(x): ``z = W x - W+ L - W- H``,
    ``R_x = x (W^T s) - L (W+^T s) - H (W-^T s)``, ``s = R_z / z``; returned as ``R_x / x``."""

    @staticmethod
    def forward(ctx, x, weight, func, args, kwargs):
        output = own_output(func(*args, **kwargs), args, kwargs)  # a model may update it in place
        ctx.save_for_backward(x, weight, output)
        ctx.switch = SWITCH.get()
        ctx.conv = dict(stride=kwargs.get("stride", args[3] if len(args) > 3 else 1),
                        padding=kwargs.get("padding", args[4] if len(args) > 4 else 0),
                        dilation=kwargs.get("dilation", args[5] if len(args) > 5 else 1),
                        groups=kwargs.get("groups", args[6] if len(args) > 6 else 1))
        ctx.conv["padding"] = _numeric_padding(ctx.conv["padding"], weight, ctx.conv["dilation"])
        return output

    @staticmethod
    def backward(ctx, grad):
        x, weight, output = saved_tensors(ctx, "pixel z^B")
        in_dtype, conv = x.dtype, ctx.conv
        if _plain(ctx):
            return torch.nn.grad.conv2d_input(x.shape, weight, grad, **conv), None, None, None, None
        dtype = torch.promote_types(x.dtype, torch.float32)
        x, weight, grad, output = x.to(dtype), weight.to(dtype), grad.to(dtype), output.to(dtype)
        low = x.amin(dim=(1, 2, 3), keepdim=True).expand_as(x)
        high = x.amax(dim=(1, 2, 3), keepdim=True).expand_as(x)
        w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
        z = (F.conv2d(x, weight, None, **conv) - F.conv2d(low, w_pos, None, **conv)
             - F.conv2d(high, w_neg, None, **conv))
        s = safe_divide(output * grad, z)

        def back(w):
            return torch.nn.grad.conv2d_input(x.shape, w, s, **conv)

        relevance = x * back(weight) - low * back(w_pos) - high * back(w_neg)
        return identity_ratio(relevance, x).to(in_dtype), None, None, None, None
