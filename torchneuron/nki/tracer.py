"""The kernel context: platform, allocators, the recorded instruction stream, source lines.

One :class:`KernelContext` exists per program (``nl.program_id``) while a kernel runs. Every
``nisa.*`` call (and every ``nl.*`` wrapper, through the ``nisa`` calls it makes) checks its
operands, appends an :class:`Instr` to ``ctx.instructions`` for the performance model and,
unless the context runs in timing-only mode, computes its result with numpy.

Memory accounting (:mod:`.memory`, documented in docs/nki.md): an SBUF/PSUM tile is live
from its allocation to the last instruction that accesses it; the ledger checks capacity over
those lifetimes when the program ends.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from dataclasses import dataclass

import numpy as np

from .errors import NKITracingError
from .launch import Launch  # noqa: F401  (re-exported: the simulator creates launches)
from .memory import MemoryLedger

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

    ``reads``/``writes`` are regions ``(dependency id, row0, row1, byte0, byte1, storage id)``:
    accesses to the same dependency id whose row and byte ranges overlap depend on each other
    (tiles placed at the same address share one); the storage id identifies the allocation
    (for lifetimes). ``cycles`` are engine cycles (compute engines) and ``nbytes`` the bytes
    moved (DMA). ``sync`` marks cross-core instructions (``core_barrier``, ``sendrecv``):
    ``(kind, sequence number, payload)`` -- the performance model starts them on every core
    at the same time.
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
    sync: tuple | None = None


class KernelContext:
    """Everything one program of a running kernel needs."""

    def __init__(self, platform, program_id: int, launch: Launch, numerics: bool = True,
                 seed: int = 0, kernel_file: str | None = None):
        self.platform = platform
        self.program_id = program_id
        self.launch = launch
        self.numerics = numerics
        self.kernel_file = kernel_file
        self.memory = MemoryLedger(platform)
        self.memory._ctx = self
        self.instructions: list[Instr] = []
        self.sync_seq = 0  # synchronising instructions executed (core_barrier, sendrecv...)
        self.rng = np.random.default_rng(seed + program_id)
        self.accumulators: dict[str, np.ndarray] = {}
        self.shared_index = 0
        # storage ids are unique across the launch: a shared_hbm tensor created by the other
        # program must not alias one of this program's tiles in the dependency tracking
        self._sids = launch.sids if launch is not None else itertools.count(1)
        self.active = True

    @property
    def num_programs(self) -> int:
        return self.launch.num_programs

    def new_sid(self) -> int:
        return next(self._sids)  # itertools.count: atomic under the GIL

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
