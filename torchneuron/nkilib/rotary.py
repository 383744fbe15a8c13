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


# ---------------------------------------------------------------------------------------------
# AWS NKI-lib layout: nkilib.core.embeddings.rope.RoPE
# ---------------------------------------------------------------------------------------------
FREE = 4096  # elements per partition per instruction (B * H * positions of one tile)


@nki.jit
def rope_dbhs(x_in, cos, sin, lnc_shard=False, contiguous_layout=True, relayout_in_sbuf=False):
    """RoPE in AWS NKI-lib's layout (``nkilib.core.embeddings.rope.RoPE``).

    ``x_in`` (d, B, H, S) with the head dim first; ``cos``, ``sin`` (d/2, B, S). With
    ``contiguous_layout`` the pairs are (i, i + d/2) (half rotation), otherwise (2i, 2i + 1)
    (interleaved, GPT-J). ``lnc_shard`` splits S between the LNC's cores (S % cores == 0).
    ``relayout_in_sbuf`` is accepted: both layouts are handled by strided DMAs here.

    Each pair half is DMA-ed onto partitions 0..d/2-1 of its own tile (strided for the
    interleaved layout), so every compute instruction reads operands that start on the same
    partition; cos / sin are broadcast over heads with stride-0 views. The first output half
    runs on VectorE, the second on GpSimd, in parallel; the halves go back with two DMAs.
    """
    if x_in.ndim != 4:
        shape_error("RoPE", f"x_in must be (d_head, B, n_heads, S), got {x_in.shape}",
                    "pass [d_head, B, n_heads, S]")
    d, B, H, S = x_in.shape
    h2 = d // 2
    if d % 2 or d > 2 * P:
        shape_error("RoPE", f"d_head={d} must be even and <= 256", "use an even head dim <= 256")
    if h2 > P:
        shape_error("RoPE", f"d_head/2={h2} exceeds {P} partitions", "use d_head <= 256")
    if tuple(cos.shape) != (h2, B, S) or tuple(sin.shape) != (h2, B, S):
        shape_error("RoPE", f"cos {cos.shape} and sin {sin.shape} must be (d_head/2, B, S) = "
                    f"({h2}, {B}, {S})", "pass per-position angles for each batch")
    nprog, pid = (nl.num_programs(), nl.program_id(0)) if lnc_shard else (1, 0)
    if S % nprog:
        shape_error("RoPE", f"S={S} is not divisible by the {nprog} LNC cores (lnc_shard=True)",
                    "pad S or launch with lnc_shard=False")
    span = S // nprog
    s_base = pid * span
    out = nl.ndarray((d, B, H, S), x_in.dtype, buffer=nl.shared_hbm)
    # the two halves of every pair: rows [0, h2) / [h2, d) or even / odd rows
    halves = ((x_in[0:h2], out[0:h2]), (x_in[h2:d], out[h2:d])) if contiguous_layout else \
        ((x_in.slice(0, 0, d, 2), out.slice(0, 0, d, 2)),
         (x_in.slice(0, 1, d, 2), out.slice(0, 1, d, 2)))
    st_len = max(1, min(span, FREE // max(B * H, 1)))
    for s0 in range(s_base, s_base + span, st_len):
        w = min(st_len, s_base + span - s0)
        ct = nl.ndarray((h2, B, 1, w), nl.float32, buffer=nl.sbuf)
        sn = nl.ndarray((h2, B, 1, w), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=ct, src=cos[:, :, s0:s0 + w])
        nisa.dma_copy(dst=sn, src=sin[:, :, s0:s0 + w])
        cb = ct.broadcast(2, H)
        sb = sn.broadcast(2, H)
        xa = nl.ndarray((h2, B, H, w), x_in.dtype, buffer=nl.sbuf)
        xb = nl.ndarray((h2, B, H, w), x_in.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xa, src=halves[0][0][:, :, :, s0:s0 + w])
        nisa.dma_copy(dst=xb, src=halves[1][0][:, :, :, s0:s0 + w])
        for (a, b, op, half, eng) in ((xa, xb, nl.subtract, 0, nisa.engine.vector),
                                      (xb, xa, nl.add, 1, nisa.engine.gpsimd)):
            t1 = nl.ndarray((h2, B, H, w), nl.float32, buffer=nl.sbuf)
            t2 = nl.ndarray((h2, B, H, w), nl.float32, buffer=nl.sbuf)
            o = nl.ndarray((h2, B, H, w), x_in.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(t1, a, cb, nl.multiply, engine=eng)
            nisa.tensor_tensor(t2, b, sb, nl.multiply, engine=eng)
            nisa.tensor_tensor(o, t1, t2, op, engine=eng)
            nisa.dma_copy(dst=halves[half][1][:, :, :, s0:s0 + w], src=o)
    return out


def rope_dbhs_ref(x_in, cos, sin, contiguous_layout=True):
    """PyTorch reference of :func:`rope_dbhs` (fp32 math, output in x's dtype)."""
    import torch
    d = x_in.shape[0]
    h2 = d // 2
    xf = x_in.float()
    c = cos.float()[:, :, None, :]
    s = sin.float()[:, :, None, :]
    if contiguous_layout:
        x1, x2 = xf[:h2], xf[h2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=0).to(x_in.dtype)
    x1, x2 = xf[0::2], xf[1::2]
    out = torch.empty_like(xf)
    out[0::2] = x1 * c - x2 * s
    out[1::2] = x2 * c + x1 * s
    return out.to(x_in.dtype)
