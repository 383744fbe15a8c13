"""The oracles of Adaptive Eager's GEMM family (test_gemm_fusion.py: the AMX kernel;
test_gemm_fusion_half_rate.py: the few-row and routed kernels): torchao's weight-only int8 linear op for op,
the same program with the family off, and the TensorE contract's bound against fp64."""

from __future__ import annotations

import torch

engine = torch.neuron.engine


def bits(t):
    return t.detach().cpu().contiguous().view(torch.int16)


def assert_within_tensore_bound(got, exact, k, roundings=1):
    """``got`` against the float64 ``exact`` product: fp32 sums of k exact products, then
    ``roundings`` roundings to bf16 (2^-8 each), relative to the largest |exact|."""
    tol = exact.abs().max().item() * (k * 2.0**-23 + roundings * 2.0**-8)
    assert (got.cpu().double() - exact).abs().max().item() <= tol


def weight_only(x, w8, scale):
    """torchao's Int8Tensor weight-only linear (per-row scales), op for op."""
    m = torch.mm(x, w8.t().to(x.dtype))
    return m * scale.to(m.dtype).flatten()


def operands(m, k, n, seed=0, dev="neuron"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, 1, generator=g) / 64 + 1e-3
    return x.to(dev), w8.to(dev), scale.to(dev)


def run(fn, fused):
    """``fn()`` with the family on or off, synchronized; and how many regions it fused."""
    engine.set_cast_fusion_enabled(fused)
    before = engine.stats()["gemm"]
    out = fn()
    torch.neuron.synchronize()
    return out, engine.stats()["gemm"] - before


def check_nan_results_take_atens_bits(where, m=8):
    # ATen's bf16 mul writes NaN as 0xFFFF in its vector loop and 0x7FC0 in its scalar tail (the
    # last n % 64 columns of each row): a fused result with a NaN is redone through ATen.
    x, w8, scale = operands(m, 64, 100, seed=6)
    if where == "scale_vector_lanes":
        scale[3] = float("nan")
    elif where == "scale_tail":
        scale[97] = float("nan")
    else:
        x[2, 5] = float("inf")
        scale[10] = 0.0  # inf * 0
    want, _ = run(lambda: weight_only(x, w8, scale), False)
    got, fused = run(lambda: weight_only(x, w8, scale), True)
    assert fused == 1 and torch.isnan(want.cpu().float()).any()
    assert torch.equal(bits(got), bits(want))


def check_weight_only_fuses_bit_for_bit(m, k, n):
    """The family on: one fused region, the unfused bits, within the TensorE bound."""
    x, w8, scale = operands(m, k, n, seed=m * k + n)
    want, fused_before = run(lambda: weight_only(x, w8, scale), False)
    got, fused = run(lambda: weight_only(x, w8, scale), True)
    assert fused_before == 0 and fused == 1
    assert torch.equal(bits(got), bits(want))
    exact = (x.cpu().double() @ w8.cpu().double().t()) * scale.cpu().bfloat16().double().flatten()
    assert_within_tensore_bound(got, exact, k, roundings=2)  # the product, then the column scale
