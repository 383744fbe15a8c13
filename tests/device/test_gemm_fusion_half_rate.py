"""Adaptive Eager's GEMM family on hosts whose bf16 dot products run at half rate.

There a bf16 `mm` of one row with B column-major runs gemv.h's matrix-vector kernel, of 2-16
rows its few-row kernel, and of 64 rows or more the routed kernel (exact fp32 copies, an fp32
GEMM, one rounding). torchao's weight-only int8 linear, `mm(x, w_int8.t().to(bf16)) *
scale.to(bf16)`, runs as one call of any of them: the matrix-vector and few-row kernels read the
int8 weight and widen it in registers, the routed one copies it to fp32 directly (the bf16
copy's fp32 values), and the per-column product runs in their epilogue.
Oracles: the same program with the family off (bit for bit, NaN included) and an fp64 product of
the same operands (the TensorE contract). The half-rate routes are forced on any host with
AVX512-BF16 and AVX512-FP16 (the family records the int8 widening only where AVX512-FP16 is), AMX
hosts included: the comparisons here are between neuron's own kernels.
"""

from __future__ import annotations

import pytest
import torch

from gemm_fusion_oracles import (assert_within_tensore_bound, bits, check_nan_results_take_atens_bits,
                                 check_weight_only_fuses_bit_for_bit, operands, run, weight_only)
from torchneuron import _C

engine = torch.neuron.engine
ROUTES = _C._precision_routes()
pytestmark = pytest.mark.skipif(not (ROUTES["cpu_avx512_bf16"] and ROUTES["fp16_cpu_product_kernels"]),
                                reason="needs AVX512-BF16 and AVX512-FP16")


@pytest.fixture
def half_rate(cast_fusion_on):
    _C._set_bf16_half_rate(1)
    yield
    torch.neuron.synchronize()
    _C._set_bf16_half_rate(-1)


# k: within one 512-value chunk, past it, with tails of k (not a multiple of 16); n: whole and
# partial blocks of 4 weight rows and of the 64 rows a thread takes
@pytest.mark.parametrize("m,k,n", [(2, 64, 32), (7, 100, 33), (16, 1031, 130), (5, 2085, 48), (16, 512, 257),
                                   (3, 16, 4), (1, 64, 32), (1, 1031, 130), (1, 7, 5)])
def test_weight_only_int8_linear_fuses_bit_for_bit(half_rate, m, k, n):
    check_weight_only_fuses_bit_for_bit(m, k, n)


@pytest.mark.parametrize("m,k", [(12, 700), (80, 200)], ids=["few_rows", "routed"])
def test_the_widened_product_alone_fuses_bit_for_bit(half_rate, m, k):
    x, w8, _ = operands(m, k, 96, seed=m)
    fn = lambda: torch.mm(x, w8.t().to(torch.bfloat16))  # noqa: E731
    want, _ = run(fn, False)
    got, fused = run(fn, True)
    assert fused == 1 and torch.equal(bits(got), bits(want))
    assert_within_tensore_bound(got, x.cpu().double() @ w8.cpu().double().t(), k, roundings=1)


def test_one_row_fused_product_sums_in_the_matrix_vector_kernels_order(half_rate):
    # Products of int8 codes and bf16 activations are mostly exact in fp32 sums, which hides the
    # order of the sums; these activations show it (+-16 and many 2^-21: an accumulator holding 16
    # loses the small ones). The matrix-vector kernel (4 accumulators 64 apart) and the few-row
    # kernel (one accumulator per lane) give different results; the fused one-row product is the
    # former's, as the unfused one is.
    x = torch.full((1, 4096), 2.0**-21)
    x[0, 0], x[0, 32] = 16, -16
    x = x.to(torch.bfloat16).to("neuron")
    w8 = torch.ones(64, 4096, dtype=torch.int8, device="neuron")
    ones = torch.ones(64, 1, device="neuron")
    want, _ = run(lambda: weight_only(x, w8, ones), False)
    got, fused = run(lambda: weight_only(x, w8, ones), True)
    assert fused == 1 and torch.equal(bits(got), bits(want))
    few_rows, _ = run(lambda: weight_only(x.expand(2, -1).contiguous(), w8, ones), True)
    assert not torch.equal(bits(few_rows[:1]), bits(want))


def test_a_bf16_weight_with_a_column_scale_fuses_bit_for_bit(half_rate):
    x, w8, scale = operands(8, 300, 70, seed=2)
    w = (w8.to(torch.bfloat16) / 7).contiguous()  # values that are not integers
    fn = lambda: torch.mm(x, w.t()) * scale.to(torch.bfloat16).flatten()  # noqa: E731
    want, _ = run(fn, False)
    got, fused = run(fn, True)
    assert fused == 1 and torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("rows", [1, 8, 64], ids=["gemv", "few_rows", "routed"])
def test_a_nan_product_alone_has_the_unfused_bits(half_rate, rows):
    # inf * 0 in a sum: the host's default NaN (negative) where the unfused kernel rounds to c10's
    # 0x7FC0 (one or a few rows) or through ATen's copy (routed)
    x, w8, _ = operands(rows, 64, 40, seed=5)
    r = rows // 2
    x[r, 7] = float("inf")
    w8[11, 7] = 0
    fn = lambda: torch.mm(x, w8.t().to(torch.bfloat16))  # noqa: E731
    want, _ = run(fn, False)
    got, fused = run(fn, True)
    assert fused == 1 and torch.isnan(want.cpu()[r, 11].float())
    assert torch.equal(bits(got), bits(want))


def test_few_row_nan_results_are_one_quiet_nan_in_every_column(half_rate):
    # the vector lanes (columns 0-31 of 40) and the scalar tail (32-39) round alike: c10's 0x7FC0,
    # not the host's negative default NaN that inf * 0 produces
    x, w8, _ = operands(8, 64, 40, seed=5)
    x[3, 7] = float("inf")
    w8[11, 7] = w8[35, 7] = 0
    got = torch.mm(x, w8.t().to(torch.bfloat16)).cpu()
    assert got.view(torch.int16)[3, 11].item() == got.view(torch.int16)[3, 35].item() == 0x7FC0


def test_every_int8_weight_value_widens_exactly(half_rate):
    # Rows of the identity make the product the widened weight itself: weight row j is every code
    # rotated by j, then by j + 17, so each picked k position sees all 256 codes across the rows;
    # the picked positions include both 512-value chunks and the tail past the last 16 (k = 600).
    k, n = 600, 256
    codes = torch.arange(-128, 128, dtype=torch.int8)
    w8 = torch.stack([torch.cat([codes.roll(j), codes.roll(j + 17), codes.roll(j + 5)])[:k] for j in range(n)])
    picked = torch.tensor([0, 1, 15, 16, 255, 256, 300, 511, 512, 513, 580, 590, 591, 597, 598, 599])
    x = torch.eye(k, dtype=torch.bfloat16)[picked]
    ones = torch.ones(n, 1, device="neuron")
    got, fused = run(lambda: weight_only(x.to("neuron"), w8.to("neuron"), ones), True)
    assert fused == 1
    assert torch.equal(bits(got), bits(w8[:, picked].t().to(torch.bfloat16)))


def test_torchao_int8_weight_only_decode_step_fuses_bit_for_bit(half_rate):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=False).to("neuron", torch.bfloat16)
    quantize_(lin, Int8WeightOnlyConfig())
    x = torch.randn(4, 2, 256, device="neuron", dtype=torch.bfloat16)  # 8 sequences, one token each
    with torch.no_grad():
        want, _ = run(lambda: lin(x), False)
        got, fused = run(lambda: lin(x), True)
    assert fused == 1 and got.shape == (4, 2, 384)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("m,k,n", [(64, 256, 96), (256, 1024, 512), (100, 300, 70), (70, 17, 1000)])
def test_routed_weight_only_int8_linear_fuses_bit_for_bit(half_rate, m, k, n):
    check_weight_only_fuses_bit_for_bit(m, k, n)


def test_a_routed_bf16_weight_with_a_column_scale_fuses_bit_for_bit(half_rate):
    x, w8, scale = operands(64, 300, 70, seed=4)
    w = (w8.to(torch.bfloat16) / 7).contiguous()
    fn = lambda: torch.mm(x, w.t()) * scale.to(torch.bfloat16).flatten()  # noqa: E731
    want, _ = run(fn, False)
    got, fused = run(fn, True)
    assert fused == 1 and torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("where", ["scale_vector_lanes", "scale_tail", "activations"])
def test_routed_nan_results_take_atens_bits(half_rate, where):
    check_nan_results_take_atens_bits(where, m=64)


def test_rows_between_the_few_row_and_routed_kernels_run_unfused(half_rate):
    # 17 to 63 rows run CPU's kernel, which takes no int8 codes
    x, w8, scale = operands(17, 128, 64, seed=17)
    want, _ = run(lambda: weight_only(x, w8, scale), False)
    got, fused = run(lambda: weight_only(x, w8, scale), True)
    assert fused == 0 and torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("where", ["scale_vector_lanes", "scale_tail", "activations"])
def test_nan_results_take_atens_bits(half_rate, where):
    check_nan_results_take_atens_bits(where)


def test_a_widened_weight_still_referenced_is_stored(half_rate):
    x, w8, scale = operands(16, 128, 64, seed=8)
    wb = w8.t().to(torch.bfloat16)
    m = torch.mm(x, wb)
    y = m * scale.to(torch.bfloat16).flatten()
    torch.neuron.synchronize()
    assert torch.equal(wb.cpu(), w8.cpu().t().to(torch.bfloat16))
    engine.set_cast_fusion_enabled(False)
    want = torch.mm(x, w8.t().to(torch.bfloat16))
    assert torch.equal(bits(m), bits(want))
    assert torch.equal(bits(y), bits(want * scale.to(torch.bfloat16).flatten()))


def test_the_fused_kernel_does_not_depend_on_the_thread_count(half_rate):
    x, w8, scale = operands(16, 1500, 200, seed=12)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, fused_one = run(lambda: weight_only(x, w8, scale), True)
        torch.set_num_threads(max(2, threads))
        many, fused_many = run(lambda: weight_only(x, w8, scale), True)
    finally:
        torch.set_num_threads(threads)
    assert fused_one == fused_many == 1 and torch.equal(bits(one), bits(many))
