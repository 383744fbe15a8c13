"""Memory placement (nl.ndarray(..., address=)) and capacity accounting by tile lifetime."""

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import errors
from torchneuron.nki.simulator import run

X = np.zeros((1, 1), np.float32)


def line_of(marker: str) -> str:
    with open(__file__) as f:
        for i, text in enumerate(f, 1):
            if marker in text and "line_of(" not in text:
                return f"{__file__}:{i}"
    raise AssertionError(marker)


@nki.jit
def _same_address(x):
    a = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 4096))
    b = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 4096))  # same bytes
    c = nl.ndarray((128, 32), nl.bfloat16, buffer=nl.sbuf, address=(0, 4096))  # same, as bf16
    nisa.dma_copy(dst=a, src=x)
    out = nl.ndarray((2, 128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[0], src=b)  # reads what was written through a
    d = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(d[:, :32], c)  # the low bf16 halves of a's first 16 floats' bytes
    nisa.memset(d[:, 32:], 0.0)
    nisa.dma_copy(dst=out[1], src=d)
    return out


def test_tiles_placed_at_the_same_address_share_storage():
    x = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    out = _same_address(x)
    np.testing.assert_array_equal(out[0], x)
    import ml_dtypes
    np.testing.assert_array_equal(out[1][:, :32], x[:, :16].view(ml_dtypes.bfloat16).astype(np.float32))


@nki.jit
def _partition_offset(x):
    a = nl.ndarray((32, 64), nl.float32, buffer=nl.sbuf, address=(32, 0))  # partitions 32..63
    nisa.dma_copy(dst=a, src=x)
    b = nl.ndarray((32, 64), nl.float32, buffer=nl.sbuf, address=(0, 256))
    nisa.tensor_copy(b, a)  # starts at partition 32: allowed for 32-partition accesses
    out = nl.ndarray((32, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=b)
    return out


def test_a_placed_tiles_partition_offset_is_its_start_partition():
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    np.testing.assert_array_equal(_partition_offset(x), x)


@nki.jit
def _bad_start(x):
    a = nl.ndarray((64, 64), nl.float32, buffer=nl.sbuf, address=(32, 0))
    nisa.memset(a, 0.0)  # <bad-start> 64 partitions must start at 0 or 64


def test_start_partition_rule_applies_to_placed_tiles():
    with pytest.raises(errors.NKIPartitionError, match="starts at partition 32"):
        _bad_start(X)


@nki.jit
def _clobber(x):
    a = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 0))  # <old-tile>
    nisa.memset(a, 1.0)
    b = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 1024))  # <new-tile>
    nisa.memset(b, 2.0)
    out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)  # <stale-use> a's bytes 1024.. now belong to b


def test_using_a_tile_whose_bytes_were_re_placed_is_an_error_naming_both():
    with pytest.raises(errors.NKIMemoryError) as e:
        _clobber(X)
    msg = str(e.value)
    assert e.value.rule == "placement"
    assert line_of("<stale-use>") in msg and line_of("<old-tile>") in msg
    assert line_of("<new-tile>") in msg and "(0, 1024)" in msg


@nki.jit
def _reuse_after_last_use(x):
    a = nl.ndarray((128, 512), nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=a, src=x)
    out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)  # last use of a
    b = nl.ndarray((128, 256), nl.float32, buffer=nl.sbuf, address=(0, 512))  # overlaps a: fine
    nisa.memset(b, 0.0)
    return out


def test_overlapping_a_tile_after_its_last_use_is_fine():
    x = np.ones((128, 512), np.float32)
    np.testing.assert_array_equal(_reuse_after_last_use(x), x)


@nki.jit
def _placed_out_of_range(x):
    nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 212_984 - 100))


@nki.jit
def _placed_partitions(x):
    nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(32, 0))


def test_placements_outside_sbuf_are_errors():
    with pytest.raises(errors.NKIMemoryError, match="212984 usable bytes"):
        _placed_out_of_range(X)
    with pytest.raises(errors.NKIPartitionError, match="partitions 32..159"):
        _placed_partitions(X)


@nki.jit
def _placed_plus_auto(x, auto_kib):
    p = nl.ndarray((128, 25_000), nl.float32, buffer=nl.sbuf, address=(0, 100_000))  # to 200000
    nisa.memset(p, 0.0)
    a = nl.ndarray((128, auto_kib * 256), nl.float32, buffer=nl.sbuf)  # <auto-tile>
    nisa.memset(a, 0.0)
    nisa.tensor_copy(p[:, :64], a[:, :64])  # p still live


def test_capacity_counts_auto_tiles_above_the_highest_live_placed_byte():
    run(_placed_plus_auto.fn, (X, 12), {})  # 200000 + 12 KiB = 212288 <= 212984
    with pytest.raises(errors.NKIMemoryError, match="200000 up to the highest placed byte") as e:
        run(_placed_plus_auto.fn, (X, 16), {})
    assert line_of("<auto-tile>") in str(e.value)


@nki.jit
def _psum_rotation(a, b):
    """AWS's rotating PSUM buffers: each group's tile is a new allocation at bank 0, so its
    first matmul starts a new accumulation even though bank 0 held the previous group's."""
    out = nl.ndarray((2, 64, 128), nl.float32, buffer=nl.shared_hbm)
    s = nl.load(a)
    m = nl.load(b)
    tiles = [nl.ndarray((64, 128), nl.float32, buffer=nl.psum, address=(0, 0)) for _ in range(2)]
    for g in range(2):
        nisa.nc_matmul(tiles[g], s[:, g * 64:(g + 1) * 64], m)  # accumulate=None
        r = nl.ndarray((64, 128), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(r, tiles[g])
        nl.store(out[g], r)
    return out


def test_psum_accumulation_groups_belong_to_allocations_not_addresses():
    rng = np.random.default_rng(2)
    a = rng.standard_normal((32, 128)).astype(np.float32)
    b = rng.standard_normal((32, 128)).astype(np.float32)
    out = _psum_rotation(a, b)
    for g in range(2):
        np.testing.assert_allclose(out[g], a[:, g * 64:(g + 1) * 64].T @ b, rtol=1e-5, atol=1e-5)


@nki.jit
def _psum_placed_overlap(x):
    t = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 2048 * i))
         for i in range(8)]
    for p in t:
        nisa.memset(p, 0.0)
    extra = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)  # <ninth-bank>
    nisa.memset(extra, 0.0)
    for p in t:
        nisa.tensor_scalar(p, p, nl.add, 1.0)


def test_placed_psum_banks_count_towards_the_eight():
    with pytest.raises(errors.NKIMemoryError, match="9 banks live") as e:
        _psum_placed_overlap(X)
    assert line_of("<ninth-bank>") in str(e.value)


@nki.jit
def _war_alias(x):
    a = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf, address=(0, 0))
    nisa.dma_copy(dst=a, src=x)
    r = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf)
    nisa.activation(r, nl.exp, a)  # reads a (ScalarE)
    b = nl.ndarray((128, 2048), nl.float32, buffer=nl.sbuf, address=(0, 0))  # same bytes
    nisa.memset(b, 0.0)  # VectorE write: must wait for the read of a


def test_performance_model_orders_writes_to_a_placed_alias_after_reads_of_the_old_tile():
    r = nki.benchmark(_war_alias)(np.zeros((128, 2048), np.float32))
    ev = {e.instr.op: e for e in r.events if e.instr.op in ("activation", "memset")}
    assert ev["memset"].start >= ev["activation"].end
