"""The performance model's parts, one rule per test, on a made-up platform with round numbers.

The rules are the ones documented in ``torchneuron/nki/perf_model.py`` and docs/nki.md
(engine clocks, 16-bit speed-ups, DMA chunking over queues, the HBM channel, in-order engines
with read/write dependencies, cross-core rendezvous, the summary figures). The platform below
has distinct clocks per engine, two DMA queues of 1 byte/ns and a 1 us fixed DMA cost, so every
expected time is a hand computation, not the model's own output. Pure Python: these tests run
in milliseconds and are the first ones mutation testing runs (tools/mutation.py, ``perf_model``).
"""

import dataclasses

import pytest

from torchneuron.nki import perf_model as pm
from torchneuron.nki.tracer import Instr
from torchneuron.platform import Engine, get_platform

US = 1e-6
TOY = dataclasses.replace(
    get_platform("trn2"), name="toy",
    tensor_clock_hz=1e9, vector=Engine(2e9, 128, 512), scalar=Engine(4e9, 128, 256),
    gpsimd=Engine(8e9, 128), pe_rows=128,
    dma_queues=2, dma_queue_bytes_per_ns=1.0, dma_fixed_cost_s=1 * US,
    hbm_bandwidth_per_chip=8e12, physical_cores_per_chip=2,  # 4 TB/s per core: never binding
    tensor_tflops={"bf16": 0.001, "fp32": 0.0005, "fp8": 0.001},  # 1e9 / 5e8 FLOP/s
)
KB64 = 64 * 1024


def reg(sid, r0=0, r1=128, b0=0, b1=1024):
    """A region (dependency id, rows [r0, r1), bytes [b0, b1), storage id)."""
    return (sid, r0, r1, b0, b1, sid)


def op(engine, cycles=0.0, reads=(), writes=(), **kw):
    return Instr(f"op_{engine}", engine, float(cycles), list(reads), list(writes), **kw)


def spans(events):
    return [(e.track, pytest.approx(e.start, abs=1e-15), pytest.approx(e.end, abs=1e-15)) for e in events]


# --- cost formulas -----------------------------------------------------------------------------
@pytest.mark.parametrize("p,f,cycles", [(128, 1, 128), (128, 512, 128), (32, 40, 40), (32, 100, 64),
                                        (1, 1, 1), (64, 64, 64)])
def test_transpose_costs_max_of_partitions_and_min64_free(p, f, cycles):
    assert pm.transpose_cycles(p, f) == cycles


@pytest.mark.parametrize("kind,psum,factor", [("copy", False, 4), ("tensor_scalar", False, 4),
                                              ("copy", True, 2), ("tensor_scalar", True, 2),
                                              ("tensor_tensor", False, 2), ("tensor_tensor", True, 1),
                                              ("reduce", False, 1)])
def test_vector_16bit_speedup_per_instruction_kind(kind, psum, factor):
    # lanes_16bit 512 over 128 PE rows: 4 elements per lane and cycle
    assert pm.vector_speedup(TOY, True, psum, kind) == factor


@pytest.mark.parametrize("kind", ["copy", "tensor_scalar", "tensor_tensor"])
def test_vector_speedup_is_one_for_32bit_data(kind):
    assert pm.vector_speedup(TOY, False, False, kind) == 1


@pytest.mark.parametrize("lanes16", [0, 128])
def test_vector_speedup_is_one_without_wider_16bit_lanes(lanes16):
    plat = dataclasses.replace(TOY, vector=Engine(2e9, 128, lanes16))
    for kind in ("copy", "tensor_scalar", "tensor_tensor"):
        assert pm.vector_speedup(plat, True, False, kind) == 1


def test_vector_speedup_is_16bit_lanes_over_pe_rows():
    plat = dataclasses.replace(TOY, pe_rows=2, vector=Engine(2e9, 2, 6))
    assert pm.vector_speedup(plat, True, False, "copy") == 3
    plat = dataclasses.replace(TOY, pe_rows=1, vector=Engine(2e9, 1, 3))
    assert pm.vector_speedup(plat, True, False, "copy") == 3


def test_vector_speedup_of_a_two_times_wider_engine_is_two():
    plat = dataclasses.replace(TOY, vector=Engine(2e9, 128, 256))
    assert pm.vector_speedup(plat, True, False, "copy") == 2


def test_scalar_16bit_speedup_is_16bit_lanes_over_pe_rows():
    assert pm.scalar_speedup(TOY, True) == 2
    assert pm.scalar_speedup(dataclasses.replace(TOY, pe_rows=2, scalar=Engine(4e9, 2, 6)), True) == 3
    assert pm.scalar_speedup(dataclasses.replace(TOY, pe_rows=1, scalar=Engine(4e9, 1, 3)), True) == 3


def test_scalar_speedup_is_one_for_32bit_data_or_without_wider_lanes():
    assert pm.scalar_speedup(TOY, False) == 1
    assert pm.scalar_speedup(dataclasses.replace(TOY, scalar=Engine(4e9, 128, 128)), True) == 1
    assert pm.scalar_speedup(dataclasses.replace(TOY, scalar=Engine(4e9, 128, 0)), True) == 1


@pytest.mark.parametrize("engine,hz", [("tensor", 1e9), ("vector", 2e9), ("scalar", 4e9), ("gpsimd", 8e9)])
def test_each_engine_runs_at_its_own_clock(engine, hz):
    assert pm.clock_of(TOY, engine) == hz


def test_hbm_bandwidth_per_core_is_the_chip_bandwidth_over_its_physical_cores():
    assert pm.hbm_bytes_per_s_per_core(TOY) == 4e12


def test_one_byte_dma_runs_cost_64_bytes_each():
    assert pm.dma_cost_bytes(4096, 1) == 4096 * 64


# --- regions and timelines ----------------------------------------------------------------------
def test_regions_overlap_only_when_rows_and_bytes_both_intersect():
    a = reg(1, 0, 64, 0, 512)
    assert pm._overlaps(a, reg(1, 32, 96, 256, 768))
    assert pm._overlaps(reg(1, 32, 96, 256, 768), a)
    assert pm._overlaps(a, reg(1, 10, 20, 10, 20))


@pytest.mark.parametrize("other", [reg(1, 64, 128, 0, 512), reg(1, 0, 64, 512, 1024),   # touching ends
                                   reg(1, 80, 128, 0, 512), reg(1, 0, 64, 600, 1024)])
def test_regions_that_only_touch_or_are_apart_do_not_overlap(other):
    a = reg(1, 0, 64, 0, 512)
    assert not pm._overlaps(a, other)
    assert not pm._overlaps(other, a)


def test_a_region_covers_itself_and_regions_inside_it():
    a = reg(1, 0, 64, 0, 512)
    assert pm._covers(a, a)
    assert pm._covers(a, reg(1, 1, 63, 1, 511))


@pytest.mark.parametrize("other", [reg(1, 0, 65, 0, 512), reg(1, 0, 64, 0, 513)])
def test_a_region_does_not_cover_one_reaching_past_its_end(other):
    assert not pm._covers(reg(1, 0, 64, 0, 512), other)


@pytest.mark.parametrize("other", [reg(1, 3, 64, 8, 512), reg(1, 4, 64, 7, 512)])
def test_a_region_does_not_cover_one_starting_before_it(other):
    assert not pm._covers(reg(1, 4, 64, 8, 512), other)


def timeline(*intervals):
    t = pm._Timeline()
    for s, e in intervals:
        t.book(s, e)
    return t


def test_an_empty_timeline_starts_a_job_when_it_is_ready():
    assert pm._Timeline().slot(2.5, 10.0) == 2.5


def test_a_job_that_fits_before_a_busy_interval_takes_that_gap():
    t = timeline((1.0, 3.0))
    assert t.slot(0.0, 1.0) == 0.0  # ends exactly when the busy interval starts
    assert t.slot(0.0, 0.5) == 0.0


def test_a_job_that_does_not_fit_before_a_busy_interval_waits_for_its_end():
    t = timeline((1.0, 3.0))
    assert t.slot(0.0, 1.5) == 3.0
    assert t.slot(2.0, 0.5) == 3.0  # ready while busy


def test_a_job_takes_the_first_gap_long_enough_for_it():
    t = timeline((1.0, 3.0), (5.0, 6.0), (9.0, 10.0))
    assert t.slot(2.0, 2.0) == 3.0  # the [3, 5) gap fits exactly
    assert t.slot(2.0, 2.5) == 6.0  # too long for [3, 5), fits [6, 9)
    assert t.slot(3.0, 2.5) == 6.0
    assert t.slot(2.0, 5.0) == 10.0  # after the last interval
    assert t.slot(11.0, 1.0) == 11.0


def test_booked_intervals_stay_sorted_and_disjoint():
    t = timeline((5.0, 6.0), (1.0, 2.0), (3.0, 4.0))
    assert (t.starts, t.ends) == ([1.0, 3.0, 5.0], [2.0, 4.0, 6.0])


def test_booking_an_interval_that_touches_the_previous_one_extends_it():
    t = timeline((1.0, 2.0), (5.0, 6.0))
    t.book(2.0, 3.0)
    assert (t.starts, t.ends) == ([1.0, 5.0], [3.0, 6.0])


def test_booking_inside_an_interval_changes_nothing():
    t = timeline((1.0, 4.0))
    t.book(2.0, 3.0)
    assert (t.starts, t.ends) == ([1.0], [4.0])


def test_booking_an_interval_that_reaches_the_next_ones_merges_them():
    t = timeline((1.0, 2.0), (3.0, 4.0), (5.0, 6.0), (8.0, 9.0))
    t.book(2.0, 5.0)  # touches [1, 2), reaches [3, 4) and the start of [5, 6)
    assert (t.starts, t.ends) == ([1.0, 8.0], [6.0, 9.0])
    t.book(0.0, 10.0)
    assert (t.starts, t.ends) == ([0.0], [10.0])


def test_booking_before_an_interval_it_reaches_merges_with_it():
    t = timeline((3.0, 4.0))
    t.book(1.0, 3.0)
    assert (t.starts, t.ends) == ([1.0], [4.0])
    t.book(0.0, 0.5)
    assert (t.starts, t.ends) == ([0.0, 1.0], [0.5, 4.0])


@pytest.mark.parametrize("intervals,length", [([], 0.0), ([(1.0, 2.0)], 1.0), ([(4.0, 6.0), (1.0, 2.0)], 3.0),
                                              ([(1.0, 2.0), (4.0, 6.0), (7.0, 8.0)], 4.0),
                                              ([(1.0, 3.0), (2.0, 5.0)], 4.0), ([(1.0, 5.0), (2.0, 3.0)], 4.0),
                                              ([(1.0, 2.0), (2.0, 3.0), (7.0, 8.0)], 3.0)])
def test_union_length_counts_overlaps_once(intervals, length):
    assert pm.union_length(intervals) == pytest.approx(length)


# --- scheduling: compute engines ----------------------------------------------------------------
def test_an_instruction_takes_its_cycles_over_its_engine_clock():
    ev = pm.schedule([op("tensor", 1000), op("vector", 1000), op("scalar", 1000), op("gpsimd", 1000)], TOY)
    assert spans(ev) == [("tensor", 0, 1 * US), ("vector", 0, 0.5 * US), ("scalar", 0, 0.25 * US),
                         ("gpsimd", 0, 0.125 * US)]


def test_a_single_core_schedule_is_program_zero_unless_told():
    assert {e.program for e in pm.schedule([op("tensor", 1000), op("dma", nbytes=10)], TOY)} == {0}
    assert {e.program for e in pm.schedule([op("tensor", 1000), op("dma", nbytes=10)], TOY, program=3)} == {3}


def test_a_barrier_on_a_single_core_starts_when_its_engine_is_free():
    ev = pm.schedule([op("gpsimd", 8000), barrier(), op("gpsimd", 8), barrier(seq=1)], TOY)
    assert spans(ev) == [("gpsimd", 0, 1 * US), ("gpsimd", 1 * US, 1.1 * US), ("gpsimd", 1.1 * US, 1.101 * US),
                         ("gpsimd", 1.101 * US, 1.201 * US)]


def test_an_engine_runs_its_instructions_in_program_order():
    ev = pm.schedule([op("vector", 2000), op("vector", 2000)], TOY)
    assert spans(ev) == [("vector", 0, 1 * US), ("vector", 1 * US, 2 * US)]


def test_a_read_waits_for_the_write_it_overlaps():
    ev = pm.schedule([op("tensor", 1000, writes=[reg(1)]), op("vector", 2000, reads=[reg(1)])], TOY)
    assert spans(ev)[1] == ("vector", 1 * US, 2 * US)


def test_a_read_of_disjoint_bytes_does_not_wait():
    ev = pm.schedule([op("tensor", 1000, writes=[reg(1, b0=0, b1=512)]),
                      op("vector", 2000, reads=[reg(1, b0=512, b1=1024)])], TOY)
    assert spans(ev)[1] == ("vector", 0, 1 * US)


def test_a_read_of_another_allocation_does_not_wait():
    ev = pm.schedule([op("tensor", 1000, writes=[reg(1)]), op("vector", 2000, reads=[reg(2)])], TOY)
    assert spans(ev)[1] == ("vector", 0, 1 * US)


def test_a_read_waits_for_the_latest_of_several_writes():
    ev = pm.schedule([op("tensor", 3000, writes=[reg(1, 0, 64)]), op("gpsimd", 8000, writes=[reg(1, 64, 128)]),
                      op("vector", 2000, reads=[reg(1)])], TOY)
    assert spans(ev)[2] == ("vector", 3 * US, 4 * US)


def test_a_write_waits_for_an_earlier_read_of_its_bytes():
    ev = pm.schedule([op("tensor", 1000, reads=[reg(1)]), op("vector", 2000, writes=[reg(1)])], TOY)
    assert spans(ev)[1] == ("vector", 1 * US, 2 * US)


def test_a_write_waits_for_an_earlier_write_of_its_bytes():
    ev = pm.schedule([op("tensor", 1000, writes=[reg(1)]), op("vector", 2000, writes=[reg(1)])], TOY)
    assert spans(ev)[1] == ("vector", 1 * US, 2 * US)


def test_a_write_waits_for_the_latest_of_several_reads():
    ev = pm.schedule([op("tensor", 3000, reads=[reg(1, 0, 64)]), op("gpsimd", 8000, reads=[reg(1, 64, 128)]),
                      op("vector", 2000, writes=[reg(1)])], TOY)
    assert spans(ev)[2] == ("vector", 3 * US, 4 * US)


def test_a_partial_write_keeps_the_dependency_on_an_older_write_it_does_not_cover():
    # rows 0-63 written slowly, rows 64-127 quickly; a read of rows 0-63 still waits for the first
    ev = pm.schedule([op("tensor", 4000, writes=[reg(1, 0, 64)]), op("scalar", 4, writes=[reg(1, 64, 128)]),
                      op("vector", 2000, reads=[reg(1, 0, 64)])], TOY)
    assert spans(ev)[2] == ("vector", 4 * US, 5 * US)


def test_a_partial_write_keeps_the_dependency_on_an_older_read_it_does_not_cover():
    ev = pm.schedule([op("tensor", 4000, reads=[reg(1, 0, 64)]), op("scalar", 4, writes=[reg(1, 64, 128)]),
                      op("vector", 2000, writes=[reg(1, 0, 64)])], TOY)
    assert spans(ev)[2] == ("vector", 4 * US, 5 * US)


def test_a_covering_write_becomes_the_dependency_of_later_readers():
    ev = pm.schedule([op("tensor", 1000, writes=[reg(1, 0, 64)]), op("scalar", 8000, writes=[reg(1)]),
                      op("vector", 2000, reads=[reg(1, 0, 64)])], TOY)
    assert spans(ev)[1] == ("scalar", 1 * US, 3 * US)  # WAW on the covered rows
    assert spans(ev)[2] == ("vector", 3 * US, 4 * US)


def test_independent_instructions_on_different_engines_overlap():
    ev = pm.schedule([op("tensor", 1000, writes=[reg(1)]), op("vector", 2000, writes=[reg(2)])], TOY)
    assert [e.start for e in ev] == [0.0, 0.0]


# --- scheduling: DMA --------------------------------------------------------------------------
def test_a_small_dma_is_one_chunk_costing_fixed_plus_bytes_over_queue_bandwidth():
    ev = pm.schedule([op("dma", nbytes=1000, writes=[reg(1)])], TOY)
    assert spans(ev) == [("dma0", 0, 2 * US)]  # 1 us + 1000 B at 1 B/ns
    assert ev[0].nbytes == 1000


def test_a_dma_is_split_into_64k_chunks_over_at_most_the_queue_count():
    ev = pm.schedule([op("dma", nbytes=3 * KB64, writes=[reg(1)])], TOY)
    dur = 1 * US + 1.5 * KB64 * 1e-9  # two queues: two chunks of 1.5 x 64 KiB
    assert spans(ev) == [("dma0", 0, dur), ("dma1", 0, dur)]
    assert [e.nbytes for e in ev] == [int(1.5 * KB64)] * 2


def test_a_dma_below_two_64k_units_is_not_split():
    ev = pm.schedule([op("dma", nbytes=2 * KB64 - 1, writes=[reg(1)])], TOY)
    assert len(ev) == 1 and ev[0].end == pytest.approx(1 * US + (2 * KB64 - 1) * 1e-9)


def test_consecutive_independent_dmas_use_the_idle_queues_in_turn():
    ev = pm.schedule([op("dma", nbytes=1000, writes=[reg(i)]) for i in range(3)], TOY)
    assert spans(ev) == [("dma0", 0, 2 * US), ("dma1", 0, 2 * US), ("dma0", 2 * US, 4 * US)]


def test_a_dma_waiting_for_its_data_does_not_block_a_later_independent_one():
    ev = pm.schedule([op("tensor", 10000, writes=[reg(1)]), op("dma", nbytes=1000, reads=[reg(1)]),
                      op("dma", nbytes=1000, writes=[reg(2)])], TOY)
    assert spans(ev)[1:] == [("dma0", 10 * US, 12 * US), ("dma1", 0, 2 * US)]


def test_a_dma_takes_an_earlier_gap_on_a_busy_queue():
    plat = dataclasses.replace(TOY, dma_queues=1)
    ev = pm.schedule([op("tensor", 10000, writes=[reg(1)]), op("dma", nbytes=1000, reads=[reg(1)]),
                      op("dma", nbytes=1000, writes=[reg(2)])], plat)
    assert spans(ev)[1:] == [("dma0", 10 * US, 12 * US), ("dma0", 0, 2 * US)]


def test_a_dma_prefers_the_queue_free_earliest():
    # queue 0 is busy until 2 us, queue 1 until 3 us; the third transfer goes to queue 0
    ev = pm.schedule([op("dma", nbytes=1000, writes=[reg(1)]), op("dma", nbytes=2000, writes=[reg(2)]),
                      op("dma", nbytes=1000, writes=[reg(3)])], TOY)
    assert spans(ev)[2] == ("dma0", 2 * US, 4 * US)


def test_hbm_bytes_occupy_the_cores_hbm_channel_after_the_fixed_cost():
    # 1 GB/s per core of HBM: 1000 HBM bytes take 1 us on the channel, starting after the fixed
    # cost; a second transfer on the other queue waits for the channel
    plat = dataclasses.replace(TOY, hbm_bandwidth_per_chip=2e9)
    ev = pm.schedule([op("dma", nbytes=1000, hbm_bytes=1000, writes=[reg(1)]),
                      op("dma", nbytes=1000, hbm_bytes=1000, writes=[reg(2)])], plat)
    assert spans(ev) == [("dma0", 0, 2 * US), ("dma1", 0, 3 * US)]


def test_a_dma_bound_by_hbm_ends_when_its_hbm_transfer_ends():
    plat = dataclasses.replace(TOY, hbm_bandwidth_per_chip=2e8)  # 100 MB/s per core
    ev = pm.schedule([op("dma", nbytes=1000, hbm_bytes=1000, writes=[reg(1)])], plat)
    assert spans(ev) == [("dma0", 0, 11 * US)]  # 1 us fixed + 10 us on the channel


def test_a_split_dma_divides_its_hbm_bytes_over_its_chunks():
    plat = dataclasses.replace(TOY, hbm_bandwidth_per_chip=2 * 2 * KB64 * 1e6)  # 2x64 KiB per us per core
    ev = pm.schedule([op("dma", nbytes=4 * KB64, hbm_bytes=4 * KB64, writes=[reg(1)])], plat)
    q = 2 * KB64 * 1e-9  # each chunk: 2 x 64 KiB at 1 B/ns on its queue
    # channel: chunk 0 [1 us, 2 us), chunk 1 [2 us, 3 us); both inside their queue time
    assert spans(ev) == [("dma0", 0, 1 * US + q), ("dma1", 0, 1 * US + q)]
    plat = dataclasses.replace(plat, hbm_bandwidth_per_chip=2 * 2 * KB64 * 1e3)  # 1000 x slower
    ev = pm.schedule([op("dma", nbytes=4 * KB64, hbm_bytes=4 * KB64, writes=[reg(1)])], plat)
    assert [e.end for e in ev] == pytest.approx([1 * US + 1e-3, 1 * US + 2e-3])


def test_an_instruction_reading_a_dma_result_waits_for_its_last_chunk():
    ev = pm.schedule([op("dma", nbytes=3 * KB64, writes=[reg(1)]), op("vector", 2000, reads=[reg(1)])], TOY)
    dur = 1 * US + 1.5 * KB64 * 1e-9
    assert spans(ev)[2] == ("vector", dur, dur + 1 * US)


# --- several cores ------------------------------------------------------------------------------
def barrier(engine="gpsimd", cycles=800.0, seq=0):
    return op(engine, cycles, sync=("core_barrier", seq, None))


def test_one_program_schedules_like_a_single_core():
    prog = [op("tensor", 1000, writes=[reg(1)]), op("vector", 2000, reads=[reg(1)])]
    ev = pm.schedule_programs([prog], TOY)
    assert spans(ev) == spans(pm.schedule(prog, TOY))
    assert {e.program for e in ev} == {0}


def test_a_barrier_starts_on_every_core_when_the_last_core_reaches_it():
    p0 = [op("gpsimd", 8000), barrier(), op("gpsimd", 8)]  # reaches the barrier at 1 us
    p1 = [op("gpsimd", 24000), barrier(), op("gpsimd", 8)]  # at 3 us
    ev = pm.schedule_programs([p0, p1], TOY)
    bar = [e for e in ev if e.instr.sync]
    assert sorted((e.program, e.start, e.end) for e in bar) == [(0, pytest.approx(3 * US), pytest.approx(3.1 * US)),
                                                                (1, pytest.approx(3 * US), pytest.approx(3.1 * US))]
    after = sorted((e.program, e.start) for e in ev if e.instr.cycles == 8)
    assert after == [(0, pytest.approx(3.1 * US)), (1, pytest.approx(3.1 * US))]


def test_a_barrier_waits_for_the_data_it_depends_on():
    p0 = [op("tensor", 2000, writes=[reg(1)]), op("gpsimd", 800, reads=[reg(1)], sync=("core_barrier", 0, None))]
    p1 = [barrier()]
    ev = pm.schedule_programs([p0, p1], TOY)
    assert sorted(e.start for e in ev if e.instr.sync) == [pytest.approx(2 * US)] * 2


def test_each_barrier_meets_its_own_counterpart():
    p0 = [barrier(seq=0), op("gpsimd", 16000), barrier(seq=1)]
    p1 = [barrier(seq=0), barrier(seq=1)]
    ev = pm.schedule_programs([p0, p1], TOY)
    second = [e.start for e in ev if e.instr.sync and e.instr.sync[1] == 1]
    assert second == [pytest.approx(0.1 * US + 2 * US)] * 2


def test_a_cross_core_transfer_occupies_a_dma_queue_of_each_core():
    send = [op("dma", nbytes=1000, sync=("sendrecv", 0, None))]
    ev = pm.schedule_programs([send, list(send)], TOY)
    assert sorted((e.program, e.track, e.start, e.end, e.nbytes) for e in ev) == [
        (0, "dma0", 0.0, pytest.approx(2 * US), 1000), (1, "dma0", 0.0, pytest.approx(2 * US), 1000)]


def test_a_cross_core_transfer_takes_the_queue_free_first():
    # queue 0 busy until 4 us, queue 1 until 2 us; the transfer is ready at 1 us
    p = [op("dma", nbytes=3000, writes=[reg(1)]), op("dma", nbytes=1000, writes=[reg(2)]),
         op("tensor", 1000, writes=[reg(9)]), op("dma", nbytes=1000, reads=[reg(9)], sync=("sendrecv", 0, None))]
    ev = pm.schedule_programs([p, list(p)], TOY)
    sr = [e for e in ev if e.instr.sync and e.program == 0][0]
    assert (sr.track, sr.start, sr.end) == ("dma1", pytest.approx(2 * US), pytest.approx(4 * US))
    # the queue is booked: a later transfer goes to the other queue
    p = p + [op("dma", nbytes=1000, writes=[reg(3)])]
    ev = pm.schedule_programs([p, list(p)], TOY)
    last = [e for e in ev if e.program == 0][-1]
    assert (last.track, last.start) == ("dma0", pytest.approx(4 * US))


def test_a_cross_core_transfer_needs_a_gap_as_long_as_itself():
    # both queues carry a transfer from 1 to 3 us (waiting for the tensor op); the 2-us
    # cross-core transfer, ready at 0, does not fit before them and starts at 3 us
    p = [op("tensor", 1000, writes=[reg(9)]),
         op("dma", nbytes=1000, reads=[reg(9)], writes=[reg(1)]),
         op("dma", nbytes=1000, reads=[reg(9)], writes=[reg(2)]),
         op("dma", nbytes=1000, sync=("sendrecv", 0, None))]
    ev = pm.schedule_programs([p, list(p)], TOY)
    for prog in (0, 1):
        sr = [e for e in ev if e.instr.sync and e.program == prog][0]
        assert (sr.start, sr.end) == (pytest.approx(3 * US), pytest.approx(5 * US))
        busy = [(e.start, e.end) for e in ev if e.program == prog and e.track == sr.track and e is not sr]
        assert all(end <= sr.start or start >= sr.end for start, end in busy)


# --- the summary -----------------------------------------------------------------------------
def test_latency_is_the_end_of_the_last_instruction():
    r = pm.analyze([[op("tensor", 1000, writes=[reg(1)]), op("vector", 2000, reads=[reg(1)])]], TOY)
    assert r.latency_us == pytest.approx(2.0)
    assert r.instructions == 2 and r.num_programs == 1
    assert r.sbuf_peak_bytes == 0 and r.outputs is None


def test_the_sbuf_peak_and_outputs_are_passed_through():
    r = pm.analyze([[op("vector", 64)]], TOY, outputs="out", sbuf_peak=4096)
    assert (r.sbuf_peak_bytes, r.outputs) == (4096, "out")


def test_an_empty_program_has_zero_latency_and_mfu():
    r = pm.analyze([[]], TOY)
    assert (r.latency_us, r.mfu, r.flops, r.dma_bytes, r.matmul_dtype) == (0.0, 0.0, 0.0, 0, "")


def test_engine_busy_time_is_the_sum_of_its_instructions_per_core():
    progs = [[op("vector", 2000), op("vector", 4000), op("tensor", 500)], [op("vector", 2000)]]
    r = pm.analyze(progs, TOY)
    assert r.engine_busy_us["vector"] == pytest.approx((1 + 2 + 1) / 2)
    assert r.engine_busy_us["tensor"] == pytest.approx(0.5 / 2)
    assert r.engine_busy_us["scalar"] == 0.0 and r.engine_busy_us["gpsimd"] == 0.0
    assert r.num_programs == 2 and r.instructions == 4


def test_dma_busy_time_counts_overlapping_queues_once_and_averages_per_queue():
    # two chunks of 2 us each in parallel on the two queues: busy 2 us, per-queue mean 2 us
    r = pm.analyze([[op("dma", nbytes=2 * KB64 + 2000, writes=[reg(1)])]], TOY)
    per_chunk = 1 + (KB64 + 1000) * 1e-3
    assert r.engine_busy_us["dma"] == pytest.approx(per_chunk)
    assert r.engine_busy_us["dma_queue_avg"] == pytest.approx(per_chunk)
    assert r.dma_bytes == 2 * KB64 + 2000
    # one 2 us transfer: busy 2 us, but the two queues' mean is 1 us
    r = pm.analyze([[op("dma", nbytes=1000, writes=[reg(1)])]], TOY)
    assert (r.engine_busy_us["dma"], r.engine_busy_us["dma_queue_avg"]) == (pytest.approx(2.0), pytest.approx(1.0))


def test_dma_busy_time_of_two_cores_is_their_mean():
    p = [op("dma", nbytes=1000, writes=[reg(1)])]
    r = pm.analyze([p, [op("dma", nbytes=3000, writes=[reg(1)])]], TOY)
    assert r.engine_busy_us["dma"] == pytest.approx((2 + 4) / 2)  # not the overlap of the two cores
    assert r.engine_busy_us["dma_queue_avg"] == pytest.approx((2 + 4) / 4)
    assert r.dma_bytes == 4000


def test_mfu_is_flops_over_latency_times_peak_of_the_main_matmul_dtype_times_cores():
    mm = op("tensor", 1000, flops=500.0, dtype="bfloat16")  # 1 us; peak 1e9 FLOP/s
    r = pm.analyze([[mm]], TOY)
    assert (r.flops, r.matmul_dtype) == (500.0, "bfloat16")
    assert r.mfu == pytest.approx(500 / (1e-6 * 1e9))
    r = pm.analyze([[mm], [mm]], TOY)
    assert r.mfu == pytest.approx(1000 / (1e-6 * 1e9 * 2))


def test_the_matmul_dtype_is_the_one_with_most_flops():
    ops = [op("tensor", 1000, flops=100.0, dtype="float32"), op("tensor", 1000, flops=300.0, dtype="bfloat16"),
           op("tensor", 1000, flops=250.0, dtype="float32")]
    r = pm.analyze([ops], TOY)
    assert (r.matmul_dtype, r.flops) == ("float32", 650.0)
    assert r.mfu == pytest.approx(650 / (3e-6 * 5e8))


def test_the_matmul_dtype_is_chosen_by_flops_not_by_name():
    ops = [op("tensor", 1000, flops=100.0, dtype="float32"), op("tensor", 1000, flops=300.0, dtype="bfloat16")]
    assert pm.analyze([ops], TOY).matmul_dtype == "bfloat16"


def test_flops_without_a_matmul_dtype_give_no_mfu():
    r = pm.analyze([[op("tensor", 1000, flops=100.0)]], TOY)
    assert (r.flops, r.mfu) == (100.0, 0.0)


def test_flops_in_zero_time_give_no_mfu_instead_of_dividing_by_zero():
    r = pm.analyze([[op("tensor", 0, flops=100.0, dtype="bfloat16")]], TOY)
    assert (r.latency_us, r.mfu) == (0.0, 0.0)


def test_summary_formats_each_figure_in_its_unit():
    r = pm.BenchmarkResult("trn2", 12.345678, {"tensor": 3.26, "dma": 0.04}, 0.5, 1e9, 1_005_001, 7, 1, "bfloat16")
    assert r.summary() == ("trn2: latency 12.35 us, MFU 50.0% (bfloat16), 7 instructions, 1.01 MB DMA; "
                           "busy us: tensor 3.3, dma 0.0")


def test_a_saved_trace_names_the_platform_of_each_core(tmp_path):
    import json
    r = pm.analyze([[op("tensor", 1000)], [op("tensor", 1000)]], TOY)
    data = json.load(open(r.save_trace(str(tmp_path / "t.json"))))
    names = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"toy NeuronCore (program 0)", "toy NeuronCore (program 1)"}


def test_summary_reports_latency_mfu_dtype_counts_bytes_and_busy_times():
    # the DMA: two chunks of 750 kB on the two queues, 1 us + 750 us each, in parallel;
    # MFU 500 FLOP / (751 us x 1e9 FLOP/s) = 0.067 %
    r = pm.analyze([[op("tensor", 1000, flops=500.0, dtype="bfloat16"), op("dma", nbytes=1_500_000)]], TOY)
    s = r.summary()
    assert s.startswith("toy: latency 751.00 us, MFU 0.1% (bfloat16), 2 instructions, 1.50 MB DMA; busy us: ")
    assert s.endswith("busy us: tensor 1.0, vector 0.0, scalar 0.0, gpsimd 0.0, dma 751.0, dma_queue_avg 751.0")
    assert "(no matmul)" in pm.analyze([[op("vector", 64)]], TOY).summary()


def test_a_cross_core_transfer_takes_a_gap_before_a_later_busy_interval():
    # queue 0: free until 10 us; queue 1: busy [0, 2 us); the transfer is ready at 1 us and
    # fits queue 0's gap
    p = [op("tensor", 10000, writes=[reg(1)]), op("dma", nbytes=1000, reads=[reg(1)]),
         op("dma", nbytes=1000, writes=[reg(2)]), op("vector", 2000, writes=[reg(9)]),
         op("dma", nbytes=1000, reads=[reg(9)], sync=("sendrecv", 0, None))]
    ev = pm.schedule_programs([p, list(p)], TOY)
    sr = [e for e in ev if e.instr.sync and e.program == 0][0]
    assert (sr.track, sr.start) == ("dma0", pytest.approx(1 * US))


def test_with_every_queue_busy_a_dma_goes_to_the_next_queue_in_turn_that_frees_first():
    plat = dataclasses.replace(TOY, dma_queues=3)
    # queue 0 busy until 10 us, queues 1 and 2 until 2 us; the fourth transfer ties between
    # queues 1 and 2 and takes queue 1, the next in turn after queue 0
    ev = pm.schedule([op("dma", nbytes=9000, writes=[reg(1)]), op("dma", nbytes=1000, writes=[reg(2)]),
                      op("dma", nbytes=1000, writes=[reg(3)]), op("dma", nbytes=1000, writes=[reg(4)])], plat)
    assert [e.track for e in ev] == ["dma0", "dma1", "dma2", "dma1"]
    assert ev[3].start == pytest.approx(2 * US)
