"""``mm`` / ``bmm`` / ``addmm`` / ``baddbmm`` with ``out_dtype`` (the ``.dtype`` overloads), as
CUDA has them and CPU does not: fp16/bf16 operands with an fp32 result (or the operands' own
dtype). TensorE's contract (exact products, fp32 accumulation, one rounding to the output dtype;
docs/architecture.md, Precision) is what an fp32 GEMM of the widened operands computes, so that
is how neuron computes them; ``beta * self`` is added in fp32 before the rounding.
"""

from __future__ import annotations

import torch

from . import on_cpu
from .out import resize_output

__all__ = ["mm_dtype", "bmm_dtype", "addmm_dtype", "baddbmm_dtype"]


def _check(fn: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, dims: int) -> None:
    for name, t in (("self" if dims == 2 else "batch1", a), ("mat2" if dims == 2 else "batch2", b)):
        if t.dim() != dims:
            raise RuntimeError(f"{name} must be a {'matrix' if dims == 2 else '3D tensor'}, got {t.dim()}-D tensor")
    if a.dtype != b.dtype:
        raise RuntimeError(f"{fn}: input dtypes must be the same, got {a.dtype} and {b.dtype}")
    if not (out_dtype == a.dtype or (out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16))):
        raise RuntimeError(f"{fn}: out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs")
    if a.shape[-1] != b.shape[-2] or (dims == 3 and a.shape[0] != b.shape[0]):
        raise RuntimeError(f"{fn}: shapes cannot be multiplied ({'x'.join(map(str, a.shape))} and "
                           f"{'x'.join(map(str, b.shape))})")


def _gemm(a, b, self_, beta, alpha, out_dtype, out):
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    prod = torch.matmul(a.to(wide), b.to(wide))
    if alpha != 1:
        prod = prod * alpha
    if self_ is not None and beta != 0:
        prod = prod + beta * self_.to(wide)
    if out is None:
        return prod.to(out_dtype)
    out.copy_(prod)
    return out


def _run(fn, a, b, out_dtype, dims, self_=None, beta=1, alpha=1, out=None):
    _check(fn, a, b, out_dtype, dims)
    shape = (*a.shape[:-1], b.shape[-1])
    if out is not None:
        if out.dtype != out_dtype:
            raise RuntimeError("out_dtype must be the same as the dtype of the provided out tensor")
        resize_output(out, shape, a.device)
    if self_ is not None:
        if self_.dtype not in (out_dtype, a.dtype):
            raise RuntimeError(f"{fn}: self dtype must match either out_dtype or the inputs' dtype, got {self_.dtype}")
        self_ = self_.expand(shape)
    return on_cpu(fn, _gemm, a, b, self_, beta, alpha, out_dtype, out)


def mm_dtype(self, mat2, out_dtype):
    """``aten::mm.dtype``."""
    return _run("mm.dtype", self, mat2, out_dtype, 2)


def mm_dtype_out(self, mat2, out_dtype, *, out):
    """``aten::mm.dtype_out``."""
    return _run("mm.dtype_out", self, mat2, out_dtype, 2, out=out)


def bmm_dtype(self, mat2, out_dtype):
    """``aten::bmm.dtype``."""
    return _run("bmm.dtype", self, mat2, out_dtype, 3)


def bmm_dtype_out(self, mat2, out_dtype, *, out):
    """``aten::bmm.dtype_out``."""
    return _run("bmm.dtype_out", self, mat2, out_dtype, 3, out=out)


def addmm_dtype(self, mat1, mat2, out_dtype, beta=1, alpha=1):
    """``aten::addmm.dtype``."""
    return _run("addmm.dtype", mat1, mat2, out_dtype, 2, self, beta, alpha)


def addmm_dtype_out(self, mat1, mat2, out_dtype, beta=1, alpha=1, *, out):
    """``aten::addmm.dtype_out``."""
    return _run("addmm.dtype_out", mat1, mat2, out_dtype, 2, self, beta, alpha, out=out)


def baddbmm_dtype(self, batch1, batch2, out_dtype, beta=1, alpha=1):
    """``aten::baddbmm.dtype``."""
    return _run("baddbmm.dtype", batch1, batch2, out_dtype, 3, self, beta, alpha)


def baddbmm_dtype_out(self, batch1, batch2, out_dtype, beta=1, alpha=1, *, out):
    """``aten::baddbmm.dtype_out``."""
    return _run("baddbmm.dtype_out", batch1, batch2, out_dtype, 3, self, beta, alpha, out=out)


def register(lib: torch.library.Library) -> None:
    for name, fn in (("mm.dtype", mm_dtype), ("mm.dtype_out", mm_dtype_out), ("bmm.dtype", bmm_dtype),
                     ("bmm.dtype_out", bmm_dtype_out), ("addmm.dtype", addmm_dtype),
                     ("addmm.dtype_out", addmm_dtype_out), ("baddbmm.dtype", baddbmm_dtype),
                     ("baddbmm.dtype_out", baddbmm_dtype_out)):
        lib.impl(name, fn, "PrivateUse1")
