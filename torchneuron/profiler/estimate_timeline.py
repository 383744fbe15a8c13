"""The estimated Trainium timeline: when each device activity would run on the real device.

The emulator executes every kernel on the calling thread, so the measured host timeline
contains the kernels' (CPU) execution. A real Trainium runs them asynchronously. The replay
below walks the records in launch order and keeps, per host thread, a *virtual clock*: the
measured time minus the emulated execution the thread did (which a real device takes off the
host), plus the stalls the host would spend waiting for the device:

* a kernel is ready when its host launch completes (virtual time), starts at
  ``max(ready, end of the previous activity on its queue, events its queue waits for,
  collectives that wrote its inputs)`` and lasts its estimated time (:mod:`.estimate`);
* a synchronization (device / stream / event synchronize, a blocking device-to-host copy such
  as ``.item()``) makes the host wait until the estimated end of the work it waits for;
* a stream waiting for an event waits for the estimated time of the event's record;
* collectives run on their own queue, after the work on the issuing stream; kernels that read
  what a collective wrote wait for it. A host thread that launched nothing between a
  collective's issue and its measured completion is taken to have waited for it (DDP's
  ``future.wait()``): that blocked time is replaced by the wait for the estimated collective.

What remains idle on the device is time the device waits for the host: the host-bound
fraction.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .estimate import Cost, Hardware, cost_of
from ..nki.perf_model import union_length
from .records import DeviceRecord

__all__ = ["Estimated", "Timeline", "build_timeline"]


@dataclass
class Estimated:
    """A record with its cost and place on the estimated timeline (ns, trace clock)."""

    record: DeviceRecord
    cost: Cost | None = None
    host_launch: float = 0.0  # virtual host time of the launch
    est_start: float = 0.0
    est_end: float = 0.0
    stall_ns: float = 0.0  # syncs: estimated time the host waits


@dataclass
class Timeline:
    """Estimated items; their times are ns relative to ``origin`` (the first launch)."""

    items: list = field(default_factory=list)
    hw: Hardware | None = None
    origin: int = 0

    def device_items(self) -> list:
        return [e for e in self.items if e.record.is_device]


def build_timeline(records: list[DeviceRecord], hw: Hardware) -> Timeline:
    """Replay ``records`` (any order) on the estimated device; see the module docstring."""
    recs = sorted(records, key=lambda r: (r.launch_start, r.id))
    # Times are ns since 1970: beyond float64's integer precision (256 ns at 1.8e18). The
    # replay runs relative to the first launch; callers add Timeline.origin back.
    origin = recs[0].launch_start if recs else 0
    removed: dict[int, float] = defaultdict(float)  # emulated execution taken off the host
    stall: dict[int, float] = defaultdict(float)  # host waits for the estimated device
    last_activity: dict[int, float] = {}  # measured end of the thread's last host activity
    queue_free: dict[tuple, float] = {}
    event_time: dict[int, float] = {}
    storage_ready: dict[int, float] = {}
    pending_cc: dict[int, list] = defaultdict(list)  # tid -> collectives not yet waited for
    tl = Timeline(hw=hw, origin=origin)

    def virtual(tid: int, t: float) -> float:
        return (t - origin) - removed[tid] + stall[tid]

    def wait_host(tid: int, measured_now: float, until: float) -> float:
        v = virtual(tid, measured_now)
        if until > v:
            stall[tid] += until - v
            return until - v
        return 0.0

    def device_done(device: int, stream: int) -> float:
        if stream < 0:
            return max((t for (d, _s), t in queue_free.items() if d == device), default=0.0)
        return queue_free.get((device, stream), 0.0)

    for r in recs:
        tid = r.tid
        # A collective that completed while this thread launched nothing: the thread waited.
        if pending_cc[tid]:
            keep = []
            prev = last_activity.get(tid, r.launch_start)
            for cc in pending_cc[tid]:
                if prev <= cc.record.end <= r.launch_start:
                    blocked = cc.record.end - max(prev, cc.record.launch_end)  # (ints)
                    if blocked > 0:
                        removed[tid] += blocked
                    wait_host(tid, cc.record.end, cc.est_end)
                elif cc.record.end > r.launch_start:
                    keep.append(cc)
            pending_cc[tid] = keep
        v_launch = virtual(tid, r.launch_start)
        e = Estimated(r, host_launch=v_launch)
        if r.kind == "sync":
            until = device_done(r.device, r.stream)
            e.stall_ns = wait_host(tid, r.end, until)
            e.est_start, e.est_end = v_launch, v_launch + e.stall_ns
        elif r.kind == "event_record":
            event_time[int(r.meta.get("event", 0))] = queue_free.get((r.device, r.stream), 0.0)
        elif r.kind == "wait":
            q = (r.device, r.stream)
            queue_free[q] = max(queue_free.get(q, 0.0), event_time.get(int(r.meta.get("event", 0)), 0.0))
        elif r.is_device:
            c = cost_of(r, hw)
            e.cost = c
            ready = v_launch + max(r.launch_end - r.launch_start, 0)
            q = (r.device, r.stream)
            ready = max(ready, queue_free.get(q, 0.0))
            if r.kind == "collective":
                issue = int(r.meta.get("issue_stream", 0))
                ready = max(ready, queue_free.get((r.device, issue), 0.0))
            for t in r.tensors:
                if t.read and t.storage in storage_ready:
                    ready = max(ready, storage_ready[t.storage])
            e.est_start = ready
            e.est_end = ready + c.est_ns
            queue_free[q] = e.est_end
            if r.kind == "collective":
                for t in r.tensors:
                    if t.written:
                        storage_ready[t.storage] = e.est_end
                pending_cc[tid].append(e)
            else:
                # The emulator ran the work on this thread; Trainium runs it on the device.
                removed[tid] += r.end - r.start
                if r.blocking:
                    e.stall_ns = wait_host(tid, r.end, e.est_end)
        if r.kind != "collective":
            last_activity[tid] = max(last_activity.get(tid, 0.0), r.end, r.launch_end)
        tl.items.append(e)
    return tl


def summarize(tl: Timeline, t0: float | None = None, t1: float | None = None) -> dict:
    """Totals over the device items launched in [t0, t1) (virtual host time): estimated span,
    busy time, FLOPs, bytes, MFU, MBU and the host-bound fraction."""
    hw = tl.hw
    items = [e for e in tl.device_items() if e.cost is not None
             and (t0 is None or e.host_launch >= t0) and (t1 is None or e.host_launch < t1)]
    if not items:
        return {"est_ns": 0.0, "busy_ns": 0.0, "flops": 0, "bytes": 0, "mfu": 0.0, "mbu": 0.0,
                "host_bound_fraction": 0.0, "kernels": 0}
    start = min(min(e.host_launch for e in items), min(e.est_start for e in items))
    end = max(e.est_end for e in items)
    span = max(end - start, 1e-9)
    compute = [(e.est_start, e.est_end) for e in items if e.record.kind != "collective"]
    busy = union_length(compute)
    flops = sum(e.cost.flops for e in items)
    nbytes = sum(e.cost.bytes for e in items if e.record.kind != "collective")
    peak = hw.peak_flops(dominant_dtype(items))
    return {"est_ns": span, "busy_ns": busy, "flops": flops, "bytes": nbytes,
            "mfu": flops / (span * 1e-9 * peak), "mbu": nbytes / (span * 1e-9 * hw.hbm_bw),
            "host_bound_fraction": max(0.0, 1.0 - busy / span), "kernels": len(items)}


def dominant_dtype(items: list) -> str:
    """The dtype that carries most FLOPs (MFU is taken against its TensorE peak)."""
    by: dict[str, float] = defaultdict(float)
    for e in items:
        if e.cost is not None and e.cost.flops:
            by[e.cost.dtype or "bfloat16"] += e.cost.flops
    return max(by, key=by.get) if by else "bfloat16"
