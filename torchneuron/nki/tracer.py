"""The kernel context: platform, allocators, the recorded instruction stream, source lines.

One :class:`KernelContext` exists per program (``nl.program_id``) while a kernel runs. Every
``nisa.*`` call (and every ``nl.*`` wrapper, through the ``nisa`` calls it makes) checks its
operands, appends an :class:`Instr` to ``ctx.instructions`` for the performance model and,
unless the context runs in timing-only mode, computes its result with numpy.

Memory accounting (documented in docs/nki.md): an SBUF/PSUM allocation is live from the
``nl.ndarray``/``nl.zeros``/... call (or the ``nl.*`` op that returns a new tile) until the
Python object owning it is garbage-collected -- with CPython reference counting that is when
the last tensor (or view) referring to it goes away, e.g. when a loop variable is rebound --
or until the kernel ends.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NKIMemoryError, NKITracingError

# With the trailing separator so sibling packages such as torchneuron/nkilib (whose kernels
# are user code) are not mistaken for this package.
_PKG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_state = threading.local()


def user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost caller outside this package: the kernel source line."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_PKG_DIR):
            return fn, f.f_lineno
        f = f.f_back
    return None


def user_location() -> str | None:
    fr = user_frame()
    return f"{fr[0]}:{fr[1]}" if fr else None


@dataclass(slots=True)
class Instr:
    """One instruction of the stream, as the performance model sees it.

    ``reads``/``writes`` are regions ``(storage id, row0, row1, byte0, byte1)``; ``cycles``
    are engine cycles (compute engines) and ``nbytes`` the bytes moved (DMA).
    """

    op: str
    engine: str  # "tensor", "vector", "scalar", "gpsimd", "dma"
    cycles: float
    reads: list
    writes: list
    nbytes: int = 0
    flops: float = 0.0
    dtype: str = ""
    hbm_bytes: int = 0  # bytes of this DMA that cross HBM (bandwidth-capped)
    loc: tuple | None = None


class SbufAllocator:
    """Live SBUF bytes per partition, checked against the platform's usable capacity."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self.peak = 0
        self.live: dict[int, tuple[int, str]] = {}

    def allocate(self, sid: int, nbytes: int, desc: str, loc: str | None) -> None:
        if self.used + nbytes > self.capacity:
            biggest = sorted(self.live.values(), reverse=True)[:3]
            raise NKIMemoryError(
                f"SBUF capacity exceeded: allocating {desc} needs {nbytes} bytes per partition but "
                f"{self.used} of {self.capacity} bytes per partition are live"
                + (f" (largest live: {', '.join(d for _, d in biggest)})" if biggest else ""),
                fix="use smaller tiles, or allocate tiles inside the loop that uses them so earlier "
                    "ones are freed",
                location=loc, rule="sbuf-capacity")
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.live[sid] = (nbytes, desc)

    def free(self, sid: int) -> None:
        entry = self.live.pop(sid, None)
        if entry is not None:
            self.used -= entry[0]


class PsumAllocator:
    """PSUM: ``banks`` banks of ``bank_bytes`` per partition; each tile occupies one whole bank."""

    def __init__(self, banks: int, bank_bytes: int):
        self.banks: list[tuple[int, str] | None] = [None] * banks
        self.bank_bytes = bank_bytes

    def allocate(self, sid: int, nbytes: int, desc: str, loc: str | None) -> int:
        if nbytes > self.bank_bytes:
            raise NKIMemoryError(
                f"PSUM tile {desc} needs {nbytes} bytes per partition and would straddle PSUM banks; "
                f"a PSUM tile must fit in one bank of {self.bank_bytes} bytes per partition "
                f"({self.bank_bytes // 4} fp32 values)",
                fix=f"split the free dimension into PSUM tiles of at most {self.bank_bytes // 4} fp32 "
                    "elements per partition",
                location=loc, rule="psum-bank")
        for i, b in enumerate(self.banks):
            if b is None:
                self.banks[i] = (sid, desc)
                return i
        raise NKIMemoryError(
            f"PSUM is full: allocating {desc} needs a free bank but all {len(self.banks)} banks hold "
            f"live tiles ({', '.join(b[1] for b in self.banks if b)})",
            fix="reuse PSUM tiles or allocate them inside the loop that uses them so that at most "
                f"{len(self.banks)} are live at once",
            location=loc, rule="psum-capacity")

    def free(self, sid: int) -> None:
        for i, b in enumerate(self.banks):
            if b is not None and b[0] == sid:
                self.banks[i] = None


class Launch:
    """State shared by the programs of one launch (LNC grid): shared_hbm tensors, outputs."""

    def __init__(self, num_programs: int):
        self.num_programs = num_programs
        self.shared: list = []  # shared_hbm tensors in allocation order (aliased across programs)


class KernelContext:
    """Everything one program of a running kernel needs."""

    def __init__(self, platform, program_id: int, launch: Launch, numerics: bool = True,
                 seed: int = 0, kernel_file: str | None = None):
        self.platform = platform
        self.program_id = program_id
        self.launch = launch
        self.numerics = numerics
        self.kernel_file = kernel_file
        self.sbuf = SbufAllocator(platform.sbuf_usable_bytes_per_partition)
        self.psum = PsumAllocator(platform.psum_banks, platform.psum_bank_bytes)
        self.instructions: list[Instr] = []
        self.rng = np.random.default_rng(seed + program_id)
        self.accumulators: dict[str, np.ndarray] = {}
        self.shared_index = 0
        self._next_sid = 0
        self.active = True

    @property
    def num_programs(self) -> int:
        return self.launch.num_programs

    def new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid

    def track(self, owner: Any, sid: int, buffer: str) -> None:
        """Free ``sid`` from its allocator when ``owner`` is garbage-collected."""
        alloc = self.sbuf if buffer == "sbuf" else self.psum
        weakref.finalize(owner, alloc.free, sid)

    def emit(self, instr: Instr) -> None:
        self.instructions.append(instr)


def current() -> KernelContext:
    """The running kernel's context; raises if called outside a kernel."""
    ctx = getattr(_state, "ctx", None)
    if ctx is None or not ctx.active:
        raise NKITracingError(
            "nki.language / nki.isa calls must run inside a kernel launched with nki.jit, "
            "nki.simulate or nki.benchmark",
            fix="decorate the function with @nki.jit and call it, or run nki.simulate(kernel)(*args)",
            location=user_location())
    return ctx


def current_or_none() -> KernelContext | None:
    return getattr(_state, "ctx", None)


class activate:
    """Context manager installing ``ctx`` as the current kernel context."""

    def __init__(self, ctx: KernelContext):
        self.ctx = ctx

    def __enter__(self):
        self.prev = getattr(_state, "ctx", None)
        _state.ctx = self.ctx
        return self.ctx

    def __exit__(self, *exc):
        self.ctx.active = False
        _state.ctx = self.prev
        return False
