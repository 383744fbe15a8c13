"""bf16 products on AMX hosts and Adaptive Eager's GEMM family.

A bf16 `mm` whose B is column-major (nn.Linear's `weight.t()`) and whose A has at most
`bf16_mm_amx_rows` rows runs amx_gemm.h's kernel (fp32 sums, one rounding; not oneDNN's bits on
every shape). torchao's weight-only int8 linear, `mm(x, w_int8.t().to(bf16)) * scale.to(bf16)`,
then runs as one call of that kernel: the int8 weight widened in cache, the per-column product in
its epilogue. Oracles: an fp64 product of the same operands (the TensorE contract), the same
program with the family off (bit for bit, NaN included), and `_scaled_mm`, whose fp8 GEMMs run
the same kernel.
"""

from __future__ import annotations

import pytest
import torch

import torchneuron
from gemm_fusion_oracles import (assert_within_tensore_bound, bits, check_nan_results_take_atens_bits,
                                 check_weight_only_fuses_bit_for_bit, operands, run, weight_only)

engine = torch.neuron.engine
ROUTES = torchneuron._C._precision_routes()
pytestmark = pytest.mark.skipif(ROUTES["bf16_mm_amx_rows"] == 0, reason="needs AMX (bf16 tiles)")


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 100, 33), (64, 256, 512), (256, 1024, 4096), (33, 520, 100),
                                   (5, 1031, 64), (40, 2085, 48)])
def test_bf16_mm_with_column_major_weight_meets_tensore_contract(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    got = torch.mm(a.to("neuron"), w.to("neuron").t()).cpu()
    assert_within_tensore_bound(got, a.double() @ w.double().t(), k)


@pytest.mark.parametrize("k", [40, 300])
def test_a_weight_narrower_than_its_rows_reads_nothing_past_k(k):
    # The kernel reads whole weight tiles in place where they fit; a tail of k is staged with
    # zeros. Here the weight is a column slice of rows holding Inf past k: a tile read past k
    # would multiply Inf by the activations' zero padding, NaN.
    g = torch.Generator().manual_seed(k)
    a = torch.randn(16, k, generator=g).to(torch.bfloat16)
    rows = torch.full((64, k + 64), float("inf"), dtype=torch.bfloat16)
    rows[:, :k] = torch.randn(64, k, generator=g).to(torch.bfloat16)
    w = rows.to("neuron")[:, :k]
    got = torch.mm(a.to("neuron"), w.t()).cpu()
    exact = a.double() @ rows[:, :k].double().t()
    assert torch.isfinite(got).all()
    assert_within_tensore_bound(got, exact, k)


def test_bf16_mm_runs_the_amx_kernel_of_fp8_gemms():
    # fp8 values are exact in bf16, and _scaled_mm with unit scales runs the same AMX kernel:
    # the same bits. oneDNN's bf16 GEMM differs from it in a few elements at this shape.
    g = torch.Generator().manual_seed(3)
    a8 = (torch.randn(256, 1024, generator=g) * 4).to(torch.float8_e4m3fn)
    b8 = (torch.randn(4096, 1024, generator=g) * 4).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device="neuron")
    a8n, b8n = a8.to("neuron"), b8.to("neuron")
    via_fp8 = torch._scaled_mm(a8n, b8n.t(), one, one, out_dtype=torch.bfloat16)
    via_bf16 = torch.mm(a8n.to(torch.bfloat16), b8n.to(torch.bfloat16).t())
    assert torch.equal(bits(via_fp8), bits(via_bf16))
    assert not torch.equal(bits(via_bf16), bits(torch.mm(a8.bfloat16(), b8.bfloat16().t())))


@pytest.mark.parametrize("shape", [(16, 1024, 4096), (7, 100, 33), (4, 8, 256)], ids=["16x1024", "7x100", "3d"])
def test_bf16_linear_with_bias_adds_it_to_the_fp32_sums_and_rounds_once(shape):
    # nn.Linear's addmm(bias, x, w.t()) on the AMX kernel: its fp32 sums (the same kernel's as an
    # fp8 _scaled_mm with unit scales, fp32 out) plus the bias in fp32, one rounding.
    *lead, k, n = shape
    g = torch.Generator().manual_seed(k + n)
    x8 = (torch.randn(*lead, k, generator=g) * 4).to(torch.float8_e4m3fn)
    w8 = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    bias = (torch.randn(n, generator=g) * 8).to(torch.bfloat16)
    one = torch.tensor(1.0, device="neuron")
    sums = torch._scaled_mm(x8.reshape(-1, k).to("neuron"), w8.to("neuron").t(), one, one,
                            out_dtype=torch.float32).cpu()
    want = (sums + bias.float()).to(torch.bfloat16).reshape(*lead, n)
    got = torch.nn.functional.linear(x8.to(torch.bfloat16).to("neuron"), w8.to(torch.bfloat16).to("neuron"),
                                     bias.to("neuron"))
    assert torch.equal(bits(got), bits(want))


def test_addmm_with_other_beta_keeps_cpus_kernel():
    g = torch.Generator().manual_seed(12)
    a = (torch.randn(16, 1024, generator=g) * 4).to(torch.float8_e4m3fn).bfloat16()
    w = (torch.randn(4096, 1024, generator=g) * 4).to(torch.float8_e4m3fn).bfloat16()
    bias = torch.randn(4096, generator=g).bfloat16()
    want = torch.addmm(bias, a, w.t(), beta=0.5)
    got = torch.addmm(bias.to("neuron"), a.to("neuron"), w.to("neuron").t(), beta=0.5)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("engine_on_", [False, True], ids=["sync", "engine"])
def test_out_forms_take_the_functional_route(engine_on_):
    # Inductor's extern kernels call mm.out / addmm.out: the same kernel, the same bits (oneDNN's
    # differ from them in a few elements at this shape).
    g = torch.Generator().manual_seed(13)
    x = torch.randn(256, 1024, generator=g).to(torch.bfloat16).to("neuron")
    w = torch.randn(4096, 1024, generator=g).to(torch.bfloat16).to("neuron")
    bias = torch.randn(4096, generator=g).to(torch.bfloat16).to("neuron")
    was = engine.is_enabled()
    try:
        engine.set_enabled(engine_on_)
        mm_out = torch.empty(256, 4096, dtype=torch.bfloat16, device="neuron")
        addmm_out = torch.empty_like(mm_out)
        torch.mm(x, w.t(), out=mm_out)
        torch.addmm(bias, x, w.t(), out=addmm_out)
        assert torch.equal(bits(mm_out), bits(torch.mm(x, w.t())))
        assert torch.equal(bits(addmm_out), bits(torch.addmm(bias, x, w.t())))
    finally:
        engine.set_enabled(was)


def test_compiled_bf16_linear_equals_eager_bit_for_bit():
    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 128, bias=False))
    model = model.to("neuron", torch.bfloat16)
    x = torch.randn(64, 256, device="neuron", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, backend="neuron")(x)
    assert torch.equal(bits(compiled), bits(eager))


def test_bf16_mm_route_is_the_same_with_and_without_the_engine():
    x, w8, _ = operands(64, 256, 96, seed=4)
    w = w8.to(torch.bfloat16)
    was = engine.is_enabled()
    try:
        engine.set_enabled(False)
        sync = torch.mm(x, w.t()).cpu()
        engine.set_enabled(True)
        queued = torch.mm(x, w.t()).cpu()
    finally:
        engine.set_enabled(was)
    assert torch.equal(bits(sync), bits(queued))


def test_rows_past_the_limit_keep_cpus_kernel():
    rows = ROUTES["bf16_mm_amx_rows"] + 1
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(rows, 1024, generator=g) * 4).to(torch.float8_e4m3fn).bfloat16()
    w = (torch.randn(4096, 1024, generator=g) * 4).to(torch.float8_e4m3fn).bfloat16()
    assert torch.equal(bits(torch.mm(a.to("neuron"), w.to("neuron").t())), bits(torch.mm(a, w.t())))


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (7, 100, 33), (64, 256, 512), (256, 1024, 4096), (200, 40, 130),
                                   (3, 2085, 40)])
def test_weight_only_int8_linear_fuses_bit_for_bit(cast_fusion_on, m, k, n):
    check_weight_only_fuses_bit_for_bit(m, k, n)


def test_every_int8_weight_value_widens_exactly(cast_fusion_on):
    # Rows of the identity make the product the widened weight itself: weight row j is every
    # code rotated by j, then again rotated by j + 17 (so k and k + 256 differ), so each picked
    # k position sees all 256 codes, among them positions in a row's tail past its last whole
    # group of 32 (k = 300).
    k, n = 300, 256
    codes = torch.arange(-128, 128, dtype=torch.int8)
    w8 = torch.stack([torch.cat([codes.roll(j), codes.roll(j + 17)])[:k] for j in range(n)])
    picked = torch.cat([torch.arange(0, 128), torch.arange(k - 128, k)])
    x = torch.eye(k, dtype=torch.bfloat16)[picked]
    got, fused = run(lambda: weight_only(x.to("neuron"), w8.to("neuron"), torch.ones(n, 1, device="neuron")), True)
    assert fused == 1
    assert torch.equal(bits(got), bits(w8[:, picked].t().to(torch.bfloat16)))


def test_torchao_int8_weight_only_linear_fuses_bit_for_bit(cast_fusion_on):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=False).to("neuron", torch.bfloat16)
    quantize_(lin, Int8WeightOnlyConfig())
    x = torch.randn(16, 8, 256, device="neuron", dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = run(lambda: lin(x), False)
        got, fused = run(lambda: lin(x), True)
    assert fused == 1 and got.shape == (16, 8, 384)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("where", ["scale_vector_lanes", "scale_tail", "activations"])
def test_nan_results_take_atens_bits(cast_fusion_on, where):
    check_nan_results_take_atens_bits(where)


def test_scale_first_operand_fuses(cast_fusion_on):
    x, w8, scale = operands(16, 128, 64, seed=7)
    fn = lambda: scale.to(torch.bfloat16).flatten() * torch.mm(x, w8.t().to(torch.bfloat16))  # noqa: E731
    want, _ = run(fn, False)
    got, fused = run(fn, True)
    assert fused == 1 and torch.equal(bits(got), bits(want))


def test_a_widened_weight_still_referenced_is_stored(cast_fusion_on):
    x, w8, scale = operands(16, 128, 64, seed=8)
    engine.set_cast_fusion_enabled(True)
    wb = w8.t().to(torch.bfloat16)
    m = torch.mm(x, wb)
    y = m * scale.to(torch.bfloat16).flatten()
    torch.neuron.synchronize()
    assert torch.equal(wb.cpu(), w8.cpu().t().to(torch.bfloat16))
    assert torch.equal(bits(m), bits(torch.mm(x, w8.t().to(torch.bfloat16))))
    assert torch.equal(bits(y), bits(m * scale.to(torch.bfloat16).flatten()))


def test_a_product_still_referenced_is_stored(cast_fusion_on):
    x, w8, scale = operands(16, 128, 64, seed=9)
    m = torch.mm(x, w8.t().to(torch.bfloat16))  # the widening fuses, m is kept
    y = m * scale.to(torch.bfloat16).flatten()
    torch.neuron.synchronize()
    engine.set_cast_fusion_enabled(False)
    want_m = torch.mm(x, w8.t().to(torch.bfloat16))
    assert torch.equal(bits(m), bits(want_m))
    assert torch.equal(bits(y), bits(want_m * scale.to(torch.bfloat16).flatten()))


def test_deterministic_algorithms_turn_the_family_off(cast_fusion_on):
    x, w8, scale = operands(16, 128, 64, seed=10)
    torch.use_deterministic_algorithms(True)
    try:
        _, fused = run(lambda: weight_only(x, w8, scale), True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert fused == 0


def test_a_result_in_the_memory_of_a_freed_operand_is_written_after_the_product(cast_fusion_on):
    # The int8 weight is a temporary freed once the product is queued, as large as the result
    # (k = 2m), so the mul's result takes its memory: fusing the mul into the epilogue would
    # write the weight while the kernel still reads it. The region stops before the mul.
    x, w8, scale = operands(32, 64, 256, seed=11)

    def fn():
        temporary = w8.clone()
        m = torch.mm(x, temporary.t().to(torch.bfloat16))
        del temporary
        return m * scale.to(torch.bfloat16).flatten()

    want, _ = run(fn, False)
    got, fused = run(fn, True)
    assert fused == 1 and torch.equal(bits(got), bits(want))
