"""Inductor code generation for ``neuron``.

Neuron memory is host memory, so Inductor's C++ kernels (``CppScheduling``: fused, vectorised
pointwise/reduction loops over raw data pointers) run on neuron buffers unchanged. What is
device-specific lives here:

* :class:`NeuronPythonWrapperCodegen` - the host-side wrapper. It allocates every buffer on
  the *neuron* device (``empty_strided(..., device='neuron:<i>')``) and calls the C++ kernels
  directly, which the stock wrapper refuses to do for a non-CPU device ("device neuron nyi").
* :class:`NeuronDeviceOpOverrides` - device guard / synchronize snippets used by the wrapper.
* :class:`NeuronCppScheduling` - Inductor's C++ scheduling with two changes to the vectorised
  kernels: fp32 ``tanh`` uses SLEEF's 3.5-ULP variant (see :func:`fast_tanh_enabled`) and fp32
  ``erf`` (also as bf16/fp16's fp32 halves) a rational approximation (:func:`fast_erf_enabled`).
* :func:`register` - registers both, plus the Dynamo device interface and the small set of
  Inductor patches in :mod:`.inductor_patches`.

The emulated device executes synchronously in submission order, so running the kernels on
the calling thread *is* running them on the current neuron stream.
"""

from __future__ import annotations

import os
import threading
from textwrap import dedent

import torch
from torch._inductor.codegen.common import (
    DeviceOpOverrides,
    register_backend_for_device,
    register_device_op_overrides,
)
from torch._inductor.codegen.cpp import (
    CppCSEVariable,
    CppKernelProxy,
    CppScheduling,
    CppTile2DKernel,
    CppTile2DOverrides,
    CppVecKernel,
    CppVecOverrides,
)
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen
from torch._inductor.custom_graph_pass import CustomGraphModulePass
from torch._inductor.virtualized import V

_lock = threading.RLock()
_registered = False


def fast_tanh_enabled() -> bool:
    """Whether vectorised fp32 ``tanh`` in neuron kernels uses SLEEF's 3.5-ULP implementation
    (``TORCHNEURON_COMPILE_FAST_TANH``, default on).

    ATen's and Inductor's ``Vectorized<float>::tanh`` call the 1-ULP SLEEF routine, which runs
    double-float arithmetic and costs about 3x the 3.5-ULP one (4.1 vs 1.3 ms per 4M floats on
    one AVX-512 core; measured max error of the fast one 2.25 ULP). Fused kernels are
    compute-bound once memory traffic is gone, and tanh dominates GELU(tanh) and activation
    chains. Trainium's ScalarE evaluates activations by approximation too, so a few ULP is
    within what the real device gives; ``0`` restores bit-identity with CPU Inductor."""
    return os.environ.get("TORCHNEURON_COMPILE_FAST_TANH", "1") != "0"


# Overload set emitted once per translation unit: the fast routine for the single-register
# fp32 vector of the ISA the kernel is built for, ATen's own tanh for every other vector type
# (double, VectorizedN, reduced-precision), so the substitution can never change a type.
_FAST_TANH_HELPERS = r"""
#ifndef TORCHNEURON_FAST_TANH_DEFINED
#define TORCHNEURON_FAST_TANH_DEFINED
template <typename V> inline V neuron_tanh(const V& a) { return a.tanh(); }
#if defined(CPU_CAPABILITY_AVX512) && !defined(_MSC_VER)
inline at::vec::Vectorized<float> neuron_tanh(const at::vec::Vectorized<float>& a) {
  return at::vec::Vectorized<float>(Sleef_tanhf16_u35(a));
}
#elif defined(CPU_CAPABILITY_AVX2) && !defined(_MSC_VER)
inline at::vec::Vectorized<float> neuron_tanh(const at::vec::Vectorized<float>& a) {
  return at::vec::Vectorized<float>(Sleef_tanhf8_u35(a));
}
#endif
#endif
"""


def fast_erf_enabled() -> bool:
    """Whether vectorised ``erf`` over fp32 registers in neuron kernels (fp32 ones, and the fp32
    halves bf16 and fp16 are computed in) uses :data:`_FAST_ERF_HELPERS`
    (``TORCHNEURON_COMPILE_FAST_ERF``, default on).

    ATen's ``Vectorized<float>::erf``, which Inductor emits for GELU and its backward, costs an
    exp and a division besides its polynomial (0.5 ns an element on one AVX-512 core, where
    GELU's other work is 0.15): compiled GELU ran at half eager's speed (oneDNN's GELU). The
    replacement is one rational function of x^2, no exp: 0.27 ns an element, and more accurate
    (max error 6.2 ULP and 3.7e-7 absolute over every float in [0, 5], against ATen's 5.7e-7
    absolute and a relative error up to 100 % below 1e-37). ``0`` restores bit-identity with
    CPU Inductor."""
    return os.environ.get("TORCHNEURON_COMPILE_FAST_ERF", "1") != "0"


# erf(x) = sign(x) * |x| P(x^2) / Q(x^2) for |x| < 4, sign(x) from 4 on (fp32's erf is 1 there).
# P and Q (degrees 6 and 5 in x^2) were fitted to erf(x)/x on [0, 4] for least maximum relative
# error (iteratively reweighted least squares); the fit's own error is 4e-9, the rest is fp32
# evaluation. Written over at::vec::Vectorized<float>, so every ISA Inductor builds for gets it;
# VectorizedN<float, N> (a bf16/fp16 kernel's fp32 halves) applies it per register, and every
# other vector type (double) keeps ATen's erf.
_FAST_ERF_HELPERS = r"""
#ifndef TORCHNEURON_FAST_ERF_DEFINED
#define TORCHNEURON_FAST_ERF_DEFINED
template <typename V> inline V neuron_erf(const V& a) { return a.erf(); }
inline at::vec::Vectorized<float> neuron_erf(const at::vec::Vectorized<float>& x) {
  using Vf = at::vec::Vectorized<float>;
  const Vf ax = x.abs();
  const Vf t = ax * ax;
  Vf p = at::vec::fmadd(t, Vf(-1.414420314e-08f), Vf(4.876038020e-06f));
  p = at::vec::fmadd(p, t, Vf(3.864183091e-04f));
  p = at::vec::fmadd(p, t, Vf(3.850504989e-03f));
  p = at::vec::fmadd(p, t, Vf(5.441354588e-02f));
  p = at::vec::fmadd(p, t, Vf(1.846914738e-01f));
  p = at::vec::fmadd(p, t, Vf(1.128379226e+00f));
  Vf q = at::vec::fmadd(t, Vf(6.493215915e-05f), Vf(1.316990121e-03f));
  q = at::vec::fmadd(q, t, Vf(1.548688207e-02f));
  q = at::vec::fmadd(q, t, Vf(1.138926372e-01f));
  q = at::vec::fmadd(q, t, Vf(4.970120192e-01f));
  q = at::vec::fmadd(q, t, Vf(1.0f));
  // NaN fails the comparison and stays NaN; infinities take the saturated value.
  const Vf y = Vf::blendv((p * ax) / q, Vf(1.0f), ax >= Vf(4.0f));
  return y | (x & Vf(-0.0f));
}
template <int N> inline at::vec::VectorizedN<float, N> neuron_erf(const at::vec::VectorizedN<float, N>& a) {
  at::vec::VectorizedN<float, N> r;
  for (int i = 0; i < N; ++i) r[i] = neuron_erf(a[i]);
  return r;
}
#endif
"""
_PREFIX_INCLUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"


def _vector_only(base, helper: str):
    """An override emitting ``helper(a)`` for vector operands, ``base(a)`` for scalars."""

    def op(a):
        if isinstance(a, CppCSEVariable) and a.is_vec:
            return f"{helper}({a})"
        return base(a)

    return op


def _with_fast_math(overrides):
    """Route vector ``tanh`` and ``erf`` of an overrides instance through
    :data:`_FAST_TANH_HELPERS` and :data:`_FAST_ERF_HELPERS`.

    ``CppVecOverrides.__new__`` rebinds every op on the instance to a scalar/vector dispatching
    wrapper of the *base* implementation, so the overrides go on the instance too, after it,
    and defer to that wrapper for scalars."""
    if fast_tanh_enabled():
        overrides.tanh = _vector_only(overrides.tanh, "neuron_tanh")
    if fast_erf_enabled():
        overrides.erf = _vector_only(overrides.erf, "neuron_erf")
    return overrides


class NeuronCppVecOverrides(CppVecOverrides):
    """Vector op overrides for neuron kernels: ``tanh`` goes through :data:`_FAST_TANH_HELPERS`,
    ``erf`` through :data:`_FAST_ERF_HELPERS`."""

    def __new__(cls, *args, **kwargs):
        return _with_fast_math(super().__new__(cls, *args, **kwargs))


class NeuronCppTile2DOverrides(CppTile2DOverrides):
    """The same for the transposing (2-d tiled) kernels."""

    def __new__(cls, *args, **kwargs):
        return _with_fast_math(super().__new__(cls, *args, **kwargs))


class NeuronCppVecKernel(CppVecKernel):
    overrides = NeuronCppVecOverrides  # type: ignore[assignment]


class NeuronCppTile2DKernel(CppTile2DKernel, NeuronCppVecKernel):
    """Inductor's 2-d tiled kernel (operands in transposed layouts), still a
    :class:`NeuronCppVecKernel`: the kernel proxy's reduction code requires its vector kernels
    to be instances of ``vec_kernel_cls`` (a reduction over two transposed operands failed an
    assertion in it: HF Mamba's backward)."""

    overrides = NeuronCppTile2DOverrides  # type: ignore[assignment]


class NeuronCppKernelProxy(CppKernelProxy):
    vec_kernel_cls = NeuronCppVecKernel
    tile2d_kernel_cls = NeuronCppTile2DKernel


class NeuronCppScheduling(CppScheduling):
    """Inductor's C++ scheduling for neuron buffers, emitting :class:`NeuronCppVecKernel`."""

    kernel_proxy_cls = NeuronCppKernelProxy

    def define_kernel(self, src_code, nodes, kernel_args=None):
        if "neuron_tanh(" in src_code and _PREFIX_INCLUDE in src_code:
            src_code = src_code.replace(_PREFIX_INCLUDE, _PREFIX_INCLUDE + _FAST_TANH_HELPERS, 1)
        if "neuron_erf(" in src_code and _PREFIX_INCLUDE in src_code:
            src_code = src_code.replace(_PREFIX_INCLUDE, _PREFIX_INCLUDE + _FAST_ERF_HELPERS, 1)
        args = self.kernel_group.args if kernel_args is None else kernel_args
        name = super().define_kernel(src_code, nodes, kernel_args)
        # Profiler attribution of the kernel (FX nodes' ops, FLOPs, source lines, module path),
        # emitted as a literal at its call sites (see _NeuronWrapperMixin).
        try:
            from ..profiler.compiled import kernel_info

            outputs = list(args.output_buffers) + list(args.inplace_buffers)
            _kernel_info[name] = kernel_info(nodes, [str(o) for o in outputs])
        except Exception:  # attribution must never break compilation
            _kernel_info.pop(name, None)
        return name


# Kernel name -> profiler info of the graph being generated (a kernel's definition precedes
# its calls in Inductor's codegen).
_kernel_info: dict = {}


class _NeuronWrapperMixin:
    """Overrides shared by the top-level and subgraph wrappers."""

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True,
                                     **kwargs):
        device = device or V.graph.get_current_device_or_throw()
        if not triton and device.type == "neuron":
            # C++ kernel over raw pointers, queued on the execution engine like an eager op
            # (kernels.py; it runs now, after the queue, where the engine cannot queue). While
            # torch.profiler records neuron activities the engine is off and the call is an
            # attributed device activity, through Inductor's own binding after the queue ran;
            # while a graph is captured the recorded kernel keeps its attribution for the
            # replays (profiler/compiled.py, call).
            args = ", ".join(str(a) for a in call_args)
            info = _kernel_info.get(kernel_name)
            if info is not None:
                outs = tuple(i for i, a in enumerate(call_args) if str(a) in info["outputs"])
                info = {k: v for k, v in info.items() if k != "outputs"}
                self.writeline(f"if _nrt_special(): _nrt_attributed({kernel_name}, {info!r}, {outs!r}, {args})")
                self.writeline(f"else: _nrt_call({kernel_name}.handle, {args})")
            else:
                self.writeline(f"_nrt_call({kernel_name}.handle, {args})")
            return
        return super()._generate_kernel_call_helper(  # type: ignore[misc]
            kernel_name, call_args, device=device, triton=triton, **kwargs)

    def define_kernel(self, kernel_name, kernel_body, metadata=None, gpu=True, cpp_definition=None):
        # A C++ kernel's binding, built with the packed entry point the engine queues (kernels.py).
        stock = "async_compile.cpp_pybinding("
        body = kernel_body.lstrip()
        if not gpu and body.startswith(stock):
            kernel_body = f"_nrt_cpp_kernel(async_compile, {kernel_name!r}, " + body[len(stock):]
        return super().define_kernel(kernel_name, kernel_body, metadata=metadata,  # type: ignore[misc]
                                     gpu=gpu, cpp_definition=cpp_definition)

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

    def write_header(self) -> None:
        super().write_header()
        self.imports.writeline("from torchneuron.profiler.compiled import call as _nrt_attributed")
        self.imports.writeline("from torchneuron._C import _trace_or_capture as _nrt_special")
        self.imports.writeline("from torchneuron._C import _kernel_call as _nrt_call")
        self.imports.writeline("from torchneuron.compile.kernels import cpp_pybinding as _nrt_cpp_kernel")

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


class NeuronCppWrapper(CppWrapperCpu):
    """Inductor's C++ wrapper for neuron graphs (``torch._inductor.config.cpp_wrapper = True``,
    and AOTInductor: ``aoti_compile_and_package``): not implemented. The CPU wrapper it would
    extend assumes the model's device is the CPU (constants, the model container) and calls ATen's
    CPU kernels by their C shims, bypassing the dispatcher, hence the neuron kernels and the
    execution engine's queue; a neuron wrapper needs its own shim and runtime. Raising here turns
    Inductor's assertion deep in code generation into an error that names the way out."""

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        raise NotImplementedError(
            "Inductor's C++ wrapper is not implemented for neuron (torch._inductor.config."
            "cpp_wrapper=True, AOTInductor's aoti_compile_and_package / aot_compile): compile "
            "with torch.compile(backend=\"neuron\") and the default Python wrapper, or export and "
            "AOT-compile the model on the CPU.")


def _register_support() -> None:
    """Everything Inductor needs for neuron besides the code generators themselves: the Dynamo
    device interface, the device snippets and the patches. Idempotent; safe to call from inside
    Inductor's ``init_backend_registration`` (it never calls back into it)."""
    from . import device_interface, inductor_patches

    device_interface.register()
    register_device_op_overrides("neuron", NeuronDeviceOpOverrides())
    inductor_patches.apply()


# Names Inductor reads from the device module (``torch.neuron.<name>``) when it builds its
# backend table: ``init_backend_registration`` registers a PrivateUse1 device from them.
DEVICE_MODULE_CODEGENS = {
    "Scheduling": NeuronCppScheduling,
    "PythonWrapperCodegen": NeuronPythonWrapperCodegen,
    "CppWrapperCodegen": NeuronCppWrapper,
    "WrapperFxCodegen": WrapperFxCodegen,  # Inductor requires all four, or registers none
}


def codegen_for_device_module(name: str) -> type:
    """``torch.neuron.<name>`` for Inductor's lookup; registers the rest of the support first,
    so that a graph lowered by Inductor alone (``compile_fx`` called directly) works too."""
    with _lock:
        _register_support()
    return DEVICE_MODULE_CODEGENS[name]


class _CodegenVersion(CustomGraphModulePass):
    """Puts the version of neuron's code generation into Inductor's cache keys. A graph compiled
    with ``backend="inductor"`` (not ``"neuron"``, whose cache is keyed by it, cache.py) is
    generated by the classes above but cached in Inductor's own directory, under a key that
    covers the graph, torch and Inductor's settings: without this, code generated by an older
    torchneuron (e.g. calling a kernel entry point the core no longer has) would be loaded.
    Inductor keys every device's pass by ``uuid()``; it never runs the pass on a graph."""

    def __call__(self, gm: torch.fx.GraphModule) -> None:
        return None

    def uuid(self) -> str:
        from .cache import _source_hash

        return f"torchneuron-codegen-{_source_hash()}"


def register() -> None:
    """Make Inductor able to compile graphs whose tensors live on ``neuron``. Idempotent."""
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        _register_support()
        register_backend_for_device("neuron", NeuronCppScheduling, NeuronPythonWrapperCodegen,
                                    NeuronCppWrapper, WrapperFxCodegen,
                                    device_custom_pass=_CodegenVersion())
        _registered = True
