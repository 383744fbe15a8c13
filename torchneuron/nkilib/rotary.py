"""``rope``: rotary position embedding (half rotation, Llama/NeoX style), and its reference.

Layouts: ``x`` (B, S, H, d) -- queries or keys straight out of the projection, heads
unfolded; ``cos``, ``sin`` (S, d/2) (the per-position angles, shared by all heads). With
``x1 = x[..., :d/2]``, ``x2 = x[..., d/2:]``::

    out = concat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)   (same shape and dtype as x)

Tiling: 128 positions per tile on partitions, all heads x head dim on the free axis (so
every instruction covers H*d/2 elements); cos/sin tiles are loaded once per position tile and
broadcast over heads with stride-0 views. The first output half is computed on VectorE, the
second on GpSimd, in parallel. LNC=2 splits position tiles between the programs.

Limits: d even, d <= 256, H * d <= 16384. Numerics: fp32 arithmetic, one output rounding;
tolerance vs :func:`rope_ref`: fp32 1e-5, bf16 1e-2.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, cdiv, shape_error


@nki.jit
def rope(x, cos, sin):
    """Apply rotary embeddings to ``x`` (B, S, H, d); see the module docstring."""
    if x.ndim != 4:
        shape_error("rope", f"x must be (B, S, H, d), got {x.shape}", "unfold heads: (B, S, H, d)")
    B, S, H, d = x.shape
    h2 = d // 2
    if d % 2 or d > 256 or H * d > 16384:
        shape_error("rope", f"head dim d={d} must be even and <= 256, and H*d={H * d} <= 16384",
                    "use an even head dim; split heads across calls")
    if tuple(cos.shape) != (S, h2) or tuple(sin.shape) != (S, h2):
        shape_error("rope", f"cos {cos.shape} and sin {sin.shape} must be (S, d/2) = ({S}, {h2})",
                    "pass the per-position angle tables")
    out = nl.ndarray((B, S, H, d), x.dtype, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    for i in range(pid, cdiv(S, P), nl.num_programs()):
        s0 = i * P
        rows = min(P, S - s0)
        ct = nl.ndarray((rows, 1, h2), nl.float32, buffer=nl.sbuf)
        st = nl.ndarray((rows, 1, h2), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ct, src=cos[s0:s0 + rows, :])
        nisa.dma_copy(dst=st, src=sin[s0:s0 + rows, :])
        cb = ct.broadcast_to((rows, H, h2))
        sb = st.broadcast_to((rows, H, h2))
        for b in range(B):
            xt = nl.ndarray((rows, H, d), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=xt, src=x[b, s0:s0 + rows, :, :])
            x1 = xt[:, :, :h2]
            x2 = xt[:, :, h2:]
            o = nl.ndarray((rows, H, d), x.dtype, buffer=nl.sbuf)
            # first half on VectorE, second half on GpSimd: independent, so they overlap
            for (a, bb, sign, dst, eng) in ((x1, x2, nl.subtract, o[:, :, :h2], nisa.engine.vector),
                                            (x2, x1, nl.add, o[:, :, h2:], nisa.engine.gpsimd)):
                t1 = nl.ndarray((rows, H, h2), nl.float32, buffer=nl.sbuf)
                t2 = nl.ndarray((rows, H, h2), nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(t1, a, cb, nl.multiply, engine=eng)
                nisa.tensor_tensor(t2, bb, sb, nl.multiply, engine=eng)
                nisa.tensor_tensor(dst, t1, t2, sign, engine=eng)
            nisa.dma_copy(dst=out[b, s0:s0 + rows, :, :], src=o)
    return out


def rope_ref(x, cos, sin):
    """PyTorch reference (fp32 math, output in x's dtype)."""
    import torch
    xf = x.float()
    h2 = x.shape[-1] // 2
    c = cos.float()[None, :, None, :]
    s = sin.float()[None, :, None, :]
    x1, x2 = xf[..., :h2], xf[..., h2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
