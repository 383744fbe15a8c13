"""Each nisa instruction computes what its numpy reference computes."""

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl

rng = np.random.default_rng(1234)


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def simulate(kernel, *args, platform=None):
    return nki.simulate(kernel, platform=platform)(*args)


@nki.jit
def _dma_roundtrip(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_copy_round_trips_exactly():
    x = randn(128, 64)
    np.testing.assert_array_equal(simulate(_dma_roundtrip, x), x)


@nki.jit
def _dma_cast(x):
    out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_copy_casts_to_destination_dtype_with_round_to_nearest_even():
    x = randn(32, 16)
    out = simulate(_dma_cast, x)
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16))


@nki.jit
def _matmul_once(a_t, b):
    out = nl.ndarray((a_t.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
    a_sb = nl.load(a_t)
    b_sb = nl.load(b)
    ps = nl.ndarray((a_t.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(ps, a_sb, b_sb)
    res = nl.ndarray(ps.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(res, ps)
    nl.store(out, res)
    return out


def test_nc_matmul_is_stationary_transposed_times_moving():
    a_t, b = randn(128, 96), randn(128, 512)
    np.testing.assert_allclose(simulate(_matmul_once, a_t, b), a_t.T @ b, rtol=1e-5, atol=1e-4)


def test_nc_matmul_bf16_inputs_accumulate_in_fp32():
    a_t, b = randn(64, 32, dtype=ml_dtypes.bfloat16), randn(64, 128, dtype=ml_dtypes.bfloat16)
    ref = a_t.astype(np.float32).T @ b.astype(np.float32)
    np.testing.assert_allclose(simulate(_matmul_once, a_t, b), ref, rtol=1e-5, atol=1e-4)


@nki.jit
def _matmul_accumulate(a_t, b, mode):
    K = a_t.shape[0]
    out = nl.ndarray((a_t.shape[1], b.shape[1]), nl.float32, buffer=nl.shared_hbm)
    ps = nl.ndarray((a_t.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    for k in range(K // 128):
        a_sb = nl.load(a_t[k * 128:(k + 1) * 128, :])
        b_sb = nl.load(b[k * 128:(k + 1) * 128, :])
        if mode == "auto":
            nisa.nc_matmul(ps, a_sb, b_sb)
        else:
            nisa.nc_matmul(ps, a_sb, b_sb, accumulate=(k > 0))
    nl.store(out, nl.copy(ps))
    return out


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_nc_matmul_accumulates_over_k_in_psum(mode):
    a_t, b = randn(384, 64), randn(384, 256)
    np.testing.assert_allclose(simulate(_matmul_accumulate, a_t, b, mode), a_t.T @ b,
                               rtol=1e-4, atol=1e-3)


@nki.jit
def _matmul_transpose_mode(x):
    out = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    eye = nl.shared_identity_matrix(x.shape[0], x.dtype)
    ps = nl.ndarray((x.shape[1], x.shape[0]), x.dtype, buffer=nl.psum)
    nisa.nc_matmul(ps, t, eye, is_transpose=True)
    nl.store(out, nl.copy(ps))
    return out


def test_nc_matmul_transpose_mode_is_bit_exact_including_nan():
    x = randn(64, 32, dtype=ml_dtypes.bfloat16)
    x[3, 5] = np.nan
    out = simulate(_matmul_transpose_mode, x)
    np.testing.assert_array_equal(out.view(np.uint16), x.T.view(np.uint16))


@nki.jit
def _nc_transpose(x):
    out = nl.ndarray((x.shape[1], x.shape[0]), nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    ps = nl.ndarray((x.shape[1], x.shape[0]), nl.float32, buffer=nl.psum)
    nisa.nc_transpose(ps, t)
    nl.store(out, nl.copy(ps))
    return out


def test_nc_transpose_swaps_partition_and_free_axes():
    x = randn(128, 100)
    np.testing.assert_array_equal(simulate(_nc_transpose, x), x.T)


@nki.jit
def _activation(x, bias, scale):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    sums = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    b = nl.load(bias)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    s = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.activation(y, op=nl.exp, data=t, bias=b, scale=scale, reduce_op=nl.add, reduce_res=s)
    nl.store(out, y)
    nl.store(sums, s)
    return out, sums


def test_activation_applies_op_to_scaled_biased_input_and_reduces():
    x, bias = randn(128, 64), randn(128, 1)
    y, s = simulate(_activation, x, bias, 0.5)
    ref = np.exp(x * 0.5 + bias)
    np.testing.assert_allclose(y, ref, rtol=1e-6)
    np.testing.assert_allclose(s, ref.sum(axis=1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("op,ref", [
    (nl.tanh, np.tanh), (nl.sigmoid, lambda v: 1 / (1 + np.exp(-v))),
    (nl.relu, lambda v: np.maximum(v, 0)), (nl.silu, lambda v: v / (1 + np.exp(-v))),
    (nl.gelu, lambda v: 0.5 * v * (1 + np.vectorize(__import__("math").erf)(v / np.sqrt(2)))),
    (nl.square, np.square), (nl.softplus, lambda v: np.log1p(np.exp(v))),
])
def test_activation_functions_match_numpy(op, ref):
    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(y, op, t)
        nl.store(out, y)
        return out
    x = randn(16, 32)
    np.testing.assert_allclose(simulate(k, x), ref(x), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("op,ref", [(nl.add, np.add), (nl.subtract, np.subtract),
                                    (nl.multiply, np.multiply), (nl.maximum, np.maximum),
                                    (nl.divide, np.divide), (np.minimum, np.minimum),
                                    (nl.greater, lambda a, b: (a > b).astype(np.float32))])
def test_tensor_tensor_matches_numpy(op, ref):
    @nki.jit
    def k(a, b):
        out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
        x, y = nl.load(a), nl.load(b)
        r = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(r, x, y, op=op)
        nl.store(out, r)
        return out
    a, b = randn(64, 48), randn(64, 48)
    np.testing.assert_allclose(simulate(k, a, b), ref(a, b), rtol=1e-6)


@nki.jit
def _tensor_scalar(x, v):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t, vec = nl.load(x), nl.load(v)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(r, t, op0=nl.subtract, operand0=vec, reverse0=True,
                       op1=nl.multiply, operand1=3.0)
    nl.store(out, r)
    return out


def test_tensor_scalar_applies_two_ops_with_per_partition_operand_and_reverse():
    x, v = randn(128, 40), randn(128, 1)
    np.testing.assert_allclose(simulate(_tensor_scalar, x, v), (v - x) * 3.0, rtol=1e-6)


@nki.jit
def _stt(x, y):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    a, b = nl.load(x), nl.load(y)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(r, data=a, op0=nl.multiply, operand0=2.0, op1=nl.add, operand1=b)
    nl.store(out, r)
    return out


def test_scalar_tensor_tensor_is_data_op0_scalar_then_op1_tensor():
    x, y = randn(32, 16), randn(32, 16)
    np.testing.assert_allclose(simulate(_stt, x, y), x * 2 + y, rtol=1e-6)


@pytest.mark.parametrize("op,ref", [(nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min)])
def test_tensor_reduce_along_free_axis(op, ref):
    @nki.jit
    def k(x):
        out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        r = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(r, op=op, data=t, axis=1, keepdims=True)
        nl.store(out, r)
        return out
    x = randn(128, 300)
    np.testing.assert_allclose(simulate(k, x), ref(x, axis=1, keepdims=True), rtol=1e-5)


@nki.jit
def _reduce_negate_3d(x):
    out = nl.ndarray((x.shape[0], x.shape[1]), nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    r = nl.ndarray((x.shape[0], x.shape[1]), nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(r, op=nl.maximum, data=t, axis=2, negate=True)
    nl.store(out, r)
    return out


def test_tensor_reduce_negate_on_innermost_axis_of_3d_tile():
    x = randn(8, 4, 6)
    np.testing.assert_array_equal(simulate(_reduce_negate_3d, x), -x.max(axis=2))


@nki.jit
def _copy_cast(x):
    out = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm)
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(r, t, engine=nisa.engine.scalar)
    nl.store(out, r)
    return out


def test_tensor_copy_converts_dtype():
    x = randn(16, 16)
    np.testing.assert_array_equal(simulate(_copy_cast, x), x.astype(ml_dtypes.bfloat16))


@nki.jit
def _scan(a, b):
    out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
    x, y = nl.load(a), nl.load(b)
    r = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor_scan(r, x, y, initial=0.0, op0=nl.multiply, op1=nl.add)
    nl.store(out, r)
    return out


def test_tensor_tensor_scan_is_a_linear_recurrence():
    a, b = rng.uniform(0.5, 1, (4, 10)).astype(np.float32), randn(4, 10)
    ref = np.zeros_like(a)
    prev = np.zeros(4, np.float32)
    for i in range(10):
        prev = a[:, i] * prev + b[:, i]
        ref[:, i] = prev
    np.testing.assert_allclose(simulate(_scan, a, b), ref, rtol=1e-5)


@nki.jit
def _reciprocal(x):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(r, t)
    nl.store(out, r)
    return out


def test_reciprocal():
    x = rng.uniform(0.1, 2, (8, 8)).astype(np.float32)
    np.testing.assert_allclose(simulate(_reciprocal, x), 1 / x, rtol=1e-6)


@nki.jit
def _exponential(x, m):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t, mx = nl.load(x), nl.load(m)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.exponential(r, t, max_value=mx)
    nl.store(out, r)
    return out


def test_exponential_subtracts_max_on_trn3():
    x, m = randn(8, 8), randn(8, 1)
    np.testing.assert_allclose(simulate(_exponential, x, m, platform="trn3"), np.exp(x - m), rtol=1e-6)


@nki.jit
def _iota(dummy):
    out = nl.ndarray((4, 6), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 6), nl.int32, buffer=nl.sbuf)
    nisa.iota(t, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
    nl.store(out, t)
    return out


def test_iota_generates_affine_pattern():
    ref = 5 + 100 * np.arange(4)[:, None] + (10 * np.arange(2)[:, None] + np.arange(3)).reshape(-1)
    np.testing.assert_array_equal(simulate(_iota, np.zeros(1, np.float32)), ref)


@nki.jit
def _memset(dummy):
    out = nl.ndarray((4, 6), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 2.5)
    nl.store(out, t)
    return out


def test_memset_fills_constant():
    np.testing.assert_array_equal(simulate(_memset, np.zeros(1, np.float32)), np.full((4, 6), 2.5))


@nki.jit
def _causal(x):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    # keep j <= p: p - j >= 0
    nisa.affine_select(r, pattern=[[-1, x.shape[1]]], channel_multiplier=1, on_true_tile=t,
                       on_false_value=-1e9, cmp_op=nl.greater_equal)
    nl.store(out, r)
    return out


def test_affine_select_builds_a_causal_mask():
    x = randn(16, 16)
    ref = np.where(np.tril(np.ones((16, 16), bool)), x, np.float32(-1e9))
    np.testing.assert_array_equal(simulate(_causal, x), ref)


@nki.jit
def _range_select(x, lo, hi):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    mx = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    t, b0, b1 = nl.load(x), nl.load(lo), nl.load(hi)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    m = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.range_select(r, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less,
                      bound0=b0, bound1=b1, reduce_res=m, reduce_op=nl.maximum,
                      on_false_value=-100.0)
    nl.store(out, r)
    nl.store(mx, m)
    return out, mx


def test_range_select_keeps_index_range_per_partition_and_reduces_max():
    x = randn(4, 12)
    lo = np.array([[0], [2], [5], [11]], np.float32)
    hi = np.array([[3], [6], [12], [12]], np.float32)
    r, m = simulate(_range_select, x, lo, hi)
    idx = np.arange(12)[None, :]
    ref = np.where((idx >= lo) & (idx < hi), x, np.float32(-100))
    np.testing.assert_array_equal(r, ref)
    np.testing.assert_array_equal(m, ref.max(axis=1, keepdims=True))


@nki.jit
def _select_reduce(p, a, b):
    out = nl.ndarray(a.shape, nl.float32, buffer=nl.shared_hbm)
    s = nl.ndarray((a.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    pt, at, bt = nl.load(p), nl.load(a), nl.load(b)
    r = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
    m = nl.ndarray((a.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.select_reduce(r, predicate=pt, on_true=at, on_false=bt, reduce_res=m, reduce_op=nl.add)
    nl.store(out, r)
    nl.store(s, m)
    return out, s


def test_select_reduce_selects_by_predicate_and_sums():
    p = (rng.random((8, 10)) > 0.5).astype(np.uint8)
    a, b = randn(8, 10), randn(8, 10)
    r, s = simulate(_select_reduce, p, a, b)
    ref = np.where(p != 0, a, b)
    np.testing.assert_array_equal(r, ref)
    np.testing.assert_allclose(s, ref.sum(1, keepdims=True), rtol=1e-5)


@nki.jit
def _bn(x):
    out = nl.ndarray((x.shape[0], 2), nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    F = x.shape[1]
    stats = nl.ndarray((x.shape[0], 6 * (F // 512)), nl.float32, buffer=nl.sbuf)
    for i in range(F // 512):
        nisa.bn_stats(stats[:, i * 6:(i + 1) * 6], t[:, i * 512:(i + 1) * 512])
    mv = nl.ndarray((x.shape[0], 2), nl.float32, buffer=nl.sbuf)
    nisa.bn_aggr(mv, stats)
    nl.store(out, mv)
    return out


def test_bn_stats_and_bn_aggr_give_mean_and_variance():
    x = randn(64, 1024) * 3 + 1
    out = simulate(_bn, x)
    np.testing.assert_allclose(out[:, 0], x.mean(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 1], x.var(1), rtol=1e-4)


@nki.jit
def _max8_find(x):
    vals = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.shared_hbm)
    idx = nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.shared_hbm)
    t = nl.load(x)
    v = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
    i = nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.sbuf)
    nisa.max8(v, t)
    nisa.nc_find_index8(i, t, v)
    nl.store(vals, v)
    nl.store(idx, i)
    return vals, idx


def test_max8_returns_top8_descending_and_find_index8_their_positions():
    x = randn(16, 100)
    v, i = simulate(_max8_find, x)
    ref = -np.sort(-x, axis=1)[:, :8]
    np.testing.assert_array_equal(v, ref)
    np.testing.assert_array_equal(np.take_along_axis(x, i.astype(np.int64), axis=1), ref)


@nki.jit
def _dropout(x):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.dropout(r, t, prob=0.25)
    nl.store(out, r)
    return out


def test_dropout_zeroes_about_prob_and_keeps_the_rest_unscaled():
    x = rng.uniform(1, 2, (128, 512)).astype(np.float32)
    out = simulate(_dropout, x)
    dropped = out == 0
    assert 0.23 < dropped.mean() < 0.27
    np.testing.assert_array_equal(out[~dropped], x[~dropped])


@nki.jit
def _accumulate_registers(x):
    out = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    s = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    half = x.shape[1] // 2
    nisa.activation(y[:, :half], nl.copy, t[:, :half], reduce_op=nl.add, reduce_res=s,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.activation(y[:, half:], nl.copy, t[:, half:], reduce_op=nl.add, reduce_res=s,
                    reduce_cmd=nisa.reduce_cmd.reduce)
    nl.store(out, s)
    return out


def test_reduce_cmd_reduce_keeps_accumulating_across_instructions():
    x = randn(16, 64)
    np.testing.assert_allclose(simulate(_accumulate_registers, x), x.sum(1, keepdims=True), rtol=1e-5)


@nki.jit
def _gather_rows(table, indices):
    P, F = indices.shape[0], table.shape[1]
    out = nl.ndarray((P, F), table.dtype, buffer=nl.shared_hbm)
    idx = nl.ndarray((P, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    rows = nl.ndarray((P, F), table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=rows, src=table.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0))
    nisa.dma_copy(dst=out, src=rows)
    return out


def test_dma_copy_gathers_rows_with_a_vector_offset():
    table = randn(50, 16)
    indices = rng.integers(0, 50, (32, 1)).astype(np.uint32)
    np.testing.assert_array_equal(simulate(_gather_rows, table, indices), table[indices[:, 0]])


@nki.jit
def _scatter_rows(src_data, indices, output):
    P, F = src_data.shape
    s = nl.load(src_data)
    idx = nl.ndarray((P, 1), nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    nisa.dma_copy(dst=output.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0), src=s,
                  oob_mode=nisa.oob_mode.skip)


def test_dma_copy_scatters_rows_and_skips_out_of_bounds_indices():
    src = randn(4, 8)
    output = np.zeros((10, 8), np.float32)
    indices = np.array([[7], [2], [99], [0]], np.uint32)
    nki.simulate(_scatter_rows)(src, indices, output)
    ref = np.zeros((10, 8), np.float32)
    ref[[7, 2, 0]] = src[[0, 1, 3]]
    np.testing.assert_array_equal(output, ref)


def test_dma_copy_gather_with_out_of_bounds_index_is_an_error_by_default():
    from torchneuron.nki.errors import NKIOutOfBoundsError
    table = randn(10, 4)
    with pytest.raises(NKIOutOfBoundsError, match=r"index value\(s\) \[12\]"):
        simulate(_gather_rows, table, np.array([[1], [12]], np.uint32))


@nki.jit
def _dynamic_slice(x, start):
    out = nl.ndarray((4, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=start)
    t = nl.ndarray((4, x.shape[1]), x.dtype, buffer=nl.sbuf)
    F = x.shape[1]
    nisa.dma_copy(dst=t, src=x.ap(pattern=[[F, 4], [1, F]], scalar_offset=s, indirect_dim=0))
    nl.store(out, t)
    return out


def test_dma_copy_with_a_scalar_offset_reads_a_dynamic_row_window():
    x = randn(20, 6)
    np.testing.assert_array_equal(simulate(_dynamic_slice, x, np.array([[9]], np.int32)), x[9:13])
