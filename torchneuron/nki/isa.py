"""``nki.isa`` (``nisa``): one function per NeuronCore instruction; every call writes ``dst``.

Each call (1) checks its operands against the hardware rules (:mod:`.checks`), (2) appends an
instruction record with its engine, cycle cost and byte regions to the kernel's stream (the
input of :mod:`.perf_model`) and (3) unless the kernel runs timing-only, computes the result
on whole tiles with numpy, in float32 (the engines' internal precision), and rounds it into
``dst.dtype``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import ml_dtypes
import numpy as np

from . import dtypes as dt
from . import perf_model as pm
from .checks import Call
from .errors import (NKIArgumentError, NKIBufferError, NKIDtypeError, NKIMemoryError,
                     NKIOutOfBoundsError,
                     NKIPlatformError, NKIShapeError)
from .ops import OPS, Op, op_from_any
from .tensor import NkiTensor, describe
from .tracer import Instr, current, user_frame


from . import constants  # noqa: E402  (nki.isa.constants)
from .constants import (dge_mode, dma_engine, engine, matmul_perf_mode, nc_version, oob_mode,
                        reduce_cmd)

tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown


_RC = reduce_cmd
_DGE = dge_mode
_OOB = oob_mode

_GEN = {"trn1": nc_version.gen2, "trn2": nc_version.gen3, "trn3": nc_version.gen4}


def _platform():
    from .language import _platform as p
    return p()


def get_nc_version() -> nc_version:
    """NeuronCore generation of the target platform (inside a kernel: the kernel's; outside:
    ``NEURON_PLATFORM_TARGET_OVERRIDE``)."""
    return _GEN[_platform().name]


def get_nc_sub_version() -> int:
    """Silicon revision within the generation (0: first revision, the only one modelled)."""
    return 0


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
    name = eng.name if isinstance(eng, engine) else str(eng)
    if name not in allowed:
        c.fail(NKIArgumentError, f"cannot run on the {name} engine", fix=f"use engine= one of "
               f"{', '.join('nisa.engine.' + a for a in allowed)}")
    return name


def _emit(c: Call, eng: str, cycles: float, reads: list, writes: list, **kw) -> None:
    c.ctx.instructions.append(Instr(c.op, eng, cycles, [t.region() for t in reads],
                                    [t.region() for t in writes], loc=c.loc, **kw))


def _one_bank(c: Call, t: NkiTensor, arg: str) -> None:
    """TensorE writes one PSUM bank per instruction: ``t`` must not cross a bank boundary."""
    r = t.region()
    st = t.storage
    base = st.address[1] if st.address is not None else 0  # auto tiles start at a bank
    b0, b1 = base + r[3], base + r[4]
    bank = c.ctx.platform.psum_bank_bytes
    if b0 // bank != (b1 - 1) // bank:
        c.fail(NKIMemoryError, f"`{arg}` {t._desc()} covers bytes {b0}..{b1 - 1} of each PSUM "
               f"partition, crossing a {bank}-byte bank boundary; TensorE writes one bank per "
               "instruction", fix=f"keep each matmul output within one bank ({bank // 4} fp32 "
               "per partition, bank-aligned)", rule="psum-bank")


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
    if 0 in a.strides and any(n > 1 and s == 0 for n, s in zip(a.shape, a.strides)):
        return None  # a stride-0 destination aliases its elements: compute in a temporary
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
    """The PSUM "written" flags of the view ``t``: one flag per element of its allocation.

    Flags belong to the allocation: tiles placed at the same address share data but each
    starts a fresh accumulation group (AWS's rotating PSUM buffers). A view reinterpreted with
    a different element size maps onto the flags of the allocation's elements it overlaps."""
    st = t.storage
    fl = st.written
    si = st.array.itemsize
    rb = st.row_bytes
    off = t.data.__array_interface__["data"][0] - st.base_ptr
    if fl.strides[0] * si == rb and t.data.itemsize == si:  # auto tile, storage dtype
        return np.lib.stride_tricks.as_strided(fl.reshape(-1)[off // si:], shape=t.shape,
                                               strides=tuple(x // si for x in t.data.strides))
    frow = fl.strides[0]
    r, c = divmod(off, rb)
    strides = tuple((x // rb) * frow if (x and x % rb == 0 and abs(x) >= rb) else x // si
                    for x in t.data.strides)
    return np.lib.stride_tricks.as_strided(fl.reshape(-1)[r * frow + c // si:], shape=t.shape,
                                           strides=strides)


def _scalar_arg(x: Any) -> Any:
    """A per-partition operand as something numpy broadcasts against (P, F)."""
    if isinstance(x, NkiTensor):
        return _f32(x).reshape(-1, 1)
    if isinstance(x, int):  # an integer float32 cannot hold exactly (bit masks): keep it exact
        return x
    return np.float32(x)


def _any_psum(*ts) -> bool:
    return any(isinstance(t, NkiTensor) and t.storage.buffer.name == "psum" for t in ts)


def _all16(*ts) -> bool:
    for t in ts:  # a plain loop: this runs on every instruction
        if isinstance(t, NkiTensor) and t.dtype not in dt._SIXTEEN:
            return False
    return True


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


def _dma_checks(c: Call, dst: NkiTensor, src: NkiTensor) -> None:
    if src.storage.buffer.name == "psum":
        c.fail(NKIBufferError, f"`src` {src._desc()} is in PSUM; DMAs may not read PSUM",
               fix="copy the PSUM tile to SBUF with nisa.tensor_copy first, then DMA from SBUF",
               rule="buffer-kind")
    if dst.storage.buffer.name == "psum":
        c.fail(NKIBufferError, f"`dst` {dst._desc()} is in PSUM; DMAs write HBM or SBUF only",
               fix="DMA into an SBUF tile, then nisa.tensor_copy into PSUM if needed",
               rule="buffer-kind")


def _index_reads(*ts) -> list:
    """Index tiles / registers an indirect view reads (dependencies of the DMA)."""
    out = []
    for t in ts:
        if t is not None and t.ind is not None:
            idx = t.ind[0]
            if isinstance(idx, (NkiTensor, VirtualRegister)):
                out.append(idx)
    return out


def _dma_bytes(dst: NkiTensor, src: NkiTensor) -> tuple[int, int, int]:
    """(bytes moved, descriptor-cost bytes, bytes crossing HBM) of a DMA."""
    nbytes = dst.size * dst.itemsize
    run = min(_run_bytes(dst.data), _run_bytes(src.data))
    hbm_bytes = (src.size * src.itemsize if src.storage.buffer.is_hbm else 0) + \
        (nbytes if dst.storage.buffer.is_hbm else 0)
    return nbytes, int(pm.dma_cost_bytes(nbytes, run)), hbm_bytes


def _dma_values(src: NkiTensor, dst: NkiTensor, v: np.ndarray) -> np.ndarray:
    if src.dtype != dst.dtype and not (dt.is_int(src.dtype) and dt.is_int(dst.dtype)) \
            and not dt.is_packed(dst.dtype):
        v = v.astype(np.float32)  # DMA casts go through fp32
    return v


def dma_copy(dst: NkiTensor, src: NkiTensor, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown,
             engine=engine.unknown, name=None) -> None:
    """Copy ``src`` to ``dst`` with a DMA queue (HBM<->SBUF, SBUF<->SBUF, HBM<->HBM).

    Element counts must match; differing dtypes convert through float32. DMAs may not read or
    write PSUM. Integer data is copied even in timing-only runs (it feeds registers, loop
    bounds and indirect offsets).
    """
    ctx, c = _start("dma_copy")
    dst = c.tensor(dst, "dst")
    src = c.tensor(src, "src")
    _dma_checks(c, dst, src)
    if dst.size != src.size:
        c.fail(NKIShapeError, f"`dst` {dst._desc()} has {dst.size} elements but `src` "
               f"{src._desc()} has {src.size}", fix="slice src and dst to the same number of elements")
    if dst.storage.buffer.on_chip and dst.shape[0] > ctx.platform.sbuf_partitions:
        c.partitions(dst, "dst")
    if dge_mode is _DGE.hwdge and src.dtype != dst.dtype:
        c.fail(NKIDtypeError, f"hardware-DGE DMAs cannot convert dtypes ({dt.name(src.dtype)} -> "
               f"{dt.name(dst.dtype)})", fix="use matching dtypes, or dge_mode=nisa.dge_mode.swdge / "
               "the default to let the DMA cast through fp32", rule="dtype")
    if (dt.is_packed(src.dtype) or dt.is_packed(dst.dtype)) and src.dtype != dst.dtype:
        c.fail(NKIDtypeError, f"cannot convert {dt.name(src.dtype)} to {dt.name(dst.dtype)} in a "
               "DMA: x4-packed data is copied bit for bit", fix="use the same packed dtype on both "
               "sides, or reinterpret with .view()", rule="dtype")
    nbytes, cost, hbm_bytes = _dma_bytes(dst, src)
    _emit(c, "dma", 0.0, [src] + _index_reads(src, dst), [dst], nbytes=cost, hbm_bytes=hbm_bytes)
    if dst.storage.external:
        dst.storage.dirty = True  # a kernel input written in place: the caller copies it back
    compute = ctx.numerics or dt.is_int(dst.dtype)
    if compute and (src.ind is not None or dst.ind is not None):
        _indirect_copy(c, dst, src, oob_mode)
    elif compute:
        v = _dma_values(src, dst, src.data)
        _write(dst, v.reshape(dst.shape) if v.shape != dst.shape else v)


def _index_values(t: NkiTensor) -> np.ndarray:
    idx = t.ind[0]
    if isinstance(idx, NkiTensor):
        return idx.data.astype(np.int64)
    if isinstance(idx, VirtualRegister):
        return np.array([idx.read()], np.int64)
    return np.array([idx], np.int64)


def _resolve(c: Call, t: NkiTensor, arg: str, mode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat root array, root indices, in-bounds mask) of an indirect view for the current
    index values."""
    idx = _index_values(t)
    offs = t.indirect_offsets(idx)
    flat, where, ok = t.indirect_locations(offs)
    if not ok.all() and mode is not _OOB.skip:
        flat_idx = idx.reshape(-1)
        if t.ind[4]:  # vector offsets: one index per row of pattern dim 0
            flat_idx = flat_idx[~ok.reshape(ok.shape[0], -1).all(axis=1)]
        bad = sorted(set(flat_idx.tolist()))[:8]
        st = t.storage
        c.fail(NKIOutOfBoundsError, f"indirect `{arg}` index value(s) {bad} address outside "
               f"{describe(st.array.shape, st.dtype, st.buffer)}",
               fix="clamp the indices, or pass oob_mode=nisa.oob_mode.skip to skip those rows",
               rule="out-of-bounds")
    return flat, where, ok


def _indirect_copy(c: Call, dst: NkiTensor, src: NkiTensor, mode) -> None:
    """Gather (indirect src) and/or scatter (indirect dst); out-of-bounds rows are skipped
    when ``oob_mode=skip``."""
    if src.ind is not None:
        flat, where, ok = _resolve(c, src, "src", mode)
        vals = flat[where]
    else:
        vals, ok = src.data, np.ones(src.shape, bool)
    vals = dt.cast(_dma_values(src, dst, vals), dst.dtype)
    if dst.ind is not None:
        dflat, dwhere, dok = _resolve(c, dst, "dst", mode)
        mask = dok & ok.reshape(dwhere.shape)
        dflat[dwhere[mask]] = vals.reshape(dwhere.shape)[mask]
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
    _one_bank(c, dst, "dst")
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
    if eng == "tensor":
        _one_bank(c, dst, "dst")
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
    o0 = _op(c, op0, "op0", ("binary", "compare", "logical", "bitwise", "unary"))
    s0 = c.per_partition_scalar(operand0 if operand0 is not None else 0.0, "operand0", x)
    o1 = s1 = None
    if op1 is not None:
        o1 = _op(c, op1, "op1", ("binary", "compare", "logical", "bitwise", "unary"))
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


# --------------------------------------------------------------------------------------------
# registers and dynamic control flow
# --------------------------------------------------------------------------------------------
class VirtualRegister:
    """A 32-bit engine-sequencer register (``nisa.register_alloc``).

    Holds its value while the kernel is simulated, so dynamic loops (``nl.dynamic_range``,
    ``nl.fori_loop``, ``nl.while_loop``, ``while reg:``) run the iterations the value gives and
    ``.ap(scalar_offset=reg)`` reads it when the DMA executes. Arithmetic with ints or other
    registers gives new registers (register ALU operations).
    """

    __slots__ = ("value", "sid", "loc")

    def __init__(self, value: int | None = None):
        self.value = None if value is None else _int32(value)
        ctx = current_or_none_active()
        self.sid = ctx.new_sid() if ctx is not None else 0
        self.loc = None

    def read(self) -> int:
        if self.value is None:
            raise NKIArgumentError("register read before a value was set",
                                   fix="initialise it: nisa.register_alloc(0), register_move or "
                                       "register_load", location=None)
        return self.value

    def region(self) -> tuple:
        return (self.sid, 0, 1, 0, 4, self.sid)

    def __bool__(self) -> bool:  # `while reg:` (data-dependent loop on a register)
        return self.read() != 0

    def _alu(self, other, f, rev=False):
        o = other.read() if isinstance(other, VirtualRegister) else int(other)
        a, b = (o, self.read()) if rev else (self.read(), o)
        return VirtualRegister(f(a, b))

    def __add__(self, o): return self._alu(o, lambda a, b: a + b)
    def __radd__(self, o): return self._alu(o, lambda a, b: a + b, True)
    def __sub__(self, o): return self._alu(o, lambda a, b: a - b)
    def __rsub__(self, o): return self._alu(o, lambda a, b: a - b, True)
    def __mul__(self, o): return self._alu(o, lambda a, b: a * b)
    def __rmul__(self, o): return self._alu(o, lambda a, b: a * b, True)
    def __floordiv__(self, o): return self._alu(o, lambda a, b: a // b)
    def __mod__(self, o): return self._alu(o, lambda a, b: a % b)

    def __repr__(self) -> str:
        return f"VirtualRegister({self.value})"


def _int32(v) -> int:
    v = int(v)
    return ((v + 2 ** 31) % 2 ** 32) - 2 ** 31


def current_or_none_active():
    from .tracer import current_or_none
    ctx = current_or_none()
    return ctx if ctx is not None and ctx.active else None


_REG_CYCLES = 64  # a sequencer register load/store (U: no public figure)


def register_alloc(x: Any = None) -> VirtualRegister:
    """A virtual register: uninitialised (None), an int, or loaded from a one-element tensor."""
    if isinstance(x, NkiTensor):
        r = VirtualRegister()
        register_load(r, x)
        return r
    if x is not None and not isinstance(x, (int, np.integer)):
        ctx, c = _start("register_alloc")
        c.fail(NKIArgumentError, f"initial value must be None, an int or a one-element tensor, "
               f"got {type(x).__name__}", fix="pass e.g. nisa.register_alloc(0)")
    return VirtualRegister(None if x is None else int(x))


def register_move(dst: VirtualRegister, src) -> None:
    """``dst = src`` (an int or another register)."""
    ctx, c = _start("register_move")
    if not isinstance(dst, VirtualRegister):
        c.fail(NKIArgumentError, "`dst` must be a VirtualRegister", fix="use nisa.register_alloc()")
    dst.value = src.read() if isinstance(src, VirtualRegister) else _int32(src)


def _one_element(c: Call, t, arg: str) -> NkiTensor:
    t = c.tensor(t, arg)
    if t.size != 1:
        c.fail(NKIShapeError, f"`{arg}` {t._desc()} must hold exactly one element",
               fix="slice it to shape (1, 1)")
    if t.storage.buffer.name == "psum":
        c.fail(NKIBufferError, f"`{arg}` is in PSUM; registers load/store HBM or SBUF",
               fix="copy it to SBUF first", rule="buffer-kind")
    return t


def register_load(dst: VirtualRegister, src: NkiTensor) -> None:
    """Load the one value of ``src`` (HBM or SBUF, up to 32 bits) into register ``dst``.

    The value is read even in timing-only runs (integer DMAs copy data there too), so dynamic
    loops follow the data."""
    ctx, c = _start("register_load")
    if not isinstance(dst, VirtualRegister):
        c.fail(NKIArgumentError, "`dst` must be a VirtualRegister", fix="use nisa.register_alloc()")
    t = _one_element(c, src, "src")
    _emit(c, "gpsimd", _REG_CYCLES, [t], [dst])
    v = t.data.reshape(-1)[0]
    if dt.is_float(t.dtype) and not np.isfinite(np.float32(v)):
        c.fail(NKIArgumentError, f"`src` {t._desc()} holds {v}, not a number a register can hold "
               "(uninitialised memory?)", fix="write the value before loading it")
    dst.value = _int32(np.float64(v) if dt.is_float(t.dtype) else int(v))


def register_store(dst: NkiTensor, src: VirtualRegister) -> None:
    """Store register ``src`` into the one element of ``dst`` (HBM or SBUF)."""
    ctx, c = _start("register_store")
    if not isinstance(src, VirtualRegister):
        c.fail(NKIArgumentError, "`src` must be a VirtualRegister", fix="use nisa.register_alloc()")
    t = _one_element(c, dst, "dst")
    _emit(c, "gpsimd", _REG_CYCLES, [src], [t])
    if t.storage.external:
        t.storage.dirty = True
    _write(t, np.full(t.shape, src.read()))


# --------------------------------------------------------------------------------------------
# cross-core (LNC) synchronisation
# --------------------------------------------------------------------------------------------
def _need_lnc_platform(c: Call) -> None:
    if c.ctx.platform.name == "trn1":
        c.fail(NKIPlatformError, "needs NeuronCore-v3 or newer (trn2/trn3); trn1 has no LNC",
               fix="target trn2 or trn3", rule="platform")


def core_barrier(data: NkiTensor, cores, engine=engine.gpsimd, name=None) -> None:
    """Wait until both cores of the logical core reach this barrier (on ``engine``); accesses
    to ``data`` after it see what either core wrote before it."""
    ctx, c = _start("core_barrier")
    _need_lnc_platform(c)
    t = c.tensor(data, "data")
    try:
        cores_t = tuple(int(x) for x in cores)
    except TypeError:
        cores_t = None
    n = ctx.num_programs
    if cores_t != tuple(range(n)) and cores_t != (0, 1):
        c.fail(NKIArgumentError, f"cores={cores!r}: the barrier synchronises the LNC's cores "
               f"{tuple(range(n))}", fix="pass cores=(0, 1)")
    eng = _engine(c, engine, "gpsimd", ("gpsimd", "vector", "scalar", "tensor"))
    seq = ctx.sync_seq
    ctx.launch.meet(ctx, "core_barrier", fmt_loc(c.loc), None)
    _emit(c, eng, _REG_CYCLES, [t], [t], sync=("barrier", seq, None))


def sendrecv(src: NkiTensor, dst: NkiTensor, send_to_rank, recv_from_rank, pipe_id,
             dma_engine=dma_engine.dma, name=None) -> None:
    """Send ``src`` to core ``send_to_rank``'s ``dst`` while receiving core
    ``recv_from_rank``'s ``src`` into this core's ``dst`` (SBUF tiles, same shape and dtype)."""
    ctx, c = _start("sendrecv")
    _need_lnc_platform(c)
    s = c.tensor(src, "src")
    d = c.tensor(dst, "dst")
    for t, arg in ((s, "src"), (d, "dst")):
        if t.storage.buffer is not _SBUF:
            c.fail(NKIBufferError, f"`{arg}` {t._desc()} must be in SBUF", fix="stage it in SBUF",
                   rule="buffer-kind")
    if s.shape != d.shape or s.dtype != d.dtype:
        c.fail(NKIShapeError, f"`src` {s._desc()} and `dst` {d._desc()} must have the same shape "
               "and dtype", fix="allocate dst like src")
    n = ctx.num_programs
    me = ctx.program_id
    to, frm = int(send_to_rank), int(recv_from_rank)
    if not (0 <= to < n and 0 <= frm < n):
        c.fail(NKIArgumentError, f"send_to_rank={to} / recv_from_rank={frm}: ranks are the LNC's "
               f"cores 0..{n - 1}", fix="launch with kernel[2] and use ranks 0 and 1")
    if dma_engine is _DMA_ENGINE.gpsimd_dma:
        lim = {4: 1024, 2: 512, 1: 256}.get(s.itemsize, 1024)
        if s.free_size() * s.itemsize > lim:
            c.fail(NKIShapeError, f"gpsimd_dma moves at most {lim} bytes per partition; `src` "
                   f"{s._desc()} has {s.free_size() * s.itemsize}", fix="use dma_engine=nisa."
                   "dma_engine.dma or send smaller tiles")
    payload = (to, frm, s.data.copy() if (ctx.numerics or dt.is_int(s.dtype)) else None, s.shape,
               dt.name(s.dtype))

    def agree(pl: dict):
        for p, (t_, f_, _, shp, dn) in pl.items():
            if pl[t_][1] != p:
                return (f"program {p} sends to {t_} but program {t_} receives from "
                        f"{pl[t_][1]}")
            if pl[f_][3] != shp or pl[f_][4] != dn:
                return (f"program {p} receives {shp} {dn} but program {f_} sends "
                        f"{pl[f_][3]} {pl[f_][4]}")
        return None
    seq = ctx.sync_seq
    got = ctx.launch.meet(ctx, f"sendrecv pipe {int(pipe_id)}", fmt_loc(c.loc), payload, agree)
    nbytes = s.size * s.itemsize
    _emit(c, "dma", 0.0, [s], [d], nbytes=nbytes, sync=("sendrecv", seq, frm))
    data = got[frm][2]
    if data is not None:
        _write(d, data)


# --------------------------------------------------------------------------------------------
# more DMA instructions
# --------------------------------------------------------------------------------------------
_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(dst: NkiTensor, src: NkiTensor, axes=None, priority=None,
                  dge_mode=dge_mode.unknown, oob_mode=oob_mode.error, name=None) -> None:
    """DMA ``src`` (HBM or SBUF, 2-byte dtype, last dim <= 128) transposed into ``dst`` (SBUF):
    2-D axes (1, 0), 3-D (2, 1, 0), 4-D (3, 1, 2, 0). An indirect ``src`` (``vector_offset``)
    gathers rows first. Modelled at 90% of copy bandwidth from HBM, 50% from SBUF."""
    ctx, c = _start("dma_transpose")
    d = c.tensor(dst, "dst")
    s = c.tensor(src, "src")
    _dma_checks(c, d, s)
    if d.storage.buffer is not _SBUF:
        c.fail(NKIBufferError, f"`dst` {d._desc()} must be in SBUF", fix="transpose into SBUF",
               rule="buffer-kind")
    perm = _TRANSPOSE_AXES.get(s.ndim)
    if perm is None:
        c.fail(NKIShapeError, f"`src` {s._desc()} must be 2-, 3- or 4-D", fix="reshape src")
    if axes is not None and tuple(axes) != perm:
        c.fail(NKIArgumentError, f"axes={tuple(axes)} is not supported for a {s.ndim}-D source; "
               f"the supported permutation is {perm}", fix=f"pass axes={perm} or omit it")
    if s.dtype != d.dtype:
        c.fail(NKIDtypeError, f"src {dt.name(s.dtype)} and dst {dt.name(d.dtype)} differ; "
               "dma_transpose does not convert", fix="transpose in the source dtype", rule="dtype")
    if s.itemsize != 2:
        c.fail(NKIDtypeError, f"dma_transpose moves 2-byte elements; src is {dt.name(s.dtype)}",
               fix="transpose bf16/fp16 data, or use nisa.nc_transpose", rule="dtype")
    if s.shape[-1] > 128:
        c.fail(NKIShapeError, f"`src` {s._desc()}: the last dimension must be <= 128",
               fix="transpose in blocks of 128", rule="transpose-tile")
    out_shape = tuple(s.shape[i] for i in perm)
    if d.size != s.size or (d.shape != out_shape and d.free_size() * d.shape[0] != s.size):
        c.fail(NKIShapeError, f"`dst` {d._desc()} must hold the transposed {out_shape}",
               fix=f"allocate dst with shape {out_shape}")
    if dge_mode is _DGE.hwdge:
        ok = (s.shape[0] == 16) if s.ndim == 2 else (
            s.shape[0] in (1, 2, 4, 8, 16) and (s.shape[0] * s.shape[-2]) % 16 == 0)
        if not ok:
            c.fail(NKIShapeError, f"hardware-DGE dma_transpose of {s._desc()}: 2-D sources need "
                   "16 rows; 3-/4-D sources 1/2/4/8/16 rows with rows * shape[-2] % 16 == 0",
                   fix="use dge_mode=nisa.dge_mode.unknown or pad the source")
    nbytes, _, hbm_bytes = _dma_bytes(d, s)
    # The DMA engine transposes natively: no small-run descriptor penalty, but 90% (HBM) /
    # 50% (SBUF source) of copy bandwidth.
    eff = 0.9 if s.storage.buffer.is_hbm else 0.5
    _emit(c, "dma", 0.0, [s] + _index_reads(s), [d], nbytes=int(nbytes / eff), hbm_bytes=hbm_bytes)
    if ctx.numerics or dt.is_int(d.dtype):
        if s.ind is not None:
            flat, where, ok = _resolve(c, s, "src", oob_mode)
            vals = np.where(ok, flat[where], 0).reshape(s.shape)
        else:
            vals = s.data
        _write(d, np.transpose(vals, perm).reshape(d.shape))


def dma_compute(dst: NkiTensor, srcs, reduce_op, scales=None, unique_indices=True,
                oob_mode=oob_mode.error, name=None) -> None:
    """``dst = sum(srcs)`` computed in float32 inside the DMA engines (HBM/SBUF operands; up
    to 16 sources; ``reduce_op`` nl.add, ``scales`` all 1.0). With an indirect (vector_offset)
    operand it is a read-modify-write: ``dst[idx] = dst[idx] + src`` (scatter, dst indirect) or
    ``dst = dst + src[idx]`` (gather)."""
    ctx, c = _start("dma_compute")
    d = c.tensor(dst, "dst")
    if not isinstance(srcs, (list, tuple)) or not 1 <= len(srcs) <= 16:
        c.fail(NKIArgumentError, "`srcs` must be a list of 1..16 tensors", fix="pass [a, b]")
    ss = [c.tensor(x, f"srcs[{i}]") for i, x in enumerate(srcs)]
    o = _op(c, reduce_op, "reduce_op", ("binary",))
    if o.name != "add":
        c.fail(NKIArgumentError, f"reduce_op={o!r}: DMA compute supports nl.add only",
               fix="pass reduce_op=nl.add")
    if scales is not None and any(float(x) != 1.0 for x in scales):
        c.fail(NKIArgumentError, f"scales={list(scales)}: only 1.0 is supported",
               fix="omit scales")
    for i, x in enumerate(ss):
        _dma_checks(c, d, x)
        if x.size != d.size:
            c.fail(NKIShapeError, f"`srcs[{i}]` {x._desc()} has {x.size} elements, `dst` "
                   f"{d._desc()} has {d.size}", fix="match the element counts")
    if any(x.ind is not None for x in ss + [d]) and (len(ss) != 2 or not unique_indices):
        c.fail(NKIArgumentError, "read-modify-write dma_compute (an indirect operand) needs "
               "exactly 2 sources and unique_indices=True", fix="pass [dst_view, data]")
    nb = d.size * d.itemsize
    hbm = sum(x.size * x.itemsize for x in ss if x.storage.buffer.is_hbm) + \
        (nb if d.storage.buffer.is_hbm else 0)
    _emit(c, "dma", 0.0, ss + _index_reads(d, *ss), [d], nbytes=nb * len(ss), hbm_bytes=hbm)
    if d.storage.external:
        d.storage.dirty = True
    if not (ctx.numerics or dt.is_int(d.dtype)):
        return
    total = None
    for i, x in enumerate(ss):
        if x.ind is not None:
            flat, where, ok = _resolve(c, x, f"srcs[{i}]", oob_mode)
            v = np.where(ok, flat[where].astype(np.float32), 0).reshape(-1)
        else:
            v = x.data.astype(np.float32).reshape(-1)
        total = v if total is None else total + v
    if d.ind is not None:
        flat, where, ok = _resolve(c, d, "dst", oob_mode)
        w = where.reshape(-1)[ok.reshape(-1)]
        flat[w] = dt.cast(total[ok.reshape(-1)], d.dtype)
    else:
        _write(d, total.reshape(d.shape))


# --------------------------------------------------------------------------------------------
# more compute instructions
# --------------------------------------------------------------------------------------------
def activation_reduce(dst: NkiTensor, op, data: NkiTensor, reduce_op, reduce_res: NkiTensor,
                      bias=None, scale=1.0, name=None) -> None:
    """``activation`` with ``reduce_cmd=reset_reduce``: ``reduce_res = reduce_op(op(data *
    scale + bias))`` along the free dimension (ScalarE)."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=_RC.reset_reduce)


_IDENTITY = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}


def _acc_update(c: Call, eng: str, cmd, red: Op, partial: np.ndarray, init) -> np.ndarray:
    """New accumulator-register value for ``reduce_cmd`` (reset_reduce / reduce / load_reduce)."""
    acc = c.ctx.accumulators.get(eng)
    if cmd is _RC.load_reduce:
        base = np.broadcast_to(_scalar_arg(init) if init is not None else np.float32(0),
                               partial.shape).astype(np.float32)
        acc = red.fn(base, partial)
    elif cmd is _RC.reduce and acc is not None and acc.shape == partial.shape:
        acc = red.fn(acc, partial)
    else:
        acc = partial
    c.ctx.accumulators[eng] = acc
    return acc


def tensor_scalar_reduce(dst: NkiTensor, data: NkiTensor, op0, operand0, reduce_op,
                         reduce_res: NkiTensor | None = None, reverse0=False,
                         reduce_cmd=reduce_cmd.reset_reduce, reduce_init=None,
                         reduce_res_negate=False, name=None) -> None:
    """VectorE: ``dst = data op0 operand0`` and ``reduce_res = reduce_op`` over the free
    dimension of ``dst`` through the engine's accumulator registers (``reduce_cmd``)."""
    ctx, c = _start("tensor_scalar_reduce")
    d = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    c.same_elements(d, "dst", x, "data")
    o0 = _op(c, op0, "op0", ("binary", "unary"))  # unary ALU ops (nl.abs) ignore operand0
    if o0.kind == "unary" and operand0 not in (None, 0, 0.0):
        c.fail(NKIArgumentError, f"op0={o0!r} is unary; operand0 must be None or 0, got "
               f"{operand0!r}", fix="pass operand0=0.0")
    s0 = c.per_partition_scalar(operand0 if operand0 is not None else 0.0, "operand0", x)
    red = _op(c, reduce_op, "reduce_op", ("binary",))
    if red.reducer is None:
        c.fail(NKIArgumentError, f"reduce_op={red!r} cannot reduce",
               fix="use nl.add, nl.multiply, nl.maximum or nl.minimum")
    if reduce_res is not None:
        reduce_res = c.compute_operand(reduce_res, "reduce_res")
        c.per_partition_scalar(reduce_res, "reduce_res", x)
    if reduce_cmd is _RC.load_reduce and reduce_init is None:
        c.fail(NKIArgumentError, "reduce_cmd=load_reduce needs reduce_init",
               fix="pass reduce_init (a float or [P, 1] tile)")
    init = c.per_partition_scalar(reduce_init, "reduce_init", x) if reduce_init is not None else None
    cyc = _vec_cycles(c, x.free_size(), "tensor_scalar", x, d)
    reads = [x] + [t for t in (s0, init) if isinstance(t, NkiTensor)]
    _emit(c, "vector", cyc, reads, [d] + ([reduce_res] if reduce_res is not None else []))
    if not ctx.numerics:
        return
    v = _apply(o0, _f32(x), _scalar_arg(s0), reverse0)
    _write(d, v)
    stored = dt.cast(v, d.dtype).astype(np.float32)  # the reduction sees the written values
    acc = _acc_update(c, "vector", reduce_cmd, red, red.reducer(stored, axis=1, keepdims=True), init)
    if reduce_res is not None:
        _write(reduce_res, -acc if reduce_res_negate else acc)


def tensor_scalar_cumulative(dst: NkiTensor, src: NkiTensor, op0, op1, imm0, imm1=None,
                             reduce_cmd=reduce_cmd.reset_reduce, name=None) -> None:
    """VectorE running reduction: ``reg = op1(op0(src[i], imm0), reg); dst[i] = reg`` along the
    free dimension (``reg`` starts at op1's identity, continues, or is loaded from ``imm1``)."""
    ctx, c = _start("tensor_scalar_cumulative")
    d = c.compute_operand(dst, "dst")
    x = c.compute_operand(src, "src")
    c.same_elements(d, "dst", x, "src")
    o0 = _op(c, op0, "op0", ("binary",))
    o1 = _op(c, op1, "op1", ("binary",))
    if o1.name not in _IDENTITY:
        c.fail(NKIArgumentError, f"op1={o1!r}: the running reduction is add, subtract, multiply, "
               "maximum or minimum", fix="pick one of those")
    for t in (x, d):
        if t.dtype in (dt.int32, dt.uint32):
            c.fail(NKIDtypeError, f"{t._desc()}: int32/uint32 are not supported by "
                   "tensor_scalar_cumulative", fix="use 16-bit ints or floats", rule="dtype")
    s0 = c.per_partition_scalar(imm0, "imm0", x)
    s1 = c.per_partition_scalar(imm1, "imm1", x) if imm1 is not None else None
    if reduce_cmd is _RC.load_reduce and s1 is None:
        c.fail(NKIArgumentError, "reduce_cmd=load_reduce needs imm1", fix="pass imm1")
    n = x.free_size()
    _emit(c, "vector", 2 * max(64, n), [x] + [t for t in (s0, s1) if isinstance(t, NkiTensor)],
          [d])
    if not ctx.numerics:
        return
    v = _apply(o0, _f32(x), _scalar_arg(s0))
    acc = c.ctx.accumulators.get("vector")
    p = v.shape[0]
    if reduce_cmd is _RC.load_reduce:
        reg = np.broadcast_to(_scalar_arg(s1), (p, 1)).astype(np.float32)[:, 0].copy()
    elif reduce_cmd is _RC.reduce and acc is not None and acc.shape == (p, 1):
        reg = acc[:, 0].astype(np.float32).copy()
    else:
        reg = np.full(p, _IDENTITY[o1.name], np.float32)
    out = np.empty_like(v)
    for i in range(v.shape[1]):  # inherently sequential; vectorised across partitions
        reg = o1.fn(v[:, i], reg).astype(np.float32)
        out[:, i] = reg
    c.ctx.accumulators["vector"] = reg.reshape(p, 1)
    _write(d, out)


def activate2(dst: NkiTensor, op, data: NkiTensor, imm0, imm1, op0, op1, relu_param=0.0,
              reverse0=False, reverse1=False, reduce_op=None, reduce_res=None,
              reduce_cmd=reduce_cmd.idle, name=None) -> None:
    """ScalarE (NeuronCore-v4): ``dst = op((data op0 imm0) op1 imm1)`` (``nl.bypass`` skips a
    stage; ``nl.prelu`` uses ``relu_param`` as its negative slope), with an optional reduction
    through the accumulator registers."""
    ctx, c = _start("activate2")
    if ctx.platform.name != "trn3":
        c.fail(NKIPlatformError, f"needs NeuronCore-v4 (trn3); the target is {ctx.platform.name}",
               fix="use nisa.activation with scale/bias on trn1/trn2", rule="platform")
    d = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    c.same_elements(d, "dst", x, "data")
    o = _op(c, op, "op", ("unary",))
    o0 = _op(c, op0, "op0", ("binary",))
    o1 = _op(c, op1, "op1", ("binary",))
    ok = {("multiply", "add"), ("multiply", "subtract"), ("multiply", "bypass"),
          ("add", "bypass"), ("subtract", "bypass"), ("bypass", "bypass")}
    if (o0.name, o1.name) not in ok:
        c.fail(NKIArgumentError, f"(op0, op1) = ({o0!r}, {o1!r}) is not one of the supported "
               "pairs (multiply, add/subtract/bypass), (add, bypass), (subtract, bypass), "
               "(bypass, bypass)", fix="use a supported pair")
    i0 = c.per_partition_scalar(imm0, "imm0", x)
    i1 = c.per_partition_scalar(imm1, "imm1", x)
    rp = c.per_partition_scalar(relu_param, "relu_param", x)
    red = None
    if reduce_op is not None:
        red = _op(c, reduce_op, "reduce_op", ("binary",))
        if red.name not in ("add", "maximum", "minimum", "abs_max", "abs_min"):
            c.fail(NKIArgumentError, f"reduce_op={red!r} is not supported",
                   fix="use nl.add, nl.maximum, nl.minimum, nl.abs_max or nl.abs_min")
    if reduce_res is not None:
        reduce_res = c.compute_operand(reduce_res, "reduce_res")
    n = x.free_size()
    cyc = max(64, n) / pm.scalar_speedup(ctx.platform, _all16(x, d)) + (64 if red else 0)
    reads = [x] + [t for t in (i0, i1, rp) if isinstance(t, NkiTensor)]
    _emit(c, "scalar", cyc, reads, [d] + ([reduce_res] if reduce_res is not None else []))
    if not ctx.numerics:
        return
    v = _f32(x)
    if o0.name != "bypass":
        v = _apply(o0, v, _scalar_arg(i0), reverse0)
    if o1.name != "bypass":
        v = _apply(o1, v, _scalar_arg(i1), reverse1)
    if o.name == "prelu":
        y = np.where(v >= 0, v, v * _scalar_arg(rp)).astype(np.float32)
    else:
        y = o.fn(v)
    _write(d, y)
    if red is not None and reduce_cmd is not _RC.idle:
        if reduce_cmd is _RC.reset:
            acc = np.full((v.shape[0], 1), _IDENTITY.get(red.name, 0.0), np.float32)
            c.ctx.accumulators["scalar"] = acc
        else:
            part = red.reducer(y, axis=1, keepdims=True) if red.reducer else \
                _reduce_pairwise(red, y)
            acc = _acc_update(c, "scalar", reduce_cmd, red, part, None)
        if reduce_res is not None:
            _write(reduce_res, acc)


def _reduce_pairwise(red: Op, y: np.ndarray) -> np.ndarray:
    acc = y[:, :1]
    for i in range(1, y.shape[1]):
        acc = red.fn(acc, y[:, i:i + 1])
    return acc


def tensor_partition_reduce(dst: NkiTensor, op, data: NkiTensor, name=None) -> None:
    """GpSimd: reduce ``data`` [P, ...] across partitions into ``dst`` [1, ...] with ``op``
    (add, average, maximum, bitwise_or, bitwise_and). Cost (U): 150 + F * ceil(P / 16) cycles
    (eight 16-partition GpSimd cores, then combined)."""
    ctx, c = _start("tensor_partition_reduce")
    d = c.compute_operand(dst, "dst", psum=False, engine="the GpSimd engine")
    x = c.compute_operand(data, "data", psum=False, engine="the GpSimd engine")
    o = _op(c, op, "op", ("binary", "bitwise"))
    if o.name not in ("add", "average", "maximum", "minimum", "bitwise_or", "bitwise_and"):
        c.fail(NKIArgumentError, f"op={o!r} cannot reduce across partitions",
               fix="use nl.add, nl.average, nl.maximum, nl.bitwise_or or nl.bitwise_and")
    if d.shape[0] != 1 or d.free_size() != x.free_size():
        c.fail(NKIShapeError, f"dst {d._desc()} must be [1, ...] with data's "
               f"{x.free_size()} elements per partition", fix=f"allocate dst (1, ...) like data")
    p, f = x.shape[0], x.free_size()
    _emit(c, "gpsimd", 150 + f * -(-p // 16), [x], [d])
    if ctx.numerics:
        v = x.data.reshape(p, -1)
        if o.kind == "bitwise":
            r = o.reducer(v.astype(np.int64), axis=0)
        else:
            r = o.reducer(v.astype(np.float32), axis=0)
        _write(d, np.asarray(r).reshape(d.shape))


def tensor_copy_predicated(dst: NkiTensor, src, predicate: NkiTensor, reverse_pred=False,
                           name=None) -> None:
    """VectorE: ``dst[i] = src[i]`` (or the scalar ``src``) where ``predicate[i]`` is non-zero
    (zero with ``reverse_pred``); other elements of ``dst`` keep their values."""
    ctx, c = _start("tensor_copy_predicated")
    d = c.compute_operand(dst, "dst")
    pr = c.compute_operand(predicate, "predicate")
    c.same_elements(d, "dst", pr, "predicate")
    if pr.dtype not in (dt.uint8, dt.uint16, dt.uint32, dt.int32, dt.int8, dt.int16) and \
            not dt.is_float(pr.dtype):
        c.fail(NKIDtypeError, f"predicate {pr._desc()} must be an integer mask",
               fix="use a uint8/uint16/uint32 tile", rule="dtype")
    reads = [pr, d]
    if isinstance(src, NkiTensor):
        s = c.compute_operand(src, "src")
        c.same_elements(d, "dst", s, "src")
        if s.dtype != d.dtype:
            c.fail(NKIDtypeError, f"src {dt.name(s.dtype)} and dst {dt.name(d.dtype)} must match",
                   fix="copy in one dtype", rule="dtype")
        if _any_psum(s) and _any_psum(pr):
            c.fail(NKIBufferError, "src and predicate cannot both be in PSUM",
                   fix="copy one to SBUF", rule="buffer-kind")
        reads.append(s)
    else:
        s = c.per_partition_scalar(src, "src", d)
    n = d.free_size()
    if _any_psum(*reads):
        cyc = max(64, n)
    else:
        cyc = 2 * n / pm.vector_speedup(ctx.platform, _all16(d), False, "tensor_tensor")
    _emit(c, "vector", max(64.0, cyc), reads, [d])
    if ctx.numerics:
        mask = pr.data.reshape(d.shape[0], -1) != 0
        if reverse_pred:
            mask = ~mask
        cur = d.data.reshape(d.shape[0], -1)
        val = s.data.reshape(cur.shape) if isinstance(s, NkiTensor) else dt.cast(
            np.full(cur.shape, s), d.dtype)
        _write(d, np.where(mask, val, cur).reshape(d.shape))


def nonzero_with_count(dst: NkiTensor, src: NkiTensor, index_offset=0, padding_val=-1,
                       name=None) -> None:
    """GpSimd: on partitions 0, 16, ..., 112 of the tiles, the indices (+ ``index_offset``) of
    the non-zero elements of ``src``, then ``padding_val``, then their count (dst has one more
    element per partition than src). Other partitions of ``dst`` are not written."""
    ctx, c = _start("nonzero_with_count")
    if ctx.platform.name == "trn1":
        c.fail(NKIPlatformError, "needs NeuronCore-v3 or newer", fix="target trn2/trn3",
               rule="platform")
    d = c.compute_operand(dst, "dst", psum=False, engine="the GpSimd engine")
    x = c.compute_operand(src, "src", psum=False, engine="the GpSimd engine")
    c.same_partitions(d, "dst", x, "src")
    if d.free_size() != x.free_size() + 1:
        c.fail(NKIShapeError, f"dst {d._desc()} must have one more element per partition than "
               f"src {x._desc()}", fix=f"allocate dst with {x.free_size() + 1} elements per partition")
    c.dtype_in(x, "src", (dt.float32, dt.int32), "nonzero_with_count reads float32 or int32")
    c.dtype_in(d, "dst", (dt.int32,), "nonzero_with_count writes int32")
    t = x.free_size()
    _emit(c, "gpsimd", 150 + t, [x], [d])
    if ctx.numerics or dt.is_int(x.dtype):
        v = x.data.reshape(x.shape[0], -1)
        out = d.data.reshape(d.shape[0], -1)
        for p in range(0, x.shape[0], 16):
            nz = np.flatnonzero(v[p] != 0)
            row = np.full(t + 1, int(padding_val), np.int64)
            row[:nz.size] = nz + int(index_offset)
            row[t] = nz.size
            out[p] = dt.cast(row, d.dtype)


def nc_match_replace8(dst: NkiTensor, data: NkiTensor, vals: NkiTensor, imm, dst_idx=None,
                      name=None) -> None:
    """VectorE: ``dst`` = ``data`` with the first occurrence of each of the 8 ``vals`` per
    partition replaced by ``imm``; ``dst_idx`` gets their positions (vals processed 7..0, so
    duplicates pair with successive occurrences; not found: all-ones)."""
    ctx, c = _start("nc_match_replace8")
    d = c.compute_operand(dst, "dst")
    x = c.compute_operand(data, "data")
    v = c.compute_operand(vals, "vals")
    c.same_elements(d, "dst", x, "data")
    if v.shape[0] != x.shape[0] or v.free_size() != 8:
        c.fail(NKIShapeError, f"vals {v._desc()} must be [{x.shape[0]}, 8]",
               fix="pass the max8 output as vals")
    if dst_idx is not None:
        dst_idx = c.compute_operand(dst_idx, "dst_idx")
        if dst_idx.free_size() != 8:
            c.fail(NKIShapeError, f"dst_idx {dst_idx._desc()} must have 8 elements per partition",
                   fix=f"allocate ({x.shape[0]}, 8)")
        c.dtype_in(dst_idx, "dst_idx", (dt.uint32, dt.uint16, dt.int32), "indices are integers")
    n = x.free_size()
    if not 8 <= n <= 16384:
        c.fail(NKIShapeError, f"data {x._desc()} has {n} elements per partition; 8..16384 are "
               "supported", fix="split the free dimension")
    _emit(c, "vector", max(64, n), [x, v], [d] + ([dst_idx] if dst_idx is not None else []))
    if not ctx.numerics:
        return
    data2 = _f32(x).copy()
    vv = _f32(v)
    p = data2.shape[0]
    taken = np.zeros(data2.shape, bool)
    idx = np.full((p, 8), 0xFFFFFFFF, np.int64)
    rows = np.arange(p)
    for i in range(7, -1, -1):
        eq = (data2 == vv[:, i:i + 1]) & ~taken
        found = eq.any(axis=1)
        j = eq.argmax(axis=1)
        taken[rows[found], j[found]] = True
        idx[found, i] = j[found]
    out = np.where(taken, np.float32(imm), data2)
    _write(d, out)
    if dst_idx is not None:
        lim = np.iinfo(np.uint16).max if dst_idx.dtype == dt.uint16 else 0xFFFFFFFF
        _write(dst_idx, np.minimum(idx, lim).astype(dt.storage(dst_idx.dtype)))


def nc_n_gather(dst: NkiTensor, data: NkiTensor, indices: NkiTensor, name=None) -> None:
    """GpSimd: per partition, ``dst[p, k] = data[p].flatten()[indices[p, k]]`` (SBUF tiles;
    uint32 indices in [0, elements per partition))."""
    ctx, c = _start("nc_n_gather")
    d = c.compute_operand(dst, "dst", psum=False, engine="the GpSimd engine")
    x = c.compute_operand(data, "data", psum=False, engine="the GpSimd engine")
    ix = c.compute_operand(indices, "indices", psum=False, engine="the GpSimd engine")
    c.same_partitions(d, "dst", x, "data")
    c.same_elements(d, "dst", ix, "indices")
    c.dtype_in(ix, "indices", (dt.uint32, dt.int32), "indices are uint32")
    if d.dtype != x.dtype:
        c.fail(NKIDtypeError, f"dst {dt.name(d.dtype)} must match data {dt.name(x.dtype)}",
               fix="gather in the data dtype", rule="dtype")
    n = ix.free_size()
    _emit(c, "gpsimd", 150 + n, [x, ix], [d])
    if ctx.numerics or dt.is_int(d.dtype):
        src = x.data.reshape(x.shape[0], -1)
        k = ix.data.reshape(ix.shape[0], -1).astype(np.int64)
        if (k < 0).any() or (k >= src.shape[1]).any():
            bad = k[(k < 0) | (k >= src.shape[1])][:8].tolist()
            c.fail(NKIOutOfBoundsError, f"indices {bad} are outside [0, {src.shape[1]})",
                   fix="clamp the indices", rule="out-of-bounds")
        _write(d, np.take_along_axis(src, k, axis=1).reshape(d.shape))


def local_gather(dst: NkiTensor, src_buffer: NkiTensor, index: NkiTensor, num_elem_per_idx=1,
                 num_valid_indices=None, name=None) -> None:
    """GpSimd: each 16-partition group g flattens its slice of ``index`` (partition-major,
    i.e. column by column) into a list of element offsets and every partition p of the group
    reads ``num_elem_per_idx`` contiguous elements of its own (flattened) ``src_buffer`` row at
    each offset: ``dst[p, k, e] = src[p, idx_g[k] + e]``. uint16 indices; out-of-range indices
    are undefined behaviour on hardware and an error here."""
    ctx, c = _start("local_gather")
    d = c.compute_operand(dst, "dst", psum=False, engine="the GpSimd engine")
    x = c.compute_operand(src_buffer, "src_buffer", psum=False, engine="the GpSimd engine")
    ix = c.compute_operand(index, "index", psum=False, engine="the GpSimd engine")
    p = x.shape[0]
    if ix.shape[0] != p or p % 16:
        c.fail(NKIShapeError, f"src_buffer {x._desc()} and index {ix._desc()} need the same "
               "partition count, a multiple of 16", fix="pad to 16-partition groups")
    c.dtype_in(ix, "index", (dt.uint16,), "local_gather indices are uint16")
    ne = int(num_elem_per_idx)
    if ne not in (1, 2, 4, 8, 16, 32):
        c.fail(NKIArgumentError, f"num_elem_per_idx={ne} must be 1, 2, 4, 8, 16 or 32",
               fix="pick one of those")
    per_core = ix.free_size() * 16
    nv = per_core if num_valid_indices is None else int(num_valid_indices)
    if not 1 <= nv <= per_core or nv > 4096:
        c.fail(NKIArgumentError, f"num_valid_indices={nv} must be in [1, {min(per_core, 4096)}]",
               fix="count the indices per 16-partition group")
    if d.shape[0] != p or d.free_size() != nv * ne:
        c.fail(NKIShapeError, f"dst {d._desc()} must be [{p}, {nv} * {ne}] elements",
               fix=f"allocate dst with {nv * ne} elements per partition")
    if d.dtype != x.dtype:
        c.fail(NKIDtypeError, "local_gather does not convert dtypes", fix="match dst to src_buffer",
               rule="dtype")
    t = 4
    cc = ((28 + t * ne) / (t * ne)) / min(4 / x.itemsize, ne)
    _emit(c, "gpsimd", 150 + nv * ne / cc, [x, ix], [d])
    if ctx.numerics or dt.is_int(d.dtype):
        src = x.data.reshape(p, -1)
        idx = ix.data.reshape(p, -1).astype(np.int64)
        out = np.empty((p, nv, ne), dtype=src.dtype)
        for g in range(p // 16):
            ids = idx[16 * g:16 * g + 16].flatten(order="F")[:nv]
            cols = ids[:, None] + np.arange(ne)[None, :]
            if (cols < 0).any() or (cols >= src.shape[1]).any():
                c.fail(NKIOutOfBoundsError, f"index values {sorted(set(ids.tolist()))[:8]} of "
                       f"partition group {g} read outside the {src.shape[1]} elements per "
                       "partition", fix="clamp the indices", rule="out-of-bounds")
            out[16 * g:16 * g + 16] = src[16 * g:16 * g + 16][:, cols]
        _write(d, out.reshape(d.shape))


def nc_stream_shuffle(dst: NkiTensor, src: NkiTensor, shuffle_mask, name=None) -> None:
    """VectorE: within each 32-partition quadrant, ``dst[i] = src[shuffle_mask[i]]`` (255 leaves
    ``dst[i]`` unchanged); the same mask applies to every quadrant."""
    ctx, c = _start("nc_stream_shuffle")
    d = c.tensor(dst, "dst")
    s = c.tensor(src, "src")
    c.on_chip(d, "dst")
    c.on_chip(s, "src")
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        c.fail(NKIArgumentError, f"shuffle_mask must be 32 entries in 0..31 or 255, got {mask}",
               fix="pass a 32-element list")
    if d.dtype != s.dtype or d.free_size() != s.free_size():
        c.fail(NKIShapeError, f"dst {d._desc()} and src {s._desc()} need the same dtype and "
               "elements per partition", fix="match the tiles")
    active = -(-max(d.shape[0], s.shape[0]) // 32) * 32
    allowed = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for t, arg in ((s, "src"), (d, "dst")):
        if t.partition_start() not in allowed:
            c.fail(NKIPartitionError, f"`{arg}` starts at partition {t.partition_start()}; with "
                   f"{active} active partitions it must start at {allowed}",
                   fix="align the tiles", rule="start-partition")
    _emit(c, "vector", max(64, s.free_size()), [s], [d])
    if ctx.numerics or dt.is_int(d.dtype):
        sv = s.data.reshape(s.shape[0], -1).copy()
        dv = d.data.reshape(d.shape[0], -1)
        for q in range(0, d.shape[0], 32):
            for i, m in enumerate(mask):
                if m == 255 or q + i >= d.shape[0]:
                    continue
                if q + m >= sv.shape[0]:
                    c.fail(NKIOutOfBoundsError, f"shuffle_mask[{i}]={m} reads partition {q + m} "
                           f"of src {s._desc()}", fix="mask entries must address src partitions",
                           rule="out-of-bounds")
                dv[q + i] = sv[q + m]
        if dst.storage.written is not None:
            _mark(d)


# --------------------------------------------------------------------------------------------
# MX (microscaling, NeuronCore-v4)
# --------------------------------------------------------------------------------------------
_MX_EMAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15, "float4_e2m1fn_x4": 2}


def _need_trn3(c: Call, what: str) -> None:
    if c.ctx.platform.name != "trn3":
        c.fail(NKIPlatformError, f"{what} needs NeuronCore-v4 (trn3); the target is "
               f"{c.ctx.platform.name}", fix="target trn3 (NEURON_PLATFORM_TARGET_OVERRIDE=trn3)",
               rule="platform")


def _scale_row(k: np.ndarray) -> np.ndarray:
    """Row of the scale tile holding the scale of data partition k: within each 32-partition
    quadrant, block b (partitions 8b..8b+7) uses row 32 * quadrant + b."""
    return (k // 32) * 32 + (k % 32) // 8


def _unpack_mx(t: NkiTensor) -> np.ndarray:
    """float32 values of an x4-packed tile [P, F] -> [P, F, 4]."""
    d = t.dtype
    raw = np.ascontiguousarray(t.data.reshape(t.shape[0], -1))
    if d is dt.float4_e2m1fn_x4:
        bits = raw.astype(np.uint16)
        nib = np.stack([(bits >> (4 * i)) & 0xF for i in range(4)], axis=-1).astype(np.uint8)
        return nib.view(dt.float4_e2m1fn_x4.element).astype(np.float32)
    return raw.view(np.uint8).reshape(raw.shape[0], raw.shape[1], 4).view(d.element).astype(
        np.float32)


def _scale_factors(t: NkiTensor, cols: int) -> np.ndarray:
    raw = t.data.reshape(t.shape[0], -1)[:, :cols]
    bits = raw.view(np.uint8) if raw.dtype.itemsize == 1 else raw.astype(np.uint8)
    return np.exp2(bits.astype(np.float64) - 127).astype(np.float32)


def quantize_mx(dst: NkiTensor, src: NkiTensor, dst_scale: NkiTensor, name=None) -> None:
    """VectorE (NeuronCore-v4): MXFP8-quantize ``src`` [P, F] (bf16/fp16; P a multiple of 32,
    F of 4) into ``dst`` [P, F/4] (float8_e4m3fn_x4 / float8_e5m2_x4) and ``dst_scale``
    [P, F/4] (float8_e8m0fnu / uint8). Each group of 8 partitions x 4 elements shares the
    scale X = 2^(floor(log2 max|v|) - (Emax - 1)) (Emax 8 for e4m3fn, 15 for e5m2; 2^-127 for
    an all-zero group); values are v / X rounded to nearest even and saturated. Scales of the
    four 8-partition blocks of each 32-partition quadrant go to that quadrant's first four
    partitions (the layout nc_matmul_mx reads)."""
    ctx, c = _start("quantize_mx")
    _need_trn3(c, "quantize_mx")
    d = c.compute_operand(dst, "dst", psum=False)
    s = c.compute_operand(src, "src", psum=False)
    sc = c.compute_operand(dst_scale, "dst_scale", psum=False)
    c.dtype_in(s, "src", (dt.bfloat16, dt.float16), "quantize_mx reads fp16/bf16")
    if d.dtype not in (dt.float8_e4m3fn_x4, dt.float8_e5m2_x4):
        c.fail(NKIDtypeError, f"dst is {dt.name(d.dtype)}; quantize_mx writes float8_e4m3fn_x4 "
               "or float8_e5m2_x4", fix="allocate dst with an x4 fp8 dtype", rule="dtype")
    c.dtype_in(sc, "dst_scale", (dt.float8_e8m0fnu, dt.uint8), "scales are float8_e8m0fnu/uint8")
    p, f = s.shape[0], s.free_size()
    if p % 32 or f % 4:
        c.fail(NKIShapeError, f"src {s._desc()}: partitions must be a multiple of 32 and elements "
               "per partition of 4", fix="pad the tile")
    if d.shape[0] != p or d.free_size() != f // 4 or sc.shape[0] != p or sc.free_size() != f // 4:
        c.fail(NKIShapeError, f"dst {d._desc()} and dst_scale {sc._desc()} must be "
               f"[{p}, {f // 4}]", fix=f"allocate both as ({p}, {f // 4})")
    _emit(c, "vector", _vec_cycles(c, f, "copy", s), [s], [d, sc])
    if not ctx.numerics:
        return
    v = _f32(s).reshape(p, f // 4, 4)
    emax = _MX_EMAX[d.dtype.name]
    blocks = np.abs(v).reshape(p // 8, 8, f // 4, 4).max(axis=(1, 3))  # [P/8, F/4]
    with np.errstate(divide="ignore"):
        e = np.where(blocks > 0, np.floor(np.log2(np.where(blocks > 0, blocks, 1))), -np.inf)
    sexp = np.where(blocks > 0, np.clip(e - (emax - 1), -127, 127), -127)
    scale = np.exp2(sexp)
    full = np.repeat(np.repeat(scale, 8, axis=0), 4, axis=1).reshape(p, f // 4, 4)
    q = v / full
    el = d.dtype.element
    maxv = float(ml_dtypes.finfo(el).max)
    q = np.clip(q, -maxv, maxv).astype(el)
    packed = np.ascontiguousarray(q).view(np.uint8).reshape(p, f // 4, 4).view(np.uint32)
    _write(d, packed.reshape(d.shape))
    bits = (sexp + 127).astype(np.uint8)  # e8m0 biased exponent
    out = sc.data.reshape(p, -1)
    for qd in range(p // 32):
        rows = bits[4 * qd:4 * qd + 4]
        if sc.dtype == dt.uint8:
            out[32 * qd:32 * qd + 4] = rows
        else:
            out[32 * qd:32 * qd + 4] = rows.view(dt.float8_e8m0fnu)


def nc_matmul_mx(dst: NkiTensor, stationary: NkiTensor, moving: NkiTensor,
                 stationary_scale: NkiTensor, moving_scale: NkiTensor, tile_position=None,
                 tile_size=None, accumulate=None, name=None) -> None:
    """TensorE (NeuronCore-v4) MXFP8/MXFP4 matmul with dequantisation:
    ``dst[m, n] (+)= sum_{k, q} S[k, m, q] s_S(k, m) M[k, n, q] s_M(k, n)`` where the x4 dtypes
    pack q = 0..3 and the scales (float8_e8m0fnu / uint8, 2^(bits - 127)) are shared by groups
    of 8 partitions x 4 values, in quantize_mx's quadrant layout. stationary [K, M<=128],
    moving [K, N] (K a multiple of 32 <= 128; N <= 4096 with fp32 dst, 8192 with bf16), dst
    [M, N] in PSUM (fp32 or bf16). Cost: a bf16 matmul's cycles for 4x the contraction."""
    ctx, c = _start("nc_matmul_mx")
    _need_trn3(c, "nc_matmul_mx")
    d = c.tensor(dst, "dst")
    c.on_chip(d, "dst", sbuf=False, engine="TensorE")
    s = c.compute_operand(stationary, "stationary", psum=False, engine="TensorE")
    m = c.compute_operand(moving, "moving", psum=False, engine="TensorE")
    ss = c.compute_operand(stationary_scale, "stationary_scale", psum=False, engine="TensorE")
    ms = c.compute_operand(moving_scale, "moving_scale", psum=False, engine="TensorE")
    for t, arg in ((s, "stationary"), (m, "moving")):
        if not dt.is_packed(t.dtype):
            c.fail(NKIDtypeError, f"`{arg}` is {dt.name(t.dtype)}; nc_matmul_mx multiplies "
                   "float8_e5m2_x4 / float8_e4m3fn_x4 / float4_e2m1fn_x4", fix="quantize with "
                   "nisa.quantize_mx", rule="dtype")
    for t, arg in ((ss, "stationary_scale"), (ms, "moving_scale")):
        c.dtype_in(t, arg, (dt.float8_e8m0fnu, dt.uint8), "MX scales are float8_e8m0fnu/uint8")
    c.dtype_in(d, "dst", (dt.float32, dt.bfloat16), "nc_matmul_mx writes fp32 or bf16")
    k, mm = s.shape[0], s.free_size()
    k2, n = m.shape[0], m.free_size()
    if k != k2 or k % 32 or k > 128:
        c.fail(NKIShapeError, f"stationary {s._desc()} and moving {m._desc()} need the same "
               "partition count, a multiple of 32 <= 128", fix="pad K", rule="matmul-tile")
    if mm > 128 or mm % 2:
        c.fail(NKIShapeError, f"stationary free size {mm} must be even and <= 128",
               fix="tile M", rule="matmul-tile")
    nmax = 4096 if d.dtype == dt.float32 else 8192
    if n > nmax:
        c.fail(NKIShapeError, f"moving free size {n} > {nmax} (all of PSUM for a "
               f"{dt.name(d.dtype)} dst)", fix=f"tile N into chunks of {nmax}", rule="matmul-tile")
    if d.shape[0] != mm or d.free_size() != n:
        c.fail(NKIShapeError, f"dst {d._desc()} must be [{mm}, {n}]",
               fix=f"allocate dst as ({mm}, {n}) in PSUM")
    for t, arg, cols in ((ss, "stationary_scale", mm), (ms, "moving_scale", n)):
        if t.shape[0] < min(k, _scale_row(np.array(k - 1)) + 1) or t.free_size() < cols:
            c.fail(NKIShapeError, f"`{arg}` {t._desc()} must cover the scale rows of {k} "
                   f"partitions and {cols} columns", fix="pass quantize_mx's scale tile")
    if tile_position not in (None, ()) or tile_size not in (None, ()):
        if tuple(tile_position or (0, 0))[1] != 0 or tuple(tile_size or (128, 128))[1] != 128:
            c.fail(NKIArgumentError, "nc_matmul_mx supports row tiling only (column 0, column "
                   "size 128)", fix="tile rows only")
    cycles = pm.matmul_cycles(mm, n, False)
    _emit(c, "tensor", cycles, [s, m, ss, ms], [d], flops=2.0 * k * 4 * mm * n,
          dtype="float8_e4m3fn")
    if not ctx.numerics:
        return
    sv = _unpack_mx(s)  # [K, M, 4]
    mv = _unpack_mx(m)  # [K, N, 4]
    rows = _scale_row(np.arange(k))
    sf = _scale_factors(ss, mm)[rows]  # [K, M]
    mf = _scale_factors(ms, n)[rows]
    res = np.einsum("kiq,kjq->ij", sv * sf[:, :, None], mv * mf[:, :, None],
                    dtype=np.float32).astype(np.float32)
    d2 = d.data.reshape(mm, n)
    if accumulate is None:
        flags = _flags(d).reshape(mm, n)
        res = np.where(flags, d2.astype(np.float32) + res, res)
    elif accumulate:
        res = d2.astype(np.float32) + res
    _write(d, res.reshape(d.shape))


# --------------------------------------------------------------------------------------------
# random numbers
# --------------------------------------------------------------------------------------------
def rng(dst: NkiTensor, engine=engine.vector, name=None) -> None:
    """Random bits into an integer tile (Vector, or GpSimd on v3+). The stream is numpy's
    (seeded per core by nki.simulate's ``seed``), not the hardware's XORWOW sequence."""
    ctx, c = _start("rng")
    eng = _engine(c, engine, "vector", ("vector", "gpsimd"))
    d = c.compute_operand(dst, "dst", psum=(eng == "vector"), engine=f"the {eng} engine")
    if not dt.is_int(d.dtype):
        c.fail(NKIDtypeError, f"dst {d._desc()} must be an integer tile", fix="use uint32 "
               "and normalise", rule="dtype")
    _emit(c, eng, max(64, d.free_size()), [], [d])
    if ctx.numerics:
        bits = ctx.rng.integers(0, 2 ** 32, size=d.shape, dtype=np.uint64)
        info = np.iinfo(d.data.dtype)
        _write(d, (bits & info.max if info.min == 0 else
                   (bits & (2 * info.max + 1)).astype(np.int64) - (bits & (info.max + 1)) * 2
                   ).astype(d.data.dtype))


def rand2(dst: NkiTensor, min, max, name=None) -> None:  # noqa: A002  (AWS argument names)
    """VectorE (NeuronCore-v4): uniform random values in [min, max] (scalars or [P, 1])."""
    ctx, c = _start("rand2")
    _need_trn3(c, "rand2")
    _rand_fill(c, dst, min, max)


def rand_uniform(dst: NkiTensor, lo=0.0, hi=1.0) -> None:
    """Uniform random values in [lo, hi) into ``dst`` on VectorE (``nl.rand``; all targets)."""
    ctx, c = _start("rng")
    _rand_fill(c, dst, lo, hi)


def _rand_fill(c: Call, dst, lo, hi) -> None:
    d = c.compute_operand(dst, "dst")
    a = c.per_partition_scalar(lo, "min", d)
    b = c.per_partition_scalar(hi, "max", d)
    _emit(c, "vector", max(64, d.free_size()), [t for t in (a, b) if isinstance(t, NkiTensor)], [d])
    if c.ctx.numerics:
        u = c.ctx.rng.random((d.shape[0], d.free_size()), dtype=np.float32)
        _write(d, _scalar_arg(a) + u * (_scalar_arg(b) - _scalar_arg(a)))


def set_rng_seed(src_seeds: NkiTensor, name=None) -> None:
    """Re-seed this core's random stream with the value of a [1, 1] tile."""
    ctx, c = _start("set_rng_seed")
    t = _one_element(c, src_seeds, "src_seeds")
    _emit(c, "vector", 64, [t], [])
    ctx.rng = np.random.default_rng(int(np.asarray(t.data).reshape(-1)[0]) & 0xFFFFFFFF)


def rand_set_state(src_seeds: NkiTensor, engine=engine.gpsimd, name=None) -> None:
    raise NotImplementedError("nisa.rand_set_state: the hardware PRNG's (XORWOW) per-lane state "
                              "layout is not public; seed with nisa.set_rng_seed instead")


def rand_get_state(dst: NkiTensor, engine=engine.gpsimd, name=None) -> None:
    raise NotImplementedError("nisa.rand_get_state: the hardware PRNG's (XORWOW) per-lane state "
                              "layout is not public")


def sequence_bounds(dst: NkiTensor, segment_ids: NkiTensor, name=None) -> None:
    raise NotImplementedError("nisa.sequence_bounds: AWS's reference omits the exact semantics "
                              "(NumPy equivalent not published); compute bounds with "
                              "iota/tensor_tensor_scan instead")


def topk(val_dst: NkiTensor, idx_dst: NkiTensor, src: NkiTensor, n, name=None) -> None:
    raise NotImplementedError("nisa.topk: the 16-partition snake layout it reads is not "
                              "specified precisely enough in AWS's reference to reproduce; use "
                              "nisa.max8 + nc_find_index8 / nc_match_replace8")


class NkiValidationError(NKIArgumentError):
    """Raised when hardware constraints are violated (AWS's name; our checks raise NKIError
    subclasses, of which this is one)."""


def _fmt(loc):
    from .checks import fmt_loc as f
    return f(loc)


fmt_loc = _fmt
_SBUF = None  # set below (tensor.sbuf), kept module-level for the checks above
_DMA_ENGINE = dma_engine

from .tensor import sbuf as _SBUF  # noqa: E402,F811

__all__ = [
    "engine", "reduce_cmd", "dge_mode", "oob_mode", "matmul_perf_mode", "nc_version",
    "dma_engine", "constants", "get_nc_version", "get_nc_sub_version", "tensor_engine",
    "vector_engine", "scalar_engine", "gpsimd_engine", "unknown_engine", "dma_copy",
    "dma_transpose", "dma_compute", "nc_matmul", "nc_matmul_mx", "nc_transpose", "activation",
    "activation_reduce", "activate2", "tensor_tensor", "tensor_scalar", "tensor_scalar_reduce",
    "tensor_scalar_cumulative", "scalar_tensor_tensor", "tensor_reduce",
    "tensor_partition_reduce", "tensor_copy", "tensor_copy_predicated", "memset", "reciprocal",
    "exponential", "tensor_tensor_scan", "iota", "affine_select", "range_select",
    "select_reduce", "bn_stats", "bn_aggr", "max8", "nc_find_index8", "nc_match_replace8",
    "nonzero_with_count", "nc_n_gather", "local_gather", "nc_stream_shuffle", "dropout",
    "quantize_mx", "rng", "rand2", "set_rng_seed", "rand_set_state", "rand_get_state",
    "sequence_bounds", "topk", "register_alloc", "register_move", "register_load",
    "register_store", "VirtualRegister", "core_barrier", "sendrecv", "NkiValidationError",
]

# `import nki.isa.constants` / `from nki.isa import constants`
sys.modules.setdefault(__name__ + ".constants", constants)
