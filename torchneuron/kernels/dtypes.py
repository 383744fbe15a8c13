"""Op x dtype pairs CUDA supports and CPU's kernels refuse, by widening (CUDA dtype parity).

Most such pairs are handled generically: when a CPU kernel raises "not implemented for 'Half'"
(or 'BFloat16', 'ComplexHalf'), the boxed fallback reruns it widened and rounds once
(csrc/backend/fallback.cpp). The kernels here cover the CPU refusals that are not phrased that
way:

- FFTs of fp16 / complex32 (``_fft_r2c``, ``_fft_c2c``, ``_fft_c2r``; CPU's MKL/pocketfft path
  raises "Unsupported dtype Half"): computed in fp32 / complex64 and rounded once to the half
  types cuFFT returns;
- the ``torch.fft`` entry points (``fft_rfft``, ``fft_irfft``, ... 18 of them) for fp16 inputs:
  ATen's composites refuse Half for every device but CUDA/XPU/meta before any kernel runs
  (``promote_type_fft``). Registered for neuron and its autograd key, they run the composite
  itself: real fp16 inputs of the transforms that take complex input (``fft``, ``irfft``,
  ``hfft``, ...) become complex32, as CUDA promotes them; the real-to-complex ones (``rfft``,
  ``ihfft``, ...) run on the input widened to fp32 and round the result once to complex32. Other
  dtypes run the composite unchanged. cuFFT's half-precision restriction (power-of-two signal
  sizes) is checked with CUDA's message, so code that passes here passes on CUDA;
- ``nansum`` of complex tensors (CPU: "nansum on CPU does not support complex inputs"; CUDA
  treats an element with a NaN real or imaginary part as zero), and so ``nanmean``, which is
  built on it.
"""

from __future__ import annotations

import threading

import torch

from . import cpu_kernel, on_cpu
from .out import resize_output

__all__ = ["FFT_ENTRY_POINTS", "fft_r2c", "fft_c2c", "fft_c2r", "nansum"]

_WIDE = {torch.float16: torch.float32, torch.complex32: torch.complex64}
_NARROW_OF = {torch.float32: torch.float16, torch.complex64: torch.complex32}


# Set (per thread) while a real-to-complex entry point runs an fp16 input widened to fp32: the
# transforms below it then still apply cuFFT's half-precision size rule.
_HALF_SCOPE = threading.local()


def _signal_sizes(op_name: str, self: torch.Tensor, args: tuple) -> list[int]:
    dim = args[0]
    sizes = [self.shape[d] for d in dim]
    if op_name == "_fft_c2r":  # the last transformed dim is the real output's length
        sizes[-1] = args[2]
    return sizes


def _check_half_signal(sizes: list[int]) -> None:
    # cuFFT computes half precision for power-of-two sizes only (CUDA's plan check and message).
    if any(s & (s - 1) for s in sizes):
        raise RuntimeError("cuFFT only supports dimensions whose sizes are powers of two when computing in half "
                           f"precision, but got a signal size of{list(sizes)}")


def _into_out(out: torch.Tensor, result: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Write a widened kernel's result into ``out=`` with CUDA's dtype rule for FFT outputs."""
    if out.dtype != result.dtype:
        raise RuntimeError(f"Expected out tensor to have dtype {result.dtype}, but got {out.dtype} instead")
    resize_output(out, result.shape, device)
    return out.copy_(result)


def _fft(op_name: str):
    functional = getattr(torch.ops.aten, op_name).default
    out_op = getattr(torch.ops.aten, op_name).out

    def kernel(self, *args):
        half = self.dtype in _WIDE
        if half or getattr(_HALF_SCOPE, "on", False):
            _check_half_signal(_signal_sizes(op_name, self, args))
        if not half:
            return cpu_kernel(functional, self, *args)
        result = cpu_kernel(functional, self.to(_WIDE[self.dtype]), *args)
        return result.to(_NARROW_OF[result.dtype])

    def kernel_out(self, *args, out):
        if self.dtype not in _WIDE:
            return cpu_kernel(out_op, self, *args, out=out)
        return _into_out(out, kernel(self, *args), self.device)

    kernel.__name__ = op_name
    kernel.__doc__ = f"``aten::{op_name}`` with fp16/complex32 computed in fp32/complex64 (CUDA's dtypes)."
    return kernel, kernel_out


fft_r2c, fft_r2c_out = _fft("_fft_r2c")
fft_c2c, fft_c2c_out = _fft("_fft_c2c")
fft_c2r, fft_c2r_out = _fft("_fft_c2r")


# torch.fft entry points: (name, takes a real input and returns complex).
FFT_ENTRY_POINTS = tuple(
    [(f"fft_{k}", False) for k in ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn",
                                   "irfft", "irfft2", "irfftn", "hfft", "hfft2", "hfftn")]
    + [(f"fft_{k}", True) for k in ("rfft", "rfft2", "rfftn", "ihfft", "ihfft2", "ihfftn")])


def _fft_entry(name: str, real_to_complex: bool):
    packet = getattr(torch.ops.aten, name)
    functional, out_op = packet.default, packet.out

    def run(op, self, *args, **kwargs):
        if self.dtype != torch.float16:
            return op.decompose(self, *args, **kwargs)
        if not real_to_complex:  # CUDA promotes a real half input to complex32
            return op.decompose(self.to(torch.complex32), *args, **kwargs)
        _HALF_SCOPE.on = True
        try:
            return op.decompose(self.to(torch.float32), *args, **kwargs)
        finally:
            _HALF_SCOPE.on = False

    def kernel(self, *args, **kwargs):
        if self.dtype != torch.float16 or not real_to_complex:
            return run(functional, self, *args, **kwargs)
        return run(functional, self, *args, **kwargs).to(torch.complex32)

    def kernel_out(self, *args, out, **kwargs):
        if self.dtype != torch.float16:
            return run(out_op, self, *args, out=out, **kwargs)
        return _into_out(out, kernel(self, *args, **kwargs), self.device)

    kernel.__name__ = name
    kernel.__doc__ = f"``aten::{name}`` accepting fp16 as on CUDA (the composite, past its device-type check)."
    return kernel, kernel_out


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
    # The composites are CompositeImplicitAutograd: a kernel for the backend key alone would leave
    # the autograd key without one, so the same kernel (it runs the composite, whose ops record
    # the graph) is registered for both.
    for name, real_to_complex in FFT_ENTRY_POINTS:
        fn, fn_out = _fft_entry(name, real_to_complex)
        for key in ("PrivateUse1", "AutogradPrivateUse1"):
            lib.impl(name, fn, key)
            lib.impl(name + ".out", fn_out, key)
