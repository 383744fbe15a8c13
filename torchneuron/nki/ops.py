"""ALU and activation operators: the objects behind ``nl.add``, ``nl.exp``, ``nl.maximum``...

Each :class:`Op` is both callable as an ``nl.*`` function (``nl.exp(tile)`` returns a new
tile) and passable as the ``op=`` argument of ``nisa.*`` instructions. Numpy ufuncs such as
``np.add`` are accepted wherever an op is, through :func:`op_from_any`.

Numerics: every op computes in float32 (integers/bitwise ops in int64 then saturated on
write), the precision of the Vector/Scalar engines.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 refined with one Newton step would be overkill: the W. J. Cody
    # style rational approximation below is accurate to ~1e-7, float32 resolution.
    x = np.asarray(x, dtype=np.float64)
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    y = 1.0 - t * np.exp(-a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (
        0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (
            1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))))
    return (s * y).astype(np.float32)


def _sigmoid(x):
    return (0.5 * (np.tanh(0.5 * x) + 1.0)).astype(np.float32, copy=False)


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x * np.float32(1 / math.sqrt(2))))).astype(np.float32, copy=False)


def _gelu_tanh(x):
    c = np.float32(math.sqrt(2 / math.pi))
    return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def _softplus(x):
    return np.logaddexp(np.float32(0), x)


_GELU_SIGMOID_K = np.float32(1.702)  # gelu(x) ~ x * sigmoid(1.702 x)


def _gelu_sigmoid(x):
    return x * _sigmoid(_GELU_SIGMOID_K * x)


def _gelu_sigmoid_dx(x):
    s = _sigmoid(_GELU_SIGMOID_K * x)
    return s + _GELU_SIGMOID_K * x * s * (np.float32(1) - s)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (np.float32(1) + x * (np.float32(1) - s))


def _gelu_dx(x):
    # d/dx [x Phi(x)] = Phi(x) + x phi(x)
    phi = np.exp(np.float32(-0.5) * x * x) * np.float32(1 / math.sqrt(2 * math.pi))
    cdf = np.float32(0.5) * (np.float32(1) + _erf(x * np.float32(1 / math.sqrt(2))))
    return (cdf + x * phi).astype(np.float32, copy=False)


def _erf_dx(x):
    return (np.float32(2 / math.sqrt(math.pi)) * np.exp(-x * x)).astype(np.float32, copy=False)


def _abs_pick(bigger: bool):
    def f(a, b):
        a, b = np.broadcast_arrays(np.asarray(a, np.float32), np.asarray(b, np.float32))
        pick_a = np.abs(a) >= np.abs(b) if bigger else np.abs(a) <= np.abs(b)
        return np.where(pick_a, a, b)
    return f


class Op:
    """An ALU/activation operator. ``kind`` is ``unary``, ``binary``, ``compare``, ``logical``
    or ``bitwise``; ``fn`` is the numpy implementation; ``reducer`` the reduction (if any)."""

    __slots__ = ("name", "kind", "fn", "reducer", "impl", "__dict__")

    def __init__(self, name: str, kind: str, fn: Callable, reducer: Callable | None = None,
                 doc: str = ""):
        self.name = name
        self.kind = kind
        self.fn = fn
        self.reducer = reducer
        self.impl = None
        self.__doc__ = doc or f"nl.{name}: elementwise {name}; also usable as an ``op=`` argument."

    def __call__(self, *args, **kwargs):
        if self.impl is None:
            from . import language  # noqa: F401  (registers the nl-level implementations)
        return self.impl(*args, **kwargs)

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __reduce__(self):
        return (_op_by_name, (self.name,))


def _cmp(f):
    return lambda a, b: f(a, b).astype(np.float32)


UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: np.float32(1) / np.sqrt(x), "reciprocal": lambda x: np.float32(1) / x,
    "tanh": np.tanh, "sin": np.sin, "cos": np.cos, "abs": np.abs, "negative": np.negative,
    "square": np.square, "relu": lambda x: np.maximum(x, np.float32(0)), "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x), "gelu": _gelu, "gelu_apprx_tanh": _gelu_tanh,
    "softplus": _softplus, "erf": _erf, "mish": lambda x: x * np.tanh(_softplus(x)),
    "copy": lambda x: x, "identity": lambda x: x, "sign": np.sign,
    "ceil": np.ceil, "floor": np.floor, "logical_not": lambda x: (x == 0).astype(np.float32),
    "gelu_apprx_sigmoid": _gelu_sigmoid, "gelu_apprx_sigmoid_dx": _gelu_sigmoid_dx,
    "silu_dx": _silu_dx, "gelu_dx": _gelu_dx, "erf_dx": _erf_dx, "tan": np.tan,
    "arctan": np.arctan, "trunc": np.trunc,
    # prelu's negative slope is activate2's relu_param; as a plain activation it is relu.
    "prelu": lambda x: np.maximum(x, np.float32(0)),
}

BINARY = {
    "add": (np.add, np.add.reduce), "subtract": (np.subtract, None),
    "multiply": (np.multiply, np.multiply.reduce), "divide": (np.divide, None),
    "maximum": (np.maximum, np.maximum.reduce), "minimum": (np.minimum, np.minimum.reduce),
    "power": (np.power, None), "mod": (np.mod, None), "fmod": (np.fmod, None),
    "abs_max": (_abs_pick(True), None), "abs_min": (_abs_pick(False), None),
    # bypass passes its first operand through (a no-op stage of tensor_scalar / activate2);
    # average is a reduction (tensor_partition_reduce) that divides the sum by the count.
    "bypass": (lambda a, b: np.broadcast_to(np.asarray(a, np.float32), np.broadcast_shapes(
        np.shape(a), np.shape(b))).copy(), None),
    "average": (lambda a, b: (np.asarray(a, np.float32) + b) * np.float32(0.5),
                lambda v, axis=None, keepdims=False: np.mean(v, axis=axis, keepdims=keepdims,
                                                             dtype=np.float32)),
}
COMPARE = {
    "equal": np.equal, "not_equal": np.not_equal, "greater": np.greater,
    "greater_equal": np.greater_equal, "less": np.less, "less_equal": np.less_equal,
}
LOGICAL = {"logical_and": np.logical_and, "logical_or": np.logical_or,
           "logical_xor": np.logical_xor}
BITWISE = {"bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or,
           "bitwise_xor": np.bitwise_xor, "left_shift": np.left_shift,
           "right_shift": np.right_shift}

OPS: dict[str, Op] = {}
for _n, _f in UNARY.items():
    OPS[_n] = Op(_n, "unary", _f)
for _n, (_f, _r) in BINARY.items():
    OPS[_n] = Op(_n, "binary", _f, _r)
for _n, _f in COMPARE.items():
    OPS[_n] = Op(_n, "compare", _cmp(_f))
for _n, _f in LOGICAL.items():
    OPS[_n] = Op(_n, "logical", _cmp(_f),
                 {"logical_and": np.logical_and.reduce, "logical_or": np.logical_or.reduce}.get(_n))
for _n, _f in BITWISE.items():
    OPS[_n] = Op(_n, "bitwise", _f, {"bitwise_and": np.bitwise_and.reduce,
                                     "bitwise_or": np.bitwise_or.reduce}.get(_n))


def _op_by_name(name: str) -> Op:
    return OPS[name]


_NUMPY_ALIASES = {
    np.add: "add", np.subtract: "subtract", np.multiply: "multiply", np.divide: "divide",
    np.maximum: "maximum", np.minimum: "minimum", np.power: "power", np.exp: "exp",
    np.log: "log", np.sqrt: "sqrt", np.tanh: "tanh", np.sin: "sin", np.cos: "cos",
    np.abs: "abs", np.negative: "negative", np.square: "square", np.reciprocal: "reciprocal",
    np.equal: "equal", np.not_equal: "not_equal", np.greater: "greater",
    np.greater_equal: "greater_equal", np.less: "less", np.less_equal: "less_equal",
    np.logical_and: "logical_and", np.logical_or: "logical_or", np.logical_xor: "logical_xor",
    np.bitwise_and: "bitwise_and", np.bitwise_or: "bitwise_or", np.bitwise_xor: "bitwise_xor",
    np.left_shift: "left_shift", np.right_shift: "right_shift", np.sign: "sign",
    np.max: "maximum", np.amax: "maximum", np.min: "minimum", np.amin: "minimum",
    np.sum: "add", np.prod: "multiply", np.fmod: "fmod", np.mod: "mod", np.ceil: "ceil",
    np.floor: "floor", np.logical_not: "logical_not", np.tan: "tan", np.arctan: "arctan",
    np.trunc: "trunc",
}


def op_from_any(op: Any) -> Op | None:
    """The :class:`Op` for ``op`` (an Op, a numpy ufunc/function, or a name), else None."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        return OPS.get(op)
    try:
        name = _NUMPY_ALIASES.get(op)
    except TypeError:
        return None
    return OPS.get(name) if name else None
