"""FLOP formulas for the ops ``torch.utils.flop_counter`` does not count.

``FlopCounterMode`` knows matmuls, convolutions and the CUDA SDPA variants. The estimator
(and any ``FlopCounterMode`` after ``import torchneuron.profiler``) also needs elementwise
ops, reductions, norms, softmax, embedding and the CPU/overrideable SDPA variants; they are
registered here with ``register_flop_formula``, so both read one registry.

Counting convention (stated in docs/profiling.md): one FLOP per elementary arithmetic
operation per output element of the textbook formula; a transcendental (exp, tanh, erf...)
counts as one. Gathers and copies are 0 FLOPs.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.utils import flop_counter as _fc

__all__ = ["POINTWISE_FLOPS", "REDUCTION_FLOPS", "NORM_FLOPS", "SOFTMAX_FLOPS", "flops_of",
           "formula_for"]

aten = torch.ops.aten

#: FLOPs per output element of pointwise ops.
POINTWISE_FLOPS: dict[str, int] = {
    **{n: 1 for n in (
        "add", "sub", "mul", "div", "neg", "abs", "rsub", "maximum", "minimum", "clamp",
        "clamp_min", "clamp_max", "relu", "threshold", "threshold_backward", "eq", "ne", "lt",
        "le", "gt", "ge", "where", "masked_fill", "exp", "exp2", "log", "log2", "log1p",
        "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "erf", "sign", "floor", "ceil",
        "round", "trunc", "fmod", "remainder", "pow", "square", "bitwise_and", "bitwise_or",
        "bitwise_not", "logical_and", "logical_or", "logical_not", "hardtanh", "leaky_relu",
        "_to_copy", "fill", "zero", "nan_to_num")},
    "addcmul": 2, "addcdiv": 2, "lerp": 3, "sigmoid": 4, "sigmoid_backward": 3,
    "tanh_backward": 3, "silu": 5, "silu_backward": 8, "gelu": 8, "gelu_backward": 14,
    "softplus": 4, "elu": 4, "mish": 8, "hardswish": 4, "hardsigmoid": 3,
}

#: FLOPs per *input* element of reductions.
REDUCTION_FLOPS: dict[str, int] = {
    "sum": 1, "mean": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "prod": 1, "argmax": 1,
    "argmin": 1, "var": 3, "std": 3, "var_mean": 3, "std_mean": 3, "norm": 2,
    "linalg_vector_norm": 2, "logsumexp": 4, "cumsum": 1, "any": 1, "all": 1,
}

#: FLOPs per element of normalizations (forward: mean, centre, square, sum, scale, affine).
NORM_FLOPS: dict[str, int] = {
    "native_layer_norm": 7, "native_layer_norm_backward": 14, "native_group_norm": 7,
    "native_group_norm_backward": 14, "native_batch_norm": 7, "native_batch_norm_backward": 14,
    "_fused_rms_norm": 4, "_fused_rms_norm_backward": 8, "_batch_norm_with_update": 7,
}

#: FLOPs per element of softmax: max, subtract, exp, sum, divide.
SOFTMAX_FLOPS: dict[str, int] = {
    "_softmax": 5, "_log_softmax": 5, "_softmax_backward_data": 4,
    "_log_softmax_backward_data": 4,
}


def _numel(shape: Any) -> int:
    if shape is None:
        return 0
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple, torch.Size)):
        return sum(_numel(s) for s in shape)  # a tuple of outputs or a tensor list
    return math.prod(shape) if shape else 1


def _first_out(out_shape: Any) -> Any:
    if isinstance(out_shape, (list, tuple)) and out_shape and isinstance(out_shape[0], (list, tuple, torch.Size)):
        return out_shape[0]
    return out_shape


def _per_output(k: int) -> Callable:
    def formula(*args, out_shape=None, **kwargs) -> int:
        return k * _numel(_first_out(out_shape))
    return formula


def _per_input(k: int) -> Callable:
    def formula(*args, out_shape=None, **kwargs) -> int:
        x = args[0] if args else None
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], (list, tuple, torch.Size)):
            return k * sum(_numel(s) for s in x)
        return k * _numel(x if x is not None else _first_out(out_shape))
    return formula


def _embedding(*args, out_shape=None, **kwargs) -> int:
    return 0  # a gather: bytes, no arithmetic


def _embedding_backward(grad_shape, *args, out_shape=None, **kwargs) -> int:
    return _numel(grad_shape)  # one add per gradient element scattered


def _sdpa_fwd(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_flop_count(q, k, v)


def _sdpa_bwd(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return _fc.sdpa_backward_flop_count(grad_out, q, k, v)


def _packet(name: str):
    return getattr(aten, name, None)


_FORMULAS: dict[str, Callable] = {}


def _register_all() -> None:
    table: dict[str, Callable] = {}
    for n, k in POINTWISE_FLOPS.items():
        table[n] = _per_output(k)
    for n, k in REDUCTION_FLOPS.items():
        table[n] = _per_input(k)
    for n, k in {**NORM_FLOPS, **SOFTMAX_FLOPS}.items():
        table[n] = _per_input(k)
    table["embedding"] = _embedding
    table["index_select"] = _embedding
    table["embedding_dense_backward"] = _embedding_backward
    for n in ("_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_fused_attention_overrideable"):
        table[n] = _sdpa_fwd
    for n in ("_scaled_dot_product_flash_attention_for_cpu_backward",
              "_scaled_dot_product_fused_attention_overrideable_backward"):
        table[n] = _sdpa_bwd
    for n, f in table.items():
        packet = _packet(n)
        _FORMULAS[n] = f
        if packet is None or packet in _fc.flop_registry:
            continue
        _fc.register_flop_formula(packet)(f)
    # In-place and out= variants share the functional op's formula (add_, mul_ ...).
    for n in list(table):
        _FORMULAS.setdefault(n + "_", table[n])


_register_all()


def formula_for(op: str) -> Callable | None:
    """The FLOP formula for an ATen op name (overload ignored), as ``f(*input_shapes,
    out_shape=...)``: FlopCounterMode's registry (built-ins and ours), else ours by base name
    (in-place and ``_foreach_`` variants share the functional op's)."""
    base = op.split(".", 1)[0]
    packet = _packet(base)
    if packet is not None and packet in _fc.flop_registry:
        registered = _fc.flop_registry[packet]
        # Registry entries take the output as ``out_val`` (they map tensors to shapes).
        return lambda *shapes, out_shape=None, **kw: registered(*shapes, out_val=out_shape, **kw)
    if base in _FORMULAS:
        return _FORMULAS[base]
    stripped = base[:-1] if base.endswith("_") else base
    if stripped.startswith("_foreach_"):
        stripped = stripped[len("_foreach_"):]
    return _FORMULAS.get(stripped)


def flops_of(op: str, input_shapes: list, output_shapes: list, meta: dict | None = None) -> int:
    """FLOPs of one call of ``op`` given its tensor argument shapes (in argument order) and its
    outputs'. 0 for ops without a formula (data movement)."""
    meta = meta or {}
    base = op.split(".", 1)[0]
    out = output_shapes[0] if len(output_shapes) == 1 else tuple(output_shapes)
    if base in ("convolution_overrideable", "convolution", "_convolution") and len(input_shapes) >= 2:
        return int(_fc.conv_flop_count(list(input_shapes[0]), list(input_shapes[1]),
                                       list(output_shapes[0]) if output_shapes else [],
                                       bool(meta.get("transposed", False))))
    if base == "convolution_backward_overrideable" and len(input_shapes) >= 3:
        go, x, w = input_shapes[:3]
        t = bool(meta.get("transposed", False))
        # grad input and grad weight: two convolutions of the forward's size.
        return 2 * int(_fc.conv_flop_count(list(x), list(w), list(go), t))
    if base.startswith("_foreach_"):
        f = formula_for(base)
        if f is None:
            return 0
        return int(sum(f(s, out_shape=s) for s in (output_shapes or input_shapes)))
    f = formula_for(op)
    if f is None:
        return 0
    try:
        return int(f(*input_shapes, out_shape=out))
    except (TypeError, IndexError, ValueError, AssertionError, RuntimeError):
        return 0
