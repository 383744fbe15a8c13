"""The GEMM family on random shapes, layouts and dtypes, against an fp64 product.

Each case draws an op (mm, addmm with its beta/alpha forms and a broadcast self, matmul, linear
with and without bias, the out= forms, bmm/baddbmm, mv/addmv), a dtype (bf16, fp16, fp32), sizes
at the routes' edges (one row, a few rows, 16/17 and 63/64 rows; k and n with vector tails) and
operand layouts (contiguous, transposed, sliced out of a wider buffer, a batch broadcast by
stride 0). The result's sizes, strides and dtype must be CPU's, and its values within the TensorE
contract (exact products, fp32 sums, one rounding) of an fp64 product of the same operands:
|got - ref| <= u·|ref| + (k + 3)·2^-24·(|alpha|·(|A| @ |B|) + |beta·self|) + the output's
smallest subnormal, u the output's unit roundoff. The cases run queued and synchronous, on the
host's routes and, on hosts with AVX512-BF16, with the half-rate routes forced. fp8
`_scaled_mm` likewise (e4m3/e5m2 operands, tensor-wise and row-wise scales, bias, every output
dtype), its scales and bias adding an fp32 rounding each.
"""

from __future__ import annotations

import random

import pytest
import torch

from torchneuron import _C

DEV = "neuron"
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
TINY = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -149}
SIZES = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129]
FEW_ROWS = [1, 2, 4, 7, 12, 16, 17]
OPS = ["mm", "addmm", "matmul", "linear", "mm_out", "addmm_out", "bmm", "baddbmm", "mv", "addmv"]


def _operand(rng: random.Random, shape: tuple, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A CPU operand of `shape` in `layout` (its values exact in `dtype`)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if layout == "transposed" and len(shape) >= 2:
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype).transpose(-1, -2)
    if layout == "sliced":
        return torch.randn(*shape[:-1], shape[-1] + 3, generator=g).to(dtype)[..., 1:shape[-1] + 1]
    if layout == "broadcast" and len(shape) == 3:
        return torch.randn(1, *shape[1:], generator=g).to(dtype).expand(*shape)
    return torch.randn(*shape, generator=g).to(dtype)


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """t's values on neuron in t's layout (sizes, strides and offset in its storage)."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype)
    storage.untyped_storage().copy_(t.untyped_storage())
    return storage.to(DEV).as_strided(t.size(), t.stride(), t.storage_offset())


def _case(seed: int):
    """(description, op on given operands, CPU operands, reference, |alpha|·|A|@|B| + |beta·self|, k, dtype)."""
    rng = random.Random(seed)
    dtype = rng.choice(list(UNIT))
    op = rng.choice(OPS)
    m = rng.choice(FEW_ROWS if rng.random() < 0.35 else SIZES)
    k, n = rng.choice(SIZES), rng.choice(SIZES)
    if rng.random() < 0.15:
        k = rng.choice([256, 513, 1031])
    lay = lambda: rng.choice(["contiguous", "transposed", "sliced"])  # noqa: E731
    a, b = _operand(rng, (m, k), dtype, lay()), _operand(rng, (k, n), dtype, lay())
    beta, alpha = rng.choice([(1.0, 1.0), (0.0, 1.0), (0.5, 2.0), (1.0, 0.0), (0.0, 0.5)])
    A, B = a.double(), b.double()
    absprod = lambda x, y: x.abs() @ y.abs()  # noqa: E731
    if op in ("mm", "matmul", "mm_out"):
        out = torch.empty(m, n, dtype=dtype) if op == "mm_out" else None
        fn = {"mm": torch.mm, "matmul": torch.matmul}.get(op)
        call = (lambda x, y: fn(x, y)) if fn else (lambda x, y: torch.mm(x, y, out=_like(out, x)))
        return op, call, (a, b), A @ B, absprod(A, B), k, dtype
    if op in ("addmm", "addmm_out"):
        sshape = rng.choice([(m, n), (n,), (1, n), (m, 1)])
        s = _operand(rng, sshape, dtype, "contiguous")
        S = s.double().expand(m, n)
        out = torch.empty(m, n, dtype=dtype) if op == "addmm_out" else None
        ref = beta * S + alpha * (A @ B)
        scale = abs(alpha) * absprod(A, B) + abs(beta) * S.abs()

        def call(x, y, z):
            if out is None:
                return torch.addmm(z, x, y, beta=beta, alpha=alpha)
            return torch.addmm(z, x, y, beta=beta, alpha=alpha, out=_like(out, x))
        return f"{op} beta={beta} alpha={alpha} self{tuple(sshape)}", call, (a, b, s), ref, scale, k, dtype
    if op == "linear":
        w = b.t()
        bias = _operand(rng, (n,), dtype, "contiguous") if rng.random() < 0.5 else None
        ref = A @ B + (bias.double() if bias is not None else 0)
        scale = absprod(A, B) + (bias.double().abs() if bias is not None else 0)
        args = (a, w) if bias is None else (a, w, bias)
        return f"linear bias={bias is not None}", torch.nn.functional.linear, args, ref, scale, k, dtype
    if op in ("bmm", "baddbmm"):
        batch = rng.choice([1, 2, 3])
        blay = lambda: rng.choice(["contiguous", "transposed", "broadcast"])  # noqa: E731
        x, y = _operand(rng, (batch, m, k), dtype, blay()), _operand(rng, (batch, k, n), dtype, blay())
        X, Y = x.double(), y.double()
        if op == "bmm":
            return f"bmm batch={batch}", torch.bmm, (x, y), X @ Y, absprod(X, Y), k, dtype
        s = _operand(rng, (batch, m, n), dtype, "contiguous")
        ref = beta * s.double() + alpha * (X @ Y)
        scale = abs(alpha) * absprod(X, Y) + abs(beta) * s.double().abs()
        call = lambda x_, y_, s_: torch.baddbmm(s_, x_, y_, beta=beta, alpha=alpha)  # noqa: E731
        return f"baddbmm batch={batch} beta={beta} alpha={alpha}", call, (x, y, s), ref, scale, k, dtype
    v = _operand(rng, (k,), dtype, rng.choice(["contiguous", "sliced"]))
    V = v.double()
    if op == "mv":
        return "mv", torch.mv, (a, v), A @ V, a.double().abs() @ V.abs(), k, dtype
    s = _operand(rng, (m,), dtype, "contiguous")
    ref = beta * s.double() + alpha * (A @ V)
    scale = abs(alpha) * (A.abs() @ V.abs()) + abs(beta) * s.double().abs()
    call = lambda x, y, z: torch.addmv(z, x, y, beta=beta, alpha=alpha)  # noqa: E731
    return f"addmv beta={beta} alpha={alpha}", call, (a, v, s), ref, scale, k, dtype


def _like(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The out= tensor on ref's device."""
    return out if ref.device.type == "cpu" else torch.empty_like(out, device=ref.device)


def _check(seed: int) -> None:
    desc, call, args, ref, scale, k, dtype = _case(seed)
    want = call(*args)
    got = call(*(_on_device(t) for t in args))
    what = f"seed {seed}: {desc} {dtype} {[tuple(t.shape) for t in args]} strides {[t.stride() for t in args]}"
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride()), what
    got = got.cpu().double()
    bound = UNIT[dtype] * ref.abs() + (k + 3) * 2.0 ** -24 * scale + TINY[dtype]
    err = (got - ref).abs()
    assert torch.isfinite(got).all() and (err <= bound).all(), f"{what}: max error {err.max().item():.3g}"


class _engine_off:
    """The execution engine off for the block (every kernel runs at its call)."""

    def __enter__(self):
        self.was = torch.neuron.engine.is_enabled()
        torch.neuron.engine.set_enabled(False)

    def __exit__(self, *exc):
        torch.neuron.engine.set_enabled(self.was)


@pytest.fixture(params=["host routes", "half-rate routes"])
def routes(request):
    if request.param == "half-rate routes":
        if not _C._precision_routes()["cpu_avx512_bf16"]:
            pytest.skip("needs AVX512-BF16")
        _C._set_bf16_half_rate(1)
    yield request.param
    torch.neuron.synchronize()
    _C._set_bf16_half_rate(-1)


@pytest.mark.parametrize("block", range(4))
def test_random_products_are_within_the_tensore_bound_of_an_fp64_product(routes, block):
    for seed in range(block * 60, (block + 1) * 60):
        _check(seed)


@pytest.mark.parametrize("block", range(2))
def test_random_products_run_synchronously_within_the_same_bound(routes, block):
    with _engine_off():
        for seed in range(10_000 + block * 40, 10_000 + (block + 1) * 40):
            _check(seed)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _check_scaled(seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    m = rng.choice(FEW_ROWS + [31, 64, 65, 128])
    k, n = rng.choice([16, 32, 48, 64, 256, 528]), rng.choice([16, 32, 48, 64, 272])
    da, db = rng.choice(FP8), torch.float8_e4m3fn if rng.random() < 0.5 else rng.choice(FP8)
    if da == db == torch.float8_e5m2:
        db = torch.float8_e4m3fn  # (no e5m2 x e5m2 product: CPU and CUDA refuse it)
    a = (torch.randn(m, k, generator=g) * rng.choice([0.05, 1.0, 40.0])).to(da)
    b = (torch.randn(n, k, generator=g) * rng.choice([0.05, 1.0, 40.0])).to(db).t()  # k x n, column-major
    if rng.random() < 0.5:  # row-wise
        sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    else:
        sa, sb = torch.rand((), generator=g) + 0.5, torch.rand((), generator=g) + 0.5
    out_dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
    bias = torch.randn(n, generator=g).to(out_dtype) if out_dtype != torch.float32 and rng.random() < 0.4 else None
    fast = rng.random() < 0.3

    def call(*t):
        return torch._scaled_mm(t[0], t[1], t[2], t[3], bias=t[4] if len(t) > 4 else None, out_dtype=out_dtype,
                                use_fast_accum=fast)
    args = (a, b, sa, sb) + ((bias,) if bias is not None else ())
    got = call(*(_on_device(t) for t in args)).cpu()
    what = f"seed {seed}: _scaled_mm {m}x{k}x{n} {da}/{db} scales {tuple(sa.shape)} {out_dtype} bias={bias is not None}"
    assert got.shape == (m, n) and got.dtype == out_dtype, what
    A, B, SA, SB = a.double(), b.double(), sa.double(), sb.double()
    ref = (A @ B) * SA * SB + (bias.double() if bias is not None else 0)
    scale = (A.abs() @ B.abs()) * SA * SB
    bound = UNIT[out_dtype] * ref.abs() + (k + 5) * 2.0 ** -24 * (scale + (bias.double().abs() if bias is not None else 0))
    bound = bound + TINY[out_dtype]
    got = got.double()
    finite = ref.abs() < torch.finfo(out_dtype).max * (1 - UNIT[out_dtype])  # (fp16 may overflow)
    err = (got - ref).abs()
    assert (torch.isfinite(got) | ~finite).all() and (err[finite] <= bound[finite]).all(), \
        f"{what}: max error {err[finite].max().item():.3g}"


@pytest.mark.parametrize("block", range(2))
def test_random_scaled_mm_is_within_the_tensore_bound_of_an_fp64_product(routes, block):
    for seed in range(20_000 + block * 50, 20_000 + (block + 1) * 50):
        _check_scaled(seed)
