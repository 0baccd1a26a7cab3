"""Loading the weights the package ships in ``captum_transformers/assets``.

The built-in models' state dicts are stored compactly (float16 for the DigitCanvas models) and
loaded as float32 into a model built from code; a missing file is an :class:`InputError` that
names the command which recreates it.

Example::

    >>> model = load_shipped_weights(build_digit_model(), weights_path(), "The DigitCanvas weights",
    ...                              "python -m captum_transformers.tasks.train_digits")
"""
from __future__ import annotations

import importlib.resources

import torch
from torch import nn

from ..errors import InputError


def load_shipped_weights(model: nn.Module, path, what: str, retrain_command: str) -> nn.Module:
    """``model`` with the state dict at ``path`` loaded (floating tensors as float32), in eval mode."""
    if not path.is_file():
        raise InputError(f"{what} {path} are missing (expected a state dict shipped in captum_transformers/assets/). "
                         f"Reinstall captum_transformers, or recreate them with `{retrain_command}`.")
    with importlib.resources.as_file(path) as file:
        state = torch.load(file, map_location="cpu", weights_only=True)
    model.load_state_dict({name: tensor.float() if tensor.is_floating_point() else tensor
                           for name, tensor in state.items()})
    return model.eval()
