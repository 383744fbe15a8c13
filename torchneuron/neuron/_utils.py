"""Device-index helpers (``torch.neuron._utils``; serialization looks here)."""

from __future__ import annotations

from typing import Any

import torch


def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
    """The neuron device index of ``device`` (int, str, torch.device or None).

    ``None`` means the current device when ``optional`` is true. Raises ``ValueError`` for a
    device of another type, like ``torch.cuda._utils._get_device_index``."""
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type == "cpu" and allow_cpu:
            return -1
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, but got: {device}")
        if device.index is None:
            if not optional:
                raise ValueError(f"Expected a neuron device with a specified index or an integer, but got: {device}")
            return torch.neuron.current_device()
        return device.index
    if device is None:
        if not optional:
            raise ValueError("Expected a neuron device, but got None")
        return torch.neuron.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    raise ValueError(f"Expected a neuron device index, torch.device or str, but got {device!r}")
