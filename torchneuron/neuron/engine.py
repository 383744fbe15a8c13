"""torch.neuron.engine: the execution engine (asynchronous streams).

With the engine on, an op whose outputs exist at the call (in-place and ``out=`` ops, and
elementwise ops over same-shaped operands of one floating dtype) queues its kernel and returns,
so Python runs ahead of the device as on a real accelerator. The queue runs, in order, where the
host must wait: every other op, every host read of device memory (``.item()``, ``.cpu()``,
printing, data-dependent shapes), ``synchronize``, ``Event.synchronize``; ``Stream.query`` and
``Event.query`` report "not ready" while kernels are queued and let the queue run. It also runs
once 64 kernels are queued (``TORCH_NEURONX_CONCATENATION_BUFFER_SIZE_LIMIT``). A kernel that
fails asynchronously raises at the next synchronization point, naming the op and the Python
stack that enqueued it.

On by default: ``TORCHNEURON_ASYNC_EXECUTION=0`` (or :func:`set_enabled`) turns it off;
``NEURON_LAUNCH_BLOCKING=1`` keeps every kernel synchronous, with errors raised at the op that
caused them, as CUDA's ``CUDA_LAUNCH_BLOCKING=1`` does. See docs/architecture.md, *Execution
engine*.

Adaptive Eager (:func:`set_fusion_enabled`, ``TORCH_NEURONX_ENABLE_CONCATENATION=1``) runs runs of
queued float32 elementwise kernels as one generated kernel, bit-identical to running them one by
one. Its precompiled family (:func:`set_cast_fusion_enabled`, on by default) runs runs of queued
casts (bfloat16 -> float32 -> fp8), products with a 0-dim tensor, clamps and ``max(abs(x))``, the
scaling casts of float8 training, as one pass over the elements, with no compilation.
"""

from __future__ import annotations

from .. import _C

__all__ = ["is_enabled", "set_enabled", "synchronize", "stats", "is_fusion_enabled", "set_fusion_enabled",
           "is_cast_fusion_enabled", "set_cast_fusion_enabled", "is_executor_thread_enabled",
           "set_executor_thread_enabled"]


def is_enabled() -> bool:
    """Whether ops may queue their kernels (the configuration; the profiler, while it records
    device activity, still runs every kernel synchronously)."""
    return _C._engine_configured()


def set_enabled(enabled: bool) -> None:
    """Turn asynchronous execution on or off for the process. Turning it off first waits for
    the queued kernels (an error one of them raised stays for the next synchronization)."""
    _C._engine_set_enabled(bool(enabled))


def synchronize() -> None:
    """Wait for every queued kernel on every device; raise the error of one that failed."""
    _C._engine_drain()


def is_fusion_enabled() -> bool:
    """Whether Adaptive Eager fuses queued elementwise kernels (``TORCH_NEURONX_ENABLE_CONCATENATION=1``
    or :func:`set_fusion_enabled`). Off by default in this release; it acts only while the
    engine is on, and never under ``torch.use_deterministic_algorithms(True)``."""
    return _C._fusion_enabled()


def set_fusion_enabled(enabled: bool) -> None:
    """Turn Adaptive Eager on or off. Fused results are bit-identical to unfused ones: a run of
    queued float32 elementwise kernels (add, sub, mul, div, addcmul, addcdiv, lerp; in place,
    ``out=`` or same-shaped functional) runs as one generated kernel once the same run was seen
    twice and its kernel compiled in the background. See docs/architecture.md, *Adaptive Eager*."""
    _C._fusion_set_enabled(bool(enabled))


def is_cast_fusion_enabled() -> bool:
    """Whether Adaptive Eager's precompiled family fuses queued scaling casts: on by default
    (it compiles nothing); ``TORCH_NEURONX_ENABLE_CONCATENATION=0`` turns it off with the rest."""
    return _C._fusion_tiles_enabled()


def set_cast_fusion_enabled(enabled: bool) -> None:
    """Turn the precompiled family on or off. A run of queued kernels among bfloat16 -> float32
    and float32 -> float8 casts, products with a 0-dim float32 tensor, clamps with two number
    bounds, and ``abs`` with a whole-tensor ``max``, over dense tensors of one layout, runs as one
    pass over the elements, tile by tile; intermediates nothing references stay in the cache
    instead of memory. Bit-identical to the kernels one by one: each element's bits depend only
    on its inputs, and where an abs or a max could depend on ATen's path (a NaN, a zero max) they
    are redone through ATen's kernels. The same switch holds the GEMM family (AMX hosts): a bf16
    ``mm`` of a widened int8 weight (``w.t().to(bfloat16)``) and a per-column ``mul`` after it,
    torchao's weight-only int8 linear, run as one AMX kernel call, bit-identical to the three
    kernels (a NaN result is redone through ATen). And while the generated kernels are off
    (``set_fusion_enabled``), the foreach list kernels of an optimizer step run as one region
    through a precompiled interpreted kernel (AVX-512 hosts with MKL), bit-identical to the lists
    one by one. See docs/architecture.md, *Adaptive Eager*."""
    _C._fusion_set_tiles_enabled(bool(enabled))


def is_executor_thread_enabled() -> bool:
    """Whether queued kernels run on an executor thread of their own (``TORCHNEURON_EXECUTOR_THREAD=1``
    or :func:`set_executor_thread_enabled`), overlapping the host's Python. Off by default."""
    return _C._engine_executor_thread()


def set_executor_thread_enabled(enabled: bool) -> None:
    """Run queued kernels on an executor thread (with the host's intra-op thread count, so results
    are the host's bit for bit) as soon as they are enqueued, instead of where the host waits. Host waits, ordering,
    results and error reports are unchanged; a program that reads a result without
    synchronizing may see it either computed or not, as on a GPU. It acts only while the engine
    is on. On a 2-core host it is slower than the engine without it (a second OpenMP team
    throttles both); see docs/architecture.md, *Threads and cores*."""
    _C._engine_set_executor_thread(bool(enabled))


def stats() -> dict:
    """Counters since start: ``enqueued`` and ``executed`` kernels, ``drains`` (host waits that
    found queued work); Adaptive Eager's ``fused`` kernels, in ``regions`` (one generated kernel
    call per element count), and its generated kernels ``kernels_requested``, ``kernels_compiled``
    and ``kernels_failed`` (which run unfused for good); ``tiled``: groups the precompiled family
    ran; ``gemm``: bf16 matmuls run with their int8 weight's widening or the per-column product
    after them fused (torchao's weight-only int8 linear); ``interpreted``: groups of foreach list
    kernels run by the interpreted kernel (the generated kernels off)."""
    return dict(_C._engine_stats())
