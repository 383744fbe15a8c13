"""Op x dtype pairs CUDA supports and CPU's kernels refuse, by widening (CUDA dtype parity).

Most such pairs are handled generically: when a CPU kernel raises "not implemented for 'Half'"
(or 'BFloat16', 'ComplexHalf'), the boxed fallback reruns it widened and rounds once
(csrc/backend/fallback.cpp). The kernels here cover the CPU refusals that are not phrased that
way:

- FFTs of fp16 / complex32 (``_fft_r2c``, ``_fft_c2c``, ``_fft_c2r``; CPU's MKL/pocketfft path
  raises "Unsupported dtype Half"): computed in fp32 / complex64 and rounded once to the half
  types cuFFT returns;
- ``nansum`` of complex tensors (CPU: "nansum on CPU does not support complex inputs"; CUDA
  treats an element with a NaN real or imaginary part as zero), and so ``nanmean``, which is
  built on it.
"""

from __future__ import annotations

import torch

from . import cpu_kernel, on_cpu
from .out import resize_output

__all__ = ["fft_r2c", "fft_c2c", "fft_c2r", "nansum"]

_WIDE = {torch.float16: torch.float32, torch.complex32: torch.complex64}
_NARROW_OF = {torch.float32: torch.float16, torch.complex64: torch.complex32}


def _fft(op_name: str):
    functional = getattr(torch.ops.aten, op_name).default
    out_op = getattr(torch.ops.aten, op_name).out

    def kernel(self, *args):
        if self.dtype not in _WIDE:
            return cpu_kernel(functional, self, *args)
        result = cpu_kernel(functional, self.to(_WIDE[self.dtype]), *args)
        return result.to(_NARROW_OF[result.dtype])

    def kernel_out(self, *args, out):
        if self.dtype not in _WIDE:
            return cpu_kernel(out_op, self, *args, out=out)
        result = kernel(self, *args)
        if out.dtype != result.dtype:
            raise RuntimeError(f"Expected out tensor to have dtype {result.dtype}, but got {out.dtype} instead")
        resize_output(out, result.shape, self.device)
        return out.copy_(result)

    kernel.__name__ = op_name
    kernel.__doc__ = f"``aten::{op_name}`` with fp16/complex32 computed in fp32/complex64 (CUDA's dtypes)."
    return kernel, kernel_out


fft_r2c, fft_r2c_out = _fft("_fft_r2c")
fft_c2c, fft_c2c_out = _fft("_fft_c2c")
fft_c2r, fft_c2r_out = _fft("_fft_c2r")


def _complex_nansum(x, dim, keepdim, dtype):
    wide = torch.complex64 if x.dtype == torch.complex32 else x.dtype
    xw = x.to(wide)
    zeroed = torch.where(torch.isnan(xw), torch.zeros((), dtype=wide), xw)
    out_dtype = dtype if dtype is not None else x.dtype
    return zeroed.sum(dim, keepdim=keepdim, dtype=torch.complex64 if out_dtype == torch.complex32 else out_dtype
                      ).to(out_dtype)


def nansum(self, dim=None, keepdim=False, *, dtype=None):
    """``aten::nansum``: CUDA's complex support (NaN in either part counts as zero)."""
    if not self.is_complex():
        return cpu_kernel(torch.ops.aten.nansum.default, self, dim, keepdim, dtype=dtype)
    return on_cpu("nansum", _complex_nansum, self, dim, keepdim, dtype)


def nansum_out(self, dim=None, keepdim=False, *, dtype=None, out):
    """``aten::nansum.out``."""
    if not self.is_complex():
        return cpu_kernel(torch.ops.aten.nansum.out, self, dim, keepdim, dtype=dtype, out=out)
    result = nansum(self, dim, keepdim, dtype=dtype)
    resize_output(out, result.shape, self.device)
    return out.copy_(result)


def register(lib: torch.library.Library) -> None:
    for name, fn in (("_fft_r2c", fft_r2c), ("_fft_r2c.out", fft_r2c_out), ("_fft_c2c", fft_c2c),
                     ("_fft_c2c.out", fft_c2c_out), ("_fft_c2r", fft_c2r), ("_fft_c2r.out", fft_c2r_out),
                     ("nansum", nansum), ("nansum.out", nansum_out)):
        lib.impl(name, fn, "PrivateUse1")
