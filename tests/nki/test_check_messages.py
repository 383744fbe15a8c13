"""Each argument check of ``torchneuron/nki/checks.py``: the error class, the rule it names, the
message (instruction, argument, tile description) and the fix, one rule per test.

The project's rule for bad input is "a clear exception naming the problem and the fix"
(docs/nki.md, *Errors*): these tests pin what each message must name, at the boundaries of the
hardware rules of /work/shared/reference/nki.md (start partition 0/32/64/96 by access size,
at most 128 partitions and 4 free access dimensions, compute engines on SBUF/PSUM only).
"""

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import errors

X = np.zeros((128, 64), np.float32)


def error_of(kernel, *args, platform=None) -> errors.NKIError:
    with pytest.raises(errors.NKIError) as e:
        nki.simulate(kernel, platform=platform)(*(args or (X,)))
    return e.value


def run(kernel, *args):
    return nki.simulate(kernel)(*(args or (X,)))


# --- tensor arguments ---------------------------------------------------------------------------
@nki.jit
def _number_as_src(x):
    r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(r, 3.0)


def test_a_number_where_a_tile_is_needed_names_the_argument_and_its_type():
    e = error_of(_number_as_src)
    assert isinstance(e, errors.NKIArgumentError)
    assert e.detail == "tensor_copy: `src` must be a tensor (nl.ndarray or a slice of one), got float"
    assert e.fix == "pass a tile for `src`"


@nki.jit
def _indirect_compute(x):
    it = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.memset(it, 0)
    t = nl.ndarray((4, 8), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.ap([[8, 4], [1, 8]], offset=0, scalar_offset=it, indirect_dim=0))
    src = t.ap([[8, 4], [1, 8]], offset=0, scalar_offset=it, indirect_dim=0)
    r = nl.ndarray((4, 8), x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(r, src)


def test_an_indirect_access_pattern_is_only_for_dma_instructions():
    e = error_of(_indirect_compute, np.zeros((8, 8), np.float32))
    assert isinstance(e, errors.NKIArgumentError)
    assert e.detail == ("tensor_copy: `src` has an indirect access pattern, which only DMA instructions "
                        "support")
    assert e.fix == "gather with nisa.dma_copy first"


@nki.jit
def _clobbered(x):
    a = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 4096))
    nisa.memset(a, 1.0)
    b = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf, address=(0, 4096 + 128))  # overlaps a
    nisa.memset(b, 2.0)
    r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(r, a)


def test_using_a_tile_after_an_overlapping_placement_names_both_placements():
    e = error_of(_clobbered)
    assert isinstance(e, errors.NKIMemoryError) and e.rule == "placement"
    assert e.detail.startswith("tensor_copy: `src` sbuf[128, 64] float32 placed at address (0, 4096) (allocated at ")
    assert "is used after sbuf[128, 64] float32 was placed at (0, 4224) (at " in e.detail
    assert e.detail.endswith("overlapping its bytes; tiles share storage only when placed at the same address")
    assert e.fix == ("give live tiles disjoint address ranges, or place the new tile at exactly the old "
                     "tile's address to reuse its storage")


# --- buffers ------------------------------------------------------------------------------------
@nki.jit
def _compute_on_hbm(x):
    r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(r, x)


def test_compute_engines_reading_hbm_name_the_buffer_rule_and_the_load():
    e = error_of(_compute_on_hbm)
    assert isinstance(e, errors.NKIBufferError) and e.rule == "buffer-kind"
    assert e.detail.startswith("tensor_copy: `src` is hbm[128, 64] float32 in HBM but the ")
    assert e.detail.endswith(" engine only access SBUF/PSUM")
    assert e.fix == "load it into SBUF first with nisa.dma_copy / nl.load"


@nki.jit
def _gpsimd_psum(x):
    p = nl.ndarray((128, 64), nl.float32, buffer=nl.psum)
    nisa.iota(p, [[1, 64]])


def test_an_engine_without_psum_access_names_psum_and_the_copy_fix():
    e = error_of(_gpsimd_psum)
    assert isinstance(e, errors.NKIBufferError) and e.rule == "buffer-kind"
    assert e.detail == "iota: `dst` is psum[128, 64] float32 in PSUM, which the GpSimd engine cannot access"
    assert e.fix == "copy it to SBUF with nisa.tensor_copy (Vector/Scalar engine) first"


@nki.jit
def _matmul_into_sbuf(x):
    a = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(a, 0.0)
    d = nl.ndarray((128, 128), nl.float32, buffer=nl.sbuf)
    nisa.nc_matmul(d, a, a)


def test_a_result_that_must_be_in_psum_names_the_psum_allocation_fix():
    e = error_of(_matmul_into_sbuf)
    assert isinstance(e, errors.NKIBufferError) and e.rule == "buffer-kind"
    assert e.detail == "nc_matmul: `dst` is sbuf[128, 128] float32 in SBUF but must be in PSUM"
    assert e.fix == "allocate it with buffer=nl.psum"


# --- partitions ---------------------------------------------------------------------------------
def _copy_rows(start, size):
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(r[start:start + size, :], t[start:start + size, :])
    return k


@pytest.mark.parametrize("start,size,allowed", [(32, 65, "0"), (63, 65, "0"), (32, 33, "0 or 64"),
                                                (32, 64, "0 or 64"), (16, 32, "0, 32, 64 or 96"),
                                                (1, 1, "0, 32, 64 or 96")])
def test_the_start_partition_rule_names_the_allowed_starts_for_the_access_size(start, size, allowed):
    e = error_of(_copy_rows(start, size))
    assert isinstance(e, errors.NKIPartitionError) and e.rule == "start-partition"
    assert e.detail == (f"tensor_copy: `dst` (sbuf[{size}, 64] float32) starts at partition {start}; an access "
                        f"of {size} partitions must start at partition {allowed}")
    assert e.fix == "align the partition slice (or move the data with a DMA first)"


@pytest.mark.parametrize("start,size", [(0, 128), (0, 65), (64, 64), (64, 33), (0, 33), (96, 32), (32, 32),
                                        (64, 1), (96, 1)])
def test_accesses_at_an_allowed_start_partition_pass(start, size):
    run(_copy_rows(start, size))


# --- free access dimensions ---------------------------------------------------------------------
def _copy_view(shape, index):
    @nki.jit
    def k(x):
        t = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 1.0)
        r = nl.ndarray(shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(r[index], t[index])
    return k


S = slice(None)
E = slice(0, 3, 2)  # every other element: does not merge with its neighbours


def test_five_free_dimensions_that_do_not_merge_are_rejected_naming_the_count():
    e = error_of(_copy_view((4, 2, 3, 2, 3, 2), (S, S, E, S, E, S)))
    assert isinstance(e, errors.NKIShapeError) and e.rule == "access-pattern"
    assert e.detail == ("tensor_copy: `dst` sbuf[4, 2, 2, 2, 2, 2] float32 needs a 5-D free access pattern; "
                        "instructions address at most 4 free dimensions")
    assert e.fix == "reshape the tile so that contiguous dimensions merge, or split the instruction"


def test_four_free_dimensions_that_do_not_merge_pass():
    # free dims (3, 3, 2, 2, 3) with strides (81, 27, 18, 6, 1): the first two merge, 4 remain
    run(_copy_view((4, 3, 3, 3, 3, 3), (S, S, S, E, E, S)))


def test_five_free_dimensions_of_which_two_merge_pass():
    run(_copy_view((4, 2, 3, 2, 3, 2), (S, S, S, S, E, S)))


def test_unit_dimensions_do_not_count_as_free_dimensions():
    run(_copy_view((4, 1, 3, 1, 3, 1, 3, 1, 3), (S, S, E, S, E, S, E, S, E)))


def test_six_free_dimensions_with_unit_dimensions_between_are_still_rejected():
    e = error_of(_copy_view((4, 3, 1, 3, 1, 3, 1, 3, 3), (S, E, S, E, S, E, S, E, E)))
    assert "needs a 5-D free access pattern" in e.detail


# --- shapes -------------------------------------------------------------------------------------
def _copy_between(src_shape, dst_shape):
    """A kernel that copies an SBUF tile of `src_shape` into one of `dst_shape`."""
    @nki.jit
    def k(x):
        a = nl.ndarray(src_shape, nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 1.0)
        r = nl.ndarray(dst_shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(r, a)
    return k


def test_different_partition_sizes_name_both_tiles():
    e = error_of(_copy_between((64, 64), (128, 32)))
    assert isinstance(e, errors.NKIShapeError)
    assert e.detail == ("tensor_copy: `dst` sbuf[128, 32] float32 and `src` sbuf[64, 64] float32 have different "
                        "partition dimensions")
    assert e.fix == "use tiles with the same partition size"


def test_different_free_sizes_name_both_element_counts():
    e = error_of(_copy_between((128, 64), (128, 2, 16)))
    assert isinstance(e, errors.NKIShapeError)
    assert e.detail == ("tensor_copy: `dst` sbuf[128, 2, 16] float32 and `src` sbuf[128, 64] float32 have "
                        "different numbers of elements per partition (32 vs 64)")
    assert e.fix == "slice the tiles to matching shapes"


def test_tiles_of_the_same_element_count_in_other_shapes_pass():
    run(_copy_between((128, 64), (128, 4, 16)))


# --- per-partition scalars ----------------------------------------------------------------------
def _scalar_kernel(make_operand):
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 3.0)
        r = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(r, a, nl.add, make_operand())
        out = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out
    return k


def _tile(rows, cols, value=2.0):
    def make():
        t = nl.ndarray((rows, cols), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, value)
        return t
    return make


@pytest.mark.parametrize("rows,cols", [(128, 2), (64, 1)])
def test_a_per_partition_operand_must_be_one_value_per_partition(rows, cols):
    e = error_of(_scalar_kernel(_tile(rows, cols)))
    assert isinstance(e, errors.NKIShapeError)
    assert e.detail == (f"tensor_scalar: `operand0` sbuf[{rows}, {cols}] float32 must be a scalar or a "
                        "[128, 1] tile (one value per partition)")
    assert e.fix == "slice it to shape (128, 1)"


def test_a_128_by_1_tile_is_a_per_partition_operand():
    np.testing.assert_array_equal(run(_scalar_kernel(_tile(128, 1, 2.0))), np.full((128, 8), 5.0, np.float32))


@pytest.mark.parametrize("value", [2, 2.0, True, np.float32(2.0), np.int64(2)])
def test_python_and_numpy_scalars_are_operands(value):
    np.testing.assert_array_equal(run(_scalar_kernel(lambda: value)), np.full((128, 8), 3.0 + float(value), np.float32))


def test_a_string_operand_names_its_type_and_the_accepted_kinds():
    e = error_of(_scalar_kernel(lambda: "2"))
    assert isinstance(e, errors.NKIArgumentError)
    assert e.detail == "tensor_scalar: `operand0` must be a number or a tile, got str"
    assert e.fix == "pass a Python float or a [P, 1] tile"


def test_a_per_partition_tile_operand_is_checked_as_a_compute_operand():
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(a, 3.0)
        r = nl.ndarray((128, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(r, a, nl.add, x)  # an HBM [128, 1] operand
    e = error_of(k, np.zeros((128, 1), np.float32))
    assert isinstance(e, errors.NKIBufferError) and "`operand0` is hbm[128, 1] float32 in HBM" in e.detail


def test_integers_beyond_float32_precision_stay_exact():
    from torchneuron.nki.checks import Call
    c = Call("op", None, None)
    assert c.per_partition_scalar(2 ** 24 + 1, "s", None) == 2 ** 24 + 1
    assert isinstance(c.per_partition_scalar(2 ** 24 + 1, "s", None), int)
    assert isinstance(c.per_partition_scalar(-(2 ** 24 + 1), "s", None), int)
    assert isinstance(c.per_partition_scalar(np.int64(2 ** 24 + 1), "s", None), int)
    assert isinstance(c.per_partition_scalar(2 ** 24, "s", None), float)  # exact in float32
    assert isinstance(c.per_partition_scalar(True, "s", None), float)


# --- dtypes ------------------------------------------------------------------------------------
@nki.jit
def _int_matmul(x):
    a = nl.ndarray((128, 128), nl.int32, buffer=nl.sbuf)
    nisa.memset(a, 0)
    p = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(p, a, a)


def test_a_dtype_outside_the_allowed_set_names_it_and_the_allowed_ones():
    e = error_of(_int_matmul)
    assert isinstance(e, errors.NKIDtypeError)
    assert e.detail == "nc_matmul: `stationary` has dtype int32 but TensorE multiplies bf16/fp16/tf32/fp32/fp8/int8"
    assert e.fix.startswith("cast it (e.g. with nisa.tensor_copy) to one of ")
    assert "bfloat16" in e.fix and "float32" in e.fix


# --- locations ---------------------------------------------------------------------------------
def test_an_error_names_the_kernel_file_and_line():
    from torchneuron.nki.checks import fmt_loc
    assert fmt_loc(("k.py", 12)) == "k.py:12"
    assert fmt_loc(None) is None
    e = error_of(_number_as_src)
    assert e.location is not None and e.location.startswith(__file__ + ":")


def test_the_dtype_error_lists_every_allowed_dtype():
    e = error_of(_int_matmul)
    assert e.fix == ("cast it (e.g. with nisa.tensor_copy) to one of bfloat16, float16, tfloat32, float32, "
                     "float8_e4m3, float8_e5m2, float8_e4m3fn, int8, uint8")


def _matmul_of(dtype):
    @nki.jit
    def k(x):
        a = nl.ndarray((128, 128), dtype, buffer=nl.sbuf)
        nisa.memset(a, 0.0)
        p = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, a, a)
    return k


def test_a_custom_dtype_in_the_allowed_set_passes():
    run(_matmul_of(nl.tfloat32))  # tfloat32: an NKI dtype numpy has no equivalent for


def test_a_custom_dtype_outside_the_allowed_set_is_rejected():
    e = error_of(_matmul_of(nl.float8_e4m3fn_x4))
    assert isinstance(e, errors.NKIDtypeError)
    assert e.detail.startswith("nc_matmul: `stationary` has dtype float8_e4m3fn_x4 but TensorE multiplies")


def test_an_array_operand_is_not_a_scalar():
    e = error_of(_scalar_kernel(lambda: np.array([1.0, 2.0])))
    assert isinstance(e, errors.NKIArgumentError)
    assert e.detail == "tensor_scalar: `operand0` must be a number or a tile, got ndarray"


def test_an_object_with_a_dtype_but_no_dimensions_is_not_a_scalar():
    class Typed:
        dtype = np.float32
    e = error_of(_scalar_kernel(Typed))
    assert isinstance(e, errors.NKIArgumentError)
    assert e.detail == "tensor_scalar: `operand0` must be a number or a tile, got Typed"


# --- the partition-count check itself --------------------------------------------------------
# No kernel can hand an instruction a view of more than 128 partitions (allocation and reshape
# reject it first), so the check is exercised on a stand-in tile.
class _Tile:
    def __init__(self, shape, start=0):
        self.data = np.zeros(shape, np.float32)
        self._start = start

    def _desc(self):
        return f"sbuf[{', '.join(map(str, self.data.shape))}] float32"

    def partition_start(self):
        return self._start


def _call():
    from types import SimpleNamespace

    from torchneuron.nki.checks import Call
    from torchneuron.platform import get_platform
    return Call("tensor_copy", SimpleNamespace(platform=get_platform("trn2")), ("k.py", 7))


def test_more_than_128_partitions_name_the_limit_and_the_tiling_fix():
    with pytest.raises(errors.NKIPartitionError) as e:
        _call().partitions(_Tile((129, 4)), "src")
    assert e.value.rule == "partition-size"
    assert e.value.detail == "tensor_copy: partition dimension 129 of `src` (sbuf[129, 4] float32) exceeds maximum 128"
    assert e.value.fix == "tile dimension 0 into chunks of at most 128"
    assert e.value.location == "k.py:7"


def test_128_partitions_from_partition_0_pass():
    _call().partitions(_Tile((128, 4)), "src")


def test_a_zero_dimensional_tile_is_one_partition():
    _call().partitions(_Tile(()), "src")
    with pytest.raises(errors.NKIPartitionError, match="an access of 1 partitions must start at partition 0, 32"):
        _call().partitions(_Tile((), start=5), "src")


@nki.jit
def _activation_of(x):
    r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.activation(r, nl.exp, x)


def test_an_instruction_naming_no_engine_calls_them_the_compute_engines():
    e = error_of(_activation_of)
    assert e.detail == "activation: `data` is hbm[128, 64] float32 in HBM but compute engines only access SBUF/PSUM"


@nki.jit
def _activation_from_psum(x):
    p = nl.ndarray((128, 64), nl.float32, buffer=nl.psum)
    nisa.memset(p, 0.0)
    r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
    nisa.activation(r, nl.exp, p)
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=r)
    return out


def test_the_scalar_engine_reads_psum():
    np.testing.assert_array_equal(run(_activation_from_psum), np.ones((128, 64), np.float32))


@nki.jit
def _transpose_into_hbm(x):
    t = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 0.0)
    out = nl.ndarray((32, 32), nl.float32, buffer=nl.shared_hbm)
    nisa.nc_transpose(out, t, engine=nisa.engine.vector)


def test_a_buffer_check_naming_no_engine_calls_them_the_compute_engines():
    e = error_of(_transpose_into_hbm)
    assert isinstance(e, errors.NKIBufferError)
    assert e.detail == "nc_transpose: `dst` is shared_hbm[32, 32] float32 in HBM but compute engines only access SBUF/PSUM"
