"""``torch.histc`` on integer tensors, with CUDA's semantics (CPU supports floating types only).

Hugging Face's MoE experts (``grouped_mm`` path) count tokens per expert with
``torch.histc(expert_ids.int(), ...)`` on every non-CPU device. CUDA's kernel
(``aten/src/ATen/native/cuda/SummaryOps.cu``) for an integer ``input_t``:

- the bounds are ``min``/``max`` converted to int64 (``acc_type``), then to ``input_t`` (C++
  narrowing: they wrap);
- ``min == max`` (as int64) on a non-empty input takes the data's minimum and maximum; equal
  bounds then widen to ``[min - 1, max + 1]`` (in ``input_t``, wrapping), and ``min < max`` is
  required;
- an element ``v`` with ``min <= v <= max`` falls in bin ``(v - min) * bins // (max - min)``
  (int64 arithmetic), ``max`` itself in the last bin;
- counts are accumulated in ``input_t`` (they wrap for int8 / uint8).

Floating types run the CPU kernel unchanged.
"""

from __future__ import annotations

import torch

from . import cpu_kernel
from .out import resize_output

__all__ = ["histc", "histc_out"]

_INT_BITS = {torch.uint8: (8, False), torch.int8: (8, True), torch.int16: (16, True),
             torch.int32: (32, True), torch.int64: (64, True)}


def _wrap(value: int, dtype: torch.dtype) -> int:
    """C++'s conversion of an int64 to ``dtype`` (two's complement wrap-around)."""
    bits, signed = _INT_BITS[dtype]
    value &= (1 << bits) - 1
    if signed and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def _as_int64(value, what: str) -> int:
    """``Scalar::to<int64_t>()``: truncation toward zero, an error when out of range."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise RuntimeError(f"histc: {what}={value} cannot be converted to type int64_t without overflow")
    return _wrap(int(value), torch.int64)


def _integer_histc(self: torch.Tensor, bins: int, min, max) -> torch.Tensor:
    dtype = self.dtype
    if bins <= 0:
        raise RuntimeError("bins must be > 0")
    lo64, hi64 = _as_int64(min, "min"), _as_int64(max, "max")
    lo, hi = _wrap(lo64, dtype), _wrap(hi64, dtype)
    if lo64 == hi64 and self.numel() > 0:
        lo, hi = int(self.min().item()), int(self.max().item())
    if lo == hi:
        lo, hi = _wrap(lo - 1, dtype), _wrap(hi + 1, dtype)
    if not lo < hi:
        raise RuntimeError("max must be larger than min")
    span = _wrap(hi - lo, torch.int64)
    if span <= 0:  # CUDA's int64 arithmetic overflows here and indexes out of bounds
        raise RuntimeError(f"histc: the range [{lo}, {hi}] is wider than int64 can hold")
    # Shapes that do not depend on the data (no boolean mask, no bincount), so that with the
    # execution engine on nothing here waits for the device: values out of range count in an
    # extra bin that is dropped.
    values = self.reshape(-1).to(torch.int64)
    index = ((values - lo) * bins // span).clamp_(max=bins - 1)
    index = torch.where(values < lo, bins, torch.where(values > hi, bins, index))
    counts = torch.zeros(bins + 1, dtype=torch.int64, device=self.device).scatter_add_(0, index, torch.ones_like(index))
    return counts[:bins].to(dtype)


def histc(self: torch.Tensor, bins: int = 100, min=0, max=0) -> torch.Tensor:
    """``aten::histc`` for neuron: CUDA's integer kernel, CPU's kernel for floating types."""
    if self.dtype in _INT_BITS:
        return _integer_histc(self, bins, min, max)
    return cpu_kernel(torch.ops.aten.histc.default, self, bins, min, max)


def histc_out(self: torch.Tensor, bins: int = 100, min=0, max=0, *, out: torch.Tensor) -> torch.Tensor:
    """``aten::histc.out``: CUDA computes the histogram, resizes ``out`` and copies into it."""
    if self.dtype in _INT_BITS:
        result = _integer_histc(self, bins, min, max)
        resize_output(out, result.shape, self.device)
        return out.copy_(result)
    return cpu_kernel(torch.ops.aten.histc.out, self, bins, min, max, out=out)


def register(lib: torch.library.Library) -> None:
    lib.impl("histc", histc, "PrivateUse1")
    lib.impl("histc.out", histc_out, "PrivateUse1")
