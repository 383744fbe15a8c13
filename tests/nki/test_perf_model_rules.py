"""Each cost rule of the performance model, checked at its boundaries.

One tiny kernel issues the instruction under test; the test reads the modelled cycles (or DMA
bytes) of that one instruction and compares them with the rule as documented in
``torchneuron/nki/perf_model.py`` and docs/nki.md, on both sides of every threshold (the 64-cycle
floor, the 64-byte DMA run, the fp32 matmul passes, the 16-bit speed-ups of NeuronCore-v3).
"""

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import perf_model as pm
from torchneuron.platform import get_platform

TRN2, TRN3 = get_platform("trn2"), get_platform("trn3")
DUMMY = np.zeros(1, np.float32)


def instrs(kernel, *args, platform="trn2"):
    """(op, engine, cycles, dma bytes) of every instruction the kernel issues, in order."""
    r = nki.benchmark(kernel, platform=platform)(*args)
    seen, out = set(), []
    for e in r.events:  # a split DMA appears once per chunk: keep one row per instruction
        if id(e.instr) not in seen:
            seen.add(id(e.instr))
            out.append((e.instr.op, e.instr.engine, e.instr.cycles, e.instr.nbytes))
    return out


def last(kernel, *args, platform="trn2"):
    return instrs(kernel, *args, platform=platform)[-1]


# --- ScalarE activation: max(64, N), +64 with a reduction; x2 for 16-bit on v4 (trn3) ----------
@nki.jit
def _activation(x, n, dtype, reduce):
    t = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.memset(t, 1.0)
    r = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    if reduce:
        acc = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(r, nl.exp, t, reduce_op=nl.add, reduce_res=acc)
    else:
        nisa.activation(r, nl.exp, t)


@pytest.mark.parametrize("n,cycles", [(1, 64), (32, 64), (63, 64), (64, 64), (65, 65), (512, 512)])
def test_activation_costs_at_least_64_cycles(n, cycles):
    op, eng, cyc, _ = last(_activation, DUMMY, n, nl.float32, False)
    assert (op, eng) == ("activation", "scalar")
    assert cyc == cycles


@pytest.mark.parametrize("n,cycles", [(16, 128), (64, 128), (300, 364)])
def test_activation_with_reduction_adds_64_cycles(n, cycles):
    assert last(_activation, DUMMY, n, nl.float32, True)[2] == cycles


@pytest.mark.parametrize("plat,dtype,cycles", [("trn2", nl.bfloat16, 512), ("trn3", nl.bfloat16, 256),
                                               ("trn3", nl.float16, 256), ("trn3", nl.float32, 512)])
def test_16bit_activation_is_twice_as_fast_on_neuroncore_v4_scalar_engine(plat, dtype, cycles):
    assert last(_activation, DUMMY, 512, dtype, False, platform=plat)[2] == cycles


# --- TensorE matmul: max(min(64, M), N); fp32 x4 (x2 as transpose) ----------------------------
@nki.jit
def _matmul(x, m, n, dtype):
    s = nl.ndarray((128, m), dtype, buffer=nl.sbuf)
    mv = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.memset(s, 0.0)
    nisa.memset(mv, 0.0)
    p = nl.ndarray((m, n), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(p, s, mv)


@pytest.mark.parametrize("m,n,cycles", [(128, 1, 64), (128, 64, 64), (128, 65, 65), (32, 1, 32),
                                        (32, 40, 40), (128, 512, 512)])
def test_bf16_matmul_costs_max_of_min64_stationary_and_moving(m, n, cycles):
    op, eng, cyc, _ = last(_matmul, DUMMY, m, n, nl.bfloat16)
    assert (op, eng) == ("nc_matmul", "tensor")
    assert cyc == cycles


@pytest.mark.parametrize("dtype,factor", [(nl.bfloat16, 1), (nl.float16, 1), (nl.float32, 4)])
def test_fp32_matmul_takes_four_passes(dtype, factor):
    assert last(_matmul, DUMMY, 128, 256, dtype)[2] == 256 * factor


@nki.jit
def _transpose_matmul(eye):
    s = nl.ndarray((128, 128), eye.dtype, buffer=nl.sbuf)
    mv = nl.ndarray((128, 128), eye.dtype, buffer=nl.sbuf)
    nisa.memset(s, 0.0)
    nisa.dma_copy(dst=mv, src=eye)  # transpose mode multiplies by the identity
    p = nl.ndarray((128, 128), eye.dtype, buffer=nl.psum)
    nisa.nc_matmul(p, s, mv, is_transpose=True)


def test_fp32_matmul_in_transpose_mode_takes_two_passes():
    import ml_dtypes
    bf = last(_transpose_matmul, np.eye(128, dtype=ml_dtypes.bfloat16))[2]
    assert bf == 128
    assert last(_transpose_matmul, np.eye(128, dtype=np.float32))[2] == 2 * bf


def test_matmul_cycles_formula_at_its_edges():
    assert pm.matmul_cycles(1, 1, False) == 1
    assert pm.matmul_cycles(64, 1, False) == 64
    assert pm.matmul_cycles(200, 1, False) == 64
    assert pm.matmul_cycles(128, 128, True) == 512
    assert pm.matmul_cycles(128, 128, True, transpose=True) == 256


# --- VectorE tensor_tensor: 2N from SBUF, max(64, N) with a PSUM input, /2 for 16-bit from v3 ---
@nki.jit
def _tensor_tensor(x, n, dtype, psum):
    a = nl.ndarray((128, n), dtype, buffer=nl.psum if psum else nl.sbuf)
    b = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.memset(a, 1.0)
    nisa.memset(b, 1.0)
    d = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(d, a, b, nl.add)


@pytest.mark.parametrize("n,cycles", [(16, 64), (32, 64), (33, 66), (512, 1024)])
def test_tensor_tensor_from_sbuf_costs_2n_with_a_64_cycle_floor(n, cycles):
    op, eng, cyc, _ = last(_tensor_tensor, DUMMY, n, nl.float32, False)
    assert (op, eng) == ("tensor_tensor", "vector")
    assert cyc == cycles


@pytest.mark.parametrize("n,cycles", [(16, 64), (64, 64), (65, 65), (512, 512)])
def test_tensor_tensor_with_a_psum_input_costs_max_64_n(n, cycles):
    assert last(_tensor_tensor, DUMMY, n, nl.float32, True)[2] == cycles


@pytest.mark.parametrize("plat,dtype,cycles", [("trn1", nl.bfloat16, 1024), ("trn2", nl.bfloat16, 512),
                                               ("trn2", nl.float32, 1024), ("trn3", nl.bfloat16, 512),
                                               ("trn3", nl.float16, 512), ("trn3", nl.float32, 1024)])
def test_16bit_tensor_tensor_is_twice_as_fast_from_neuroncore_v3(plat, dtype, cycles):
    assert last(_tensor_tensor, DUMMY, 512, dtype, False, platform=plat)[2] == cycles


# --- VectorE tensor_copy / tensor_scalar: max(64, N) / (lanes16 / 128) for 16-bit on v3 --------
@nki.jit
def _copy(x, n, dtype, src_psum):
    a = nl.ndarray((128, n), dtype, buffer=nl.psum if src_psum else nl.sbuf)
    nisa.memset(a, 1.0)
    d = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.tensor_copy(d, a, engine=nisa.engine.vector)


@nki.jit
def _tensor_scalar(x, n, dtype):
    a = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.memset(a, 1.0)
    d = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(d, a, nl.multiply, 2.0)


@pytest.mark.parametrize("plat", ["trn2", "trn3"])
def test_vector_16bit_copy_and_tensor_scalar_are_four_times_as_fast_from_sbuf(plat):
    # NeuronCore-v3+ VectorE processes lanes_16bit 16-bit elements per cycle over 128 partitions.
    wide = get_platform(plat).vector.lanes_16bit // get_platform(plat).pe_rows
    assert wide == 4
    assert last(_copy, DUMMY, 1024, nl.bfloat16, False, platform=plat)[2] == 256
    assert last(_tensor_scalar, DUMMY, 1024, nl.bfloat16, platform=plat)[2] == 256
    assert last(_copy, DUMMY, 1024, nl.float32, False, platform=plat)[2] == 1024
    assert last(_tensor_scalar, DUMMY, 1024, nl.float32, platform=plat)[2] == 1024


def test_vector_16bit_copy_is_not_faster_on_neuroncore_v2():
    assert last(_copy, DUMMY, 1024, nl.bfloat16, False, platform="trn1")[2] == 1024


def test_vector_16bit_copy_from_psum_is_only_twice_as_fast():
    assert last(_copy, DUMMY, 1024, nl.bfloat16, True, platform="trn2")[2] == 512


def test_vector_copy_keeps_the_64_cycle_floor_before_the_speedup():
    assert last(_copy, DUMMY, 8, nl.bfloat16, False, platform="trn2")[2] == 16
    assert last(_copy, DUMMY, 8, nl.float32, False, platform="trn2")[2] == 64


# --- tensor_reduce: N (N/2 for 16-bit add/max) with a 64-cycle floor ---------------------------
@nki.jit
def _reduce(x, n, dtype, op):
    a = nl.ndarray((128, n), dtype, buffer=nl.sbuf)
    nisa.memset(a, 1.0)
    d = nl.ndarray((128, 1), dtype, buffer=nl.sbuf)
    nisa.tensor_reduce(d, op, a, axis=1)


@pytest.mark.parametrize("n,dtype,op,cycles", [(512, nl.float32, nl.add, 512), (512, nl.bfloat16, nl.add, 256),
                                               (512, nl.bfloat16, nl.maximum, 256),
                                               (100, nl.float32, nl.add, 100), (100, nl.bfloat16, nl.add, 64),
                                               (32, nl.float32, nl.add, 64)])
def test_tensor_reduce_cost(n, dtype, op, cycles):
    assert last(_reduce, DUMMY, n, dtype, op)[2] == cycles


# --- DMA: descriptor runs of at least 64 bytes ---------------------------------------------------
@nki.jit
def _strided_load(x, cols):
    t = nl.ndarray((128, cols), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[:, 0:cols])


@pytest.mark.parametrize("run_elems,cost_bytes_per_run", [(4, 64), (8, 64), (15, 64), (16, 64), (17, 68),
                                                          (64, 256)])
def test_dma_runs_shorter_than_64_bytes_cost_64_bytes_each(run_elems, cost_bytes_per_run):
    # [128, run] slices of a [128, 1024] fp32 array: one contiguous run of run*4 bytes per row.
    x = np.zeros((128, 1024), np.float32)
    op, eng, _, nbytes = last(_strided_load, x, run_elems)
    assert (op, eng) == ("dma_copy", "dma")
    assert nbytes == 128 * cost_bytes_per_run


def test_dma_cost_bytes_formula_at_its_edges():
    assert pm.dma_cost_bytes(4096, 4096) == 4096
    assert pm.dma_cost_bytes(4096, 64) == 4096
    assert pm.dma_cost_bytes(4096, 63) == pytest.approx(4096 / 63 * 64)
    assert pm.dma_cost_bytes(4096, 4) == 4096 / 4 * 64
    assert pm.dma_cost_bytes(4096, 0) == 4096


@nki.jit
def _load(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)


@pytest.mark.parametrize("cols,chunks", [(128, 1), (256, 2), (383, 2), (384, 3), (8192, 16), (16384, 16)])
def test_dma_is_split_into_64k_chunks_over_at_most_16_queues(cols, chunks):
    x = np.zeros((128, cols), np.float32)  # 512 bytes per column of 128 rows
    r = nki.benchmark(_load, platform="trn2")(x)
    dmas = [e for e in r.events if e.track.startswith("dma")]
    assert len(dmas) == chunks
    assert len({e.track for e in dmas}) == chunks  # idle queues: each chunk on its own
    assert sum(e.nbytes for e in dmas) == pytest.approx(x.nbytes, abs=chunks)


def test_one_dma_chunk_costs_fixed_latency_plus_bytes_over_queue_bandwidth():
    x = np.zeros((128, 256), np.float32)  # 128 KiB: two 64 KiB chunks on two queues
    r = nki.benchmark(_load, platform="trn2")(x)
    chunk = x.nbytes / 2
    expect = TRN2.dma_fixed_cost_s + chunk / (TRN2.dma_queue_bytes_per_ns * 1e9)
    for e in r.events:
        assert e.end - e.start == pytest.approx(expect)


@nki.jit
def _hbm_to_hbm(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    return out


@pytest.mark.parametrize("plat", ["trn2", "trn3"])
def test_hbm_channel_bounds_an_hbm_to_hbm_copy(plat):
    # An HBM->HBM copy reads and writes HBM: its 16 parallel chunks need twice the bytes of the
    # core's HBM share, which then sets the time, not the queues.
    P = get_platform(plat)
    x = np.zeros((128, 16384), np.float32)
    r = nki.benchmark(_hbm_to_hbm, platform=plat)(x)
    hbm = pm.hbm_bytes_per_s_per_core(P)
    queues = P.dma_queues * P.dma_queue_bytes_per_ns * 1e9
    assert 2 * x.nbytes / hbm > x.nbytes / queues
    assert r.latency_us * 1e-6 == pytest.approx(P.dma_fixed_cost_s + 2 * x.nbytes / hbm, rel=0.01)


# --- iota / reciprocal ------------------------------------------------------------------------------
@nki.jit
def _reciprocal(x, n):
    a = nl.ndarray((128, n), nl.float32, buffer=nl.sbuf)
    nisa.memset(a, 1.0)
    d = nl.ndarray((128, n), nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(d, a)


@pytest.mark.parametrize("n,cycles", [(4, 64), (8, 64), (9, 72), (100, 800)])
def test_reciprocal_costs_8n_with_a_64_cycle_floor(n, cycles):
    assert last(_reciprocal, DUMMY, n)[2] == cycles
