"""``nki.language`` (``nl``): buffers, dtypes, tensor creation, loops and convenience ops.

The convenience ops (``nl.load``, ``nl.exp``, ``nl.sum``, ``nl.softmax``...) return *new*
tiles, allocated in SBUF, and are lowered to the ``nisa`` instructions the NKI compiler would
emit (so they are checked and costed exactly like hand-written ``nisa`` calls). Operators such
as ``nl.add`` or ``nl.exp`` double as ``op=`` arguments of ``nisa`` instructions.
"""

from __future__ import annotations

import builtins as _builtins
import math
import os as _os
from typing import Any, Callable, Sequence

import numpy as np

from . import dtypes as _dt
from . import isa as _isa
from .dtypes import (bfloat16, bool_, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn,
                     float8_e4m3fn_x4, float8_e5m2, float8_e5m2_x4, float8_e8m0fnu, float16,
                     float32, int8, int16, int32, tfloat32, uint8, uint16, uint32)
from .errors import NKIArgumentError, NKIShapeError, NKITracingError
from .ops import OPS, Op
from .tensor import (Buffer, NkiTensor, allocate, hbm, private_hbm, psum, sbuf, shared_constant_tensor,
                     shared_hbm)
from .tracer import current, current_or_none, user_location

# This module defines NKI names that shadow Python builtins (range, bool, sum, max, min, all,
# abs). Code in this module therefore reaches the builtins only as ``_builtins.<name>``
# (checked by tests/nki/test_nki_api.py).

# ---------------------------------------------------------------------------------------------
# creation
# ---------------------------------------------------------------------------------------------


def ndarray(shape: Sequence[int], dtype: Any, buffer=sbuf, name: str | None = None,
            address: Any = None) -> NkiTensor:
    """Allocate an uninitialised tensor (filled with sentinels: NaN, or 4 for ints) in ``buffer``.

    ``address=(partition_offset, byte_offset)`` places an SBUF/PSUM tile at a fixed location of
    this core's memory: tiles placed at the same address share storage; a tile whose bytes are
    re-placed by a later allocation at a different address may no longer be used
    (``[placement]`` error). Without ``address`` the tile gets its own storage.
    """
    return allocate(shape, dtype, buffer, name, address=address)


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


def shared_identity_matrix(n: int, dtype=uint8, dst: NkiTensor | None = None) -> NkiTensor:
    """An [n, n] identity matrix in SBUF (built with memset + affine_select on GpSimd), written
    into ``dst`` when given."""
    ones_t = ones((n, n), dtype if dst is None else dst.dtype)
    eye = ndarray((n, n), dtype) if dst is None else dst
    _isa.affine_select(eye, pattern=[[-1, n]], channel_multiplier=1, on_true_tile=ones_t,
                       on_false_value=0.0, cmp_op=OPS["equal"])
    return eye


def shared_constant(constant: Any) -> NkiTensor:
    """A ``shared_hbm`` tensor holding ``constant`` (a numpy array or the path of a ``.npy``
    file), loaded with the program (no instruction). Under LNC=2 both cores share it."""
    if isinstance(constant, (str, _os.PathLike)):
        try:
            arr = np.load(constant, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise NKIArgumentError(f"shared_constant: cannot read {constant!r} ({e})",
                                   fix="pass a numpy array or the path of a .npy file",
                                   location=user_location()) from None
    elif isinstance(constant, NkiTensor):
        raise NKIArgumentError("shared_constant takes host data (numpy array or .npy path), not "
                               "a kernel tensor", fix="pass a numpy array",
                               location=user_location())
    else:
        arr = np.asarray(constant)
    return shared_constant_tensor(arr)


# ---------------------------------------------------------------------------------------------
# loops, programs, misc
# ---------------------------------------------------------------------------------------------


def affine_range(*args) -> _builtins.range:
    """Loop with no loop-carried dependency (deprecated alias of ``range`` in NKI 0.6)."""
    return _builtins.range(*args)


def sequential_range(*args) -> _builtins.range:
    """Loop whose iterations depend on each other (alias of ``range``)."""
    return _builtins.range(*args)


def static_range(*args) -> _builtins.range:
    """Fully unrolled loop (alias of ``range``)."""
    return _builtins.range(*args)


def _reg_value(v: Any, what: str) -> int:
    from .isa import VirtualRegister
    if isinstance(v, VirtualRegister):
        return v.read()
    if isinstance(v, NkiTensor):
        raise NKIArgumentError(f"{what} is a tensor; dynamic loop bounds are ints or registers",
                               fix="load the value into a register with nisa.register_load",
                               location=user_location())
    return int(v)


def dynamic_range(start, stop=None, step: int = 1):
    """A loop run on the device with run-time bounds (ints or ``VirtualRegister`` s).

    The simulator executes the iterations the register values give; each iteration value is
    passed as a ``VirtualRegister`` (usable as ``scalar_offset`` of ``.ap()``).
    """
    from .isa import VirtualRegister
    if stop is None:
        start, stop = 0, start
    if isinstance(step, VirtualRegister) or int(step) <= 0:
        raise NKIArgumentError(f"dynamic_range step {step!r} must be a positive trace-time int",
                               fix="pass a constant step such as 1", location=user_location())
    lo, hi = _reg_value(start, "start"), _reg_value(stop, "stop")
    return (VirtualRegister(i) for i in _builtins.range(lo, hi, int(step)))


def fori_loop(lower, upper, body_fun: Callable, step: int = 1) -> None:
    """``body_fun(i)`` for i in [lower, upper) step ``step``; bounds are ints or registers, ``i``
    is a ``VirtualRegister``. Other loop state lives in SBUF/HBM."""
    for i in dynamic_range(lower, upper, step):
        body_fun(i)


def while_loop(init, body_fun: Callable) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` with ``r`` a ``VirtualRegister``."""
    from .isa import VirtualRegister
    r = init
    guard = 0
    while True:
        if not isinstance(r, VirtualRegister):
            raise NKIArgumentError(f"while_loop's condition must be a VirtualRegister, got "
                                   f"{type(r).__name__}", fix="return the condition register "
                                   "from body_fun", location=user_location())
        if r.read() == 0:
            return
        r = body_fun(r)
        guard += 1
        if guard > 10_000_000:  # a kernel bug, not a workload
            raise NKITracingError("while_loop ran 10,000,000 iterations; its condition register "
                                  "never became 0", fix="update the register in body_fun",
                                  location=user_location(), rule="control-flow")


def program_id(axis: int = 0) -> int:
    """Index of this program in the launch grid (0 or 1 under LNC=2)."""
    if axis != 0:
        raise NKIArgumentError(f"program_id(axis={axis}): the launch grid has one axis (LNC degree)",
                               fix="use nl.program_id(0)", location=user_location())
    return current().program_id


def num_programs(axes: int | None = 0) -> int:
    """Number of programs in the launch grid (the LNC degree, 1 or 2)."""
    return current().num_programs


def program_ndim() -> int:
    """Dimensions of the launch grid: 0 for ``kernel(...)``, 1 for ``kernel[lnc](...)``."""
    return current().launch.grid_ndim


class no_reorder:
    """``with nl.no_reorder():`` keep the enclosed instructions in program order.

    The simulator and performance model never reorder instructions of one engine, so the block
    only groups them; it is accepted for source compatibility."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class MemoryRegion:
    """The memory kinds, as AWS's ``nl.MemoryRegion`` members (the same objects as ``nl.sbuf``...)."""

    sbuf = sbuf
    psum = psum
    private_hbm = private_hbm
    shared_hbm = shared_hbm


DType = Any  # AWS's annotation type of dtypes (here every dtype is a numpy or custom dtype)


def is_hbm(buffer) -> _builtins.bool:
    """True for ``nl.hbm``, ``nl.private_hbm``, ``nl.shared_hbm``."""
    return isinstance(buffer, Buffer) and buffer.is_hbm


def is_on_chip(buffer) -> _builtins.bool:
    """True for ``nl.sbuf`` and ``nl.psum``."""
    return isinstance(buffer, Buffer) and buffer.on_chip


def is_psum(buffer) -> _builtins.bool:
    return buffer is psum


def is_sbuf(buffer) -> _builtins.bool:
    return buffer is sbuf


class _NKIObjectType(type):
    """Lets ``Cfg(x=...)`` set declared attributes the class' own ``__init__`` does not take.

    AWS's kernels decorate NKIObject subclasses with ``@dataclass`` while declaring some
    attributes without annotations (plain class attributes), which dataclass leaves out of
    its ``__init__``; those keywords are set after construction. Unknown keywords raise.
    """

    _params: dict = {}

    def __call__(cls, *args, **kwargs):
        init = cls.__init__
        if init is NKIObject.__init__ or not kwargs:
            return super().__call__(*args, **kwargs)
        accepted = _NKIObjectType._params.get(init)
        if accepted is None:
            import inspect
            ps = inspect.signature(init).parameters.values()
            accepted = True if _builtins.any(p.kind is p.VAR_KEYWORD for p in ps) else \
                frozenset(p.name for p in ps)
            _NKIObjectType._params[init] = accepted
        extra = {}
        if accepted is not True:
            extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in accepted}
        obj = super().__call__(*args, **kwargs)
        if extra:
            declared = _declared_attributes(cls)
            unknown = [k for k in extra if k not in declared]
            if unknown:
                raise TypeError(f"{cls.__name__}() got unexpected keyword argument(s) "
                                f"{', '.join(unknown)}; declared attributes: "
                                f"{', '.join(sorted(declared)) or '(none)'}")
            for k, v in extra.items():
                setattr(obj, k, v)
        return obj


class NKIObject(metaclass=_NKIObjectType):
    """Base class of kernel-side objects (configurations, helpers).

    ``Cfg(a=1, b=2)`` sets the attributes the class declares (annotations or class attributes,
    through the whole class hierarchy); unknown keywords are errors, declared attributes not
    given stay unset (or keep their class default). With ``@dataclass`` the generated
    ``__init__`` takes the annotated fields and the other declared attributes are still
    accepted as keywords.
    """

    def __init__(self, **kwargs: Any) -> None:
        cls = type(self)
        declared = _declared_attributes(cls)
        unknown = [k for k in kwargs if k not in declared]
        if unknown:
            raise TypeError(f"{cls.__name__}() got unexpected keyword argument(s) "
                            f"{', '.join(unknown)}; declared attributes: "
                            f"{', '.join(sorted(declared)) or '(none)'}")
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({items})"


def _declared_attributes(cls) -> list:
    names: list = []
    for klass in reversed(cls.__mro__):
        if klass in (object, NKIObject):
            continue
        for k in getattr(klass, "__annotations__", {}):
            if k not in names:
                names.append(k)
        for k, v in vars(klass).items():
            if k.startswith("_") or k in names or callable(v) or isinstance(
                    v, (staticmethod, classmethod, property)):
                continue
            names.append(k)
    return names


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


def _platform():
    ctx = current_or_none()
    if ctx is not None and ctx.active:
        return ctx.platform
    from ..platform import get_platform  # outside a kernel: the target of the environment
    return get_platform()


class _TileSize:
    """Hardware tile limits of the target platform (``nl.tile_size.pmax`` ...).

    Inside a kernel: the running kernel's platform; outside (e.g. module-level constants of a
    kernel library): ``NEURON_PLATFORM_TARGET_OVERRIDE``, else trn2.
    """

    @property
    def pmax(self) -> int:
        return _platform().sbuf_partitions

    @property
    def psum_fmax(self) -> int:
        """fp32 elements per partition of one PSUM bank (deprecated name of psum_bank_fmax)."""
        return _platform().psum_bank_bytes // 4

    @property
    def psum_bank_fmax(self) -> int:
        return _platform().psum_bank_bytes // 4

    @property
    def psum_bank_fmax_bytes(self) -> int:
        return _platform().psum_bank_bytes

    @property
    def psum_num_banks(self) -> int:
        return _platform().psum_banks

    @property
    def gemm_stationary_fmax(self) -> int:
        return _platform().pe_cols

    @property
    def gemm_moving_fmax(self) -> int:
        return _platform().matmul_max_moving_free

    bn_stats_fmax = 512

    @property
    def psum_partition_size(self) -> int:
        return _platform().psum_bytes_per_partition

    @property
    def total_available_sbuf_size(self) -> int:
        """Usable SBUF bytes per partition (deprecated name of sbuf_fmax_bytes)."""
        return _platform().sbuf_usable_bytes_per_partition

    @property
    def sbuf_fmax_bytes(self) -> int:
        return _platform().sbuf_usable_bytes_per_partition

    @property
    def sbuf_fmax(self) -> int:
        return _platform().sbuf_usable_bytes_per_partition // 4

    @property
    def sbuf_size_bytes(self) -> int:
        p = _platform()
        return p.sbuf_partitions * p.sbuf_bytes_per_partition

    @property
    def psum_min_align(self) -> int:
        raise NotImplementedError("nl.tile_size.psum_min_align: AWS does not publish the value")

    @property
    def sbuf_min_align(self) -> int:
        raise NotImplementedError("nl.tile_size.sbuf_min_align: AWS does not publish the value")


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
    if _builtins.all(t is ts[0] or t == ts[0] for t in ts):
        return ts[0]
    if _builtins.any(_dt.is_float(t) for t in ts):
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
fmod = OPS["fmod"]
abs_max = OPS["abs_max"]
abs_min = OPS["abs_min"]
gelu_apprx_sigmoid = OPS["gelu_apprx_sigmoid"]
gelu_apprx_sigmoid_dx = OPS["gelu_apprx_sigmoid_dx"]
silu_dx = OPS["silu_dx"]
gelu_dx = OPS["gelu_dx"]
erf_dx = OPS["erf_dx"]
tan = OPS["tan"]
arctan = OPS["arctan"]
trunc = OPS["trunc"]
average = OPS["average"]
bypass = OPS["bypass"]
prelu = OPS["prelu"]


def invert(x: NkiTensor, dtype=None) -> NkiTensor:
    """Bitwise NOT of an integer tile (VectorE ``tensor_scalar`` xor with all ones)."""
    if not isinstance(x, NkiTensor) or not _dt.is_int(x.dtype):
        raise NKIArgumentError("nl.invert needs an integer tile", fix="pass an int/uint tile",
                               location=user_location())
    out = ndarray(x.shape, _result_dtype(dtype, x), sbuf)
    ones_bits = -1 if np.dtype(x.dtype).kind == "i" else int(np.iinfo(x.dtype).max)
    _isa.tensor_scalar(out, x, OPS["bitwise_xor"], ones_bits)
    return out


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


def load_transpose2d(src: NkiTensor, dtype=None) -> NkiTensor:
    """DMA a 2-D HBM tensor [A, B] into a new SBUF tile [B, A] (``nisa.dma_transpose``)."""
    if src.ndim != 2:
        raise NKIShapeError(f"nl.load_transpose2d needs a 2-D tensor, got {src._desc()}",
                            fix="slice or reshape to 2-D", location=user_location())
    t = ndarray((src.shape[1], src.shape[0]), src.dtype, sbuf)
    _isa.dma_transpose(t, src)
    if dtype is not None and _dt.as_dtype(dtype) != src.dtype:
        return _copy(t, dtype)
    return t


def gather_flattened(data: NkiTensor, indices: NkiTensor, axis: int = 0, dtype=None) -> NkiTensor:
    """Per partition, ``data`` (free dims flattened) gathered at ``indices`` (``nisa.nc_n_gather``)."""
    out = ndarray(indices.shape, data.dtype, sbuf)
    _isa.nc_n_gather(out, data, indices)
    if dtype is not None and _dt.as_dtype(dtype) != data.dtype:
        return _copy(out, dtype)
    return out


def rand(shape, dtype, buffer=sbuf, name: str | None = None) -> NkiTensor:
    """A tile of uniform [0, 1) values (GpSimd random number generator; the stream is seeded by
    the ``seed`` of nki.simulate / nki.benchmark and the program id)."""
    t = ndarray(shape, dtype, buffer, name)
    _isa.rand_uniform(t, 0.0, 1.0)
    return t


def random_seed(seed: NkiTensor) -> None:
    """Seed the random number generator of this core with the value of a [1, 1] tile."""
    _isa.set_rng_seed(seed)


# NKI names that are also Python builtins; assigned last, after every use of the builtins
# above (which go through _builtins anyway).
range = _builtins.range  # noqa: A001  (nl.range: a trace-time unrolled loop, like affine_range)
bool = bool_  # noqa: A001  (nl.bool: the boolean dtype)

__all__ = [n for n in dir() if not n.startswith("_") and n not in (
    "annotations", "math", "np", "Any", "Callable", "Sequence", "Op", "OPS", "Buffer",
    "allocate", "current", "current_or_none", "user_location", "NKIArgumentError",
    "NKIShapeError", "NKITracingError", "shared_constant_tensor")]
