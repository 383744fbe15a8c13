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


# ATen vectorizes fp32 <-> float8_e4m3fn for Inductor's two-register conversions on AVX-512
# (VecConvert<Float8_e4m3fn, 1, float, 2> and back) but float8_e5m2 for one register only, so
# a compiled e5m2 cast (torchao's gradients) fell back to c10's scalar conversion element by
# element: 2 M elements in ~2 ms instead of ~0.3. These are the two missing specializations,
# built from ATen's own one-register conversions (the bits of the e5m2 ones ATen already uses),
# inserted after the kernel's prelude, only where a kernel converts e5m2.
_E5M2_VEC_CONVERT = r"""
#if defined(CPU_CAPABILITY_AVX512) && !defined(TORCHNEURON_E5M2_VEC_CONVERT)
#define TORCHNEURON_E5M2_VEC_CONVERT
namespace at::vec { inline namespace CPU_CAPABILITY {
template <>
struct VecConvert<Float8_e5m2, 1, float, 2> {
  static inline VectorizedN<Float8_e5m2, 1> apply(const VectorizedN<float, 2>& src) {
    __m512i r = _mm512_setzero_si512();
    r = _mm512_inserti32x4(r, cvtfp32_fp8e5m2(src[0]), 0);
    r = _mm512_inserti32x4(r, cvtfp32_fp8e5m2(src[1]), 1);
    return Vectorized<Float8_e5m2>(r);
  }
};
template <>
struct VecConvert<float, 2, Float8_e5m2, 1> {
  static inline VectorizedN<float, 2> apply(const VectorizedN<Float8_e5m2, 1>& src) {
    __m512i v = src[0];
    __m512 lo, hi;
    cvtfp8e5m2_fp32(_mm512_castsi512_si128(v), lo);
    cvtfp8e5m2_fp32(_mm512_extracti32x4_epi32(v, 1), hi);
    return VectorizedN<float, 2>(Vectorized<float>(lo), Vectorized<float>(hi));
  }
};
}}  // namespace at::vec::CPU_CAPABILITY
#endif
"""
_PRELUDE = "#include <torch/csrc/inductor/cpp_prefix.h>\n"


def _with_vec_converts(source: str) -> str:
    """`source` with the e5m2 two-register conversions declared after its prelude, if it uses one."""
    if "Float8_e5m2,1,float,2" not in source and "float,2,at::Float8_e5m2,1" not in source:
        return source
    at = source.find(_PRELUDE)
    if at < 0:
        return source
    at += len(_PRELUDE)
    return source[:at] + _E5M2_VEC_CONVERT + source[at:]


def cpp_pybinding(async_compile: Any, name: str, argtypes: Sequence[str], source: str) -> Any:
    """``async_compile.cpp_pybinding(argtypes, source)`` for neuron: the same kernel, with the
    packed entry point the execution engine calls. Returns a :class:`NeuronCppKernel`, or a
    future of one when Inductor compiles in worker processes."""
    from torch._inductor.codecache import CodeCacheFuture, LambdaFuture

    argtypes = list(argtypes)
    built = async_compile.cpp_pybinding(argtypes, _with_vec_converts(source) + _packed_entry(argtypes))
    if isinstance(built, CodeCacheFuture):
        return LambdaFuture(lambda: _load(built.result(), name, argtypes))
    return _load(built, name, argtypes)
