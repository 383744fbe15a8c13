"""``torch.distributed`` backend ``"neuron"`` for the emulated Trainium device.

``register()`` (idempotent) makes ``init_process_group(backend="neuron")`` work, as well as
mixed strings such as ``"cpu:gloo,neuron:neuron"``. The backend is a C++ ``c10d::Backend``
(``torchneuron._C_distributed.ProcessGroupNeuron``): neuron memory is host memory, so every
collective runs over zero-copy CPU aliases on a gloo transport created here, while Works and
Futures carry the neuron tensors. See ``docs/distributed.md``.

Importing this module is cheap: it imports ``torch.distributed`` only (no DTensor, FSDP or
pipelining), and loads the small ``_C_distributed`` extension. The SDPA kernels context
parallelism needs (efficient attention on neuron) live in the device core (csrc/backend/sdpa.cpp).
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch

__all__ = ["register", "is_registered", "bind_local_device", "dump_flight_recorder", "monitored_barrier",
           "BACKEND_NAME"]

BACKEND_NAME = "neuron"
_lock = threading.Lock()
_registered = False
_bound_device: int | None = None


def _ext():
    from .. import _C_distributed  # noqa: PLC0415  (loaded on first use)

    return _C_distributed


def bind_local_device() -> int | None:
    """Map this process to its NeuronCore: ``neuron:(LOCAL_RANK % device_count)``.

    The real runtime does the same by setting ``NEURON_RT_VISIBLE_CORES=LOCAL_RANK`` before it
    starts, so the runtime must not already be running on a different core. Returns the device
    index, or None when ``LOCAL_RANK`` is unset (the caller placed the process itself)."""
    global _bound_device
    if _bound_device is not None:
        return _bound_device
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        return None
    n = torch.neuron.device_count()
    if n == 0:
        raise RuntimeError("neuron process group: no neuron device is visible (check "
                           "NEURON_RT_VISIBLE_CORES / NEURON_LOGICAL_NC_CONFIG)")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # n == 1: each process was given its own core (NEURON_RT_VISIBLE_CORES per process).
    if 1 < n < local_world:
        raise RuntimeError(
            f"neuron process group: {local_world} processes per node but only {n} logical "
            f"NeuronCore(s) are visible; one process drives one core (use --nproc-per-node {n} "
            "or raise TORCHNEURON_NUM_CHIPS / change NEURON_LOGICAL_NC_CONFIG)")
    target = int(local_rank) % n
    if torch.neuron.is_initialized():
        # The real runtime binds the process to its core when it starts; here all cores are
        # visible, so the conflict that matters is memory already placed on another core.
        busy = [d for d in range(n) if d != target and torch.neuron.memory_allocated(d) > 0]
        if busy:
            raise RuntimeError(
                f"neuron process group: this process already holds memory on neuron:{busy[0]} "
                f"but LOCAL_RANK={local_rank} maps it to neuron:{target} (one process drives one "
                "NeuronCore). Create no neuron tensors before init_process_group, or create "
                f"them on neuron:{target} (torch.neuron.set_device({target})).")
    torch.neuron.set_device(target)
    _bound_device = target
    return target


def _create_backend(opts, pg_options=None):
    """Creator called by c10d (``extended_api=True``) once per group and device."""
    import torch.distributed as dist

    bind_local_device()
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else timedelta(seconds=float(opts.timeout))
    if pg_options is not None and isinstance(pg_options, dist.ProcessGroupGloo._Options):
        gloo = dist.ProcessGroupGloo(store, rank, size, pg_options)
    else:
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    # as c10d does for its own gloo groups (names show up in gloo's logs and errors)
    gloo.options.global_ranks_in_group = list(opts.global_ranks_in_group)
    gloo.options.group_name = str(opts.group_id)
    return _ext().ProcessGroupNeuron(gloo, rank, size, timeout.total_seconds(), str(opts.group_id))


def register() -> None:
    """Register backend ``"neuron"`` with ``torch.distributed`` (idempotent, thread-safe)."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        import torch.distributed as dist

        if not dist.is_available():
            return
        _ext()  # load the C++ backend now: a broken build shows here, not at first use
        if BACKEND_NAME not in dist.Backend.backend_list:  # survives a module reload
            dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                          devices=["neuron"])
        _patch_monitored_barrier()
        _registered = True


def _patch_monitored_barrier() -> None:
    """``dist.monitored_barrier`` refuses every backend not named gloo (a Python check in torch
    2.13), although ours has a gloo transport that implements it. Route neuron groups to it;
    other groups keep the original behaviour."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.monitored_barrier
    if getattr(original, "_torchneuron", False):
        return

    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        pg = group if group is not None else c10d._get_default_group()
        if dist.get_backend(pg) != dist.Backend.GLOO:
            try:
                pg._get_backend(torch.device("neuron"))
            except RuntimeError:
                pass  # no neuron backend in this group: let torch report its own error
            else:
                return globals()["monitored_barrier"](pg, timeout, wait_all_ranks)
        return original(group, timeout=timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._torchneuron = True
    monitored_barrier.__doc__ = original.__doc__
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier


def is_registered() -> bool:
    return _registered


def dump_flight_recorder() -> str:
    """The last collectives of this process (JSON lines, oldest first): op, seq, shapes, state."""
    return _ext()._dump_flight_recorder()


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks: bool = False):
    """``dist.monitored_barrier`` for a neuron group (upstream accepts only the gloo backend by
    name; ours forwards to its gloo transport, which reports the ranks that did not arrive)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("neuron"))
    if timeout is None:
        timeout = timedelta(seconds=dist.default_pg_timeout.total_seconds())
    backend.monitored_barrier(timeout, wait_all_ranks)
