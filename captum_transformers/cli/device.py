"""``--device`` of ``explain`` and ``explore``: parsed and checked before any model is loaded.

Accepted: ``cpu``, ``cuda``, ``cuda:N`` and ``mps``. A device this machine does not have
(no CUDA, an index past the last GPU, no Metal) is an ``InputError`` naming the devices that
exist, so the command prints one line and exits 2 instead of failing inside torch.

Example::

    >>> checked_device("cpu")
    device(type='cpu')
"""
from __future__ import annotations

import torch

from ..errors import InputError

ACCEPTED = "cpu, cuda, cuda:N or mps"


def checked_device(spec: str) -> torch.device:
    """``spec`` as a ``torch.device`` this machine has (see the module docstring)."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps") or (device.type == "cpu" and device.index):
        raise InputError(f"--device {spec!r} is not a device this command runs on; expected {ACCEPTED}.")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(f"--device {spec} but no CUDA device is available here; use --device cpu.")
        if device.index is not None and device.index >= count:
            raise InputError(f"--device {spec} but this machine has {count} CUDA device(s); use cuda:0 to "
                             f"cuda:{count - 1}.")
    if device.type == "mps":
        backend = getattr(torch.backends, "mps", None)
        if backend is None or not backend.is_available():
            raise InputError(f"--device {spec} but Apple's Metal (MPS) backend is not available here; use --device "
                             "cpu.")
    return device
