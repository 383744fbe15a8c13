"""``out=`` handling for Python kernels, as ATen's ``at::native::resize_output`` does it."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

__all__ = ["resize_output"]


def resize_output(out: torch.Tensor, shape: Sequence[int], device: torch.device) -> None:
    """Check that ``out`` is on ``device`` (CUDA's message) and resize it to ``shape``, warning
    as ATen does when a non-empty output changes shape."""
    if out.device != device:
        raise RuntimeError(f"Expected out tensor to have device {device}, but got {out.device} instead")
    shape = torch.Size(shape)
    if out.shape == shape:
        return
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
            f"which does not match the required output shape {list(shape)}. This behavior is "
            "deprecated, and in a future PyTorch release outputs will not be resized unless they "
            "have zero elements. You can explicitly reuse an out tensor t by resizing it, inplace, "
            "to zero elements with t.resize_(0).", UserWarning, stacklevel=3)
    out.resize_(shape)
