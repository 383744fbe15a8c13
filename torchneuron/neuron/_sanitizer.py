"""Neuron stream sanitizer: finds unsynchronized cross-stream use of tensors.

The neuron counterpart of PyTorch's CUDA sanitizer (``torch.cuda._sanitizer``), and built from
it. Every ATen op on neuron tensors is seen by a ``TorchDispatchMode`` as a kernel launch on the
current stream of the tensors' device, reading its input tensors and writing its mutated
arguments and outputs. Each stream keeps a vector clock (the last kernel of every stream it is
known to be ordered after); ``Event.record`` / ``wait``, ``Stream.wait_stream`` /
``wait_event``, and stream, event and device synchronizations (also a blocking copy to the host,
like CUDA's ``memcpy_and_sync``) advance the clocks, reported by the C++ guard through
PyTorch's GPU trace hooks (``torch.neuron._gpu_trace``). An access is a data race when the
previous conflicting access to the same tensor (write after read, read after write, write after
write) happened on another stream that the current stream is not ordered after.

The device executes synchronously, so such races cannot corrupt data here: they would on
Trainium, and the sanitizer reports them with both accesses' Python stacks.

Enable with ``TORCHNEURON_STREAM_SANITIZER=1`` (read when torchneuron loads) or
:func:`enable_neuron_sanitizer`, as early as possible in the program. Each detected race is
printed to stderr and the op raises :class:`NeuronSanitizerErrors`. The mode is pushed on the
calling thread, as CUDA's: ops run by other threads are not checked.

Reused from ``torch.cuda._sanitizer`` (device-agnostic): the vector clocks
(``StreamSynchronizations``), the access bookkeeping and conflict check (``EventHandler``),
schema-based argument parsing (``ArgumentHandler``), the access record and error type.
Neuron-specific: which tensors count (neuron, not CUDA), the stream of an op (the current stream
of the tensors' device, not of the current device), device synchronization of one device only,
syncs that happen inside an op (``.cpu()``, ``.item()``) ordered after that op's own access, and error
messages naming the tensor (shape, dtype, device) and streams as ``neuron:<device>`` stream ids.
"""

from __future__ import annotations

import io
import os
import sys
import textwrap
import threading
from typing import Any, Optional

import torch
import torch.cuda._sanitizer as _csan  # pure Python; importing it needs no CUDA
from torch.utils._python_dispatch import TorchDispatchMode

from . import _gpu_trace

__all__ = ["NeuronSanitizerErrors", "NeuronUnsynchronizedAccessError", "NeuronSanitizer",
           "enable_neuron_sanitizer", "disable_neuron_sanitizer", "neuron_sanitizer"]

aten = torch.ops.aten
ENV_VAR = "TORCHNEURON_STREAM_SANITIZER"


def _stream_name(handle: int) -> str:
    device, stream_id = _gpu_trace.decode_stream(handle)
    kind = "default stream" if stream_id == 0 else f"stream {stream_id}"
    return f"neuron:{device} {kind}"


class NeuronUnsynchronizedAccessError(_csan.UnsynchronizedAccessError):
    """Two accesses to one tensor on different streams with nothing ordering them."""

    def __init__(self, error: _csan.UnsynchronizedAccessError, tensor: str):
        super().__init__(error.data_ptr, error.allocation_stack_trace, error.current_access,
                         error.previous_access)
        self.tensor = tensor

    def __str__(self) -> str:
        def format_access(access: _csan.Access) -> None:
            message.write(f"{access.operator}\n{access.type}")
            if access.aliases:
                message.write(" argument(s) " + ", ".join(access.aliases))
                if access.is_output:
                    message.write(", and to")
            if access.is_output:
                message.write(" the output")
            message.write(f"\nWith stack trace:\n{''.join(access.stack_trace.format())}\n")

        with io.StringIO() as message:
            message.write(textwrap.dedent(f"""\
                ============================
                Neuron stream sanitizer detected a possible data race on tensor {self.tensor} \
                with data pointer {self.data_ptr}
                Access by {_stream_name(self.current_access.stream)} during kernel:
                """))
            format_access(self.current_access)
            message.write(f"Previous access by {_stream_name(self.previous_access.stream)} "
                          "during kernel:\n")
            format_access(self.previous_access)
            if self.allocation_stack_trace:
                message.write("Tensor was allocated with stack trace:\n"
                              f"{''.join(self.allocation_stack_trace.format())}")
            else:
                message.write("Trace for tensor allocation not found.")
            message.write("\nOrder the two streams (event record/wait, Stream.wait_stream or a "
                          "synchronize) before the second access.\n")
            return message.getvalue()


class NeuronSanitizerErrors(_csan.CUDASanitizerErrors):
    """Raised by an op for the data races the neuron stream sanitizer found at that op."""

    def __str__(self) -> str:
        return f"detected {len(self.errors)} errors\n" + "\n".join(str(e) for e in self.errors)


class _EventHandler(_csan.EventHandler):
    def _handle_device_synchronization(self) -> None:
        # Only the synchronized device's streams (PyTorch's hook carries no device index; the
        # C++ side hands it over in trace_details). Then every stream and the host are
        # ordered after them, as CUDA's sync_all_streams does for all devices.
        device, _ = _gpu_trace.trace_details()
        syncs = self.syncs
        for stream, state in syncs.current_sync_states.items():
            if device < 0 or _gpu_trace.decode_stream(stream)[0] == device:
                syncs.host_sync_state[stream] = state.get(stream, 0)
        for state in syncs.current_sync_states.values():
            syncs._state_wait_for_other(state, syncs.host_sync_state)


class _ArgumentHandler(_csan.ArgumentHandler):
    """CUDA's schema-driven argument parsing, for neuron tensors; remembers their device and a
    description of each tensor for the report."""

    def __init__(self) -> None:
        super().__init__()
        self.device: Optional[int] = None
        self.described: dict[int, str] = {}

    def _handle_argument(self, value: Any, is_write: bool, metadata_only: bool,
                         name: Optional[str] = None, is_output: bool = False) -> None:
        if not (isinstance(value, torch.Tensor) and value.device.type == "neuron"):
            return
        if self.device is None:
            self.device = value.device.index
        data_ptr = value.data_ptr() or id(value)
        if data_ptr not in self.described:
            self.described[data_ptr] = (f"{list(value.shape)} {str(value.dtype).split('.')[-1]} "
                                        f"on {value.device}")
        if is_write:
            self.dataptrs_written.add(data_ptr)
        elif not metadata_only:
            self.dataptrs_read.add(data_ptr)
        self.tensor_aliases.setdefault(data_ptr, [])
        if name is not None:
            self.tensor_aliases[data_ptr].append(name)
        if is_output:
            self.outputs.add(data_ptr)


class NeuronSanitizerDispatchMode(TorchDispatchMode):
    """Sees every op, hands neuron kernel launches to the race detector."""

    def __init__(self) -> None:
        super().__init__()
        self.event_handler = _EventHandler()
        self._local = threading.local()
        h, t = self.event_handler, _gpu_trace
        self._callbacks = [
            (t.EventCreationCallbacks, h._handle_event_creation),
            (t.EventDeletionCallbacks, h._handle_event_deletion),
            (t.EventRecordCallbacks, h._handle_event_record),
            (t.EventWaitCallbacks, h._handle_event_wait),
            (t.MemoryAllocationCallbacks, h._handle_memory_allocation),
            (t.MemoryDeallocationCallbacks, h._handle_memory_deallocation),
            (t.StreamCreationCallbacks, h._handle_stream_creation),
            (t.DeviceSynchronizationCallbacks, h._handle_device_synchronization),
            (t.StreamSynchronizationCallbacks, self._on_stream_synchronization),
            (t.EventSynchronizationCallbacks, h._handle_event_synchronization),
        ]
        for registry, callback in self._callbacks:
            registry.add_callback(callback)

    def close(self) -> None:
        """Unregister this mode's trace callbacks (its recorded state is dropped)."""
        for registry, callback in self._callbacks:
            if callback in registry.callback_list:
                registry.callback_list.remove(callback)
        self._callbacks = []

    def _on_stream_synchronization(self, stream: int) -> None:
        self.event_handler._handle_stream_synchronization(stream)
        pending = getattr(self._local, "syncs_in_op", None)
        if pending is not None:
            pending.append(stream)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.record_stream.default:  # not a kernel launch
            return func(*args, **kwargs)
        is_factory = bool(_csan.FACTORY_FUNCTION_REGEX.match(func._schema.name))
        handler = _ArgumentHandler()
        handler.parse_inputs(func._schema, args, kwargs, is_factory=is_factory)
        outer = getattr(self._local, "syncs_in_op", None)
        self._local.syncs_in_op = syncs = []
        try:
            outputs = func(*args, **kwargs)
        finally:
            self._local.syncs_in_op = outer
        handler.parse_outputs(func._schema, outputs, is_factory=is_factory)
        if handler.device is None:  # no neuron tensor: not a neuron kernel
            return outputs
        stream = _gpu_trace.encode_stream(
            handler.device, torch.accelerator.current_stream(handler.device).stream_id)
        errors = self.event_handler._handle_kernel_launch(
            stream,
            handler.dataptrs_read - handler.dataptrs_written,
            handler.dataptrs_written,
            handler.outputs,
            func._schema,
            handler.tensor_aliases,
        )
        # The host waited for a stream inside the op (.cpu(), .item()): that wait follows the
        # op's own access, which the hook could not know yet.
        for s in syncs:
            self.event_handler._handle_stream_synchronization(s)
        if errors:
            errors = [NeuronUnsynchronizedAccessError(e, handler.described.get(e.data_ptr, "?"))
                      if isinstance(e, _csan.UnsynchronizedAccessError) else e for e in errors]
            for error in errors:
                print(error, file=sys.stderr)
            raise NeuronSanitizerErrors(errors)
        return outputs


class NeuronSanitizer:
    """Owns the dispatch mode for the lifetime of the program (as ``CUDASanitizer``)."""

    def __init__(self) -> None:
        self.dispatch: Optional[NeuronSanitizerDispatchMode] = None
        self.enabled = False

    def enable(self) -> None:
        if self.enabled:
            return
        if self.dispatch is None:
            self.dispatch = NeuronSanitizerDispatchMode()
        _gpu_trace.activate()
        self.dispatch.__enter__()
        self.enabled = True

    def disable(self) -> None:
        if not self.enabled:
            return
        self.dispatch.__exit__(None, None, None)
        _gpu_trace.deactivate()
        self.enabled = False

    def __del__(self) -> None:
        if (sys is not None) and (not sys.is_finalizing()) and self.enabled:
            self.disable()


def enable_neuron_sanitizer() -> None:
    """Enable the neuron stream sanitizer on the calling thread (as
    ``torch.cuda._sanitizer.enable_cuda_sanitizer``).

    From here on every op on neuron tensors is checked for accesses that race with an access on
    another stream; a race is printed to stderr with both Python stacks and raised as
    :class:`NeuronSanitizerErrors`. Enable it at the start of the program: tensors used before
    are tracked from their first access only (their allocation stack is unknown)."""
    neuron_sanitizer.enable()


def disable_neuron_sanitizer() -> None:
    """Stop checking (the recorded accesses are kept and used again if re-enabled)."""
    neuron_sanitizer.disable()


neuron_sanitizer = NeuronSanitizer()


def _enable_from_env() -> None:
    """``TORCHNEURON_STREAM_SANITIZER=1`` at load time enables the sanitizer."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(f"{ENV_VAR}={value!r}: expected 1 (enable) or 0 (disable)")
    enable_neuron_sanitizer()
