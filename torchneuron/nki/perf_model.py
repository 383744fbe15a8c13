"""Performance model: per-instruction cost formulas and per-engine queue scheduling.

Cost formulas (engine cycles, docs/nki.md and shared nki.md section 10; N = elements per
partition of the free dimension):

* ``nc_matmul``: ``max(min(64, M), N)`` with M the stationary free size and N the moving free
  size; x4 for fp32 inputs (x2 for fp32 in transpose mode). LoadStationary is overlapped.
* ``nc_transpose`` (TensorE): ``max(P, min(64, F))``.
* Vector/Scalar/GpSimd ``activation``, ``tensor_scalar``, ``tensor_copy``, ``memset``...:
  ``max(64, N)``; +64 when the activation also reduces.
* ``tensor_tensor``: ``max(64, N)`` when an input is in PSUM, else ``2N``; halved for 16-bit
  float data on NeuronCore-v3+.
* ``tensor_reduce``: ``N`` (``N/2`` for 16-bit add/max); ``reciprocal``: ``8N``;
  ``iota``/``affine_select`` (GpSimd): ``150 + N``.
* NeuronCore-v3+ VectorE: x4 (``lanes_16bit / 128``) for 16-bit ``tensor_copy``/
  ``tensor_scalar`` in SBUF, x2 with a PSUM operand. v4 ScalarE: x2 for 16-bit data.

Seconds = cycles / the engine clock of the platform (``torchneuron.platform``).

DMA: a transfer is split into ``min(dma_queues, bytes // 64 KiB)`` (at least one) equal
chunks; each chunk occupies one DMA queue for ``dma_fixed_cost_s + chunk_bytes /
dma_queue_bytes_per_ns``, taking the earliest gap on any queue at or after the moment its
data is ready (DMAs are triggered by their dependencies, so a store waiting for its data does
not block later loads) (bytes counted in descriptor units: each contiguous
run costs at least 64 bytes). Transfers that touch HBM also reserve
a per-core HBM channel for ``bytes / (hbm_bandwidth_per_chip / physical_cores_per_chip)``
(also the earliest free gap), so the aggregate of all queues never exceeds the core's share of
HBM bandwidth.

Scheduling: every engine (and DMA queue) executes its instructions in program order; an
instruction starts when its engine is free and every earlier instruction it depends on
(read-after-write, write-after-read, write-after-write on overlapping byte regions of the same
allocation) has finished. LNC=2 programs run on separate physical cores in parallel;
their cross-core instructions (core_barrier, sendrecv) start on both cores when the later of
the two is ready (a barrier costs 64 cycles of its engine; a sendrecv occupies a DMA queue of
each core for the fixed DMA cost + bytes / queue bandwidth).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from .tracer import Instr

COMPUTE_ENGINES = ("tensor", "vector", "scalar", "gpsimd")
DMA_SPLIT_BYTES = 64 * 1024  # a DMA is spread over up to dma_queues chunks of >= 64 KiB


# --------------------------------------------------------------------------------------------
# cost formulas (cycles)
# --------------------------------------------------------------------------------------------
def matmul_cycles(m: int, n: int, fp32: bool, transpose: bool = False) -> float:
    c = max(min(64, m), n)
    if fp32:
        c *= 2 if transpose else 4
    return float(c)


def transpose_cycles(p: int, f: int) -> float:
    return float(max(p, min(64, f)))


def vector_speedup(platform, sixteen_bit: bool, psum: bool, kind: str) -> float:
    """Throughput multiplier of NeuronCore-v3+ VectorE for 16-bit data."""
    wide = platform.vector.lanes_16bit // max(platform.pe_rows, 1)
    if not sixteen_bit or wide <= 1:
        return 1.0
    if kind in ("copy", "tensor_scalar"):
        return float(wide if not psum else 2)
    if kind == "tensor_tensor" and not psum:
        return 2.0
    return 1.0


def scalar_speedup(platform, sixteen_bit: bool) -> float:
    wide = platform.scalar.lanes_16bit // max(platform.pe_rows, 1)
    return float(wide) if sixteen_bit and wide > 1 else 1.0


def clock_of(platform, engine: str) -> float:
    if engine == "tensor":
        return platform.tensor_clock_hz
    return getattr(platform, engine).clock_hz


def hbm_bytes_per_s_per_core(platform) -> float:
    return platform.hbm_bandwidth_per_chip / platform.physical_cores_per_chip


def dma_cost_bytes(nbytes: int, run_bytes: int) -> float:
    """Bytes a DMA costs: small contiguous runs waste descriptor bandwidth (>= 64 B each)."""
    if run_bytes <= 0 or run_bytes >= 64:
        return float(nbytes)
    runs = nbytes / run_bytes
    return runs * 64.0


# --------------------------------------------------------------------------------------------
# scheduling
# --------------------------------------------------------------------------------------------
@dataclass
class Event:
    """A scheduled instruction (times in seconds)."""

    instr: Instr
    track: str  # engine name or "dma<q>"
    start: float
    end: float
    program: int = 0
    nbytes: int = 0  # DMA bytes carried by this event (one chunk of a split transfer)


def _overlaps(a: tuple, b: tuple) -> bool:
    return a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]


def _covers(a: tuple, b: tuple) -> bool:
    return a[1] <= b[1] and b[2] <= a[2] and a[3] <= b[3] and b[4] <= a[4]


class _Timeline:
    """Busy intervals of one resource (a DMA queue, the HBM channel), sorted and disjoint."""

    __slots__ = ("starts", "ends")

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def slot(self, ready: float, dur: float) -> float:
        """Earliest start >= ready of a free gap of length ``dur``."""
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(ends, ready)
        t = ready
        n = len(starts)
        while i < n and starts[i] < t + dur:
            if ends[i] > t:
                t = ends[i]
            i += 1
        return t

    def book(self, start: float, end: float) -> None:
        starts, ends = self.starts, self.ends
        i = bisect.bisect_right(starts, start)
        if i and ends[i - 1] >= start:  # touches the previous interval: extend it
            ends[i - 1] = max(ends[i - 1], end)
            i -= 1
        else:
            starts.insert(i, start)
            ends.insert(i, end)
        while i + 1 < len(starts) and starts[i + 1] <= ends[i]:  # swallow what it now reaches
            ends[i] = max(ends[i], ends.pop(i + 1))
            starts.pop(i + 1)


def schedule(instrs: list[Instr], platform, program: int = 0) -> list[Event]:
    """Schedule one program's instruction stream on one physical core (a cross-core
    instruction starts when this core is ready for it)."""
    events: list[Event] = []
    gen = _core(instrs, platform, program, events)
    try:
        req = next(gen)
        while True:
            req = gen.send(req[1])
    except StopIteration:
        pass
    return events


def schedule_programs(programs: list[list[Instr]], platform) -> list[Event]:
    """Schedule the programs of one launch on their physical cores, in parallel.

    Cross-core instructions (``core_barrier``, ``sendrecv``: ``Instr.sync``) are rendezvous:
    the k-th of every core starts when the last core is ready for it.
    """
    if len(programs) == 1:
        return schedule(programs[0], platform, 0)
    events: list[Event] = []
    gens = [_core(p, platform, pid, events) for pid, p in enumerate(programs)]
    pending: dict[int, tuple] = {}
    for pid, g in enumerate(gens):
        try:
            pending[pid] = next(g)
        except StopIteration:
            pass
    while pending:
        start = max(t for _, t in pending.values())
        nxt: dict[int, tuple] = {}
        for pid in list(pending):
            try:
                nxt[pid] = gens[pid].send(start)
            except StopIteration:
                pass
        pending = nxt
    return events


def _core(instrs: list[Instr], platform, program: int, events: list):
    """Generator scheduling one core; yields ``(instr, ready time)`` at each cross-core
    instruction and resumes with its start time."""
    free = {e: 0.0 for e in COMPUTE_ENGINES}
    nq = platform.dma_queues
    queues = [_Timeline() for _ in range(nq)]
    hbm = _Timeline()
    rr = 0
    hbm_bw = hbm_bytes_per_s_per_core(platform)
    q_bw = platform.dma_queue_bytes_per_ns * 1e9
    fixed = platform.dma_fixed_cost_s
    clocks = {e: clock_of(platform, e) for e in COMPUTE_ENGINES}
    writes: dict[int, list] = {}  # sid -> [(region, end)]
    reads: dict[int, list] = {}
    for ins in instrs:
        ready = 0.0
        for r in ins.reads:
            for w, end in writes.get(r[0], ()):
                if end > ready and _overlaps(r, w):
                    ready = end
        for r in ins.writes:
            sid = r[0]
            for w, end in writes.get(sid, ()):
                if end > ready and _overlaps(r, w):
                    ready = end
            for w, end in reads.get(sid, ()):
                if end > ready and _overlaps(r, w):
                    ready = end
        if ins.sync is not None:
            # Cross-core: starts on every core at once (the coordinator's time).
            if ins.engine == "dma":
                # the queue with the earliest gap that holds the whole transfer
                dur = fixed + ins.nbytes / q_bw
                q = min(range(nq), key=lambda j: queues[j].slot(ready, dur))
                local = queues[q].slot(ready, dur)
            else:
                local = max(free[ins.engine], ready)
                dur = ins.cycles / clocks[ins.engine]
            t0 = yield (ins, local)
            end = t0 + dur
            if ins.engine == "dma":
                queues[q].book(t0, end)
                events.append(Event(ins, f"dma{q}", t0, end, program, ins.nbytes))
            else:
                free[ins.engine] = end
                events.append(Event(ins, ins.engine, t0, end, program))
        elif ins.engine == "dma":
            # Large transfers are split across queues (as the compiler spreads descriptors over
            # DMA rings); each chunk pays the fixed cost on its own queue.
            # A DMA is triggered when its inputs are ready, so a transfer waiting for data does
            # not hold up later, independent transfers: chunks take the earliest free gap.
            chunks = max(1, min(nq, ins.nbytes // DMA_SPLIT_BYTES))
            cb = ins.nbytes / chunks
            hb = ins.hbm_bytes / chunks
            dq = fixed + cb / q_bw
            dh = hb / hbm_bw
            end = 0.0
            for _ in range(chunks):
                best_t, best_q = None, 0
                for j in range(nq):
                    q = (rr + j) % nq
                    t = queues[q].slot(ready, dq)
                    if best_t is None or t < best_t:
                        best_t, best_q = t, q
                        if t <= ready:
                            break
                rr = (best_q + 1) % nq
                t0 = best_t
                cend = t0 + dq
                if dh:
                    hs = hbm.slot(t0 + fixed, dh)
                    hbm.book(hs, hs + dh)
                    cend = max(cend, hs + dh)
                queues[best_q].book(t0, cend)
                events.append(Event(ins, f"dma{best_q}", t0, cend, program, int(cb)))
                end = max(end, cend)
        else:
            t0 = max(free[ins.engine], ready)
            end = t0 + ins.cycles / clocks[ins.engine]
            free[ins.engine] = end
            events.append(Event(ins, ins.engine, t0, end, program))
        for r in ins.reads:
            reads.setdefault(r[0], []).append((r, end))
        for r in ins.writes:
            sid = r[0]
            # A covering write finishes after everything it waited for, so older records inside
            # its region can never be the binding dependency again: drop them.
            wl = writes.get(sid)
            if wl:
                writes[sid] = [x for x in wl if not _covers(r, x[0])]
            rl = reads.get(sid)
            if rl:
                reads[sid] = [x for x in rl if not _covers(r, x[0])]
            writes.setdefault(sid, []).append((r, end))


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


@dataclass
class BenchmarkResult:
    """Modelled performance of one kernel launch (plus its simulated outputs).

    ``latency_us``: modelled end-to-end time; ``engine_busy_us``: busy time per engine (``dma``
    is the time at least one DMA queue is active; ``dma_queue_avg`` the mean per-queue busy
    time); ``mfu``: TensorE FLOPs / (latency x peak FLOP/s of the matmul dtype x cores);
    ``dma_bytes``: bytes moved by DMAs; ``instructions``: instruction count;
    ``sbuf_peak_bytes``: peak live SBUF bytes per partition; ``outputs``: simulated outputs.
    """

    platform: str
    latency_us: float
    engine_busy_us: dict
    mfu: float
    flops: float
    dma_bytes: int
    instructions: int
    num_programs: int
    matmul_dtype: str
    outputs: Any = None
    sbuf_peak_bytes: int = 0  # peak live SBUF bytes per partition (max over programs)
    events: list = field(default_factory=list, repr=False)

    def save_trace(self, path: str) -> str:
        """Write a Chrome/Perfetto trace (one track per engine and DMA queue); returns ``path``."""
        from .trace_export import write_chrome_trace
        return write_chrome_trace(self.events, path, self.platform)

    def summary(self) -> str:
        busy = ", ".join(f"{k} {v:.1f}" for k, v in self.engine_busy_us.items())
        return (f"{self.platform}: latency {self.latency_us:.2f} us, MFU {self.mfu * 100:.1f}% "
                f"({self.matmul_dtype or 'no matmul'}), {self.instructions} instructions, "
                f"{self.dma_bytes / 1e6:.2f} MB DMA; busy us: {busy}")


def analyze(programs: list[list[Instr]], platform, outputs: Any = None,
            sbuf_peak: int = 0) -> BenchmarkResult:
    """Schedule every program and summarise into a :class:`BenchmarkResult`."""
    events = schedule_programs(programs, platform)
    latency = max((e.end for e in events), default=0.0)
    busy: dict[str, float] = {e: 0.0 for e in COMPUTE_ENGINES}
    dma_iv: list = []
    dma_sum = 0.0
    flops = 0.0
    by_dtype: dict[str, float] = {}
    dma_bytes = 0
    for ev in events:
        d = ev.end - ev.start
        if ev.track.startswith("dma"):
            dma_iv.append((ev.start + ev.program * 1e3, ev.end + ev.program * 1e3))
            dma_sum += d
            dma_bytes += ev.nbytes
        else:
            busy[ev.track] += d
        if ev.instr.flops:
            flops += ev.instr.flops
            by_dtype[ev.instr.dtype] = by_dtype.get(ev.instr.dtype, 0.0) + ev.instr.flops
    nprog = max(len(programs), 1)
    busy = {k: v / nprog * 1e6 for k, v in busy.items()}
    busy["dma"] = union_length(dma_iv) / nprog * 1e6
    busy["dma_queue_avg"] = dma_sum / (platform.dma_queues * nprog) * 1e6
    mm_dtype = max(by_dtype, key=by_dtype.get) if by_dtype else ""
    peak = platform.peak_flops(mm_dtype) if mm_dtype else 0.0
    mfu = flops / (latency * peak * nprog) if latency > 0 and peak > 0 else 0.0
    return BenchmarkResult(platform.name, latency * 1e6, busy, mfu, flops, dma_bytes,
                           sum(len(p) for p in programs), nprog, mm_dtype, outputs, sbuf_peak,
                           events)
