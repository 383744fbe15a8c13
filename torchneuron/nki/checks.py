"""The hardware rules every instruction checks, with their error messages.

Each helper raises an :class:`~torchneuron.nki.errors.NKIError` subclass naming the rule,
the instruction and argument, the shapes/buffers involved, the kernel source line and a fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import dtypes as dt
from .errors import (NKIArgumentError, NKIBufferError, NKIDtypeError, NKIMemoryError,
                     NKIPartitionError, NKIShapeError)
from .tensor import NkiTensor

# Instructions whose operands may be indirect (run-time offset) access patterns.
_INDIRECT_OK = frozenset({"dma_copy", "dma_transpose", "dma_compute"})


def fmt_loc(loc: tuple | None) -> str | None:
    return f"{loc[0]}:{loc[1]}" if loc else None


class Call:
    """Argument checking for one instruction call (keeps the op name and source line)."""

    __slots__ = ("op", "loc", "ctx")

    def __init__(self, op: str, ctx, loc: tuple | None):
        self.op = op
        self.ctx = ctx
        self.loc = loc

    def fail(self, cls, msg: str, fix: str, rule: str | None = None):
        raise cls(f"{self.op}: {msg}", fix=fix, location=fmt_loc(self.loc), rule=rule)

    def tensor(self, x: Any, arg: str) -> NkiTensor:
        if not isinstance(x, NkiTensor):
            self.fail(NKIArgumentError, f"`{arg}` must be a tensor (nl.ndarray or a slice of one), "
                      f"got {type(x).__name__}", fix=f"pass a tile for `{arg}`")
        if x.ind is not None and self.op not in _INDIRECT_OK:
            self.fail(NKIArgumentError, f"`{arg}` has an indirect access pattern, which only "
                      "DMA instructions support", fix="gather with nisa.dma_copy first")
        st = x.storage
        if st.clobbered is not None:
            desc, loc, addr = st.clobbered
            self.fail(NKIMemoryError,
                      f"`{arg}` {x._desc()} placed at address {st.address} (allocated at "
                      f"{st.loc}) is used after {desc} was placed at {addr} (at {loc}), "
                      "overlapping its bytes; tiles share storage only when placed at the same "
                      "address", fix="give live tiles disjoint address ranges, or place the new "
                      "tile at exactly the old tile's address to reuse its storage",
                      rule="placement")
        return x

    def on_chip(self, t: NkiTensor, arg: str, psum: bool = True, sbuf: bool = True,
                engine: str = "compute engines") -> None:
        b = t.storage.buffer
        if b.is_hbm:
            self.fail(NKIBufferError, f"`{arg}` is {t._desc()} in HBM but {engine} only access "
                      "SBUF/PSUM", fix="load it into SBUF first with nisa.dma_copy / nl.load",
                      rule="buffer-kind")
        if b.name == "psum" and not psum:
            self.fail(NKIBufferError, f"`{arg}` is {t._desc()} in PSUM, which {engine} cannot access",
                      fix="copy it to SBUF with nisa.tensor_copy (Vector/Scalar engine) first",
                      rule="buffer-kind")
        if b.name == "sbuf" and not sbuf:
            self.fail(NKIBufferError, f"`{arg}` is {t._desc()} in SBUF but must be in PSUM",
                      fix="allocate it with buffer=nl.psum", rule="buffer-kind")

    def partitions(self, t: NkiTensor, arg: str) -> None:
        """Partition count <= 128 and the start-partition rule of the compute engines."""
        shape = t.data.shape
        n = shape[0] if shape else 1
        pmax = self.ctx.platform.sbuf_partitions
        if n > pmax:
            self.fail(NKIPartitionError, f"partition dimension {n} of `{arg}` ({t._desc()}) exceeds "
                      f"maximum {pmax}", fix=f"tile dimension 0 into chunks of at most {pmax}",
                      rule="partition-size")
        start = t.partition_start()
        if n > 64:
            ok = start == 0
            allowed = "0"
        elif n > 32:
            ok = start in (0, 64)
            allowed = "0 or 64"
        else:
            ok = start in (0, 32, 64, 96)
            allowed = "0, 32, 64 or 96"
        if not ok:
            self.fail(NKIPartitionError, f"`{arg}` ({t._desc()}) starts at partition {start}; an "
                      f"access of {n} partitions must start at partition {allowed}",
                      fix="align the partition slice (or move the data with a DMA first)",
                      rule="start-partition")

    def compute_operand(self, t: Any, arg: str, psum: bool = True, engine: str = "compute engines"
                        ) -> NkiTensor:
        t = self.tensor(t, arg)
        self.on_chip(t, arg, psum=psum, engine=engine)
        self.partitions(t, arg)
        self.access_dims(t, arg)
        return t

    def access_dims(self, t: NkiTensor, arg: str) -> None:
        """ISA access patterns address at most 4 free dimensions (after merging contiguous ones)."""
        if t.ndim <= 5:
            return
        dims = [(n, s) for n, s in zip(t.data.shape[1:], t.data.strides[1:]) if n != 1]
        merged = 0
        prev = None
        for n, s in reversed(dims):
            if prev is None or s != prev[0] * prev[1]:
                merged += 1
            prev = (n, s)
        if merged > 4:
            self.fail(NKIShapeError, f"`{arg}` {t._desc()} needs a {merged}-D free access pattern; "
                      "instructions address at most 4 free dimensions",
                      fix="reshape the tile so that contiguous dimensions merge, or split the "
                          "instruction", rule="access-pattern")

    def same_partitions(self, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
        if a.shape[0] != b.shape[0]:
            self.fail(NKIShapeError, f"`{an}` {a._desc()} and `{bn}` {b._desc()} have different "
                      "partition dimensions", fix="use tiles with the same partition size")

    def same_elements(self, a: NkiTensor, an: str, b: NkiTensor, bn: str) -> None:
        self.same_partitions(a, an, b, bn)
        if a.free_size() != b.free_size():
            self.fail(NKIShapeError, f"`{an}` {a._desc()} and `{bn}` {b._desc()} have different "
                      f"numbers of elements per partition ({a.free_size()} vs {b.free_size()})",
                      fix="slice the tiles to matching shapes")

    def per_partition_scalar(self, x: Any, arg: str, like: NkiTensor) -> Any:
        """A Python scalar or a [P, 1] tile (one value per partition)."""
        if isinstance(x, NkiTensor):
            self.compute_operand(x, arg)
            if x.shape[0] != like.shape[0] or x.free_size() != 1:
                self.fail(NKIShapeError, f"`{arg}` {x._desc()} must be a scalar or a "
                          f"[{like.shape[0]}, 1] tile (one value per partition)",
                          fix=f"slice it to shape ({like.shape[0]}, 1)")
            return x
        if isinstance(x, (int, np.integer)) and not isinstance(x, bool) and abs(int(x)) > 2 ** 24:
            return int(x)  # beyond float32's exact integers (e.g. 32-bit masks): keep it exact
        if isinstance(x, (int, float, bool)) or (hasattr(x, "dtype") and getattr(x, "ndim", 1) == 0):
            return float(x)
        self.fail(NKIArgumentError, f"`{arg}` must be a number or a tile, got {type(x).__name__}",
                  fix="pass a Python float or a [P, 1] tile")

    def dtype_in(self, t: NkiTensor, arg: str, allowed, what: str) -> None:
        d = t.dtype
        custom = isinstance(d, dt._CustomDType)
        if not any(d is a or (not custom and not isinstance(a, dt._CustomDType) and d == a)
                   for a in allowed):
            self.fail(NKIDtypeError, f"`{arg}` has dtype {dt.name(t.dtype)} but {what}",
                      fix=f"cast it (e.g. with nisa.tensor_copy) to one of "
                          f"{', '.join(dt.name(a) for a in allowed)}")
