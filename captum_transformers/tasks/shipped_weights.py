"""The weights the package ships in ``captum_transformers/assets``: found, loaded, written.

The built-in models' state dicts are stored compactly (float16 for the DigitCanvas models) and
loaded as float32 into a model built from code, each with a JSON record of its training beside
it (same stem); a missing file is an :class:`InputError` that names the command which
recreates it.

Example::

    >>> model = load_shipped_weights(build_digit_model(), weights_path(), "The DigitCanvas weights",
    ...                              "python -m captum_transformers.tasks.digits.train")
"""
from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

from ..errors import InputError


def asset(name: str):
    """The shipped file ``name`` inside the installed package (a Traversable)."""
    return importlib.resources.files("captum_transformers").joinpath("assets", name)


def load_shipped_record(name: str, what: str, retrain_command: str) -> Dict[str, Any]:
    """The JSON training record ``name`` of shipped weights (accuracies, seed, time, command)."""
    record = asset(name)
    if not record.is_file():
        raise InputError(f"{what} {record} is missing (expected it in captum_transformers/assets/). Reinstall "
                         f"captum_transformers, or run `{retrain_command}` to recreate it.")
    return json.loads(record.read_text())


def save_shipped(state: Dict[str, torch.Tensor], out: Path, record: Dict[str, Any]) -> Path:
    """Write ``state`` to ``out`` and ``record`` beside it as JSON (same stem, ``.json``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    return out


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
