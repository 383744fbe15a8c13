"""One kernel launch: its programs (logical cores), what they share, and how they synchronise.

``kernel[2](...)`` runs two programs -- the two physical NeuronCores of a logical core --
concurrently, one thread each, with per-core SBUF/PSUM and instruction streams and shared
``shared_hbm`` tensors. Cross-core instructions (``nisa.core_barrier``, ``nisa.sendrecv``)
are rendezvous: the i-th synchronising instruction of every program meets the i-th of the
others, exchanges data and checks they agree (same instruction, compatible arguments).
A program that finishes, fails or reaches a different synchronising instruction while
another waits makes the waiting program fail with an error naming both sides (no hangs).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from .errors import NKIArgumentError, NKIShapeError, NKITracingError


class Aborted(Exception):
    """Raised in a program whose launch failed in another program (not reported)."""


class Launch:
    """State shared by the programs of one launch (LNC grid)."""

    def __init__(self, num_programs: int, grid_ndim: int = 1):
        self.num_programs = num_programs
        self.grid_ndim = grid_ndim  # 0 for kernel(...), 1 for kernel[lnc](...)
        self.cond = threading.Condition()
        self.sids = itertools.count(1)  # storage ids, unique across the programs
        self.shared: dict[int, Any] = {}  # k-th shared_hbm allocation -> Storage
        self.failed: BaseException | None = None
        self.done: set[int] = set()
        self._meet: dict[int, dict] = {}  # sync sequence number -> {pid: (what, loc, payload)}
        self._results: dict[int, dict] = {}

    # -- shared_hbm ---------------------------------------------------------------------------
    def shared_tensor(self, ctx, shape, dtype, desc, loc, make: Callable):
        """The ``ctx.shared_index``-th shared_hbm tensor of this launch (created by the first
        program to get there)."""
        from .tensor import NkiTensor, describe, shared_hbm
        idx = ctx.shared_index
        ctx.shared_index += 1
        with self.cond:
            st = self.shared.get(idx)
            if st is None:
                st = self.shared[idx] = make()
                st.loc = loc
                return NkiTensor(st, st.array, dtype)
        if st.array.shape != shape or st.dtype != dtype:
            raise NKIShapeError(
                f"shared_hbm allocation #{idx} is {desc} in program {ctx.program_id} but "
                f"{describe(st.array.shape, st.dtype, shared_hbm)} in the other program "
                f"(allocated at {st.loc})",
                fix="allocate the same shared_hbm tensors, in the same order, in every program",
                location=loc)
        return NkiTensor(st, st.array, dtype)

    # -- lifecycle ----------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = exc
            self.cond.notify_all()

    def finished(self, pid: int) -> None:
        with self.cond:
            self.done.add(pid)
            self.cond.notify_all()

    # -- rendezvous ---------------------------------------------------------------------------
    def meet(self, ctx, what: str, loc: str | None, payload: Any,
             agree: Callable[[dict], str | None] | None = None) -> dict:
        """Wait until every program reaches its ``ctx.sync_seq``-th synchronising instruction.

        ``what`` names the instruction (``core_barrier``, ``sendrecv pipe 0``...); every
        program must reach the same ``what``. Returns {program id: payload}. ``agree`` may
        return an error message when the payloads are incompatible.
        """
        seq = ctx.sync_seq
        ctx.sync_seq += 1
        pid = ctx.program_id
        n = self.num_programs
        with self.cond:
            slot = self._meet.setdefault(seq, {})
            slot[pid] = (what, loc, payload)
            if len(slot) == n:
                whats = {p: w for p, (w, _, _) in slot.items()}
                if len(set(whats.values())) > 1:
                    msg = "; ".join(f"program {p} reached {w} at {slot[p][1]}"
                                    for p, w in sorted(whats.items()))
                    err = NKITracingError(
                        f"the programs' synchronising instructions differ at #{seq}: {msg}",
                        fix="make every program execute the same sequence of core_barrier / "
                            "sendrecv / collective instructions", location=loc,
                        rule="lnc-sync")
                    self.failed = self.failed or err
                    self.cond.notify_all()
                    raise err
                payloads = {p: pl for p, (_, _, pl) in slot.items()}
                msg = agree(payloads) if agree is not None else None
                if msg:
                    err = NKIArgumentError(f"{what}: {msg}", fix="pass matching arguments on "
                                           "every core", location=loc, rule="lnc-sync")
                    self.failed = self.failed or err
                    self.cond.notify_all()
                    raise err
                self._results[seq] = payloads
                del self._meet[seq]
                self.cond.notify_all()
                return payloads
            while True:
                res = self._results.get(seq)
                if res is not None and pid in res:
                    # every program reads its result once; drop it after the last reader
                    out = res
                    res_readers = self._results.setdefault(("read", seq), set())
                    res_readers.add(pid)
                    if len(res_readers) == n - 1:
                        self._results.pop(seq, None)
                        self._results.pop(("read", seq), None)
                    return out
                if self.failed is not None:
                    raise Aborted()
                missing = [p for p in range(n) if p not in slot and p in self.done]
                if missing:
                    err = NKITracingError(
                        f"program {pid} waits at {what} (synchronising instruction #{seq}) but "
                        f"program {missing[0]} finished without reaching it",
                        fix="make every program execute the same sequence of core_barrier / "
                            "sendrecv / collective instructions", location=loc, rule="lnc-sync")
                    self.failed = err
                    self.cond.notify_all()
                    raise err
                self.cond.wait(timeout=1.0)
