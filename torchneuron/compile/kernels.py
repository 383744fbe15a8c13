"""Inductor's C++ kernels for neuron graphs, queued on the execution engine.

Inductor builds each fused kernel of a neuron graph as a C++ function with a Python binding
(``async_compile.cpp_pybinding``), as for the CPU. The neuron wrapper (:mod:`.inductor`) builds it
through :func:`cpp_pybinding` instead, which appends a *packed entry point* to the source (one
``int64_t`` slot per argument, so that the C++ core calls every kernel through one signature) and
registers it with the core. The wrapper then calls ``_kernel_call(kernel.handle, *args)``: the core
reads the arguments' pointers and numbers at the call and queues the kernel on the current
stream like an eager op (``csrc/backend/compiled_kernels.cpp``), so compiled code runs ahead of
the device, in stream order with eager work, and can be recorded by a graph capture. Inductor's
own binding stays the kernel's ``__call__`` (the profiler's attributed launches use it).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Sequence

__all__ = ["NeuronCppKernel", "cpp_pybinding"]

_ENTRY = "torchneuron_kernel_packed"


def _kind(argtype: str) -> str:
    """'p' (a pointer the kernel reads), 'o' (one it writes: Inductor's outputs and in-place
    buffers are its non-const pointers), 'i' (integer) or 'f' (float) for a C++ argument type of
    Inductor's bindings."""
    t = argtype.replace("const ", "").strip()
    if t.endswith("*"):
        return "p" if "const " in argtype else "o"
    if t in ("int64_t", "long", "uintptr_t", "int32_t", "int", "bool"):
        return "i"
    if t in ("float", "double"):
        return "f"
    raise NotImplementedError(f"neuron: compiled kernel argument of C++ type {argtype!r} "
                              "cannot be queued (expected a pointer, an integer or a float)")


def _packed_entry(argtypes: Sequence[str]) -> str:
    """C++ source of the packed entry point calling Inductor's ``kernel`` with ``argtypes``."""
    casts = []
    for n, argtype in enumerate(argtypes):
        kind = _kind(argtype)
        t = argtype.strip()
        if kind in "po":
            casts.append(f"reinterpret_cast<{t}>(s[{n}])")
        elif kind == "i":
            casts.append(f"static_cast<{t.replace('const ', '')}>(s[{n}])")
        else:  # the core stores a double's bits; narrowed as Inductor's binding narrows it
            casts.append(f"static_cast<{t.replace('const ', '')}>(__builtin_bit_cast(double, s[{n}]))")
    return ("\n// torchneuron: one signature for every kernel, so the execution engine can queue it.\n"
            f'extern "C" void {_ENTRY}(const int64_t* s) {{\n'
            f"    kernel({', '.join(casts)});\n}}\n")


class NeuronCppKernel:
    """A compiled neuron kernel: callable as Inductor's binding (synchronously, with tensors),
    and queued by the core through ``handle``."""

    __slots__ = ("binding", "handle", "name")

    def __init__(self, binding: Any, handle: int, name: str) -> None:
        self.binding = binding
        self.handle = handle
        self.name = name

    def __call__(self, *args: Any) -> None:
        return self.binding(*args)


def _load(binding: Any, name: str, argtypes: Sequence[str]) -> NeuronCppKernel:
    from .. import _C

    module = getattr(binding, "__self__", None) or sys.modules[binding.__module__]
    entry = ctypes.cast(getattr(ctypes.CDLL(module.__file__), _ENTRY), ctypes.c_void_p).value
    kinds = "".join(_kind(t) for t in argtypes)
    return NeuronCppKernel(binding, _C._kernel_register(entry, name, kinds), name)


def cpp_pybinding(async_compile: Any, name: str, argtypes: Sequence[str], source: str) -> Any:
    """``async_compile.cpp_pybinding(argtypes, source)`` for neuron: the same kernel, with the
    packed entry point the execution engine calls. Returns a :class:`NeuronCppKernel`, or a
    future of one when Inductor compiles in worker processes."""
    from torch._inductor.codecache import CodeCacheFuture, LambdaFuture

    argtypes = list(argtypes)
    built = async_compile.cpp_pybinding(argtypes, source + _packed_entry(argtypes))
    if isinstance(built, CodeCacheFuture):
        return LambdaFuture(lambda: _load(built.result(), name, argtypes))
    return _load(built, name, argtypes)
