"""An independent Python model of the neuron caching allocator, and a driver that replays a
random sequence of operations on the real allocator and on the model, comparing every
``memory_stats`` counter after each step.

The model is written from the allocator's documented rules (docs/architecture.md, "Memory"),
not from its code: size classes, small/large pools and their segment sizes, best-fit reuse per
stream, splitting, coalescing, ``empty_cache``, retry-then-OOM at the device capacity, the
``c10::CachingDeviceAllocator::DeviceStats`` counter semantics (current / peak / allocated /
freed), and stream-ordered reuse: a block freed after ``record_stream`` on other streams stops
being *allocated* at once but stays *active* and unusable until the host has observed each of
those streams past the free (a stream / device / event synchronize, a true ``query``, a
blocking copy to the host); pending blocks are returned at the next allocation on their device,
and synchronized and returned before ``empty_cache`` or the OOM retry releases memory. Only the segment base addresses come from the real allocator (through
``memory_snapshot``), because the best-fit tie-break between equal blocks is by address.

With ``expandable=True`` the process runs with ``PYTORCH_ALLOC_CONF=expandable_segments:True``
and the model follows the expandable-segment rules (docs/architecture.md): one segment per stream
and pool reserving address space for 9/8 of the capacity, mapped in chunks (2 MiB small, 20 MiB
large) at the lowest address where free and unmapped space fit a request; any remainder split
off; mapped bytes in reserved_bytes but no segment counted; free blocks there are never inactive
splits; empty_cache / the OOM retry unmap their whole free chunks (a segment left without pages
is dropped here; the allocator keeps its address space reserved, which no counter shows, and
regrows it at the same base, which is the address the model then reads). The sequence also switches the setting off and on at run time (ordinary
segments then serve requests; expandable ones keep their memory until released).

Run as a script (``python allocator_model.py SEED STEPS [expandable]``) in a process whose devices are small
(``TORCHNEURON_DEVICE_MEMORY``) so that OOMs are reachable; it exits non-zero on the first
mismatch, printing the step and the differing counters.
"""

from __future__ import annotations

import gc
import random
import sys

KiB, MiB = 1 << 10, 1 << 20
MIN_BLOCK = 256
SMALL_SIZE = 1 * MiB          # requests up to this go to the small pool
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB      # segment for requests in (1 MiB, 10 MiB)
MIN_LARGE_ALLOC = 10 * MiB    # from here the segment is the request rounded to 2 MiB
ROUND_LARGE = 2 * MiB
SIZE_CLASS_LIMIT = 16 * MiB

STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
         "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "small_pool", "large_pool")
FIELDS = ("current", "peak", "allocated", "freed")
UNSEEN = 1 << 62  # placeholder addresses from here
COUNTERS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")


def round_size(n: int) -> int:
    """Size class of a request: >= 256 B; four classes per power of two below 16 MiB; else 512 B."""
    if n < MIN_BLOCK:
        return MIN_BLOCK
    if n >= SIZE_CLASS_LIMIT:
        return -(-n // 512) * 512
    pow2 = 1 << (n.bit_length() - 1)
    if pow2 == n:
        return n
    step = pow2 // 4
    return -(-n // step) * step


def segment_size(rounded: int) -> int:
    if rounded <= SMALL_SIZE:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


class Stat:
    __slots__ = FIELDS

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, delta: int) -> None:
        if delta >= 0:
            self.current += delta
            self.peak = max(self.peak, self.current)
            self.allocated += delta
        else:
            self.current += delta
            self.freed -= delta


class Block:
    def __init__(self, seg: "Segment", offset: int, size: int, mapped: bool = True) -> None:
        self.seg, self.offset, self.size = seg, offset, size
        self.mapped = mapped  # False: unmapped address space of an expandable segment
        self.allocated = False
        self.requested = 0
        self.pending: set[int] | None = None  # streams still to be observed after the free

    @property
    def busy(self) -> bool:
        """Allocated, or freed but waiting for other streams: neither reusable nor mergeable."""
        return self.allocated or self.pending is not None

    @property
    def free(self) -> bool:
        """In the free pool: mapped and not busy."""
        return self.mapped and not self.busy

    @property
    def address(self) -> int:
        return self.seg.address + self.offset


class Segment:
    def __init__(self, address: int, size: int, stream: int, large: bool, chunk: int = 0) -> None:
        self.address, self.size, self.stream, self.large = address, size, stream, large
        self.chunk = chunk  # expandable segments: the mapping granularity (0: an ordinary one)
        self.blocks = [Block(self, 0, size, mapped=not chunk)]

    def split(self) -> bool:
        return len(self.blocks) > 1

    @property
    def expandable(self) -> bool:
        return self.chunk > 0

    def mapped_bytes(self) -> int:
        return sum(b.size for b in self.blocks if b.mapped)

    def neighbours(self, b: Block) -> tuple[Block | None, Block | None]:
        i = self.blocks.index(b)
        return (self.blocks[i - 1] if i > 0 else None,
                self.blocks[i + 1] if i + 1 < len(self.blocks) else None)


class OutOfMemory(Exception):
    pass


class DeviceModel:
    """One device's cache and stats."""

    def __init__(self, capacity: int, expandable: bool = False) -> None:
        self.capacity = capacity
        self.expandable = expandable  # the expandable_segments setting, now
        self.segments: list[Segment] = []
        self.stats = {(s, p): Stat() for s in STATS for p in POOLS}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.pending_order: list[Block] = []

    # -- stats ---------------------------------------------------------------------------
    def _add(self, stat: str, large: bool, delta: int) -> None:
        self.stats[(stat, "all")].add(delta)
        self.stats[(stat, "large_pool" if large else "small_pool")].add(delta)

    def _free_block_counts(self, b: Block, sign: int) -> None:
        """A free block counts as an inactive split when its segment holds other blocks."""
        if b.seg.split() and not b.seg.expandable:
            self._add("inactive_split", b.seg.large, sign)
            self._add("inactive_split_bytes", b.seg.large, sign * b.size)

    def used(self) -> int:
        return sum(s.mapped_bytes() for s in self.segments)

    # -- operations ----------------------------------------------------------------------
    @staticmethod
    def _growable(b: Block) -> int:
        """A free block's size plus the unmapped space right after it."""
        _, nxt = b.seg.neighbours(b)
        return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _best_fit(self, size: int, large: bool, stream: int) -> Block | None:
        cands = sorted((b for s in self.segments if s.large == large and s.stream == stream
                        for b in s.blocks if b.free and b.size >= size),
                       key=lambda b: (b.size, b.address))
        if not self.expandable:
            return next((b for b in cands if not b.seg.expandable), None)
        # The smallest that fits; but one that can grow yields to the next if that can grow
        # less (or not at all).
        i = 0
        while (i + 1 < len(cands) and cands[i].seg.expandable
               and self._growable(cands[i + 1]) < self._growable(cands[i])):
            i += 1
        return cands[i] if cands else None

    def _merge_into(self, b: Block, n: Block | None, mapped: bool) -> None:
        """Absorb neighbour ``n`` of ``b`` if it is free (mapped) or unmapped, as ``b`` is."""
        if n is None or n.mapped != mapped or (mapped and n.busy):
            return
        if mapped:
            self._free_block_counts(n, -1)
        b.seg.blocks.remove(n)
        b.offset = min(b.offset, n.offset)
        b.size += n.size

    def _map(self, b: Block, n: int) -> Block | None:
        """Map the first ``n`` bytes (in chunks) of unmapped ``b``; None past the capacity."""
        seg = b.seg
        length = min(-(-n // seg.chunk) * seg.chunk, b.size)
        if self.used() + length > self.capacity:
            return None
        if seg.address >= UNSEEN:  # its address shows once it has pages
            seg.address = self.find_address(seg.size)
        if length < b.size:
            seg.blocks.insert(seg.blocks.index(b) + 1,
                              Block(seg, b.offset + length, b.size - length, mapped=False))
            b.size = length
        b.mapped = True
        self._add("reserved_bytes", seg.large, length)
        self.counters["num_device_alloc"] += 1
        for n_ in seg.neighbours(b):
            self._merge_into(b, n_, mapped=True)
        return b

    def _alloc_expandable(self, size: int, large: bool, stream: int, new_segment_address) -> Block | None:
        start = None
        unmapped = sorted((b for s in self.segments if s.expandable and s.large == large
                           and s.stream == stream for b in s.blocks if not b.mapped),
                          key=lambda b: b.address)
        for u in unmapped:
            prev, _ = u.seg.neighbours(u)
            cand = prev if prev is not None and not prev.busy else u
            blocks = u.seg.blocks[u.seg.blocks.index(cand):]
            room = 0
            for b in blocks:
                if room >= size or b.busy:
                    break
                room += b.size
            if room >= size:
                start = cand
                break
        if start is None:
            chunk = LARGE_SEGMENT if large else SMALL_SEGMENT
            span = -(-(self.capacity + self.capacity // 8) // chunk) * chunk
            self.find_address = new_segment_address
            seg = Segment(new_segment_address(span), span, stream, large, chunk)
            self.segments.append(seg)
            start = seg.blocks[0]
        b = start if start.mapped else self._map(start, min(start.size, size))
        while b is not None and b.size < size:
            _, nxt = b.seg.neighbours(b)
            b = self._map(nxt, min(size - b.size, nxt.size))
        return b

    def _unmap(self, b: Block) -> None:
        """Unmap the whole chunks inside free block ``b`` of an expandable segment."""
        seg, c = b.seg, b.seg.chunk
        begin, end = -(-b.offset // c) * c, (b.offset + b.size) // c * c
        if begin >= end:
            return
        i = seg.blocks.index(b)
        pieces = []
        if begin > b.offset:
            pieces.append(Block(seg, b.offset, begin - b.offset))
        middle = Block(seg, begin, end - begin, mapped=False)
        pieces.append(middle)
        if b.offset + b.size > end:
            pieces.append(Block(seg, end, b.offset + b.size - end))
        seg.blocks[i:i + 1] = pieces
        for n in seg.neighbours(middle):
            self._merge_into(middle, n, mapped=False)
        self._add("reserved_bytes", seg.large, -(end - begin))
        self.counters["num_device_free"] += 1

    def release_cached(self) -> None:
        for seg in [s for s in self.segments if s.expandable]:
            for b in [b for b in seg.blocks if b.free]:
                self._unmap(b)
            if len(seg.blocks) == 1:  # no pages left: the address space goes back
                self.segments.remove(seg)
        for s in [s for s in self.segments
                  if not s.expandable and not s.split() and not s.blocks[0].busy]:
            self.segments.remove(s)
            self._add("reserved_bytes", s.large, -s.size)
            self._add("segment", s.large, -1)
            self.counters["num_device_free"] += 1

    def pending_blocks(self) -> list[Block]:
        """Blocks waiting for other streams, in the order they were freed: completions (and so
        merges and the fragmentation counters) happen in that order, as CUDA's event queue."""
        return list(self.pending_order)

    def observe(self, stream: int) -> None:
        """The host saw ``stream`` reach the present: frees before now no longer wait for it."""
        for b in self.pending_blocks():
            b.pending.discard(stream)

    def process_events(self, sync: bool = False) -> None:
        for b in self.pending_blocks():
            if sync or not b.pending:
                self._complete_free(b)

    def malloc(self, nbytes: int, stream: int, new_segment_address) -> Block:
        self.process_events()
        size = round_size(nbytes)
        large = size > SMALL_SIZE
        block = self._best_fit(size, large, stream)
        if block is not None:
            self._free_block_counts(block, -1)
        elif self.expandable:
            block = self._alloc_expandable(size, large, stream, new_segment_address)
            if block is None:
                self.counters["num_alloc_retries"] += 1
                self.process_events(sync=True)
                self.release_cached()
                block = self._alloc_expandable(size, large, stream, new_segment_address)
                if block is None:
                    self.counters["num_ooms"] += 1
                    raise OutOfMemory(nbytes)
        else:
            seg_bytes = segment_size(size)
            if self.used() + seg_bytes > self.capacity:
                self.counters["num_alloc_retries"] += 1
                self.process_events(sync=True)
                self.release_cached()
                if self.used() + seg_bytes > self.capacity:
                    self.counters["num_ooms"] += 1
                    raise OutOfMemory(nbytes)
            self.counters["num_device_alloc"] += 1
            seg = Segment(new_segment_address(seg_bytes), seg_bytes, stream, large)
            self.segments.append(seg)
            self._add("segment", large, 1)
            self._add("reserved_bytes", large, seg_bytes)
            block = seg.blocks[0]
        remaining = block.size - size
        if (remaining > SMALL_SIZE) if large and not self.expandable else (remaining >= MIN_BLOCK):
            seg = block.seg
            rest = Block(seg, block.offset + size, remaining)
            seg.blocks.insert(seg.blocks.index(block) + 1, rest)
            block.size = size
            self._free_block_counts(rest, +1)
        block.allocated, block.requested = True, nbytes
        self._add("allocation", large, 1)
        self._add("active", large, 1)
        self._add("allocated_bytes", large, block.size)  # an unsplit remainder stays inside
        self._add("active_bytes", large, block.size)
        self._add("requested_bytes", large, nbytes)
        return block

    def free(self, block: Block, stream_uses: set[int] = frozenset()) -> None:
        """Free requested; completes now unless other streams used the block."""
        large = block.seg.large
        self._add("allocation", large, -1)
        self._add("allocated_bytes", large, -block.size)
        block.allocated = False
        uses = set(stream_uses) - {block.seg.stream}
        if uses:
            block.pending = uses
            self.pending_order.append(block)
        else:
            self._complete_free(block)

    def _complete_free(self, block: Block) -> None:
        seg, large = block.seg, block.seg.large
        self._add("active", large, -1)
        self._add("active_bytes", large, -block.size)
        self._add("requested_bytes", large, -block.requested)
        if block.pending is not None:
            self.pending_order.remove(block)
        block.requested, block.pending = 0, None
        prev, nxt = seg.neighbours(block)
        for n in (nxt, prev):  # merge with free neighbours
            self._merge_into(block, n, mapped=True)
        self._free_block_counts(block, +1)

    def reset_peak(self) -> None:
        for st in self.stats.values():
            st.peak = st.current

    def reset_accumulated(self) -> None:
        for st in self.stats.values():
            st.allocated = st.freed = 0
        self.counters = dict.fromkeys(COUNTERS, 0)

    def flat(self) -> dict[str, int]:
        out = {f"{s}.{p}.{f}": getattr(st, f) for (s, p), st in self.stats.items() for f in FIELDS}
        out.update(self.counters)
        return out


def compare(real: dict, model: dict) -> list[str]:
    return [f"{k}: allocator {real.get(k)} != model {v}" for k, v in model.items()
            if real.get(k, 0) != v]


def replay(seed: int, steps: int, expandable: bool = False) -> None:
    """Random alloc / free / record_stream / synchronization / empty_cache / OOM / reset
    sequence on every device and two streams per device, checked against the model after every
    step (also the blocks' addresses and their snapshot states). ``expandable``: with
    expandable segments (the process must start with them on), switched off and on again now
    and then."""
    import torch

    rng = random.Random(seed)
    ndev = torch.neuron.device_count()
    capacity = torch.neuron.mem_get_info(0)[1]
    gc.collect()
    torch.neuron.empty_cache()
    for d in range(ndev):
        torch.neuron.reset_peak_memory_stats(d)
        torch.neuron.reset_accumulated_memory_stats(d)
        assert torch.neuron.memory_reserved(d) == 0, "a fresh process holds no device memory"
    models = [DeviceModel(capacity, expandable) for _ in range(ndev)]
    streams = [[torch.neuron.default_stream(d), torch.neuron.Stream(device=d)] for d in range(ndev)]
    # (device, tensor, model block, streams it was recorded on)
    live: list[tuple[int, "torch.Tensor", Block, set[int]]] = []

    def known_segments(d: int) -> set[int]:
        return {s.address for s in models[d].segments}

    def inside_known(d: int, address: int) -> bool:
        return any(s.address <= address < s.address + s.size for s in models[d].segments)

    unseen = [UNSEEN]  # addresses for expandable segments that have no pages yet

    def new_address(d: int):
        def find(seg_bytes: int) -> int:
            if models[d].expandable:
                # Its first mapped run starts at its base. Until it has one (its first mapping
                # failed), it gets a placeholder, replaced when it is mapped.
                fresh = [s["address"] for s in torch.neuron.memory_snapshot()
                         if s["device"] == d and s["is_expandable"] and not inside_known(d, s["address"])]
                assert len(fresh) <= 1, fresh
                unseen[0] += seg_bytes
                return fresh[0] if fresh else unseen[0]
            fresh = [s for s in torch.neuron.memory_snapshot()
                     if s["device"] == d and s["address"] not in known_segments(d)]
            assert len(fresh) == 1 and fresh[0]["total_size"] == seg_bytes, (
                f"model expects one new {seg_bytes}-byte segment, allocator has {fresh}")
            return fresh[0]["address"]
        return find

    sizes = [1, 200, 256, 1000, 4 * KiB + 1, 100 * KiB, 700 * KiB, SMALL_SIZE, SMALL_SIZE + 1,
             3 * MiB, 9 * MiB + 7, 10 * MiB, 12 * MiB + 3, 17 * MiB, capacity // 3, capacity]
    def check_blocks(step: int) -> None:
        """Every segment's blocks (addresses, sizes, states) equal the model's."""
        real = {}
        for s in torch.neuron.memory_snapshot():
            real.update({(s["device"], b["address"]): (b["size"], b["state"])
                         for b in s["blocks"]})
        want = {}
        for dd, m in enumerate(models):
            for seg in m.segments:
                for b in (b for b in seg.blocks if b.mapped):
                    state = ("active_allocated" if b.allocated else
                             "active_pending_free" if b.pending is not None else "inactive")
                    want[(dd, b.address)] = (b.size, state)
        assert real == want, (f"seed {seed} step {step}: blocks differ: allocator has "
                              f"{sorted(set(real.items()) - set(want.items()))[:4]}, model "
                              f"{sorted(set(want.items()) - set(real.items()))[:4]}")

    pending_frees = 0
    for step in range(steps):
        d = rng.randrange(ndev)
        op = rng.choices(["alloc", "free", "empty_cache", "reset_peak", "reset_acc",
                          "record_stream", "sync", "wait_stream", "toggle"],
                         weights=[50, 40, 4, 3, 3, 15, 10, 3, 2 if expandable else 0])[0]
        if op == "alloc":
            nbytes = rng.choice(sizes) + rng.choice([0, 0, 0, rng.randrange(1, 4096)])
            sidx = rng.randrange(2)
            with torch.neuron.stream(streams[d][sidx]):
                try:
                    t = torch.empty(nbytes, dtype=torch.uint8, device=f"neuron:{d}")
                    oom = False
                except torch.OutOfMemoryError:
                    oom = True
            try:
                block = models[d].malloc(nbytes, streams[d][sidx].stream_id, new_address(d))
                assert not oom, f"step {step}: allocator raised OOM for {nbytes} B, model did not"
                assert t.data_ptr() == block.address, (
                    f"step {step}: {nbytes} B placed at {t.data_ptr():#x}, model says "
                    f"{block.address:#x}")
                live.append((d, t, block, set()))
            except OutOfMemory:
                assert oom, f"step {step}: model expected OOM for {nbytes} B"
        elif op == "free" and live:
            d, t, block, uses = live.pop(rng.randrange(len(live)))
            del t
            models[d].free(block, uses)
            pending_frees += block.pending is not None
        elif op == "record_stream" and live:
            d, t, block, uses = live[rng.randrange(len(live))]
            s = streams[d][rng.randrange(2)]  # its own stream sometimes: ignored
            t.record_stream(s)
            uses.add(s.stream_id)
        elif op == "sync":
            s = streams[d][rng.randrange(2)]
            how = rng.choice(["stream", "device", "event_sync", "event_query", "stream_query",
                              "item"])
            if how == "stream":
                s.synchronize()
            elif how == "device":
                torch.neuron.synchronize(d)
            elif how == "event_sync":
                s.record_event().synchronize()
            elif how == "event_query":
                assert s.record_event().query()
            elif how == "stream_query":
                assert s.query()
            else:  # a blocking copy to the host waits for the current stream
                mine = [t for dd, t, _, _ in live if dd == d and t.numel()]
                if not mine:
                    continue
                with torch.neuron.stream(s):
                    mine[0][0].item()
                del mine  # holds the tensors: a later free must free them
            for ss in (streams[d] if how == "device" else [s]):
                models[d].observe(ss.stream_id)
        elif op == "toggle":  # process-wide, as the setting
            on = not models[0].expandable
            torch._C._accelerator_setAllocatorSettings(f"expandable_segments:{on}")
            for m in models:
                m.expandable = on
        elif op == "wait_stream":  # orders streams on the device; the host observes nothing
            streams[d][0].wait_stream(streams[d][1])
        elif op == "empty_cache":
            torch.neuron.empty_cache()
            for m in models:
                m.process_events(sync=True)
                m.release_cached()
        elif op == "reset_peak":
            torch.neuron.reset_peak_memory_stats(d)
            models[d].reset_peak()
        elif op == "reset_acc":
            torch.neuron.reset_accumulated_memory_stats(d)
            models[d].reset_accumulated()
        check_blocks(step)
        for dd in range(ndev):
            want = models[dd].flat()
            diff = compare(torch.neuron.memory_stats(dd), want)
            assert not diff, f"seed {seed} step {step} ({op}) neuron:{dd}:\n  " + "\n  ".join(diff)
            accessors = {  # the torch.neuron and torch.accelerator shortcuts read the same stats
                "memory_allocated": "allocated_bytes.all.current",
                "max_memory_allocated": "allocated_bytes.all.peak",
                "memory_reserved": "reserved_bytes.all.current",
                "max_memory_reserved": "reserved_bytes.all.peak"}
            for fn, key in accessors.items():
                assert getattr(torch.neuron, fn)(dd) == want[key], (seed, step, fn)
                assert getattr(torch.accelerator, fn)(dd) == want[key], (seed, step, fn)
    print(f"seed {seed}: {steps} steps, {sum(m.counters['num_ooms'] for m in models)} OOMs, "
          f"{sum(len(m.segments) for m in models)} segments at the end, {pending_frees} frees "
          "waited for other streams")


if __name__ == "__main__":
    replay(int(sys.argv[1]), int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "expandable")
