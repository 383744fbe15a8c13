"""``torch.neuron``: the device module of the emulated Trainium device, mirroring ``torch.cuda``.

Device index ``N`` of ``neuron:N`` is a logical NeuronCore (see :mod:`torchneuron.platform` for
the topology and the environment variables that shape it).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import _C
from .. import platform as _platform
from . import amp, comm, engine, graphs, ipc, memory, random, streams  # noqa: F401  (submodules, as torch.cuda.*)
from . import _gpu_trace  # noqa: F401  (PyTorch's GPU trace hooks call torch.neuron._gpu_trace)
from ._utils import _get_device_index
from .amp import get_amp_supported_dtype, is_bf16_supported
from .graphs import NeuronGraph, graph, graph_pool_handle, is_current_stream_capturing, make_graphed_callables
from .ipc import ipc_collect
from .memory import (empty_cache, host_memory_stats, list_gpu_processes, max_memory_allocated,
                     max_memory_reserved, mem_get_info, memory_allocated, memory_reserved,
                     memory_snapshot, memory_stats, memory_summary, reset_accumulated_memory_stats,
                     reset_max_memory_allocated, reset_peak_memory_stats,
                     set_per_process_memory_fraction, get_per_process_memory_fraction,
                     memory_stats_as_nested_dict, memory_cached, max_memory_cached,
                     reset_max_memory_cached, caching_allocator_alloc, caching_allocator_delete,
                     caching_allocator_enable, caching_allocator_disabled, get_allocator_backend,
                     device_memory_used, host_memory_stats_as_nested_dict,
                     reset_peak_host_memory_stats, reset_accumulated_host_memory_stats, MemPool,
                     use_mem_pool)
from .random import (get_rng_state, get_rng_state_all, initial_seed, manual_seed, manual_seed_all,
                     seed, seed_all, set_rng_state, set_rng_state_all)
from .streams import (Event, Stream, StreamContext, current_stream, default_stream, set_stream,
                      stream, synchronize)

__all__ = [
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device",
    "device", "device_of", "get_device_name", "get_device_properties", "get_device_capability",
    "synchronize", "Stream", "Event", "stream", "StreamContext", "current_stream", "default_stream",
    "set_stream", "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "get_amp_supported_dtype", "is_bf16_supported", "memory_stats", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_accumulated_memory_stats", "memory_summary", "memory_snapshot", "empty_cache",
    "mem_get_info", "set_per_process_memory_fraction", "get_per_process_memory_fraction",
    "memory_stats_as_nested_dict", "memory_cached", "max_memory_cached", "reset_max_memory_cached",
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_enable",
    "caching_allocator_disabled", "get_allocator_backend",
    "device_memory_used", "host_memory_stats", "host_memory_stats_as_nested_dict",
    "reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats", "MemPool", "use_mem_pool",
    "OutOfMemoryError", "set_sync_debug_mode", "get_sync_debug_mode",
    "get_dynamo_metrics", "reset_dynamo_metrics", "amp", "comm", "memory", "random",
    "streams", "ipc_collect", "engine", "graphs", "NeuronGraph", "graph", "is_current_stream_capturing",
    "graph_pool_handle", "make_graphed_callables", "can_device_access_peer", "clock_rate",
    "utilization", "memory_usage", "temperature", "power_draw", "default_generators",
]

OutOfMemoryError = torch.OutOfMemoryError  # as torch.cuda.OutOfMemoryError

_init_lock = threading.Lock()
_queued_calls: list = []  # callables to run at lazy init (e.g. manual_seed before first use)


def is_available() -> bool:
    """True when at least one neuron device is visible (never initialises the device)."""
    return _C._device_count() > 0


def device_count() -> int:
    """Number of visible logical NeuronCores."""
    return _C._device_count()


def _is_in_bad_fork() -> bool:
    return _C._in_bad_fork()


def is_initialized() -> bool:
    """Whether the neuron runtime has been initialised in this process."""
    return _C._is_initialized()


def _lazy_init() -> None:
    """Initialise the runtime on first use. Raises in a forked child of an initialised parent
    (CUDA's rule) and when the topology environment variables are invalid."""
    if _C._is_initialized():
        return
    with _init_lock:
        _C._lazy_init()
        calls, _queued_calls[:] = list(_queued_calls), []
        for fn in calls:
            fn()


def init() -> None:
    """Initialise the neuron runtime explicitly (normally lazy)."""
    _lazy_init()


def _check_index(index: int) -> None:
    """Raise RuntimeError naming the valid range unless ``index`` is a visible device."""
    _C._check_device(index)


def current_device() -> int:
    """Index of the current neuron device of this thread."""
    return _C._current_device()


def set_device(device: Any) -> None:
    """Make ``device`` (index, ``"neuron:N"`` or torch.device) current for this thread."""
    index = _get_device_index(device, optional=True)
    if index >= 0:
        _C._set_device(index)


class device:
    """Context manager that changes the current device (``None`` or -1: no change)."""

    def __init__(self, device: Any):
        self.idx = -1 if device is None else _get_device_index(device, optional=True)
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx >= 0:
            self.prev_idx = current_device()
            if self.idx != self.prev_idx:
                set_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        if self.idx >= 0 and self.prev_idx != self.idx:
            set_device(self.prev_idx)
        return False


class device_of(device):
    """Context manager that makes the device of tensor ``obj`` current (no-op for CPU tensors)."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.is_neuron else -1)


@dataclass(frozen=True)
class NeuronDeviceProperties:
    """What ``torch.neuron.get_device_properties(i)`` returns; all figures from the platform table."""

    name: str
    platform: str
    core_version: str
    total_memory: int
    physical_cores: int
    logical_core: int
    chip: int
    lnc: int
    peak_tflops: dict
    hbm_bandwidth: float  # bytes/s available to this device
    sbuf_bytes: int
    psum_bytes: int
    multi_processor_count: int  # engines per logical core, for code that reads CUDA's field

    def __repr__(self) -> str:
        return (f"NeuronDeviceProperties(name='{self.name}', platform='{self.platform}', "
                f"total_memory={self.total_memory // (1 << 20)}MB, physical_cores={self.physical_cores}, "
                f"peak_tflops={self.peak_tflops}, hbm_bandwidth={self.hbm_bandwidth / 1e9:.0f}GB/s)")


def get_device_properties(device: Any = None) -> NeuronDeviceProperties:
    """Hardware properties of ``device`` (a logical NeuronCore)."""
    index = _get_device_index(device, optional=True)
    _check_index(index)
    topo = _platform.topology()
    p = topo.platform
    per_chip = topo.logical_cores_per_chip
    return NeuronDeviceProperties(
        name=f"{p.chip} NeuronCore ({p.core_version}, LNC={topo.lnc})",
        platform=p.name,
        core_version=p.core_version,
        total_memory=_C._device_capacity(index),
        physical_cores=topo.lnc,
        logical_core=topo.visible_cores[index],
        chip=topo.chip_of(index),
        lnc=topo.lnc,
        peak_tflops={k: v * topo.lnc for k, v in p.tensor_tflops.items()},
        hbm_bandwidth=p.hbm_bandwidth_per_chip / per_chip,
        sbuf_bytes=p.sbuf_bytes_per_partition * p.sbuf_partitions * topo.lnc,
        psum_bytes=p.psum_bytes_per_partition * p.sbuf_partitions * topo.lnc,
        multi_processor_count=4 * topo.lnc,
    )


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """Whether ``device`` can access ``peer_device``'s memory directly, as
    ``torch.cuda.can_device_access_peer``: NeuronCores of one instance reach each other's HBM
    (DMA over NeuronLink), and here all device memory is host memory, so any two distinct
    visible devices can; a device is not its own peer (CUDA answers False there too)."""
    a = _get_device_index(device, optional=True)
    b = _get_device_index(peer_device)
    _check_index(a)
    _check_index(b)
    return a != b


def clock_rate(device: Any = None) -> int:
    """The clock of ``device``'s TensorE in MHz (``torch.cuda.clock_rate`` reports the SM
    clock): the emulated part's nominal clock from :mod:`torchneuron.platform`."""
    index = _get_device_index(device, optional=True)
    _check_index(index)
    return int(round(_platform.topology().platform.tensor_clock_hz / 1e6))


def _no_sensor(name: str, what: str) -> Any:
    def unavailable(device: Any = None) -> Any:
        raise NotImplementedError(
            f"torch.neuron.{name}: the emulated NeuronCore has no {what} to read (torch.cuda's comes "
            "from NVML's sensors). Time spent on the device is measured by torch.profiler "
            "(ProfilerActivity.PrivateUse1) and torchneuron's profiler (docs/profiling.md).")
    unavailable.__name__ = unavailable.__qualname__ = name
    unavailable.__doc__ = f"Not available on the emulated device (``torch.cuda.{name}`` reads NVML): raises NotImplementedError."
    return unavailable


utilization = _no_sensor("utilization", "utilization counter")
memory_usage = _no_sensor("memory_usage", "memory-activity counter")
temperature = _no_sensor("temperature", "temperature sensor")
power_draw = _no_sensor("power_draw", "power sensor")


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Report the operations that make the host wait for the device, as
    ``torch.cuda.set_sync_debug_mode``: ``"default"``/0 (off), ``"warn"``/1 (a warning per such
    operation) or ``"error"``/2 (a RuntimeError instead of waiting). They are ``.item()`` and other
    value-dependent results, blocking copies to the CPU (``.cpu()``, ``.tolist()``, printing), ops
    whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``, boolean
    indexing) and ``Stream.synchronize()``; not ``torch.neuron.synchronize()`` nor
    ``Event.synchronize()``, which a program calls in order to wait."""
    _lazy_init()
    if isinstance(debug_mode, str):
        modes = {"default": 0, "warn": 1, "error": 2}
        if debug_mode not in modes:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = modes[debug_mode]
    _C._set_sync_debug_mode(int(debug_mode))


def get_sync_debug_mode() -> int:
    """The sync debug mode: 0 (off), 1 (warn) or 2 (error); see :func:`set_sync_debug_mode`."""
    _lazy_init()
    return _C._get_sync_debug_mode()


def get_device_name(device: Any = None) -> str:
    """Name of ``device``, e.g. ``"Trainium2 NeuronCore (NeuronCore-v3, LNC=2)"``."""
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """(major, minor) NeuronCore version: (3, 0) on trn2, (4, 0) on trn3."""
    props = get_device_properties(device)
    return (int(props.core_version.rsplit("v", 1)[1]), 0)


def get_dynamo_metrics() -> dict:
    """torch.compile metrics of the ``neuron`` backend (compilations, cache hits, ...)."""
    from ..compile import metrics  # lazy: keeps Dynamo out of import torch

    return metrics.get()


def reset_dynamo_metrics() -> None:
    """Zero the torch.compile metrics."""
    from ..compile import metrics

    metrics.reset()


# Inductor's code generators for this device. Inductor looks them up here by itself
# (``torch.utils.backend_registration._get_custom_mod_func``) the first time it builds its
# backend table, so plain Inductor compiles neuron graphs without a prior registration call.
# Resolved on access: importing them imports Inductor, which ``import torch`` must not do.
_INDUCTOR_CODEGENS = ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")


def __getattr__(name: str) -> Any:
    if name == "default_generators":  # each device's default generator (torch.cuda's tuple)
        return random.default_generators
    if name == "_initialized":
        # torch.cuda's module flag, read by torch.utils.checkpoint: without it checkpointing
        # neither saves nor restores the device RNG state (preserve_rng_state has no effect).
        return _C._is_initialized()
    if name == "_sanitizer":  # torch.neuron._sanitizer, imported on first use (as torch.cuda's)
        import importlib

        return importlib.import_module(f"{__name__}._sanitizer")
    if name in _INDUCTOR_CODEGENS:
        from ..compile import inductor

        return inductor.codegen_for_device_module(name)
    raise AttributeError(f"module 'torch.neuron' has no attribute {name!r}")
