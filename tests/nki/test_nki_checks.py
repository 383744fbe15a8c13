"""Every enforced hardware rule raises a clear error naming the rule, shapes and kernel line."""

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import errors

X = np.zeros((128, 64), np.float32)


def line_of(marker: str) -> str:
    """``this_file:line`` of the line containing ``marker`` (the expected error location)."""
    with open(__file__) as f:
        for i, text in enumerate(f, 1):
            if marker in text and "line_of(" not in text:
                return f"{__file__}:{i}"
    raise AssertionError(marker)


def run(kernel, *args, platform=None):
    return nki.simulate(kernel, platform=platform)(*args)


# --- partitions ------------------------------------------------------------------------------

@nki.jit
def _too_many_partitions(x):
    t = nl.ndarray((256, 64), nl.float32, buffer=nl.sbuf)  # <too-many-partitions>
    return t


def test_partition_dimension_over_128_is_rejected_at_the_kernel_line():
    with pytest.raises(errors.NKIPartitionError) as e:
        run(_too_many_partitions, X)
    msg = str(e.value)
    assert "partition dimension 256 exceeds maximum 128" in msg
    assert line_of("<too-many-partitions>") in msg
    assert "fix:" in msg


@pytest.mark.parametrize("start,size,ok", [
    (0, 128, True), (32, 96, False), (64, 64, True), (32, 64, False), (16, 16, False),
    (96, 32, True), (32, 32, True), (64, 33, True), (1, 1, False),
])
def test_start_partition_rule(start, size, ok):
    @nki.jit
    def k(x):
        t = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        r = nl.ndarray((128, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(r[start:start + size, :], t[start:start + size, :])
    if ok:
        run(k, X)
    else:
        with pytest.raises(errors.NKIPartitionError, match=f"starts at partition {start}"):
            run(k, X)


@nki.jit
def _strided_partitions(x):
    t = nl.load(x)
    return t[0:128:2, :]


def test_partition_dimension_cannot_be_strided():
    with pytest.raises(errors.NKIPartitionError, match="cannot be strided"):
        run(_strided_partitions, X)


# --- SBUF capacity ---------------------------------------------------------------------------

@nki.jit
def _big_tile(x, cols):
    t = nl.ndarray((128, cols), nl.float32, buffer=nl.sbuf)  # <big-tile>
    nisa.memset(t, 0.0)


def test_sbuf_tile_larger_than_a_partition_is_rejected():
    with pytest.raises(errors.NKIMemoryError) as e:
        run(_big_tile, X, 60000)  # 240000 bytes per partition > 212984 on trn2
    assert "SBUF capacity exceeded" in str(e.value)
    assert "240000 bytes per partition" in str(e.value)
    assert line_of("<big-tile>") in str(e.value)


def test_sbuf_capacity_comes_from_the_platform():
    run(_big_tile, X, 60000, platform="trn3")  # 240000 <= 245752 on trn3


def test_sbuf_capacity_follows_neuron_platform_target_override(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    run(_big_tile, X, 60000)


@nki.jit
def _loop_allocations(x, use_later):
    kept = []
    for i in range(8):
        t = nl.ndarray((128, 8192), nl.float32, buffer=nl.sbuf)  # <loop-alloc> 32 KiB
        nisa.memset(t, 0.0)
        kept.append(t)  # Python keeps all eight alive either way
    if use_later:
        for t in kept:
            nisa.tensor_scalar(t, t, nl.add, 1.0)


def test_sbuf_tile_lifetime_ends_at_its_last_use_not_with_its_python_object():
    run(_loop_allocations, X, False)  # each tile dies after its memset: 32 KiB live at a time


def test_sbuf_tiles_used_later_are_live_together_and_exceed_capacity():
    with pytest.raises(errors.NKIMemoryError, match="live") as e:
        run(_loop_allocations, X, True)  # eight 32 KiB tiles live at once > 208 KiB
    assert e.value.rule == "sbuf-capacity"
    assert "bytes per partition live" in str(e.value)
    assert line_of("<loop-alloc>") in str(e.value)  # the allocation that crossed the limit


# --- PSUM --------------------------------------------------------------------------------------

@nki.jit
def _psum_straddle(x, lo):
    s = nl.zeros((128, 128), nl.bfloat16)
    m = nl.zeros((128, 512), nl.bfloat16)
    p = nl.ndarray((128, 1024), nl.float32, buffer=nl.psum)  # two banks
    nisa.nc_matmul(p[:, lo:lo + 512], s, m)  # <psum-straddle>


def test_matmul_output_may_not_straddle_psum_banks():
    run(_psum_straddle, X, 512)  # a two-bank tile is allowed; its second bank is one output
    with pytest.raises(errors.NKIMemoryError) as e:
        run(_psum_straddle, X, 256)
    assert e.value.rule == "psum-bank"
    assert "bytes 1024..3071" in str(e.value) and "2048" in str(e.value)
    assert line_of("<psum-straddle>") in str(e.value)


@nki.jit
def _psum_whole(x):
    nl.ndarray((128, 4097), nl.float32, buffer=nl.psum)  # <psum-whole>


def test_psum_tile_may_not_exceed_psum():
    with pytest.raises(errors.NKIMemoryError, match="16384") as e:
        run(_psum_whole, X)
    assert line_of("<psum-whole>") in str(e.value)


@nki.jit
def _psum_nine(x, n_used):
    tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
    for t in tiles[:n_used]:
        nisa.memset(t, 0.0)


def test_psum_has_eight_banks_of_live_tiles():
    run(_psum_nine, X, 0)  # nine tiles that are never used are never live together
    with pytest.raises(errors.NKIMemoryError, match="9 banks live but PSUM has 8") as e:
        run(_psum_nine, X, 9)
    assert e.value.rule == "psum-capacity"


# --- matmul --------------------------------------------------------------------------------------

def _mm_kernel(k_, m_, n_, sdt=nl.bfloat16, mdt=nl.bfloat16, dst_buf=nl.psum, dst_dt=nl.float32,
               k2=None):
    @nki.jit
    def k(x):
        s = nl.zeros((k_, m_), sdt)
        mv = nl.zeros((k2 or k_, n_), mdt)
        # dst is always allocatable, so the matmul's own checks are what fails
        d = nl.ndarray((min(m_, 128), min(n_, 512)), dst_dt, buffer=dst_buf)
        nisa.nc_matmul(d, s, mv)  # <matmul-call>
    return k


@pytest.mark.parametrize("args,match", [
    ((128, 256, 512), "stationary .* free size 256 > 128"),
    ((128, 128, 1024), "moving .* free size 1024 > 512"),
    ((64, 128, 128, nl.bfloat16, nl.bfloat16, nl.psum, nl.float32, 32), "contraction"),
])
def test_nc_matmul_tile_limits(args, match):
    with pytest.raises(errors.NKIError, match=match) as e:
        run(_mm_kernel(*args), X)
    assert line_of("<matmul-call>") in str(e.value)


def test_nc_matmul_dst_must_be_psum():
    with pytest.raises(errors.NKIBufferError, match="must be in PSUM"):
        run(_mm_kernel(128, 128, 128, dst_buf=nl.sbuf), X)


def test_nc_matmul_rejects_mixed_fp32_and_bf16():
    with pytest.raises(errors.NKIDtypeError, match="fp32 matmul needs both operands in fp32"):
        run(_mm_kernel(128, 128, 128, sdt=nl.float32), X)


def test_nc_matmul_bf16_dst_only_on_trn3():
    with pytest.raises(errors.NKIDtypeError, match="float32"):
        run(_mm_kernel(128, 128, 128, dst_dt=nl.bfloat16), X, platform="trn2")
    run(_mm_kernel(128, 128, 128, dst_dt=nl.bfloat16), X, platform="trn3")


# --- buffer kinds ----------------------------------------------------------------------------------

@nki.jit
def _compute_on_hbm(x):
    r = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(r, x)  # <compute-on-hbm>


def test_compute_engines_cannot_read_hbm():
    with pytest.raises(errors.NKIBufferError) as e:
        run(_compute_on_hbm, X)
    assert "in HBM" in str(e.value) and "nl.load" in str(e.value)
    assert line_of("<compute-on-hbm>") in str(e.value)


@nki.jit
def _dma_from_psum(x):
    p = nl.ndarray((128, 64), nl.float32, buffer=nl.psum)
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=p)


def test_dma_may_not_read_psum():
    with pytest.raises(errors.NKIBufferError, match="DMAs may not read PSUM"):
        run(_dma_from_psum, X)


@nki.jit
def _gpsimd_psum(x):
    p = nl.ndarray((128, 64), nl.float32, buffer=nl.psum)
    nisa.memset(p, 0.0, engine=nisa.engine.gpsimd)


def test_gpsimd_cannot_access_psum():
    with pytest.raises(errors.NKIBufferError, match="PSUM"):
        run(_gpsimd_psum, X)


@nki.jit
def _return_sbuf(x):
    return nl.load(x)


def test_kernel_outputs_must_be_in_hbm():
    with pytest.raises(errors.NKIBufferError, match="shared_hbm"):
        run(_return_sbuf, X)


# --- bounds -------------------------------------------------------------------------------------

@nki.jit
def _oob_slice(x):
    return x[0:200, :]  # <oob-slice>


def test_out_of_bounds_slice_is_an_error_not_a_clip():
    with pytest.raises(errors.NKIOutOfBoundsError) as e:
        run(_oob_slice, X)
    assert "0:200" in str(e.value) and "size 128" in str(e.value)
    assert line_of("<oob-slice>") in str(e.value)


@nki.jit
def _oob_index(x):
    return x[5, 64]


def test_out_of_bounds_index_is_an_error():
    with pytest.raises(errors.NKIOutOfBoundsError, match="index 64 is out of bounds"):
        run(_oob_index, X)


@nki.jit
def _oob_ap(x):
    return x.ap(pattern=[[64, 128], [1, 65]])


def test_access_pattern_outside_the_tensor_is_an_error():
    with pytest.raises(errors.NKIOutOfBoundsError, match="access pattern"):
        run(_oob_ap, X)


@nki.jit
def _shape_mismatch(x):
    a = nl.load(x)
    r = nl.ndarray((128, 32), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(r, a, a, op=nl.add)


def test_elementwise_shape_mismatch_names_both_shapes():
    with pytest.raises(errors.NKIShapeError, match=r"sbuf\[128, 32\].*sbuf\[128, 64\]"):
        run(_shape_mismatch, X)


# --- sentinels -------------------------------------------------------------------------------------

@nki.jit
def _read_uninitialised(x):
    out_f = nl.ndarray((128, 4), nl.float32, buffer=nl.shared_hbm)
    out_i = nl.ndarray((128, 4), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 4), nl.float32, buffer=nl.sbuf)
    ti = nl.ndarray((128, 4), nl.int32, buffer=nl.sbuf)
    nl.store(out_f, t)
    nl.store(out_i, ti)
    return out_f, out_i


def test_uninitialised_memory_reads_as_sentinels():
    f, i = run(_read_uninitialised, X)
    assert np.isnan(f).all()
    assert (i == 4).all()


@nki.jit
def _partial_store(x):
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x[:, 0:32])
    nl.store(out[:, 0:32], t)
    return out


def test_output_parts_never_written_stay_nan():
    out = run(_partial_store, np.ones((128, 64), np.float32))
    assert (out[:, :32] == 1).all() and np.isnan(out[:, 32:]).all()


# --- tracing ---------------------------------------------------------------------------------------

@nki.jit
def _data_dependent_if(x):
    t = nl.load(x)
    if t:  # <data-dependent-if>
        pass


def test_python_if_on_a_tile_is_a_tracing_error():
    with pytest.raises(errors.NKITracingError) as e:
        run(_data_dependent_if, X)
    assert "control flow" in str(e.value) and line_of("<data-dependent-if>") in str(e.value)


@nki.jit
def _uses_is(x, y):
    if x is y:  # <uses-is>
        pass


def test_is_operator_is_rejected_at_its_line():
    with pytest.raises(errors.NKITracingError) as e:
        run(_uses_is, X, X)
    assert "`is`" in str(e.value) and line_of("<uses-is>") in str(e.value)


def test_list_arguments_are_rejected():
    with pytest.raises(errors.NKITracingError, match="pass a tuple"):
        run(_return_sbuf, [X])


@nki.jit
def _numpy_on_tile(x):
    t = nl.load(x)
    np.asarray(t)


def test_numpy_conversion_of_a_tile_is_rejected():
    with pytest.raises(errors.NKITracingError, match="nl.exp instead of np.exp"):
        run(_numpy_on_tile, X)


@nki.jit
def _bad_op(x):
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(r, t, t, op="frobnicate")


def test_unknown_operator_is_rejected():
    with pytest.raises(errors.NKIArgumentError, match="not an NKI operator"):
        run(_bad_op, X)


@nki.jit
def _exp_v4(x):
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    nisa.exponential(r, t)


def test_trn3_only_instruction_is_rejected_on_trn2():
    with pytest.raises(errors.NKIPlatformError, match="trn3"):
        run(_exp_v4, X, platform="trn2")


def test_nl_calls_outside_a_kernel_are_rejected():
    with pytest.raises(errors.NKITracingError, match="inside a kernel"):
        nl.ndarray((1, 1), nl.float32)


def test_bad_dtype_is_rejected_with_a_suggestion():
    @nki.jit
    def k(x):
        nl.ndarray((4, 4), np.float64, buffer=nl.sbuf)
    with pytest.raises(errors.NKIArgumentError, match="float32 instead of float64"):
        run(k, X)


# --- instruction-specific limits ----------------------------------------------------------------

@nki.jit
def _scalar_from_psum(x):
    p = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
    nisa.memset(p, 0.0)
    wide = nl.ndarray((128, 8192), nl.float32, buffer=nl.sbuf)
    nisa.memset(wide, 0.0)
    r = nl.ndarray((128, 8192), nl.float32, buffer=nl.sbuf)
    nisa.activation(r, nl.exp, wide)  # 8192 from SBUF: fine


def test_scalar_engine_free_size_limit_is_64k_from_sbuf():
    run(_scalar_from_psum, X)

    @nki.jit
    def too_wide(x):
        t = nl.ndarray((8, 70000), nl.bfloat16, buffer=nl.sbuf)
        nisa.memset(t, 0.0)
        nisa.activation(t, nl.exp, t)
    with pytest.raises(errors.NKIShapeError, match="at most 65536"):
        run(too_wide, X)


@nki.jit
def _hwdge_cast(x):
    t = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x, dge_mode=nisa.dge_mode.hwdge)


def test_hardware_dge_dma_requires_matching_dtypes():
    with pytest.raises(errors.NKIDtypeError, match="hardware-DGE"):
        run(_hwdge_cast, X)


@nki.jit
def _six_d(x):
    t = nl.ndarray((4, 2, 3, 2, 3, 2), nl.float32, buffer=nl.sbuf)
    nisa.memset(t, 1.0)
    r = nl.ndarray((4, 2, 3, 2, 3, 2), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(r, t)                      # contiguous: merges to 1 free dim, fine
    v = t[:, :, 0:3:2, :, 0:3:2, :]             # strides no longer merge: 5 free dims
    nisa.tensor_copy(r[:, :, 0:3:2, :, 0:3:2, :], v)  # <five-free-dims>


def test_access_patterns_have_at_most_four_free_dimensions():
    with pytest.raises(errors.NKIShapeError) as e:
        run(_six_d, X)
    assert "at most 4 free dimensions" in str(e.value)
    assert line_of("<five-free-dims>") in str(e.value)
