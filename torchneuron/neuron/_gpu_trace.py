"""GPU trace callbacks for neuron (``torch.neuron._gpu_trace``), as ``torch.cuda._gpu_trace``.

The C++ device guard and allocator report stream creation, event creation / record / wait /
synchronization / deletion, stream and device synchronizations and device memory allocation /
deallocation through PyTorch's ``c10::impl::GPUTrace`` hooks; PyTorch calls the registries below
by name (``torch.<device>._gpu_trace.<Registry>.fire_callbacks``). The stream sanitizer
(:mod:`torchneuron.neuron._sanitizer`) is their user.

Streams are reported as one integer, ``(device_index << 32) | stream_id`` (see
:func:`decode_stream`); events as the address of the runtime event. Nothing is reported until
:func:`activate` is called: a CUDA tool activating PyTorch's GPU trace must not slow neuron down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch._utils import CallbackRegistry

from .. import _C

__all__ = [
    "activate", "deactivate", "decode_stream", "encode_stream",
    "register_callback_for_event_creation", "register_callback_for_event_deletion",
    "register_callback_for_event_record", "register_callback_for_event_wait",
    "register_callback_for_memory_allocation", "register_callback_for_memory_deallocation",
    "register_callback_for_stream_creation", "register_callback_for_device_synchronization",
    "register_callback_for_stream_synchronization", "register_callback_for_event_synchronization",
]

EventCreationCallbacks: "CallbackRegistry[int]" = CallbackRegistry("neuron event creation")
EventDeletionCallbacks: "CallbackRegistry[int]" = CallbackRegistry("neuron event deletion")
EventRecordCallbacks: "CallbackRegistry[int, int]" = CallbackRegistry("neuron event record")
EventWaitCallbacks: "CallbackRegistry[int, int]" = CallbackRegistry("neuron event wait")
MemoryAllocationCallbacks: "CallbackRegistry[int]" = CallbackRegistry("neuron memory allocation")
MemoryDeallocationCallbacks: "CallbackRegistry[int]" = CallbackRegistry(
    "neuron memory deallocation")
StreamCreationCallbacks: "CallbackRegistry[int]" = CallbackRegistry("neuron stream creation")
DeviceSynchronizationCallbacks: "CallbackRegistry[[]]" = CallbackRegistry(
    "neuron device synchronization")
StreamSynchronizationCallbacks: "CallbackRegistry[int]" = CallbackRegistry(
    "neuron stream synchronization")
EventSynchronizationCallbacks: "CallbackRegistry[int]" = CallbackRegistry(
    "neuron event synchronization")


_users = 0
_users_lock = threading.Lock()


def activate() -> None:
    """Start reporting neuron stream, event and memory activity to the registered callbacks.

    Counted: reporting stops when every ``activate`` has been matched by a :func:`deactivate`."""
    global _users
    with _users_lock:
        torch._C._activate_gpu_trace()  # PyTorch's switch (process-wide, cannot be undone)
        _users += 1
        _C._gpu_trace_set_enabled(True)


def deactivate() -> None:
    """Undo one :func:`activate` (PyTorch's GPU trace itself stays active)."""
    global _users
    with _users_lock:
        _users = max(0, _users - 1)
        _C._gpu_trace_set_enabled(_users > 0)


def encode_stream(device_index: int, stream_id: int) -> int:
    """The integer a neuron stream is reported as."""
    return (device_index << 32) | (stream_id & 0xFFFFFFFF)


def decode_stream(handle: int) -> tuple[int, int]:
    """``(device_index, stream_id)`` of a reported stream."""
    return handle >> 32, handle & 0xFFFFFFFF


def trace_details() -> tuple[int, int]:
    """Inside a callback: ``(device_index, nbytes)`` of the device synchronization, allocation
    or deallocation being reported (PyTorch's hooks carry only a pointer)."""
    return _C._gpu_trace_details()


def register_callback_for_event_creation(cb: Callable[[int], None]) -> None:
    EventCreationCallbacks.add_callback(cb)


def register_callback_for_event_deletion(cb: Callable[[int], None]) -> None:
    EventDeletionCallbacks.add_callback(cb)


def register_callback_for_event_record(cb: Callable[[int, int], None]) -> None:
    EventRecordCallbacks.add_callback(cb)


def register_callback_for_event_wait(cb: Callable[[int, int], None]) -> None:
    EventWaitCallbacks.add_callback(cb)


def register_callback_for_memory_allocation(cb: Callable[[int], None]) -> None:
    MemoryAllocationCallbacks.add_callback(cb)


def register_callback_for_memory_deallocation(cb: Callable[[int], None]) -> None:
    MemoryDeallocationCallbacks.add_callback(cb)


def register_callback_for_stream_creation(cb: Callable[[int], None]) -> None:
    StreamCreationCallbacks.add_callback(cb)


def register_callback_for_device_synchronization(cb: Callable[[], None]) -> None:
    DeviceSynchronizationCallbacks.add_callback(cb)


def register_callback_for_stream_synchronization(cb: Callable[[int], None]) -> None:
    StreamSynchronizationCallbacks.add_callback(cb)


def register_callback_for_event_synchronization(cb: Callable[[int], None]) -> None:
    EventSynchronizationCallbacks.add_callback(cb)
