"""NkiTensor: a storage (one allocation in HBM, SBUF or PSUM) plus a strided view of it.

Views never copy: slicing, ``reshape`` and ``.ap()`` access patterns return new
:class:`NkiTensor` objects that share the storage, so writes through any view are visible in
all of them. For on-chip buffers (SBUF/PSUM) dimension 0 is the partition dimension: it is
never strided, and indexing it with an integer keeps it (size 1).
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import numpy as np

from . import dtypes as dt
from .errors import (NKIArgumentError, NKIMemoryError, NKIOutOfBoundsError, NKIPartitionError,
                     NKIShapeError, NKITracingError)
from .tracer import current, user_location


class Buffer:
    """A memory kind: ``nl.sbuf``, ``nl.psum``, ``nl.hbm``, ``nl.shared_hbm``, ``nl.private_hbm``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    @property
    def is_hbm(self) -> bool:
        return self.name.endswith("hbm")

    @property
    def on_chip(self) -> bool:
        return not self.is_hbm

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __reduce__(self):
        return (_buffer_by_name, (self.name,))


sbuf = Buffer("sbuf")
psum = Buffer("psum")
hbm = Buffer("hbm")
shared_hbm = Buffer("shared_hbm")
private_hbm = Buffer("private_hbm")
BUFFERS = {b.name: b for b in (sbuf, psum, hbm, shared_hbm, private_hbm)}


def _buffer_by_name(name: str) -> Buffer:
    return BUFFERS[name]


class Storage:
    """One allocation.

    ``sid`` identifies the allocation (its lifetime in the memory ledger); ``dep_sid`` keys the
    byte regions the performance model tracks dependencies on (the same as ``sid``, except
    for tiles placed with ``address=``, which share it with every tile placed at the same
    address). ``p0`` is the first partition of a placed tile; ``row_bytes`` the partition
    stride of ``array`` in bytes.
    """

    __slots__ = ("sid", "buffer", "array", "dtype", "name", "row_bytes", "base_ptr", "written",
                 "bank", "external", "dirty", "dep_sid", "p0", "address",
                 "clobbered", "loc", "root", "__weakref__")

    def __init__(self, sid: int, buffer: Buffer, array: np.ndarray, dtype, name: str):
        self.sid = sid
        self.dep_sid = sid
        self.buffer = buffer
        self.array = array
        self.dtype = dtype
        self.name = name
        self.row_bytes = (array.nbytes // array.shape[0]) if array.ndim and array.shape[0] else max(array.nbytes, 1)
        self.base_ptr = array.__array_interface__["data"][0]
        self.written = None  # PSUM: per-element "has been written" flags for accumulate=None
        self.bank = None
        self.external = False  # memory owned by the caller (a kernel input)
        self.dirty = False  # an external storage some DMA wrote (the caller must see it)
        self.p0 = 0
        self.address = None  # (partition, byte) of a tile placed with address=
        self.clobbered = None  # placed tile whose bytes a later placement took: (desc, loc)
        self.loc = None  # allocation site (file:line)
        self.root = array  # the contiguous array holding these bytes (see _root)


# Recycled host memory for on-chip tiles. Fresh multi-megabyte numpy arrays come from mmap and
# page-fault on first touch, which cost more than the arithmetic of a whole instruction.
_POOL: dict[int, list] = {}
_POOL_STATE = {"bytes": 0}
_POOL_MIN = 64 * 1024
_POOL_LIMIT = 128 * 1024 * 1024


def _take(nbytes: int) -> np.ndarray:
    lst = _POOL.get(nbytes)
    if lst:
        try:
            raw = lst.pop()
            _POOL_STATE["bytes"] -= nbytes
            return raw
        except IndexError:  # another thread took it
            pass
    return np.empty(nbytes, np.uint8)


def _give(raw: np.ndarray) -> None:
    if _POOL_STATE["bytes"] + raw.nbytes <= _POOL_LIMIT:
        _POOL.setdefault(raw.nbytes, []).append(raw)
        _POOL_STATE["bytes"] += raw.nbytes


def describe(shape, dtype, buffer) -> str:
    return f"{buffer.name}[{', '.join(map(str, shape))}] {dt.name(dtype)}"


def _check_shape(shape: Any, loc) -> tuple:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise NKIArgumentError(f"shape must be a tuple of ints, got {shape!r}",
                               fix="pass e.g. (128, 512)", location=loc) from None
    if any(s <= 0 for s in shape):
        raise NKIShapeError(f"shape {shape} has a non-positive dimension",
                            fix="every dimension must be >= 1", location=loc)
    return shape


def _check_dtype(dtype, loc):
    try:
        return dt.as_dtype(dtype)
    except TypeError as e:
        raise NKIArgumentError(str(e), fix="use an nl dtype such as nl.float32 or nl.bfloat16",
                               location=loc) from None


def allocate(shape: Any, dtype: Any, buffer: Buffer, name: str | None = None,
             address: Any = None) -> "NkiTensor":
    """Allocate a fresh tensor filled with sentinels (NaN for floats, 4 for ints).

    ``address=(partition, byte)`` places an SBUF/PSUM tile in this core's memory (see
    :meth:`KernelContext.place`); otherwise the tile gets storage of its own. Capacity is
    accounted by the memory ledger at the end of the program, from each tile's lifetime
    (allocation to last use).
    """
    ctx = current()
    loc = user_location()
    shape = _check_shape(shape, loc)
    if not isinstance(buffer, Buffer):
        raise NKIArgumentError(f"buffer must be one of nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm, "
                               f"nl.private_hbm, got {buffer!r}", fix="pass buffer=nl.sbuf",
                               location=loc)
    dtype = _check_dtype(dtype, loc)
    desc = describe(shape, dtype, buffer)
    if buffer.on_chip:
        pmax = ctx.platform.sbuf_partitions
        if shape[0] > pmax:
            raise NKIPartitionError(
                f"partition dimension {shape[0]} exceeds maximum {pmax} for {desc}",
                fix=f"tile dimension 0 into chunks of at most {pmax} partitions", location=loc,
                rule="partition-size")
    elif address is not None:
        raise NKIArgumentError(f"address={address!r} given for {desc}; only SBUF and PSUM tiles "
                               "are placed", fix="drop address= for HBM tensors", location=loc)
    if buffer is shared_hbm and ctx.launch.num_programs > 1:
        # Both programs of an LNC2 launch see the same shared_hbm tensor: the k-th shared_hbm
        # allocation of every program aliases the k-th of the program that got there first.
        return ctx.launch.shared_tensor(ctx, shape, dtype, desc, loc,
                                        lambda: _new_storage(ctx, shape, dtype, buffer, name))
    if address is not None:
        st = ctx.memory.place(ctx, shape, dtype, buffer, name, address, desc, loc)
        return NkiTensor(st, st.array, dtype)
    if buffer is psum and math.prod(shape[1:]) * dtype.itemsize > ctx.platform.psum_bytes_per_partition:
        raise NKIMemoryError(
            f"PSUM tile {desc} needs {math.prod(shape[1:]) * dtype.itemsize} bytes per partition; "
            f"PSUM has {ctx.platform.psum_bytes_per_partition} ({ctx.platform.psum_banks} banks of "
            f"{ctx.platform.psum_bank_bytes})", fix="split the free dimension over several PSUM "
            "tiles", location=loc, rule="psum-capacity")
    st = _new_storage(ctx, shape, dtype, buffer, name)
    st.loc = loc
    if buffer.on_chip:
        ctx.memory.record(st, math.prod(shape[1:]) * dtype.itemsize, desc, loc)
    if buffer is psum:
        st.written = np.zeros((shape[0], math.prod(shape[1:])), dtype=bool)
    return NkiTensor(st, st.array, dtype)


def _new_storage(ctx, shape, dtype, buffer, name) -> Storage:
    sid = ctx.new_sid()
    sdt = dt.storage(dtype)
    raw = None
    if buffer.on_chip and math.prod(shape) * sdt.itemsize >= _POOL_MIN:
        raw = _take(math.prod(shape) * sdt.itemsize)
        arr = raw.view(sdt).reshape(shape)
    else:
        arr = np.empty(shape, dtype=sdt)
    arr.fill(dt.sentinel(dtype))
    st = Storage(sid, buffer, arr, dtype, name or f"t{sid}")
    if raw is not None:
        weakref.finalize(st, _give, raw)
    return st


def shared_constant_tensor(arr: np.ndarray) -> "NkiTensor":
    """A shared_hbm tensor initialised with ``arr`` (nl.shared_constant)."""
    ctx = current()
    loc = user_location()
    if arr.ndim == 0:
        arr = arr.reshape(1)
    dtype = _check_dtype(arr.dtype, loc)
    shape = tuple(int(s) for s in arr.shape)
    desc = describe(shape, dtype, shared_hbm)

    def make():
        st = _new_storage(ctx, shape, dtype, shared_hbm, None)
        st.array[...] = arr
        return st
    if ctx.launch.num_programs > 1:
        return ctx.launch.shared_tensor(ctx, shape, dtype, desc, loc, make)
    st = make()
    return NkiTensor(st, st.array, dtype)


def wrap_array(arr: np.ndarray, dtype, name: str, buffer: Buffer = hbm) -> "NkiTensor":
    """Make a kernel input: an HBM tensor sharing memory with ``arr`` (writes go back to it)."""
    ctx = current()
    st = Storage(ctx.new_sid(), buffer, arr, dtype, name)
    st.external = True
    return NkiTensor(st, arr, dtype)



def _norm_index(i, n: int, axis: int, t: "NkiTensor", loc) -> int:
    i = int(i)
    j = i + n if i < 0 else i
    if not 0 <= j < n:
        raise NKIOutOfBoundsError(
            f"index {i} is out of bounds for dimension {axis} of size {n} of {t._desc()}",
            fix=f"use an index in [0, {n})", location=loc)
    return j


def _norm_slice(s: slice, n: int, axis: int, t: "NkiTensor", loc, partition: bool) -> slice:
    step = 1 if s.step is None else int(s.step)
    if step <= 0:
        raise NKIArgumentError(f"slice step {step} on dimension {axis} is not supported",
                               fix="use a positive step", location=loc)
    if partition and step != 1:
        raise NKIPartitionError(
            f"the partition dimension of {t._desc()} cannot be strided (step {step})",
            fix="select partitions with a contiguous slice; rearrange data with a DMA instead",
            location=loc, rule="partition-stride")
    start = 0 if s.start is None else int(s.start)
    stop = n if s.stop is None else int(s.stop)
    start = start + n if start < 0 else start
    stop = stop + n if stop < 0 else stop
    if not (0 <= start <= n and 0 <= stop <= n):
        raise NKIOutOfBoundsError(
            f"slice {s.start}:{s.stop} is out of bounds for dimension {axis} of size {n} of {t._desc()}",
            fix=f"keep slice bounds within [0, {n}]", location=loc)
    if stop <= start:
        raise NKIShapeError(f"slice {s.start}:{s.stop} on dimension {axis} of {t._desc()} is empty",
                            fix="use a non-empty range", location=loc)
    return slice(start, stop, step)


class NkiTensor:
    """A tensor in HBM, SBUF or PSUM (a view of a :class:`Storage`).

    Views never copy. AWS's view API is supported: slicing and integer indexing,
    :meth:`reshape`, :meth:`permute`, :meth:`slice`, :meth:`select`, :meth:`vector_select`,
    :meth:`broadcast`, :meth:`expand_dim`, :meth:`squeeze_dim`, :meth:`reshape_dim`,
    :meth:`flatten_dims`, :meth:`view` (dtype reinterpretation) and :meth:`ap` (explicit
    access patterns). ``strides`` and ``offset`` are in elements of the tensor's dtype, in the
    storage's row-major layout (for on-chip tensors one partition step is the storage's
    elements per partition).
    """

    __slots__ = ("storage", "data", "dtype", "_region", "_offset", "ind")
    __array_priority__ = 1000

    def __init__(self, storage: Storage, data: np.ndarray, dtype):
        self.storage = storage
        self.data = data
        self.dtype = dtype
        self._region = None  # a view never changes where it points: cache its geometry
        self._offset = None
        # Indirect (run-time offset) access pattern, resolved by the DMA that uses it:
        # (index: tensor / register / int, element stride of the indexed dimension,
        #  base element, [(stride, count), ...], is_vector, unit dtype)
        self.ind = None

    # -- properties -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def buffer(self) -> Buffer:
        return self.storage.buffer

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple:
        """Element strides of this view in the storage's row-major layout."""
        return tuple(self._elem_stride(s) for s in self.data.strides)

    @property
    def offset(self) -> int:
        """Element offset of this view's first element in the storage's row-major layout."""
        return self._logical_byte_offset() // self.itemsize

    def _storage_row_bytes(self) -> int:
        """Bytes per partition (row) of the storage's logical layout."""
        a = self.storage.array
        return a.itemsize * (math.prod(a.shape[1:]) if a.ndim > 1 else 1)

    def _elem_stride(self, s: int) -> int:
        st = self.storage
        if st.buffer.on_chip and s and s % st.row_bytes == 0 and abs(s) >= st.row_bytes:
            return (s // st.row_bytes) * (self._storage_row_bytes() // self.itemsize)
        return s // self.itemsize

    def _logical_byte_offset(self) -> int:
        b = self.byte_offset()
        st = self.storage
        if st.buffer.on_chip:
            r, c = divmod(b, st.row_bytes)
            return r * self._storage_row_bytes() + c
        return b

    def _desc(self) -> str:
        return describe(self.shape, self.dtype, self.buffer)

    def __repr__(self) -> str:
        return f"NkiTensor({self.name}: {self._desc()})"

    def byte_offset(self) -> int:
        if self._offset is None:
            self._offset = self.data.__array_interface__["data"][0] - self.storage.base_ptr
        return self._offset

    def partition_start(self) -> int:
        """First partition this view accesses (absolute, for tiles placed with ``address``)."""
        st = self.storage
        off = self._offset if self._offset is not None else self.byte_offset()
        return st.p0 + off // st.row_bytes

    def free_size(self) -> int:
        """Elements per partition (on-chip) / per row."""
        a = self.data
        if a.ndim < 2:
            return 1
        n = a.shape[0]
        return a.size // n if n else math.prod(a.shape[1:])

    def region(self) -> tuple:
        """Bounding box ``(dep id, row0, row1, byte0, byte1, storage id)`` of the bytes this
        view touches (rows and bytes relative to the storage, or to the placement address)."""
        if self._region is None:
            self._region = self._compute_region()
        return self._region

    def _compute_region(self) -> tuple:
        a = self.data
        st = self.storage
        rb = st.row_bytes
        off = self.byte_offset()
        rows = 0
        cols = a.itemsize
        for n, s in zip(a.shape, a.strides):
            if n <= 1 or s == 0:
                continue
            if s >= rb and s % rb == 0:
                rows += (n - 1) * (s // rb)
            else:
                cols += (n - 1) * s
        r0, c0 = divmod(off, rb)
        if c0 + cols > rb:
            return (st.dep_sid, r0, (off + rows * rb + cols - 1) // rb + 1, 0, rb, st.sid)
        return (st.dep_sid, r0, r0 + rows + 1, c0, c0 + cols, st.sid)

    # -- queries (AWS NkiTensor API) ----------------------------------------------------------
    def is_indirect(self) -> bool:
        """True if this view uses run-time (indirect) addressing."""
        return self.ind is not None

    def is_contiguous(self) -> bool:
        """True if the view covers its elements contiguously in row-major order (on chip: per
        partition, over the free dimensions)."""
        dims = list(zip(self.shape, self.strides))
        if self.buffer.on_chip:
            dims = dims[1:]
        expect = 1
        for n, s in reversed(dims):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True

    def get_pattern(self) -> list:
        """The view's access pattern ``[[stride, count], ...]`` (element strides)."""
        return [[s, n] for s, n in zip(self.strides, self.shape)]

    # -- Python protocol guards -------------------------------------------------------------
    def __bool__(self):
        raise NKITracingError(
            f"the truth value of {self._desc()} is unknown while tracing: Python `if`/`while` on "
            "tensor values (data-dependent control flow) is not supported",
            fix="compute a mask and use nl.where / nisa.select_reduce, or load the value into a "
                "register (nisa.register_load) for nl.while_loop / nl.dynamic_range",
            location=user_location(), rule="control-flow")

    def __iter__(self):
        raise NKITracingError(
            f"cannot iterate over {self._desc()}",
            fix="loop over indices with `for i in nl.affine_range(n)` and slice the tensor",
            location=user_location(), rule="control-flow")

    def __array__(self, *a, **k):
        raise NKITracingError(
            f"{self._desc()} cannot be converted to a numpy array inside a kernel",
            fix="use nl.* / nisa.* operations on tiles (e.g. nl.exp instead of np.exp)",
            location=user_location(), rule="numpy")

    def __float__(self):
        raise NKITracingError(f"{self._desc()} has no Python value while tracing",
                              fix="keep values in tiles and operate with nl.* / nisa.*",
                              location=user_location(), rule="control-flow")

    __int__ = __float__
    __index__ = __float__

    def __hash__(self):
        return id(self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        from .ops import op_from_any
        op = op_from_any(ufunc) if method == "__call__" and not kwargs else None
        if op is None:
            raise NKITracingError(f"numpy {ufunc.__name__}.{method} cannot run on NKI tensors",
                                  fix="use the nl.* equivalent", location=user_location(),
                                  rule="numpy")
        return op(*inputs)

    # -- views ------------------------------------------------------------------------------
    def _view(self, data: np.ndarray, dtype=None) -> "NkiTensor":
        return NkiTensor(self.storage, data, self.dtype if dtype is None else dtype)

    def _no_indirect(self, what: str) -> None:
        if self.ind is not None:
            raise NKIArgumentError(f"cannot {what} an indirect access pattern ({self._desc()})",
                                   fix="express the whole access in the .ap() pattern",
                                   location=user_location())

    def _dim(self, dim: int) -> int:
        d = int(dim)
        d = d + self.ndim if d < 0 else d
        if not 0 <= d < self.ndim:
            raise NKIArgumentError(f"dimension {dim} is out of range for {self._desc()}",
                                   fix=f"use a dimension in [0, {self.ndim})",
                                   location=user_location())
        return d

    def _keep_partition(self, d: int, what: str) -> None:
        if self.buffer.on_chip and d == 0:
            raise NKIPartitionError(f"{what} dimension 0 of {self._desc()}, its partition "
                                    "dimension", fix="operate on free dimensions (1..); move data "
                                    "across partitions with a DMA or transpose",
                                    location=user_location(), rule="partition-dim")

    def __getitem__(self, key) -> "NkiTensor":
        loc = None
        if self.ind is not None:  # inline check: slicing is the hottest call of a kernel
            self._no_indirect("slice")
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > self.ndim:
            raise NKIOutOfBoundsError(f"too many indices ({len(key)}) for {self._desc()}",
                                      fix=f"index at most {self.ndim} dimensions",
                                      location=user_location())
        on_chip = self.storage.buffer.on_chip
        norm = []
        for axis, k in enumerate(key):
            n = self.shape[axis]
            if isinstance(k, slice):
                if (k.start is not None and not isinstance(k.start, (int, np.integer))) or \
                        (k.stop is not None and not isinstance(k.stop, (int, np.integer))):
                    raise NKITracingError(
                        f"slice bounds must be Python ints at trace time, got {k!r}",
                        fix="use loop indices from range/nl.affine_range; dynamic offsets need "
                            ".ap(scalar_offset=...)", location=user_location(), rule="indexing")
                loc = loc or user_location()
                norm.append(_norm_slice(k, n, axis, self, loc, on_chip and axis == 0))
            elif isinstance(k, (int, np.integer)):
                loc = loc or user_location()
                j = _norm_index(k, n, axis, self, loc)
                norm.append(slice(j, j + 1) if (on_chip and axis == 0) else j)
            elif isinstance(k, NkiTensor):
                raise NKITracingError(
                    "indexing a tensor with another tensor (dynamic indexing) is not supported",
                    fix="use .select(dim, index_tile), nisa.dma_copy with .ap(vector_offset=...) "
                        "or nl.where", location=user_location(), rule="indexing")
            else:
                raise NKIArgumentError(f"unsupported index {k!r} on {self._desc()}",
                                       fix="index with ints and slices", location=user_location())
        return self._view(self.data[tuple(norm)])

    def __setitem__(self, key, value) -> None:
        from . import isa
        dst = self[key]
        if isinstance(value, NkiTensor):
            if dst.buffer.is_hbm or value.buffer.is_hbm:
                isa.dma_copy(dst, value)
            else:
                isa.tensor_copy(dst, value)
        else:
            isa.memset(dst, value)

    def reshape(self, *shape) -> "NkiTensor":
        """A view with a new shape (no copy; the partition dim of on-chip tensors is kept)."""
        self._no_indirect("reshape")
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        try:
            new = np.reshape(self.data, shape, copy=False)
        except ValueError as e:
            raise NKIShapeError(f"cannot reshape {self._desc()} to {shape} without copying ({e})",
                                fix="reshape only contiguous views, or copy into a new tile first",
                                location=user_location()) from None
        if self.buffer.on_chip and new.shape[0] != self.shape[0]:
            raise NKIPartitionError(
                f"reshape of {self._desc()} to {shape} changes the partition dimension",
                fix="keep dimension 0 unchanged; move data across partitions with a DMA or transpose",
                location=user_location(), rule="partition-reshape")
        return self._view(new)

    def broadcast_to(self, shape) -> "NkiTensor":
        """Read-only stride-0 view repeating size-1 dimensions (a DMA source, e.g. a row to all partitions)."""
        try:
            return self._view(np.broadcast_to(self.data, tuple(shape)))
        except ValueError:
            raise NKIShapeError(f"cannot broadcast {self._desc()} to {tuple(shape)}",
                                fix="only size-1 dimensions can be broadcast",
                                location=user_location()) from None

    def broadcast(self, dim: int, size: int) -> "NkiTensor":
        """Repeat size-1 dimension ``dim`` ``size`` times (stride 0; not the partition dim on chip)."""
        d = self._dim(dim)
        self._keep_partition(d, "broadcast")
        if self.shape[d] != 1:
            raise NKIShapeError(f"broadcast needs dimension {d} of {self._desc()} to have size 1",
                                fix="broadcast a size-1 dimension", location=user_location())
        shape = list(self.shape)
        shape[d] = int(size)
        return self.broadcast_to(shape)

    def permute(self, dims) -> "NkiTensor":
        """Reorder dimensions (on chip, dimension 0 stays first)."""
        self._no_indirect("permute")
        dims = tuple(self._dim(d) for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NKIArgumentError(f"permute{dims} is not a permutation of the {self.ndim} "
                                   f"dimensions of {self._desc()}", fix="list every dimension once",
                                   location=user_location())
        if self.buffer.on_chip and dims[0] != 0:
            raise NKIPartitionError(f"permute{dims} moves the partition dimension of {self._desc()}",
                                    fix="keep 0 first; transpose across partitions with "
                                        "nisa.nc_transpose / dma_transpose",
                                    location=user_location(), rule="partition-dim")
        return self._view(np.transpose(self.data, dims))

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> "NkiTensor":
        """Elements ``start:end:step`` of dimension ``dim``."""
        d = self._dim(dim)
        key = [slice(None)] * self.ndim
        key[d] = slice(int(start), int(end), int(step))
        return self[tuple(key)]

    def select(self, dim: int, index) -> "NkiTensor":
        """Remove dimension ``dim`` at ``index``: an int, or a run-time index (a [1, 1] SBUF
        tile or a register) giving an indirect view for DMAs."""
        d = self._dim(dim)
        if isinstance(index, (int, np.integer)):
            n = self.shape[d]
            j = _norm_index(index, n, d, self, user_location())
            key = [slice(None)] * self.ndim
            key[d] = slice(j, j + 1)
            v = self[tuple(key)]
            return v._view(np.squeeze(v.data, axis=d)) if not (self.buffer.on_chip and d == 0) else v
        self._keep_partition(d, "dynamically select")
        pattern = [[s, n] for i, (s, n) in enumerate(zip(self.strides, self.shape)) if i != d]
        return self.ap(pattern, scalar_offset=index, indirect_dim=d)

    def vector_select(self, dim: int, vector_offset: "NkiTensor") -> "NkiTensor":
        """Per-partition indirect rows: row p of the result is ``self[vector_offset[p]]``
        (``dim`` must be 0; HBM tensors; a DMA operand)."""
        if self._dim(dim) != 0:
            raise NKIArgumentError("vector_select supports dim=0 only", fix="pass dim=0",
                                   location=user_location())
        pattern = [[s, n] for s, n in zip(self.strides, self.shape)]
        pattern[0] = [self.strides[0], vector_offset.shape[0]]
        return self.ap(pattern, vector_offset=vector_offset, indirect_dim=0)

    def expand_dim(self, dim: int) -> "NkiTensor":
        """Insert a size-1 dimension at ``dim`` (not before the partition dim on chip)."""
        d = int(dim)
        d = d + self.ndim + 1 if d < 0 else d
        if not 0 <= d <= self.ndim:
            raise NKIArgumentError(f"expand_dim({dim}) out of range for {self._desc()}",
                                   fix=f"use a position in [0, {self.ndim}]", location=user_location())
        self._keep_partition(d, "insert a dimension before")
        return self._view(np.expand_dims(self.data, d))

    def squeeze_dim(self, dim: int) -> "NkiTensor":
        """Remove size-1 dimension ``dim`` (not the partition dim on chip)."""
        d = self._dim(dim)
        self._keep_partition(d, "squeeze")
        if self.shape[d] != 1:
            raise NKIShapeError(f"squeeze_dim({d}): dimension has size {self.shape[d]}, not 1",
                                fix="squeeze a size-1 dimension", location=user_location())
        return self._view(np.squeeze(self.data, axis=d))

    def reshape_dim(self, dim: int, shape) -> "NkiTensor":
        """Split dimension ``dim`` into ``shape`` (one entry may be -1)."""
        d = self._dim(dim)
        shape = [int(x) for x in shape]
        n = self.shape[d]
        if shape.count(-1) > 1:
            raise NKIArgumentError(f"reshape_dim shape {shape} has more than one -1",
                                   fix="leave at most one size to infer", location=user_location())
        if -1 in shape:
            known = math.prod(x for x in shape if x != -1)
            shape[shape.index(-1)] = n // known if known and n % known == 0 else -2
        if math.prod(shape) != n or any(x <= 0 for x in shape):
            raise NKIShapeError(f"reshape_dim({d}, {shape}): sizes do not multiply to {n}",
                                fix="split the dimension into factors of its size",
                                location=user_location())
        if d == 0 and self.buffer.on_chip and len(shape) != 1:
            self._keep_partition(d, "split")
        return self.reshape(self.shape[:d] + tuple(shape) + self.shape[d + 1:])

    def flatten_dims(self, start_dim: int, end_dim: int) -> "NkiTensor":
        """Merge dimensions ``start_dim..end_dim`` (inclusive; must be contiguous in memory)."""
        a, b = self._dim(start_dim), self._dim(end_dim)
        if b < a:
            raise NKIArgumentError(f"flatten_dims({start_dim}, {end_dim}): end before start",
                                   fix="pass start_dim <= end_dim", location=user_location())
        if a == 0 and b > 0:
            self._keep_partition(0, "merge")
        merged = math.prod(self.shape[a:b + 1])
        return self.reshape(self.shape[:a] + (merged,) + self.shape[b + 1:])

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None) -> "NkiTensor":
        """einops-style ``rearrange`` of named dimensions (split, permute, merge)."""
        fixed = dict(fixed_sizes or {})
        names = []
        split = []
        for i, g in enumerate(src_pattern):
            grp = list(g) if isinstance(g, (tuple, list)) else [g]
            n = self.shape[i]
            sizes = [fixed.get(x, -1) for x in grp]
            if sizes.count(-1) == 1:
                known = math.prod(x for x in sizes if x != -1)
                sizes[sizes.index(-1)] = n // known
            elif sizes.count(-1) > 1:
                raise NKIArgumentError(f"rearrange: sizes of {grp} are ambiguous",
                                       fix="give fixed_sizes for all but one", location=user_location())
            names += grp
            split += sizes
        if len(src_pattern) != self.ndim:
            raise NKIArgumentError(f"rearrange pattern {src_pattern} has {len(src_pattern)} "
                                   f"dimensions; {self._desc()} has {self.ndim}",
                                   fix="name every dimension", location=user_location())
        t = self.reshape(tuple(split))
        flat_dst = [x for g in dst_pattern for x in (g if isinstance(g, (tuple, list)) else [g])]
        t = t.permute(tuple(names.index(x) for x in flat_dst))
        shape = []
        k = 0
        for g in dst_pattern:
            cnt = len(g) if isinstance(g, (tuple, list)) else 1
            shape.append(math.prod(t.shape[k:k + cnt]))
            k += cnt
        return t.reshape(tuple(shape))

    def view(self, dtype) -> "NkiTensor":
        """Reinterpret the bytes as ``dtype``; the last dimension scales with the size ratio."""
        self._no_indirect("reinterpret")
        d = dt.as_dtype(dtype)
        try:
            return self._view(self.data.view(dt.storage(d)), d)
        except ValueError as e:
            raise NKIShapeError(f"cannot view {self._desc()} as {dt.name(d)} ({e})",
                                fix="the last dimension must be contiguous and divisible by the "
                                    "size ratio", location=user_location()) from None

    reinterpret_cast = view

    def indirect(self, index: "NkiTensor", num_elem: int | None = None) -> "NkiTensor":
        """Tensor indirection (NeuronCore-v4 compute-engine gather/scatter): not implemented."""
        raise NotImplementedError(
            "NkiTensor.ind (NeuronCore-v4 tensor indirection for compute engines) is not "
            "implemented by torchneuron's simulator; gather with nisa.dma_copy and "
            ".ap(vector_offset=...) or nisa.nc_n_gather / local_gather instead")

    # -- access patterns --------------------------------------------------------------------
    def ap(self, pattern: Sequence[Sequence[int]], offset: int | None = None, *, scalar_offset=None,
           vector_offset=None, indirect_dim: int = 0, dtype=None) -> "NkiTensor":
        """Access-pattern view ``pattern=[[stride, count], ...]`` over this view's storage.

        Strides and ``offset`` count elements of ``dtype`` (default: this tensor's) in the
        storage's row-major layout, from this view's first element; on chip the first pair
        steps partitions (stride = elements per partition). Every address must lie inside the
        storage. ``scalar_offset`` (an int, a [1, 1] SBUF tile or a register) adds
        ``index * strides[indirect_dim]`` (this view's element stride of that dimension) at run
        time; ``vector_offset`` (an SBUF [P, 1] index tile) replaces pattern dimension 0 by
        ``index[p] * strides[indirect_dim]``. Indirect views are DMA operands.
        """
        loc = user_location()
        self._no_indirect("re-pattern")
        try:
            pairs = [(int(s), int(c)) for s, c in pattern]
        except (TypeError, ValueError):
            raise NKIArgumentError(f"pattern must be a list of [stride, count] pairs, got {pattern!r}",
                                   fix="e.g. pattern=[[512, 128], [1, 512]]", location=loc) from None
        if not pairs or any(c <= 0 for _, c in pairs):
            raise NKIArgumentError(f"pattern {pattern!r} needs at least one pair with counts >= 1",
                                   fix="e.g. pattern=[[512, 128], [1, 512]]", location=loc)
        u = self.dtype if dtype is None else dt.as_dtype(dtype)
        ui = u.itemsize
        st = self.storage
        on_chip = st.buffer.on_chip
        rowb = self._storage_row_bytes() if on_chip else None
        if on_chip and rowb % ui:
            raise NKIArgumentError(f"cannot address {self._desc()} in {dt.name(u)} elements: "
                                   f"{rowb} bytes per partition", fix="pick a dtype that divides "
                                   "the partition size", location=loc)
        lbo = self._logical_byte_offset()
        if lbo % ui:
            raise NKIArgumentError(f"this view starts at byte {lbo}, not a multiple of the "
                                   f"{dt.name(u)} element size", fix="align the view",
                                   location=loc)
        base = lbo // ui + (0 if offset is None else int(offset))
        indirect = scalar_offset is not None or vector_offset is not None
        if indirect:
            stride_i = self._indirect_stride(indirect_dim, loc)
            tmpl = [(0, c) if (vector_offset is not None and i == 0) else (s, c)
                    for i, (s, c) in enumerate(pairs)]
        else:
            tmpl = pairs
        view = self._strided(tmpl, base, u, loc, pattern)
        t = self._view(view, u)
        if indirect:
            t.ind = self._indirect_spec(pairs, base, u, scalar_offset, vector_offset,
                                             stride_i, loc)
            # Run-time indices may reach anywhere: the dependency region is the whole allocation.
            rows = st.array.shape[0] if st.array.ndim else 1
            t._region = (st.dep_sid, 0, rows, 0, st.row_bytes if not on_chip else rowb, st.sid)
        return t

    def _indirect_stride(self, indirect_dim: int, loc) -> int:
        d = int(indirect_dim)
        if not 0 <= d < self.ndim:
            raise NKIArgumentError(f"indirect_dim={indirect_dim} is not a dimension of {self._desc()}",
                                   fix=f"use an indirect_dim in [0, {self.ndim})", location=loc)
        return self.strides[d]

    def _strided(self, pairs, base: int, u, loc, pattern) -> np.ndarray:
        """numpy view of ``pairs`` from element ``base`` (in ``u`` units) of the storage."""
        st = self.storage
        ui = u.itemsize
        root = st.root
        root_ptr = root.__array_interface__["data"][0]
        lo = base + sum(min(0, s * (c - 1)) for s, c in pairs)
        hi = base + sum(max(0, s * (c - 1)) for s, c in pairs)
        if st.buffer.on_chip:
            a = st.array
            w = self._storage_row_bytes() // ui
            nparts = a.shape[0] if a.ndim else 1
            part, within = divmod(base, w)
            (s0, c0), rest = pairs[0], pairs[1:]
            if c0 > 1 and s0 != w:
                raise NKIPartitionError(
                    f"access pattern {pattern!r} strides the partition dimension of {self._desc()} "
                    f"by {s0} elements; on-chip the first pair must step one partition ({w} "
                    f"elements)", fix=f"use [[{w}, P], ...] as the first pair", location=loc,
                    rule="partition-stride")
            rlo = within + sum(min(0, s * (c - 1)) for s, c in rest)
            rhi = within + sum(max(0, s * (c - 1)) for s, c in rest)
            if base < 0 or part + c0 > nparts or rlo < 0 or rhi >= w:
                raise NKIOutOfBoundsError(
                    f"access pattern {pattern!r} from element {base} reaches partitions "
                    f"{part}..{part + c0 - 1} and elements {rlo}..{rhi} of each partition of "
                    f"{describe(a.shape, st.dtype, st.buffer)} ({nparts} partitions of {w} "
                    f"{dt.name(u)} elements)", fix="reduce the counts or the offset", location=loc)
            start = (st.base_ptr - root_ptr) + part * st.row_bytes + within * ui
            strides = [st.row_bytes] + [s * ui for s, _ in rest]
        else:
            total = st.array.nbytes // ui
            if lo < 0 or hi >= total:
                raise NKIOutOfBoundsError(
                    f"access pattern {pattern!r} with offset {base} reaches elements [{lo}, {hi}] of "
                    f"{describe(st.array.shape, st.dtype, st.buffer)} which has {total} "
                    f"{dt.name(u)} elements", fix="reduce the counts or the offset", location=loc)
            start = (st.base_ptr - root_ptr) + base * ui
            strides = [s * ui for s, _ in pairs]
        return np.ndarray(tuple(c for _, c in pairs), dtype=dt.storage(u), buffer=root,
                          offset=start, strides=tuple(strides))

    def _indirect_spec(self, pairs, base, u, scalar_offset, vector_offset, stride_i, loc) -> tuple:
        from .isa import VirtualRegister
        st = self.storage
        if vector_offset is not None and scalar_offset is not None:
            raise NKIArgumentError("vector_offset and scalar_offset are mutually exclusive",
                                   fix="pass only one of them", location=loc)
        if vector_offset is not None:
            idx = vector_offset
            if not isinstance(idx, NkiTensor) or idx.buffer is not sbuf:
                raise NKIArgumentError("vector_offset must be an SBUF tile of indices (one per partition)",
                                       fix="DMA the indices into an SBUF tile [P, 1] first", location=loc)
            if not st.buffer.is_hbm:
                raise NKIArgumentError(f"vector_offset indexes HBM tensors; {self._desc()} is on chip",
                                       fix="call .ap(vector_offset=...) on the HBM tensor", location=loc)
            if idx.shape[0] != pairs[0][1] or idx.free_size() != 1:
                raise NKIShapeError(
                    f"vector_offset {idx._desc()} must hold one index per element of pattern "
                    f"dimension 0 ({pairs[0][1]})", fix=f"pass a [{pairs[0][1]}, 1] index tile",
                    location=loc)
            return (idx, stride_i, base, pairs, True, u)
        idx = scalar_offset
        if isinstance(idx, NkiTensor):
            if idx.buffer is not sbuf or idx.size != 1:
                raise NKIArgumentError("scalar_offset must be an int, a register or a [1, 1] SBUF tile",
                                       fix="load the offset into a [1, 1] SBUF tile", location=loc)
        elif not isinstance(idx, VirtualRegister):
            idx = int(idx)
        return (idx, stride_i, base, pairs, False, u)

    def indirect_offsets(self, index_values: np.ndarray) -> np.ndarray:
        """Element offsets (in the pattern's dtype units, storage row-major layout) of every
        pattern position, for run-time index values."""
        idx, stride_i, base, pairs, is_vector, _u = self.ind
        off = np.full((), base, dtype=np.int64)
        for i, (s, c) in enumerate(pairs):
            if i == 0 and is_vector:
                g = index_values.reshape(-1).astype(np.int64) * stride_i
            else:
                g = np.arange(c, dtype=np.int64) * s
            off = off[..., None] + g.reshape((1,) * off.ndim + (c,))
        if not is_vector:
            off = off + int(index_values.reshape(-1)[0]) * stride_i
        return off

    def indirect_locations(self, offs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(flat array of the storage's root in the pattern dtype, root indices, in-bounds mask)
        for the logical element offsets ``offs`` of an indirect view."""
        st = self.storage
        u = self.ind[5]
        ui = u.itemsize
        root = st.root
        flat = np.ndarray((root.nbytes // ui,), dtype=dt.storage(u), buffer=root)
        first = (st.base_ptr - root.__array_interface__["data"][0]) // ui
        if st.buffer.on_chip:
            w = self._storage_row_bytes() // ui
            nparts = st.array.shape[0]
            ok = (offs >= 0) & (offs < nparts * w)
            safe = np.where(ok, offs, 0)
            part, within = np.divmod(safe, w)
            idx = first + part * (st.row_bytes // ui) + within
        else:
            total = st.array.nbytes // ui
            ok = (offs >= 0) & (offs < total)
            idx = first + np.where(ok, offs, 0)
        return flat, idx, ok

    # -- arithmetic sugar (maps to nl.*) ----------------------------------------------------
    def _nl(self, name, *args):
        from . import language as nl
        return getattr(nl, name)(*args)

    def __add__(self, o): return self._nl("add", self, o)
    def __radd__(self, o): return self._nl("add", o, self)
    def __sub__(self, o): return self._nl("subtract", self, o)
    def __rsub__(self, o): return self._nl("subtract", o, self)
    def __mul__(self, o): return self._nl("multiply", self, o)
    def __rmul__(self, o): return self._nl("multiply", o, self)
    def __truediv__(self, o): return self._nl("divide", self, o)
    def __rtruediv__(self, o): return self._nl("divide", o, self)
    def __neg__(self): return self._nl("negative", self)
    def __pow__(self, o): return self._nl("power", self, o)
