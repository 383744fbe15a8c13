"""The cost and capacity helpers of ``torchneuron/nki/isa.py``: contiguous DMA runs, the bytes a
DMA moves across HBM per direction, and the one-PSUM-bank rule of TensorE outputs (2 KiB per
partition per bank: 16 KiB of PSUM in 8 banks, /work/shared/reference/trainium-hardware.md).
"""

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import errors
from torchneuron.nki.isa import _run_bytes

DUMMY = np.zeros(1, np.float32)


# --- contiguous runs ----------------------------------------------------------------------------
def test_a_contiguous_array_is_one_run_of_all_its_bytes():
    assert _run_bytes(np.zeros((4, 8), np.float32)) == 4 * 8 * 4


def test_a_column_slice_runs_for_the_slice_width():
    assert _run_bytes(np.zeros((4, 8), np.float32)[:, :3]) == 3 * 4


def test_a_strided_innermost_dimension_is_runs_of_one_element():
    assert _run_bytes(np.zeros((4, 8), np.float16)[:, ::2]) == 2


def test_unit_dimensions_do_not_break_a_run():
    assert _run_bytes(np.zeros((4, 1, 8, 1), np.float32)) == 4 * 8 * 4
    assert _run_bytes(np.zeros((4, 8, 1), np.float32)[:, :5]) == 5 * 4


def test_a_run_stops_at_the_first_dimension_that_does_not_continue_it():
    a = np.zeros((2, 3, 4, 8), np.float32)[:, :, :2, :]  # rows of 8 contiguous, then a gap
    assert _run_bytes(a) == 2 * 8 * 4


# --- bytes crossing HBM ---------------------------------------------------------------------------
@nki.jit
def _load(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)


@nki.jit
def _store(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.memset(t, 0.0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def _hbm_to_hbm(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    return out


@nki.jit
def _sbuf_to_sbuf(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.memset(t, 0.0)
    u = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=u, src=t)


def _dma(kernel, x):
    r = nki.benchmark(kernel, platform="trn2")(x)
    return [e.instr for e in r.events if e.instr.op == "dma_copy"][0]


X = np.zeros((128, 64), np.float32)  # 32 KiB


@pytest.mark.parametrize("kernel,hbm_bytes", [(_load, X.nbytes), (_store, X.nbytes),
                                              (_hbm_to_hbm, 2 * X.nbytes), (_sbuf_to_sbuf, 0)])
def test_a_dma_crosses_hbm_once_per_hbm_side(kernel, hbm_bytes):
    ins = _dma(kernel, X)
    assert ins.nbytes == X.nbytes
    assert ins.hbm_bytes == hbm_bytes


@nki.jit
def _load_columns(x, cols):
    t = nl.ndarray((128, cols), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[:, 0:cols])


def test_the_shorter_run_of_either_side_sets_the_descriptor_cost():
    # source rows of 8 fp32 (32 B) from a [128, 64] array: 128 runs costing 64 B each
    r = nki.benchmark(_load_columns, platform="trn2")(X, 8)
    ins = [e.instr for e in r.events if e.instr.op == "dma_copy"][0]
    assert ins.nbytes == 128 * 64
    assert ins.hbm_bytes == 128 * 8 * 4


# --- one PSUM bank per TensorE output -------------------------------------------------------------
@nki.jit
def _matmul_into(x, lo, cols):
    s = nl.zeros((128, 128), nl.bfloat16)
    m = nl.zeros((128, cols), nl.bfloat16)
    p = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)  # banks 0 and 1
    nisa.nc_matmul(p[:, lo:lo + cols], s, m)


@pytest.mark.parametrize("lo,cols", [(0, 512), (512, 512), (256, 256), (0, 1), (511, 1), (512, 1)])
def test_an_output_inside_one_bank_is_allowed(lo, cols):
    nki.simulate(_matmul_into)(DUMMY, lo, cols)


@pytest.mark.parametrize("lo,cols", [(1, 512), (511, 2), (256, 512)])
def test_an_output_crossing_a_bank_boundary_names_its_bytes_and_the_bank(lo, cols):
    with pytest.raises(errors.NKIMemoryError) as e:
        nki.simulate(_matmul_into)(DUMMY, lo, cols)
    assert e.value.rule == "psum-bank"
    assert e.value.detail == (f"nc_matmul: `dst` psum[128, {cols}] float32 covers bytes {4 * lo}..{4 * (lo + cols) - 1} "
                              "of each PSUM partition, crossing a 2048-byte bank boundary; TensorE writes one "
                              "bank per instruction")
    assert e.value.fix == "keep each matmul output within one bank (512 fp32 per partition, bank-aligned)"


@nki.jit
def _matmul_into_placed(x, byte):
    s = nl.zeros((128, 128), nl.bfloat16)
    m = nl.zeros((128, 256), nl.bfloat16)
    p = nl.ndarray((128, 256), nl.float32, buffer=nl.psum, address=(0, byte))
    nisa.nc_matmul(p, s, m)


def test_a_placed_output_is_checked_at_its_address():
    nki.simulate(_matmul_into_placed)(DUMMY, 1024)  # bytes 1024..2047: bank 0
    with pytest.raises(errors.NKIMemoryError, match="covers bytes 1536..2559"):
        nki.simulate(_matmul_into_placed)(DUMMY, 1536)


# --- source location -----------------------------------------------------------------------------
def test_an_instruction_records_the_kernel_line_that_issued_it():
    import inspect

    lines, first = inspect.getsourcelines(_load)
    dma_line = first + next(i for i, text in enumerate(lines) if "dma_copy" in text)
    assert _dma(_load, X).loc == (__file__, dma_line)
