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


def test_a_psum_tile_may_fill_exactly_the_whole_psum_partition():
    # AWS allocates multi-bank PSUM tiles (e.g. for nc_matmul_mx); only TensorE output is
    # limited to one bank (next test)
    p = get_platform("trn2")
    nki.simulate(_psum_tiles)(DUMMY, 1, p.psum_bytes_per_partition // 4)
    with pytest.raises(NKIMemoryError, match="PSUM tile .* needs 16388 bytes per partition"):
        nki.simulate(_psum_tiles)(DUMMY, 1, p.psum_bytes_per_partition // 4 + 1)


@nki.jit
def _matmul_into(x, width, lo):
    acc = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)
    a = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
    b = nl.ndarray((128, width), nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(a, 0.0)
    nisa.memset(b, 0.0)
    nisa.nc_matmul(acc[:, lo:lo + width], a, b)


def test_a_matmul_output_may_fill_exactly_one_psum_bank():
    bank_fp32 = get_platform("trn2").psum_bytes_per_partition // get_platform("trn2").psum_banks // 4
    nki.simulate(_matmul_into)(DUMMY, bank_fp32, 0)
    nki.simulate(_matmul_into)(DUMMY, bank_fp32, bank_fp32)  # the second bank, whole
    with pytest.raises(NKIMemoryError, match="crossing a 2048-byte bank boundary"):
        nki.simulate(_matmul_into)(DUMMY, bank_fp32, 1)


def test_every_psum_bank_may_hold_a_live_tile_but_no_more():
    banks = get_platform("trn2").psum_banks
    nki.simulate(_psum_tiles)(DUMMY, banks, 16)
    with pytest.raises(NKIMemoryError, match="PSUM is full"):
        nki.simulate(_psum_tiles)(DUMMY, banks + 1, 16)
