"""Automatic mixed precision on neuron (``torch.neuron.amp``), like ``torch.cuda.amp``.

The op policies are CUDA's, registered in C++ for the AutocastPrivateUse1 key.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["autocast", "GradScaler", "get_amp_supported_dtype", "is_bf16_supported"]


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes ``torch.autocast("neuron", dtype=...)`` accepts."""
    return [torch.float16, torch.bfloat16, torch.float32]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 is native on Trainium."""
    return True


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.neuron.amp.autocast(...)`` is ``torch.autocast("neuron", ...)``."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.bfloat16, cache_enabled: bool = True):
        super().__init__("neuron", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class GradScaler(torch.amp.GradScaler):
    """``torch.neuron.amp.GradScaler(...)`` is ``torch.amp.GradScaler("neuron", ...)``."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__("neuron", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
