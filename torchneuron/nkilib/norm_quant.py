"""``rmsnorm_quant``: optional RMSNorm followed by FP8 (float8_e4m3) quantisation.

Along the last dimension H of ``hidden`` (leading dims folded into rows), with
``y = x / sqrt(mean(x^2) + eps) * ln_w`` (or ``y = x`` without normalisation):

* **row quantisation**: per row ``amax = max |y|`` (both clipped to ``lower_bound`` when it is
  > 0), ``dequant = max(amax / 240, 1e-6)``, ``q = fp8(y / dequant)``; the output is
  ``[..., H + 4]`` float8_e4m3 whose last 4 bytes of each row are the fp32 ``dequant`` (so
  ``out[..., H:].view(float32)`` is the per-row scale).
* **static quantisation**: ``q = fp8(clip(y / input_dequant_scale, -240, 240))`` with the
  scalar ``input_dequant_scale`` ([128, 1], all equal); the output is ``[..., H]``.

240 is float8_e4m3's largest finite value. fp8 conversion rounds to nearest even.

Tiling: 128 rows per tile on partitions, the whole row on the free axis (H <= 16384);
sum of squares fused into a ScalarE square (``activation`` with an add reduction), the row
max fused into a VectorE ``tensor_scalar_reduce`` (|y|, max). LNC=2 splits row tiles between
the cores. AWS NKI-lib's signature (``rmsnorm_quant_kernel(hidden, ln_w, kargs,
input_dequant_scale)``) is in ``nkilib.core.rmsnorm.rmsnorm_quant``.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, arg_error, cdiv, shape_error

FP8_MAX = 240.0
MIN_DEQUANT = 1e-6


@nki.jit
def rmsnorm_quant(hidden, ln_w, rms_norm=True, row_quant=True, eps=1e-6, lower_bound=0.0,
                  input_dequant_scale=None):
    """RMSNorm (optional) + FP8 quantisation of ``hidden`` along its last dim (module docstring)."""
    name = "rmsnorm_quant"
    if hidden.ndim < 2:
        shape_error(name, f"hidden must have at least 2 dims, got {hidden.shape}", "pass [B, S, H]")
    H = hidden.shape[-1]
    R = 1
    for s in hidden.shape[:-1]:
        R *= s
    if H > 16384:
        shape_error(name, f"H={H} exceeds 16384", "split the hidden dimension")
    if rms_norm and tuple(ln_w.shape) not in ((H,), (1, H)):
        shape_error(name, f"ln_w {ln_w.shape} must be (H,) or (1, H) with H={H}", "pass gamma")
    if not row_quant and input_dequant_scale is None:
        arg_error(name, "static quantisation needs input_dequant_scale", "pass a [128, 1] scale")
    if lower_bound < 0:
        arg_error(name, f"lower_bound={lower_bound} must be >= 0", "pass a non-negative bound")
    W = H + 4 if row_quant else H
    out_shape = tuple(hidden.shape[:-1]) + (W,)
    out = nl.ndarray(out_shape, nl.float8_e4m3, buffer=nl.shared_hbm)
    x2 = hidden.reshape((R, H))
    o2 = out.reshape((R, W))
    gam = None
    if rms_norm:
        gam = nl.ndarray((P, H), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=gam, src=ln_w.reshape((1, H)).broadcast_to((P, H)))
    inv_static = None
    if not row_quant:
        inv_static = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=inv_static, src=input_dequant_scale[0:1, 0:1].broadcast_to((P, 1)))
        nisa.reciprocal(inv_static, inv_static)
    pid, nprog = nl.program_id(0), nl.num_programs()
    for i in range(pid, cdiv(R, P), nprog):
        r0 = i * P
        rows = min(P, R - r0)
        x = nl.ndarray((rows, H), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=x2[r0:r0 + rows, :])
        y = x
        if rms_norm:
            sq = nl.ndarray((rows, H), nl.float32, buffer=nl.sbuf)
            ss = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(sq, nl.square, x, reduce_op=nl.add, reduce_res=ss)
            nisa.tensor_scalar(ss, ss, nl.multiply, 1.0 / H, op1=nl.add, operand1=float(eps))
            nisa.activation(ss, nl.rsqrt, ss)
            y = nl.ndarray((rows, H), nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(y, x, nl.multiply, ss, nl.multiply, gam[:rows, :])
        o = nl.ndarray((rows, W), nl.float8_e4m3, buffer=nl.sbuf)
        if row_quant:
            if lower_bound > 0:
                nisa.tensor_scalar(y, y, nl.minimum, float(lower_bound), op1=nl.maximum,
                                   operand1=-float(lower_bound))
            ay = nl.ndarray((rows, H), nl.float32, buffer=nl.sbuf)
            deq = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar_reduce(ay, y, nl.abs, 0.0, nl.maximum, reduce_res=deq)
            nisa.tensor_scalar(deq, deq, nl.multiply, 1.0 / FP8_MAX, op1=nl.maximum,
                               operand1=MIN_DEQUANT)
            inv = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(inv, deq)
            nisa.tensor_scalar(o[:, :H], y, nl.multiply, inv)
            nisa.tensor_copy(o[:, H:H + 4].view(nl.float32), deq)  # 4 fp8 bytes = fp32 scale
        else:
            nisa.tensor_scalar(o, y, nl.multiply, inv_static[:rows, :], op1=nl.minimum,
                               operand1=FP8_MAX)
            nisa.tensor_scalar(o, o, nl.maximum, -FP8_MAX)
        nisa.dma_copy(dst=o2[r0:r0 + rows, :], src=o)
    return out


def rmsnorm_quant_ref(hidden, ln_w, rms_norm=True, row_quant=True, eps=1e-6, lower_bound=0.0,
                      input_dequant_scale=None):
    """numpy reference: (quantised values as float32 [..., H], per-row fp32 dequant scale
    [..., 1] or None)."""
    import ml_dtypes
    import numpy as np
    x = np.asarray(hidden, np.float32)
    y = x
    if rms_norm:
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * \
            np.asarray(ln_w, np.float32).reshape(-1)
    if row_quant:
        if lower_bound > 0:
            y = np.clip(y, -lower_bound, lower_bound)
        deq = np.maximum(np.abs(y).max(-1, keepdims=True) / FP8_MAX, MIN_DEQUANT).astype(np.float32)
        q = (y * (np.float32(1) / deq)).astype(ml_dtypes.float8_e4m3).astype(np.float32)
        return q, deq
    s = np.float32(1) / np.asarray(input_dequant_scale, np.float32).reshape(-1)[0]
    q = np.clip(y * s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3).astype(np.float32)
    return q, None
