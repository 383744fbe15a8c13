"""``nki.isa`` (``nisa``): one function per NeuronCore instruction; every call writes ``dst``.

Each call (1) checks its operands against the hardware rules (:mod:`.checks`), (2) appends an
instruction record with its engine, cycle cost and byte regions to the kernel's stream (the
input of :mod:`.perf_model`) and (3) unless the kernel runs timing-only, computes the result
on whole tiles with numpy, in float32 (the engines' internal precision), and rounds it into
``dst.dtype``.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import numpy as np

from . import dtypes as dt
from . import perf_model as pm
from .checks import Call
from .errors import (NKIArgumentError, NKIBufferError, NKIDtypeError, NKIOutOfBoundsError,
                     NKIPlatformError, NKIShapeError)
from .ops import OPS, Op, op_from_any
from .tensor import NkiTensor, describe
from .tracer import Instr, current, user_frame


class engine(Enum):
    """NeuronCore engines (``engine=`` argument)."""

    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


class reduce_cmd(Enum):
    """Accumulator-register commands of reducing instructions."""

    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(Enum):
    error = 0
    skip = 1


class matmul_perf_mode(Enum):
    none = "none"
    double_row = "double_row"


class nc_version(Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


_RC = reduce_cmd
_DGE = dge_mode
_OOB = oob_mode

_GEN = {"trn1": nc_version.gen2, "trn2": nc_version.gen3, "trn3": nc_version.gen4}


def get_nc_version() -> nc_version:
    """NeuronCore generation of the target platform."""
    return _GEN[current().platform.name]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _start(name: str) -> tuple:
    ctx = current()
    return ctx, Call(name, ctx, user_frame())


def _op(c: Call, op: Any, arg: str = "op", kinds: tuple | None = None) -> Op:
    o = op_from_any(op)
    if o is None:
        red = getattr(op, "_alu", None)
        o = OPS.get(red) if red else None
    if o is None:
        c.fail(NKIArgumentError, f"`{arg}`={op!r} is not an NKI operator",
               fix="pass an nl operator such as nl.add, nl.multiply, nl.maximum or nl.exp")
    if kinds and o.kind not in kinds:
        c.fail(NKIArgumentError, f"`{arg}`={o!r} is a {o.kind} operator but this argument needs a "
               f"{' or '.join(kinds)} operator", fix="pick an operator of the right kind")
    return o


def _engine(c: Call, eng: Any, default: str, allowed: tuple) -> str:
    if eng is None or eng is engine.unknown:
        return default
    name = eng.value if isinstance(eng, engine) else str(eng)
    if name not in allowed:
        c.fail(NKIArgumentError, f"cannot run on the {name} engine", fix=f"use engine= one of "
               f"{', '.join('nisa.engine.' + a for a in allowed)}")
    return name


def _emit(c: Call, eng: str, cycles: float, reads: list, writes: list, **kw) -> None:
    c.ctx.instructions.append(Instr(c.op, eng, cycles, [t.region() for t in reads],
                                    [t.region() for t in writes], loc=c.loc, **kw))


def _f32(t: NkiTensor) -> np.ndarray:
    """Values of ``t`` as float32, shaped (partitions, elements per partition)."""
    a = t.data
    if a.dtype != np.float32:
        a = a.astype(np.float32)
    return a.reshape(a.shape[0], -1) if a.ndim != 2 else a


def _out_f32(dst: NkiTensor) -> np.ndarray | None:
    """A writable float32 (P, F) view of ``dst`` to compute into directly, or None.

    Computing with ``out=`` straight into the destination avoids a temporary and a copy per
    instruction, which dominates simulation time for large tiles.
    """
    a = dst.data
    if a.dtype != np.float32 or dst.dtype is dt.tfloat32 or not a.flags.writeable:
        return None
    if a.ndim == 2:
        return a
    try:
        return np.reshape(a, (a.shape[0], -1), copy=False)
    except ValueError:
        return None


def _same_view(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.strides == b.strides and a.shape == b.shape)


def _mark(dst: NkiTensor) -> None:
    if dst.storage.written is not None:
        _flags(dst)[...] = True


def _write(dst: NkiTensor, values: np.ndarray) -> None:
    v = dt.cast(values, dst.dtype)
    if v.shape != dst.shape:
        v = v.reshape(dst.shape)
    dst.data[...] = v
    if dst.storage.written is not None:
        _flags(dst)[...] = True


def _flags(t: NkiTensor) -> np.ndarray:
    """The PSUM "written" flags matching the view ``t``."""
    st = t.storage
    item = st.array.itemsize
    base = t.byte_offset() // item
    return np.lib.stride_tricks.as_strided(st.written.reshape(-1)[base:], shape=t.shape,
                                           strides=tuple(s // item for s in t.data.strides))


def _scalar_arg(x: Any) -> Any:
    """A per-partition operand as something numpy broadcasts against (P, F)."""
    if isinstance(x, NkiTensor):
        return _f32(x).reshape(-1, 1)
    return np.float32(x)


def _any_psum(*ts) -> bool:
    return any(isinstance(t, NkiTensor) and t.storage.buffer.name == "psum" for t in ts)


def _all16(*ts) -> bool:
    return all(dt.is_16bit_float(t.dtype) for t in ts if isinstance(t, NkiTensor))


def _apply(o: Op, a, b, reverse: bool = False):
    if reverse:
        a, b = b, a
    if o.kind == "bitwise":
        return o.fn(np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
    if o.kind == "unary":
        return o.fn(a)
    return o.fn(a, b)


def _vec_cycles(c: Call, n: int, kind: str, *ts) -> float:
    return max(64, n) / pm.vector_speedup(c.ctx.platform, _all16(*ts), _any_psum(*ts), kind)


def _accumulate(c: Call, eng: str, cmd: Any, partial: np.ndarray, red: Op, res: NkiTensor | None):
    """Engine accumulator-register semantics of ``reduce_cmd``; writes ``reduce_res``."""
    acc = c.ctx.accumulators.get(eng)
    cmd = cmd or _RC.idle
    if cmd in (_RC.idle, _RC.reset_reduce, _RC.reset) or acc is None \
            or acc.shape != partial.shape:
        acc = partial
    elif cmd is _RC.load_reduce:
        acc = red.fn(_f32(res).reshape(partial.shape), partial) if res is not None else partial
    else:  # reduce: keep accumulating into the registers
        acc = red.fn(acc, partial)
    c.ctx.accumulators[eng] = acc
    if res is not None:
        _write(res, acc)


# --------------------------------------------------------------------------------------------
# DMA
# --------------------------------------------------------------------------------------------
def _run_bytes(a: np.ndarray) -> int:
    """Length in bytes of the contiguous innermost run of a strided view."""
    run = a.itemsize
    for n, s in zip(reversed(a.shape), reversed(a.strides)):
        if n == 1:
            continue
        if s == run:
            run *= n
        else:
            break
    return run


def dma_copy(dst: NkiTensor, src: NkiTensor, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None) -> None:
    """Copy ``src`` to ``dst`` with a DMA queue (HBM<->SBUF, SBUF<->SBUF, HBM<->HBM).

    Element counts must match; differing dtypes convert through float32. DMAs may not read or
    write PSUM.
    """
    ctx, c = _start("dma_copy")
    dst = c.tensor(dst, "dst")
    src = c.tensor(src, "src")
    if src.storage.buffer.name == "psum":
        c.fail(NKIBufferError, f"`src` {src._desc()} is in PSUM; DMAs may not read PSUM",
               fix="copy the PSUM tile to SBUF with nisa.tensor_copy first, then DMA from SBUF",
               rule="buffer-kind")
    if dst.storage.buffer.name == "psum":
        c.fail(NKIBufferError, f"`dst` {dst._desc()} is in PSUM; DMAs write HBM or SBUF only",
               fix="DMA into an SBUF tile, then nisa.tensor_copy into PSUM if needed",
               rule="buffer-kind")
    if dst.size != src.size:
        c.fail(NKIShapeError, f"`dst` {dst._desc()} has {dst.size} elements but `src` "
               f"{src._desc()} has {src.size}", fix="slice src and dst to the same number of elements")
    if dst.storage.buffer.on_chip and dst.shape[0] > ctx.platform.sbuf_partitions:
        c.partitions(dst, "dst")
    if dge_mode is _DGE.hwdge and src.dtype != dst.dtype:
        c.fail(NKIDtypeError, f"hardware-DGE DMAs cannot convert dtypes ({dt.name(src.dtype)} -> "
               f"{dt.name(dst.dtype)})", fix="use matching dtypes, or dge_mode=nisa.dge_mode.swdge / "
               "the default to let the DMA cast through fp32", rule="dtype")
    nbytes = dst.size * dst.itemsize
    run = min(_run_bytes(dst.data), _run_bytes(src.data))
    hbm_bytes = (src.size * src.itemsize if src.storage.buffer.is_hbm else 0) + \
        (nbytes if dst.storage.buffer.is_hbm else 0)
    idx_reads = [t.indirect[0] for t in (src, dst)
                 if t.indirect is not None and isinstance(t.indirect[0], NkiTensor)]
    _emit(c, "dma", 0.0, [src] + idx_reads, [dst], nbytes=int(pm.dma_cost_bytes(nbytes, run)),
          hbm_bytes=hbm_bytes)
    if dst.storage.external:
        dst.storage.dirty = True  # a kernel input written in place: the caller copies it back
    if ctx.numerics and (src.indirect is not None or dst.indirect is not None):
        _indirect_copy(c, dst, src, oob_mode)
    elif ctx.numerics:
        v = src.data
        if src.dtype != dst.dtype and not (dt.is_int(src.dtype) and dt.is_int(dst.dtype)):
            v = v.astype(np.float32)  # DMA casts go through fp32
        _write(dst, v.reshape(dst.shape) if v.shape != dst.shape else v)


def _index_values(t: NkiTensor) -> np.ndarray:
    idx = t.indirect[0]
    return idx.data.astype(np.int64) if isinstance(idx, NkiTensor) else np.array([idx], np.int64)


def _resolve(c: Call, t: NkiTensor, arg: str, mode) -> tuple[np.ndarray, np.ndarray]:
    """(element offsets, in-bounds mask) of an indirect view for the current index values."""
    idx = _index_values(t)
    offs = t.indirect_offsets(idx)
    ok = (offs >= 0) & (offs < t.storage.array.size)
    if not ok.all() and mode is not _OOB.skip:
        flat_idx = idx.reshape(-1)
        if t.indirect[4]:  # vector offsets: one index per row of pattern dim 0
            flat_idx = flat_idx[~ok.reshape(ok.shape[0], -1).all(axis=1)]
        bad = sorted(set(flat_idx.tolist()))[:8]
        c.fail(NKIOutOfBoundsError, f"indirect `{arg}` index value(s) {bad} address outside "
               f"{describe(t.storage.array.shape, t.storage.dtype, t.storage.buffer)}",
               fix="clamp the indices, or pass oob_mode=nisa.oob_mode.skip to skip those rows",
               rule="out-of-bounds")
    return offs, ok


def _indirect_copy(c: Call, dst: NkiTensor, src: NkiTensor, mode) -> None:
    """Gather (indirect src) and/or scatter (indirect dst); out-of-bounds rows are skipped
    when ``oob_mode=skip``."""
    if src.indirect is not None:
        offs, ok = _resolve(c, src, "src", mode)
        vals = src.storage.array.reshape(-1)[np.where(ok, offs, 0)]
    else:
        vals, ok = src.data, np.ones(src.shape, bool)
    if src.dtype != dst.dtype and not (dt.is_int(src.dtype) and dt.is_int(dst.dtype)):
        vals = vals.astype(np.float32)
    vals = dt.cast(vals, dst.dtype)
    if dst.indirect is not None:
        doffs, dok = _resolve(c, dst, "dst", mode)
        mask = dok & ok.reshape(doffs.shape)
        dst.storage.array.reshape(-1)[doffs[mask]] = vals.reshape(doffs.shape)[mask]
    else:
        ok = ok.reshape(dst.shape)
        cur = dst.data
        _write(dst, np.where(ok, vals.reshape(dst.shape), cur) if not ok.all() else vals.reshape(dst.shape))


# --------------------------------------------------------------------------------------------
# TensorE
# --------------------------------------------------------------------------------------------
_MATMUL_IN = (dt.bfloat16, dt.float16, dt.tfloat32, dt.float32, dt.float8_e4m3, dt.float8_e5m2,
              dt.float8_e4m3fn, dt.int8, dt.uint8)


def nc_matmul(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, accumulate=None, tile_position=(), tile_size=(),
              perf_mode=matmul_perf_mode.none, name=None) -> None:
    """``dst[M, N] (+)= stationary[K, M].T @ moving[K, N]`` on TensorE, fp32 accumulation in PSUM.

    ``accumulate``: True adds to ``dst``, False overwrites, None (default) overwrites locations
    never written before and accumulates into the others. ``is_transpose=True`` makes the
    instruction a bit-exact transpose (``moving`` must be the identity): ``dst = stationary.T``.
    """
    ctx, c = _start("nc_matmul")
    plat = ctx.platform
    dst = c.tensor(dst, "dst")
    s = c.compute_operand(stationary, "stationary", psum=False, engine="TensorE")
    m = c.compute_operand(moving, "moving", psum=False, engine="TensorE")
    c.on_chip(dst, "dst", sbuf=False, engine="TensorE")
    c.partitions(dst, "dst")
    if s.ndim != 2 or m.ndim != 2 or dst.ndim != 2:
        c.fail(NKIShapeError, f"operands must be 2-D, got stationary {s._desc()}, moving "
               f"{m._desc()}, dst {dst._desc()}", fix="reshape the tiles to [K, M], [K, N], [M, N]")
    k, mm = s.shape
    k2, n = m.shape
    if k != k2:
        c.fail(NKIShapeError, f"contraction (partition) sizes differ: stationary {s._desc()} vs "
               f"moving {m._desc()}", fix="both operands need K on the partition dimension")
    pmax = plat.pe_rows
    if mm > plat.pe_cols:
        c.fail(NKIShapeError, f"stationary {s._desc()} has free size {mm} > {plat.pe_cols} "
               "(stationary tile limit [K<=128, M<=128])", fix="tile M into chunks of 128",
               rule="matmul-tile")
    nmax = plat.matmul_max_moving_free
    if n > nmax:
        c.fail(NKIShapeError, f"moving {m._desc()} has free size {n} > {nmax} (moving tile limit "
               f"[K<={pmax}, N<={nmax}], one PSUM bank)", fix=f"tile N into chunks of {nmax}",
               rule="matmul-tile")
    if dst.shape != (mm, n):
        c.fail(NKIShapeError, f"dst {dst._desc()} must have shape ({mm}, {n}) = (stationary free, "
               "moving free)", fix=f"allocate dst as nl.ndarray(({mm}, {n}), nl.float32, buffer=nl.psum)")
    c.dtype_in(s, "stationary", _MATMUL_IN, "TensorE multiplies bf16/fp16/tf32/fp32/fp8/int8")
    c.dtype_in(m, "moving", _MATMUL_IN, "TensorE multiplies bf16/fp16/tf32/fp32/fp8/int8")
    fp32 = s.dtype == dt.float32 or m.dtype == dt.float32
    if fp32 and not (s.dtype == dt.float32 and m.dtype == dt.float32):
        c.fail(NKIDtypeError, f"stationary is {dt.name(s.dtype)} but moving is {dt.name(m.dtype)}; "
               "an fp32 matmul needs both operands in fp32",
               fix="cast both operands to the same dtype (bf16 for full TensorE speed)")
    if is_transpose:
        if dst.dtype not in (dt.float32, s.dtype):
            c.fail(NKIDtypeError, f"transpose mode writes {dt.name(s.dtype)} or float32, dst is "
                   f"{dt.name(dst.dtype)}", fix="make dst the input dtype or float32")
        if k != n:
            c.fail(NKIShapeError, f"transpose mode needs an identity `moving` [{k}, {k}], got "
                   f"{m._desc()}", fix="pass an identity matrix of size K as moving")
    else:
        ok = (dt.float32,) + ((dt.bfloat16,) if plat.name == "trn3" else ())
        c.dtype_in(dst, "dst", ok, "matmul results are written to PSUM in float32"
                   + (" or bfloat16" if plat.name == "trn3" else ""))
    if perf_mode not in (None, matmul_perf_mode.none):
        c.fail(NKIArgumentError, f"perf_mode={perf_mode} is not modelled by this simulator",
               fix="omit perf_mode")
    cycles = pm.matmul_cycles(mm, n, fp32, is_transpose)
    _emit(c, "tensor", cycles, [s, m], [dst], flops=0.0 if is_transpose else 2.0 * k * mm * n,
          dtype=dt.name(s.dtype))
    if not ctx.numerics:
        return
    if is_transpose:
        mv = m.data.astype(np.float32)
        if not np.array_equal(mv, np.eye(k, dtype=np.float32)):
            c.fail(NKIArgumentError, "transpose mode needs `moving` to be the identity matrix",
                   fix="pass an identity (e.g. nl.shared_identity_matrix) or use is_transpose=False")
        _write(dst, s.data.T)
        return
    res = np.matmul(_f32(s).T, _f32(m))
    out = _out_f32(dst)
    if out is not None and out.shape == res.shape:
        # fp32 PSUM (the usual case): accumulate in place, no temporaries or casts
        if accumulate is None:
            flags = _flags(dst)
            if flags.all():
                np.add(out, res, out=out)
            elif flags.any():
                out[...] = np.where(flags, out + res, res)
            else:
                out[...] = res
        elif accumulate:
            np.add(out, res, out=out)
        else:
            out[...] = res
        _mark(dst)
        return
    if accumulate is None:
        flags = _flags(dst)
        if flags.any():
            res = np.where(flags, dst.data.astype(np.float32) + res, res)
    elif accumulate:
        res = dst.data.astype(np.float32) + res
    _write(dst, res)


def nc_transpose(dst: NkiTensor, data: NkiTensor, engine=engine.unknown, name=None) -> None:
    """Transpose partition and free axes: ``dst = data.T``.

    TensorE (dst in PSUM; data up to [128, 128]) or VectorE (dst in SBUF; up to [32, 32]).
    """
    ctx, c = _start("nc_transpose")
    dst = c.tensor(dst, "dst")
    x = c.compute_operand(data, "data", psum=False)
    default = "tensor" if dst.storage.buffer.name == "psum" else "vector"
    eng = _engine(c, engine, default, ("tensor", "vector"))
    c.on_chip(dst, "dst", sbuf=(eng == "vector"), psum=(eng == "tensor"))
    c.partitions(dst, "dst")
    if x.ndim != 2:
        c.fail(NKIShapeError, f"data must be 2-D, got {x._desc()}", fix="reshape to [P, F]")
    p, f = x.shape
    lim = 128 if eng == "tensor" else 32
    if p > lim or f > lim:
        c.fail(NKIShapeError, f"{eng} engine transposes at most [{lim}, {lim}], got {x._desc()}",
               fix="tile the transpose" + (" or use the tensor engine (dst in PSUM)"
                                           if eng == "vector" else ""), rule="transpose-tile")
    if dst.shape != (f, p):
        c.fail(NKIShapeError, f"dst {dst._desc()} must have shape ({f}, {p})",
               fix=f"allocate dst with shape ({f}, {p})")
    cyc = pm.transpose_cycles(p, f) if eng == "tensor" else _vec_cycles(c, f, "copy", x, dst)
    _emit(c, eng, cyc, [x], [dst])
    if ctx.numerics:
        _write(dst, x.data.T)


# --------------------------------------------------------------------------------------------
# ScalarE / VectorE / GpSimd
# --------------------------------------------------------------------------------------------
def activation(dst: NkiTensor, op, data: NkiTensor, bias=None, scale=1.0, reduce_op=None, reduce_res=None,
               reduce_cmd=reduce_cmd.idle, name=None) -> None:
    """ScalarE: ``dst = op(data * scale + bias)``; optionally ``reduce_res = add-reduce(dst)``.

    ``bias`` is a [P, 1] tile (or scalar), ``scale`` a scalar or [P, 1] tile. The reduction runs
    along the free dimension in float32 into ``reduce_res`` [P, 1].
    """
    ctx, c = _start("activation")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    o = _op(c, op, "op", ("unary",))
    c.same_elements(dst, "dst", x, "data")
    b = c.per_partition_scalar(bias, "bias", x) if bias is not None else None
    sc = c.per_partition_scalar(scale, "scale", x)
    red = None
    if reduce_res is not None:
        reduce_res = c.compute_operand(reduce_res, "reduce_res")
        if reduce_res.shape[0] != x.shape[0] or reduce_res.free_size() != 1:
            c.fail(NKIShapeError, f"reduce_res {reduce_res._desc()} must be [{x.shape[0]}, 1]",
                   fix=f"allocate reduce_res with shape ({x.shape[0]}, 1)")
        red = _op(c, reduce_op if reduce_op is not None else OPS["add"], "reduce_op", ("binary",))
        if red.reducer is None:
            c.fail(NKIArgumentError, f"reduce_op={red!r} cannot reduce", fix="use nl.add")
    n = x.free_size()
    limit = 4096 if _any_psum(x) else 65536
    if n > limit:
        c.fail(NKIShapeError, f"data {x._desc()} has {n} elements per partition; ScalarE reads at "
               f"most {limit} per instruction from {'PSUM' if limit == 4096 else 'SBUF'}",
               fix="split the free dimension across several activation calls",
               rule="scalar-free-size")
    cyc = max(64, n) / pm.scalar_speedup(ctx.platform, _all16(x, dst)) + (64 if red else 0)
    reads = [x] + [t for t in (b, sc) if isinstance(t, NkiTensor)]
    _emit(c, "scalar", cyc, reads, [dst] + ([reduce_res] if reduce_res is not None else []))
    if not ctx.numerics:
        return
    v = _f32(x)
    out = _out_f32(dst)
    if out is not None and np.may_share_memory(out, v) and not _same_view(out, v):
        out = None  # partially overlapping views: compute into a temporary
    tmp = out if out is not None else np.empty(v.shape, np.float32)
    if not (isinstance(sc, float) and sc == 1.0):
        v = np.multiply(v, _scalar_arg(sc), out=tmp)
    if b is not None:
        v = np.add(v, _scalar_arg(b), out=tmp)
    if isinstance(o.fn, np.ufunc):
        y = o.fn(v, out=tmp)
    else:
        y = o.fn(v)
    if out is not None and y is out:
        _mark(dst)
    else:
        _write(dst, y)
    if red is not None:
        _accumulate(c, "scalar", reduce_cmd, red.reducer(np.asarray(y, np.float32), axis=1,
                                                         keepdims=True), red, reduce_res)


def tensor_tensor(dst: NkiTensor, data1: NkiTensor, data2: NkiTensor, op, engine=engine.unknown, name=None) -> None:
    """``dst = op(data1, data2)`` elementwise (Vector or GpSimd engine); inputs may not both be in PSUM."""
    ctx, c = _start("tensor_tensor")
    eng = _engine(c, engine, "vector", ("vector", "gpsimd"))
    gp = eng != "gpsimd"
    dst = c.compute_operand(dst, "dst", psum=gp, engine=f"the {eng} engine")
    a = c.compute_operand(data1, "data1", psum=gp, engine=f"the {eng} engine")
    b = c.compute_operand(data2, "data2", psum=gp, engine=f"the {eng} engine")
    o = _op(c, op, "op", ("binary", "compare", "logical", "bitwise"))
    c.same_elements(a, "data1", b, "data2")
    c.same_elements(dst, "dst", a, "data1")
    if _any_psum(a) and _any_psum(b):
        c.fail(NKIBufferError, "data1 and data2 are both in PSUM; at most one input may be in PSUM",
               fix="copy one of them to SBUF first", rule="buffer-kind")
    n = a.free_size()
    if _any_psum(a, b):
        cyc = max(64, n)
    else:
        cyc = 2 * n / pm.vector_speedup(ctx.platform, _all16(a, b), False, "tensor_tensor")
    _emit(c, eng, max(64.0, cyc), [a, b], [dst])
    if ctx.numerics:
        if o.kind == "bitwise":
            r = _apply(o, a.data.reshape(a.shape[0], -1), b.data.reshape(b.shape[0], -1))
        else:
            out = _out_f32(dst)
            if out is not None and isinstance(o.fn, np.ufunc):
                o.fn(_f32(a), _f32(b), out=out)
                _mark(dst)
                return
            r = o.fn(_f32(a), _f32(b))
        _write(dst, r)


def tensor_scalar(dst: NkiTensor, data: NkiTensor, op0, operand0, reverse0=False, op1=None, operand1=None,
                  reverse1=False, engine=engine.unknown, name=None) -> None:
    """``dst = (data op0 operand0) op1 operand1``; operands are scalars or [P, 1] tiles.

    ``reverse0``/``reverse1`` swap the operands of the op (``operand op data``).
    """
    ctx, c = _start("tensor_scalar")
    eng = _engine(c, engine, "vector", ("vector", "gpsimd", "scalar"))
    gp = eng != "gpsimd"
    dst = c.compute_operand(dst, "dst", psum=gp, engine=f"the {eng} engine")
    x = c.compute_operand(data, "data", psum=gp, engine=f"the {eng} engine")
    c.same_elements(dst, "dst", x, "data")
    o0 = _op(c, op0, "op0", ("binary", "compare", "logical", "bitwise"))
    s0 = c.per_partition_scalar(operand0, "operand0", x)
    o1 = s1 = None
    if op1 is not None:
        o1 = _op(c, op1, "op1", ("binary", "compare", "logical", "bitwise"))
        if operand1 is None:
            c.fail(NKIArgumentError, "op1 given without operand1", fix="pass operand1")
        s1 = c.per_partition_scalar(operand1, "operand1", x)
    n = x.free_size()
    cyc = _vec_cycles(c, n, "tensor_scalar", x, dst) if eng != "scalar" else max(64, n)
    _emit(c, eng, cyc, [x] + [t for t in (s0, s1) if isinstance(t, NkiTensor)], [dst])
    if ctx.numerics:
        out = _out_f32(dst)
        if o0.kind == "bitwise":
            v = _apply(o0, x.data.reshape(x.shape[0], -1), _scalar_arg(s0), reverse0)
        elif out is not None and isinstance(o0.fn, np.ufunc) and o1 is None:
            a0, b0 = (_scalar_arg(s0), _f32(x)) if reverse0 else (_f32(x), _scalar_arg(s0))
            o0.fn(a0, b0, out=out)
            _mark(dst)
            return
        else:
            v = _apply(o0, _f32(x), _scalar_arg(s0), reverse0)
        if o1 is not None:
            v = _apply(o1, v, _scalar_arg(s1), reverse1)
        _write(dst, v)


def scalar_tensor_tensor(dst: NkiTensor, data: NkiTensor, op0, operand0, op1, operand1, reverse0=False, reverse1=False,
                         name=None) -> None:
    """VectorE: ``dst = (data op0 operand0) op1 operand1`` with ``operand0`` a scalar/[P, 1]
    tile and ``operand1`` a tile shaped like ``data``."""
    ctx, c = _start("scalar_tensor_tensor")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    t1 = c.compute_operand(operand1, "operand1")
    c.same_elements(dst, "dst", x, "data")
    c.same_elements(t1, "operand1", x, "data")
    o0 = _op(c, op0, "op0", ("binary", "compare", "logical"))
    o1 = _op(c, op1, "op1", ("binary", "compare", "logical"))
    s0 = c.per_partition_scalar(operand0, "operand0", x)
    n = x.free_size()
    _emit(c, "vector", 2 * max(64, n), [x, t1] + ([s0] if isinstance(s0, NkiTensor) else []), [dst])
    if ctx.numerics:
        v = _apply(o0, _f32(x), _scalar_arg(s0), reverse0)
        _write(dst, _apply(o1, v, _f32(t1), reverse1))


def _norm_axes(c: Call, axis, ndim: int) -> tuple:
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = []
    for a in axes:
        a = int(a)
        a = a + ndim if a < 0 else a
        if a == 0:
            c.fail(NKIArgumentError, "cannot reduce along axis 0, the partition dimension",
                   fix="reduce free axes here; reduce across partitions with nc_matmul against a "
                       "ones vector or nc_transpose first")
        if not 0 < a < ndim:
            c.fail(NKIArgumentError, f"axis {a} is out of range for a {ndim}-D tile",
                   fix=f"use an axis in [1, {ndim})")
        out.append(a)
    return tuple(sorted(set(out)))


def tensor_reduce(dst: NkiTensor, op, data: NkiTensor, axis, negate=False, keepdims=False, name=None) -> None:
    """VectorE: reduce ``data`` along free ``axis`` (int or tuple) with ``op`` (add, maximum,
    minimum, multiply...); ``negate`` negates the result."""
    ctx, c = _start("tensor_reduce")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    o = _op(c, op, "op", ("binary", "logical", "bitwise"))
    if o.reducer is None:
        c.fail(NKIArgumentError, f"op={o!r} is not a reduction", fix="use nl.add, nl.maximum, "
               "nl.minimum or nl.multiply")
    axes = _norm_axes(c, axis, x.ndim)
    out_shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape)) if keepdims else \
        tuple(s for i, s in enumerate(x.shape) if i not in axes)
    if dst.shape[0] != x.shape[0] or dst.free_size() != (math.prod(out_shape[1:]) if len(out_shape) > 1 else 1):
        c.fail(NKIShapeError, f"dst {dst._desc()} does not match the reduced shape {out_shape}",
               fix=f"allocate dst with shape {out_shape if len(out_shape) > 1 else out_shape + (1,)}")
    n = x.free_size()
    fast = _all16(x) and o.name in ("add", "maximum")
    _emit(c, "vector", max(64.0, n / 2 if fast else n), [x], [dst])
    if ctx.numerics:
        if o.kind == "bitwise":
            v = x.data.astype(np.int64)
        else:
            v = x.data if x.data.dtype == np.float32 else x.data.astype(np.float32)
        r = _reduce_many(o, v, axes)
        if negate:
            r = -r
        _write(dst, r)


def _reduce_many(o: Op, v: np.ndarray, axes: tuple) -> np.ndarray:
    for a in sorted(axes, reverse=True):
        v = o.reducer(v, axis=a)
    return v


def tensor_copy(dst: NkiTensor, src: NkiTensor, engine=engine.unknown, name=None) -> None:
    """Copy ``src`` to ``dst`` on chip (Vector, Scalar or GpSimd engine), converting the dtype."""
    ctx, c = _start("tensor_copy")
    eng = _engine(c, engine, "vector", ("vector", "scalar", "gpsimd"))
    gp = eng != "gpsimd"
    dst = c.compute_operand(dst, "dst", psum=gp, engine=f"the {eng} engine")
    s = c.compute_operand(src, "src", psum=gp, engine=f"the {eng} engine")
    c.same_elements(dst, "dst", s, "src")
    n = s.free_size()
    if eng == "scalar":
        cyc = max(64, n) / pm.scalar_speedup(ctx.platform, _all16(s, dst))
    else:
        cyc = _vec_cycles(c, n, "copy", s, dst)
    _emit(c, eng, cyc, [s], [dst])
    if ctx.numerics:
        v = s.data
        if s.dtype != dst.dtype:
            v = v.astype(np.float32)
        _write(dst, v.reshape(dst.shape))


def memset(dst: NkiTensor, value, engine=engine.unknown, name=None) -> None:
    """Fill ``dst`` with the constant ``value`` (Vector or GpSimd engine)."""
    ctx, c = _start("memset")
    eng = _engine(c, engine, "vector", ("vector", "gpsimd"))
    dst = c.compute_operand(dst, "dst", psum=(eng != "gpsimd"), engine=f"the {eng} engine")
    if isinstance(value, NkiTensor) or not np.isscalar(value):
        c.fail(NKIArgumentError, f"value must be a compile-time constant number, got {type(value).__name__}",
               fix="pass a Python number; copy tiles with nisa.tensor_copy")
    _emit(c, eng, _vec_cycles(c, dst.free_size(), "copy", dst), [], [dst])
    if ctx.numerics:
        _write(dst, np.full(dst.shape, value, dtype=np.float64 if dt.is_float(dst.dtype) else np.int64))


def reciprocal(dst: NkiTensor, data: NkiTensor, name=None) -> None:
    """VectorE: ``dst = 1 / data``."""
    ctx, c = _start("reciprocal")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    c.same_elements(dst, "dst", x, "data")
    _emit(c, "vector", max(64, 8 * x.free_size()), [x], [dst])
    if ctx.numerics:
        with np.errstate(divide="ignore"):
            _write(dst, np.float32(1) / _f32(x))


def exponential(dst: NkiTensor, src: NkiTensor, max_value=0.0, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                reduce_init=0.0, name=None) -> None:
    """VectorE (NeuronCore-v4 only): ``dst = exp(src - max_value)``, optional add-reduce."""
    ctx, c = _start("exponential")
    if ctx.platform.name != "trn3":
        c.fail(NKIPlatformError, f"needs NeuronCore-v4 (trn3); the target is {ctx.platform.name}",
               fix="use nisa.activation(op=nl.exp, bias=<-max tile>) on trn1/trn2", rule="platform")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(src, "src")
    c.same_elements(dst, "dst", x, "src")
    mv = c.per_partition_scalar(max_value, "max_value", x)
    if reduce_res is not None:
        reduce_res = c.compute_operand(reduce_res, "reduce_res")
    n = x.free_size()
    _emit(c, "vector", max(16.0, n / 4), [x] + ([mv] if isinstance(mv, NkiTensor) else []),
          [dst] + ([reduce_res] if reduce_res is not None else []))
    if ctx.numerics:
        y = np.exp(_f32(x) - _scalar_arg(mv))
        _write(dst, y)
        if reduce_res is not None:
            part = y.sum(axis=1, keepdims=True, dtype=np.float32)
            if reduce_cmd in (_RC.idle, _RC.reset_reduce):
                part = part + np.float32(reduce_init)
            _accumulate(c, "vector", reduce_cmd, part, OPS["add"], reduce_res)


def tensor_tensor_scan(dst: NkiTensor, data0: NkiTensor, data1: NkiTensor, initial, op0, op1, reverse0=False, reverse1=False,
                       name=None) -> None:
    """VectorE scan along the free dim: ``r[i] = (data0[i] op0 r[i-1]) op1 data1[i]``,
    ``r[-1] = initial`` (scalar or [P, 1] tile)."""
    ctx, c = _start("tensor_tensor_scan")
    dst = c.compute_operand(dst, "dst")
    a = c.compute_operand(data0, "data0")
    b = c.compute_operand(data1, "data1")
    c.same_elements(a, "data0", b, "data1")
    c.same_elements(dst, "dst", a, "data0")
    if _any_psum(a) and _any_psum(b):
        c.fail(NKIBufferError, "data0 and data1 cannot both be in PSUM", fix="copy one to SBUF",
               rule="buffer-kind")
    o0 = _op(c, op0, "op0", ("binary",))
    o1 = _op(c, op1, "op1", ("binary",))
    init = c.per_partition_scalar(initial, "initial", a)
    n = a.free_size()
    _emit(c, "vector", 2 * max(64, n), [a, b] + ([init] if isinstance(init, NkiTensor) else []), [dst])
    if ctx.numerics:
        x0, x1 = _f32(a), _f32(b)
        out = np.empty_like(x0)
        prev = np.broadcast_to(_scalar_arg(init), (x0.shape[0], 1))[:, 0].astype(np.float32)
        # A scan is inherently sequential along the free axis; it is vectorised across partitions.
        for i in range(x0.shape[1]):
            prev = _apply(o1, _apply(o0, x0[:, i], prev, reverse0), x1[:, i], reverse1)
            out[:, i] = prev
        _write(dst, out)


def _pattern(c: Call, pattern) -> list:
    try:
        pairs = [(int(s), int(n)) for s, n in pattern]
    except (TypeError, ValueError):
        c.fail(NKIArgumentError, f"pattern must be a list of [step, count] pairs, got {pattern!r}",
               fix="e.g. pattern=[[1, 512]]")
    if not 1 <= len(pairs) <= 4:
        c.fail(NKIArgumentError, f"pattern has {len(pairs)} dimensions; 1 to 4 are supported",
               fix="use at most 4 [step, count] pairs")
    return pairs


def _affine(pairs: list, p: int, offset: int, channel_multiplier: int) -> np.ndarray:
    """offset + channel*channel_multiplier + sum(index_i * step_i), shaped (P, prod(counts))."""
    v = np.zeros((1,), dtype=np.int64)
    for step, n in pairs:
        v = (v[:, None] + np.arange(n, dtype=np.int64)[None, :] * step).reshape(-1)
    ch = np.arange(p, dtype=np.int64)[:, None] * channel_multiplier
    return ch + v[None, :] + offset


def iota(dst: NkiTensor, pattern, offset=0, channel_multiplier=0, name=None) -> None:
    """GpSimd: ``dst[p, i...] = offset + p * channel_multiplier + sum(i_k * step_k)``."""
    ctx, c = _start("iota")
    dst = c.compute_operand(dst, "dst", psum=False, engine="the GpSimd engine")
    pairs = _pattern(c, pattern)
    cnt = math.prod(n for _, n in pairs)
    if cnt != dst.free_size():
        c.fail(NKIShapeError, f"pattern {pattern} generates {cnt} elements per partition but dst "
               f"{dst._desc()} holds {dst.free_size()}", fix="make the pattern counts match dst")
    _emit(c, "gpsimd", 150 + cnt, [], [dst])
    if ctx.numerics:
        _write(dst, _affine(pairs, dst.shape[0], int(offset), int(channel_multiplier)))


def affine_select(dst: NkiTensor, pattern, channel_multiplier, on_true_tile: NkiTensor, on_false_value,
                  cmp_op=OPS["equal"], offset=0, name=None) -> None:
    """GpSimd: ``dst = where(cmp_op(affine, 0), on_true_tile, on_false_value)`` with
    ``affine = offset + p * channel_multiplier + sum(i_k * step_k)`` (e.g. causal masks)."""
    ctx, c = _start("affine_select")
    dst = c.compute_operand(dst, "dst", psum=False, engine="the GpSimd engine")
    t = c.compute_operand(on_true_tile, "on_true_tile", psum=False, engine="the GpSimd engine")
    c.same_elements(dst, "dst", t, "on_true_tile")
    pairs = _pattern(c, pattern)
    cnt = math.prod(n for _, n in pairs)
    if cnt != dst.free_size():
        c.fail(NKIShapeError, f"pattern {pattern} covers {cnt} elements per partition but dst "
               f"{dst._desc()} holds {dst.free_size()}", fix="make the pattern counts match dst")
    o = _op(c, cmp_op, "cmp_op", ("compare",))
    _emit(c, "gpsimd", 150 + cnt, [t], [dst])
    if ctx.numerics:
        pred = o.fn(_affine(pairs, dst.shape[0], int(offset), int(channel_multiplier)), 0) != 0
        _write(dst, np.where(pred, _f32(t), np.float32(on_false_value)))


def range_select(dst: NkiTensor, on_true_tile: NkiTensor, comp_op0, comp_op1, bound0, bound1,
                 reduce_cmd=reduce_cmd.reset_reduce, reduce_res=None, reduce_op=OPS["maximum"],
                 range_start=0.0, on_false_value=-3.4028235e+38, name=None) -> None:
    """VectorE: keep ``on_true_tile[p, i]`` where ``comp_op0(range_start + i, bound0[p])`` and
    ``comp_op1(range_start + i, bound1[p])`` hold, else ``on_false_value``; optional reduce."""
    ctx, c = _start("range_select")
    dst = c.compute_operand(dst, "dst")
    t = c.compute_operand(on_true_tile, "on_true_tile")
    c.same_elements(dst, "dst", t, "on_true_tile")
    o0 = _op(c, comp_op0, "comp_op0", ("compare",))
    o1 = _op(c, comp_op1, "comp_op1", ("compare",))
    b0 = c.per_partition_scalar(bound0, "bound0", t)
    b1 = c.per_partition_scalar(bound1, "bound1", t)
    red = _op(c, reduce_op, "reduce_op", ("binary",)) if reduce_res is not None else None
    if reduce_res is not None:
        reduce_res = c.compute_operand(reduce_res, "reduce_res")
    n = t.free_size()
    _emit(c, "vector", max(64, n), [t] + [x for x in (b0, b1) if isinstance(x, NkiTensor)],
          [dst] + ([reduce_res] if reduce_res is not None else []))
    if ctx.numerics:
        idx = np.float32(range_start) + np.arange(n, dtype=np.float32)[None, :]
        mask = (o0.fn(idx, _scalar_arg(b0)) != 0) & (o1.fn(idx, _scalar_arg(b1)) != 0)
        y = np.where(mask, _f32(t), np.float32(on_false_value))
        _write(dst, y)
        if red is not None:
            _accumulate(c, "vector", reduce_cmd, red.reducer(y, axis=1, keepdims=True), red, reduce_res)


def select_reduce(dst: NkiTensor, predicate: NkiTensor, on_true, on_false, reduce_res=None, reduce_cmd=reduce_cmd.idle,
                  reduce_op=OPS["maximum"], reverse_pred=False, name=None) -> None:
    """VectorE: ``dst = where(predicate != 0, on_true, on_false)`` (``on_false`` tile or scalar),
    optionally reducing ``dst`` along the free dim into ``reduce_res``."""
    ctx, c = _start("select_reduce")
    dst = c.compute_operand(dst, "dst")
    p = c.compute_operand(predicate, "predicate")
    t = c.compute_operand(on_true, "on_true")
    c.same_elements(dst, "dst", t, "on_true")
    c.same_elements(p, "predicate", t, "on_true")
    reads = [p, t]
    if isinstance(on_false, NkiTensor):
        f = c.compute_operand(on_false, "on_false")
        if not (f.shape[0] == t.shape[0] and f.free_size() in (1, t.free_size())):
            c.same_elements(f, "on_false", t, "on_true")
        reads.append(f)
    else:
        f = c.per_partition_scalar(on_false, "on_false", t)
    red = _op(c, reduce_op, "reduce_op", ("binary",)) if reduce_res is not None else None
    if reduce_res is not None:
        reduce_res = c.compute_operand(reduce_res, "reduce_res")
    _emit(c, "vector", max(64, t.free_size()), reads,
          [dst] + ([reduce_res] if reduce_res is not None else []))
    if ctx.numerics:
        mask = _f32(p) != 0
        if reverse_pred:
            mask = ~mask
        fv = _f32(f) if isinstance(f, NkiTensor) else np.float32(f)
        y = np.where(mask, _f32(t), fv)
        _write(dst, y)
        if red is not None:
            _accumulate(c, "vector", reduce_cmd, red.reducer(y, axis=1, keepdims=True), red, reduce_res)


def bn_stats(dst: NkiTensor, data: NkiTensor, name=None) -> None:
    """VectorE: per partition ``(count, mean, var*count)`` of the even and of the odd elements
    of ``data`` (at most 512 per partition) -> ``dst`` [P, 6]."""
    ctx, c = _start("bn_stats")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    n = x.free_size()
    if n > 512:
        c.fail(NKIShapeError, f"data {x._desc()} has {n} elements per partition; bn_stats takes at "
               "most 512 (nl.tile_size.bn_stats_fmax)", fix="call bn_stats per 512-element chunk "
               "and combine with one bn_aggr", rule="bn-stats-tile")
    if dst.shape[0] != x.shape[0] or dst.free_size() != 6:
        c.fail(NKIShapeError, f"dst {dst._desc()} must be [{x.shape[0]}, 6]",
               fix=f"allocate dst with shape ({x.shape[0]}, 6)")
    _emit(c, "vector", max(64, n), [x], [dst])
    if ctx.numerics:
        v = _f32(x).astype(np.float64)
        cols = []
        for part in (v[:, 0::2], v[:, 1::2]):
            cnt = part.shape[1]
            if cnt:
                mean = part.mean(axis=1)
                m2 = ((part - mean[:, None]) ** 2).sum(axis=1)
            else:
                mean = m2 = np.zeros(v.shape[0])
            cols += [np.full(v.shape[0], cnt, np.float64), mean, m2]
        _write(dst, np.stack(cols, axis=1))


def bn_aggr(dst: NkiTensor, data: NkiTensor, name=None) -> None:
    """VectorE: combine ``(count, mean, var*count)`` triples (from bn_stats) into
    ``dst`` [P, 2] = (mean, variance)."""
    ctx, c = _start("bn_aggr")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    n = x.free_size()
    if n % 3:
        c.fail(NKIShapeError, f"data {x._desc()} must hold (count, mean, var*count) triples; "
               f"{n} elements per partition is not a multiple of 3", fix="pass bn_stats outputs")
    if dst.shape[0] != x.shape[0] or dst.free_size() != 2:
        c.fail(NKIShapeError, f"dst {dst._desc()} must be [{x.shape[0]}, 2]",
               fix=f"allocate dst with shape ({x.shape[0]}, 2)")
    _emit(c, "vector", max(64, n), [x], [dst])
    if ctx.numerics:
        t = _f32(x).astype(np.float64).reshape(x.shape[0], -1, 3)
        cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
        total = cnt.sum(axis=1)
        safe = np.where(total > 0, total, 1)
        gmean = (cnt * mean).sum(axis=1) / safe
        gm2 = (m2 + cnt * (mean - gmean[:, None]) ** 2).sum(axis=1)
        _write(dst, np.stack([gmean, gm2 / safe], axis=1))


def max8(dst: NkiTensor, src: NkiTensor, name=None) -> None:
    """VectorE: the 8 largest values of each partition, in descending order -> ``dst`` [P, 8]."""
    ctx, c = _start("max8")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(src, "src")
    n = x.free_size()
    if not 8 <= n <= 16384:
        c.fail(NKIShapeError, f"src {x._desc()} has {n} elements per partition; max8 needs 8..16384",
               fix="pad or split the free dimension")
    if dst.shape[0] != x.shape[0] or dst.free_size() != 8:
        c.fail(NKIShapeError, f"dst {dst._desc()} must be [{x.shape[0]}, 8]",
               fix=f"allocate dst with shape ({x.shape[0]}, 8)")
    _emit(c, "vector", max(64, n), [x], [dst])
    if ctx.numerics:
        v = _f32(x)
        top = np.partition(v, n - 8, axis=1)[:, n - 8:]
        _write(dst, -np.sort(-top, axis=1))


def nc_find_index8(dst: NkiTensor, data: NkiTensor, vals, name=None) -> None:
    """VectorE: for each of the 8 values per partition in ``vals``, the index of its first
    occurrence in ``data`` (flattened free dim) -> ``dst`` [P, 8] (uint32)."""
    ctx, c = _start("nc_find_index8")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    v = c.compute_operand(vals, "vals")
    if v.shape[0] != x.shape[0] or v.free_size() != 8 or dst.free_size() != 8:
        c.fail(NKIShapeError, f"vals {v._desc()} and dst {dst._desc()} must be [{x.shape[0]}, 8]",
               fix="pass the max8 output as vals")
    c.dtype_in(dst, "dst", (dt.uint32, dt.int32, dt.uint16), "indices are integers")
    _emit(c, "vector", max(64, x.free_size()), [x, v], [dst])
    if ctx.numerics:
        d = _f32(x)
        eq = d[:, None, :] == _f32(v)[:, :, None]
        found = eq.any(axis=2)
        idx = np.where(found, eq.argmax(axis=2), np.iinfo(np.uint32).max)
        _write(dst, idx)


def dropout(dst: NkiTensor, data: NkiTensor, prob, name=None) -> None:
    """VectorE: zero each element with probability ``prob`` (scalar or [P, 1] tile); survivors
    are not rescaled."""
    ctx, c = _start("dropout")
    dst = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    c.same_elements(dst, "dst", x, "data")
    p = c.per_partition_scalar(prob, "prob", x)
    if isinstance(p, float) and not 0.0 <= p <= 1.0:
        c.fail(NKIArgumentError, f"prob={p} is not a probability", fix="pass a value in [0, 1]")
    _emit(c, "vector", max(64, x.free_size()), [x] + ([p] if isinstance(p, NkiTensor) else []), [dst])
    if ctx.numerics:
        v = _f32(x)
        keep = ctx.rng.random(v.shape, dtype=np.float32) >= _scalar_arg(p)
        _write(dst, np.where(keep, v, np.float32(0)))


__all__ = [
    "engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version",
    "get_nc_version", "tensor_engine", "vector_engine", "scalar_engine", "gpsimd_engine",
    "unknown_engine", "dma_copy", "nc_matmul", "nc_transpose", "activation", "tensor_tensor",
    "tensor_scalar", "scalar_tensor_tensor", "tensor_reduce", "tensor_copy", "memset",
    "reciprocal", "exponential", "tensor_tensor_scan", "iota", "affine_select", "range_select",
    "select_reduce", "bn_stats", "bn_aggr", "max8", "nc_find_index8", "dropout",
]
