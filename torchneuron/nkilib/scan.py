"""``cumsum``: inclusive prefix sum along the last axis, and its reference.

Layout: ``x`` (N, L) -- fold leading dims into N; ``out`` (N, L) in ``x``'s dtype (fp32
accumulation). Rows go on partitions (128 per tile); the scan runs along the free axis with
VectorE ``tensor_tensor_scan`` (``r[i] = r[i-1] * 1 + x[i]``) in chunks of 4096 columns, the
last column of each chunk seeding the next. LNC=2 splits row tiles between the programs.

Numerics: fp32 sequential accumulation (same order as torch.cumsum on fp32);
tolerance vs :func:`cumsum_ref`: fp32 1e-5 * sqrt(L) relative, bf16 1e-2 relative to max |out|.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, cdiv, shape_error

CHUNK = 4096


@nki.jit
def cumsum(x):
    """Inclusive cumulative sum of ``x`` (N, L) along the last axis."""
    if x.ndim != 2:
        shape_error("cumsum", f"x must be (N, L), got {x.shape}", "flatten leading dims into N")
    N, L = x.shape
    out = nl.ndarray((N, L), x.dtype, buffer=nl.shared_hbm)
    ones = nl.ndarray((P, CHUNK), nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0, engine=nisa.engine.gpsimd)
    pid = nl.program_id(0)
    for i in range(pid, cdiv(N, P), nl.num_programs()):
        r0 = i * P
        rows = min(P, N - r0)
        carry = 0.0
        for c0 in range(0, L, CHUNK):
            w = min(CHUNK, L - c0)
            xt = nl.ndarray((rows, w), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=xt, src=x[r0:r0 + rows, c0:c0 + w])
            acc = nl.ndarray((rows, w), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor_scan(acc, ones[:rows, :w], xt, carry, nl.multiply, nl.add)
            carry = acc[:, w - 1:w]
            if x.dtype == nl.float32:
                nisa.dma_copy(dst=out[r0:r0 + rows, c0:c0 + w], src=acc)
            else:
                o = nl.ndarray((rows, w), x.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(o, acc)
                nisa.dma_copy(dst=out[r0:r0 + rows, c0:c0 + w], src=o)
    return out


def cumsum_ref(x):
    """PyTorch reference (fp32 accumulation, output in x's dtype)."""
    return x.float().cumsum(-1).to(x.dtype)
