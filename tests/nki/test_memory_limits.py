"""On-chip capacity rules at their exact boundaries: SBUF bytes per partition and PSUM banks."""

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki.errors import NKIMemoryError
from torchneuron.platform import get_platform

DUMMY = np.zeros(1, np.float32)


@nki.jit
def _sbuf_tiles(x, widths):
    tiles = [nl.ndarray((128, w), nl.float32, buffer=nl.sbuf) for w in widths]
    for t in tiles:  # all live at once
        nisa.memset(t, 0.0)


@pytest.mark.parametrize("plat", ["trn2", "trn3"])
def test_sbuf_tiles_filling_the_usable_capacity_exactly_fit(plat):
    cap = get_platform(plat).sbuf_usable_bytes_per_partition
    assert cap % 8 == 0
    nki.simulate(_sbuf_tiles, platform=plat)(DUMMY, (cap // 4,))
    nki.simulate(_sbuf_tiles, platform=plat)(DUMMY, (cap // 8, cap // 8))


@pytest.mark.parametrize("plat", ["trn2", "trn3"])
def test_one_element_past_the_sbuf_capacity_is_an_error(plat):
    cap = get_platform(plat).sbuf_usable_bytes_per_partition
    with pytest.raises(NKIMemoryError, match="SBUF capacity exceeded"):
        nki.simulate(_sbuf_tiles, platform=plat)(DUMMY, (cap // 4 + 1,))
    with pytest.raises(NKIMemoryError, match="SBUF capacity exceeded"):
        nki.simulate(_sbuf_tiles, platform=plat)(DUMMY, (cap // 8, cap // 8 + 1))


@nki.jit
def _psum_tiles(x, count, width):
    tiles = [nl.ndarray((128, width), nl.float32, buffer=nl.psum) for _ in range(count)]
    for t in tiles:
        nisa.memset(t, 0.0)


def test_a_psum_tile_may_fill_exactly_one_bank():
    p = get_platform("trn2")
    bank = p.psum_bytes_per_partition // p.psum_banks
    nki.simulate(_psum_tiles)(DUMMY, 1, bank // 4)
    with pytest.raises(NKIMemoryError, match="straddle PSUM banks"):
        nki.simulate(_psum_tiles)(DUMMY, 1, bank // 4 + 1)


def test_every_psum_bank_may_hold_a_live_tile_but_no_more():
    banks = get_platform("trn2").psum_banks
    nki.simulate(_psum_tiles)(DUMMY, banks, 16)
    with pytest.raises(NKIMemoryError, match="PSUM is full"):
        nki.simulate(_psum_tiles)(DUMMY, banks + 1, 16)
