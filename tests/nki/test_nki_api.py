"""AWS's nki.language / nki.isa API surface: names, objects, views, registers, module paths."""

import ast
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import torchneuron.nki as tnki
from torchneuron.nki import errors

rng = np.random.default_rng(11)


# --- module hygiene ------------------------------------------------------------------------------

def _annotation_nodes(tree) -> set:
    ids = set()
    for node in ast.walk(tree):
        anns = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            anns.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            anns.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            anns.append(node.annotation)
        for a in anns:
            ids |= {id(n) for n in ast.walk(a)}
    return ids


def test_language_module_reaches_range_and_bool_builtins_only_through_the_builtins_module():
    """nl.range / nl.bool shadow Python's range / bool in torchneuron/nki/language.py: code
    there must spell the builtins _builtins.range / _builtins.bool (a bare `bool(x)` would call
    the NKI dtype). sum/max/min/all/abs bare uses are the NKI reductions, on purpose."""
    tree = ast.parse(open(tnki.language.__file__).read())
    assert vars(tnki.language)["bool"] is nl.bool_  # the shadowing this guards against
    skip = _annotation_nodes(tree)
    bad = [(n.id, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Name)
           and isinstance(n.ctx, ast.Load) and n.id in ("range", "bool") and id(n) not in skip]
    assert not bad, f"bare uses of shadowed builtins in language.py: {bad}"


def test_nl_range_is_a_loop_and_nl_bool_the_boolean_dtype():
    assert list(nl.range(2, 5)) == [2, 3, 4]
    assert nl.bool is nl.bool_ and np.dtype(nl.bool) == np.bool_


def test_nki_module_paths_of_aws_kernels_import():
    import importlib
    import nki.collectives as ncc
    import nki.isa.constants as consts
    import nki.typing as nt
    from nki.isa import constants as consts2
    from nki.isa.constants import dge_mode, oob_mode  # noqa: F401
    legacy = importlib.import_module("neuronxcc.nki.typing")
    assert consts is consts2 is tnki.constants and legacy is nt
    assert importlib.import_module("neuronxcc.nki.language") is nl
    assert importlib.import_module("neuronxcc.nki.isa") is nisa
    assert nt.mutable_tensor[128, 512] is nt.mutable_tensor
    assert nki.dtype.bfloat16 == ml_dtypes.bfloat16 and ncc.ReplicaGroup


def test_nc_version_is_ordered_and_readable_outside_kernels(monkeypatch):
    assert nisa.nc_version.gen2 < nisa.nc_version.gen3 < nisa.nc_version.gen4
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert nisa.get_nc_version() >= nisa.nc_version.gen4


def test_tile_size_is_the_target_platforms_outside_a_kernel(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert nl.tile_size.total_available_sbuf_size == 245_752
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert nl.tile_size.sbuf_fmax_bytes == 212_984
    assert (nl.tile_size.pmax, nl.tile_size.psum_bank_fmax, nl.tile_size.psum_num_banks,
            nl.tile_size.gemm_moving_fmax) == (128, 512, 8, 512)
    with pytest.raises(NotImplementedError, match="psum_min_align"):
        nl.tile_size.psum_min_align


# --- NKIObject ------------------------------------------------------------------------------------

class Cfg(nl.NKIObject):
    size: int
    scale: float = 1.0
    label = "x"


@dataclass
class DCfg(nl.NKIObject):
    size: int = 4
    idx = None  # declared without an annotation: not a dataclass field


def test_nkiobject_sets_declared_attributes_by_keyword():
    c = Cfg(size=3, label="y")
    assert (c.size, c.scale, c.label) == (3, 1.0, "y")
    with pytest.raises(TypeError, match="unexpected keyword argument.*colour"):
        Cfg(colour=1)


def test_nkiobject_dataclass_accepts_unannotated_declared_attributes():
    d = DCfg(size=2, idx=7)
    assert (d.size, d.idx) == (2, 7)
    with pytest.raises(TypeError, match="unexpected"):
        DCfg(nope=1)


# --- programs, constants, ops ---------------------------------------------------------------------

@nki.jit
def _grid_info(x):
    out = nl.ndarray((1, 3), nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 3), nl.int32, buffer=nl.sbuf)
    nisa.memset(t[:, 0:1], nl.program_ndim())
    nisa.memset(t[:, 1:2], nl.num_programs())
    nisa.memset(t[:, 2:3], nl.program_id(0))
    if nl.program_id(0) == 0:
        nisa.dma_copy(dst=out, src=t)
    return out


def test_program_ndim_is_zero_without_a_grid_and_one_with_it():
    x = np.zeros((1, 1), np.float32)
    assert _grid_info(x).tolist() == [[0, 1, 0]]
    assert _grid_info[1](x).tolist() == [[1, 1, 0]]
    assert _grid_info[2](x).tolist() == [[1, 2, 0]]
    assert nki.simulate(_grid_info[2])(x).tolist() == [[1, 2, 0]]


def test_shared_constant_from_an_array_and_from_an_npy_file(tmp_path):
    c = rng.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(_run_const(c), c)
    path = tmp_path / "c.npy"
    np.save(path, c)
    np.testing.assert_array_equal(_run_const(str(path)), c)


def _run_const(c):
    @nki.jit
    def k(x):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=nl.shared_constant(c))
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k(np.zeros((1, 1), np.float32))


def _unary(op):
    @nki.jit
    def k(x):
        t = nl.load(x)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(out, op(t))
        return out
    return k


def _sig(x):
    return 1 / (1 + np.exp(-x))


def _phi(x):
    return 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("op,ref", [
    (nl.gelu_apprx_sigmoid, lambda x: x * _sig(1.702 * x)),
    (nl.gelu_apprx_sigmoid_dx, lambda x: _sig(1.702 * x) + 1.702 * x * _sig(1.702 * x) * (1 - _sig(1.702 * x))),
    (nl.silu_dx, lambda x: _sig(x) * (1 + x * (1 - _sig(x)))),
    (nl.gelu_dx, lambda x: _phi(x) + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)),
    (nl.erf_dx, lambda x: 2 / math.sqrt(math.pi) * np.exp(-x * x)),
    (nl.arctan, np.arctan), (nl.trunc, np.trunc), (nl.tan, lambda x: np.tan(x * 0.5)),
])
def test_new_activation_functions_match_numpy(op, ref):
    x = rng.standard_normal((16, 32)).astype(np.float32) * 2
    if op is nl.tan:
        x = x * 0.5
        np.testing.assert_allclose(_unary(op)(x), np.tan(x), rtol=2e-5, atol=1e-5)
        return
    np.testing.assert_allclose(_unary(op)(x), ref(x), rtol=2e-5, atol=1e-5)


@nki.jit
def _mods(x, y):
    a, b = nl.load(x), nl.load(y)
    out = nl.ndarray((2,) + x.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out[0], nl.mod(a, b))
    nl.store(out[1], nl.fmod(a, b))
    return out


def test_mod_is_pythons_modulus_and_fmod_the_c_remainder():
    x = np.array([[-7.0, 7.0, -7.5, 5.0]], np.float32)
    y = np.array([[3.0, -3.0, 2.0, 5.0]], np.float32)
    out = _mods(x, y)
    np.testing.assert_array_equal(out[0], np.mod(x, y))
    np.testing.assert_array_equal(out[1], np.fmod(x, y))


@nki.jit
def _invert(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.invert(nl.load(x)))
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.uint32])
def test_invert_is_bitwise_not(dtype):
    x = rng.integers(0, 100, (4, 16)).astype(dtype)
    np.testing.assert_array_equal(_invert(x), np.invert(x))


# --- x4-packed MX dtypes ---------------------------------------------------------------------------

def test_packed_mx_dtypes_have_their_element_sizes_and_names():
    assert (nl.float8_e4m3fn_x4.itemsize, nl.float8_e5m2_x4.itemsize,
            nl.float4_e2m1fn_x4.itemsize) == (4, 4, 2)
    assert str(nl.float8_e4m3fn_x4) == "float8_e4m3fn_x4"


@nki.jit
def _packed_roundtrip(x):
    t = nl.ndarray((4, 8), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.view(nl.float8_e4m3fn_x4))
    out = nl.ndarray((4, 32), nl.uint8, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out.view(nl.float8_e4m3fn_x4), src=t)
    return out


def test_packed_dtypes_move_bit_for_bit_and_reinterpret_with_view():
    x = rng.integers(0, 255, (4, 32)).astype(np.uint8)
    np.testing.assert_array_equal(_packed_roundtrip(x), x)


@nki.jit
def _packed_cast(x):
    t = nl.ndarray((4, 8), nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)  # float32 -> packed: not a bit copy


def test_converting_values_into_a_packed_dtype_is_an_error():
    with pytest.raises(errors.NKIDtypeError, match="bit for bit"):
        _packed_cast(np.zeros((4, 8), np.float32))


# --- views (AWS NkiTensor API) --------------------------------------------------------------------

@nki.jit
def _views(x):
    out = nl.ndarray((6, 4, 8), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 6, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.permute((1, 0, 2)))  # HBM (6, 4, 8) -> [4, 6, 8]
    u = nl.ndarray((4, 6, 8), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(u, t.permute((0, 1, 2)))
    nisa.dma_copy(dst=out.permute((1, 0, 2)), src=u)
    return out


def test_permute_views_on_hbm_and_sbuf_round_trip():
    x = rng.standard_normal((6, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(_views(x), x)


@nki.jit
def _view_ops(x):
    out = nl.ndarray((5, 4, 6), nl.float32, buffer=nl.shared_hbm)
    a = x.slice(1, 0, 12, 2)  # (4, 6) every other column
    b = a.expand_dim(0).broadcast(0, 5)  # (5, 4, 6), stride 0 on dim 0
    nisa.dma_copy(dst=out, src=b)
    return out


def test_slice_expand_broadcast_views_match_numpy():
    x = rng.standard_normal((4, 12)).astype(np.float32)
    np.testing.assert_array_equal(_view_ops(x), np.broadcast_to(x[:, ::2], (5, 4, 6)))


@nki.jit
def _reshape_ops(x):
    out = nl.ndarray((4, 2, 3, 5), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 30), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.flatten_dims(1, 2))
    v = t.reshape_dim(1, (2, -1)).reshape_dim(2, (3, 5))
    nisa.dma_copy(dst=out, src=v)
    return out


def test_flatten_and_reshape_dims_match_numpy():
    x = rng.standard_normal((4, 6, 5)).astype(np.float32)
    np.testing.assert_array_equal(_reshape_ops(x), x.reshape(4, 2, 3, 5))


@nki.jit
def _rearrange(x):
    out = nl.ndarray((4, 3, 2), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x.rearrange(("b", ("h", "w")), ("b", "w", "h"), {"h": 2}))
    return out


def test_rearrange_splits_and_permutes_named_dims():
    x = rng.standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_array_equal(_rearrange(x), x.reshape(4, 2, 3).transpose(0, 2, 1))


def test_strides_offset_and_pattern_are_in_elements_of_the_storage_layout():
    seen = {}

    @nki.jit
    def k(x):
        t = nl.ndarray((128, 4, 16), nl.float32, buffer=nl.sbuf)
        v = t[2:34, 1, 3:11:2]
        seen.update(strides=v.strides, offset=v.offset, pattern=v.get_pattern(),
                    contiguous=(t.is_contiguous(), v.is_contiguous()))
    k(np.zeros((1, 1), np.float32))
    assert seen["strides"] == (64, 2) and seen["offset"] == 2 * 64 + 16 + 3
    assert seen["pattern"] == [[64, 32], [2, 4]] and seen["contiguous"] == (True, False)


@nki.jit
def _select_dyn(x, i):
    it = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=i)
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.select(0, it))  # run-time index on dimension 0 of (E, 4, 8)
    out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[0], src=t)
    nisa.dma_copy(dst=out[1], src=x.select(0, 1))
    return out


def test_select_with_a_static_and_a_run_time_index():
    x = rng.standard_normal((3, 4, 8)).astype(np.float32)
    out = _select_dyn(x, np.array([[2]], np.int32))
    np.testing.assert_array_equal(out[0], x[2])
    np.testing.assert_array_equal(out[1], x[1])


@nki.jit
def _vsel(x, idx):
    it = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=idx)
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.vector_select(0, it))
    out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_vector_select_gathers_one_row_per_partition():
    x = rng.standard_normal((10, 8)).astype(np.float32)
    idx = np.array([[7], [0], [7], [3]], np.int32)
    np.testing.assert_array_equal(_vsel(x, idx), x[idx[:, 0]])


@nki.jit
def _ap_scalar_offset(x, e):
    it = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=it, src=e)
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    # AWS semantics: the index scales by x's stride of dimension indirect_dim (4 * 8 here);
    # the pattern covers one expert's (4, 8) block
    nisa.dma_copy(dst=t, src=x.ap([[8, 4], [1, 8]], offset=0, scalar_offset=it, indirect_dim=0))
    out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_ap_scalar_offset_scales_by_the_stride_of_indirect_dim():
    x = rng.standard_normal((5, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(_ap_scalar_offset(x, np.array([[3]], np.int32)), x[3])


@nki.jit
def _ap_dtype(x):
    t = nl.ndarray((2, 8), nl.uint16, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x.ap([[8, 2], [1, 8]], dtype=nl.uint16))  # fp32 storage as uint16
    out = nl.ndarray((2, 8), nl.uint16, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_ap_dtype_reinterprets_the_storage():
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(_ap_dtype(x), x.view(np.uint16))


# --- registers and dynamic control flow -------------------------------------------------------------

@nki.jit
def _dyn_loops(x, n):
    rows = x.shape[0]
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    nt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=nt, src=n)
    reg = nisa.register_alloc()
    nisa.register_load(reg, nt)
    t = nl.ndarray((1, x.shape[1]), nl.float32, buffer=nl.sbuf)
    zero = nl.zeros((1, x.shape[1]), nl.float32)
    for r in range(rows):
        nisa.dma_copy(dst=out[r:r + 1, :], src=zero)

    def body(i):  # i: a register; copies row i (run-time offset) to the output, doubled
        nisa.dma_copy(dst=t, src=x.ap([[x.shape[1], 1], [1, x.shape[1]]], scalar_offset=i,
                                      indirect_dim=0))
        nisa.tensor_scalar(t, t, nl.multiply, 2.0)
        nisa.dma_copy(dst=out.ap([[x.shape[1], 1], [1, x.shape[1]]], scalar_offset=i,
                                 indirect_dim=0), src=t)
    nl.fori_loop(0, reg, body)
    # a while loop on a count held in SBUF: adds 1 to row 0, `count` times
    cnt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=cnt, src=n)
    c = nisa.register_alloc()
    nisa.register_load(c, cnt)
    acc = nl.zeros((1, 1), nl.float32)

    def wbody(r):
        nisa.tensor_scalar(acc, acc, nl.add, 1.0)
        nisa.tensor_scalar(cnt, cnt, nl.subtract, 1)
        nisa.register_load(r, cnt)
        return r
    nl.while_loop(c, wbody)
    res = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=res, src=acc)
    stored = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
    nisa.register_store(stored, reg)
    return out, res, stored


def test_dynamic_loops_follow_register_values_loaded_at_run_time():
    x = rng.standard_normal((6, 8)).astype(np.float32)
    for n in (0, 2, 5):
        out, res, stored = _dyn_loops(x, np.array([[n]], np.int32))
        want = np.zeros_like(x)
        want[:n] = 2 * x[:n]
        np.testing.assert_array_equal(out, want)
        assert res[0, 0] == n and stored[0, 0] == n


@nki.jit
def _dyn_range(x, n):
    out = nl.zeros((1, 1), nl.float32)
    nt = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=nt, src=n)
    reg = nisa.register_alloc(nt)  # initialised from a tensor
    for _ in nl.dynamic_range(1, reg):
        nisa.tensor_scalar(out, out, nl.add, 1.0)
    w = nisa.register_alloc(2)
    while w:  # the parser frontend's data-dependent loop on a register
        nisa.tensor_scalar(out, out, nl.add, 10.0)
        nisa.register_move(w, w - 1)
    res = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=res, src=out)
    return res


def test_dynamic_range_and_while_on_a_register():
    assert _dyn_range(np.zeros((1, 1), np.float32), np.array([[4]], np.int32))[0, 0] == 3 + 20


@nki.jit
def _uninit_reg(x):
    r = nisa.register_alloc()
    for _ in nl.dynamic_range(r):
        pass


def test_reading_an_unset_register_is_an_error():
    with pytest.raises(errors.NKIArgumentError, match="register read before"):
        _uninit_reg(np.zeros((1, 1), np.float32))


# --- kernels calling kernels ------------------------------------------------------------------------

@nki.jit
def _inner(x):
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(out, nl.multiply(nl.load(x), 3.0))
    return out


@nki.jit
def _outer(x):
    return _inner(x)  # inlined into this kernel, as the NKI compiler does


def test_a_kernel_called_from_a_kernel_is_inlined():
    x = rng.standard_normal((4, 4)).astype(np.float32)
    np.testing.assert_allclose(_outer(x), 3 * x)
    r = nki.benchmark(_outer)(x)
    assert r.instructions == 3  # load, multiply, store: one program, no nested launch


# --- the API coverage table of docs/nki.md -------------------------------------------------------------

def _coverage_rows():
    import os
    import re
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "nki.md")
    rows = []
    for line in open(doc):
        m = re.match(r"\| `(\w+)` \| (supported|\*\*not supported\*\*) \|", line)
        if m:
            rows.append((m.group(1), m.group(2) == "supported"))
    return rows


def test_docs_coverage_table_matches_the_modules():
    import nki.collectives as ncc
    rows = _coverage_rows()
    assert len(rows) > 180  # every nl, nisa and collectives name of AWS's reference
    for name, supported in rows:
        mods = [m for m in (nl, nisa, ncc) if hasattr(m, name)]
        if supported:
            assert mods, f"{name} is marked supported but no module has it"
            continue
        for m in mods:  # present only to explain itself: calling it must raise
            fn = getattr(m, name)
            nargs = fn.__code__.co_argcount - len(fn.__defaults__ or ())
            with pytest.raises(NotImplementedError):
                fn(*([None] * nargs))
