"""Streams and events (``torch.neuron.Stream`` / ``Event``), like ``torch.cuda.streams``.

Built on ``torch.Stream`` and ``torch.Event``, which the C++ device guard implements. The
emulated device executes synchronously, so work is complete when it is submitted; ordering
primitives therefore hold trivially, ``query`` is always true and timing is real host time.

What stays observable is what the *host* knows: memory freed by the caching allocator while
another stream used it (``Tensor.record_stream``) is reused only after the host has observed
that stream past the free — ``Stream.synchronize``, ``Event.synchronize``, a ``query`` (true),
``torch.neuron.synchronize``, or a blocking copy to the host on it — as on an asynchronous
device. The stream sanitizer (``torch.neuron._sanitizer``, ``TORCHNEURON_STREAM_SANITIZER=1``)
reports cross-stream tensor use that nothing orders.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _C
from ._utils import _get_device_index

__all__ = ["Stream", "Event", "StreamContext", "stream", "current_stream", "default_stream",
           "set_stream", "synchronize"]


class Stream(torch.Stream):
    """An ordered queue of work on one neuron device.

    Args:
        device: the device (default: current).
        priority: 0 (default) or a negative number for high priority. With the execution
            engine on, a high-priority stream's queued work runs before earlier work of
            normal streams (docs/architecture.md, "Execution engine").
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if "stream_id" in kwargs:  # wrapping an existing stream
            return super().__new__(cls, **kwargs)
        torch.neuron._lazy_init()
        index = _get_device_index(device, optional=True)
        torch.neuron._check_index(index)
        return super().__new__(cls, device=torch.device("neuron", index), priority=priority)

    @property
    def priority(self) -> int:
        """0 for normal streams, -1 for high-priority ones (any negative request gives -1)."""
        return _C._stream_priority(self.stream_id)

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """``(least, greatest)`` priority, as ``torch.cuda.Stream.priority_range``: (0, -1)."""
        return (0, -1)

    def query(self) -> bool:
        """Whether all work submitted to this stream so far has completed (always, unless the
        execution engine queued some: ``torch.neuron.engine``). If so, the host thereby observes
        the stream idle (memory freed across streams may be reused)."""
        return super().query()

    def wait_stream(self, stream: torch.Stream) -> None:
        """Make future work on this stream wait for all work queued on ``stream`` so far."""
        self.wait_event(stream.record_event())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, torch.Stream):
            return super().__eq__(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device=neuron:{self.device_index} stream_id={self.stream_id}>"


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


class _EventMeta(type):
    # torch.Event's C++ methods accept only exact torch.Event objects as the *other* event
    # (elapsed_time, wait), so neuron events are plain torch.Events on the neuron device and
    # isinstance() recognises them.
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == "neuron"


class Event(metaclass=_EventMeta):
    """A marker in a stream, for synchronization and timing (a ``torch.Event`` on neuron).

    Args:
        enable_timing: record time so ``elapsed_time`` works.
        blocking: accepted for CUDA compatibility (synchronize always blocks here).
        interprocess: not supported by the emulated device.

    Methods (from ``torch.Event``): ``record(stream=None)``, ``wait(stream=None)``, ``query()``,
    ``synchronize()``, ``elapsed_time(end_event)`` in milliseconds.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False) -> torch.Event:  # type: ignore[misc]
        if interprocess:
            raise NotImplementedError("interprocess events are not supported by the emulated neuron device")
        torch.neuron._lazy_init()
        return torch.Event(torch.device("neuron", torch.neuron.current_device()),
                           enable_timing=enable_timing, blocking=blocking)


class StreamContext:
    """Context manager that makes ``stream`` current on its device (None: no-op)."""

    def __init__(self, stream: Optional[torch.Stream]):
        self.stream = stream
        self._prev_stream: Optional[torch.Stream] = None
        self._prev_device: Optional[int] = None

    def __enter__(self) -> Optional[torch.Stream]:
        if self.stream is None:
            return None
        self._prev_device = torch.neuron.current_device()
        if self.stream.device_index != self._prev_device:
            torch.neuron.set_device(self.stream.device_index)
        self._prev_stream = torch.accelerator.current_stream(self.stream.device_index)
        torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if self.stream is None:
            return
        torch.accelerator.set_stream(self._prev_stream)
        if self._prev_device is not None and torch.neuron.current_device() != self._prev_device:
            torch.neuron.set_device(self._prev_device)


def stream(stream: Optional[torch.Stream]) -> StreamContext:
    """``with torch.neuron.stream(s):`` — run the block with ``s`` as the current stream."""
    return StreamContext(stream)


def current_stream(device: Any = None) -> Stream:
    """The current stream of ``device`` (default: current device)."""
    torch.neuron._lazy_init()
    index = _get_device_index(device, optional=True)
    torch.neuron._check_index(index)
    return _wrap(torch.accelerator.current_stream(index))


def default_stream(device: Any = None) -> Stream:
    """The default stream of ``device``."""
    torch.neuron._lazy_init()
    index = _get_device_index(device, optional=True)
    torch.neuron._check_index(index)
    return Stream(stream_id=0, device_index=index, device_type=_PRIVATEUSE1)


# c10::DeviceType::PrivateUse1, as torch.Stream stores device types.
_PRIVATEUSE1 = 20


def set_stream(stream: torch.Stream) -> None:
    """Make ``stream`` the current stream of its device."""
    if stream is None:
        return
    torch.accelerator.set_stream(stream)


def synchronize(device: Any = None) -> None:
    """Wait for all work on ``device`` (all its streams) to finish."""
    torch.neuron._lazy_init()
    index = _get_device_index(device, optional=True)
    torch.neuron._check_index(index)
    torch.accelerator.synchronize(index)
