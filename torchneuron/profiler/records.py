"""Device records as the profiler sees them: decoding what the runtime recorded.

Every piece of device work the runtime executed while ``torch.profiler`` recorded
``ProfilerActivity.PrivateUse1`` is one :class:`DeviceRecord`: kernels, copies, memsets,
collectives, NKI and compiled kernels, plus host-side synchronizations and event record/wait.
Each carries the tensors it read and wrote (shape, stride, dtype, storage), so the estimator
can count bytes and FLOPs without re-running anything.

Records reach Python twice: live, when the kineto plugin hands them to
:func:`torchneuron.profiler._session.annotate` (tuples), and from a saved Chrome trace (the
device events' ``args``), via :func:`records_from_trace`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable

__all__ = ["TensorMeta", "DeviceRecord", "decode_tensors", "unique_bytes", "records_from_trace",
           "DEVICE_KINDS"]

#: Record kinds that are device work (the rest are host-side: sync, wait, event_record).
DEVICE_KINDS = ("kernel", "memcpy", "memset", "collective", "nki", "compiled")

# Flag bits of the C++ encoding (csrc/backend/profiler.h).
_OUTPUT, _CPU, _READ = 1, 2, 4

_NAME_TO_DTYPE = {
    "Byte": "uint8", "Char": "int8", "Short": "int16", "Int": "int32", "Long": "int64",
    "Half": "float16", "Float": "float32", "Double": "float64", "ComplexHalf": "complex32",
    "ComplexFloat": "complex64", "ComplexDouble": "complex128", "Bool": "bool",
    "BFloat16": "bfloat16", "Float8_e5m2": "float8_e5m2", "Float8_e4m3fn": "float8_e4m3fn",
    "Float8_e5m2fnuz": "float8_e5m2fnuz", "Float8_e4m3fnuz": "float8_e4m3fnuz",
    "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64",
}
_ITEMSIZE = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
             "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
             "bool": 1, "bfloat16": 2, "float8_e5m2": 1, "float8_e4m3fn": 1,
             "float8_e5m2fnuz": 1, "float8_e4m3fnuz": 1, "uint16": 2, "uint32": 4, "uint64": 8}


@lru_cache(maxsize=1)
def _scalar_types() -> list:
    from .. import _C

    return [_NAME_TO_DTYPE.get(n, n.lower()) for n in _C._scalar_type_names()]


@dataclass(frozen=True)
class TensorMeta:
    """One tensor a device activity touched."""

    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple
    stride: tuple
    storage: int  # storage identity (its base address)
    storage_nbytes: int
    offset: int  # storage offset in elements
    written: bool
    read: bool
    cpu: bool  # host memory (a CPU scalar or index tensor), not device memory

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 4)

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    def span(self) -> tuple[int, int]:
        """[lo, hi) byte range of the storage this view can touch."""
        lo = hi = self.offset
        for n, s in zip(self.shape, self.stride):
            if n <= 0:
                return (self.offset * self.itemsize, self.offset * self.itemsize)
            if s >= 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return (lo * self.itemsize, (hi + 1) * self.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes the view touches: stride-aware (a broadcast dimension, stride 0, is read once)
        and never more than its span in storage."""
        if self.numel == 0:
            return 0
        unique = 1
        for n, s in zip(self.shape, self.stride):
            if s != 0:
                unique *= n
        lo, hi = self.span()
        return min(unique * self.itemsize, hi - lo)


def decode_tensors(flat: Iterable[int]) -> list[TensorMeta]:
    """Decode the runtime's tensor encoding: [flags, dtype, ndim, storage, storage_nbytes,
    offset, sizes..., strides...] per tensor."""
    flat = list(flat)
    names = _scalar_types()
    out = []
    i = 0
    while i + 6 <= len(flat):
        flags, dt, nd, key, nbytes, off = flat[i:i + 6]
        sizes = tuple(flat[i + 6:i + 6 + nd])
        strides = tuple(flat[i + 6 + nd:i + 6 + 2 * nd])
        i += 6 + 2 * nd
        written = bool(flags & _OUTPUT)
        out.append(TensorMeta(names[dt] if 0 <= dt < len(names) else "unknown", sizes, strides,
                              key, nbytes, off, written, (not written) or bool(flags & _READ),
                              bool(flags & _CPU)))
    return out


def unique_bytes(tensors: Iterable[TensorMeta]) -> int:
    """Bytes moved for a set of views: per storage, the union of the views' spans, capped by
    the sum of their own touched bytes (views of one buffer are read once)."""
    by_storage: dict[int, list] = {}
    for t in tensors:
        by_storage.setdefault(t.storage, []).append(t)
    total = 0
    for key, views in by_storage.items():
        own = sum(v.nbytes for v in views)
        if key == 0 or len(views) == 1:
            total += own
            continue
        spans = sorted(v.span() for v in views)
        union = 0
        cur_lo, cur_hi = spans[0]
        for lo, hi in spans[1:]:
            if lo > cur_hi:
                union += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        union += cur_hi - cur_lo
        total += min(own, union)
    return total


@dataclass
class DeviceRecord:
    """One record of the runtime (times in ns, CLOCK_REALTIME like PyTorch's profiler)."""

    id: int
    kind: str
    name: str
    device: int
    stream: int
    tid: int
    launch_start: int
    launch_end: int
    start: int
    end: int
    bytes: int = 0
    copy: str = ""
    blocking: bool = False
    tensors: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    stack: Any = None  # symbolized frames (innermost first) or None
    scope: int = 0
    external: int = 0  # correlation id of the framework op that launched it

    @property
    def is_device(self) -> bool:
        return self.kind in DEVICE_KINDS

    @property
    def op(self) -> str:
        """The ATen op of a kernel (``"mm"``, ``"add.Tensor"``), else the record's name."""
        return self.name[4:] if self.name.startswith("nc::") else self.name

    @property
    def duration(self) -> int:
        return max(self.end - self.start, 0)

    @classmethod
    def from_tuple(cls, t: tuple) -> "DeviceRecord":
        (rid, kind, name, device, stream, tid, ls, le, s, e, nbytes, copy, blocking, tensors,
         meta, stack, scope, external) = t
        m = {}
        for k, v in meta:
            try:
                m[k] = json.loads(v)
            except ValueError:
                m[k] = v
        return cls(rid, kind, name, device, stream, tid, ls, le, s, e, nbytes, copy, bool(blocking),
                   decode_tensors(tensors), m, stack, scope, external)


def records_from_trace(trace: dict) -> list[DeviceRecord]:
    """Rebuild the device records from a Chrome trace written by ``export_chrome_trace``.

    Device events are the ``kernel``/``gpu_memcpy``/``gpu_memset`` events with a
    ``correlation`` arg; syncs and event waits the ``privateuse1_runtime`` events with a
    ``kind`` arg. Timestamps come back as ns on the trace's clock."""
    base = int(trace.get("baseTimeNanoseconds", 0))
    launches: dict[int, dict] = {}
    out: list[DeviceRecord] = []
    for ev in trace.get("traceEvents", ()):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        args = ev.get("args") or {}
        if cat == "privateuse1_runtime" and "correlation" in args:
            if "kind" not in args:
                launches[int(args["correlation"])] = ev
                continue
        elif cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "correlation" not in args:
            continue
        start = base + int(round(float(ev["ts"]) * 1000))
        end = start + int(round(float(ev.get("dur", 0)) * 1000))
        rec = DeviceRecord(
            id=int(args["correlation"]), kind=args.get("kind", "kernel"), name=ev["name"],
            device=int(args.get("device", 0)), stream=int(args.get("stream", args.get("queue", 0))),
            tid=int(args.get("thread", ev.get("tid", 0))), launch_start=start, launch_end=start,
            start=start, end=end, bytes=int(args.get("bytes", 0)), copy=args.get("copy", ""),
            blocking=bool(args.get("blocking", 0)),
            tensors=decode_tensors(args.get("tensors", [])), meta=dict(args),
            scope=int(args.get("scope", 0)), external=int(args.get("op_correlation", 0)))
        if cat == "privateuse1_runtime":
            rec.tid = int(ev.get("tid", 0))
        else:
            rec.launch_start = start - int(args.get("launch_ns", 0))
            rec.launch_end = start
        out.append(rec)
    out.sort(key=lambda r: (r.launch_start, r.id))
    return out
