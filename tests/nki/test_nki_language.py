"""nki.language: kernels, tensors, views, loops, LNC grids and the nl.* convenience ops."""

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import torchneuron.nki as tnki
from nki_kernels import softmax_kernel

rng = np.random.default_rng(7)


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def test_top_level_nki_package_aliases_torchneuron_nki():
    assert nki.jit is tnki.jit
    assert nl is tnki.language and nisa is tnki.isa


def test_nl_dtypes_are_numpy_dtypes():
    assert nl.bfloat16 == ml_dtypes.bfloat16 and nl.float32 == np.float32
    assert nl.float8_e4m3 == ml_dtypes.float8_e4m3 and nl.float8_e5m2 == ml_dtypes.float8_e5m2


@nki.jit
def _add(a, b):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.add(nl.load(a), nl.load(b)))
    return out


def test_jit_kernel_called_with_numpy_returns_numpy():
    a, b = randn(128, 32), randn(128, 32)
    out = _add(a, b)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, a + b)


def test_jit_as_a_function_call_and_with_parentheses():
    k1 = nki.jit(_add.fn)
    k2 = nki.jit()(_add.fn)
    a = randn(4, 4)
    np.testing.assert_array_equal(k1(a, a), k2(a, a))


def test_simulate_with_torch_tensors_returns_torch_tensors():
    torch = pytest.importorskip("torch")
    a, b = torch.randn(16, 8), torch.randn(16, 8)
    out = nki.simulate(_add)(a, b)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, a + b)


def test_simulate_torch_bf16_round_trips():
    torch = pytest.importorskip("torch")
    a = torch.randn(16, 8).to(torch.bfloat16)
    out = nki.simulate(_add)(a, a)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, a + a)


@nki.jit
def _tiled_exp(x):
    P, F = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(P // 128):
        for j in nl.sequential_range(F // 256):
            t = nl.load(x[i * 128:(i + 1) * 128, j * 256:(j + 1) * 256])
            nl.store(out[i * 128:(i + 1) * 128, j * 256:(j + 1) * 256], nl.exp(t))
    return out


def test_loops_and_slices_tile_a_large_tensor():
    x = randn(256, 1024)
    np.testing.assert_allclose(_tiled_exp(x), np.exp(x), rtol=1e-6)


@nki.jit
def _strided_cols(x):
    out = nl.ndarray((x.shape[0], x.shape[1] // 2), x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x[:, 0:x.shape[1]:2])
    nl.store(out, t)
    return out


def test_free_dim_slices_with_steps():
    x = randn(8, 16)
    np.testing.assert_array_equal(_strided_cols(x), x[:, ::2])


@nki.jit
def _int_index_keeps_partition(x):
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    row = t[3]
    assert row.shape == (1, x.shape[1])  # indexing SBUF keeps the partition dim
    nl.store(out, row)
    return out


def test_integer_index_on_sbuf_keeps_partition_dim():
    x = randn(8, 16)
    np.testing.assert_array_equal(_int_index_keeps_partition(x), x[3:4])


@nki.jit
def _reshape_and_ap(x):
    P, F = x.shape
    out = nl.ndarray((P, F), x.dtype, buffer=nl.shared_hbm)
    out2 = nl.ndarray((P, F // 2), x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x.reshape((P, 2, F // 2)))
    nl.store(out.reshape((P, 2, F // 2)), t)
    # every other element of each row via an access pattern on the HBM tensor
    nl.store(out2, nl.load(x.ap(pattern=[[F, P], [2, F // 2]], offset=1)))
    return out, out2


def test_reshape_and_access_pattern_views_share_storage():
    x = randn(16, 8)
    out, out2 = _reshape_and_ap(x)
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(out2, x[:, 1::2])


@nki.jit
def _views_alias(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    nisa.memset(t[:, 0:2], 0.0)  # a write through a view shows in the parent
    nl.store(out, t)
    return out


def test_writes_through_a_view_show_in_the_parent():
    x = randn(8, 4)
    ref = x.copy()
    ref[:, :2] = 0
    np.testing.assert_array_equal(_views_alias(x), ref)


@nki.jit
def _in_place(x):
    t = nl.load(x)
    nl.store(x, nl.multiply(t, 2.0))


def test_inputs_written_by_the_kernel_are_updated_in_place():
    x = randn(4, 4)
    ref = x * 2
    _in_place(x)
    np.testing.assert_array_equal(x, ref)


@nki.jit
def _lnc2(x):
    P, F = x.shape
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    half = P // nl.num_programs()
    pid = nl.program_id(0)
    t = nl.load(x[pid * half:(pid + 1) * half, :])
    nl.store(out[pid * half:(pid + 1) * half, :], nl.add(t, float(pid)))
    return out


def test_lnc2_grid_runs_two_programs_sharing_shared_hbm_outputs():
    x = randn(256, 16)
    out = nki.simulate(_lnc2)[2](x)
    np.testing.assert_array_equal(out[:128], x[:128])
    np.testing.assert_array_equal(out[128:], x[128:] + 1)


def test_lnc2_via_jit_grid_syntax():
    x = randn(256, 16)
    np.testing.assert_array_equal(_lnc2[2](x), nki.simulate(_lnc2)[2](x))


def test_lnc1_program_sees_one_program():
    x = randn(256, 16)
    out = _lnc2(x[:128])
    np.testing.assert_array_equal(out, x[:128])


def test_grid_must_be_the_lnc_degree():
    with pytest.raises(tnki.NKIArgumentError, match="1 or 2"):
        _lnc2[4](randn(256, 16))


# --- nl convenience ops ------------------------------------------------------------------------

def _unary_kernel(fn):
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, fn(nl.load(x)))
        return out
    return k


@pytest.mark.parametrize("fn,ref", [
    (nl.exp, np.exp), (nl.tanh, np.tanh), (nl.sin, np.sin), (nl.cos, np.cos), (nl.abs, np.abs),
    (nl.negative, np.negative), (nl.square, np.square), (nl.sigmoid, lambda v: 1 / (1 + np.exp(-v))),
    (nl.erf, np.vectorize(__import__("math").erf)),
])
def test_nl_unary_ops_match_numpy(fn, ref):
    x = randn(32, 64)
    np.testing.assert_allclose(_unary_kernel(fn)(x), ref(x), rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("fn,ref", [(nl.log, np.log), (nl.sqrt, np.sqrt),
                                    (nl.rsqrt, lambda v: 1 / np.sqrt(v)),
                                    (nl.reciprocal, lambda v: 1 / v)])
def test_nl_unary_ops_on_positive_inputs(fn, ref):
    x = rng.uniform(0.1, 3, (16, 16)).astype(np.float32)
    np.testing.assert_allclose(_unary_kernel(fn)(x), ref(x), rtol=2e-6)


def test_nl_binary_op_broadcasts_a_per_partition_column():
    @nki.jit
    def k(x, c):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.subtract(nl.load(x), nl.load(c)))
        return out
    x, c = randn(16, 8), randn(16, 1)
    np.testing.assert_array_equal(k(x, c), x - c)


def test_nl_power_and_operators_on_tiles():
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        nl.store(out, (t * 2 + 1) / nl.power(t, 2.0) - t)
        return out
    x = rng.uniform(1, 2, (8, 8)).astype(np.float32)
    np.testing.assert_allclose(k(x), (x * 2 + 1) / x ** 2 - x, rtol=1e-6)


@pytest.mark.parametrize("fn,ref", [(nl.sum, np.sum), (nl.max, np.max), (nl.min, np.min),
                                    (nl.mean, np.mean), (nl.prod, np.prod), (nl.var, np.var)])
def test_nl_reductions_along_free_axis(fn, ref):
    @nki.jit
    def k(x):
        out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, fn(nl.load(x), axis=1, keepdims=True))
        return out
    x = rng.uniform(0.5, 1.5, (16, 20)).astype(np.float32)
    np.testing.assert_allclose(k(x), ref(x, axis=1, keepdims=True), rtol=1e-5)


def test_nl_all():
    @nki.jit
    def k(x):
        out = nl.ndarray((x.shape[0], 1), nl.uint8, buffer=nl.shared_hbm)
        nl.store(out, nl.all(nl.load(x), axis=1, keepdims=True))
        return out
    x = np.ones((4, 5), np.float32)
    x[1, 2] = 0
    np.testing.assert_array_equal(k(x)[:, 0], [1, 0, 1, 1])


def test_nl_where_with_tiles_and_scalars():
    @nki.jit
    def k(c, x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        out2 = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        ct, xt = nl.load(c), nl.load(x)
        nl.store(out, nl.where(ct, xt, -1.0))
        nl.store(out2, nl.where(ct, 5.0, xt))
        return out, out2
    c = (rng.random((8, 8)) > 0.5).astype(np.float32)
    x = randn(8, 8)
    a, b = k(c, x)
    np.testing.assert_array_equal(a, np.where(c != 0, x, -1))
    np.testing.assert_array_equal(b, np.where(c != 0, 5, x))


def test_nl_comparison_gives_zero_one():
    @nki.jit
    def k(x, y):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.less_equal(nl.load(x), nl.load(y)))
        return out
    x, y = randn(8, 8), randn(8, 8)
    np.testing.assert_array_equal(k(x, y), (x <= y).astype(np.float32))


def test_nl_softmax_matches_reference():
    x = randn(128, 300)
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(softmax_kernel(x), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_nl_rms_norm_with_a_weight_row_broadcast_by_dma():
    @nki.jit
    def k(x, w):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.rms_norm(nl.load(x), w, axis=1, n=x.shape[1], epsilon=1e-6))
        return out
    x, w = randn(64, 32), randn(1, 32)
    ref = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(k(x, w), ref, rtol=1e-5, atol=1e-6)


def test_nl_matmul_and_transpose():
    @nki.jit
    def k(a, b):
        out = nl.ndarray((a.shape[0], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
        outt = nl.ndarray((a.shape[1], a.shape[0]), nl.float32, buffer=nl.shared_hbm)
        at, bt = nl.load(a), nl.load(b)
        nl.store(out, nl.matmul(at, bt))
        nl.store(outt, nl.transpose(at))
        return out, outt
    a, b = randn(64, 96), randn(96, 200)
    mm, t = k(a, b)
    np.testing.assert_allclose(mm, a @ b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(t, a.T)


def test_nl_matmul_transpose_x():
    @nki.jit
    def k(a_t, b):
        out = nl.ndarray((a_t.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.matmul(nl.load(a_t), nl.load(b), transpose_x=True))
        return out
    a_t, b = randn(128, 64), randn(128, 32)
    np.testing.assert_allclose(k(a_t, b), a_t.T @ b, rtol=1e-4, atol=1e-4)


def test_nl_zeros_ones_full_and_like():
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        s = nl.add(nl.add(nl.zeros((4, 4), nl.float32), nl.ones_like(t)), nl.full((4, 4), 3.0, nl.float32))
        nl.store(out, s)
        return out
    np.testing.assert_array_equal(k(np.zeros((4, 4), np.float32)), np.full((4, 4), 4.0))


def test_nl_dropout_rate():
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.dropout(nl.load(x), 0.5))
        return out
    out = k(np.ones((128, 256), np.float32))
    assert 0.47 < (out == 0).mean() < 0.53


def test_numpy_ops_accepted_as_op_arguments():
    @nki.jit
    def k(x):
        out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        r = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(r, op=np.add, data=t, axis=1)
        nl.store(out, r)
        return out
    x = randn(8, 8)
    np.testing.assert_allclose(k(x)[:, 0], x.sum(1), rtol=1e-6)


def test_tile_size_constants():
    @nki.jit
    def k(x):
        assert nl.tile_size.pmax == 128
        assert nl.tile_size.psum_fmax == 512
        assert nl.tile_size.gemm_moving_fmax == 512
        assert nl.tile_size.gemm_stationary_fmax == 128
    k(np.zeros(1, np.float32))
