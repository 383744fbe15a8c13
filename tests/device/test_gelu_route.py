"""GELU on neuron (csrc/backend/ops.cpp, gelu / gelu_backward): below 16,384 elements a contiguous
input runs ATen's own vectorized GELU kernel, the one CPU runs with oneDNN off (or for strided
inputs), instead of oneDNN's eltwise primitive, whose per-call setup dominates small tensors.
At and above that size, and for strided inputs, neuron runs CPU's kernel as before. So each
result is bit for bit one of CPU's two answers, and which one is fixed by size and layout.
The tanh approximation over contiguous inputs takes SLEEF's 3.5-ULP tanh (gelu_tanh.cpp), unless
TORCHNEURON_FAST_TANH_GELU=0.
"""

import textwrap

import pytest
import torch
import torch.nn.functional as F

import torchneuron  # noqa: F401
from support import run_python

# flags() also sets oneDNN's TF32 mode, which warns on builds without Intel GPU support.
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")

DEV = "neuron"
THRESHOLD = 16384
SMALL = (2, 16, 257, 2048, THRESHOLD - 1)
LARGE = (THRESHOLD, 40000)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def onednn_off():
    return torch.backends.mkldnn.flags(enabled=False)


def cpu_without_onednn(fn, *args):
    with onednn_off():
        return fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SMALL)
def test_small_gelu_is_atens_kernel_bit_for_bit(n, dtype):
    x = torch.randn(n).to(dtype)
    expected = cpu_without_onednn(F.gelu, x)
    assert torch.equal(F.gelu(x.to(DEV)).cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SMALL)
def test_small_gelu_backward_is_atens_kernel_bit_for_bit(n, dtype):
    x, g = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    expected = cpu_without_onednn(torch.ops.aten.gelu_backward, g, x)
    assert torch.equal(torch.ops.aten.gelu_backward(g.to(DEV), x.to(DEV)).cpu(), expected)


@pytest.mark.parametrize("n", LARGE)
def test_large_gelu_is_cpus_default_kernel_bit_for_bit(n):
    x, g = torch.randn(n), torch.randn(n)
    assert torch.equal(F.gelu(x.to(DEV)).cpu(), F.gelu(x))
    got = torch.ops.aten.gelu_backward(g.to(DEV), x.to(DEV)).cpu()
    assert torch.equal(got, torch.ops.aten.gelu_backward(g, x))


def test_small_and_large_routes_differ_somewhere():
    # The premise of the two tests above: otherwise they could not tell the routes apart.
    x = torch.randn(4096)
    assert not torch.equal(cpu_without_onednn(F.gelu, x), F.gelu(x))


def test_strided_input_matches_cpu_values_and_layout():
    x = torch.randn(64, 48)
    got = F.gelu(x.to(DEV).t())
    expected = F.gelu(x.t())
    assert got.stride() == expected.stride()
    assert torch.equal(got.cpu(), expected)


def _tanh_gelu(x, g):
    return F.gelu(x, approximate="tanh"), torch.ops.aten.gelu_backward(g, x, approximate="tanh")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_approximation_takes_the_fast_tanh_with_cpus_accuracy(dtype):
    # gelu_tanh.cpp: ATen's formula with SLEEF's 3.5-ULP tanh instead of the 1-ULP one. Against
    # the formula in float64 it errs no more than CPU's kernel does (plus the tanh's few ulps);
    # in fp32 the two differ in some elements, which tells the routes apart.
    torch.manual_seed(0)
    x, g = (torch.randn(40003) * 4).to(dtype), torch.randn(40003).to(dtype)
    got = [t.cpu().double() for t in _tanh_gelu(x.to(DEV), g.to(DEV))]
    cpu = [t.double() for t in _tanh_gelu(x, g)]
    exact = _tanh_gelu(x.double(), g.double())
    eps = torch.finfo(dtype).eps
    k = 16 if dtype == torch.float32 else 2  # a few fp32 ulps of tanh, amplified by the derivative
    for a, c, e in zip(got, cpu, exact):
        assert (a - e).abs().max() <= (c - e).abs().max() + 4 * eps * e.abs().max()
        torch.testing.assert_close(a, c, rtol=k * eps, atol=k * eps)
    if dtype == torch.float32:
        assert not torch.equal(got[0], cpu[0])


def test_tanh_approximation_of_strided_input_is_cpus_kernel():
    x = torch.randn(64, 48)
    got = F.gelu(x.to(DEV).t(), approximate="tanh").cpu()
    assert torch.equal(got, F.gelu(x.t(), approximate="tanh"))


def test_tanh_approximation_switched_off_is_cpus_kernel_bit_for_bit():
    code = textwrap.dedent("""
        import torch, torchneuron
        import torch.nn.functional as F
        x, g = torch.randn(40003) * 4, torch.randn(40003)
        for dt in (torch.float32, torch.bfloat16):
            a, b = x.to(dt), g.to(dt)
            y = F.gelu(a.to("neuron"), approximate="tanh").cpu()
            d = torch.ops.aten.gelu_backward(b.to("neuron"), a.to("neuron"), approximate="tanh").cpu()
            ok = torch.equal(y, F.gelu(a, approximate="tanh")) and torch.equal(
                d, torch.ops.aten.gelu_backward(b, a, approximate="tanh"))
            print("EQUAL" if ok else "DIFFERENT")
    """)
    res = run_python(code, env={"TORCHNEURON_FAST_TANH_GELU": "0"}, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["EQUAL", "EQUAL"]


def test_backward_with_mixed_dtypes_takes_cpus_path():
    # (A float input with a double gradient fails inside CPU's oneDNN call, on CPU too.)
    x = torch.randn(8, 16, dtype=torch.float64)
    g = torch.randn(8, 16)
    got = torch.ops.aten.gelu_backward(g.to(DEV), x.to(DEV)).cpu()
    expected = torch.ops.aten.gelu_backward(g, x)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_autograd_through_small_gelu_matches_cpu_without_onednn():
    x = torch.randn(8, 256, requires_grad=True)
    xn = x.detach().to(DEV).requires_grad_()
    F.gelu(xn).square().sum().backward()
    with onednn_off():
        F.gelu(x).square().sum().backward()
    assert torch.equal(xn.grad.cpu(), x.grad)


def test_invalid_approximation_is_refused_as_on_cpu():
    x = torch.randn(16, device=DEV)
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        F.gelu(x, approximate="fast")
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        torch.ops.aten.gelu_backward(x, x, approximate="fast")


def test_device_mismatch_in_backward_is_refused():
    x = torch.randn(16, device=DEV)
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.aten.gelu_backward(torch.randn(16), x)
