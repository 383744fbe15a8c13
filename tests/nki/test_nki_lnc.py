"""LNC=2 programs: concurrent cores, shared HBM, per-core SBUF/PSUM, core_barrier, sendrecv,
the performance model running both cores, and collectives within one process."""

import numpy as np
import pytest

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import errors
from torchneuron.platform import get_platform

rng = np.random.default_rng(3)


@nki.jit
def _exchange_via_hbm(x):
    """Each core writes half of a shared_hbm scratch, waits at the barrier, then reads the
    half the other core wrote: correct only if both cores run and the barrier orders them."""
    n = x.shape[0] // 2
    pid = nl.program_id(0)
    scratch = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    mine = nl.ndarray((n, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[pid * n:(pid + 1) * n])
    nisa.tensor_scalar(mine, mine, nl.multiply, 2.0)
    nisa.dma_copy(dst=scratch[pid * n:(pid + 1) * n], src=mine)
    nisa.core_barrier(scratch, (0, 1))
    other = nl.ndarray((n, x.shape[1]), x.dtype, buffer=nl.sbuf)
    o = 1 - pid
    nisa.dma_copy(dst=other, src=scratch[o * n:(o + 1) * n])
    nisa.dma_copy(dst=out[pid * n:(pid + 1) * n], src=other)  # swapped halves
    return out


def test_core_barrier_orders_shared_hbm_exchange_between_the_two_cores():
    x = rng.standard_normal((64, 32)).astype(np.float32)
    out = _exchange_via_hbm[2](x)
    np.testing.assert_array_equal(out[:32], 2 * x[32:])
    np.testing.assert_array_equal(out[32:], 2 * x[:32])


@nki.jit
def _sendrecv(x):
    pid = nl.program_id(0)
    n = x.shape[0] // 2
    t = nl.ndarray((n, x.shape[1]), x.dtype, buffer=nl.sbuf, address=(0, 0))  # same address
    nisa.dma_copy(dst=t, src=x[pid * n:(pid + 1) * n])  # on both cores: per-core SBUF
    got = nl.ndarray((n, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.sendrecv(src=t, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid * n:(pid + 1) * n], src=got)
    return out


def test_sendrecv_swaps_tiles_and_sbuf_is_per_core():
    x = rng.standard_normal((16, 8)).astype(np.float32)
    out = _sendrecv[2](x)
    np.testing.assert_array_equal(out[:8], x[8:])
    np.testing.assert_array_equal(out[8:], x[:8])


@nki.jit
def _mismatch(x):
    t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 0.0)
    if nl.program_id(0) == 0:
        nisa.core_barrier(t, (0, 1))
    else:
        nisa.sendrecv(t, t, 0, 0, pipe_id=0)


@nki.jit
def _missing(x):
    t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 0.0)
    if nl.program_id(0) == 0:
        nisa.core_barrier(t, (0, 1))  # <lonely-barrier>


def test_unmatched_cross_core_instructions_are_errors_not_hangs():
    x = np.zeros((1, 1), np.float32)
    with pytest.raises(errors.NKITracingError, match="differ at #0"):
        _mismatch[2](x)
    with pytest.raises(errors.NKITracingError, match="program 1 finished without reaching it"):
        _missing[2](x)


def test_sendrecv_and_core_barrier_need_an_lnc_platform():
    with pytest.raises(errors.NKIPlatformError, match="trn1"):
        nki.simulate(_sendrecv, platform="trn1")[2](np.zeros((4, 4), np.float32))


@nki.jit
def _shared_mismatch(x):
    shape = (4, 4) if nl.program_id(0) == 0 else (4, 8)
    nl.ndarray(shape, nl.float32, buffer=nl.shared_hbm)


def test_shared_hbm_allocations_must_agree_between_cores():
    with pytest.raises(errors.NKIShapeError, match="shared_hbm allocation #0"):
        _shared_mismatch[2](np.zeros((1, 1), np.float32))


@nki.jit
def _unbalanced(x, work0, work1):
    pid = nl.program_id(0)
    t = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 1.0)
    for _ in range(work0 if pid == 0 else work1):
        nisa.activation(t, nl.exp, t)
    nisa.core_barrier(t, (0, 1))
    for _ in range(work1 if pid == 0 else work0):
        nisa.activation(t, nl.exp, t)


@nki.jit
def _uneven_allocations(x):
    """Program 0 allocates one tile more than program 1 before the shared output, so with
    per-program storage ids the shared tensor's id would name a tile of the other program."""
    pid = nl.program_id(0)
    a = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    if pid == 0:
        nisa.memset(nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf), 0.0)
    out = nl.ndarray((2,) + x.shape, x.dtype, buffer=nl.shared_hbm)
    b = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    c = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=x)
    nisa.tensor_copy(dst=b, src=a)
    nisa.tensor_copy(dst=c, src=b)
    nisa.dma_copy(dst=out[pid], src=c)
    return out


def test_storage_ids_are_unique_across_the_programs_of_a_launch():
    # the dependency tracking of one core keys on storage ids: a shared tensor created by the
    # other program must not alias a local tile (it made LNC=2 latencies depend on thread order)
    from torchneuron.nki import simulator
    x = np.zeros((128, 64), np.float32)
    res = simulator.run(_uneven_allocations, (x,), {}, lnc=2, platform="trn2", numerics=False)
    for prog in res.programs:
        store = prog[-1]
        assert store.op == "dma_copy"
        out_sid = store.writes[0][-1]
        local = {r[-1] for ins in prog[:-1] for r in ins.writes}
        assert out_sid not in local


def test_performance_model_runs_cores_in_parallel_and_synchronises_at_barriers():
    x = np.zeros((1, 1), np.float32)
    plat = get_platform("trn2")
    act = 512 / plat.scalar.clock_hz * 1e6  # one activation, us
    bar = 64 / plat.gpsimd.clock_hz * 1e6
    memset = 512 / plat.vector.clock_hz * 1e6
    r = nki.benchmark(_unbalanced, numerics=False)[2](x, 10, 2)
    # core 1 waits at the barrier for core 0's 10 activations, then both run their second phase
    # (core 1: 10 more): latency ~ 20 activations, not 12 (no barrier) nor 24 (serial)
    assert r.latency_us == pytest.approx(memset + 20 * act + bar, rel=0.01)
    bars = [e for e in r.events if e.instr.op == "core_barrier"]
    assert len(bars) == 2 and bars[0].start == bars[1].start


@nki.jit
def _two_cores_dma(x):
    pid = nl.program_id(0)
    n = x.shape[1] // nl.num_programs()
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for j in range(0, n, 4096):
        c0 = pid * n + j
        t = nl.load(x[:, c0:c0 + 4096])
        nl.store(out[:, c0:c0 + 4096], t)
    return out


def test_two_cores_halve_a_bandwidth_bound_copy():
    x = np.zeros((128, 65536), np.float32)
    t1 = nki.benchmark(_two_cores_dma, numerics=False)(x).latency_us
    t2 = nki.benchmark(_two_cores_dma, numerics=False)[2](x).latency_us
    assert t2 == pytest.approx(t1 / 2, rel=0.1)


# --- collectives inside one process: the group of this rank ------------------------------------------

@nki.jit
def _collectives(x):
    rg = ncc.ReplicaGroup([[0]])
    t = nl.load(x)
    g = nl.ndarray((x.shape[0], x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.all_gather([t], [g], rg, collective_dim=1)
    r = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    ncc.all_reduce([t], [r], rg, nl.add)
    p = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    ncc.collective_permute_implicit([[t]], [[p]], rg)
    me = ncc.rank_id()
    src = ncc.collective_permute_implicit_current_processing_rank_id(0, rg)
    out = nl.ndarray((3,) + x.shape, x.dtype, buffer=nl.shared_hbm)
    for i, v in enumerate((g, r, p)):
        nl.store(out[i], v)
    ids = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
    nisa.register_store(ids[:, 0:1], me)
    nisa.register_store(ids[:, 1:2], src)
    return out, ids


def test_collectives_over_a_group_of_this_rank_only():
    x = rng.standard_normal((8, 16)).astype(np.float32)
    out, ids = _collectives(x)
    for i in range(3):
        np.testing.assert_array_equal(out[i], x)
    assert ids.tolist() == [[0, 0]]
    out2, _ = _collectives[2](x)  # every core takes part on its own data
    np.testing.assert_array_equal(out2[0], x)


@nki.jit
def _bad_group(x):
    t = nl.load(x)
    g = nl.ndarray((x.shape[0], 2 * x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.all_gather([t], [g], ncc.ReplicaGroup([[0, 1]]), collective_dim=1)


def test_a_group_spanning_other_ranks_needs_a_process_group():
    with pytest.raises(errors.NKIArgumentError, match="world of 1"):
        _bad_group(np.zeros((4, 4), np.float32))
