"""An ``explain_func`` for Quantus (Hedström et al., JMLR 2023), so that Quantus' metrics evaluate
this package's methods directly.

Quantus calls ``explain_func(model=..., inputs=x_batch, targets=y_batch, **explain_func_kwargs)``
with NumPy arrays (channel first) and expects NumPy attributions it can broadcast against the
inputs. ``quantus_explain_func`` builds that callable around a method of this package; it does
not import Quantus (nothing here needs it), so Quantus stays an optional, user-side install.

Example::

    import quantus
    from captum_transformers.evaluation.quantus_bridge import quantus_explain_func

    explain = quantus_explain_func("generic-attention")
    scores = quantus.RegionPerturbation(patch_size=4, regions_evaluation=16)(
        model=model.eval(), x_batch=x, y_batch=y, explain_func=explain)
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Union

import numpy as np
import torch
from torch import nn

from ..errors import InputError

MethodSpec = Union[str, type, Callable[[nn.Module], Any]]

def quantus_explain_func(method: MethodSpec, channel_reduce: str = "sum",
                         **attribute_kwargs) -> Callable[..., np.ndarray]:
    """A Quantus ``explain_func`` running ``method`` of this package.

    Args:
        method: a method name of ``methods.catalog`` (``"generic-attention"``, ``"attn-lrp"``,
            ...), a method class (``GenericAttention``) or any factory ``model -> explainer``
            whose ``attribute(inputs, target=...)`` returns input-shaped attributions.
        channel_reduce: how image attributions (B, C, H, W) become Quantus' (B, 1, H, W) maps:
            ``"sum"`` (the package's convention, ``as_pixel_maps``), ``"mean"``, or ``"none"``
            to keep (B, C, H, W) (Quantus then ranks every channel as its own feature).
        **attribute_kwargs: passed to every ``attribute`` call. Options a method takes at
            construction go into a factory: ``lambda m: ConservativeLRP(m, variant="GI")``.

    Returns:
        ``explain(model, inputs, targets, **kwargs) -> np.ndarray`` (float32). ``inputs`` and
        ``targets`` are NumPy arrays or tensors; they are moved to the model's device (or
        ``kwargs["device"]``, which Quantus passes), float inputs cast to the dtype of the
        model's first floating parameter (float32 for a model without one). Other ``kwargs`` go to ``attribute``.
        The explainer is built once per model object and reused.

    >>> explain = quantus_explain_func("rollout")
    >>> callable(explain)
    True
    """
    if channel_reduce not in ("sum", "mean", "none"):
        raise InputError(f"channel_reduce={channel_reduce!r} is not one of ('sum', 'mean', 'none'). Pick one of those.")
    factory = _factory(method)
    explainers: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()

    def explain(model: nn.Module, inputs, targets, **kwargs) -> np.ndarray:
        if not isinstance(model, nn.Module):
            raise InputError(f"explain_func received a {type(model).__name__} model; this package explains torch "
                             "nn.Module models. Pass the torch model to the Quantus metric.")
        device = kwargs.pop("device", None)  # Quantus adds it to explain_func_kwargs on its own
        parameter = next(model.parameters(), None)
        if device is None:
            device = parameter.device if parameter is not None else torch.device("cpu")
        # Inputs take the model's float dtype (Quantus hands float32 or float64 arrays alike).
        floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        x = torch.as_tensor(np.asarray(inputs) if not isinstance(inputs, torch.Tensor) else inputs)
        if x.is_floating_point():
            x = x.to(device=device, dtype=floating)
        else:
            x = x.to(device)
        target = torch.as_tensor(np.asarray(targets) if not isinstance(targets, torch.Tensor) else targets)
        target = target.to(device=device, dtype=torch.long).reshape(-1)
        if target.shape[0] != x.shape[0]:
            raise InputError(f"explain_func received {target.shape[0]} targets for {x.shape[0]} inputs; "
                             "pass one target class per input.")
        if model not in explainers:
            explainers[model] = factory(model)
        maps = explainers[model].attribute(x, target=target, **{**attribute_kwargs, **kwargs})
        if not isinstance(maps, torch.Tensor):
            raise InputError(f"The method returned {type(maps).__name__}, not one tensor; Quantus needs one "
                             "attribution array per input batch (pass a single input tensor).")
        maps = maps.detach()
        if maps.dim() == 4 and channel_reduce != "none":
            maps = maps.sum(dim=1, keepdim=True) if channel_reduce == "sum" else maps.mean(dim=1, keepdim=True)
        return maps.to(torch.float32).cpu().numpy()

    return explain


def _factory(method: MethodSpec) -> Callable[[nn.Module], Any]:
    if isinstance(method, str):
        from ..methods.catalog import METHOD_FACTORIES, resolve_method_names
        (name,) = resolve_method_names([method])
        return METHOD_FACTORIES[name]
    if callable(method):
        return method
    raise InputError(f"method={method!r} is neither a method name (e.g. 'generic-attention'), a method class nor a "
                     "factory model -> explainer.")
