"""``avg_pool3d(out=)`` into a non-contiguous buffer, which CPU's kernel writes wrongly.

CPU's ``avg_pool3d_out_cpu`` (torch 2.13) writes its result as if ``out`` were contiguous (or
channels-last): given a strided ``out`` of the right shape it leaves wrong values, silently (CPU
tensors too). CUDA's kernel writes through the strides, and PyTorch's ``TestCommon.test_out``
checks that. Neuron computes into a fresh buffer with the CPU kernel and copies it through
``out``'s strides; contiguous buffers take the CPU kernel directly.
"""

from __future__ import annotations

import torch

from . import cpu_kernel
from .out import resize_output

__all__ = ["avg_pool3d_out"]


def avg_pool3d_out(self, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                   divisor_override=None, *, out):
    """``aten::avg_pool3d.out`` with CUDA's handling of strided ``out`` buffers."""
    args = (self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    if out.is_contiguous() or out.is_contiguous(memory_format=torch.channels_last_3d) or out.numel() == 0:
        return cpu_kernel(torch.ops.aten.avg_pool3d.out, *args, out=out)
    result = cpu_kernel(torch.ops.aten.avg_pool3d.default, *args)
    if out.dtype != result.dtype:
        raise RuntimeError(f"Expected out tensor to have dtype {result.dtype}, but got {out.dtype} instead")
    resize_output(out, result.shape, self.device)
    return out.copy_(result)


def register(lib: torch.library.Library) -> None:
    lib.impl("avg_pool3d.out", avg_pool3d_out, "PrivateUse1")
