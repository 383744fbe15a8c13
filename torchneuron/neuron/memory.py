"""Device memory: the caching allocator's statistics and controls (``torch.neuron.memory``).

Mirrors ``torch.cuda.memory``. Statistics come from the C++ ``DeviceAllocator`` through
``torch.accelerator``, so both APIs always agree.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import threading
import warnings
from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch

from .. import _C
from ._utils import _get_device_index

__all__ = [
    "empty_cache", "memory_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "reset_max_memory_allocated", "memory_summary",
    "memory_snapshot", "mem_get_info", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats", "list_gpu_processes",
    "set_per_process_memory_fraction", "get_per_process_memory_fraction",
    "memory_stats_as_nested_dict", "memory_cached", "max_memory_cached", "reset_max_memory_cached",
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_enable",
    "caching_allocator_disabled", "get_allocator_backend", "device_memory_used", "MemPool",
    "use_mem_pool", "NeuronPluggableAllocator", "change_current_allocator",
    "_record_memory_history", "_snapshot", "_dump_snapshot",
]


def _index(device: Any) -> int:
    torch.neuron._lazy_init()
    index = _get_device_index(device, optional=True)
    torch.neuron._check_index(index)
    return index


def empty_cache() -> None:
    """Return every unused cached block of every device to the (emulated) runtime."""
    if torch.neuron.is_initialized():
        torch._C._accelerator_emptyCache()


def memory_stats(device: Any = None) -> "OrderedDict[str, Any]":
    """Allocator statistics of ``device`` as a flat dict, keys as in ``torch.cuda.memory_stats``."""
    return torch.accelerator.memory_stats(_index(device))


def memory_allocated(device: Any = None) -> int:
    """Bytes currently occupied by tensors on ``device``."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: Any = None) -> int:
    """Peak of :func:`memory_allocated` since start or the last reset."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: Any = None) -> int:
    """Bytes held by the caching allocator on ``device`` (allocated plus cached)."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: Any = None) -> int:
    """Peak of :func:`memory_reserved` since start or the last reset."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Reset the peak counters of ``device`` to their current values."""
    torch._C._accelerator_resetPeakStats(_index(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    """Alias of :func:`reset_peak_memory_stats` (CUDA's older name)."""
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Reset the accumulated (allocated/freed, retry and OOM) counters of ``device``."""
    torch._C._accelerator_resetAccumulatedStats(_index(device))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the emulated HBM of ``device``."""
    index = _index(device)
    total = _C._device_capacity(index)
    return total - _C._device_used(index), total


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """:func:`memory_stats` as nested dicts (``{"allocated_bytes": {"all": {"current": ...}}}``),
    the form ``torch.cuda.memory_stats_as_nested_dict`` returns."""
    nested: dict[str, Any] = {}
    for key, value in memory_stats(device).items():
        *path, leaf = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_cached(device: Any = None) -> int:
    """Deprecated name of :func:`memory_reserved` (as in ``torch.cuda``)."""
    warnings.warn("`torch.neuron.memory_cached` has been renamed to `torch.neuron.memory_reserved`",
                  FutureWarning, stacklevel=2)
    return memory_reserved(device)


def max_memory_cached(device: Any = None) -> int:
    """Deprecated name of :func:`max_memory_reserved` (as in ``torch.cuda``)."""
    warnings.warn("`torch.neuron.max_memory_cached` has been renamed to `torch.neuron.max_memory_reserved`",
                  FutureWarning, stacklevel=2)
    return max_memory_reserved(device)


def reset_max_memory_cached(device: Any = None) -> None:
    """Deprecated: resets every peak statistic, as :func:`reset_peak_memory_stats` (as in
    ``torch.cuda``)."""
    warnings.warn("torch.neuron.reset_max_memory_cached now calls torch.neuron.reset_peak_memory_stats, "
                  "which resets /all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device)


# caching_allocator_alloc's blocks, by address: each is a byte tensor kept alive until
# caching_allocator_delete, so the block returns to the caching allocator (and its stream's pool)
# like any tensor's.
_raw_blocks: dict[int, torch.Tensor] = {}
_raw_lock = threading.Lock()


def caching_allocator_alloc(size: int, device: Any = None, stream: Optional[torch.Stream] = None) -> int:
    """Allocate ``size`` bytes from the neuron caching allocator on ``device`` (the current one if
    None) for ``stream`` (the device's current stream if None), as
    ``torch.cuda.caching_allocator_alloc``: for interoperability with code that manages raw device
    memory. Returns the address; free it with :func:`caching_allocator_delete`."""
    index = _index(device)
    if stream is not None and not (isinstance(stream, torch.Stream) and stream.device.type == "neuron"):
        raise TypeError("Invalid type for stream argument, must be a neuron `torch.Stream` "
                        "(torch.neuron.Stream) or None for the current stream")
    with torch.neuron.stream(stream):  # (None: the device's current stream)
        block = torch.empty(int(size), dtype=torch.uint8, device=torch.device("neuron", index))
    address = block.data_ptr()
    with _raw_lock:
        _raw_blocks[address] = block
    return address


def caching_allocator_delete(mem_ptr: int) -> None:
    """Free memory allocated by :func:`caching_allocator_alloc` (its device and stream were
    recorded with it)."""
    with _raw_lock:
        block = _raw_blocks.pop(int(mem_ptr), None)
    if block is None:
        raise RuntimeError(f"invalid device pointer: {mem_ptr:#x} was not allocated by "
                           "torch.neuron.caching_allocator_alloc (or was freed already)")
    del block


def caching_allocator_enable(value: bool = True) -> None:
    """Turn the neuron caching allocator on or off (on by default), as
    ``torch.cuda.memory.caching_allocator_enable``. Off, each allocation is a device allocation of
    its own, returned to the device when its tensor is freed, and outside ``memory_stats``
    (CUDA's uncached path). ``PYTORCH_NO_CUDA_MEMORY_CACHING`` keeps it off for the process."""
    _C._caching_allocator_enable(bool(value))


@contextlib.contextmanager
def caching_allocator_disabled() -> Iterator[None]:
    """Context manager that turns the caching allocator off inside it, as
    ``torch.cuda.memory.caching_allocator_disabled``."""
    prev = _C._caching_allocator_is_enabled()
    caching_allocator_enable(False)
    try:
        yield
    finally:
        caching_allocator_enable(prev)


def get_allocator_backend() -> str:
    """``"native"``: the neuron caching allocator (the only backend)."""
    return "native"


def device_memory_used(device: Any = None) -> int:
    """Bytes in use on ``device`` by this process (what the runtime holds: the caching allocator's
    segments and adopted results), as ``torch.cuda.device_memory_used`` reports the device's."""
    return _C._device_used(_index(device))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limit what this process's caching allocator may hold on ``device`` to ``fraction`` of its
    capacity (0 to 1, as ``torch.cuda.set_per_process_memory_fraction``): an allocation beyond it
    frees the cache and retries, then raises ``torch.OutOfMemoryError``. Blocks already held stay
    allocated; :func:`mem_get_info` still reports the whole device."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    _C._set_memory_fraction(float(fraction), _index(device))


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The fraction set by :func:`set_per_process_memory_fraction` (1.0 unless set)."""
    return _C._memory_fraction(_index(device))


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """Statistics of the pinned host allocator, nested as ``torch.cuda``'s: ``allocations``,
    ``allocated_bytes``, ``active_requests``, ``active_bytes`` (each ``current``, ``peak``,
    ``allocated``, ``freed``), ``num_host_alloc``, ``num_host_free``, ``host_alloc_time`` and
    ``host_free_time`` (µs: ``total``, ``max``, ``min``, ``count``, ``avg``). Pinned blocks are
    not cached here: each request allocates and each free releases."""
    return _C._host_stats()


def host_memory_stats() -> "OrderedDict[str, Any]":
    """:func:`host_memory_stats_as_nested_dict` flattened (``"allocations.current"``, ...), sorted
    by key, as ``torch.cuda.host_memory_stats``."""
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat.append((prefix, value))
    walk("", host_memory_stats_as_nested_dict())
    return OrderedDict(sorted(flat))


def reset_peak_host_memory_stats() -> None:
    """Reset the pinned host allocator's ``peak`` (and duration ``max``/``min``) statistics."""
    _C._host_reset_peak_stats()


def reset_accumulated_host_memory_stats() -> None:
    """Reset the pinned host allocator's accumulated statistics (``allocated``, ``freed``, the
    alloc/free counts and the durations' ``total``/``count``)."""
    _C._host_reset_accumulated_stats()


def memory_snapshot(mempool_id: Optional[tuple[int, int]] = None,
                    include_traces: bool = True) -> list[dict[str, Any]]:
    """Every segment of every device with its blocks, in ``torch.cuda.memory_snapshot`` form;
    with ``mempool_id`` (a :class:`MemPool`'s ``id``), that pool's segments only.
    (``include_traces`` is accepted for CUDA's signature: segments carry no traces.)"""
    segments = _snapshot()["segments"]
    if mempool_id is None:
        return segments
    return [s for s in segments if tuple(s["segment_pool_id"]) == tuple(mempool_id)]


def _fmt(n: float) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:7.2f} {unit}" if unit != "B  " else f"{int(n):7d} B  "
        n /= 1024
    return str(n)


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A human-readable table of the allocator statistics of ``device``, like CUDA's."""
    index = _index(device)
    stats = memory_stats(index)
    total = _C._device_capacity(index)
    rows = [
        ("Allocated memory", "allocated_bytes", True),
        ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True),
        ("Reserved memory", "reserved_bytes", True),
        ("Allocations", "allocation", False),
        ("Active allocs", "active", False),
        ("Segments", "segment", False),
    ]
    width = 75
    lines = ["=" * width,
             f" neuron:{index} memory summary (capacity {_fmt(total).strip()}, "
             f"platform {torch.neuron.get_device_properties(index).platform})",
             "-" * width,
             f" {'Metric':<22}| {'Cur Usage':>11} | {'Peak Usage':>11} | {'Tot Alloc':>11} | {'Tot Freed':>11}",
             "-" * width]
    pools = ("all",) if abbreviated else ("all", "large_pool", "small_pool")
    for title, key, is_bytes in rows:
        for pool in pools:
            vals = [stats.get(f"{key}.{pool}.{m}", 0) for m in ("current", "peak", "allocated", "freed")]
            cells = [_fmt(v) if is_bytes else f"{v:>11d}" for v in vals]
            label = title if pool == "all" else f"  from {pool.replace('_pool', '')} pool"
            lines.append(f" {label:<22}| {cells[0]:>11} | {cells[1]:>11} | {cells[2]:>11} | {cells[3]:>11}")
        lines.append("-" * width)
    lines.append(f" OOMs: {stats.get('num_ooms', 0)}   alloc retries: {stats.get('num_alloc_retries', 0)}"
                 f"   device allocs: {stats.get('num_device_alloc', 0)}   device frees: {stats.get('num_device_free', 0)}")
    lines.append("=" * width)
    return "\n".join(lines) + "\n"


def list_gpu_processes(device: Any = None) -> str:
    """The emulated device is private to this process."""
    index = _index(device)
    return f"neuron:{index}: emulated device, used only by this process"


def _record_memory_history(enabled: Optional[str] = "all", context: Optional[str] = "all",
                           stacks: str = "all", max_entries: int = sys.maxsize,
                           device: Any = None, clear_history: bool = False) -> None:
    """Record the allocator's history, like ``torch.cuda.memory._record_memory_history``.

    Args:
        enabled: ``"all"`` keeps a trace of every alloc/free/segment/OOM action plus the stack
            of every live block; ``"state"`` only the live blocks' stacks; ``None`` stops
            recording and forgets the history (``True``/``False`` mean ``"all"``/``None``).
        context: which actions capture a stack: ``"alloc"``, ``"all"`` (allocs and frees),
            ``"state"`` (allocs, for the live blocks), or ``None``.
        stacks: ``"python"`` (Python frames only, cheap) or ``"all"`` (Python and C++).
        max_entries: the most recent actions kept.
        device: accepted for CUDA compatibility (every neuron device is recorded).
        clear_history: forget the actions recorded so far before continuing.

    Render with ``torch.cuda._memory_viz`` (or pytorch.org/memory_viz) after
    :func:`_dump_snapshot`.
    """
    if enabled is True:
        enabled = "all"
    elif enabled is False:
        enabled = None
    if clear_history and enabled is not None:
        _C._memory_record_history(None, None, "python", 1)
    torch.neuron._lazy_init()
    _C._memory_record_history(enabled, context, stacks, int(min(max_entries, 2**62)))


def _snapshot(device: Any = None) -> dict[str, Any]:
    """The allocator state and recorded history in ``torch.cuda.memory._snapshot`` form:
    ``{"segments": [...], "device_traces": [[...] per device], "allocator_settings": {...}}``,
    each block and trace entry with its ``frames`` (``filename``, ``line``, ``name``)."""
    if not torch.neuron.is_initialized():
        return {"segments": [], "device_traces": [[] for _ in range(torch.neuron.device_count())],
                "allocator_settings": {"device": "neuron"}}
    return _C._memory_snapshot_full()


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Pickle :func:`_snapshot` to ``filename`` (open it with ``torch.cuda._memory_viz`` or
    drag it onto pytorch.org/memory_viz)."""
    with open(filename, "wb") as f:
        pickle.dump(_snapshot(), f)


class NeuronPluggableAllocator:
    """Device memory from functions of a shared library, as
    ``torch.cuda.memory.CUDAPluggableAllocator``, for a :class:`MemPool`'s segments:

    ``void* alloc_fn(size_t size, int device, void* stream)`` returns ``size`` bytes (NULL when
    it has none) and ``void free_fn(void* ptr, size_t size, int device, void* stream)`` takes
    them back; ``stream`` is the neuron stream id. The emulated device's memory is host memory,
    so any host allocation will do; what the functions hand out still counts against the
    device's capacity. The caching allocator keeps their blocks as it keeps its own segments'
    (reuse, splitting, statistics), returning a segment through ``free_fn`` when it is released.
    """

    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        import ctypes

        self._library = ctypes.CDLL(path_to_so_file)  # kept loaded for as long as this object
        try:
            self._alloc_fn = ctypes.cast(getattr(self._library, alloc_fn_name), ctypes.c_void_p).value
            self._free_fn = ctypes.cast(getattr(self._library, free_fn_name), ctypes.c_void_p).value
        except AttributeError as e:
            raise AttributeError(f"NeuronPluggableAllocator: {path_to_so_file} has no function "
                                 f"{e.args[0].split(':')[-1].strip()}") from None


def change_current_allocator(allocator: NeuronPluggableAllocator) -> None:
    """Not implemented: neuron's caching allocator cannot be replaced for the whole device (the
    execution engine, graph capture and interprocess sharing rely on its blocks). Give the
    allocator to a pool instead: ``MemPool(allocator=...)`` and :func:`use_mem_pool`."""
    raise NotImplementedError(
        "torch.neuron.memory.change_current_allocator is not implemented: neuron's caching allocator "
        "cannot be replaced (the execution engine, graph capture and IPC rely on its blocks); use "
        "torch.neuron.MemPool(allocator=...) with torch.neuron.use_mem_pool(pool) instead")


class MemPool:
    """A pool of device memory in the caching allocator, as ``torch.cuda.MemPool``: allocations
    made inside :func:`use_mem_pool` come from the pool's own segments, and memory they free
    serves only the pool's later allocations. When the pool is garbage collected its idle
    segments return to the device; segments still holding tensors join the device's own pool.

    ``allocator``: a :class:`NeuronPluggableAllocator` that provides the pool's segments.
    ``use_on_oom=True``: an allocation outside any pool that finds the device full takes a free
    block of this pool as a last resort (CUDA's). ``no_split=True``: the pool's blocks are never
    split (each allocation keeps its segment's rounded block)."""

    def __init__(self, allocator: Optional[NeuronPluggableAllocator] = None, use_on_oom: bool = False,
                 no_split: bool = False, *, _remappable: bool = False) -> None:
        # (_remappable, internal: segments that can sleep, for vLLM's sleep mode: allocator.h)
        if allocator is not None and not isinstance(allocator, NeuronPluggableAllocator):
            raise TypeError("torch.neuron.MemPool: allocator must be a "
                            f"torch.neuron.memory.NeuronPluggableAllocator, got {type(allocator).__name__}")
        self._allocator = allocator  # (keeps its library loaded while the pool lives)
        self._id = _C._mem_pool_create(bool(no_split), bool(use_on_oom),
                                       allocator._alloc_fn if allocator else 0,
                                       allocator._free_fn if allocator else 0, bool(_remappable))
        self._uses = 0

    @property
    def allocator(self) -> Optional[NeuronPluggableAllocator]:
        """The pool's allocator, or None for the device's own memory."""
        return self._allocator

    @property
    def id(self) -> tuple[int, int]:
        """The pool's id, ``(0, n)`` as CUDA's user pools (``segment_pool_id`` in snapshots)."""
        return (0, self._id)

    def use_count(self) -> int:
        """References to the pool: this object and each :func:`use_mem_pool` context open on it."""
        return 1 + self._uses

    def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
        """:func:`memory_snapshot`'s segments that belong to this pool."""
        return memory_snapshot(self.id, include_traces)

    def __del__(self) -> None:
        if getattr(self, "_id", None) is not None and _C is not None:
            _C._mem_pool_release(self._id)


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: Any = None) -> Iterator[None]:
    """Route this thread's allocations on ``device`` (default: the current device) to ``pool``,
    as ``torch.cuda.use_mem_pool``. Other threads (autograd's included, if it runs backward on
    one) keep allocating from the device's own pool."""
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool expects a torch.neuron.MemPool, got {type(pool).__name__}")
    index = _index(device)
    _C._mem_pool_begin(index, pool._id)
    pool._uses += 1
    try:
        yield
    finally:
        pool._uses -= 1
        _C._mem_pool_end(index, pool._id)
