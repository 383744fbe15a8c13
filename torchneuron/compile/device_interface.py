"""Dynamo/Inductor device interface for ``neuron``.

Inductor looks devices up through ``torch._dynamo.device_interface`` (device guards, stream
handling, properties); 2.13 does not register PrivateUse1 devices by itself, and without an
interface compilation fails with "No interface for device neuron". Everything forwards to
``torch.neuron``, the device module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import DeviceInterface, register_interface_for_device


class NeuronInterface(DeviceInterface):
    """``DeviceInterface`` for the emulated NeuronCores (forwards to ``torch.neuron``)."""

    class Event(torch.Event):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return torch.neuron.Event(*args, **kwargs)

    class Stream(torch.Stream):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return torch.neuron.Stream(*args, **kwargs)

    class device:  # noqa: N801 - mirrors torch.cuda.device
        def __new__(cls, device: Any) -> Any:
            return torch.neuron.device(device)

    class Worker:
        # Used by Inductor's async compile workers; the device module needs no CUDA-style
        # initialisation, so these can simply query it.
        @staticmethod
        def set_device(device: int) -> None:
            torch.neuron.set_device(device)

        @staticmethod
        def current_device() -> int:
            return torch.neuron.current_device()

        @staticmethod
        def get_device_properties(device: Any = None) -> Any:
            return torch.neuron.get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return torch.neuron.current_device()

    @staticmethod
    def set_device(device: Any) -> None:
        torch.neuron.set_device(device)

    @staticmethod
    def exchange_device(device: int) -> int:
        prev = torch.neuron.current_device()
        if device >= 0 and device != prev:
            torch.neuron.set_device(device)
        return prev

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        return NeuronInterface.exchange_device(device)

    @staticmethod
    def device_count() -> int:
        return torch.neuron.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.neuron.is_available()

    @staticmethod
    def stream(stream: torch.Stream) -> Any:
        return torch.neuron.stream(stream)

    @staticmethod
    def current_stream() -> torch.Stream:
        return torch.neuron.current_stream()

    @staticmethod
    def set_stream(stream: torch.Stream) -> None:
        torch.neuron.set_stream(stream)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        torch.neuron.set_stream(torch.Stream(stream_id=stream_id, device_index=device_index,
                                             device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return torch.neuron.current_stream(device_idx).stream_id

    @staticmethod
    def synchronize(device: Any = None) -> None:
        torch.neuron.synchronize(device)

    @classmethod
    def get_device_properties(cls, device: Any = None) -> Any:
        return torch.neuron.get_device_properties(device)

    @staticmethod
    def get_compute_capability(device: Any = None) -> str:
        # Inductor uses this for Triton/CUDA arch decisions only; neuron kernels are C++.
        return ""

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @classmethod
    def is_dtype_supported(cls, dtype: torch.dtype, including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return torch.neuron.memory_allocated(device)

    @staticmethod
    def is_triton_capable(device: Any = None) -> bool:
        # Kernels are generated as C++ (CppScheduling), never Triton.
        return False

    @classmethod
    def raise_if_triton_unavailable(cls, device: Any = None) -> None:
        raise RuntimeError("neuron does not use Triton; kernels are generated as C++")


def register() -> None:
    """Register :class:`NeuronInterface` for ``neuron`` and every ``neuron:<i>``."""
    register_interface_for_device("neuron", NeuronInterface)
    for i in range(torch.neuron.device_count()):
        register_interface_for_device(f"neuron:{i}", NeuronInterface)
