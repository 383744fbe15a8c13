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
from .errors import (NKIArgumentError, NKIOutOfBoundsError, NKIPartitionError, NKIShapeError,
                     NKITracingError)
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
    """One allocation. Freed (for SBUF/PSUM accounting) when garbage-collected."""

    __slots__ = ("sid", "buffer", "array", "dtype", "name", "row_bytes", "base_ptr", "written",
                 "bank", "external", "dirty", "__weakref__")

    def __init__(self, sid: int, buffer: Buffer, array: np.ndarray, dtype, name: str):
        self.sid = sid
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


def allocate(shape: Any, dtype: Any, buffer: Buffer, name: str | None = None) -> "NkiTensor":
    """Allocate a fresh tensor filled with sentinels (NaN for floats, 4 for ints)."""
    ctx = current()
    loc = user_location()
    shape = _check_shape(shape, loc)
    if not isinstance(buffer, Buffer):
        raise NKIArgumentError(f"buffer must be one of nl.sbuf, nl.psum, nl.hbm, nl.shared_hbm, "
                               f"nl.private_hbm, got {buffer!r}", fix="pass buffer=nl.sbuf",
                               location=loc)
    try:
        dtype = dt.as_dtype(dtype)
    except TypeError as e:
        raise NKIArgumentError(str(e), fix="use an nl dtype such as nl.float32 or nl.bfloat16",
                               location=loc) from None
    desc = describe(shape, dtype, buffer)
    if buffer.on_chip:
        pmax = ctx.platform.sbuf_partitions
        if shape[0] > pmax:
            raise NKIPartitionError(
                f"partition dimension {shape[0]} exceeds maximum {pmax} for {desc}",
                fix=f"tile dimension 0 into chunks of at most {pmax} partitions", location=loc,
                rule="partition-size")
    if buffer is shared_hbm and ctx.launch.num_programs > 1:
        # Both programs of an LNC2 launch see the same shared_hbm tensor: the k-th shared_hbm
        # allocation of every program aliases the k-th of program 0.
        idx = ctx.shared_index
        ctx.shared_index += 1
        if idx < len(ctx.launch.shared):
            st = ctx.launch.shared[idx]
            if st.array.shape != shape or st.dtype != dtype:
                raise NKIShapeError(
                    f"shared_hbm allocation #{idx} is {desc} in program {ctx.program_id} but "
                    f"{describe(st.array.shape, st.dtype, shared_hbm)} in program 0",
                    fix="allocate the same shared_hbm outputs, in the same order, in every program",
                    location=loc)
            return NkiTensor(st, st.array, dtype)
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
    if buffer is sbuf:
        nbytes = math.prod(shape[1:]) * dtype.itemsize
        ctx.sbuf.allocate(sid, nbytes, desc, loc)
        ctx.track(st, sid, "sbuf")
    elif buffer is psum:
        nbytes = math.prod(shape[1:]) * dtype.itemsize
        st.bank = ctx.psum.allocate(sid, nbytes, desc, loc)
        st.written = np.zeros(shape, dtype=bool)
        ctx.track(st, sid, "psum")
    elif buffer is shared_hbm and ctx.launch.num_programs > 1:
        ctx.launch.shared.append(st)
    return NkiTensor(st, arr, dtype)


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
    """A tensor in HBM, SBUF or PSUM (a view of a :class:`Storage`)."""

    __slots__ = ("storage", "data", "dtype", "_region", "_offset", "indirect")
    __array_priority__ = 1000

    def __init__(self, storage: Storage, data: np.ndarray, dtype):
        self.storage = storage
        self.data = data
        self.dtype = dtype
        self._region = None  # a view never changes where it points: cache its geometry
        self._offset = None
        # Indirect (dynamic-offset) access pattern, resolved by dma_copy at run time:
        # (index tensor or int, indirect_dim, base element, [(stride, count), ...], is_vector)
        self.indirect = None

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

    def _desc(self) -> str:
        return describe(self.shape, self.dtype, self.buffer)

    def __repr__(self) -> str:
        return f"NkiTensor({self.name}: {self._desc()})"

    def byte_offset(self) -> int:
        if self._offset is None:
            self._offset = self.data.__array_interface__["data"][0] - self.storage.base_ptr
        return self._offset

    def partition_start(self) -> int:
        return self.byte_offset() // self.storage.row_bytes

    def free_size(self) -> int:
        """Elements per partition (on-chip) / per row."""
        return math.prod(self.shape[1:]) if self.ndim > 1 else 1

    def region(self) -> tuple:
        """Bounding box ``(sid, row0, row1, byte0, byte1)`` of the bytes this view touches."""
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
            return (st.sid, r0, (off + rows * rb + cols - 1) // rb + 1, 0, rb)
        return (st.sid, r0, r0 + rows + 1, c0, c0 + cols)

    # -- Python protocol guards -------------------------------------------------------------
    def __bool__(self):
        raise NKITracingError(
            f"the truth value of {self._desc()} is unknown while tracing: Python `if`/`while` on "
            "tensor values (data-dependent control flow) is not supported",
            fix="compute a mask and use nl.where / nisa.select_reduce, or nl.while_loop on a register",
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
    def _view(self, data: np.ndarray) -> "NkiTensor":
        return NkiTensor(self.storage, data, self.dtype)

    def __getitem__(self, key) -> "NkiTensor":
        loc = None
        if self.indirect is not None:
            raise NKIArgumentError(f"cannot slice an indirect access pattern ({self._desc()})",
                                   fix="express the whole access in the .ap() pattern",
                                   location=user_location())
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
                    fix="use nisa.dma_copy with .ap(vector_offset=...) or nl.where",
                    location=user_location(), rule="indexing")
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

    def ap(self, pattern: Sequence[Sequence[int]], offset: int = 0, *, scalar_offset=None,
           vector_offset=None, indirect_dim: int = 0, dtype=None) -> "NkiTensor":
        """Access-pattern view: ``pattern=[[stride, count], ...]`` in elements of the storage.

        The first pair addresses rows (partitions on chip); ``offset`` is in elements from the
        start of this view. Every address the pattern reaches must lie inside the storage.
        ``vector_offset`` (an SBUF [P, 1] index tile; HBM tensors only) or ``scalar_offset`` (an
        int or [1, 1] SBUF tile) make pattern dimension ``indirect_dim`` run-time indexed: such
        gather/scatter views are accepted by ``nisa.dma_copy`` only.
        """
        loc = user_location()
        if self.indirect is not None:
            raise NKIArgumentError(f"{self._desc()} already has an indirect access pattern",
                                   fix="call .ap() on the tensor itself", location=loc)
        try:
            pairs = [(int(s), int(c)) for s, c in pattern]
        except (TypeError, ValueError):
            raise NKIArgumentError(f"pattern must be a list of [stride, count] pairs, got {pattern!r}",
                                   fix="e.g. pattern=[[512, 128], [1, 512]]", location=loc) from None
        if not pairs or any(c <= 0 for _, c in pairs):
            raise NKIArgumentError(f"pattern {pattern!r} needs at least one pair with counts >= 1",
                                   fix="e.g. pattern=[[512, 128], [1, 512]]", location=loc)
        st = self.storage
        item = st.array.itemsize
        base = self.byte_offset() // item + int(offset)
        row_elems = st.row_bytes // item
        if st.buffer.on_chip and pairs[0][1] > 1 and pairs[0][0] != row_elems:
            raise NKIPartitionError(
                f"access pattern {pattern!r} strides the partition dimension of {self._desc()} by "
                f"{pairs[0][0]} elements; on-chip the first pair must step one partition "
                f"({row_elems} elements)", fix=f"use [[{row_elems}, P], ...] as the first pair",
                location=loc, rule="partition-stride")
        if scalar_offset is not None or vector_offset is not None:
            return self._indirect_ap(pairs, base, scalar_offset, vector_offset, int(indirect_dim), loc)
        lo = base + sum(min(0, s * (c - 1)) for s, c in pairs)
        hi = base + sum(max(0, s * (c - 1)) for s, c in pairs)
        if lo < 0 or hi >= st.array.size:
            raise NKIOutOfBoundsError(
                f"access pattern {pattern!r} with offset {offset} reaches elements [{lo}, {hi}] of "
                f"{describe(st.array.shape, st.dtype, st.buffer)} which has {st.array.size} elements",
                fix="reduce the counts or the offset", location=loc)
        flat = st.array.reshape(-1)
        view = np.lib.stride_tricks.as_strided(flat[base:], shape=tuple(c for _, c in pairs),
                                               strides=tuple(s * item for s, _ in pairs))
        return self._view(view)

    def _indirect_ap(self, pairs, base, scalar_offset, vector_offset, dim, loc) -> "NkiTensor":
        """A gather/scatter view: dimension ``dim`` of the pattern is indexed by run-time values."""
        st = self.storage
        if vector_offset is not None and scalar_offset is not None:
            raise NKIArgumentError("vector_offset and scalar_offset are mutually exclusive",
                                   fix="pass only one of them", location=loc)
        if not 0 <= dim < len(pairs):
            raise NKIArgumentError(f"indirect_dim={dim} is not a dimension of pattern {pairs}",
                                   fix=f"use an indirect_dim in [0, {len(pairs)})", location=loc)
        if vector_offset is not None:
            idx = vector_offset
            if not isinstance(idx, NkiTensor) or idx.buffer is not sbuf:
                raise NKIArgumentError("vector_offset must be an SBUF tile of indices (one per partition)",
                                       fix="DMA the indices into an SBUF tile [P, 1] first", location=loc)
            if not st.buffer.is_hbm:
                raise NKIArgumentError(f"vector_offset indexes HBM tensors; {self._desc()} is on chip",
                                       fix="call .ap(vector_offset=...) on the HBM tensor", location=loc)
            if dim != 0 or idx.shape[0] != pairs[0][1] or idx.free_size() != 1:
                raise NKIShapeError(
                    f"vector_offset {idx._desc()} must hold one index per partition of pattern dim 0 "
                    f"({pairs[0][1]}), with indirect_dim=0", fix=f"pass a [{pairs[0][1]}, 1] index tile",
                    location=loc)
            is_vector = True
        else:
            idx = scalar_offset
            if isinstance(idx, NkiTensor):
                if idx.buffer is not sbuf or idx.size != 1:
                    raise NKIArgumentError("scalar_offset must be an int or a [1, 1] SBUF tile",
                                           fix="load the offset into a [1, 1] SBUF tile", location=loc)
            else:
                idx = int(idx)
            is_vector = False
        # The template view (index 0 in the indirect dim) gives shape and element count.
        others = [(s if i != dim else 0, c) for i, (s, c) in enumerate(pairs)]
        lo = base + sum(min(0, s * (c - 1)) for s, c in others)
        hi = base + sum(max(0, s * (c - 1)) for s, c in others)
        if lo < 0 or hi >= st.array.size:
            raise NKIOutOfBoundsError(f"access pattern {pairs} reaches elements [{lo}, {hi}] outside "
                                      f"{self._desc()}", fix="reduce the counts or the offset",
                                      location=loc)
        item = st.array.itemsize
        view = np.lib.stride_tricks.as_strided(st.array.reshape(-1)[base:],
                                               shape=tuple(c for _, c in others),
                                               strides=tuple(s * item for s, _ in others))
        t = self._view(view)
        t.indirect = (idx, dim, base, pairs, is_vector)
        # Run-time indices may reach anywhere: the dependency region is the whole allocation.
        t._region = (st.sid, 0, st.array.shape[0] if st.array.ndim else 1, 0, st.row_bytes)
        return t

    def indirect_offsets(self, index_values: np.ndarray) -> np.ndarray:
        """Element offsets into the storage of every pattern position, for run-time indices."""
        idx, dim, base, pairs, is_vector = self.indirect
        off = np.full((), base, dtype=np.int64)
        for i, (s, c) in enumerate(pairs):
            if i == dim:
                if is_vector:
                    g = index_values.reshape(-1).astype(np.int64) * s
                else:
                    g = np.arange(c, dtype=np.int64) * s + int(index_values.reshape(-1)[0]) * s
            else:
                g = np.arange(c, dtype=np.int64) * s
            off = off[..., None] + g.reshape((1,) * off.ndim + (c,))
        return off

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
