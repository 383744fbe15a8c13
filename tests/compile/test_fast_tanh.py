"""Vectorised fp32 tanh in neuron kernels: SLEEF's 3.5-ULP routine (TORCHNEURON_COMPILE_FAST_TANH).

The oracle is tanh evaluated in float64; the switch-off path must give CPU Inductor's bits.
"""

import textwrap

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from compile_models import DEV
from support import fp32_ulp, run_python

# Tiny arguments (where a 2/(1+exp(-2x))-1 rewrite would lose all relative accuracy), the
# polynomial/exp crossover region, saturation, signed zeros and non-finite values.
_SPECIALS = [0.0, -0.0, 1e-30, -1e-20, 1e-7, 5e-4, 0.5, 0.55, 0.625, 1.0, 8.9, 9.1, 20.0, -50.0,
             float("inf"), float("-inf"), float("nan")]


def _inputs():
    return torch.cat([torch.tensor(_SPECIALS), torch.linspace(-12, 12, 200_003),
                      torch.logspace(-30, 1, 20_000), -torch.logspace(-30, 1, 20_000)])


def test_compiled_tanh_within_four_ulp_of_exact():
    x = _inputs()
    fn = torch.compile(torch.tanh, backend="neuron")
    out, (code,) = run_and_get_code(fn, x.to(DEV))
    assert "neuron_tanh(" in code  # the fast path was emitted, so this test exercises it
    exact = torch.tanh(x.double())
    finite = exact.isfinite()
    err = (out.cpu().double() - exact).abs()[finite] / fp32_ulp(exact)[finite]
    assert err.max().item() <= 4.0
    assert torch.equal(out.cpu()[~finite].isnan(), exact[~finite].isnan())
    assert torch.equal(out.cpu()[:2].signbit(), torch.tensor([False, True]))  # tanh(+-0) = +-0


def test_fused_gelu_tanh_matches_eager():
    # Default fp32 tolerances: 1 + tanh cancels near -1, so a few ULP of tanh show up there.
    x = torch.randn(4096) * 4
    fn = torch.compile(lambda t: torch.nn.functional.gelu(t, approximate="tanh") * 2, backend="neuron")
    torch.testing.assert_close(fn(x.to(DEV)).cpu(), torch.nn.functional.gelu(x, approximate="tanh") * 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_keep_aten_tanh(dtype):
    x = torch.linspace(-5, 5, 1000, dtype=dtype)
    out = torch.compile(torch.tanh, backend="neuron")(x.to(DEV))
    torch.testing.assert_close(out.cpu(), torch.tanh(x))


def test_switched_off_gives_cpu_inductor_bits():
    code = textwrap.dedent("""
        import torch, torchneuron
        x = torch.linspace(-9, 9, 100_003)
        f = lambda t: torch.tanh(t * 1.5) + 1
        a = torch.compile(f, backend="neuron")(x.to("neuron")).cpu()
        b = torch.compile(f, backend="inductor")(x)
        print("EQUAL" if torch.equal(a, b) else "DIFFERENT")
    """)
    res = run_python(code, env={"TORCHNEURON_COMPILE_FAST_TANH": "0"}, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "EQUAL" in res.stdout


def test_transposing_kernels_use_the_fast_tanh_too():
    # a transposed operand makes Inductor tile the loop in 2-d: the same tanh as the 1-d kernels
    x = torch.randn(64, 128) * 3
    fn = torch.compile(lambda t: torch.tanh(t.t()).contiguous(), backend="neuron")
    out, (code,) = run_and_get_code(fn, x.to(DEV))
    assert "neuron_tanh(" in code and "transpose" in code.lower()
    torch.testing.assert_close(out.cpu(), torch.tanh(x.t()).contiguous())
