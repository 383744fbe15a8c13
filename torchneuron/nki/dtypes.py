"""NKI data types, backed by numpy and ml_dtypes.

Every NKI dtype is a numpy dtype (``nl.bfloat16 == ml_dtypes.bfloat16``) except
``tfloat32``, which has no numpy equivalent: it is stored as float32 and every write is
rounded to 10 mantissa bits (round-to-nearest-even), which is what TensorE sees.

Conversions (:func:`cast`) follow the hardware: float -> low-precision float rounds to
nearest even (ml_dtypes), float -> int rounds to nearest even and saturates, anything ->
bool is ``!= 0``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


class _TFloat32:
    """Marker dtype for tfloat32 (fp32 range, 10-bit mantissa), stored as float32."""

    name = "tfloat32"
    itemsize = 4
    kind = "f"
    storage = np.dtype(np.float32)

    def __repr__(self) -> str:
        return "tfloat32"

    def __reduce__(self):
        return "tfloat32"


tfloat32 = _TFloat32()

bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
# NKI's float8_e4m3 is the IEEE-style E4M3 (max 240, has inf); e4m3fn (max 448) is v4 only.
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)

DTYPES: dict[str, Any] = {
    "bool_": bool_, "bool": bool_, "int8": int8, "int16": int16, "int32": int32,
    "uint8": uint8, "uint16": uint16, "uint32": uint32, "float16": float16,
    "float32": float32, "bfloat16": bfloat16, "tfloat32": tfloat32,
    "float8_e4m3": float8_e4m3, "float8_e4m3fn": float8_e4m3fn, "float8_e5m2": float8_e5m2,
    "float8_e8m0fnu": float8_e8m0fnu,
}

_NAME_OF = {}
for _n, _d in DTYPES.items():
    if _d is not tfloat32:
        _NAME_OF.setdefault(_d, _n)
_NAME_OF[bool_] = "bool_"

NkiDType = Any  # np.dtype or the tfloat32 marker


def as_dtype(dt: Any) -> NkiDType:
    """Normalise ``dt`` (numpy dtype/type, name string, torch dtype, NKI dtype) to an NKI dtype.

    Raises ``TypeError`` for anything NKI does not support (e.g. float64, int64).
    """
    if dt is tfloat32:
        return tfloat32
    if isinstance(dt, str):
        if dt in DTYPES:
            return DTYPES[dt]
        raise TypeError(f"unknown NKI dtype {dt!r}; supported: {sorted(DTYPES)}")
    mod = type(dt).__module__
    if mod.startswith("torch"):
        name = str(dt).replace("torch.", "")
        name = {"bool": "bool_", "float8_e4m3fn": "float8_e4m3fn"}.get(name, name)
        if name in DTYPES:
            return DTYPES[name]
        raise TypeError(f"torch dtype {dt} has no NKI equivalent; supported: {sorted(DTYPES)}")
    try:
        d = np.dtype(dt)
    except TypeError:
        raise TypeError(f"{dt!r} is not a dtype") from None
    if d in _NAME_OF:
        return d
    raise TypeError(f"dtype {d} is not supported by NKI; use one of {sorted(set(_NAME_OF.values()))}"
                    " (e.g. float32 instead of float64, int32 instead of int64)")


def name(dt: NkiDType) -> str:
    """NKI name of a dtype (``'bfloat16'``, ``'tfloat32'``...)."""
    if dt is tfloat32:
        return "tfloat32"
    return _NAME_OF.get(np.dtype(dt), str(dt))


def storage(dt: NkiDType) -> np.dtype:
    """The numpy dtype that holds values of ``dt``."""
    return dt.storage if dt is tfloat32 else dt


def itemsize(dt: NkiDType) -> int:
    return dt.itemsize


def is_float(dt: NkiDType) -> bool:
    return dt is tfloat32 or np.dtype(dt).kind == "f" or dt in (bfloat16, float8_e4m3, float8_e4m3fn,
                                                                  float8_e5m2, float8_e8m0fnu)


def is_int(dt: NkiDType) -> bool:
    return dt is not tfloat32 and np.dtype(dt).kind in "iu"


def is_16bit_float(dt: NkiDType) -> bool:
    return dt in (bfloat16, float16)


def is_fp8(dt: NkiDType) -> bool:
    return dt in (float8_e4m3, float8_e4m3fn, float8_e5m2)


def sentinel(dt: NkiDType):
    """Value fresh memory holds so reads of uninitialised data show: NaN, or 4 for ints."""
    if dt is bool_:
        return True
    return np.nan if is_float(dt) else 4


def round_tf32(x: np.ndarray) -> np.ndarray:
    """Round float32 values to tfloat32 precision (10 mantissa bits), nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    finite = np.isfinite(x)
    lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + lsb) & np.uint32(0xFFFFE000)).astype(np.uint32)
    out = np.where(finite, rounded, bits).view(np.float32)
    return out


def cast(values: Any, dt: NkiDType) -> np.ndarray:
    """Convert ``values`` to ``dt`` the way the hardware does (RNE, saturating ints)."""
    arr = np.asarray(values)
    st = storage(dt)
    if arr.dtype == st and dt is not tfloat32:
        return arr
    if dt is tfloat32:
        return round_tf32(arr.astype(np.float32))
    if st == bool_:
        return arr != 0
    if st.kind in "iu":
        if arr.dtype.kind in "iu" or arr.dtype == bool_:
            info = np.iinfo(st)
            return np.clip(arr, info.min, info.max).astype(st) if arr.dtype != bool_ else arr.astype(st)
        f = np.asarray(arr, dtype=np.float64)
        info = np.iinfo(st)
        f = np.rint(np.nan_to_num(f, nan=0.0, posinf=info.max, neginf=info.min))
        return np.clip(f, info.min, info.max).astype(st)
    if arr.dtype.kind not in "f" and arr.dtype not in _NAME_OF:
        arr = arr.astype(np.float32)
    if arr.dtype.itemsize == 1 and st.itemsize == 1 and arr.dtype != st:
        arr = arr.astype(np.float32)  # fp8 -> fp8 goes through fp32, as DMA does
    return arr.astype(st)


__all__ = [
    "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32",
    "bfloat16", "tfloat32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "as_dtype", "name", "storage", "cast", "sentinel", "is_float", "is_int",
]
