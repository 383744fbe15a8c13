"""nki.collectives across two ranks of a neuron process group: each rank runs the kernel on
its own data (LNC=1 and LNC=2) and every rank checks the result against numpy."""

import numpy as np

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl


def data(rank, shape=(8, 16)):
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 100 * rank)


@nki.jit
def ring_kernel(x, world):
    rg = ncc.ReplicaGroup([list(range(world))])
    pid = nl.program_id(0) if nl.program_ndim() else 0
    n = nl.num_programs() if nl.program_ndim() else 1
    rows = x.shape[0] // n
    mine = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x[pid * rows:(pid + 1) * rows])  # each core its rows
    g = nl.ndarray((rows, world * x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.all_gather([mine], [g], rg, collective_dim=1)
    s = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.all_reduce([mine], [s], rg, nl.add)
    p = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
    ncc.collective_permute_implicit([[mine]], [[p]], rg)
    gathered = nl.ndarray((x.shape[0], world * x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    summed = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    permuted = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=gathered[pid * rows:(pid + 1) * rows], src=g)
    nisa.dma_copy(dst=summed[pid * rows:(pid + 1) * rows], src=s)
    nisa.dma_copy(dst=permuted[pid * rows:(pid + 1) * rows], src=p)
    ids = nl.ndarray((1, 2), nl.int32, buffer=nl.shared_hbm)
    if pid == 0:
        nisa.register_store(ids[:, 0:1], ncc.rank_id())
        nisa.register_store(ids[:, 1:2],
                            ncc.collective_permute_implicit_current_processing_rank_id(1, rg))
    return gathered, summed, permuted, ids


def case_collectives_over_the_neuron_process_group(rank, size):
    x = data(rank)
    for lnc in (1, 2):
        g, s, p, ids = ring_kernel[lnc](x, size)
        np.testing.assert_array_equal(g, np.concatenate([data(r) for r in range(size)], axis=1))
        np.testing.assert_array_equal(s, sum(data(r) for r in range(size)))
        np.testing.assert_array_equal(p, data((rank - 1) % size))  # from the predecessor
        assert ids.tolist() == [[rank, (rank - 1) % size]]


def test_nki_collectives_over_two_ranks(world2):
    world2.run(case_collectives_over_the_neuron_process_group)
