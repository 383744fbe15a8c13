"""TensorE precision of the GEMM family on neuron (issue 16).

The oracle is the TensorE contract computed in float64 on CPU: products of the (exact)
low-precision inputs, summed exactly, then rounded once to the output dtype. A result
computed with fp32 accumulation may differ from it only where the fp32 rounding error of
the sum crosses an output rounding boundary, so per dtype the tests require
  * every element within one output ulp (+ the fp32 accumulation bound K * 2^-24 * sum|a*b|),
  * and at least 99 % of the elements equal to the rounded float64 value bit for bit;
fp16 accumulation or a double rounding (e.g. through bf16) fails the second condition.
fp32 keeps running CPU's kernels (bit for bit); so does bf16 on hosts where CPU's bf16 kernels
are oneDNN's (AVX-512), elsewhere bf16 takes the exact route and is held to the same contract.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchneuron._C as _C

DEV = "neuron"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at |x| (float64), with the subnormal floor."""
    tiny = torch.finfo(dtype).smallest_normal
    mag = x.abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * ULP[dtype]


def assert_tensore(got: torch.Tensor, exact: torch.Tensor, k: int, absprod: torch.Tensor | None = None,
                   min_equal: float = 0.99, atol: float = 0.0) -> None:
    """``got`` (on neuron) against the float64 ``exact`` value rounded once to got's dtype."""
    dtype = got.dtype
    got = got.cpu().double()
    rounded = exact.to(dtype).double()
    accum = 0.0 if absprod is None else k * 2.0 ** -24 * absprod
    err = (got - exact).abs()
    bound = ulp(exact, dtype) + accum + atol
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    equal = (got == rounded).double().mean().item()
    assert equal >= min_equal, f"only {equal:.4f} of the elements are the once-rounded exact value"


def rand(*shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


# ---- fp16: the GEMM family --------------------------------------------------------------------
def _layouts(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values on neuron, contiguous, transposed in memory, or a strided slice."""
    if layout == "contiguous":
        return t.to(DEV)
    if layout == "transposed":
        return t.transpose(-1, -2).contiguous().to(DEV).transpose(-1, -2)
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide.to(DEV)[..., ::2]


ROUTES = _C._precision_routes()
HALF = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "matmul_nd", "linear"])
def test_fp16_matmul_ops_accumulate_in_fp32_and_round_once(op, layout, dtype):
    torch.manual_seed(0)
    k = 512
    if op in ("mm", "addmm", "linear"):
        a, b = rand(64, k, dtype=dtype), rand(k, 48, dtype=dtype)
    elif op == "matmul_nd":
        a, b = rand(2, 3, 32, k, dtype=dtype), rand(k, 40, dtype=dtype)
    else:
        a, b = rand(4, 32, k, dtype=dtype), rand(4, k, 24, dtype=dtype)
    c = rand(*a.shape[:-1], b.shape[-1], dtype=dtype) if op in ("addmm", "baddbmm") else None
    A, B = _layouts(a, layout), _layouts(b, layout)
    ad, bd = a.double(), b.double()
    if op == "mm":
        got, exact = A @ B, ad @ bd
    elif op == "matmul_nd":
        got, exact = torch.matmul(A, B), ad @ bd
    elif op == "linear":
        bias = rand(48, dtype=dtype)
        got = F.linear(A, B.t(), bias.to(DEV))
        exact = ad @ bd + bias.double()
    elif op == "addmm":
        got = torch.addmm(c.to(DEV), A, B, beta=0.5, alpha=2.0)
        exact = 0.5 * c.double() + 2.0 * (ad @ bd)
    elif op == "bmm":
        got, exact = torch.bmm(A, B), ad @ bd
    else:
        got = torch.baddbmm(c.to(DEV), A, B, beta=0.5, alpha=2.0)
        exact = 0.5 * c.double() + 2.0 * (ad @ bd)
    assert got.dtype == dtype and got.device.type == DEV
    assert_tensore(got, exact, k, absprod=ad.abs() @ bd.abs() * (2.0 if op in ("addmm", "baddbmm") else 1.0))


@pytest.mark.parametrize("dtype", HALF)
def test_bmm_with_a_broadcast_batch_operand_accumulates_in_fp32(dtype):
    # matmul of (B, M, K) by an expanded (B, K, N) view: stride 0 over the batch.
    torch.manual_seed(16)
    a, b = rand(3, 40, 256, dtype=dtype), rand(256, 24, dtype=dtype)
    got = torch.bmm(a.to(DEV), b.to(DEV).expand(3, 256, 24))
    exact = a.double() @ b.double()
    assert_tensore(got, exact, 256, absprod=a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("dtype", HALF)
def test_empty_contraction_gives_beta_times_self(dtype):
    a, b = torch.zeros(5, 0, dtype=dtype, device=DEV), torch.zeros(0, 7, dtype=dtype, device=DEV)
    c = rand(5, 7, dtype=dtype)
    assert torch.equal((a @ b).cpu(), torch.zeros(5, 7, dtype=dtype))
    assert torch.equal(torch.addmm(c.to(DEV), a, b, beta=0.5).cpu(), (c.float() * 0.5).to(dtype))


# Products at the size switch of the AVX2 route (csrc/backend/gemm.cpp, matmul_lowp_f32): from
# 2^25 multiply-adds for bf16 and 2^31 for fp16 MKL's mixed-precision GEMM reads the 16-bit
# operands directly (plain and transposed); below, exact fp32 copies and sgemm. Same contract.
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype,mkn", [(torch.bfloat16, (256, 512, 256)), (torch.float16, (1024, 2048, 1024)),
                                       (torch.float16, (1024, 512, 128))],
                         ids=["bf16_2^25", "fp16_2^31", "fp16_below_switch"])
def test_large_fp16_products_accumulate_in_fp32_and_round_once(dtype, mkn, layout):
    torch.manual_seed(4)
    m, k, n = mkn
    a, b = rand(m, k, dtype=dtype), rand(k, n, dtype=dtype)
    got = _layouts(a, layout) @ _layouts(b, layout)
    ad, bd = a.double(), b.double()
    assert got.dtype == dtype
    assert_tensore(got, ad @ bd, k, absprod=ad.abs() @ bd.abs())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", ["mv", "addmv", "dot"])
def test_fp16_matrix_vector_ops_accumulate_in_fp32(op, dtype):
    torch.manual_seed(1)
    k = 1024
    m, v = rand(64, k, dtype=dtype), rand(k, dtype=dtype)
    if op == "mv":
        got, exact, absprod = torch.mv(m.to(DEV), v.to(DEV)), m.double() @ v.double(), m.double().abs() @ v.double().abs()
    elif op == "addmv":
        c = rand(64, dtype=dtype)
        got = torch.addmv(c.to(DEV), m.to(DEV), v.to(DEV), beta=0.5, alpha=2.0)
        exact = 0.5 * c.double() + 2.0 * (m.double() @ v.double())
        absprod = 2.0 * (m.double().abs() @ v.double().abs())
    else:
        w = rand(k, dtype=dtype)
        got = torch.dot(w.to(DEV), v.to(DEV))
        exact, absprod = w.double() @ v.double(), w.double().abs() @ v.double().abs()
        got, exact, absprod = got.reshape(1), exact.reshape(1), absprod.reshape(1)
    assert got.dtype == dtype
    assert_tensore(got, exact, k, absprod=absprod, min_equal=0.95)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("op", ["mv", "addmv", "dot"])
def test_16_bit_matrix_vector_ops_keep_cpus_kernels_on_avx512_hosts(op, dtype):
    # Bound by reading the matrix, they keep CPU's kernels (which keep the contract, above) where
    # oneDNN is usable: an fp32 copy of the matrix cost 3x (gemm.cpp, gemv_routed).
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("routed on hosts without AVX-512")
    if dtype == torch.float16 and op != "dot" and ROUTES["fp16_cpu_product_kernels"]:
        pytest.skip("CPU's fp16 gemv is oneDNN's matmul here: neuron's fp16 gemv kernel runs instead")
    if dtype == torch.bfloat16 and op != "dot" and ROUTES["bf16_cpu_products_below_rows"]:
        pytest.skip("bf16 dot products run at half rate here: neuron's gemv kernel runs instead")
    torch.manual_seed(1)
    m, v, c = rand(64, 1024, dtype=dtype), rand(1024, dtype=dtype), rand(64, dtype=dtype)
    run = {"mv": lambda m, v, c: torch.mv(m, v),
           "addmv": lambda m, v, c: torch.addmv(c, m, v, beta=0.5, alpha=2.0),
           "dot": lambda m, v, c: torch.dot(m[0], v)}[op]
    args = [t.to(DEV) for t in (m, v, c)]
    before = torch.neuron.memory_stats()["allocation.all.allocated"]
    got = run(*args)
    # The result is the one device allocation: the routed path adds fp32 copies and a sum.
    assert torch.neuron.memory_stats()["allocation.all.allocated"] - before == 1
    assert torch.equal(got.cpu(), run(m, v, c))


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def gemv_dtype(request):
    """The dtypes neuron's gemv kernel runs: fp16 where CPU's fp16 GEMMs are oneDNN's, bf16 where
    bf16 dot products run at half rate (routed so here on any AVX512-BF16 host)."""
    if request.param == torch.float16 and not ROUTES["fp16_cpu_product_kernels"]:
        pytest.skip("neuron's fp16 gemv kernel runs where CPU's fp16 GEMMs are oneDNN's")
    if request.param == torch.bfloat16:
        if not ROUTES["cpu_avx512_bf16"] or ROUTES["lowp_gemm"] != "onednn-fp32":
            pytest.skip("bf16 takes the kernel on hosts with AVX512-BF16 at half rate")
        _C._set_bf16_half_rate(1)
    yield request.param
    _C._set_bf16_half_rate(-1)


def _gemv_matrix(rows, k, layout, dtype=torch.float16):
    """A (rows x k) matrix on neuron, row-major, column-major, or either with a leading dimension
    larger than its extent (a slice of a wider or taller matrix)."""
    m = rand(rows, k, dtype=dtype)
    if layout == "rows":
        return m, m.to(DEV)
    if layout == "cols":
        return m, m.t().contiguous().to(DEV).t()
    if layout == "rows_ld":
        wide = torch.zeros(rows, k + 24, dtype=m.dtype)
        wide[:, 5:5 + k] = m
        return m, wide.to(DEV)[:, 5:5 + k]
    tall = torch.zeros(k, rows + 40, dtype=m.dtype)
    tall[:, 3:3 + rows] = m.t()
    return m, tall.to(DEV)[:, 3:3 + rows].t()


@pytest.mark.parametrize("layout", ["rows", "cols", "rows_ld", "cols_ld"])
@pytest.mark.parametrize("rows,k", [(1, 1), (7, 15), (130, 64), (300, 1000), (129, 4096)])
def test_gemv_kernel_reads_either_layout_with_fp32_sums(rows, k, layout, gemv_dtype):
    # Every block and tail of the kernel (64-column steps, 16-column steps, scalar columns;
    # 128-row blocks and the remaining rows) against the exact value rounded once.
    torch.manual_seed(rows * 7 + k)
    m, md = _gemv_matrix(rows, k, layout, gemv_dtype)
    v, c = rand(k, dtype=gemv_dtype), rand(rows, dtype=gemv_dtype)
    got = torch.mv(md, v.to(DEV))
    absprod = m.double().abs() @ v.double().abs()
    assert_tensore(got, m.double() @ v.double(), k, absprod=absprod, min_equal=0.95)
    got = torch.addmv(c.to(DEV), md, v.to(DEV), beta=0.5, alpha=2.0)
    exact = 0.5 * c.double() + 2.0 * (m.double() @ v.double())
    assert_tensore(got, exact, k, absprod=2.0 * absprod, min_equal=0.95)


def test_gemv_kernel_allocates_only_the_result_and_follows_blas_scalars(gemv_dtype):
    torch.manual_seed(0)
    h = gemv_dtype
    m, v = rand(64, 256, dtype=h), rand(256, dtype=h)
    md, vd = m.to(DEV), v.to(DEV)
    torch.mv(md, vd)
    before = torch.neuron.memory_stats()["allocation.all.allocated"]
    torch.mv(md, vd)
    assert torch.neuron.memory_stats()["allocation.all.allocated"] - before == 1  # no fp32 copies
    nan_self = torch.full((64,), float("nan"), dtype=h)
    # beta = 0 ignores self (NaN included); alpha = 0 reads no product; a broadcast self
    got = torch.addmv(nan_self.to(DEV), md, vd, beta=0.0)
    assert_tensore(got, m.double() @ v.double(), 256, absprod=m.double().abs() @ v.double().abs(), min_equal=0.95)
    nan_m = m.clone()
    nan_m[3, 7] = float("nan")
    c = rand(64, dtype=h)
    assert torch.equal(torch.addmv(c.to(DEV), nan_m.to(DEV), vd, beta=0.5, alpha=0.0).cpu(), (0.5 * c.float()).to(h))
    s = rand(1, dtype=h)
    got = torch.addmv(s.to(DEV), md, vd, beta=1.0, alpha=1.0).cpu()
    assert_tensore(got, s.double() + m.double() @ v.double(), 256, absprod=m.double().abs() @ v.double().abs(),
                   min_equal=0.95)


def _one_row(op, x, w, c):
    """op on a 1 x k activation and an n x k weight, and the matrix-vector op it amounts to."""
    if op == "mm_row_major":
        wr = w.t().contiguous().t()  # the same values, B = wr.t() row-major
        return x @ wr.t(), torch.mv(wr, x[0])
    if op == "addmm":
        return torch.addmm(c, x, w.t(), beta=0.5, alpha=2.0), torch.addmv(c, w, x[0], beta=0.5, alpha=2.0)
    if op == "linear_3d":
        return F.linear(x[None], w, c)[0], torch.addmv(c, w, x[0])
    return x @ w.t(), torch.mv(w, x[0])


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
@pytest.mark.parametrize("op", ["mm_weight_t", "mm_row_major", "addmm", "linear_3d"])
def test_one_row_products_run_the_gemv_kernel(op, engine, gemv_dtype):
    # A decode step's linear layer (1 x k @ k x n) is a matrix-vector product: the gemv kernel's,
    # bit for bit the same as mv of the same weight, and TensorE's contract. The second weight
    # makes the order of the sums show (+-16 and many 2^-21 in one row: a single accumulator
    # loses the small ones; CPU's bf16 GEMM on one row gives another value than the kernel).
    h = gemv_dtype
    torch.manual_seed(15)
    x, w, c = rand(1, 4096, dtype=h), rand(300, 4096, dtype=h), rand(300, dtype=h)
    ordered = torch.full((300, 4096), 2.0 ** -21)
    ordered[:, 0], ordered[:, 32] = 16, -16
    previous = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(engine)
    try:
        got, mv = _one_row(op, x.to(DEV), w.to(DEV), c.to(DEV))
        assert got.shape == (1, 300)
        assert torch.equal(got.cpu()[0], mv.cpu())
        exact, absprod = _one_row(op, x.double(), w.double(), c.double())[0], _one_row(
            op, x.double().abs(), w.double().abs(), c.double().abs())[0]
        assert_tensore(got, exact, 4096, absprod=absprod, min_equal=0.95)
        got, mv = _one_row(op, torch.ones(1, 4096, dtype=h, device=DEV), ordered.to(h).to(DEV), c.to(DEV))
        assert torch.equal(got.cpu()[0], mv.cpu())
    finally:
        torch.neuron.engine.set_enabled(previous)


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
@pytest.mark.parametrize("rows", [1, 8])
def test_out_forms_of_one_and_few_row_products_take_the_functional_route(rows, engine, gemv_dtype):
    # Inductor's extern calls and ATen's _grouped_mm composite use mm.out / addmm.out: one-row and
    # few-row products there run the matrix-vector and few-row kernels too, the same bits as the
    # functional calls (CPU's out= kernel, which they had run, gave other bits here).
    h = gemv_dtype
    torch.manual_seed(16)
    x, w, c = rand(rows, 4096, dtype=h), rand(256, 4096, dtype=h), rand(256, dtype=h)
    xd, wd, cd = x.to(DEV), w.to(DEV), c.to(DEV)
    previous = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(engine)
    try:
        mm_out = torch.empty(rows, 256, dtype=h, device=DEV)
        addmm_out = torch.empty_like(mm_out)
        torch.mm(xd, wd.t(), out=mm_out)
        torch.addmm(cd, xd, wd.t(), out=addmm_out)
        assert torch.equal(mm_out.cpu(), torch.mm(xd, wd.t()).cpu())
        assert torch.equal(addmm_out.cpu(), torch.addmm(cd, xd, wd.t()).cpu())
    finally:
        torch.neuron.engine.set_enabled(previous)


def _sixteen_lane_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.t() in fp32 as the few-row kernel sums: lane l adds the exact products of k = l mod 16
    in order (a zero-padded tail), then the lanes are reduced as GCC's _mm512_reduce_add_ps does
    (halves of 8, of 4, then (0 + 2) + (1 + 3))."""
    k = x.shape[1]
    pad = (-k) % 16
    xs = np.pad(x.float().numpy(), ((0, 0), (0, pad)))
    ws = np.pad(w.float().numpy(), ((0, 0), (0, pad)))
    prods = (xs[:, None, :].astype(np.float64) * ws[None, :, :]).astype(np.float32)  # exact
    lanes = np.zeros(prods.shape[:2] + (16,), np.float32)
    for c in range(prods.shape[2] // 16):
        lanes = lanes + prods[..., c * 16:(c + 1) * 16]
    t3 = lanes[..., 8:] + lanes[..., :8]
    t6 = t3[..., 4:] + t3[..., :4]
    return torch.from_numpy((t6[..., 0] + t6[..., 2]) + (t6[..., 1] + t6[..., 3]))


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
@pytest.mark.parametrize("mkn", [(2, 4096, 300), (3, 1000, 7), (5, 17, 65), (8, 512, 129)], ids=str)
def test_few_row_products_run_the_few_row_kernel_with_fp32_sums(mkn, engine, gemv_dtype):
    # 2-8 rows (bf16 up to 16) with B = W.t(): the few-row kernel (gemv.h), every tail of it
    # (k not a multiple of 16, weight rows past a block of 4, activation rows past a group of 4),
    # TensorE's contract, and bits that do not depend on the thread count.
    m, k, n = mkn
    h = gemv_dtype
    torch.manual_seed(m * k + n)
    x, w, c = rand(m, k, dtype=h), rand(n, k, dtype=h), rand(n, dtype=h)
    previous = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(engine)
    threads = torch.get_num_threads()
    try:
        xd, wd, cd = x.to(DEV), w.to(DEV), c.to(DEV)
        got = xd @ wd.t()
        absprod = x.double().abs() @ w.double().abs().t()
        assert_tensore(got, x.double() @ w.double().t(), k, absprod=absprod, min_equal=0.95)
        biased = torch.addmm(cd, xd, wd.t(), beta=0.5, alpha=2.0)
        exact = 0.5 * c.double() + 2.0 * (x.double() @ w.double().t())
        assert_tensore(biased, exact, k, absprod=2.0 * absprod, min_equal=0.95)
        torch.set_num_threads(1)
        assert torch.equal((xd @ wd.t()).cpu(), got.cpu())
        # each row's sums are those of the row alone (4-row groups change no order)
        assert torch.equal((xd[:1].expand(2, -1) @ wd.t()).cpu()[1], got.cpu()[0])
        # the kernel's order exactly: 16 fp32 lanes along k, then _mm512_reduce_add_ps's tree
        assert torch.equal(got.cpu(), _sixteen_lane_product(x, w).to(h))
    finally:
        torch.set_num_threads(threads)
        torch.neuron.engine.set_enabled(previous)


def test_one_row_addmm_with_alpha_zero_keeps_cpus_nan():
    # CPU's addmm multiplies even with alpha = 0 (an inf product gives NaN), where BLAS's gemv
    # reads no product: such calls keep CPU's kernel.
    for h in (torch.float16, torch.bfloat16):
        x, w, c = rand(1, 64, dtype=h), rand(300, 64, dtype=h), rand(300, dtype=h)
        x[0, 3] = float("inf")
        _C._set_bf16_half_rate(1 if ROUTES["cpu_avx512_bf16"] else -1)
        try:
            got = torch.addmm(c.to(DEV), x.to(DEV), w.to(DEV).t(), alpha=0.0).cpu()
        finally:
            _C._set_bf16_half_rate(-1)
        assert torch.equal(got.isnan(), torch.addmm(c, x, w.t(), alpha=0.0).isnan())


@pytest.mark.parametrize("dtype", HALF)
def test_fp16_linear_backward_matches_fp64_reference(dtype):
    torch.manual_seed(2)
    x, w, g = rand(64, 256, dtype=dtype), rand(96, 256, dtype=dtype), rand(64, 96, dtype=dtype)
    X = x.to(DEV).requires_grad_()
    W = w.to(DEV).requires_grad_()
    F.linear(X, W).backward(g.to(DEV))
    gd = g.double()
    assert_tensore(X.grad, gd @ w.double(), 96, absprod=gd.abs() @ w.double().abs())
    assert_tensore(W.grad, gd.t() @ x.double(), 64, absprod=gd.abs().t() @ x.double().abs())


def test_fp16_results_live_in_device_memory_and_track_as_hot_ops():
    import torchneuron
    a = rand(64, 64).to(DEV)
    torchneuron.clear_op_tracking()
    out = a @ a
    assert out.device.type == DEV
    assert "aten::mm" in torchneuron.get_executed_ops()
    assert "aten::mm" not in torchneuron.get_fallback_ops()


def test_precision_routes_describe_this_host():
    assert ROUTES["lowp_gemm"] in ("onednn-fp32", "mkl-mixed")
    # CPU's bf16 kernels are kept exactly where oneDNN is usable (AVX-512) and the CPU has native
    # bf16 dot products (AVX512-BF16): an AVX-512 CPU without them (Ice Lake) routes bf16 too.
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    # ... at full rate: an AVX512-FP16 core (Intel Sapphire Rapids class) without AMX tiles runs
    # them at half fp32's rate, and routes bf16 but for products of fewer than 64 rows.
    half_rate = ROUTES["cpu_avx512_bf16"] and " avx512_fp16" in flags and " amx_bf16" not in flags
    assert ROUTES["bf16_cpu_products_below_rows"] == (64 if half_rate and ROUTES["lowp_gemm"] == "onednn-fp32" else 0)
    assert ROUTES["bf16_cpu_kernels"] == (ROUTES["lowp_gemm"] == "onednn-fp32" and ROUTES["cpu_avx512_bf16"]
                                          and not half_rate)
    assert ROUTES["cpu_avx512_bf16"] == (" avx512_bf16" in flags)
    # AMX is taken exactly where the CPU has its bf16 tiles (and torch links MKL, as its x86 builds do)
    assert ROUTES["amx_bf16_gemm"] == (" amx_bf16" in flags and torch.backends.mkl.is_available())
    # the AMX fp8 kernel needs the tiles only (amx_gemm.h)
    assert ROUTES["amx_fp8_kernel"] == (" amx_bf16" in flags and " amx_tile" in flags)
    # fp16 products keep CPU's kernels exactly where they are oneDNN's (AVX512-FP16 or AMX-FP16)
    fp16_onednn = (" avx512_fp16" in flags or " amx_fp16" in flags) and ROUTES["lowp_gemm"] == "onednn-fp32"
    assert ROUTES["fp16_cpu_product_kernels"] == fp16_onednn


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "linear"])
def test_fp16_products_run_cpus_onednn_kernels_where_they_accumulate_in_fp32(op):
    # With AVX512-FP16, CPU's fp16 GEMMs are oneDNN's, fp32-accumulating and faster than exact
    # fp32 copies (gemm.h, cpu_fast_fp16): neuron keeps them, bit for bit, and TensorE's
    # contract with them (3,000 ones sum to 3,000; an fp16 accumulator would stop at 2,048).
    if not ROUTES["fp16_cpu_product_kernels"]:
        pytest.skip("CPU's fp16 GEMMs are not oneDNN's on this host: fp16 products are routed")
    torch.manual_seed(5)
    h = torch.float16
    # (4,096-deep: oneDNN's fp16 kernel and an fp32 GEMM then sum in orders that differ in the bits)
    a, b, c = torch.randn(2, 48, 4096, dtype=h), torch.randn(2, 4096, 72, dtype=h), torch.randn(2, 48, 72, dtype=h)
    ones = torch.ones(2, 8, 3000, dtype=h), torch.ones(2, 3000, 8, dtype=h), torch.zeros(2, 8, 8, dtype=h)
    call = {"mm": lambda x, y, z: x[0] @ y[0], "addmm": lambda x, y, z: torch.addmm(z[0], x[0], y[0], beta=0.5),
            "bmm": lambda x, y, z: torch.bmm(x, y), "baddbmm": lambda x, y, z: torch.baddbmm(z, x, y, alpha=2.0),
            "linear": lambda x, y, z: F.linear(x, y[0].t(), z[0, 0])}[op]
    for args in ((a, b, c), ones):
        want = call(*args)
        got = call(*(t.to(DEV) for t in args)).cpu()
        assert torch.equal(got, want)
    assert (call(*(t.to(DEV) for t in ones)).cpu().float().abs() >= 2999).all()
    # CPU's kernel allocates nothing but the result; the routed path would take fp32 copies of
    # both operands from the device's pool (gemm.h, scratch) when it runs synchronously
    dev_args = [t.to(DEV) for t in (a, b, c)]
    torch.neuron.engine.set_enabled(False)
    try:
        before = torch.neuron.memory_stats()["allocation.all.allocated"]
        call(*dev_args)
        assert torch.neuron.memory_stats()["allocation.all.allocated"] - before == 1
    finally:
        torch.neuron.engine.set_enabled(True)


def _mkl_bf16_gemm(a, b_t):
    """fp32 a @ b_t.T through MKL's bf16 x bf16 -> fp32 GEMM (libtorch_cpu exports it), a and b_t
    row-major bf16 CPU tensors: the AMX route's accumulator, computed outside torchneuron."""
    import ctypes
    import os
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    f = lib.cblas_gemm_bf16bf16f32
    f.restype = None
    f.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    (m, k), n = a.shape, b_t.shape[0]
    c = torch.empty(m, n)
    f(101, 111, 112, m, n, k, 1.0, a.data_ptr(), k, b_t.data_ptr(), k, 0.0, c.data_ptr(), n)  # row-major, B^T
    return c


@pytest.mark.parametrize("mkn", [(2, 2048, 96), (16, 2048, 96), (17, 300, 65), (40, 33, 31), (160, 4100, 64),
                                 (96, 1, 8)], ids=str)
def test_amx_kernel_sums_equal_mkls_amx_gemm_and_take_no_scratch(mkn):
    # On an AMX host an fp8 GEMM with B column-major runs amx_gemm.cpp's kernel. TDPBF16PS adds
    # the exact products in k order, as MKL's AMX GEMM does, so the fp32 sums equal MKL's bit for
    # bit at every shape: decode rows (16 or fewer: the half-width path), tails of 32 in every
    # dimension, several k chunks and panel groups (160 x 4100). The AVX512-BF16 kernel sums in
    # another order (2048-deep: other bits), and MKL's route widens copies of both operands and
    # an fp32 accumulator from the device's pool, where the kernel reads the codes in place.
    if not ROUTES["amx_fp8_kernel"]:
        pytest.skip("this CPU has no AMX tiles")
    torch.manual_seed(0)
    m, k, n = mkn
    a = (torch.randn(m, k) * 4).to(torch.float8_e4m3fn)
    b_t = (torch.randn(n, k) * 4).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=DEV)
    ad, bd = a.to(DEV), b_t.to(DEV).t()
    torch.neuron.engine.set_enabled(False)
    try:
        before = torch.neuron.memory_stats()["allocation.all.allocated"]
        got = torch._scaled_mm(ad, bd, one, one, out_dtype=torch.float32)
        assert torch.neuron.memory_stats()["allocation.all.allocated"] - before == 1
    finally:
        torch.neuron.engine.set_enabled(True)
    assert torch.equal(got.cpu(), _mkl_bf16_gemm(a.to(torch.bfloat16), b_t.to(torch.bfloat16)))


def test_amx_kernel_runs_a_product_too_large_to_pack_at_once_in_row_slices():
    # The packed activations are held to ~16 MiB per calling thread: 4100 rows of 2048 (16.8 MB
    # packed) run as two slices of rows, each row's sums and scales still its own.
    if not ROUTES["amx_fp8_kernel"]:
        pytest.skip("this CPU has no AMX tiles")
    torch.manual_seed(3)
    a = (torch.randn(4100, 2048) * 4).to(torch.float8_e4m3fn)
    b_t = (torch.randn(40, 2048) * 4).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(4100, 1) + 0.5, torch.rand(1, 40) + 0.5
    want = ((_mkl_bf16_gemm(a.to(torch.bfloat16), b_t.to(torch.bfloat16)) * sa) * sb).to(torch.bfloat16)
    for ad in (a.to(DEV), a.t().contiguous().to(DEV).t()):  # A row-major and column-major
        got = torch._scaled_mm(ad, b_t.to(DEV).t(), sa.to(DEV), sb.to(DEV), out_dtype=torch.bfloat16).cpu()
        assert torch.equal(_bits(got), _bits(want))


def test_amx_kernel_bits_of_a_row_do_not_depend_on_the_batch():
    # A token's result is the same whether it is decoded alone (the half-width path), with 15
    # others, or in a batch of 40 (full-width panels): each sum is its own k-ordered chain.
    # (MKL takes another kernel for one row, so it is no oracle there.)
    if not ROUTES["amx_fp8_kernel"]:
        pytest.skip("this CPU has no AMX tiles")
    torch.manual_seed(1)
    a = (torch.randn(40, 1000) * 4).to(torch.float8_e4m3fn).to(DEV)
    b = (torch.randn(70, 1000) * 4).to(torch.float8_e4m3fn).to(DEV).t()
    sa, sb = torch.rand(40, 1, device=DEV) + 0.5, torch.rand(1, 70, device=DEV) + 0.5
    outs = [torch._scaled_mm(a[:rows], b, sa[:rows], sb, out_dtype=torch.bfloat16).cpu() for rows in (1, 16, 40)]
    assert torch.equal(_bits(outs[0][0]), _bits(outs[2][0]))
    assert torch.equal(_bits(outs[1]), _bits(outs[2][:16]))


def test_amx_kernel_k_padding_is_zero_after_a_product_with_inf_and_nan():
    # k pads to a multiple of 32 with zeros on both sides: a stale Inf or NaN left in the
    # kernel's buffers by an earlier product would make 0 x Inf = NaN in every padded sum.
    if not ROUTES["amx_fp8_kernel"]:
        pytest.skip("this CPU has no AMX tiles")
    torch.manual_seed(2)
    E5M2 = torch.float8_e5m2
    inf_a = torch.full((40, 1024), float("inf")).to(E5M2)
    nan_b = torch.full((64, 1024), float("nan")).to(E5M2)
    one = torch.tensor(1.0, device=DEV)
    torch._scaled_mm(inf_a.to(DEV), nan_b.to(DEV).t(), one, one, out_dtype=torch.float32)
    a = (torch.randn(40, 100) * 4).to(E5M2)  # (one k chunk: its padding is where the NaNs were)
    b_t = (torch.randn(64, 100) * 4).to(E5M2)
    got = torch._scaled_mm(a.to(DEV), b_t.to(DEV).t(), one, one, out_dtype=torch.float32).cpu()
    assert torch.equal(got, _mkl_bf16_gemm(a.to(torch.bfloat16), b_t.to(torch.bfloat16)))


def test_amx_route_takes_mkls_bf16_gemm_as_the_fp32_accumulator_for_row_major_b():
    # A row-major B (its columns strided) is not the AMX kernel's: on an AMX host, from 128 rows,
    # its fp32 sums are MKL's AMX bf16 GEMM over the exactly widened codes, bit for bit; the
    # AVX512-BF16 kernel sums 2048-deep products in another order.
    if not ROUTES["amx_bf16_gemm"]:
        pytest.skip("this CPU has no AMX")
    torch.manual_seed(0)
    a = torch.randn(128, 2048).to(torch.float8_e4m3fn)  # (rows enough for MKL: scaled_mm.cpp)
    b_t = torch.randn(96, 2048).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=DEV)
    expect = _mkl_bf16_gemm(a.to(torch.bfloat16), b_t.to(torch.bfloat16))
    b_rows = b_t.t().contiguous().to(DEV)
    got = torch._scaled_mm(a.to(DEV), b_rows, one, one, out_dtype=torch.float32).cpu()
    assert torch.equal(got, expect)
    if ROUTES["bf16_fp32_gemm_avx512"]:
        _C._set_amx_gemm_enabled(False)
        try:
            other = torch._scaled_mm(a.to(DEV), b_rows, one, one, out_dtype=torch.float32).cpu()
        finally:
            _C._set_amx_gemm_enabled(True)
        assert not torch.equal(other, expect)  # the comparison tells the routes apart
        assert torch.allclose(other, expect, rtol=1e-5, atol=1e-3)


@pytest.fixture
def bf16_half_rate():
    """Route bf16 as a host whose bf16 dot products run at half fp32's rate (gemm.h)."""
    if not ROUTES["cpu_avx512_bf16"] or ROUTES["lowp_gemm"] != "onednn-fp32":
        pytest.skip("needs oneDNN's native bf16 kernels (AVX512-BF16)")
    if ROUTES["amx_bf16_gemm"] or ROUTES["amx_fp8_kernel"]:
        # CPU's bf16 kernels multiply on AMX tiles there: the comparisons with them below assume
        # the half-rate host's oneDNN kernels
        pytest.skip("an AMX host is never a half-rate one")
    _C._set_bf16_half_rate(1)
    yield
    _C._set_bf16_half_rate(-1)


def _bf16_product(op, a, b, c):
    if op == "mm":
        return a @ b
    if op == "mm_out":
        return torch.mm(a, b, out=torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device))
    if op == "addmm":
        return torch.addmm(c, a, b)
    if op == "linear":
        return F.linear(a, b.t(), c)
    return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[1]


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
@pytest.mark.parametrize("op", ["mm", "mm_out", "addmm", "linear", "bmm"])
def test_bf16_products_from_64_rows_take_exact_fp32_copies_on_half_rate_hosts(op, engine, bf16_half_rate):
    # oneDNN's bf16 GEMM there runs at ~0.65 of an fp32 GEMM's speed: from 64 rows the product is
    # one fp32 GEMM of exact copies, rounded once (TensorE's contract), which differs from CPU's
    # bf16 sums somewhere at k = 2,048; below, oneDNN's bf16 kernel (reading half the bytes) is
    # kept bit for bit.
    torch.manual_seed(11)
    previous = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(engine)
    try:
        for rows, routed in ((64, True), (63, False)):
            a, b, c = (torch.randn(rows, 2048, dtype=torch.bfloat16), torch.randn(2048, 96, dtype=torch.bfloat16),
                       torch.randn(96, dtype=torch.bfloat16))
            got = _bf16_product(op, a.to(DEV), b.to(DEV), c.to(DEV)).cpu()
            cpu = _bf16_product(op, a, b, c)
            exact = (a.double() @ b.double() + (c.double() if op in ("addmm", "linear") else 0))
            if routed:
                assert not torch.equal(got, cpu)
                assert_tensore(got, exact, 2048, absprod=a.double().abs() @ b.double().abs() + (
                    c.double().abs() if op in ("addmm", "linear") else 0))
            else:
                assert torch.equal(got, cpu)
    finally:
        torch.neuron.engine.set_enabled(previous)


def test_bf16_convolution_and_attention_take_exact_fp32_copies_on_half_rate_hosts(bf16_half_rate):
    # CPU's fp32 kernels on exact (channels-last) copies, rounded once: TensorE's contract, where
    # CPU's bf16 kernels sum otherwise (2,304 products a convolution output here)
    torch.manual_seed(12)
    x, w = rand(2, 256, 9, 9, dtype=torch.bfloat16), rand(32, 256, 3, 3, dtype=torch.bfloat16)
    got = F.conv2d(x.to(DEV), w.to(DEV))
    assert_tensore(got, F.conv2d(x.double(), w.double()), 2304, absprod=F.conv2d(x.double().abs(), w.double().abs()))
    assert not torch.equal(got.cpu(), F.conv2d(x, w))
    q = rand(1, 2, 64, 32, dtype=torch.bfloat16)
    got = F.scaled_dot_product_attention(*(q.to(DEV),) * 3).cpu()
    assert torch.equal(got, F.scaled_dot_product_attention(*(q.float(),) * 3).to(torch.bfloat16))
    assert not torch.equal(got, F.scaled_dot_product_attention(q, q, q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_bf16_still_equal_cpu_bit_for_bit(dtype):
    torch.manual_seed(3)
    if dtype == torch.bfloat16 and not ROUTES["bf16_cpu_kernels"]:
        # This host's CPU bf16 GEMM and convolution are scalar loops: bf16 takes the exact
        # route and is held to the TensorE contract instead of CPU's bits.
        a, b = rand(48, 200, dtype=dtype), rand(200, 72, dtype=dtype)
        assert_tensore(a.to(DEV) @ b.to(DEV), a.double() @ b.double(), 200,
                       absprod=a.double().abs() @ b.double().abs())
        x, w = rand(2, 4, 9, 9, dtype=dtype), rand(3, 4, 3, 3, dtype=dtype)
        assert_tensore(F.conv2d(x.to(DEV), w.to(DEV)), F.conv2d(x.double(), w.double()), 36,
                       absprod=F.conv2d(x.double().abs(), w.double().abs()))
        return
    a, b, c = (torch.randn(48, 200, dtype=dtype), torch.randn(200, 72, dtype=dtype),
               torch.randn(72, dtype=dtype))
    assert torch.equal((a.to(DEV) @ b.to(DEV)).cpu(), a @ b)
    assert torch.equal(torch.addmm(c.to(DEV), a.to(DEV), b.to(DEV)).cpu(), torch.addmm(c, a, b))
    x = torch.randn(2, 4, 9, 9, dtype=dtype)
    w = torch.randn(3, 4, 3, 3, dtype=dtype)
    assert torch.equal(F.conv2d(x.to(DEV), w.to(DEV)).cpu(), F.conv2d(x, w))


def _column_major_product(op, a_rows, b):
    """op over A = a_rows' transpose (column-major, as `grad_output.t()` in a weight gradient)."""
    a = a_rows.transpose(-1, -2)
    if op == "mm":
        return torch.mm(a, b)
    if op == "bmm":
        return torch.bmm(a, b)
    out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    return (torch.mm if op == "mm_out" else torch.bmm)(a, b, out=out)


@pytest.mark.parametrize("op", ["mm", "mm_out", "bmm", "bmm_out"])
def test_bf16_product_of_a_column_major_a_multiplies_a_row_major_copy(op):
    # gemm.cpp, row_major_first: oneDNN re-reads a column-major bf16 A for every block of B's
    # columns; from 1,536 columns neuron copies A row-major first. Its sums are then oneDNN's for
    # a row-major A, which at this shape differ from CPU's for the column-major A in a few
    # elements (checked below: the comparison tells the routes apart).
    if not ROUTES["bf16_cpu_kernels"]:
        pytest.skip("CPU's bf16 kernels are not oneDNN's on this host: bf16 products are routed")
    torch.manual_seed(7)
    batch = (3,) if op.startswith("bmm") else ()
    a_rows = torch.randn(*batch, 1024, 96, dtype=torch.bfloat16)
    b = torch.randn(*batch, 1024, 1536, dtype=torch.bfloat16)
    want = _column_major_product(op, a_rows.transpose(-1, -2).contiguous().transpose(-1, -2), b)
    assert not torch.equal(want, _column_major_product(op, a_rows, b))
    got = _column_major_product(op, a_rows.to(DEV), b.to(DEV))
    assert torch.equal(got.cpu(), want)


def test_bf16_linear_weight_gradient_multiplies_a_row_major_copy():
    # The weight gradient of nn.Linear(1536 -> 96) over 1,024 tokens is grad_output.t() @ input:
    # 96 x 1024 x 1536 with A column-major, the product the route is for.
    if not ROUTES["bf16_cpu_kernels"]:
        pytest.skip("CPU's bf16 kernels are not oneDNN's on this host: bf16 products are routed")
    torch.manual_seed(8)
    x = torch.randn(1024, 1536, dtype=torch.bfloat16)
    w = torch.randn(96, 1536, dtype=torch.bfloat16)
    g = torch.randn(1024, 96, dtype=torch.bfloat16)
    wd = w.to(DEV).requires_grad_()
    F.linear(x.to(DEV), wd).backward(g.to(DEV))
    assert torch.equal(wd.grad.cpu(), g.t().contiguous() @ x)


@pytest.mark.parametrize("case", ["narrow_b", "padded_a"])
def test_bf16_products_outside_the_row_major_rule_keep_cpus_bits(case):
    # Where oneDNN's kernel for a column-major A is as fast (fewer than 1,536 columns and 2,048
    # rows), or A is not a dense column-major matrix, neuron runs CPU's kernel on A as it is.
    if not ROUTES["bf16_cpu_kernels"]:
        pytest.skip("CPU's bf16 kernels are not oneDNN's on this host: bf16 products are routed")
    torch.manual_seed(9)
    if case == "narrow_b":  # 64 x 4096 x 1024: the two layouts' sums differ in a few elements
        wide, b = torch.randn(4096, 64, dtype=torch.bfloat16), torch.randn(4096, 1024, dtype=torch.bfloat16)
        cols = 64
    else:  # 96 x 1024 x 1536 as above, A's columns 128 elements apart
        wide, b = torch.randn(1024, 128, dtype=torch.bfloat16), torch.randn(1024, 1536, dtype=torch.bfloat16)
        cols = 96
    a_rows = wide[:, :cols]
    want = a_rows.t() @ b
    assert not torch.equal(want, a_rows.t().contiguous() @ b)
    assert torch.equal((wide.to(DEV)[:, :cols].t() @ b.to(DEV)).cpu(), want)


# ---- fp16: convolution and attention --------------------------------------------------------
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("dtype", HALF)
def test_fp16_conv2d_forward_and_backward_match_fp64_reference(dtype, memory_format):
    torch.manual_seed(4)
    x, w, b, g = (rand(2, 8, 12, 12, dtype=dtype), rand(16, 8, 3, 3, dtype=dtype), rand(16, dtype=dtype),
                  rand(2, 16, 12, 12, dtype=dtype))
    # A channels-last input is widened as it is (no transpose); a contiguous one is transposed.
    X = x.to(DEV).contiguous(memory_format=memory_format).requires_grad_()
    Wt, Bs = (t.to(DEV).requires_grad_() for t in (w, b))
    out = F.conv2d(X, Wt, Bs, padding=1)
    out.backward(g.to(DEV))
    xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
    ref = F.conv2d(xd, wd, bd, padding=1)
    ref.backward(g.double())
    absref = F.conv2d(xd.detach().abs(), wd.detach().abs(), padding=1)
    assert out.dtype == dtype and X.grad.dtype == dtype
    assert_tensore(out, ref.detach(), 72, absprod=absref)
    for got, exact in ((X.grad, xd.grad), (Wt.grad, wd.grad), (Bs.grad, bd.grad)):
        # fp32 accumulation over up to 2*12*12*... terms: bound by the values' own scale.
        assert_tensore(got, exact, 300, absprod=exact.abs() + 8.0, min_equal=0.95)


@pytest.mark.parametrize("weight_format", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=str)
@pytest.mark.parametrize("dtype", HALF)
def test_fp16_conv2d_output_and_grads_keep_the_layouts_of_fp32s(dtype, memory_format, weight_format):
    # The routed convolution computes on channels-last fp32 copies (oneDNN's fast layout); its
    # result and gradients have the layouts CPU's fp32 convolution gives the caller's tensors. (Called
    # directly: autograd would restride a leaf's grad to the leaf's layout anyway.)
    torch.manual_seed(5)
    x = rand(2, 16, 20, 20, dtype=dtype).contiguous(memory_format=memory_format)
    w = rand(16, 16, 3, 3, dtype=dtype).contiguous(memory_format=weight_format)
    g = rand(2, 16, 20, 20, dtype=dtype).contiguous(memory_format=memory_format)
    args = ([16], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    got = torch.ops.aten.convolution_backward(g.to(DEV), x.to(DEV), w.to(DEV), *args)
    want = torch.ops.aten.convolution_backward(g.float(), x.float(), w.float(), *args)
    assert F.conv2d(x.to(DEV), w.to(DEV), padding=1).stride() == F.conv2d(x.float(), w.float(), padding=1).stride()
    assert [t.stride() for t in got] == [t.stride() for t in want]


def _sdpa_reference(q, k, v, causal):
    qd, kd, vd = (t.double() for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ vd


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("compiled", [False, True])
def test_fp16_sdpa_forward_and_backward_match_fp64_reference(compiled, dtype):
    if dtype == torch.bfloat16 and ROUTES["bf16_cpu_kernels"]:
        pytest.skip("bf16 attention runs CPU's own kernels on this host (compared with CPU elsewhere)")
    torch.manual_seed(5)
    q, k, v, g = (rand(2, 2, 64, 32, dtype=dtype) for _ in range(4))
    Q, K, V = (t.to(DEV).requires_grad_() for t in (q, k, v))
    f = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="neuron")
    out = f(Q, K, V)
    out.backward(g.to(DEV))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = _sdpa_reference(qd, kd, vd, True)
    ref.backward(g.double())
    # Attention is computed in fp32 (softmax included) and rounded once: 99.9 % of the outputs
    # are the once-rounded exact value (CPU's fp16 kernel, which rounds P to fp16 before P @ V:
    # 66 %). The gradients start from the fp16-rounded output and its gradient (as TensorE's
    # would), which costs about 2^-11 of their scale; still 78-99 % exact (CPU's fp16: 56-57 %).
    assert_tensore(out, ref.detach(), 64, absprod=torch.full_like(ref, 1.0), min_equal=0.99)
    for got, exact in ((Q.grad, qd.grad), (K.grad, kd.grad), (V.grad, vd.grad)):
        assert_tensore(got, exact, 64, min_equal=0.75, atol=ULP[dtype] / 2 * exact.abs().max().item())


# ---- compiled graphs reach the same kernels ----------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_compiled_fp16_gemms_conv_and_scaled_mm_equal_eager(dtype):
    torch.manual_seed(6)
    x, w, c = (rand(32, 256, dtype=dtype).to(DEV), rand(128, 256, dtype=dtype).to(DEV),
               rand(4, 64, 96, dtype=dtype).to(DEV))
    img, kern = rand(2, 4, 10, 10, dtype=dtype).to(DEV), rand(6, 4, 3, 3, dtype=dtype).to(DEV)
    a8 = torch.randn(64, 128).to(E4M3).to(DEV)
    b8 = torch.randn(96, 128).to(E4M3).to(DEV).t()
    s = torch.tensor(0.5, device=DEV)

    def f(x, w, c, img, kern, a8, b8, s):
        return (F.linear(x, w), torch.bmm(c, c.transpose(1, 2)), F.conv2d(img, kern),
                torch._scaled_mm(a8, b8, s, s, out_dtype=torch.bfloat16))

    torch._dynamo.reset()
    eager = f(x, w, c, img, kern, a8, b8, s)
    compiled = torch.compile(f, backend="neuron")(x, w, c, img, kern, a8, b8, s)
    for e, got in zip(eager, compiled):
        assert got.dtype == e.dtype
        assert torch.equal(got.cpu(), e.cpu())


# ---- fp8: torch._scaled_mm -----------------------------------------------------------------------
def _fp8_operands(m, k, n, adt, bdt, b_col_major=True):
    a = (torch.randn(m, k) * 4).to(adt)
    if b_col_major:  # CUDA's layout: mat2 = weight.t()
        b = (torch.randn(n, k) * 4).to(bdt).t()
    else:
        b = (torch.randn(k, n) * 4).to(bdt)
    return a, b


def _to_dev(t):
    return t.to(DEV) if t.is_contiguous() else t.t().contiguous().to(DEV).t()


@pytest.fixture(params=["amx", "avx512_bf16", "without"])
def fp8_route(request):
    """Each fp8 GEMM test on every host route this CPU has: on AMX hosts amx_gemm.cpp's kernel
    (B column-major) or MKL's AMX bf16 GEMM over widened codes (B row-major; with the
    AVX512-BF16 kernel off, at every size), bf16_gemm.cpp's AVX512-BF16 kernel reading the fp8
    codes, and the route of hosts with neither (widened copies, an fp32 accumulator, the
    epilogue as tensor ops)."""
    if request.param == "amx" and not ROUTES["amx_bf16_gemm"]:
        pytest.skip("this CPU has no AMX (or torch no MKL)")
    if request.param == "avx512_bf16" and not ROUTES["bf16_fp32_gemm_avx512"]:
        pytest.skip("this CPU has no AVX512-BF16")
    _C._set_amx_gemm_enabled(request.param == "amx")
    _C._set_bf16_gemm_enabled(request.param == "avx512_bf16")
    _C._set_bf16_half_rate(0)  # the kernel at every size (half-rate hosts: test below)
    try:
        yield request.param
    finally:
        _C._set_amx_gemm_enabled(True)
        _C._set_bf16_gemm_enabled(True)
        _C._set_bf16_half_rate(-1)


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_scaled_mm_of_few_rows_runs_the_few_row_kernel_on_half_rate_hosts(rows, engine):
    # Up to 16 rows with B column-major: the few-row kernel's sums (fp8 weight rows widened in
    # cache), in its exact order, then the scales (tensor-wise as alpha; row-wise epilogue).
    if not ROUTES["bf16_fp32_gemm_avx512"] or ROUTES["lowp_gemm"] != "onednn-fp32":
        pytest.skip("needs the AVX512-BF16 kernel and oneDNN")
    torch.manual_seed(16 + rows)
    a, b = _fp8_operands(rows, 1000, 67, E4M3, E5M2)
    sa, sb = torch.rand(rows, 1) + 0.5, torch.rand(1, 67) + 0.5
    previous = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(engine)
    _C._set_amx_gemm_enabled(False)
    _C._set_bf16_half_rate(1)
    try:
        one = torch.tensor(1.0, device=DEV)
        sums = torch._scaled_mm(a.to(DEV), _to_dev(b), one, one, out_dtype=torch.float32).cpu()
        scaled = torch._scaled_mm(a.to(DEV), _to_dev(b), sa.to(DEV), sb.to(DEV), out_dtype=torch.bfloat16).cpu()
    finally:
        _C._set_amx_gemm_enabled(True)
        _C._set_bf16_half_rate(-1)
        torch.neuron.engine.set_enabled(previous)
    assert torch.equal(sums, _sixteen_lane_product(a.float(), b.t().float()))
    assert torch.equal(scaled, ((sums * sa) * sb).to(torch.bfloat16))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_scaled_mm_takes_fp32_copies_from_64_rows_on_half_rate_hosts(scaling):
    # Where bf16 dot products run at half rate (gemm.h, bf16_half_rate), an fp8 GEMM of 64 rows
    # or more is an fp32 GEMM of exact copies (the route of hosts without AVX512-BF16); fewer
    # rows keep the AVX512-BF16 kernel, which reads the codes in place.
    if not ROUTES["bf16_fp32_gemm_avx512"] or ROUTES["lowp_gemm"] != "onednn-fp32":
        pytest.skip("needs the AVX512-BF16 kernel and oneDNN")
    torch.manual_seed(13)

    def run(a, b, half_rate, kernel):
        sa = torch.tensor(0.5) if scaling == "tensorwise" else torch.rand(a.shape[0], 1) + 0.5
        sb = torch.tensor(2.0) if scaling == "tensorwise" else torch.rand(1, b.shape[1]) + 0.5
        _C._set_amx_gemm_enabled(False)
        _C._set_bf16_half_rate(half_rate)
        _C._set_bf16_gemm_enabled(kernel)
        try:
            return torch._scaled_mm(a.to(DEV), b.to(DEV), sa.to(DEV), sb.to(DEV), out_dtype=torch.float32).cpu()
        finally:
            _C._set_amx_gemm_enabled(True)
            _C._set_bf16_half_rate(-1)
            _C._set_bf16_gemm_enabled(True)

    for rows, copies in ((64, True), (63, False)):
        a, b = _fp8_operands(rows, 2048, 96, E4M3, E4M3)
        torch.manual_seed(14)
        kernel = run(a, b, 0, True)
        torch.manual_seed(14)
        fp32 = run(a, b, 0, False)
        torch.manual_seed(14)
        half = run(a, b, 1, True)
        assert not torch.equal(kernel, fp32)  # the routes' sums differ somewhere at this depth
        assert torch.equal(half, fp32 if copies else kernel)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
def test_scaled_mm_is_exact_fp8_products_fp32_accumulation_one_rounding(dtypes, scaling, out_dtype, fp8_route):
    torch.manual_seed(7)
    m, k, n = 96, 256, 80  # large enough for the oneDNN bf16 route (tensorwise -> bf16)
    a, b = _fp8_operands(m, k, n, *dtypes)
    if scaling == "tensorwise":
        sa, sb = torch.tensor(0.375), torch.tensor(1.5)
    else:
        sa, sb = torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5
    got = torch._scaled_mm(_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV), out_dtype=out_dtype)
    ad, bd = a.double(), b.double()
    exact = (ad @ bd) * sa.double() * sb.double()
    absprod = (ad.abs() @ bd.abs()) * sa.double() * sb.double()
    assert got.dtype == out_dtype and got.shape == (m, n)
    # An fp32 output keeps the fp32 accumulation error itself: only the bound applies.
    assert_tensore(got, exact, k, absprod=absprod, min_equal=0.0 if out_dtype == torch.float32 else 0.99)


# Across the AVX512-BF16 kernel's blocking (bf16_gemm.cpp: 8 x 32 micro-tiles, k slices of 512,
# 64-row tasks, columns split among tasks below 4 row blocks, B packed 1024 columns at a time, fewer
# for k > 2048; vectorized packing of 8 whole pairs, element loop for the rest): odd k, partial
# tiles, panels and slices, a single row or column, one and several row blocks, an empty sum.
EDGE_SHAPES = [(1, 1, 1), (7, 3, 5), (9, 33, 31), (65, 513, 97), (130, 1030, 40), (3, 1025, 1100), (16, 2, 16),
               (64, 48, 256), (200, 4100, 1100), (5, 0, 7)]


@pytest.mark.parametrize("layouts", ["a rows, b columns", "a rows, b rows", "a columns, b columns"])
@pytest.mark.parametrize("mkn", EDGE_SHAPES, ids=str)
def test_scaled_mm_fp32_accumulator_across_blocking_edges(mkn, layouts, fp8_route):
    torch.manual_seed(11)
    m, k, n = mkn
    a, b = _fp8_operands(m, k, n, E4M3, E4M3, b_col_major=layouts.endswith("b columns"))
    ad = a.t().contiguous().to(DEV).t() if layouts.startswith("a columns") else a.to(DEV)
    sa, sb = torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5
    bias = torch.randn(n)
    got = torch._scaled_mm(ad, _to_dev(b), sa.to(DEV), sb.to(DEV), bias=bias.to(DEV), out_dtype=torch.float32)
    exact = (a.double() @ b.double()) * sa.double() * sb.double() + bias.double()
    absprod = (a.double().abs() @ b.double().abs()) * sa.double() * sb.double()
    assert_tensore(got, exact, k, absprod=absprod, min_equal=0.0, atol=2.0 ** -24 * bias.double().abs())
    # The bf16 result is the fp32 one rounded once, as CPU rounds it.
    got16 = torch._scaled_mm(ad, _to_dev(b), sa.to(DEV), sb.to(DEV), bias=bias.to(DEV), out_dtype=torch.bfloat16)
    assert torch.equal(_bits(got16.cpu()), _bits(got.cpu().to(torch.bfloat16)))


BLOCK_CONFIGS = ["1x128 x 128x128", "1x128 x 1x128", "128x128 x 1x128"]


def _block_scales(config, m, k, n):
    kb = -(-k // 128)
    a_rows = config.startswith("1x128")
    sa = torch.rand(m if a_rows else -(-m // 128), kb) + 0.5
    sb = torch.rand(kb, -(-n // 128) if config.endswith("128x128") else n) + 0.5
    # per element of a and b's K blocks
    SA = sa if a_rows else sa.repeat_interleave(128, dim=0)[:m]
    SB = sb.repeat_interleave(128, dim=1)[:, :n] if config.endswith("128x128") else sb
    return sa, sb, SA.double(), SB.double()


@pytest.mark.parametrize("mkn", [(5, 300, 200), (130, 256, 129), (12, 128, 256), (1, 64, 7), (3, 0, 4)], ids=str)
@pytest.mark.parametrize("config", BLOCK_CONFIGS)
def test_block_scaled_mm_scales_each_k_blocks_fp32_sum(config, mkn):
    # DeepSeek-style block scaling (torch's three configurations): each 128-wide K block's
    # exact products summed in fp32, times its two block scales, the blocks added in fp32,
    # then the bias, one rounding
    torch.manual_seed(13)
    m, k, n = mkn
    a, b = _fp8_operands(m, k, n, E4M3, E4M3)
    sa, sb, SA, SB = _block_scales(config, m, k, n)
    bias = torch.randn(n)
    exact = torch.zeros(m, n, dtype=torch.float64) + bias.double()
    absprod = torch.zeros(m, n, dtype=torch.float64)
    for j, k0 in enumerate(range(0, k, 128)):
        ad, bd = a[:, k0:k0 + 128].double(), b[k0:k0 + 128].double()
        exact += (ad @ bd) * SA[:, j:j + 1] * SB[j]
        absprod += (ad.abs() @ bd.abs()) * SA[:, j:j + 1] * SB[j]
    args = (_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV))
    got = torch._scaled_mm(*args, bias=bias.to(DEV), out_dtype=torch.float32)
    # each block's sum, its two scalings and the additions: a few fp32 roundings of the terms
    assert_tensore(got, exact, k + 4 * (k // 128 + 1), absprod=absprod, min_equal=0.0,
                   atol=2.0 ** -22 * bias.double().abs())
    got16 = torch._scaled_mm(*args, bias=bias.to(DEV), out_dtype=torch.bfloat16)
    assert torch.equal(_bits(got16.cpu()), _bits(got.cpu().to(torch.bfloat16)))


def test_block_scaled_mm_block_scales_are_not_row_scales():
    # 1x128 x 128x128 with two K blocks: the second block's scales weigh the second block only
    m, k, n = 4, 256, 8
    a = torch.ones(m, k).to(E4M3)
    b = torch.ones(n, k).to(E4M3).t()
    sa = torch.tensor([[1.0, 2.0]]).expand(m, 2).contiguous()
    sb = torch.tensor([[1.0], [3.0]])
    got = torch._scaled_mm(_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV), out_dtype=torch.float32)
    assert torch.equal(got.cpu(), torch.full((m, n), 128.0 * 1 * 1 + 128.0 * 2 * 3))


def test_scaled_mm_with_unknown_scale_shapes_names_every_configuration():
    a, b = _fp8_operands(4, 256, 8, E4M3, E4M3)
    with pytest.raises(ValueError, match=r"row-wise scales of shape \(4, 1\).*block scales: \(4, 2\) and \(2, 1\)"):
        torch._scaled_mm(_to_dev(a), _to_dev(b), torch.ones(4, 3, device=DEV), torch.ones(3, 8, device=DEV))


def test_scaled_mm_bf16_result_rounds_subnormals_and_nan_like_cpu(fp8_route):
    # Scales that take the fp32 results into the subnormal range (vcvtneps2bf16 would flush
    # them to zero) and a NaN row scale (CPU's conversion writes 0xFFFF for every NaN).
    torch.manual_seed(12)
    a, b = _fp8_operands(40, 64, 48, E4M3, E4M3)
    sa = torch.full((40, 1), 1e-41)
    sa[3, 0] = float("nan")
    sb = torch.rand(1, 48) + 0.5
    got = torch._scaled_mm(_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV), out_dtype=torch.bfloat16).cpu()
    acc = torch._scaled_mm(_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV), out_dtype=torch.float32).cpu()
    sub = (acc[:3] != 0) & (acc[:3].abs() < torch.finfo(torch.float32).tiny)
    assert bool((sub & (acc[:3].to(torch.bfloat16) != 0)).any())  # subnormals that survive in bf16
    assert torch.equal(_bits(got), _bits(acc.to(torch.bfloat16)))
    assert bool(got[3].isnan().all())


def test_scaled_mm_reads_strided_and_broadcast_operands(fp8_route):
    # Every other column (copied first), a broadcast row (read in place at a leading dimension of
    # 0), a column slice of a column-major mat2: the same exact product.
    torch.manual_seed(14)
    wide = (torch.randn(40, 192) * 4).to(E4M3)
    a = wide.to(DEV)[:, ::2]                                    # strides (192, 2)
    row = (torch.randn(1, 96) * 4).to(E4M3)
    a_bcast = row.to(DEV).expand(40, 96)                        # strides (0, 1)
    bt = (torch.randn(72, 96) * 4).to(E4M3)
    b = bt.to(DEV).t()[:, 5:53]                                  # column-major, offset
    sa, sb = torch.rand(40, 1) + 0.5, torch.rand(1, 48) + 0.5
    col = (torch.randn(96, 1) * 4).to(E4M3)
    cases = ((a, wide[:, ::2], b, bt.t()[:, 5:53]), (a_bcast, row.expand(40, 96), b, bt.t()[:, 5:53]),
             (a, wide[:, ::2], col.to(DEV).expand(96, 48), col.expand(96, 48)))  # mat2 strides (1, 0)
    for dev_a, cpu_a, dev_b, cpu_b in cases:
        got = torch._scaled_mm(dev_a, dev_b, sa.to(DEV), sb.to(DEV), out_dtype=torch.float32)
        ad, bd = cpu_a.double(), cpu_b.double()
        exact = (ad @ bd) * sa.double() * sb.double()
        assert_tensore(got, exact, 96, absprod=(ad.abs() @ bd.abs()) * sa.double() * sb.double(), min_equal=0.0)


@pytest.mark.parametrize("mkn", [(16, 600, 520), (300, 1100, 200)], ids=str)
def test_scaled_mm_bits_do_not_depend_on_the_thread_count(mkn, fp8_route):
    # The kernel splits rows (and, for few rows, columns) among tasks, never k: each sum runs
    # in the same order on any number of intra-op threads.
    torch.manual_seed(13)
    a, b = _fp8_operands(*mkn, E4M3, E4M3)
    sa, sb = torch.rand(mkn[0], 1) + 0.5, torch.rand(1, mkn[2]) + 0.5
    args = (_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch._scaled_mm(*args, out_dtype=torch.float32).cpu()
        torch.set_num_threads(3)
        three = torch._scaled_mm(*args, out_dtype=torch.float32).cpu()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(one), _bits(three))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_adds_bias_before_the_one_rounding(bias_dtype, fp8_route):
    torch.manual_seed(8)
    a, b = _fp8_operands(64, 128, 96, E4M3, E4M3)
    bias = torch.randn(96).to(bias_dtype)
    sa, sb = torch.tensor(0.25), torch.tensor(2.0)
    got = torch._scaled_mm(_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV), bias=bias.to(DEV),
                           out_dtype=torch.bfloat16)
    exact = (a.double() @ b.double()) * 0.5 + bias.double()
    assert_tensore(got, exact, 128, absprod=(a.double().abs() @ b.double().abs()) * 0.5)


def test_scaled_mm_row_major_mat2_and_use_fast_accum_give_the_same_exact_result():
    torch.manual_seed(9)
    a, b = _fp8_operands(64, 192, 64, E4M3, E4M3, b_col_major=False)
    s = torch.tensor(1.0, device=DEV)
    r1 = torch._scaled_mm(_to_dev(a), _to_dev(b), s, s, out_dtype=torch.bfloat16)
    r2 = torch._scaled_mm(_to_dev(a), _to_dev(b), s, s, out_dtype=torch.bfloat16, use_fast_accum=True)
    assert torch.equal(r1.cpu(), r2.cpu())
    assert_tensore(r1, a.double() @ b.double(), 192, absprod=a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_reads_every_fp8_code_exactly(dtype, out_dtype, fp8_route):
    # Every code (NaNs, Inf for e5m2, subnormals, both zeros) as a column times 1: the output is
    # the code's value. 263 rows cover the vector body and its scalar tail; K=32 rows of zeros
    # but one take the bf16 oneDNN route for a bf16 output.
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    codes = torch.cat([codes, codes[:7]]).view(dtype)
    a = torch.zeros(263, 32, dtype=dtype)
    a[:, 5] = codes
    b = torch.zeros(32, 64, dtype=dtype)
    b[5, :] = 1.0
    one = torch.tensor(1.0, device=DEV)
    got = torch._scaled_mm(a.to(DEV), b.to(DEV), one, one, out_dtype=out_dtype).cpu()
    want = codes.to(torch.float32)[:, None].expand(263, 64).to(out_dtype)
    finite = want.isfinite()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf() & (got > 0), want.isinf() & (want > 0))


def test_scaled_mm_fp8_output_divides_by_scale_result_then_rounds_once(fp8_route):
    # CPU's semantics (scale_result divides an fp8 result), TensorE's numerics: the exact product,
    # scaled and divided, rounded once to e4m3. (CPU's own kernel is not the oracle: on AMX hosts
    # oneDNN's fp8 path rounds 5 of these 1,536 results, near e4m3 ties, to the other neighbour.)
    torch.manual_seed(10)
    a, b = _fp8_operands(32, 64, 48, E4M3, E4M3)
    s, sr = torch.tensor(0.125), torch.tensor(4.0)
    got = torch._scaled_mm(_to_dev(a), _to_dev(b), s.to(DEV), s.to(DEV), scale_result=sr.to(DEV),
                           out_dtype=E4M3)
    exact = (a.double() @ b.double()) * (0.125 * 0.125) / 4.0
    assert got.dtype == E4M3
    assert torch.equal(got.cpu().float(), exact.float().to(E4M3).float())


def test_scaled_mm_out_variant_writes_into_out():
    a, b = _fp8_operands(32, 64, 48, E4M3, E4M3)
    s = torch.tensor(1.0, device=DEV)
    out = torch.empty(32, 48, device=DEV, dtype=torch.bfloat16)
    r = torch._scaled_mm(_to_dev(a), _to_dev(b), s, s, out_dtype=torch.bfloat16, out=out)
    assert r.data_ptr() == out.data_ptr()
    assert torch.equal(out.cpu(), torch._scaled_mm(_to_dev(a), _to_dev(b), s, s, out_dtype=torch.bfloat16).cpu())


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
def test_scaled_mm_out_writes_a_contiguous_out_in_place(engine):
    # torch.compile calls _scaled_mm with out=: the result goes straight into it (one allocation
    # fewer than the functional call, no copy), queued or not; a transposed or wrongly sized out
    # still gets the result, through a copy.
    torch.manual_seed(4)
    a, b = _fp8_operands(40, 96, 72, E4M3, E4M3)
    ad, bd = _to_dev(a), _to_dev(b)
    sa, sb = torch.rand(40, 1, device=DEV) + 0.5, torch.rand(1, 72, device=DEV) + 0.5
    want = torch._scaled_mm(ad, bd, sa, sb, out_dtype=torch.bfloat16).cpu()
    torch.neuron.engine.set_enabled(engine)
    try:
        def allocations(call):
            before = torch.neuron.memory_stats()["allocation.all.allocated"]
            call()
            return torch.neuron.memory_stats()["allocation.all.allocated"] - before
        out = torch.empty(40, 72, device=DEV, dtype=torch.bfloat16)
        functional = allocations(lambda: torch._scaled_mm(ad, bd, sa, sb, out_dtype=torch.bfloat16))
        assert allocations(lambda: torch._scaled_mm(ad, bd, sa, sb, out_dtype=torch.bfloat16, out=out)) == functional - 1
        assert torch.equal(_bits(out.cpu()), _bits(want))
        for other in (torch.empty(72, 40, device=DEV, dtype=torch.bfloat16).t(),
                      torch.empty(0, device=DEV, dtype=torch.bfloat16)):
            torch._scaled_mm(ad, bd, sa, sb, out_dtype=torch.bfloat16, out=other)
            assert torch.equal(_bits(other.cpu()), _bits(want))
    finally:
        torch.neuron.engine.set_enabled(True)


@pytest.mark.parametrize("engine", [True, False], ids=["queued", "synchronous"])
@pytest.mark.parametrize("out_dtype,scratch", [(torch.bfloat16, 0), (torch.float32, 0), (torch.float16, 4)],
                         ids=["bf16", "fp32", "fp16"])
def test_scaled_mm_on_the_fused_kernels_takes_device_memory_for_its_route_alone(engine, out_dtype, scratch):
    # The fused fp8 kernels write a bf16 or fp32 result themselves; another dtype is rounded from
    # their fp32 accumulator. The call's device memory is its result and that (a queued call's
    # arena is sized by the route: scaled_mm.cpp, scratch_bytes).
    if not (ROUTES["amx_fp8_kernel"] or ROUTES["bf16_fp32_gemm_avx512"]):
        pytest.skip("no fused fp8 kernel on this host")
    m, k, n = 32, 256, 384  # (17-63 rows: the fused kernel on half-rate hosts too)
    a, b = _fp8_operands(m, k, n, E4M3, E4M3)
    ad, bd = _to_dev(a), _to_dev(b)
    sa, sb = torch.rand(m, 1, device=DEV) + 0.5, torch.rand(1, n, device=DEV) + 0.5
    torch.neuron.engine.set_enabled(engine)
    try:
        torch.neuron.synchronize()
        base = torch.neuron.memory_allocated()
        torch.neuron.reset_peak_memory_stats()
        y = torch._scaled_mm(ad, bd, sa, sb, out_dtype=out_dtype)
        torch.neuron.synchronize()
        assert torch.neuron.max_memory_allocated() - base == m * n * (y.element_size() + scratch)
    finally:
        torch.neuron.engine.set_enabled(True)


def test_scaled_mm_rejects_bad_scales_and_dtypes_with_clear_errors():
    a, b = _fp8_operands(16, 32, 24, E4M3, E4M3)
    A, B = _to_dev(a), _to_dev(b)
    with pytest.raises(ValueError, match="invalid scaling configuration"):
        torch._scaled_mm(A, B, torch.ones(16, device=DEV), torch.ones(24, device=DEV), out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        s = torch.tensor(1.0, device=DEV)
        torch._scaled_mm(A.float(), B, s, s)
    with pytest.raises(ValueError, match="cannot be multiplied"):
        s = torch.tensor(1.0, device=DEV)
        torch._scaled_mm(A, A, s, s, out_dtype=torch.bfloat16)


# ---- int8: torch._int_mm ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [4096, 1500])
def test_int_mm_is_exact_in_int32_beyond_fp32s_exact_range(k):
    # Sums reach 2^24-2^26 with odd parts: one fp32 accumulator (exact to 2^24) would round them.
    g = torch.Generator().manual_seed(11)
    a = torch.full((32, k), -128, dtype=torch.int8)
    b = torch.full((k, 48), -128, dtype=torch.int8)
    a[:, ::7] = torch.randint(-128, 128, (32, len(range(0, k, 7))), generator=g, dtype=torch.int8)
    b[::5, :] = torch.randint(-128, 128, (len(range(0, k, 5)), 48), generator=g, dtype=torch.int8)
    got = torch._int_mm(a.to(DEV), b.to(DEV))
    exact = a.long() @ b.long()
    assert got.dtype == torch.int32 and exact.abs().max() > 2 ** 23
    assert torch.equal(got.cpu().long(), exact)


# ---- _grouped_mm in fp16 ------------------------------------------------------------------------------
def test_grouped_mm_fp16_routes_through_the_fp32_accumulating_mm():
    torch.manual_seed(12)
    a, b = rand(96, 128), rand(3, 128, 40)
    offs = torch.tensor([32, 64, 96], dtype=torch.int32)
    got = torch._grouped_mm(a.to(DEV), b.to(DEV), offs.to(DEV))
    exact = torch.cat([a[i * 32:(i + 1) * 32].double() @ b[i].double() for i in range(3)])
    absprod = torch.cat([a[i * 32:(i + 1) * 32].double().abs() @ b[i].double().abs() for i in range(3)])
    assert_tensore(got, exact, 128, absprod=absprod)


# ---- training and determinism ---------------------------------------------------------------------
def test_fp16_amp_with_grad_scaler_tracks_an_fp32_run():
    def run(device, amp):
        torch.manual_seed(13)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler(device, enabled=amp)
        g = torch.Generator().manual_seed(14)
        x, y = torch.randn(64, 32, generator=g).to(device), torch.randn(64, 8, generator=g).to(device)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16, enabled=amp):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        return torch.tensor(losses), [p.detach().cpu() for p in model.parameters()]

    amp_losses, amp_params = run(DEV, True)
    ref_losses, ref_params = run("cpu", False)
    assert amp_losses[-1] < amp_losses[0]
    torch.testing.assert_close(amp_losses, ref_losses, rtol=5e-3, atol=1e-3)
    for p, r in zip(amp_params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-2, atol=2e-3)


def test_routed_ops_are_deterministic_under_use_deterministic_algorithms():
    torch.manual_seed(15)
    a, b = rand(200, 300).to(DEV), rand(300, 100).to(DEV)
    img, kern = rand(2, 8, 16, 16).to(DEV), rand(8, 8, 3, 3).to(DEV)
    q = rand(2, 2, 64, 32).to(DEV)
    a8, b8 = _fp8_operands(128, 256, 128, E4M3, E4M3)
    A8, B8, s = _to_dev(a8), _to_dev(b8), torch.tensor(0.5, device=DEV)

    def run():
        return [a @ b, F.conv2d(img, kern, padding=1), F.scaled_dot_product_attention(q, q, q),
                torch._scaled_mm(A8, B8, s, s, out_dtype=torch.bfloat16),
                torch._scaled_mm(A8, B8, s, s, out_dtype=torch.float32)]

    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(old)
    for x, y in zip(first, second):
        assert torch.equal(x.cpu(), y.cpu())


# ---- fp8 casts: CPU's bits at memory speed ---------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a CPU tensor as integers (NaN payloads and signed zeros included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _fp32_samples() -> torch.Tensor:
    """fp32 values that exercise every branch of the fp8 conversions: random bit patterns
    (NaNs, infinities, subnormals, both signs), every rounding tie and midpoint neighbour of both
    fp8 grids, the overflow thresholds, the NaNs nearest infinity, and ordinary magnitudes."""
    g = torch.Generator().manual_seed(20)
    raw = torch.randint(-2 ** 31, 2 ** 31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    grid = torch.cat([torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dt).float() for dt in (E4M3, E5M2)])
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties (the grids are 2-3 bits wide)
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(-float("inf")))])
    edges = torch.tensor([448.0, 464.0, 480.0, 479.99997, 57344.0, 61440.0, 65536.0, 1e30, float("inf"),
                          float("nan"), 0.0, -0.0, 2.0 ** -9, 2.0 ** -10, 2.0 ** -16, 2.0 ** -17, 1e-45])
    # the largest finite value and the NaNs of smallest and largest payload
    edges = torch.cat([edges, torch.tensor([0x7F7FFFFF, 0x7F800001, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)])
    normal = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-20, 20, (1 << 16,), generator=g).float())
    vals = torch.cat([raw, near, -near, edges, -edges, normal])
    return vals


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_casts_to_fp8_equal_cpu_bit_for_bit(src, fp8):
    if src == torch.bfloat16:  # every bf16 bit pattern
        x = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    else:
        x = _fp32_samples()
    got = x.to(DEV).to(fp8).cpu()
    want = x.to(fp8)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16])
def test_casts_from_every_fp8_code_equal_cpu_bit_for_bit(fp8, dst):
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(fp8).repeat(9)  # 2304: body + tail
    got = codes.to(DEV).to(dst).cpu()
    assert torch.equal(_bits(got), _bits(codes.to(dst)))


@pytest.mark.parametrize("layout", ["transposed", "sliced", "into_transposed"])
def test_fp8_casts_of_strided_tensors_equal_cpu(layout):
    torch.manual_seed(21)
    x = (torch.randn(96, 80) * 100).to(torch.bfloat16)
    if layout == "transposed":  # dense, permuted: .to keeps the layout
        got, want = x.to(DEV).t().to(E4M3), x.t().to(E4M3)
        assert got.stride() == want.stride()
    elif layout == "sliced":  # not dense: CPU's kernel
        got, want = x.to(DEV)[::2, 3:].to(E5M2), x[::2, 3:].to(E5M2)
    else:  # copy_ between different layouts: CPU's kernel
        got = torch.empty(80, 96, dtype=E4M3, device=DEV).t()
        got.copy_(x.to(DEV))
        want = x.to(E4M3)
    assert torch.equal(_bits(got.cpu().contiguous()), _bits(want.contiguous()))
    back = got.to(torch.float32).cpu()
    assert torch.equal(_bits(back.contiguous()), _bits(want.float().contiguous()))


# ---- fp8: torch._scaled_grouped_mm ----------------------------------------------------------------------
def _grouped_reference(a, b, sa, sb, offs, kind):
    """float64 per group: exact fp8 products and sums, both scales, one rounding to bf16 (rows or
    columns no group covers are zero)."""
    ad, bd = a.double(), b.double()
    ends = [0] + (offs.tolist() if offs is not None else [])
    if kind == "2d3d":
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
        absout = out.clone()
        for g in range(b.shape[0]):
            r = slice(ends[g], ends[g + 1])
            scale = sa[r].double()[:, None] * sb[g].double()[None, :]
            out[r] = ad[r] @ bd[g] * scale
            absout[r] = ad[r].abs() @ bd[g].abs() * scale.abs()
    elif kind == "3d3d":
        scale = sa.double()[:, :, None] * sb.double()[:, None, :]
        out, absout = ad @ bd * scale, ad.abs() @ bd.abs() * scale.abs()
    elif kind == "3d2d":
        out = torch.zeros(a.shape[1], b.shape[-1], dtype=torch.float64)
        absout = out.clone()
        for g in range(a.shape[0]):
            c = slice(ends[g], ends[g + 1])
            scale = sa[g].double()[:, None] * sb[c].double()[None, :]
            out[:, c] = ad[g] @ bd[:, c] * scale
            absout[:, c] = ad[g].abs() @ bd[:, c].abs() * scale.abs()
    else:  # 2d2d
        G, M, N = len(offs), a.shape[0], b.shape[1]
        out = torch.zeros(G, M, N, dtype=torch.float64)
        absout = out.clone()
        for g in range(G):
            k = slice(ends[g], ends[g + 1])
            scale = sa[g * M:(g + 1) * M].double()[:, None] * sb[g * N:(g + 1) * N].double()[None, :]
            out[g] = ad[:, k] @ bd[k, :] * scale
            absout[g] = ad[:, k].abs() @ bd[k, :].abs() * scale.abs()
    return out, absout


def _grouped_operands(kind, seed=22):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 3).to(E4M3)  # noqa: E731
    s = lambda *sh: torch.rand(*sh, generator=g) + 0.25  # noqa: E731
    G, M, K, N = 3, 48, 96, 32
    if kind == "2d3d":
        a, b = r(M * 2, K), r(G, N, K).transpose(-2, -1)  # b column-major
        offs = torch.tensor([20, 20, 80], dtype=torch.int32)  # an empty group, 16 rows uncovered
        sa, sb = s(M * 2), s(G, N)
    elif kind == "3d3d":
        a, b, offs = r(G, M, K), r(G, N, K).transpose(-2, -1), None
        sa, sb = s(G, M), s(G, N)
    elif kind == "3d2d":
        a, b = r(G, M, K), r(N * 3, K).t()
        offs = torch.tensor([32, 48, 96], dtype=torch.int32)
        sa, sb = s(G, M), s(N * 3)
    else:
        a, b = r(M, K * 2), r(N, K * 2).t()
        offs = torch.tensor([64, 64, 192], dtype=torch.int32)  # an empty K range
        sa, sb = s(G * M), s(G * N)
    return a, b, sa, sb, offs


def _dev(t):
    """The same values and strides on neuron."""
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=DEV).copy_(t)


@pytest.mark.parametrize("kind", ["2d3d", "3d3d", "3d2d", "2d2d"])
def test_scaled_grouped_mm_is_exact_per_group_with_one_rounding(kind, fp8_route):
    a, b, sa, sb, offs = _grouped_operands(kind)
    got = torch._scaled_grouped_mm(_dev(a), _dev(b), _dev(sa), _dev(sb), offs=_dev(offs), out_dtype=torch.bfloat16)
    exact, absout = _grouped_reference(a, b, sa, sb, offs, kind)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape and got.device.type == DEV
    assert_tensore(got, exact, a.shape[-1], absprod=absout)


def test_scaled_grouped_mm_groups_of_a_few_rows_equal_scaled_mm_per_group(bf16_half_rate):
    # An MoE decode step: each expert's few tokens take the few-row kernel on a half-rate host,
    # as _scaled_mm of the same rows does (not the half-rate bf16 dot-product kernel): the same
    # bits per group. Groups of 2, 1, 7 and 2 rows. Products of random fp8 values sum almost
    # exactly in fp32, hiding the order of the sums; these show it: 448 x 448 at k = 0 and
    # -448 x 448 at k = 16 (one lane of the few-row kernel: they cancel before the small
    # products come), among 2^-9 x 2^-9 products that a partial sum of 448^2 loses.
    g = torch.Generator().manual_seed(31)
    experts, k, n = 4, 1024, 96
    a = torch.full((12, k), 2.0**-9)
    a[:, 0], a[:, 16] = 448, -448
    a = a.to(E4M3)
    b = torch.full((experts, n, k), 2.0**-9) * (torch.rand(experts, n, 1, generator=g) < 0.5).float().add(1)
    b[:, :, 0] = b[:, :, 16] = 448
    b = b.to(E4M3).transpose(-2, -1)
    offs = torch.tensor([2, 3, 10, 12], dtype=torch.int32)
    sa, sb = torch.rand(12, generator=g) + 0.25, torch.rand(experts, n, generator=g) + 0.25
    got = torch._scaled_grouped_mm(_dev(a), _dev(b), _dev(sa), _dev(sb), offs=_dev(offs),
                                   out_dtype=torch.bfloat16).cpu()
    start = 0
    for e, end in enumerate(offs.tolist()):
        want = torch._scaled_mm(_dev(a[start:end]), _dev(b[e]), _dev(sa[start:end, None]), _dev(sb[e][None, :]),
                                out_dtype=torch.bfloat16).cpu()
        assert torch.equal(_bits(got[start:end]), _bits(want)), e
        start = end


def test_scaled_grouped_mm_with_no_columns_gives_an_empty_result_on_half_rate_hosts(bf16_half_rate):
    # groups of a few rows meet the few-row kernel, which takes no empty shape: the fused route runs
    a = torch.randn(8, 64).to(E4M3)
    b = torch.randn(2, 0, 64).to(E4M3).transpose(-2, -1)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    got = torch._scaled_grouped_mm(_dev(a), _dev(b), _dev(torch.rand(8)), _dev(torch.rand(2, 0)), offs=_dev(offs),
                                   out_dtype=torch.bfloat16)
    assert got.shape == (8, 0) and got.dtype == torch.bfloat16


def test_scaled_grouped_mm_zeroes_rows_no_group_covers_and_matches_meta_shape():
    a, b, sa, sb, offs = _grouped_operands("2d3d")
    got = torch._scaled_grouped_mm(_dev(a), _dev(b), _dev(sa), _dev(sb), offs=_dev(offs)).cpu()
    assert torch.equal(got[80:], torch.zeros(16, 32, dtype=torch.bfloat16))
    with torch.device("meta"):
        meta = torch._scaled_grouped_mm(a.to("meta"), b.to("meta"), sa.to("meta"), sb.to("meta"), offs=offs.to("meta"))
    assert meta.shape == got.shape and meta.dtype == got.dtype


def test_scaled_grouped_mm_compiled_equals_eager_and_is_deterministic():
    a, b, sa, sb, offs = (_dev(t) for t in _grouped_operands("2d3d", seed=23))
    f = lambda *args: torch._scaled_grouped_mm(*args[:4], offs=args[4])  # noqa: E731
    torch._dynamo.reset()
    eager = f(a, b, sa, sb, offs)
    compiled = torch.compile(f, backend="neuron")(a, b, sa, sb, offs)
    assert torch.equal(eager.cpu(), compiled.cpu())
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(f(a, b, sa, sb, offs).cpu(), f(a, b, sa, sb, offs).cpu())
    finally:
        torch.use_deterministic_algorithms(old)


def test_scaled_grouped_mm_rejects_bad_inputs_with_clear_errors():
    a, b, sa, sb, offs = (_dev(t) for t in _grouped_operands("2d3d"))
    call = torch._scaled_grouped_mm
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        call(a.to(torch.float32).to(E5M2), b, sa, sb, offs=offs)
    with pytest.raises(ValueError, match="column-major"):
        call(a, b.contiguous(), sa, sb, offs=offs)
    with pytest.raises(ValueError, match="offs is required"):
        call(a, b, sa, sb)
    with pytest.raises(ValueError, match="non-decreasing"):
        call(a, b, sa, sb, offs=torch.tensor([20, 10, 80], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="within the rows"):
        call(a, b, sa, sb, offs=torch.tensor([20, 40, 97], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="scale_b must have shape"):
        call(a, b, sa, sb[0], offs=offs)
    with pytest.raises(ValueError, match="out_dtype"):
        call(a, b, sa, sb, offs=offs, out_dtype=torch.float32)
    e8 = torch.ones(96, device=DEV).to(torch.float8_e8m0fnu)
    with pytest.raises(NotImplementedError, match="MXFP8"):
        call(a, b, e8, sb.to(torch.float8_e8m0fnu), offs=offs)


# ---- fp8 fast paths: the same bits as the unfused / CPU computation --------------------------------
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16])
def test_widening_random_fp8_codes_with_scattered_nan_and_inf_equals_cpu(fp8, dst):
    # Random codes: most 16-element groups hold a NaN/Inf code (the table path), some none (the
    # vectorized arithmetic path); 4099 elements leave a scalar tail.
    g = torch.Generator().manual_seed(30)
    codes = torch.randint(0, 256, (4099,), generator=g, dtype=torch.int16).to(torch.uint8)
    finite = torch.randint(0, 0x7C, (4099,), generator=g, dtype=torch.int16).to(torch.uint8)
    codes[:2048] = finite[:2048] | (codes[:2048] & 0x80)  # first half: no special codes
    x = codes.view(fp8)
    got = x.to(DEV).to(dst).cpu()
    assert torch.equal(_bits(got), _bits(x.to(dst)))


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.uint8, torch.int8, torch.bool])
@pytest.mark.parametrize("direction", ["to_row_major", "to_column_major"])
def test_one_byte_transposed_copies_equal_cpu(dtype, direction):
    # 200 x 131: neither side a multiple of the 32-element tile.
    g = torch.Generator().manual_seed(31)
    raw = torch.randint(0, 256, (200, 131), generator=g, dtype=torch.int16).to(torch.uint8)
    x = raw.bool() if dtype == torch.bool else raw.view(dtype)
    if direction == "to_row_major":  # torchao's fp8.t().contiguous()
        src = x.t().contiguous().to(DEV).t()
        got = src.contiguous()
        assert got.is_contiguous()
    else:  # fp8.t().contiguous().t(): a column-major copy of a row-major tensor
        got = x.to(DEV).t().contiguous().t()
        assert got.stride() == (1, 200)
    assert torch.equal(_bits(got.cpu().contiguous()) if dtype != torch.bool else got.cpu(),
                       _bits(x) if dtype != torch.bool else x)


def test_rowwise_scaled_mm_equals_the_unfused_epilogue_bit_for_bit(fp8_route):
    # The fused pass applies (acc * scale_a[i]) * scale_b[j] and rounds once, in row blocks of
    # 256 KiB of accumulator: 2100 x 64 spans three blocks and a partial one.
    torch.manual_seed(32)
    a, b = _fp8_operands(2100, 96, 64, E4M3, E4M3)
    sa, sb = torch.rand(2100, 1) + 0.5, torch.rand(1, 64) + 0.5
    one = torch.tensor(1.0, device=DEV)
    acc = torch._scaled_mm(_to_dev(a), _to_dev(b), one, one, out_dtype=torch.float32).cpu()
    want = ((acc * sa) * sb).to(torch.bfloat16)
    got = torch._scaled_mm(_to_dev(a), _to_dev(b), sa.to(DEV), sb.to(DEV), out_dtype=torch.bfloat16).cpu()
    assert torch.equal(_bits(got), _bits(want))


def test_scaled_grouped_mm_equals_per_group_unfused_epilogue_bit_for_bit(fp8_route):
    torch.manual_seed(33)
    G, M, K, N = 3, 600, 64, 48
    a = (torch.randn(M, K) * 4).to(E4M3)
    b = (torch.randn(G, N, K) * 4).to(E4M3).transpose(-2, -1)
    sa, sb = torch.rand(M) + 0.5, torch.rand(G, N) + 0.5
    offs = torch.tensor([100, 100, 600], dtype=torch.int32)
    got = torch._scaled_grouped_mm(a.to(DEV), b.transpose(-2, -1).contiguous().to(DEV).transpose(-2, -1),
                                   sa.to(DEV), sb.to(DEV), offs=offs.to(DEV), out_dtype=torch.bfloat16).cpu()
    one = torch.tensor(1.0, device=DEV)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            acc = torch._scaled_mm(a[start:end].to(DEV), b[g].t().contiguous().to(DEV).t(), one, one,
                                   out_dtype=torch.float32).cpu()
            want = ((acc * sa[start:end, None]) * sb[g][None, :]).to(torch.bfloat16)
            assert torch.equal(_bits(got[start:end]), _bits(want)), g
        start = end
