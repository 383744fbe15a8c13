"""NKI data types, backed by numpy and ml_dtypes.

Every NKI dtype is a numpy dtype (``nl.bfloat16 == ml_dtypes.bfloat16``) except
``tfloat32``, which has no numpy equivalent: it is stored as float32 and every write is
rounded to 10 mantissa bits (round-to-nearest-even), which is what TensorE sees, and the
x4-packed MX dtypes (``float8_e4m3fn_x4``, ``float8_e5m2_x4``, ``float4_e2m1fn_x4``), stored as
raw uint32 / uint16 bits.

Conversions (:func:`cast`) follow the hardware: float -> low-precision float rounds to
nearest even (ml_dtypes), float -> int rounds to nearest even and saturates, anything ->
bool is ``!= 0``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


class _CustomDType:
    """An NKI dtype numpy has no equivalent for, stored in a numpy ``storage`` dtype.

    ``tfloat32`` (fp32 range, 10-bit mantissa) is stored as float32 and rounded on every
    write; the x4-packed MX dtypes (four fp8 or fp4 values in one 32- or 16-bit element, the
    operands of ``nisa.nc_matmul_mx``) are stored as their raw bits (uint32 / uint16).
    Compared by identity; ``str()`` is the NKI name.
    """

    __slots__ = ("name", "itemsize", "kind", "storage", "element", "packed")

    def __init__(self, name: str, storage, kind: str, element=None, packed: int = 1):
        self.name = name
        self.storage = np.dtype(storage)
        self.itemsize = self.storage.itemsize
        self.kind = kind
        self.element = None if element is None else np.dtype(element)  # packed element type
        self.packed = packed  # values per element

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__

    def __reduce__(self):
        return self.name


tfloat32 = _CustomDType("tfloat32", np.float32, "f")
# x4-packed MX dtypes: 4 values per element, packed little-endian (value i in bits 8i..8i+7,
# or 4i..4i+3 for fp4), i.e. the byte order of a [..., 4 * n] fp8 array viewed as [..., n].
float8_e4m3fn_x4 = _CustomDType("float8_e4m3fn_x4", np.uint32, "V", ml_dtypes.float8_e4m3fn, 4)
float8_e5m2_x4 = _CustomDType("float8_e5m2_x4", np.uint32, "V", ml_dtypes.float8_e5m2, 4)
float4_e2m1fn_x4 = _CustomDType("float4_e2m1fn_x4", np.uint16, "V", ml_dtypes.float4_e2m1fn, 4)
PACKED = (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)
_CUSTOM = {d.name: d for d in (tfloat32,) + PACKED}

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
    "float8_e8m0fnu": float8_e8m0fnu, "float8_e4m3fn_x4": float8_e4m3fn_x4,
    "float8_e5m2_x4": float8_e5m2_x4, "float4_e2m1fn_x4": float4_e2m1fn_x4,
}

_NAME_OF = {}
for _n, _d in DTYPES.items():
    if not isinstance(_d, _CustomDType):
        _NAME_OF.setdefault(_d, _n)
_NAME_OF[bool_] = "bool_"

NkiDType = Any  # np.dtype or a _CustomDType (tfloat32, x4-packed)


def is_custom(dt: NkiDType) -> bool:
    """True for the dtypes numpy has no equivalent for (tfloat32, x4-packed)."""
    return isinstance(dt, _CustomDType)


def is_packed(dt: NkiDType) -> bool:
    """True for the x4-packed MX dtypes."""
    return isinstance(dt, _CustomDType) and dt.packed > 1


def as_dtype(dt: Any) -> NkiDType:
    """Normalise ``dt`` (numpy dtype/type, name string, torch dtype, NKI dtype) to an NKI dtype.

    Raises ``TypeError`` for anything NKI does not support (e.g. float64, int64).
    """
    if isinstance(dt, _CustomDType):
        return dt
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
    if isinstance(dt, _CustomDType):
        return dt.name
    n = _NAME_OF.get(dt)  # no str(dt) fallback unless needed: numpy's dtype str is slow
    return n if n is not None else _NAME_OF.get(np.dtype(dt)) or str(dt)


def storage(dt: NkiDType) -> np.dtype:
    """The numpy dtype that holds values of ``dt``."""
    return dt.storage if isinstance(dt, _CustomDType) else dt


def itemsize(dt: NkiDType) -> int:
    return dt.itemsize


def is_float(dt: NkiDType) -> bool:
    if isinstance(dt, _CustomDType):
        return dt.kind == "f"
    return np.dtype(dt).kind == "f" or dt in (bfloat16, float8_e4m3, float8_e4m3fn,
                                                                  float8_e5m2, float8_e8m0fnu)


_INTS = frozenset((int8, int16, int32, uint8, uint16, uint32))


def is_int(dt: NkiDType) -> bool:
    if dt in _INTS:  # the usual NKI dtype objects: a set lookup
        return True
    return not isinstance(dt, _CustomDType) and np.dtype(dt).kind in "iu"


_SIXTEEN = frozenset((bfloat16, float16))  # set lookups: hash first, no ml_dtypes __eq__ calls
_FP8 = frozenset((float8_e4m3, float8_e4m3fn, float8_e5m2))


def is_16bit_float(dt: NkiDType) -> bool:
    return dt in _SIXTEEN


def is_fp8(dt: NkiDType) -> bool:
    return dt in _FP8


def sentinel(dt: NkiDType):
    """Value fresh memory holds so reads of uninitialised data show: NaN, or 4 for ints."""
    if dt is bool_:
        return True
    if is_packed(dt):
        return np.iinfo(dt.storage).max  # all bits set: NaN for fp8 (fp4 has no NaN)
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
    if is_packed(dt):
        # Packed MX values are raw bits: only bit copies (same storage) and zero fills exist.
        if arr.dtype.kind in "iub" or not np.any(arr):
            return arr.astype(st)
        raise TypeError(f"cannot convert {arr.dtype} values to {dt.name} (x4-packed MX data is "
                        "produced by nisa.quantize_mx or copied bit for bit)")
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
    "float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4", "as_dtype", "name", "storage", "cast", "sentinel", "is_float", "is_int",
]
