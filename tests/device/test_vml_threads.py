"""Small calls of MKL's vector math run on one MKL thread (csrc/backend/vml_threads.h): the same
bits as CPU's kernels, for every op ATen computes with MKL, in every form, below and above the
bounds; and MKL's thread count is the caller's again afterwards. The oracle is the same call on
CPU (which lets MKL open its own team)."""

import ctypes
import os

import pytest
import torch

import torchneuron  # noqa: F401

OPS = ["acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt",
       "tan", "tanh", "trunc"]
SIZES = (1, 128, 511, 2047, 5000)  # below and above the 512 and 2,048 bounds


def inputs(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Any bit pattern (NaN, infinities, subnormals, both signs) and, every other element, a value
    in (-1, 1), where the inverse functions are defined."""
    g = torch.Generator().manual_seed(n)
    if dtype == torch.float32:
        bits = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g).view(torch.float32)
    else:
        bits = torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64, generator=g).view(torch.float64)
    return torch.where(torch.arange(n) % 2 == 0, bits, torch.rand(n, generator=g, dtype=dtype) * 2 - 1)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    # NaN payloads may differ between paths; every other value exactly
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("name", OPS)
def test_vector_math_op_matches_cpu_bit_for_bit_in_every_form(name):
    for dtype in (torch.float32, torch.float64):
        for n in SIZES:
            x = inputs(n, dtype)
            want = getattr(torch, name)(x)
            d = x.to("neuron")
            assert same_bits(getattr(torch, name)(d).cpu(), want), (dtype, n, "functional")
            out = torch.empty(n, dtype=dtype, device="neuron")
            getattr(torch, name)(d, out=out)
            assert same_bits(out.cpu(), want), (dtype, n, "out=")
            getattr(d, name + "_")()
            assert same_bits(d.cpu(), want), (dtype, n, "in place")


def mkl_threads() -> int:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    return lib.MKL_Get_Max_Threads()


@pytest.fixture
def two_threads():
    """Two intra-op (and so MKL) threads, whatever the suite runs with: one would hide a
    thread count left at one."""
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(was)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_mkl_thread_count_is_the_callers_again_after_small_calls(two_threads):
    before = mkl_threads()
    assert before == 2
    x = torch.rand(100, device="neuron")
    torch.exp(x)
    torch.sqrt(x)
    torch._foreach_sqrt([x, x])
    x.tanh_()
    assert mkl_threads() == before


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")
def test_mkl_thread_count_is_restored_when_a_small_call_raises(two_threads):
    before = mkl_threads()
    assert before == 2
    x = torch.rand(100, device="neuron")
    with pytest.raises(RuntimeError):
        torch.exp(x, out=torch.empty(100, dtype=torch.int64, device="neuron"))
    assert mkl_threads() == before
