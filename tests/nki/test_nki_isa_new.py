"""The nki.isa instructions AWS's kernels use beyond the core set: numerics against numpy,
hardware checks, and the engine / cost the performance model gives each."""

import math

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import errors
from torchneuron.nki.simulator import run
from torchneuron.platform import get_platform

rng = np.random.default_rng(5)
BF = ml_dtypes.bfloat16


def instrs(kernel, *args, platform="trn2", lnc=1):
    """The recorded instruction stream of program 0 (op -> list of Instr)."""
    res = run(kernel.fn, args, {}, lnc=lnc, platform=platform)
    by = {}
    for ins in res.programs[0]:
        by.setdefault(ins.op, []).append(ins)
    return res.outputs, by


def _out(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.shared_hbm)


# --- DMA -------------------------------------------------------------------------------------------

@nki.jit
def _dma_t(x):
    a, b = x.shape
    t = nl.ndarray((b, a), x.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(t, x)
    out = _out((b, a), x.dtype)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_transpose_2d_and_its_cost_at_90_percent_of_copy_bandwidth():
    x = rng.standard_normal((64, 96)).astype(BF)
    out, by = instrs(_dma_t, x)
    np.testing.assert_array_equal(out, x.T)
    (ins,) = by["dma_transpose"]
    assert ins.engine == "dma" and ins.nbytes == int(x.nbytes / 0.9)


@nki.jit
def _dma_t4(x):
    p, a, b, f = x.shape
    t = nl.ndarray((f, a, b, p), x.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(t, x, axes=(3, 1, 2, 0))
    out = _out((f, a, b, p), x.dtype)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_transpose_4d_swaps_first_and_last_axes():
    x = rng.standard_normal((16, 2, 3, 32)).astype(BF)
    np.testing.assert_array_equal(_dma_t4(x), x.transpose(3, 1, 2, 0))


@nki.jit
def _dma_t_gather(x, idx):
    it = nl.ndarray((idx.shape[0], 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=idx)
    t = nl.ndarray((x.shape[1], idx.shape[0]), x.dtype, buffer=nl.sbuf)
    nisa.dma_transpose(t, x.ap([[x.shape[1], idx.shape[0]], [1, x.shape[1]]], vector_offset=it,
                                indirect_dim=0))
    out = _out(t.shape, x.dtype)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_dma_transpose_of_an_indirect_source_gathers_rows_first():
    x = rng.standard_normal((40, 32)).astype(BF)
    idx = rng.integers(0, 40, (16, 1)).astype(np.int32)
    np.testing.assert_array_equal(_dma_t_gather(x, idx), x[idx[:, 0]].T)


def test_dma_transpose_moves_2_byte_elements_only():
    with pytest.raises(errors.NKIDtypeError, match="2-byte"):
        _dma_t(np.zeros((16, 16), np.float32))


@nki.jit
def _dma_compute(a, b):
    out = _out(a.shape)
    nisa.dma_compute(out, [a, b], nl.add)
    return out


@nki.jit
def _dma_compute_rmw(acc, rows, idx):
    it = nl.ndarray((idx.shape[0], 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=idx)
    r = nl.ndarray(rows.shape, rows.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=r, src=rows)
    view = acc.ap([[acc.shape[1], idx.shape[0]], [1, acc.shape[1]]], vector_offset=it,
                  indirect_dim=0)
    nisa.dma_compute(view, [view, r], nl.add)  # scatter read-modify-write: acc[idx] += rows


def test_dma_compute_adds_sources_in_fp32_and_does_scatter_read_modify_write():
    a, b = rng.standard_normal((8, 16)).astype(BF), rng.standard_normal((8, 16)).astype(np.float32)
    np.testing.assert_allclose(_dma_compute(a, b), a.astype(np.float32) + b, rtol=1e-6)
    acc = rng.standard_normal((10, 4)).astype(np.float32)
    rows = rng.standard_normal((3, 4)).astype(np.float32)
    idx = np.array([[7], [1], [4]], np.int32)
    want = acc.copy()
    want[idx[:, 0]] += rows
    _dma_compute_rmw(acc, rows, idx)  # writes the input in place
    np.testing.assert_allclose(acc, want, rtol=1e-6)


# --- Vector / Scalar / GpSimd ----------------------------------------------------------------------

@nki.jit
def _act_reduce(x):
    t = nl.load(x)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    r = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(y, nl.exp, t, nl.add, r, scale=0.5)
    out = _out((x.shape[0], x.shape[1] + 1))
    nl.store(out[:, :x.shape[1]], y)
    nl.store(out[:, x.shape[1]:], r)
    return out


def test_activation_reduce_reduces_the_activation_result():
    x = rng.standard_normal((32, 40)).astype(np.float32)
    out = _act_reduce(x)
    np.testing.assert_allclose(out[:, :40], np.exp(0.5 * x), rtol=1e-6)
    np.testing.assert_allclose(out[:, 40], np.exp(0.5 * x).sum(1), rtol=1e-5)


@nki.jit
def _ts_reduce(x, cmd_chain):
    t = nl.load(x)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    r = nl.ndarray((x.shape[0], 3), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(y, t, nl.abs, 0.0, nl.maximum, reduce_res=r[:, 0:1])
    nisa.tensor_scalar_reduce(y, t, nl.multiply, 2.0, nl.add, reduce_res=r[:, 1:2])
    nisa.tensor_scalar_reduce(y, t, nl.add, 1.0, nl.add, reduce_res=r[:, 2:3],
                              reduce_cmd=nisa.reduce_cmd.reduce, reduce_res_negate=True)
    out = _out((x.shape[0], 3))
    nl.store(out, r)
    return out


def test_tensor_scalar_reduce_with_unary_abs_accumulation_and_negation():
    x = rng.standard_normal((16, 24)).astype(np.float32)
    out = _ts_reduce(x, None)
    np.testing.assert_allclose(out[:, 0], np.abs(x).max(1), rtol=1e-6)
    np.testing.assert_allclose(out[:, 1], (2 * x).sum(1), rtol=1e-5, atol=1e-5)
    # reduce continues the accumulator: -(sum(2x) + sum(x + 1))
    np.testing.assert_allclose(out[:, 2], -((2 * x).sum(1) + (x + 1).sum(1)), rtol=1e-5, atol=1e-4)


@nki.jit
def _part_reduce(x, which):
    t = nl.load(x)
    r = nl.ndarray((1,) + x.shape[1:], nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(r, {"add": nl.add, "max": nl.maximum, "avg": nl.average}[which], t)
    out = _out((1,) + x.shape[1:])
    nl.store(out, r)
    return out


@pytest.mark.parametrize("which,ref", [("add", np.sum), ("max", np.max), ("avg", np.mean)])
def test_tensor_partition_reduce_reduces_across_partitions(which, ref):
    x = rng.standard_normal((128, 8, 4)).astype(np.float32)
    np.testing.assert_allclose(_part_reduce(x, which), ref(x, axis=0, keepdims=True), rtol=1e-5,
                               atol=1e-5)


def test_tensor_partition_reduce_is_a_gpsimd_instruction_with_its_cost():
    x = rng.standard_normal((128, 8, 4)).astype(np.float32)
    _, by = instrs(_part_reduce, x, "add")
    (ins,) = by["tensor_partition_reduce"]
    assert ins.engine == "gpsimd" and ins.cycles == 150 + 32 * 8


@nki.jit
def _copy_pred(x, pred, scalar):
    t = nl.load(x)
    m = nl.load(pred)
    d = nl.zeros(x.shape, nl.float32)
    if scalar:
        nisa.tensor_copy_predicated(d, 7.0, m, reverse_pred=True)
    else:
        nisa.tensor_copy_predicated(d, t, m)
    out = _out(x.shape)
    nl.store(out, d)
    return out


def test_tensor_copy_predicated_copies_where_the_mask_is_set():
    x = rng.standard_normal((16, 32)).astype(np.float32)
    pred = (rng.random((16, 32)) > 0.5).astype(np.uint8)
    np.testing.assert_array_equal(_copy_pred(x, pred, False), np.where(pred != 0, x, 0))
    np.testing.assert_array_equal(_copy_pred(x, pred, True), np.where(pred == 0, 7.0, 0))


@nki.jit
def _nonzero(x):
    t = nl.load(x)
    d = nl.ndarray((x.shape[0], x.shape[1] + 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(d, 99)
    nisa.nonzero_with_count(d, t, index_offset=16, padding_val=-1)
    out = _out(d.shape, nl.int32)
    nl.store(out, d)
    return out


def test_nonzero_with_count_on_every_sixteenth_partition():
    x = np.zeros((32, 8), np.float32)
    x[0] = [0, 1, 1, 0, 0, 1, 0, 0]  # AWS's example
    x[16, 7] = 3.0
    x[5, 2] = 1.0  # partition 5 is not read
    out = _nonzero(x)
    assert out[0].tolist() == [17, 18, 21, -1, -1, -1, -1, -1, 3]
    assert out[16].tolist() == [23] + [-1] * 7 + [1]
    assert (out[5] == 99).all()  # other partitions are left untouched


@nki.jit
def _match_replace(x, v):
    t = nl.load(x)
    vv = nl.load(v)
    d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    ix = nl.ndarray((x.shape[0], 8), nl.uint32, buffer=nl.sbuf)
    nisa.nc_match_replace8(d, t, vv, -1.0, dst_idx=ix)
    out = _out((x.shape[0], x.shape[1] + 8))
    nl.store(out[:, :x.shape[1]], d)
    o2 = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(o2, ix)
    nl.store(out[:, x.shape[1]:], o2)
    return out


def test_nc_match_replace8_pairs_duplicates_in_reverse_order():
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)  # AWS's example
    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    out = _match_replace(data, vals)
    assert out[0, 11:].tolist() == [2, 10, 9, 8, 7, 6, 5, 4]
    assert out[0, :11].tolist() == [1, 2, -1, 4] + [-1] * 7


@nki.jit
def _n_gather(x, idx):
    t = nl.load(x)
    i = nl.load(idx)
    d = nl.ndarray(idx.shape, x.dtype, buffer=nl.sbuf)
    nisa.nc_n_gather(d, t, i)
    out = _out(idx.shape, x.dtype)
    nl.store(out, d)
    return out


def test_nc_n_gather_gathers_within_each_partition_and_checks_bounds():
    x = rng.standard_normal((8, 4, 6)).astype(np.float32)
    idx = rng.integers(0, 24, (8, 10)).astype(np.uint32)
    np.testing.assert_array_equal(_n_gather(x, idx), np.take_along_axis(x.reshape(8, 24), idx.astype(int), 1))
    with pytest.raises(errors.NKIOutOfBoundsError, match="outside"):
        _n_gather(x, np.full((8, 2), 24, np.uint32))


@nki.jit
def _local_gather(x, idx, ne, nv):
    t = nl.load(x)
    i = nl.load(idx)
    d = nl.ndarray((x.shape[0], nv * ne), x.dtype, buffer=nl.sbuf)
    nisa.local_gather(d, t, i, num_elem_per_idx=ne, num_valid_indices=nv)
    out = _out(d.shape, x.dtype)
    nl.store(out, d)
    return out


def test_local_gather_matches_awss_numpy_semantics_and_cost():
    x = (rng.random((32, 64)) * 100).astype(np.float32)
    per16 = rng.integers(0, 15, (16, 3)).astype(np.uint16) * 4
    idx = np.tile(per16, (2, 1))
    ne, nv = 4, 40
    want = np.empty((32, nv, ne), np.float32)
    for g in range(2):
        ids = idx[16 * g:16 * g + 16].flatten(order="F")[:nv]
        want[16 * g:16 * g + 16] = np.stack([x[16 * g:16 * g + 16, i:i + ne] for i in ids], 1)
    out, by = instrs(_local_gather, x, idx, ne, nv)
    np.testing.assert_array_equal(out.reshape(32, nv, ne), want)
    c = ((28 + 4 * ne) / (4 * ne)) / min(4 / 4, ne)
    assert by["local_gather"][0].cycles == pytest.approx(150 + nv * ne / c)


@nki.jit
def _shuffle(x, mask):
    t = nl.load(x)
    d = nl.zeros(x.shape, nl.float32)
    nisa.nc_stream_shuffle(d, t, list(mask))
    out = _out(x.shape)
    nl.store(out, d)
    return out


def test_nc_stream_shuffle_moves_partitions_within_each_quadrant():
    x = rng.standard_normal((64, 8)).astype(np.float32)
    mask = [(i - 1) % 32 for i in range(32)]
    mask[5] = 255  # left untouched
    want = np.zeros_like(x)
    for q in (0, 32):
        for i, m in enumerate(mask):
            if m != 255:
                want[q + i] = x[q + m]
    np.testing.assert_array_equal(_shuffle(x, tuple(mask)), want)


@nki.jit
def _cumulative(x):
    t = nl.load(x)
    d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar_cumulative(d, t, nl.multiply, nl.maximum, 2.0)
    out = _out(x.shape)
    nl.store(out, d)
    return out


def test_tensor_scalar_cumulative_is_a_running_op1_of_op0_results():
    x = rng.standard_normal((8, 20)).astype(np.float32)
    np.testing.assert_allclose(_cumulative(x), np.maximum.accumulate(2 * x, axis=1))


@nki.jit
def _activate2(x):
    t = nl.load(x)
    d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    r = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.activate2(d, nl.prelu, t, 2.0, 0.5, nl.multiply, nl.subtract, relu_param=0.1,
                   reduce_op=nl.maximum, reduce_res=r, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    out = _out((x.shape[0], x.shape[1] + 1))
    nl.store(out[:, :x.shape[1]], d)
    nl.store(out[:, x.shape[1]:], r)
    return out


def test_activate2_on_trn3_and_its_platform_check():
    x = rng.standard_normal((16, 12)).astype(np.float32)
    v = 2 * x - 0.5
    y = np.where(v >= 0, v, 0.1 * v)
    out = nki.simulate(_activate2, platform="trn3")(x)
    np.testing.assert_allclose(out[:, :12], y, rtol=1e-6)
    np.testing.assert_allclose(out[:, 12], y.max(1), rtol=1e-6)
    with pytest.raises(errors.NKIPlatformError, match="NeuronCore-v4"):
        nki.simulate(_activate2, platform="trn2")(x)


@nki.jit
def _rand(x):
    d = nl.rand((128, 256), nl.float32)
    out = _out((128, 256))
    nl.store(out, d)
    return out


def test_nl_rand_is_uniform_and_seeded():
    x = np.zeros((1, 1), np.float32)
    a, b = nki.simulate(_rand, seed=1)(x), nki.simulate(_rand, seed=1)(x)
    np.testing.assert_array_equal(a, b)
    assert 0 <= a.min() and a.max() < 1 and abs(a.mean() - 0.5) < 0.01


# --- MX (NeuronCore-v4) ------------------------------------------------------------------------------

def _mx_quant_ref(v, emax, el):
    """AWS's documented quantize_mx: groups of 8 partitions x 4 elements share
    X = 2^(floor(log2 amax) - (emax - 1))."""
    p, f = v.shape
    g = np.abs(v).reshape(p // 8, 8, f // 4, 4).max(axis=(1, 3))
    e = np.where(g > 0, np.floor(np.log2(np.where(g > 0, g, 1))) - (emax - 1), -127)
    scale = np.exp2(e)
    full = np.repeat(np.repeat(scale, 8, 0), 4, 1)
    q = np.clip(v / full, -float(ml_dtypes.finfo(el).max), float(ml_dtypes.finfo(el).max)).astype(el)
    return q, (e + 127).astype(np.uint8)


@nki.jit
def _quantize(x):
    t = nl.load(x)
    q = nl.ndarray((x.shape[0], x.shape[1] // 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    s = nl.ndarray((x.shape[0], x.shape[1] // 4), nl.uint8, buffer=nl.sbuf)
    nisa.memset(s, 0)
    nisa.quantize_mx(q, t, s)
    out = _out((x.shape[0], x.shape[1] // 4 * 5), nl.uint8)
    nisa.dma_copy(dst=out[:, :x.shape[1]].view(nl.float8_e4m3fn_x4), src=q)
    nisa.dma_copy(dst=out[:, x.shape[1]:], src=s)
    return out


def test_quantize_mx_groups_scales_and_writes_the_quadrant_scale_layout():
    x = (rng.standard_normal((64, 16)) * 3).astype(BF)
    out = nki.simulate(_quantize, platform="trn3")(x)
    q, s = _mx_quant_ref(x.astype(np.float32), 8, ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(out[:, :16].view(ml_dtypes.float8_e4m3fn).astype(np.float32),
                                  q.astype(np.float32))
    scale = out[:, 16:]
    for qd in range(2):
        np.testing.assert_array_equal(scale[32 * qd:32 * qd + 4], s[4 * qd:4 * qd + 4])
        assert (scale[32 * qd + 4:32 * qd + 32] == 0).all()


@nki.jit
def _mx_matmul(a, b):
    ta, tb = nl.load(a), nl.load(b)
    qa = nl.ndarray((a.shape[0], a.shape[1] // 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    qb = nl.ndarray((b.shape[0], b.shape[1] // 4), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    sa = nl.ndarray(qa.shape, nl.uint8, buffer=nl.sbuf)
    sb = nl.ndarray(qb.shape, nl.uint8, buffer=nl.sbuf)
    nisa.quantize_mx(qa, ta, sa)
    nisa.quantize_mx(qb, tb, sb)
    ps = nl.ndarray((qa.shape[1], qb.shape[1]), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(ps, qa, qb, sa, sb)
    out = _out(ps.shape)
    r = nl.ndarray(ps.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(r, ps)
    nl.store(out, r)
    return out


def test_nc_matmul_mx_dequantises_and_contracts_partitions_and_packed_values():
    K, M, N = 64, 32, 48
    a = rng.standard_normal((K, 4 * M)).astype(BF)
    b = rng.standard_normal((K, 4 * N)).astype(BF)
    out = nki.simulate(_mx_matmul, platform="trn3")(a, b)
    qa, sa = _mx_quant_ref(a.astype(np.float32), 8, ml_dtypes.float8_e4m3fn)
    qb, sb = _mx_quant_ref(b.astype(np.float32), 8, ml_dtypes.float8_e4m3fn)
    da = qa.astype(np.float32) * np.repeat(np.repeat(np.exp2(sa.astype(float) - 127), 8, 0), 4, 1)
    db = qb.astype(np.float32) * np.repeat(np.repeat(np.exp2(sb.astype(float) - 127), 8, 0), 4, 1)
    want = np.einsum("kiq,kjq->ij", da.reshape(K, M, 4), db.reshape(K, N, 4))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    # and it approximates the unquantised product (MXFP8: ~2^-3 relative per value)
    exact = np.einsum("kiq,kjq->ij", a.astype(np.float32).reshape(K, M, 4),
                      b.astype(np.float32).reshape(K, N, 4))
    assert np.abs(out - exact).max() < 0.1 * np.abs(exact).max()


def test_mx_instructions_need_trn3_and_are_costed_at_the_mx_rate():
    a = np.zeros((32, 8), BF)
    with pytest.raises(errors.NKIPlatformError, match="quantize_mx needs NeuronCore-v4"):
        nki.simulate(_mx_matmul, platform="trn2")(a, a)
    r = nki.benchmark(_mx_matmul, platform="trn3")(np.ones((128, 512), BF), np.ones((128, 2048), BF))
    assert r.flops == 2 * 128 * 4 * 128 * 512 and r.matmul_dtype == "float8_e4m3fn"
    # 512 moving columns: a bf16-matmul cycle count for 4x the FLOPs
    plat = get_platform("trn3")
    assert r.engine_busy_us["tensor"] == pytest.approx(512 / plat.tensor_clock_hz * 1e6)


# --- cost and engine of every new instruction ---------------------------------------------------------

def test_benchmark_reports_the_new_instructions_on_their_engines():
    x = (rng.random((32, 64)) * 100).astype(np.float32)
    idx = np.tile(rng.integers(0, 15, (16, 3)).astype(np.uint16) * 4, (2, 1))
    r = nki.benchmark(_local_gather)(x, idx, 4, 40)
    assert r.engine_busy_us["gpsimd"] > 0 and r.instructions == 4
    names = {ev.instr.op for ev in r.events}
    assert "local_gather" in names
    assert math.isclose(r.latency_us, max(ev.end for ev in r.events) * 1e6)


@nki.jit
def _many_new(x, idx16, idx32):
    t = nl.load(x)
    y = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    r = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(y, nl.exp, t, nl.add, r)
    nisa.tensor_scalar_reduce(y, t, nl.add, 1.0, nl.add, reduce_res=r)
    nisa.tensor_scalar_cumulative(y, t, nl.add, nl.add, 0.0)
    nisa.tensor_copy_predicated(y, t, nl.load(idx32))
    nisa.nc_stream_shuffle(y, t, [0] * 32)
    p = nl.ndarray((1, x.shape[1]), nl.float32, buffer=nl.sbuf)
    nisa.tensor_partition_reduce(p, nl.add, t)
    g = nl.ndarray((x.shape[0], 16), nl.float32, buffer=nl.sbuf)
    nisa.local_gather(g, t, nl.load(idx16), num_valid_indices=16)
    ng = nl.ndarray((x.shape[0], 4), nl.float32, buffer=nl.sbuf)
    nisa.nc_n_gather(ng, t, nl.load(idx32)[:, :4])
    nz = nl.ndarray((x.shape[0], x.shape[1] + 1), nl.int32, buffer=nl.sbuf)
    nisa.nonzero_with_count(nz, t)
    m = nl.ndarray((x.shape[0], 8), nl.float32, buffer=nl.sbuf)
    nisa.max8(m, t)
    nisa.nc_match_replace8(y, t, m, 0.0)
    reg = nisa.register_alloc()
    nisa.register_load(reg, nl.load(idx32)[0:1, 0:1])
    tt = nl.ndarray((x.shape[1], x.shape[0]), nl.bfloat16, buffer=nl.sbuf)
    tb = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(tb, t)
    nisa.dma_transpose(tt, tb)
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.dma_compute(out, [x, x], nl.add)
    nisa.core_barrier(out, (0, 1))
    return out


def test_every_new_instruction_runs_on_its_documented_engine():
    x = rng.standard_normal((32, 64)).astype(np.float32)
    idx16 = rng.integers(0, 60, (32, 1)).astype(np.uint16)
    idx32 = rng.integers(0, 60, (32, 64)).astype(np.uint32)
    r = nki.benchmark(_many_new, numerics=False)(x, idx16, idx32)
    engines = {}
    for ev in r.events:
        engines.setdefault(ev.instr.op, set()).add("dma" if ev.track.startswith("dma") else ev.track)
    want = {"activation": "scalar", "tensor_scalar_reduce": "vector",
            "tensor_scalar_cumulative": "vector", "tensor_copy_predicated": "vector",
            "nc_stream_shuffle": "vector", "tensor_partition_reduce": "gpsimd",
            "local_gather": "gpsimd", "nc_n_gather": "gpsimd", "nonzero_with_count": "gpsimd",
            "nc_match_replace8": "vector", "register_load": "gpsimd", "dma_transpose": "dma",
            "dma_compute": "dma", "core_barrier": "gpsimd"}
    for op, eng in want.items():
        assert engines.get(op) == {eng}, (op, engines.get(op))
    assert all(ev.end > ev.start for ev in r.events)
