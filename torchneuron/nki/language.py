"""``nki.language`` (``nl``): buffers, dtypes, tensor creation, loops and convenience ops.

The convenience ops (``nl.load``, ``nl.exp``, ``nl.sum``, ``nl.softmax``...) return *new*
tiles, allocated in SBUF, and are lowered to the ``nisa`` instructions the NKI compiler would
emit (so they are checked and costed exactly like hand-written ``nisa`` calls). Operators such
as ``nl.add`` or ``nl.exp`` double as ``op=`` arguments of ``nisa`` instructions.
"""

from __future__ import annotations

import builtins
import math
from typing import Any, Callable, Sequence

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from .dtypes import (bfloat16, bool_, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu,
                     float16, float32, int8, int16, int32, tfloat32, uint8, uint16, uint32)
from .errors import NKIArgumentError, NKIShapeError, NKITracingError
from .ops import OPS, Op
from .tensor import NkiTensor, allocate, hbm, private_hbm, psum, sbuf, shared_hbm
from .tracer import current, user_location

# ---------------------------------------------------------------------------------------------
# creation
# ---------------------------------------------------------------------------------------------


def ndarray(shape: Sequence[int], dtype: Any, buffer=sbuf, name: str | None = None,
            address: Any = None) -> NkiTensor:
    """Allocate an uninitialised tensor (filled with sentinels: NaN, or 4 for ints) in ``buffer``."""
    return allocate(shape, dtype, buffer, name)


def _filled(shape, value, dtype, buffer, name) -> NkiTensor:
    t = allocate(shape, dtype, buffer, name)
    if buffer.on_chip:
        _isa.memset(t, value, engine=_isa.engine.gpsimd if buffer is sbuf else _isa.engine.vector)
    else:
        # HBM is initialised by a DMA from a constant; model it as one DMA of the whole tensor.
        ctx = current()
        from .tracer import Instr, user_frame
        ctx.instructions.append(Instr("dma_memset", "dma", 0.0, [], [t.region()],
                                      nbytes=t.size * t.itemsize, hbm_bytes=t.size * t.itemsize,
                                      loc=user_frame()))
        if ctx.numerics:
            t.data[...] = _dt.cast(np.full(t.shape, value), dtype)
    return t


def zeros(shape, dtype, buffer=sbuf, name=None) -> NkiTensor:
    """A tensor of zeros."""
    return _filled(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name=None) -> NkiTensor:
    """A tensor of ones."""
    return _filled(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name=None) -> NkiTensor:
    """A tensor filled with ``fill_value``."""
    return _filled(shape, fill_value, dtype, buffer, name)


def empty_like(a: NkiTensor, dtype=None, buffer=None, name=None) -> NkiTensor:
    return ndarray(a.shape, dtype or a.dtype, buffer or a.buffer, name)


ndarray_like = empty_like


def zeros_like(a: NkiTensor, dtype=None, buffer=None, name=None) -> NkiTensor:
    return zeros(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def ones_like(a: NkiTensor, dtype=None, buffer=None, name=None) -> NkiTensor:
    return ones(a.shape, dtype or a.dtype, buffer or a.buffer, name)


def full_like(a: NkiTensor, fill_value, dtype=None, buffer=None, name=None) -> NkiTensor:
    return full(a.shape, fill_value, dtype or a.dtype, buffer or a.buffer, name)


def shared_identity_matrix(n: int, dtype=bfloat16) -> NkiTensor:
    """An [n, n] identity matrix in SBUF (built with memset + affine_select on GpSimd)."""
    ones_t = ones((n, n), dtype)
    eye = ndarray((n, n), dtype)
    _isa.affine_select(eye, pattern=[[-1, n]], channel_multiplier=1, on_true_tile=ones_t,
                       on_false_value=0.0, cmp_op=OPS["equal"])
    return eye


# ---------------------------------------------------------------------------------------------
# loops, programs, misc
# ---------------------------------------------------------------------------------------------


def affine_range(*args) -> range:
    """Loop with no loop-carried dependency (deprecated alias of ``range`` in NKI 0.6)."""
    return range(*args)


def sequential_range(*args) -> range:
    """Loop whose iterations depend on each other (alias of ``range``)."""
    return range(*args)


def static_range(*args) -> range:
    """Fully unrolled loop (alias of ``range``)."""
    return range(*args)


def fori_loop(lower: int, upper: int, body: Callable, init_val: Any) -> Any:
    """``val = body(i, val)`` for i in [lower, upper); bounds must be trace-time ints here."""
    val = init_val
    for i in range(int(lower), int(upper)):
        val = body(i, val)
    return val


def program_id(axis: int = 0) -> int:
    """Index of this program in the launch grid (0 or 1 under LNC=2)."""
    if axis != 0:
        raise NKIArgumentError(f"program_id(axis={axis}): the launch grid has one axis (LNC degree)",
                               fix="use nl.program_id(0)", location=user_location())
    return current().program_id


def num_programs(axes: int | None = None) -> int:
    """Number of programs in the launch grid (the LNC degree, 1 or 2)."""
    return current().num_programs


def ds(start: int, size: int) -> slice:
    """A slice of ``size`` elements starting at ``start``."""
    return slice(start, start + size)


def device_print(prefix: str, x: NkiTensor) -> None:
    """Print a tensor's simulated values (simulation only)."""
    ctx = current()
    if ctx.numerics:
        print(prefix, x.data.astype(np.float32) if _dt.is_float(x.dtype) else x.data)


def broadcast_to(x: NkiTensor, shape) -> NkiTensor:
    """Stride-0 view of ``x`` with size-1 dims repeated (use as a DMA source)."""
    return x.broadcast_to(shape)


def expand_dims(x: NkiTensor, axis: int) -> NkiTensor:
    shape = list(x.shape)
    axis = axis + len(shape) + 1 if axis < 0 else axis
    shape.insert(axis, 1)
    return x.reshape(tuple(shape))


class _TileSize:
    """Hardware tile limits of the target platform (``nl.tile_size.pmax`` ...)."""

    @property
    def pmax(self) -> int:
        return current().platform.sbuf_partitions

    @property
    def psum_fmax(self) -> int:
        return current().platform.psum_bank_bytes // 4

    @property
    def gemm_stationary_fmax(self) -> int:
        return current().platform.pe_cols

    @property
    def gemm_moving_fmax(self) -> int:
        return current().platform.matmul_max_moving_free

    bn_stats_fmax = 512

    @property
    def psum_partition_size(self) -> int:
        return current().platform.psum_bytes_per_partition

    @property
    def total_available_sbuf_size(self) -> int:
        return current().platform.sbuf_usable_bytes_per_partition


tile_size = _TileSize()

# ---------------------------------------------------------------------------------------------
# tensor movement
# ---------------------------------------------------------------------------------------------


def load(src: NkiTensor, dtype=None) -> NkiTensor:
    """DMA ``src`` (HBM) into a new SBUF tile."""
    t = ndarray(src.shape, dtype or src.dtype, sbuf)
    _isa.dma_copy(t, src)
    return t


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """DMA an SBUF tile into ``dst`` (HBM)."""
    _isa.dma_copy(dst, value)


def _copy(x: NkiTensor, dtype=None) -> NkiTensor:
    """A copy of an on-chip tile in a new SBUF tile (VectorE)."""
    t = ndarray(x.shape, dtype or x.dtype, sbuf)
    _isa.tensor_copy(t, x)
    return t


def transpose(x: NkiTensor, dtype=None) -> NkiTensor:
    """Transpose a [P<=128, F<=128] tile (TensorE into PSUM, then copied to a new SBUF tile)."""
    if x.ndim != 2:
        raise NKIShapeError(f"nl.transpose needs a 2-D tile, got {x._desc()}",
                            fix="reshape to [P, F]", location=user_location())
    p, f = x.shape
    ps = ndarray((f, p), float32 if x.dtype == float32 else x.dtype, psum)
    eye = shared_identity_matrix(p, x.dtype)
    _isa.nc_matmul(ps, x, eye, is_transpose=True)
    return _copy(ps, dtype or x.dtype)


def matmul(x: NkiTensor, y: NkiTensor, transpose_x: bool = False, dtype=None) -> NkiTensor:
    """``x @ y`` (or ``x.T @ y`` with ``transpose_x``) into a new SBUF tile (float32 by default).

    ``x`` is [M, K] ([K, M] when ``transpose_x``), ``y`` is [K, N]; K <= 128, M <= 128, N <= 512.
    """
    stat = x if transpose_x else transpose(x)
    m = stat.shape[1] if stat.ndim == 2 else None
    ps = ndarray((m, y.shape[1] if y.ndim == 2 else 1), float32, psum)
    _isa.nc_matmul(ps, stat, y)
    return _copy(ps, dtype or float32)


# ---------------------------------------------------------------------------------------------
# elementwise
# ---------------------------------------------------------------------------------------------


def _result_dtype(dtype, *xs):
    if dtype is not None:
        return _dt.as_dtype(dtype)
    ts = [x.dtype for x in xs if isinstance(x, NkiTensor)]
    if builtins.all(t is ts[0] or t == ts[0] for t in ts):
        return ts[0]
    if builtins.any(_dt.is_float(t) for t in ts):
        return float32
    return int32


def _unary(op: Op):
    def f(x: NkiTensor, dtype=None) -> NkiTensor:
        if not isinstance(x, NkiTensor):
            raise NKIArgumentError(f"nl.{op.name} needs a tile, got {type(x).__name__}",
                                   fix="pass an SBUF/PSUM tile", location=user_location())
        out = ndarray(x.shape, _result_dtype(dtype, x), sbuf)
        _isa.activation(out, op, x)
        return out
    f.__name__ = op.name
    f.__doc__ = f"Elementwise {op.name} (ScalarE activation) into a new SBUF tile."
    return f


def _is_pscalar(t: NkiTensor, other: NkiTensor) -> bool:
    return t.shape[0] == other.shape[0] and t.free_size() == 1 and other.free_size() > 1


def _binary(op: Op):
    def f(x, y, dtype=None) -> NkiTensor:
        xt, yt = isinstance(x, NkiTensor), isinstance(y, NkiTensor)
        if not (xt or yt):
            raise NKIArgumentError(f"nl.{op.name} needs at least one tile operand",
                                   fix="compute Python scalars in Python", location=user_location())
        if xt and yt:
            if x.shape[0] != y.shape[0]:
                raise NKIShapeError(
                    f"nl.{op.name}: {x._desc()} and {y._desc()} differ in the partition dimension; "
                    "engines cannot broadcast across partitions",
                    fix="broadcast the row to all partitions with a DMA (nl.broadcast_to as the "
                        "DMA source) first", location=user_location())
            if _is_pscalar(y, x):
                out = ndarray(x.shape, _result_dtype(dtype, x, y), sbuf)
                _isa.tensor_scalar(out, x, op, y)
                return out
            if _is_pscalar(x, y):
                out = ndarray(y.shape, _result_dtype(dtype, x, y), sbuf)
                _isa.tensor_scalar(out, y, op, x, reverse0=True)
                return out
            if x.shape != y.shape and x.free_size() != y.free_size():
                raise NKIShapeError(f"nl.{op.name}: shapes {x.shape} and {y.shape} do not match",
                                    fix="slice the tiles to the same shape", location=user_location())
            out = ndarray(x.shape, _result_dtype(dtype, x, y), sbuf)
            _isa.tensor_tensor(out, x, y, op)
            return out
        t, s, rev = (x, y, False) if xt else (y, x, True)
        out = ndarray(t.shape, _result_dtype(dtype, t), sbuf)
        _isa.tensor_scalar(out, t, op, s, reverse0=rev)
        return out
    f.__name__ = op.name
    f.__doc__ = f"Elementwise {op.name} of two tiles (or a tile and a scalar / [P, 1] tile)."
    return f


for _name, _op in OPS.items():
    _op.impl = _unary(_op) if _op.kind == "unary" else _binary(_op)
# nl.copy is both the tile-copy wrapper and the identity activation (`activation(op=nl.copy)`).
OPS["copy"].impl = _copy
copy = OPS["copy"]

add = OPS["add"]
subtract = OPS["subtract"]
multiply = OPS["multiply"]
divide = OPS["divide"]
maximum = OPS["maximum"]
minimum = OPS["minimum"]
power = OPS["power"]
mod = OPS["mod"]
exp = OPS["exp"]
log = OPS["log"]
sqrt = OPS["sqrt"]
rsqrt = OPS["rsqrt"]
reciprocal = OPS["reciprocal"]
tanh = OPS["tanh"]
sin = OPS["sin"]
cos = OPS["cos"]
abs = OPS["abs"]  # noqa: A001  (NKI name)
negative = OPS["negative"]
square = OPS["square"]
relu = OPS["relu"]
sigmoid = OPS["sigmoid"]
silu = OPS["silu"]
gelu = OPS["gelu"]
gelu_apprx_tanh = OPS["gelu_apprx_tanh"]
softplus = OPS["softplus"]
mish = OPS["mish"]
erf = OPS["erf"]
sign = OPS["sign"]
ceil = OPS["ceil"]
floor = OPS["floor"]
identity = OPS["identity"]
equal = OPS["equal"]
not_equal = OPS["not_equal"]
greater = OPS["greater"]
greater_equal = OPS["greater_equal"]
less = OPS["less"]
less_equal = OPS["less_equal"]
logical_and = OPS["logical_and"]
logical_or = OPS["logical_or"]
logical_xor = OPS["logical_xor"]
logical_not = OPS["logical_not"]
bitwise_and = OPS["bitwise_and"]
bitwise_or = OPS["bitwise_or"]
bitwise_xor = OPS["bitwise_xor"]
left_shift = OPS["left_shift"]
right_shift = OPS["right_shift"]


def where(condition: NkiTensor, x, y, dtype=None) -> NkiTensor:
    """``x`` where ``condition`` is non-zero, else ``y`` (tiles or scalars) -> new SBUF tile."""
    if not isinstance(condition, NkiTensor):
        raise NKIArgumentError("nl.where needs a tile condition", fix="pass a mask tile",
                               location=user_location())
    rev = False
    if not isinstance(x, NkiTensor):
        if isinstance(y, NkiTensor):
            x, y, rev = y, x, True
        else:
            x = full(condition.shape, x, dtype or float32)
    out = ndarray(condition.shape, _result_dtype(dtype, x, *([y] if isinstance(y, NkiTensor) else [])), sbuf)
    _isa.select_reduce(out, condition, x, y, reverse_pred=rev)
    return out


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------


def _reduced_shape(x: NkiTensor, axis, keepdims: bool) -> tuple:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = {a + x.ndim if a < 0 else a for a in axes}
    if keepdims:
        return tuple(1 if i in axes else s for i, s in enumerate(x.shape))
    shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
    return shape if len(shape) > 1 else (shape + (1,) if shape else (1, 1))


def _reduction(alu: str, name: str):
    def f(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:
        out = ndarray(_reduced_shape(x, axis, keepdims), _result_dtype(dtype, x), sbuf)
        _isa.tensor_reduce(out, OPS[alu], x, axis, keepdims=keepdims)
        return out
    f.__name__ = name
    f.__doc__ = f"{name} along free ``axis`` (int or tuple) into a new SBUF tile (VectorE)."
    f._alu = alu
    return f


sum = _reduction("add", "sum")  # noqa: A001
max = _reduction("maximum", "max")  # noqa: A001
min = _reduction("minimum", "min")  # noqa: A001
prod = _reduction("multiply", "prod")


def all(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:  # noqa: A001
    """1 where every element along ``axis`` is non-zero, else 0."""
    out = ndarray(_reduced_shape(x, axis, keepdims), dtype or uint8, sbuf)
    nz = ndarray(x.shape, float32, sbuf)
    _isa.tensor_scalar(nz, x, OPS["not_equal"], 0.0)
    _isa.tensor_reduce(out, OPS["minimum"], nz, axis, keepdims=keepdims)
    return out


def _count(x: NkiTensor, axis) -> int:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return math.prod(x.shape[a] for a in axes)


def mean(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:
    """Mean along free ``axis``."""
    s = sum(x, axis, dtype=float32, keepdims=keepdims)
    out = ndarray(s.shape, _result_dtype(dtype, x), sbuf)
    _isa.tensor_scalar(out, s, OPS["multiply"], 1.0 / _count(x, axis))
    return out


def var(x: NkiTensor, axis, dtype=None, keepdims: bool = False) -> NkiTensor:
    """Population variance along free ``axis``."""
    m = mean(x, axis, dtype=float32, keepdims=True)
    centered = ndarray(x.shape, float32, sbuf)
    if m.free_size() == 1:
        _isa.tensor_scalar(centered, x, OPS["subtract"], m)
    else:
        raise NKIArgumentError("nl.var supports reducing all free axes of a [P, F] tile",
                               fix="reshape to [P, F] and reduce axis 1", location=user_location())
    sq = ndarray(x.shape, float32, sbuf)
    acc = ndarray((x.shape[0], 1), float32, sbuf)
    _isa.activation(sq, OPS["square"], centered, reduce_op=OPS["add"], reduce_res=acc)
    out = ndarray(_reduced_shape(x, axis, keepdims), _result_dtype(dtype, x), sbuf)
    _isa.tensor_scalar(out, acc, OPS["multiply"], 1.0 / _count(x, axis))
    return out


# ---------------------------------------------------------------------------------------------
# fused ops
# ---------------------------------------------------------------------------------------------


def softmax(x: NkiTensor, axis: int = -1, dtype=None) -> NkiTensor:
    """Softmax along the free axis of a [P, F] tile: max, exp(x - max) with a fused sum,
    reciprocal, scale."""
    if x.ndim != 2 or axis not in (-1, 1):
        raise NKIArgumentError(f"nl.softmax supports the free axis of a [P, F] tile, got {x._desc()} "
                               f"axis={axis}", fix="reshape to [P, F] and use axis=-1",
                               location=user_location())
    p = x.shape[0]
    mx = ndarray((p, 1), float32, sbuf)
    _isa.tensor_reduce(mx, OPS["maximum"], x, axis=1, negate=True)
    e = ndarray(x.shape, float32, sbuf)
    s = ndarray((p, 1), float32, sbuf)
    _isa.activation(e, OPS["exp"], x, bias=mx, reduce_op=OPS["add"], reduce_res=s)
    r = ndarray((p, 1), float32, sbuf)
    _isa.reciprocal(r, s)
    out = ndarray(x.shape, _result_dtype(dtype, x), sbuf)
    _isa.tensor_scalar(out, e, OPS["multiply"], r)
    return out


def rms_norm(x: NkiTensor, w: NkiTensor, axis: int = -1, n: int | None = None,
             epsilon: float = 1e-6, dtype=None) -> NkiTensor:
    """``x * rsqrt(mean(x**2) + epsilon) * w`` along the free axis of a [P, F] tile; ``w`` is
    [P, F] or a [1, F]/[F] row (broadcast to all partitions with a DMA)."""
    if x.ndim != 2:
        raise NKIArgumentError(f"nl.rms_norm needs a [P, F] tile, got {x._desc()}",
                               fix="reshape to [P, F]", location=user_location())
    p, f = x.shape
    n = n or f
    sq = ndarray(x.shape, float32, sbuf)
    ss = ndarray((p, 1), float32, sbuf)
    _isa.activation(sq, OPS["square"], x, reduce_op=OPS["add"], reduce_res=ss)
    rinv = ndarray((p, 1), float32, sbuf)
    _isa.tensor_scalar(rinv, ss, OPS["multiply"], 1.0 / n, op1=OPS["add"], operand1=epsilon)
    _isa.activation(rinv, OPS["rsqrt"], rinv)
    normed = ndarray(x.shape, float32, sbuf)
    _isa.tensor_scalar(normed, x, OPS["multiply"], rinv)
    if w.ndim == 1:
        w = w.reshape((1, w.shape[0])) if not w.buffer.on_chip else w
    if w.shape[0] != p:
        wb = ndarray((p, f), w.dtype, sbuf)
        _isa.dma_copy(wb, w.broadcast_to((p, f)))
        w = wb
    out = ndarray(x.shape, _result_dtype(dtype, x), sbuf)
    _isa.tensor_tensor(out, normed, w, OPS["multiply"])
    return out


def dropout(x: NkiTensor, rate: float, dtype=None) -> NkiTensor:
    """Zero elements with probability ``rate`` (nisa.dropout; survivors are not rescaled)."""
    out = ndarray(x.shape, _result_dtype(dtype, x), sbuf)
    _isa.dropout(out, x, rate)
    return out


__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "builtins", "math", "np", "Any", "Callable", "Sequence", "NkiTensor", "Op", "OPS",
    "allocate", "current", "user_location", "NKIArgumentError", "NKIShapeError",
    "NKITracingError")]
