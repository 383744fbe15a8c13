"""Inductor code generation for ``neuron``.

Neuron memory is host memory, so Inductor's C++ kernels (``CppScheduling``: fused, vectorised
pointwise/reduction loops over raw data pointers) run on neuron buffers unchanged. What is
device-specific lives here:

* :class:`NeuronPythonWrapperCodegen` - the host-side wrapper. It allocates every buffer on
  the *neuron* device (``empty_strided(..., device='neuron:<i>')``) and calls the C++ kernels
  directly, which the stock wrapper refuses to do for a non-CPU device ("device neuron nyi").
* :class:`NeuronDeviceOpOverrides` - device guard / synchronize snippets used by the wrapper.
* :func:`register` - registers both, plus the Dynamo device interface and the small set of
  Inductor patches in :mod:`.inductor_patches`.

The emulated device executes synchronously in submission order, so running the kernels on
the calling thread *is* running them on the current neuron stream.
"""

from __future__ import annotations

import threading
from textwrap import dedent

import torch
from torch._inductor.codegen.common import (
    DeviceOpOverrides,
    register_backend_for_device,
    register_device_op_overrides,
)
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.virtualized import V

_lock = threading.Lock()
_registered = False


class _NeuronWrapperMixin:
    """Overrides shared by the top-level and subgraph wrappers."""

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True,
                                     **kwargs):
        device = device or V.graph.get_current_device_or_throw()
        if not triton and device.type == "neuron":
            # C++ kernel over raw pointers: a plain call, as for CPU.
            self.writeline(self.wrap_kernel_call(kernel_name, call_args))
            return
        return super()._generate_kernel_call_helper(  # type: ignore[misc]
            kernel_name, call_args, device=device, triton=triton, **kwargs)

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None,
                        is_pinned=False):
        if device.type != "neuron":
            return super().make_allocation(  # type: ignore[misc]
                name, device, dtype, shape, stride, allocation_shape, is_pinned)
        if allocation_shape is None:
            allocation_shape = shape
        # Keep the device index: the stock code writes device='neuron', i.e. the *current*
        # device, which is wrong for a graph whose inputs live on neuron:1.
        dev = f"neuron:{device.index}" if device.index is not None else "neuron"
        line = (f"{name} = empty_strided({self.codegen_python_shape_tuple(allocation_shape)}, "
                f"{self.codegen_python_shape_tuple(stride)}, device='{dev}', dtype={dtype})")
        if allocation_shape != shape:
            line += (f".as_strided({self.codegen_python_shape_tuple(shape)}, "
                     f"{self.codegen_python_shape_tuple(stride)})")
        return line


class NeuronSubgraphPythonWrapperCodegen(_NeuronWrapperMixin, SubgraphPythonWrapperCodegen):
    """Wrapper for subgraphs (control-flow HOPs, FlexAttention mods) on neuron."""


class NeuronPythonWrapperCodegen(_NeuronWrapperMixin, PythonWrapperCodegen):
    """Python wrapper that launches C++ kernels on neuron buffers."""

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            assert subgraph_name is not None and parent_wrapper is not None
            return NeuronSubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                      partition_signatures)
        return NeuronPythonWrapperCodegen()


class NeuronDeviceOpOverrides(DeviceOpOverrides):
    """Source snippets Inductor emits for device management on neuron."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return dedent(f"""
            def {name}(idx):
                return torch.neuron.current_stream(idx).stream_id
            """)

    def set_device(self, device_idx: int) -> str:
        return f"torch.neuron.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.neuron.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.neuron.device({device_idx})"

    def cpp_kernel_type(self) -> str:
        return "void*"


def register() -> None:
    """Make Inductor able to compile graphs whose tensors live on ``neuron``. Idempotent."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        from . import device_interface, inductor_patches

        device_interface.register()
        # Builds the built-in table first so our entry is not shadowed by auto-registration.
        from torch._inductor.codegen.common import init_backend_registration

        init_backend_registration()
        register_backend_for_device("neuron", CppScheduling, NeuronPythonWrapperCodegen,
                                    CppWrapperCpu)
        register_device_op_overrides("neuron", NeuronDeviceOpOverrides())
        inductor_patches.apply()
        _registered = True
