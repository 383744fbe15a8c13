"""Vectorised erf in neuron kernels: a rational approximation (TORCHNEURON_COMPILE_FAST_ERF).

The oracle is erf evaluated in float64; the switch-off path must give CPU Inductor's bits.
"""

import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from compile_models import DEV
from support import fp32_ulp, run_python

# Signed zeros, tiny and subnormal arguments (where ATen's vectorised erf returns nothing near
# x * 2/sqrt(pi)), the region where the fp32 evaluation errs most (3-4), the switch to the
# saturated value at 4 and the values just below it, and non-finite values.
_SPECIALS = [0.0, -0.0, 1e-45, -1e-40, 1e-30, 1e-7, 0.5, 1.0, 2.0, 3.3, 3.647, 3.9999998, 4.0, -4.0,
             20.0, float("inf"), float("-inf"), float("nan")]


def _inputs():
    return torch.cat([torch.tensor(_SPECIALS), torch.linspace(-6, 6, 400_003),
                      torch.logspace(-38, 0.7, 20_000), -torch.logspace(-38, 0.7, 20_000)])


def test_compiled_erf_within_seven_ulp_and_4e_7_of_exact():
    # Measured over every float in [0, 5]: 6.2 ULP, 3.7e-7 absolute (ATen's: 5.7e-7 absolute).
    x = _inputs()
    fn = torch.compile(torch.erf, backend="neuron")
    out, (code,) = run_and_get_code(fn, x.to(DEV))
    assert "neuron_erf(" in code  # the fast path was emitted, so this test exercises it
    out = out.cpu()
    exact = torch.erf(x.double())
    nan = x.isnan()
    err = (out.double() - exact).abs()[~nan]
    assert (err / fp32_ulp(exact)[~nan]).max().item() <= 7.0
    assert err.max().item() <= 4e-7
    assert out[nan].isnan().all()
    assert torch.equal(out[:2].signbit(), torch.tensor([False, True]))  # erf(+-0) = +-0
    specials = dict(zip(_SPECIALS, out[: len(_SPECIALS)].tolist()))
    assert specials[4.0] == 1.0 and specials[-4.0] == -1.0 and specials[float("-inf")] == -1.0
    assert specials[20.0] == 1.0 and specials[float("inf")] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_gelu_forward_and_backward_use_it_and_match_eager(dtype):
    # bf16 kernels compute in fp32 halves (VectorizedN<float, 2>): the same erf, per register.
    x = (torch.randn(8192) * 3).to(dtype)
    g = torch.randn(8192).to(dtype)
    fwd = torch.compile(F.gelu, backend="neuron")
    out, (code,) = run_and_get_code(fwd, x.to(DEV))
    assert "neuron_erf(" in code
    torch.testing.assert_close(out.cpu(), F.gelu(x))
    bwd = torch.compile(torch.ops.aten.gelu_backward, backend="neuron")
    torch.testing.assert_close(bwd(g.to(DEV), x.to(DEV)).cpu(), torch.ops.aten.gelu_backward(g, x))


def test_bf16_kernels_take_it_per_fp32_register():
    # Tiny arguments, where ATen's erf (1 - t r(t) exp(-x^2)) cancels to ~1e-7 of noise: the
    # bf16 kernel's VectorizedN<float, 2> must reach the rational form, not ATen's.
    x = torch.logspace(-12, -9, 256).bfloat16()
    out, (code,) = run_and_get_code(torch.compile(torch.erf, backend="neuron"), x.to(DEV))
    assert "neuron_erf(" in code
    torch.testing.assert_close(out.cpu(), torch.erf(x.double()).bfloat16(), rtol=0, atol=0)


def test_float64_keeps_aten_erf():
    x = torch.linspace(-6, 6, 10_001, dtype=torch.float64)
    out, (code,) = run_and_get_code(torch.compile(torch.erf, backend="neuron"), x.to(DEV))
    # the helper may be emitted, but a double vector takes its generic overload: ATen's erf
    torch.testing.assert_close(out.cpu(), torch.erf(x), rtol=0, atol=1e-15)


def test_transposing_kernels_use_the_fast_erf_too():
    x = torch.randn(64, 128) * 3
    fn = torch.compile(lambda t: torch.erf(t.t()).contiguous(), backend="neuron")
    out, (code,) = run_and_get_code(fn, x.to(DEV))
    assert "neuron_erf(" in code and "transpose" in code.lower()
    torch.testing.assert_close(out.cpu(), torch.erf(x.t()).contiguous(), rtol=0, atol=4e-7)


def test_switched_off_gives_cpu_inductor_bits():
    code = textwrap.dedent("""
        import torch, torchneuron
        import torch.nn.functional as F
        x = torch.linspace(-6, 6, 100_003)
        f = lambda t: torch.erf(t * 1.5) + F.gelu(t.bfloat16()).float()
        a = torch.compile(f, backend="neuron")(x.to("neuron")).cpu()
        b = torch.compile(f, backend="inductor")(x)
        print("EQUAL" if torch.equal(a, b) else "DIFFERENT")
    """)
    res = run_python(code, env={"TORCHNEURON_COMPILE_FAST_ERF": "0"}, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "EQUAL" in res.stdout
