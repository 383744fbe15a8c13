"""The performance model: formulas, overlap, bandwidth, scaling, MFU and traces."""

import json

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels import copy_kernel, matmul_kernel
from torchneuron.platform import get_platform

TRN2 = get_platform("trn2")
bf16 = ml_dtypes.bfloat16


def bench(kernel, *args, platform="trn2", numerics=False, lnc=1):
    b = nki.benchmark(kernel, platform=platform, numerics=numerics)
    return b[lnc](*args) if lnc != 1 else b(*args)


def test_tiled_2048_cubed_bf16_matmul_models_at_least_80_percent_of_tensore_peak():
    a = np.zeros((2048, 2048), bf16)
    r = bench(matmul_kernel, a, a)
    assert r.matmul_dtype == "bfloat16"
    assert r.flops == 2 * 2048 ** 3
    assert r.mfu >= 0.80, r.summary()
    assert r.mfu <= 1.0


def test_tiled_matmul_kernel_numerics_and_model_agree_with_timing_only_mode():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 256)).astype(bf16)
    b = rng.standard_normal((256, 1024)).astype(bf16)
    r = bench(matmul_kernel, a, b, numerics=True)
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    np.testing.assert_allclose(r.outputs, ref, rtol=1e-4, atol=1e-3)
    assert r.latency_us == pytest.approx(bench(matmul_kernel, a, b).latency_us)


def test_matmul_latency_is_at_least_the_tensore_time():
    a = np.zeros((512, 512), bf16)
    r = bench(matmul_kernel, a, a)
    assert r.latency_us * 1e-6 >= r.flops / TRN2.peak_flops("bfloat16")


def test_dma_bound_copy_runs_at_the_dma_bandwidth():
    x = np.zeros((128, 131072), np.float32)  # 64 MiB through SBUF and back
    r = bench(copy_kernel, x)
    achieved = r.dma_bytes / (r.latency_us * 1e-6)
    limit = min(TRN2.dma_bytes_per_s, TRN2.hbm_bandwidth_per_chip / TRN2.physical_cores_per_chip)
    assert 0.75 * limit <= achieved <= limit, (achieved, limit)
    assert r.dma_bytes == 2 * x.nbytes


def test_doubling_dma_work_doubles_time():
    t1 = bench(copy_kernel, np.zeros((128, 65536), np.float32)).latency_us
    t2 = bench(copy_kernel, np.zeros((128, 131072), np.float32)).latency_us
    assert t2 / t1 == pytest.approx(2.0, rel=0.05)


def test_doubling_matmul_work_doubles_its_steady_state_time():
    # Time = pipeline fill/drain + steady state; the steady-state part doubles with the work.
    a = np.zeros((1024, 1024), bf16)
    t = {n: bench(matmul_kernel, a, np.zeros((1024, n), bf16)).latency_us for n in (2048, 4096, 8192)}
    assert (t[8192] - t[4096]) / (t[4096] - t[2048]) == pytest.approx(2.0, rel=0.05)
    assert 1.7 < t[4096] / t[2048] <= 2.0


def test_trn3_moves_data_faster_than_trn2():
    x = np.zeros((128, 65536), np.float32)
    assert bench(copy_kernel, x, platform="trn3").latency_us < bench(copy_kernel, x).latency_us


@nki.jit
def _one_activation(x):
    t = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 1.0)
    r = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.activation(r, nl.exp, t)


def test_activation_cost_is_max_64_n_cycles_on_scalar_engine():
    r = bench(_one_activation, np.zeros(1, np.float32))
    assert r.engine_busy_us["scalar"] == pytest.approx(512 / TRN2.scalar.clock_hz * 1e6)


@nki.jit
def _one_matmul(x, dtype):
    s = nl.ndarray((128, 128), dtype, buffer=nl.sbuf)
    m = nl.ndarray((128, 512), dtype, buffer=nl.sbuf)
    nisa.memset(s, 0.0)
    nisa.memset(m, 0.0)
    p = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(p, s, m)


def test_matmul_cost_is_n_moving_cycles_and_four_times_for_fp32():
    t_bf16 = bench(_one_matmul, np.zeros(1, np.float32), nl.bfloat16).engine_busy_us["tensor"]
    t_fp32 = bench(_one_matmul, np.zeros(1, np.float32), nl.float32).engine_busy_us["tensor"]
    assert t_bf16 == pytest.approx(512 / TRN2.tensor_clock_hz * 1e6)
    assert t_fp32 == pytest.approx(4 * t_bf16)


@nki.jit
def _one_dma(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)


def test_small_dma_costs_fixed_latency_plus_bytes_over_queue_bandwidth():
    x = np.zeros((128, 32), np.float32)  # 16 KiB: one chunk on one queue
    r = bench(_one_dma, x)
    expect = TRN2.dma_fixed_cost_s + x.nbytes / (TRN2.dma_queue_bytes_per_ns * 1e9)
    assert r.latency_us == pytest.approx(expect * 1e6)


@nki.jit
def _independent(x):
    a = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    b = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.memset(a, 1.0, engine=nisa.engine.gpsimd)
    nisa.memset(b, 1.0, engine=nisa.engine.gpsimd)
    ra = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    rb = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.activation(ra, nl.exp, a)          # ScalarE
    nisa.tensor_scalar(rb, b, nl.add, 1.0)  # VectorE, independent: overlaps


@nki.jit
def _dependent(x):
    a = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.memset(a, 1.0, engine=nisa.engine.gpsimd)
    ra = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    rb = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.activation(ra, nl.exp, a)
    nisa.tensor_scalar(rb, ra, nl.add, 1.0)  # reads ra: waits for ScalarE (RAW)


def test_independent_engines_overlap_and_dependencies_serialise():
    x = np.zeros(1, np.float32)
    ind, dep = bench(_independent, x), bench(_dependent, x)
    busy = ind.engine_busy_us
    assert ind.latency_us < busy["gpsimd"] + busy["scalar"] + busy["vector"] - 1
    assert dep.latency_us == pytest.approx(sum(dep.engine_busy_us[e] for e in
                                               ("gpsimd", "scalar", "vector")))


@nki.jit
def _war(x):
    a = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.memset(a, 1.0)
    r = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.activation(r, nl.exp, a)       # ScalarE reads a ...
    nisa.memset(a, 2.0, engine=nisa.engine.gpsimd)  # ... so GpSimd may not overwrite it before


def test_write_after_read_waits_for_the_reader():
    r = bench(_war, np.zeros(1, np.float32))
    b = r.engine_busy_us
    assert r.latency_us == pytest.approx(b["vector"] + b["scalar"] + b["gpsimd"])


def test_lnc2_splits_work_across_two_cores():
    @nki.jit
    def k(x):
        P, F = x.shape
        n = nl.num_programs()
        pid = nl.program_id(0)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        w = F // n
        for j in range(w // 4096):
            c0 = pid * w + j * 4096
            t = nl.load(x[:, c0:c0 + 4096])
            nl.store(out[:, c0:c0 + 4096], t)
        return out
    x = np.zeros((128, 65536), np.float32)
    t1 = bench(k, x).latency_us
    t2 = bench(k, x, lnc=2).latency_us
    assert t2 == pytest.approx(t1 / 2, rel=0.1)


def test_benchmark_exposes_outputs_and_counts():
    x = np.arange(128 * 8192, dtype=np.float32).reshape(128, 8192)
    r = bench(copy_kernel, x, numerics=True)
    np.testing.assert_array_equal(r.outputs, x)
    assert r.instructions == 4
    assert r.dma_bytes == 2 * x.nbytes
    # a tile is live until its last use (the store), so the loop needs one [128, 4096] tile
    assert r.sbuf_peak_bytes == 4096 * 4
    assert set(r.engine_busy_us) >= {"tensor", "vector", "scalar", "gpsimd", "dma"}


def test_save_trace_writes_chrome_trace_with_one_track_per_engine_and_queue(tmp_path):
    r = bench(matmul_kernel, np.zeros((256, 256), bf16), np.zeros((256, 512), bf16))
    path = r.save_trace(str(tmp_path / "trace.json"))
    data = json.load(open(path))
    names = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert {"TensorE", "VectorE"} <= names
    assert any(n.startswith("DMA queue") for n in names)
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len({e["name"] for e in spans}) >= 3
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(r.latency_us, rel=1e-6)
    assert all("source" in e["args"] for e in spans)
