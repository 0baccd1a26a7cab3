"""Exceptions raised by captum_transformers.

Every message says what was received, what was expected, and how to fix it.
"""


class CaptumTransformersError(Exception):
    """Base class of every error this package raises on purpose."""


class UnsupportedModelError(CaptumTransformersError, TypeError):
    """No adapter is registered for the model (or any of its submodules)."""


class CaptureError(CaptumTransformersError, RuntimeError):
    """The forward pass did not yield the attention the method needs.

    Raised instead of returning zeros or uniform maps: for example when no attention
    probabilities were observed, or when a gradient method found attention that is not
    connected to the explained output.
    """


class NotSoftmaxAttentionError(UnsupportedModelError, CaptureError):
    """The model mixes its tokens by something other than softmax attention over one sequence
    (Fourier mixing, a state-space scan, a recurrence, differential or approximate attention),
    so a method defined on attention probability maps (raw attention, rollout, Grad-CAM,
    GenericAttention, the LRP rule sets) does not apply to it. Gradient methods that need no
    attention (Captum's Integrated Gradients, Saliency) still do. A ``CaptureError`` too (what
    the adapters raised for these models before the families were named)."""


class InputError(CaptumTransformersError, ValueError):
    """Inputs, targets or options that do not fit the model or the method."""


class StochasticForwardError(InputError, CaptureError):
    """The model is in training mode and its forward is random or batch-dependent (active
    dropout, drop path, batch norm on batch statistics), so each call would be explained
    differently; or it would update running statistics, changing the model.

    The message names the layers found and the fix (``model.eval()``, or a method built with
    ``allow_stochastic=True``). It is an ``InputError`` (the model's mode is the caller's to
    change) and a ``CaptureError`` (what the adapters raised for attention dropout before this
    rule), so code catching either keeps working.
    """
