"""Compiled graphs' C++ kernels run on the execution engine (compile/kernels.py,
csrc/backend/compiled_kernels.cpp): queued like eager ops, in stream order with them, recorded
by graph captures, errors surfacing at the next synchronization point; synchronous where the
engine cannot queue or a kernel reads host memory."""

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.utils import run_and_get_code

from compile_models import DEV
from support import run_python
from torchneuron import _C
from torchneuron.compile import kernels
from torchneuron.neuron import engine


# The engine on (tests/conftest.py), also when the suite runs with NEURON_LAUNCH_BLOCKING=1;
# the tests of the synchronous path turn it off themselves.
pytestmark = pytest.mark.usefixtures("engine_on")


def _pointwise(x, y):
    return ((x * y).sin() + 1).relu() * 0.5


@pytest.fixture
def engine_off():
    engine.set_enabled(False)
    yield
    engine.set_enabled(True)


def test_compiled_call_queues_its_kernel_and_returns_before_it_ran():
    f = torch.compile(_pointwise, backend="neuron")
    x, y = torch.randn(64, 64, device=DEV), torch.randn(64, 64, device=DEV)
    f(x, y)
    torch.neuron.synchronize()
    before = engine.stats()["enqueued"]
    out = f(x, y)
    assert engine.stats()["enqueued"] - before == 1  # one fused kernel, queued
    assert _C._engine_pending()  # the host ran ahead of it
    torch.testing.assert_close(out.cpu(), _pointwise(x.cpu(), y.cpu()))


def test_compiled_kernels_run_in_stream_order_with_eager_ops():
    f = torch.compile(lambda x: (x * 3).exp().sum(dim=1), backend="neuron")
    x = torch.randn(16, 32, device=DEV)
    xc = x.cpu()
    x.mul_(0.5)  # queued before the graph: the kernel must read its result
    out = f(x)
    out.add_(1)  # queued after: must see the kernel's result
    x.zero_()  # and must not reach the kernel
    torch.testing.assert_close(out.cpu(), (xc * 0.5 * 3).exp().sum(dim=1) + 1)


def test_compiled_call_is_recorded_by_a_graph_capture_and_replays_with_new_inputs():
    f = torch.compile(_pointwise, backend="neuron")
    x, y = torch.randn(32, 32, device=DEV), torch.randn(32, 32, device=DEV)
    f(x, y)  # compile outside the capture
    graph = torch.neuron.NeuronGraph()
    with torch.neuron.graph(graph):
        out = f(x, y)
    for _ in range(2):
        x.copy_(torch.randn(32, 32))
        graph.replay()
        torch.testing.assert_close(out.cpu(), _pointwise(x.cpu(), y.cpu()))


def test_kernel_error_surfaces_at_the_next_synchronization_with_kernel_and_stack():
    f = torch.compile(lambda x, i: x[i] * 2, backend="neuron")
    x = torch.randn(64, device=DEV)
    f(x, torch.tensor([1, 2], device=DEV))
    f(x, torch.tensor([1, 200], device=DEV))  # out of bounds: found by the kernel, later
    with pytest.raises(RuntimeError) as info:
        torch.neuron.synchronize()
    text = str(info.value)
    assert "cpp_fused_" in text and "index out of bounds" in text
    assert "enqueued at" in text and "test_compiled_kernels.py" in text
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)  # the device stays usable


def test_with_the_engine_off_a_kernel_error_raises_at_the_call(engine_off):
    f = torch.compile(lambda x, i: x[i] * 2, backend="neuron")
    x = torch.randn(64, device=DEV)
    f(x, torch.tensor([1, 2], device=DEV))
    with pytest.raises(RuntimeError, match="index out of bounds"):
        f(x, torch.tensor([1, 200], device=DEV))


def test_with_the_engine_off_compiled_kernels_run_synchronously(engine_off):
    f = torch.compile(_pointwise, backend="neuron")
    x, y = torch.randn(8, 8, device=DEV), torch.randn(8, 8, device=DEV)
    before = engine.stats()["enqueued"]
    out = f(x, y)
    assert engine.stats()["enqueued"] == before and not _C._engine_pending()
    torch.testing.assert_close(out.cpu(), _pointwise(x.cpu(), y.cpu()))


@torch._dynamo.config.patch(specialize_float=False)
def test_a_kernel_reading_host_memory_runs_at_the_call():
    # An unspecialized float is a CPU scalar tensor the kernel reads through a pointer: queued,
    # it would read whatever that memory holds later.
    f = torch.compile(lambda x, s: x * s + 1, backend="neuron", dynamic=True)
    x = torch.randn(16, device=DEV)
    out, (code,) = run_and_get_code(f, x, 2.5)
    assert "'const double*'" in code  # the scalar is a pointer argument
    torch.testing.assert_close(out.cpu(), x.cpu() * 2.5 + 1)
    xc = x.cpu()
    x.mul_(2)  # queued: the synchronous kernel must run after it
    before = engine.stats()["enqueued"]
    out = f(x, 0.5)
    assert engine.stats()["enqueued"] == before and not _C._engine_pending()
    torch.testing.assert_close(out.cpu(), xc * 2 * 0.5 + 1)


@pytest.mark.skipif(torch.neuron.device_count() < 2, reason="needs two neuron devices")
def test_a_graph_on_another_device_queues_on_that_devices_stream():
    dev = torch.device("neuron:1")
    f = torch.compile(_pointwise, backend="neuron")
    x, y = torch.randn(64, 64, device=dev), torch.randn(64, 64, device=dev)
    f(x, y)
    torch.neuron.synchronize(dev)
    out = f(x, y)
    assert not torch.neuron.current_stream(dev).query()
    assert torch.neuron.current_stream(DEV).query()
    torch.testing.assert_close(out.cpu(), _pointwise(x.cpu(), y.cpu()))


def _build(name, argtypes):
    k = kernels.cpp_pybinding(AsyncCompile(), name, argtypes, _SOURCE)
    return k.result() if hasattr(k, "result") else k  # a future where Inductor compiles in workers


_SOURCE = r"""
#include <cstdint>
extern "C" void kernel(float* out, const float* in, const float a, const int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = a * in[i] + static_cast<float>(n);
}
"""


@pytest.mark.parametrize("queued", [True, False])
def test_packed_entry_passes_pointers_floats_and_integers(queued):
    k = _build("test_kernel", ["float*", "const float*", "const float", "const int64_t"])
    x = torch.arange(6, dtype=torch.float32, device=DEV)
    out = torch.full((6,), -1.0, device=DEV)
    engine.set_enabled(queued)
    try:
        before = engine.stats()["enqueued"]
        _C._kernel_call(k.handle, out, x, 1.5, 5)
        assert engine.stats()["enqueued"] - before == int(queued)
    finally:
        engine.set_enabled(True)
    expected = torch.arange(6, dtype=torch.float32) * 1.5 + 5
    expected[5] = -1.0  # n = 5: the last element untouched
    torch.testing.assert_close(out.cpu(), expected)
    k(out, x, 2.0, 6)  # Inductor's own binding, as the profiler's attributed path calls it
    torch.testing.assert_close(out.cpu(), torch.arange(6, dtype=torch.float32) * 2.0 + 6)


def test_kernel_call_checks_its_arguments():
    k = _build("test_kernel", ["float*", "const float*", "const float", "const int64_t"])
    x = torch.zeros(4, device=DEV)
    with pytest.raises(RuntimeError, match="takes 4 arguments, got 3"):
        _C._kernel_call(k.handle, x, x, 1.0)
    with pytest.raises(RuntimeError, match="argument 1 must be a tensor"):
        _C._kernel_call(k.handle, x, 3, 1.0, 4)
    with pytest.raises(TypeError):
        _C._kernel_call(k.handle, x, x, 1.0, "four")
    with pytest.raises(NotImplementedError, match="C\\+\\+ type 'const char'"):
        _build("bad", ["const char"])


def test_plain_inductor_cache_keys_carry_the_codegen_version():
    # backend="inductor" caches neuron graphs in Inductor's own directory: the key must change
    # with neuron's code generation, or code calling an older core would be loaded.
    out = run_python(
        "import torch\n"
        "from torch._inductor.codegen.common import custom_backend_passes, init_backend_registration\n"
        "init_backend_registration()\n"
        "from torchneuron.compile.cache import _source_hash\n"
        "print(custom_backend_passes['neuron'].uuid() == 'torchneuron-codegen-' + _source_hash())\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True"]


def _e5m2_casts(x, codes):
    # bf16 operands make Inductor convert 32 lanes at a time (two fp32 registers)
    return x.float().to(torch.float8_e5m2), (codes.float() * x.float()).to(torch.bfloat16)


def test_compiled_e5m2_casts_equal_cpu_bit_for_bit():
    # ATen vectorizes Inductor's two-register fp8 conversions for e4m3 only; kernels.py declares
    # the e5m2 pair from ATen's one-register conversions. Every bf16 bit pattern (subnormals,
    # Inf, NaN, every rounding case of the narrowing) against CPU, and every e5m2 code widened.
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    codes = torch.arange(256, dtype=torch.uint8).repeat(256).view(torch.float8_e5m2)
    y, prod = torch.compile(_e5m2_casts, backend="neuron")(x.to(DEV), codes.to(DEV))
    want_y, want_prod = _e5m2_casts(x, codes)
    assert torch.equal(y.cpu().view(torch.uint8), want_y.view(torch.uint8))
    assert torch.equal(prod.cpu().view(torch.int16), want_prod.view(torch.int16))


def test_kernels_using_e5m2_pair_conversions_get_their_declaration():
    # The generated source names the conversions kernels.py declares (if Inductor stops emitting
    # them, this says so), and only kernels using them get the declaration.
    args = torch.randn(4096, device=DEV, dtype=torch.bfloat16), torch.randn(4096).to(torch.float8_e5m2).to(DEV)
    _, code = run_and_get_code(torch.compile(_e5m2_casts, backend="neuron"), *args)
    source = "\n".join(code)
    assert "convert<at::Float8_e5m2,1,float,2>" in source and "convert<float,2,at::Float8_e5m2,1>" in source
    prelude = "#include <torch/csrc/inductor/cpp_prefix.h>\n"
    uses = prelude + "void k() { at::vec::convert<at::Float8_e5m2,1,float,2>(v); }"
    declared = kernels._with_vec_converts(uses)
    assert declared.index("struct VecConvert<Float8_e5m2, 1, float, 2>") < declared.index("void k()")
    plain = prelude + "void k() { at::vec::convert<at::Float8_e4m3fn,1,float,2>(v); }"
    assert kernels._with_vec_converts(plain) == plain
