"""NKI dtypes: names, storage and hardware-exact rounding."""

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from torchneuron.nki import dtypes as dt


def test_every_nki_dtype_is_exposed_by_nl():
    for name in ("bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16",
                 "float32", "bfloat16", "tfloat32", "float8_e4m3", "float8_e5m2"):
        assert getattr(nl, name) is dt.DTYPES[name]


def test_bf16_cast_rounds_to_nearest_even():
    x = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -1 - 2 ** -8], np.float32)  # ties
    np.testing.assert_array_equal(dt.cast(x, nl.bfloat16).astype(np.float32),
                                  [1.0, 1 + 2 ** -6, -1.0])


def test_fp8_casts_use_the_format_range():
    x = np.array([1.0, 300.0, 0.1], np.float32)
    e4 = dt.cast(x, nl.float8_e4m3).astype(np.float32)
    e5 = dt.cast(x, nl.float8_e5m2).astype(np.float32)
    assert e4[0] == 1.0 and e5[0] == 1.0
    assert e4[2] == np.float32(ml_dtypes.float8_e4m3(0.1))
    assert e5[1] == 320.0  # 300 rounds to the nearest e5m2 value


def test_tfloat32_keeps_ten_mantissa_bits_round_to_nearest_even():
    x = np.array([1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -10, np.inf, np.nan], np.float32)
    r = dt.cast(x, nl.tfloat32)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r[:4], [1.0, 1 + 2 ** -9, 1 + 2 ** -10, np.inf])
    assert np.isnan(r[4])


def test_float_to_int_rounds_and_saturates():
    x = np.array([1.5, 2.5, -300.0, 300.0, np.nan], np.float32)
    np.testing.assert_array_equal(dt.cast(x, nl.int8), [2, 2, -128, 127, 0])


def test_unsupported_dtype_names_the_alternative():
    with pytest.raises(TypeError, match="int32 instead of int64"):
        dt.as_dtype(np.int64)


@nki.jit
def _to_tf32(x):
    out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.tfloat32, buffer=nl.sbuf)
    nisa.tensor_copy(r, t)
    nl.store(out, r)
    return out


def test_tfloat32_tiles_round_on_write():
    x = np.array([[1 + 2 ** -12, 1 + 2 ** -9]], np.float32)
    np.testing.assert_array_equal(nki.simulate(_to_tf32)(x), [[1.0, 1 + 2 ** -9]])


def test_torch_dtypes_map_to_nki_dtypes():
    torch = pytest.importorskip("torch")
    assert dt.as_dtype(torch.bfloat16) is nl.bfloat16
    assert dt.as_dtype(torch.float8_e5m2) is nl.float8_e5m2
