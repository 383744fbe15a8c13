"""``torch._fused_dropout`` and its backward ``torch._masked_scale``, as CUDA has them
(``aten/src/ATen/native/cuda/Dropout.cu``): ``p`` is the probability to *keep* an element, the
mask is a ``uint8`` tensor of the input's shape, and kept elements are scaled by ``1/p``
(computed in the accumulation type). The mask draws from the neuron generator (the device's
default one when ``generator`` is None), as every neuron random op does.
"""

from __future__ import annotations

import torch

from . import on_cpu

__all__ = ["fused_dropout", "masked_scale"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scale(x, mask, scale):
    return (x.to(_acc(x.dtype)) * mask * scale).to(x.dtype)


def fused_dropout(self, p, generator=None):
    """``aten::_fused_dropout``: ``(self * mask / p, mask)`` with ``mask ~ Bernoulli(p)``."""
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not self.is_floating_point():
        raise NotImplementedError(f"\"fused_dropout\" not implemented for '{str(self.dtype)[6:]}'")
    mask = torch.empty_like(self, dtype=torch.uint8, memory_format=torch.contiguous_format)
    mask.bernoulli_(p, generator=generator)
    scale = 1.0 / p if p > 0 else 0.0
    return on_cpu("_fused_dropout", _scale, self, mask, scale), mask


def masked_scale(self, mask, scale):
    """``aten::_masked_scale``: ``self * mask * scale``, the backward of ``_fused_dropout``."""
    if mask.dtype != torch.uint8:
        raise RuntimeError("mask should be torch.uint8 dtype")
    return on_cpu("_masked_scale", _scale, self, mask, scale)


def register(lib: torch.library.Library) -> None:
    lib.impl("_fused_dropout", fused_dropout, "PrivateUse1")
    lib.impl("_masked_scale", masked_scale, "PrivateUse1")
