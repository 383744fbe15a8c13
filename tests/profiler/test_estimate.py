"""Estimated Trainium time: sanity anchors against the platform table's roofs, byte counting,
the NKI model, collectives and the timeline replay. The oracle is arithmetic on the table."""

import math

import numpy as np
import pytest
import torch

from torchneuron import platform
from torchneuron.profiler.estimate import Hardware, cost_of
from torchneuron.profiler.estimate_collectives import collective_ns
from torchneuron.profiler.estimate_timeline import build_timeline, summarize
from torchneuron.profiler.records import DeviceRecord, TensorMeta, unique_bytes

HW = Hardware(platform.get_platform("trn2"), 2)


_storages = iter(range(1000, 10**9))


def t(shape, dtype="bfloat16", storage=None, written=False, stride=None, offset=0):
    if stride is None:
        stride, acc = [], 1
        for n in reversed(shape):
            stride.insert(0, acc)
            acc *= n
    return TensorMeta(dtype, tuple(shape), tuple(stride), storage or next(_storages), 0,
                      offset, written, not written, False)


def rec(name, tensors, kind="kernel", rid=1, tid=1, launch=0, start=None, end=None, stream=0, **kw):
    start = launch + 100 if start is None else start
    end = start + 1000 if end is None else end
    return DeviceRecord(rid, kind, name, 0, stream, tid, launch, launch + 100, start, end,
                        tensors=tensors, **kw)


def test_large_bf16_matmul_lands_on_the_tensor_engine_roof():
    n = 4096
    c = cost_of(rec("nc::mm", [t((n, n)), t((n, n)), t((n, n), written=True)]), HW)
    roof = 2 * n**3 / HW.peak_flops("bfloat16") * 1e9
    assert c.engine == "tensor" and c.bound == "compute"
    assert c.flops == 2 * n**3
    assert c.compute_ns == pytest.approx(roof, rel=0.01)  # 128x128 PE array fully used
    assert c.mfu(HW) > 0.98


def test_float32_matmul_runs_at_the_tables_fp32_rate():
    n = 2048
    c16 = cost_of(rec("nc::mm", [t((n, n)), t((n, n)), t((n, n), written=True)]), HW)
    c32 = cost_of(rec("nc::mm", [t((n, n), "float32"), t((n, n), "float32"),
                                 t((n, n), "float32", written=True)]), HW)
    p = HW.platform.tensor_tflops
    assert c32.compute_ns / c16.compute_ns == pytest.approx(p["bf16"] / p["fp32"], rel=1e-6)


def test_a_skinny_matmul_cannot_fill_the_pe_array():
    c = cost_of(rec("nc::mm", [t((8, 4096)), t((4096, 4096)), t((8, 4096), written=True)]), HW)
    roof = 2 * 8 * 4096 * 4096 / HW.peak_flops() * 1e9
    assert c.compute_ns > 4 * roof  # 8 rows of 128 in the stationary tile, 64-cycle minimum


def test_large_copy_lands_on_the_hbm_roof():
    nbytes = 1 << 30
    src = t((nbytes // 2,), storage=1)
    dst = t((nbytes // 2,), storage=2, written=True)
    c = cost_of(rec("Memcpy DtoD", [src, dst], kind="memcpy", bytes=nbytes, copy="DtoD"), HW)
    roof = 2 * nbytes / min(HW.hbm_bw, HW.dma_bw) * 1e9
    assert c.bound == "memory" and c.engine == "dma"
    assert c.est_ns == pytest.approx(roof + HW.fixed_s * 1e9, rel=1e-9)
    assert c.mbu(HW) > 0.95 * min(HW.hbm_bw, HW.dma_bw) / HW.hbm_bw


def test_trn3_copy_scales_with_its_hbm_bandwidth():
    nbytes = 1 << 30
    r = rec("Memcpy DtoD", [t((nbytes // 2,), storage=1), t((nbytes // 2,), storage=2, written=True)],
            kind="memcpy", bytes=nbytes, copy="DtoD")
    trn3 = Hardware(platform.get_platform("trn3"), 2)
    ratio = cost_of(r, HW).memory_ns / cost_of(r, trn3).memory_ns
    assert ratio == pytest.approx(min(trn3.hbm_bw, trn3.dma_bw) / min(HW.hbm_bw, HW.dma_bw))


def test_elementwise_bytes_read_a_broadcast_operand_once():
    n = 1024
    row = t((n, n), "float32", stride=(0, 1))  # a (n,) vector broadcast over rows
    c = cost_of(rec("nc::add.Tensor", [t((n, n), "float32"), row, t((n, n), "float32", written=True)]), HW)
    assert c.bytes_read == n * n * 4 + n * 4
    assert c.bytes_written == n * n * 4
    assert c.flops == n * n and c.engine == "vector"


def test_views_of_one_buffer_are_counted_once():
    qkv = 7
    q = t((16, 64), "float32", storage=qkv, stride=(192, 1), offset=0)
    k = t((16, 64), "float32", storage=qkv, stride=(192, 1), offset=64)
    v = t((16, 64), "float32", storage=qkv, stride=(192, 1), offset=128)
    assert unique_bytes([q, k, v]) == 16 * 192 * 4
    assert unique_bytes([q, q]) == 16 * 64 * 4 * 1 + 0 or unique_bytes([q, q]) <= 2 * q.nbytes


def test_causal_attention_counts_the_lower_triangle():
    q = [t((1, 8, 2048, 128)) for _ in range(3)]
    full = cost_of(rec("nc::_scaled_dot_product_efficient_attention", q, meta={"is_causal": False}), HW)
    causal = cost_of(rec("nc::_scaled_dot_product_efficient_attention", q, meta={"is_causal": True}), HW)
    assert full.flops == 4 * 8 * 2048 * 2048 * 128
    assert causal.flops / full.flops == pytest.approx(0.5 + 64 / 2048)
    assert causal.est_ns < full.est_ns


def test_all_reduce_follows_the_ring_alpha_beta_model():
    nbytes, n = 64 << 20, 4
    r = rec("ncclKernel_AllReduce (neuron)", [], kind="collective",
            meta={"op": "allreduce", "group_size": n, "total_bytes": nbytes})
    alpha = HW.platform.dma_transfer_fixed_s
    expect = 2 * (n - 1) / n * nbytes / HW.dma_bw + 2 * (n - 1) * alpha  # one chip: HBM/DMA path
    assert collective_ns(r, HW) == pytest.approx(expect * 1e9)
    # Ranks on two chips go over NeuronLink, shared by the chip's logical cores.
    r.meta.update(group_size=8, ranks=list(range(8)))
    bw = HW.platform.neuronlink_bytes_per_s / 4
    assert collective_ns(r, HW) == pytest.approx((2 * 7 / 8 * nbytes / bw + 14 * alpha) * 1e9)


def test_timeline_runs_a_queue_in_order_and_a_sync_stalls_the_host():
    n = 4096
    big = [t((n, n)), t((n, n)), t((n, n), written=True)]
    a = rec("nc::mm", big, rid=1, launch=0, start=100, end=10_000_000)
    b = rec("nc::mm", big, rid=2, launch=10_000_100, start=10_000_200, end=20_000_000)
    sync = DeviceRecord(3, "sync", "neuronDeviceSynchronize", 0, -1, 1, 20_000_100, 20_000_100,
                        20_000_100, 20_000_200, blocking=True)
    tl = build_timeline([a, b, sync], HW)
    ea, eb, es = tl.items
    est = ea.cost.est_ns
    # The emulator's 10 ms of execution is taken off the host: b launches right after a.
    assert eb.host_launch == pytest.approx(ea.host_launch + 200)
    assert eb.est_start == pytest.approx(ea.est_end)  # one queue: in order
    # The host waits for b from the moment its (measured, 100 ns) sync call returns.
    assert es.stall_ns == pytest.approx(eb.est_end - (es.host_launch + 100))
    s = summarize(tl)
    assert s["busy_ns"] == pytest.approx(2 * est)
    assert 0 <= s["host_bound_fraction"] < 0.01


def test_a_stream_waits_for_an_event_recorded_on_another():
    n = 4096
    big = [t((n, n)), t((n, n)), t((n, n), written=True)]
    a = rec("nc::mm", big, rid=1, launch=0, stream=1)
    evr = DeviceRecord(2, "event_record", "neuronEventRecord", 0, 1, 1, 1500, 1500, 1500, 1500, meta={"event": 9})
    wait = DeviceRecord(3, "wait", "neuronStreamWaitEvent", 0, 0, 1, 1600, 1600, 1600, 1600, meta={"event": 9})
    b = rec("nc::add.Tensor", [t((8,)), t((8,), written=True)], rid=4, launch=1700, stream=0)
    tl = build_timeline([a, evr, wait, b], HW)
    assert tl.items[3].est_start == pytest.approx(tl.items[0].est_end)


def test_gaps_between_launches_make_the_step_host_bound():
    small = [t((8,)), t((8,), written=True)]
    recs = [rec("nc::add.Tensor", small, rid=i, launch=i * 100_000, start=i * 100_000 + 100,
                end=i * 100_000 + 200) for i in range(10)]
    s = summarize(build_timeline(recs, HW))
    assert s["host_bound_fraction"] > 0.9


def test_nki_attention_estimate_is_its_own_performance_model(tmp_path):
    import json

    from torchneuron import nki
    from torchneuron.nkilib.attention import attention_cte
    from profiling_helpers import ACTIVITIES, device_events

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 128, 64)).astype(np.float32)
    k = rng.standard_normal((1, 64, 128)).astype(np.float32)
    v = rng.standard_normal((1, 128, 64)).astype(np.float32)
    model = nki.benchmark(attention_cte, "trn2", numerics=False)(q, k, v, scale=0.125).latency_us
    dq, dk, dv = (torch.from_numpy(x).to("neuron") for x in (q, k, v))
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        out = attention_cte(dq, dk, dv, scale=0.125)
    assert out.device.type == "neuron"
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    (ev,) = device_events(trace, "nki")
    assert ev["name"] == "nki::attention_cte"
    assert ev["args"]["est_ns"] == pytest.approx(model * 1e3, abs=0.1)
    # The simulator's host staging copies are not device work.
    assert device_events(trace, "memcpy") == []
