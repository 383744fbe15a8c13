"""Neuron tensors and storages across processes (``torch.multiprocessing``), as CUDA's.

torch 2.13 shares CPU storages through POSIX shared memory and CUDA storages through CUDA IPC
handles; any other device reaches ``_share_fd_cpu_`` and fails ("only available on CPU"). Here
neuron storages get their own reduction, registered with ``multiprocessing``'s
``ForkingPickler`` (queues, pipes, ``Process`` arguments, DataLoader workers) next to torch's:

* **Zero-copy.** Device memory is a shareable file per device and process (the runtime's heap
  file, a memfd), so a storage travels as ``(device, file descriptor, offset, size)``: the
  receiver maps the same pages as a neuron storage on the same device index. Writes on either
  side are seen by the other. The descriptor crosses processes as ``multiprocessing`` passes
  CPU tensors' shared-memory descriptors (``reduction.DupFd``), whatever the sharing strategy
  (``file_system`` concerns CPU tensors only, as for CUDA).
* **CUDA's lifetime rules.** Each send gets a reference counter in shared memory. The producer
  keeps the memory allocated (not reusable by its caching allocator) until every consumer's
  storage is gone, even if the producer dropped its own tensor first; such blocks wait in a
  limbo that is collected when another shared block is freed, by :func:`ipc_collect`, and
  before an allocation would fail. Received storages cannot be resized and cannot be sent on
  ("Consider cloning before sending", as CUDA says).
* **Memory stats.** The producer counts shared blocks as allocated until its consumers release
  them; the consumer's allocator does not count memory it received (CUDA counts IPC-opened
  memory in neither ``memory_allocated`` nor ``memory_reserved`` of the receiver).
* **Errors never hang.** ``Queue.put`` pickles in a feeder thread, whose exceptions are only
  printed while the receiver waits forever. When sharing a neuron tensor fails there, the
  exception is sent instead and raised by the receiver's ``get()``.
* **Fork.** A process forked after the device was initialised cannot use it (CUDA's rule), so
  it can neither receive nor send neuron tensors: use the ``spawn`` or ``forkserver`` start
  methods, as with CUDA. The same holds for DataLoader workers.
"""

from __future__ import annotations

import os
import threading
from multiprocessing import reduction
from typing import Any, Callable

import torch
import torch.multiprocessing.reductions as _reductions

from .. import _C

__all__ = ["ipc_collect"]

_FEEDER_THREAD = "QueueFeederThread"  # multiprocessing.queues.Queue's pickling thread


def ipc_collect() -> None:
    """Free device memory that consumer processes have released (``torch.cuda.ipc_collect``).

    Blocks shared with other processes stay allocated after the producer drops them until the
    consumers release them too; this returns those to the caching allocator now."""
    _C._ipc_collect()


def _raise(exc: BaseException) -> None:
    raise exc


def _in_receiver_on_feeder_error(reduce: Callable[[Any], tuple], obj: Any) -> tuple:
    """``reduce(obj)``, but an exception raised in a queue's feeder thread (where nobody would
    see it and the receiver would block forever) is sent to the receiver instead."""
    try:
        return reduce(obj)
    except Exception as exc:
        if threading.current_thread().name != _FEEDER_THREAD:
            raise
        return (_raise, (exc,))


def _rebuild_empty_storage(device: int) -> torch.UntypedStorage:
    return torch.UntypedStorage(0, device=torch.device("neuron", device))


def _rebuild_neuron_storage(device: int, dup_fd: Any, offset: int, nbytes: int,
                            counter_offset: int) -> torch.UntypedStorage:
    fd = dup_fd.detach()
    try:
        st = os.fstat(fd)
        # One storage per (file, offset) in this process, as CUDA keys by (handle, offset): a
        # storage sent twice maps once, and the extra reference is returned at once.
        key = ("neuron", st.st_dev, st.st_ino, offset)
        storage = _reductions.storage_from_cache(torch.UntypedStorage, key)
        if storage is not None:
            _C._ipc_release_counter(fd, counter_offset)
            return storage
        storage = _C._ipc_import(device, fd, offset, nbytes, counter_offset)
        _reductions.shared_cache[key] = _reductions.StorageWeakRef(storage)
        return storage
    finally:
        os.close(fd)


def _reduce_neuron_storage(storage: torch.UntypedStorage) -> tuple:
    if storage.nbytes() == 0:
        return (_rebuild_empty_storage, (storage.device.index,))
    device, fd, offset, nbytes, counter_offset = _C._ipc_export(storage)
    # DupFd duplicates the descriptor now and hands it to the receiver (through the resource
    # sharer, or the spawned child's inherited fds), like CPU tensors' shared memory.
    return (_rebuild_neuron_storage,
            (device, reduction.DupFd(fd), offset, nbytes, counter_offset))


def _reduce_storage(storage: torch.UntypedStorage) -> tuple:
    if storage.device.type == "neuron":
        return _in_receiver_on_feeder_error(_reduce_neuron_storage, storage)
    return _reductions.reduce_storage(storage)


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    # torch's reduction handles neuron tensors as CPU ones (rebuild around the storage, which
    # _reduce_storage shares); this only routes its errors (non-leaf tensors requiring grad)
    # away from a queue's feeder thread.
    if tensor.device.type == "neuron":
        return _in_receiver_on_feeder_error(_reductions.reduce_tensor, tensor)
    return _reductions.reduce_tensor(tensor)


def install() -> None:
    """Register the neuron reductions with ``ForkingPickler`` (idempotent).

    Replaces torch's reducer wherever torch registered ``reduce_tensor`` (every tensor class and
    Parameter) or ``reduce_storage`` (``UntypedStorage``); the replacements hand everything that
    is not on neuron back to torch's functions."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reductions first)

    reducers = reduction.ForkingPickler._extra_reducers
    for cls, fn in list(reducers.items()):
        if fn is _reductions.reduce_tensor:
            reduction.register(cls, _reduce_tensor)
        elif fn is _reductions.reduce_storage:
            reduction.register(cls, _reduce_storage)
    _patch_is_shared()


def _patch_is_shared() -> None:
    """``Storage.is_shared()`` (and ``Tensor.is_shared()``) is True for CUDA storages, whose
    memory can always be shared; torch 2.13 answers False for every other device. Neuron
    memory is always shareable too."""
    original = torch.UntypedStorage.is_shared
    if getattr(original, "_torchneuron", False):
        return

    def is_shared(self) -> bool:
        return self.device.type == "neuron" or original(self)

    is_shared._torchneuron = True
    is_shared.__doc__ = original.__doc__
    torch.UntypedStorage.is_shared = is_shared
