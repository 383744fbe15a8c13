"""Helpers shared by the NKI-lib kernels (trace-time Python, not kernels themselves)."""

from __future__ import annotations

import sys

import numpy as np

import torchneuron.nki.language as nl
from torchneuron.nki.errors import NKIArgumentError, NKIShapeError

P = 128  # partitions / TensorE contraction rows


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _caller() -> str:
    f = sys._getframe(2)  # the kernel (or its argument check) that raised
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def shape_error(kernel: str, msg: str, fix: str):
    """Raise a clear NKIShapeError naming the kernel and the violated limit."""
    raise NKIShapeError(f"{kernel}: {msg}", fix=fix, rule="nkilib-limit", location=_caller())


def arg_error(kernel: str, msg: str, fix: str):
    """Raise an NKIArgumentError naming the kernel and the bad argument."""
    raise NKIArgumentError(f"{kernel}: {msg}", fix=fix, rule="nkilib-argument",
                           location=_caller())


def matmul_dtype(dtype):
    """TensorE operand dtype for inputs of ``dtype``: fp32 stays fp32 (exact, 4x slower on
    TensorE), every 16-bit/8-bit float runs as bf16 (full TensorE rate)."""
    return nl.float32 if np.dtype(dtype) == np.dtype(np.float32) else nl.bfloat16


NEG_BIG = -3.0e38  # additive mask value: finite (no inf - inf = NaN), exp() of it is 0
