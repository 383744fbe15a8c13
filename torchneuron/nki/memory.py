"""On-chip memory of one NeuronCore: tile placement and capacity accounting by lifetime.

Two kinds of SBUF/PSUM tiles exist:

* **auto-allocated** (``nl.ndarray(...)`` without ``address``): storage of their own; the
  compiler's allocator would place them.
* **placed** (``nl.ndarray(..., address=(partition, byte))``): views of this core's SBUF or
  PSUM byte array at that address. Tiles placed at the same address share storage (AWS's
  kernels rotate buffers this way). A placement that overlaps a tile placed at a *different*
  address takes those bytes: the older tile may not be used afterwards (``[placement]`` error
  at its next use, naming both tiles).

Capacity is accounted by **lifetime**, not by Python object lifetime: a tile is live from its
allocation to the last instruction that accesses it. At the end of each program the ledger
sweeps the instruction stream; at every allocation it checks

* SBUF: live auto-allocated bytes per partition + the highest byte used by live placed tiles
  <= the platform's usable bytes per partition (auto tiles are assumed to go above the placed
  ones);
* PSUM: banks of live auto-allocated tiles (each starts at a bank boundary and occupies
  ``ceil(bytes / 2 KiB)`` banks) + the banks live placed tiles touch <= 8.

Violations raise :class:`NKIMemoryError` naming the allocation where the limit was crossed,
the live tiles with their source lines and a fix.
"""

from __future__ import annotations

import bisect
import math
import weakref
import numpy as np

from . import dtypes as dt
from .errors import NKIArgumentError, NKIMemoryError, NKIPartitionError


class _Record:
    """One SBUF/PSUM allocation: bytes per partition, stream position, placement."""

    __slots__ = ("sid", "buffer", "nbytes", "index", "desc", "loc", "address", "p1")

    def __init__(self, sid, buffer, nbytes, index, desc, loc, address=None, p1=0):
        self.sid = sid
        self.buffer = buffer  # "sbuf" or "psum"
        self.nbytes = nbytes  # bytes per partition
        self.index = index  # instruction-stream position at allocation
        self.desc = desc
        self.loc = loc
        self.address = address  # placed: (partition, byte)
        self.p1 = p1  # placed: partition range end


class MemoryLedger:
    """Allocation records, placement bookkeeping and the end-of-program capacity sweep."""

    def __init__(self, platform):
        self.platform = platform
        self.records: list[_Record] = []
        self._peak_sbuf = None  # bytes per partition (computed by the sweep, lazily)
        self.peak_psum_banks = 0
        self._instructions = None
        self._backing: dict = {}  # "sbuf"/"psum" -> (uint8 array, written flags or None)
        self._placed: dict = {"sbuf": [], "psum": []}  # live placements (not clobbered)
        self._dep_ids: dict = {}  # (buffer, partition, byte) -> dep_sid shared by aliases
        self._ctx = None

    # -- recording ----------------------------------------------------------------------------
    def record(self, st, nbytes: int, desc: str, loc: str | None) -> None:
        """Note an auto-allocated SBUF/PSUM tile."""
        self.records.append(_Record(st.sid, st.buffer.name, nbytes, len(self._ctx.instructions),
                                    desc, loc))

    def _backing_of(self, buffer: str):
        b = self._backing.get(buffer)
        if b is None:
            plat = self.platform
            cols = plat.sbuf_usable_bytes_per_partition if buffer == "sbuf" else \
                plat.psum_bytes_per_partition
            # np.empty maps pages lazily: untouched SBUF costs no host memory
            data = np.empty((plat.sbuf_partitions, cols), np.uint8)
            b = self._backing[buffer] = (data, None)
        return b

    def place(self, ctx, shape: tuple, dtype, buffer, name, address, desc: str, loc):
        """A tile at ``address=(partition, byte)`` of this core's SBUF/PSUM (a view of it)."""
        from .tensor import Storage
        plat = self.platform
        try:
            p0, b0 = (int(a) for a in address)
        except (TypeError, ValueError):
            raise NKIArgumentError(f"address={address!r} for {desc} must be a (partition, byte) "
                                   "pair", fix="e.g. address=(0, 4096)", location=loc,
                                   rule="placement") from None
        bname = buffer.name
        nbytes = math.prod(shape[1:]) * dtype.itemsize
        cols = plat.sbuf_usable_bytes_per_partition if bname == "sbuf" else \
            plat.psum_bytes_per_partition
        if p0 < 0 or p0 + shape[0] > plat.sbuf_partitions:
            raise NKIPartitionError(
                f"{desc} placed at partition {p0} would use partitions {p0}..{p0 + shape[0] - 1}; "
                f"{bname.upper()} has {plat.sbuf_partitions}", location=loc, rule="placement",
                fix=f"place it at a partition <= {plat.sbuf_partitions - shape[0]}")
        if b0 < 0 or b0 + nbytes > cols:
            raise NKIMemoryError(
                f"{desc} placed at byte {b0} needs bytes {b0}..{b0 + nbytes - 1} of each partition "
                f"but {bname.upper()} has {cols} usable bytes per partition", location=loc,
                rule="placement", fix="lower the address or use a smaller tile")
        if b0 % dtype.itemsize:
            raise NKIArgumentError(
                f"{desc} placed at byte {b0}, which is not a multiple of its element size "
                f"{dtype.itemsize}", fix="align the address to the element size", location=loc,
                rule="placement")
        data, _ = self._backing_of(bname)
        raw = data[p0:p0 + shape[0], b0:b0 + nbytes]
        arr = raw.view(dt.storage(dtype)).reshape(shape)
        arr.fill(dt.sentinel(dtype))
        sid = ctx.new_sid()
        st = Storage(sid, buffer, arr, dtype, name or f"t{sid}")
        st.row_bytes = data.strides[0]
        st.base_ptr = raw.__array_interface__["data"][0]
        st.root = data
        st.p0 = p0
        st.address = (p0, b0)
        st.loc = loc
        key = (bname, p0, b0)
        dep = self._dep_ids.get(key)
        if dep is None:
            dep = self._dep_ids[key] = ctx.new_sid()
        st.dep_sid = dep
        if bname == "psum":
            # accumulate=None flags belong to the allocation (a new tile at a reused address
            # starts a new accumulation group)
            st.written = np.zeros((shape[0], nbytes // dtype.itemsize), bool)
        self._claim(bname, st, p0, p0 + shape[0], b0, b0 + nbytes, desc, loc)
        self.records.append(_Record(sid, bname, nbytes, len(ctx.instructions), desc, loc,
                                    (p0, b0), p0 + shape[0]))
        return st

    def _claim(self, bname, st, p0, p1, b0, b1, desc, loc) -> None:
        """Register a placement; tiles it overlaps at another address lose their bytes."""
        live = self._placed[bname]
        keep = []
        for entry in live:
            ref, q0, q1, c0, c1 = entry
            old = ref()
            if old is None:
                continue
            if q0 < p1 and p0 < q1 and c0 < b1 and b0 < c1 and old.address != (p0, b0):
                old.clobbered = (desc, loc, (p0, b0))
                continue
            keep.append(entry)
        keep.append((weakref.ref(st), p0, p1, b0, b1))
        self._placed[bname] = keep

    # -- end of program -----------------------------------------------------------------------
    def finish(self, instructions: list) -> None:
        """Check SBUF/PSUM capacity over the tiles' lifetimes.

        Fast path: when every tile ever allocated fits at once (all auto tiles together, above
        every placement), no instant can exceed capacity and the sweep is skipped until a peak
        is asked for (:attr:`peak_sbuf`)."""
        self._instructions = instructions
        if not self.records:
            self._peak_sbuf = 0
            return
        plat = self.platform
        sb_auto = sb_top = ps_banks = 0
        bank = plat.psum_bank_bytes
        for r in self.records:
            if r.buffer == "sbuf":
                if r.address is None:
                    sb_auto += r.nbytes
                else:
                    sb_top = max(sb_top, r.address[1] + r.nbytes)
            else:
                ps_banks += max(1, -(-r.nbytes // bank))
        if sb_auto + sb_top <= plat.sbuf_usable_bytes_per_partition and ps_banks <= plat.psum_banks:
            return
        self._sweep(instructions)

    @property
    def peak_sbuf(self) -> int:
        """Peak live SBUF bytes per partition (tile lifetimes; the sweep runs on demand)."""
        if self._peak_sbuf is None:
            self._sweep(self._instructions or [])
        return self._peak_sbuf

    def _sweep(self, instructions: list) -> None:
        last: dict[int, int] = {}
        for i, ins in enumerate(instructions):
            for r in ins.reads:
                last[r[5]] = i
            for r in ins.writes:
                last[r[5]] = i
        plat = self.platform
        self._peak_sbuf = 0
        self._sweep_sbuf([r for r in self.records if r.buffer == "sbuf"], last,
                         plat.sbuf_usable_bytes_per_partition)
        self._sweep_psum([r for r in self.records if r.buffer == "psum"], last,
                         plat.psum_banks, plat.psum_bank_bytes)

    @staticmethod
    def _events(records, last):
        """(key, kind, record) in time order; kind 1 = allocation, 0 = end of life.

        A tile allocated before instruction i and last used by instruction L lives until just
        before the allocations made before instruction L + 1; a tile never used dies right
        after its own allocation."""
        ev = []
        for seq, r in enumerate(records):
            ev.append(((r.index, 1, seq), 1, r))
            end = last.get(r.sid)
            if end is None or end < r.index:
                ev.append(((r.index, 1, seq + 0.5), 0, r))
            else:
                ev.append(((end + 1, 0, seq), 0, r))
        ev.sort(key=lambda e: e[0])
        return ev

    def _sweep_sbuf(self, records, last, capacity: int) -> None:
        auto = 0
        ends: list[int] = []  # sorted byte ends of live placed tiles
        live: dict[int, _Record] = {}
        peak = 0
        for _, kind, r in self._events(records, last):
            if kind == 0:
                live.pop(r.sid, None)
                if r.address is None:
                    auto -= r.nbytes
                else:
                    del ends[bisect.bisect_left(ends, r.address[1] + r.nbytes)]
                continue
            live[r.sid] = r
            if r.address is None:
                auto += r.nbytes
            else:
                bisect.insort(ends, r.address[1] + r.nbytes)
            used = auto + (ends[-1] if ends else 0)
            peak = max(peak, used)
            if used > capacity:
                biggest = sorted(live.values(), key=lambda x: -x.nbytes)[:4]
                listing = "; ".join(f"{x.desc} from {x.loc or '?'}" for x in biggest)
                placed = ends[-1] if ends else 0
                raise NKIMemoryError(
                    f"SBUF capacity exceeded: allocating {r.desc} needs {r.nbytes} bytes per "
                    f"partition, making {used} bytes per partition live ({auto} in auto-allocated "
                    f"tiles, {placed} up to the highest placed byte) of {capacity}; largest live "
                    f"tiles (a tile is live until its last use): {listing}",
                    fix="use smaller tiles, or finish with tiles (their last use) before allocating "
                        "new ones", location=r.loc, rule="sbuf-capacity")
        self._peak_sbuf = max(self._peak_sbuf or 0, peak)

    def _sweep_psum(self, records, last, banks: int, bank_bytes: int) -> None:
        auto_banks = 0
        placed: dict[int, int] = {}  # bank -> live placed tiles touching it
        live: dict[int, _Record] = {}
        peak = 0
        for _, kind, r in self._events(records, last):
            if r.address is None:
                n = max(1, -(-r.nbytes // bank_bytes))
                span = ()
            else:
                b0 = r.address[1]
                span = range(b0 // bank_bytes, (b0 + max(r.nbytes, 1) - 1) // bank_bytes + 1)
            if kind == 0:
                live.pop(r.sid, None)
                if r.address is None:
                    auto_banks -= n
                for b in span:
                    placed[b] -= 1
                    if not placed[b]:
                        del placed[b]
                continue
            live[r.sid] = r
            if r.address is None:
                auto_banks += n
            for b in span:
                placed[b] = placed.get(b, 0) + 1
            used = auto_banks + len(placed)
            peak = max(peak, used)
            if used > banks:
                listing = "; ".join(f"{x.desc} from {x.loc or '?'}" for x in live.values())
                raise NKIMemoryError(
                    f"PSUM is full: allocating {r.desc} makes {used} banks live but PSUM has "
                    f"{banks} banks of {bank_bytes} bytes per partition (each auto-allocated tile "
                    f"starts at a bank boundary; a tile is live until its last use): {listing}",
                    fix=f"finish with PSUM tiles (copy results out) before allocating new ones so "
                        f"that at most {banks} banks are live, or place them with address=",
                    location=r.loc, rule="psum-capacity")
        self.peak_psum_banks = max(self.peak_psum_banks, peak)
