"""``grouped_mm``: grouped matrix multiply (MoE expert layers), and its PyTorch reference.

Semantics are those of ``torch._grouped_mm(mat_a, mat_b, offs)`` in its 2-D x 3-D form:
tokens are sorted by group and ``offs`` holds the cumulative group ends, so group ``g`` owns
rows ``offs[g-1]:offs[g]`` (``offs[-1] = 0``)::

    a    (T, K)         tokens sorted by group
    b    (G, K, N)      one [K, N] weight per group ([in, out])
    out  (T, N)         out[r] = a[r] @ b[g(r)];  rows >= offs[G-1] are zero

:func:`grouped_mm_wgrad` is the companion that the backward (and the 2-D x 2-D form of
``torch._grouped_mm``) needs: ``out[g] = x[rows of g]^T @ y[rows of g]`` for x (T, M), y (T, N)
-> (G, M, N) (zero for empty groups).

The group ends are trace-time constants (``group_ends``, a tuple of ints): the kernel is
specialised on them, the way the NKI compiler specialises on constant arguments; the torch
op reads ``offs`` on the host.

Algorithm (grouped_mm): per group, rows in chunks of up to 4 x 128; A^T of a chunk is built
once with TensorE transposes (K must be on partitions to be contracted), then for every 512
columns of N the group's weight block [K, 512] is loaded and each 128-row tile accumulates
``A^T[k] . B[k]`` over K in one PSUM bank (full 128 x 128 x 512 matmuls), copied out on
VectorE/ScalarE alternately. Matmuls run in bf16 (fp32 for fp32 inputs) with fp32 PSUM
accumulation. Any T, K, N, G; groups may be empty or start mid-tile.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, arg_error, cdiv, matmul_dtype, shape_error

NB = 512  # output columns per PSUM bank (fp32)
A_T_BUDGET = 64 * 1024  # per-partition bytes for a row chunk's A^T


def _check_ends(name, group_ends, G, T):
    ends = tuple(int(e) for e in group_ends)
    if len(ends) != G:
        shape_error(name, f"group_ends has {len(ends)} entries but there are G={G} groups",
                    "pass one cumulative end per group (torch._grouped_mm's offs)")
    prev = 0
    for e in ends:
        if e < prev or e > T:
            arg_error(name, f"group_ends={ends} must be non-decreasing and within [0, T={T}]",
                      "sort tokens by group and pass cumulative group sizes")
        prev = e
    return ends


@nki.jit
def grouped_mm(a, b, group_ends):
    """Grouped matmul ``out[r] = a[r] @ b[g(r)]`` (see the module docstring)."""
    name = "grouped_mm"
    if a.ndim != 2 or b.ndim != 3:
        shape_error(name, f"a must be (T, K) and b (G, K, N), got {a.shape}, {b.shape}",
                    "pass 2-D tokens and 3-D per-group weights")
    T, K = a.shape
    G, Kb, N = b.shape
    if Kb != K:
        shape_error(name, f"contraction dims differ: a {a.shape} vs b {b.shape}",
                    "b must be (G, K, N) with the K of a")
    ends = _check_ends(name, group_ends, G, T)
    mdt = matmul_dtype(a.dtype)
    out = nl.ndarray((T, N), a.dtype, buffer=nl.shared_hbm)
    ident = nl.shared_identity_matrix(P, a.dtype)
    nk = cdiv(K, P)
    kfull = K // P
    tiles_per_chunk = max(1, min(4, A_T_BUDGET // (nk * P * mdt.itemsize)))
    copies = [0]

    for g in range(G):
        r0 = ends[g - 1] if g else 0
        r1 = ends[g]
        for c0 in range(r0, r1, tiles_per_chunk * P):
            c1 = min(r1, c0 + tiles_per_chunk * P)
            ntile = cdiv(c1 - c0, P)
            # A^T of the chunk: [k in chunk, k chunk, row tile, row]
            aT = nl.ndarray((P, nk, ntile, P), mdt, buffer=nl.sbuf)
            for t in range(ntile):
                rows = min(P, c1 - c0 - t * P)
                araw = nl.ndarray((P, K), a.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=araw[:rows], src=a[c0 + t * P:c0 + t * P + rows, :])
                for c in range(nk):
                    kc = min(P, K - c * P)
                    tp = nl.ndarray((P, P), nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(tp[:kc, :rows], araw[:rows, c * P:c * P + kc],
                                   ident[:rows, :rows], is_transpose=True)
                    nisa.tensor_copy(aT[:kc, c, t, :rows], tp[:kc, :rows])
            for n0 in range(0, N, NB):
                nb = min(NB, N - n0)
                bt = nl.ndarray((P, nk, nb), mdt, buffer=nl.sbuf)
                if kfull:
                    # row k = c * 128 + p of b[g] goes to partition p, chunk c
                    nisa.dma_copy(dst=bt[:, :kfull, :], src=b.ap(
                        [[N, P], [P * N, kfull], [1, nb]], offset=g * K * N + n0))
                if K % P:
                    nisa.dma_copy(dst=bt[:K % P, kfull, :],
                                  src=b[g, kfull * P:K, n0:n0 + nb])
                for t in range(ntile):
                    rows = min(P, c1 - c0 - t * P)
                    ps = nl.ndarray((P, nb), nl.float32, buffer=nl.psum)
                    for c in range(nk):
                        kc = min(P, K - c * P)
                        nisa.nc_matmul(ps[:rows, :], aT[:kc, c, t, :rows], bt[:kc, c, :],
                                       accumulate=c > 0)
                    o_sb = nl.ndarray((P, nb), a.dtype, buffer=nl.sbuf)
                    if copies[0] % 2:
                        nisa.activation(o_sb[:rows], nl.copy, ps[:rows, :])
                    else:
                        nisa.tensor_copy(o_sb[:rows], ps[:rows, :])
                    copies[0] += 1
                    r = c0 + t * P
                    nisa.dma_copy(dst=out[r:r + rows, n0:n0 + nb], src=o_sb[:rows])
    # rows past the last group end belong to no group: defined as zero
    tail = ends[-1] if G else 0
    if tail < T:
        zeros = nl.ndarray((P, N), a.dtype, buffer=nl.sbuf)
        nisa.memset(zeros, 0.0, engine=nisa.engine.gpsimd)
        for r in range(tail, T, P):
            rows = min(P, T - r)
            nisa.dma_copy(dst=out[r:r + rows, :], src=zeros[:rows])
    return out


@nki.jit
def grouped_mm_wgrad(x, y, group_ends):
    """Per-group ``x^T y``: ``out[g] = x[rows of g]^T @ y[rows of g]`` -> (G, M, N).

    x (T, M), y (T, N), tokens sorted by group; empty groups give zeros. The contraction runs
    over tokens, which sit on partitions in the natural (T, .) layout: no transposes.
    """
    name = "grouped_mm_wgrad"
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        shape_error(name, f"x (T, M) and y (T, N) must share T, got {x.shape}, {y.shape}",
                    "pass token-major 2-D tensors with the same number of rows")
    T, M = x.shape
    N = y.shape[1]
    G = len(group_ends)
    ends = _check_ends(name, group_ends, G, T)
    mdt = matmul_dtype(x.dtype)
    out = nl.ndarray((G, M, N), x.dtype, buffer=nl.shared_hbm)
    copies = [0]
    for g in range(G):
        r0 = ends[g - 1] if g else 0
        r1 = ends[g]
        ntc = cdiv(r1 - r0, P)
        for m0 in range(0, M, P):
            mc = min(P, M - m0)
            for n0 in range(0, N, NB):
                nb = min(NB, N - n0)
                o_sb = nl.ndarray((P, nb), x.dtype, buffer=nl.sbuf)
                if ntc == 0:
                    nisa.memset(o_sb[:mc], 0.0, engine=nisa.engine.gpsimd)
                else:
                    ps = nl.ndarray((P, nb), nl.float32, buffer=nl.psum)
                    for t in range(ntc):
                        r = r0 + t * P
                        tc = min(P, r1 - r)
                        xs = nl.ndarray((P, P), mdt, buffer=nl.sbuf)
                        nisa.dma_copy(dst=xs[:tc, :mc], src=x[r:r + tc, m0:m0 + mc])
                        ys = nl.ndarray((P, nb), mdt, buffer=nl.sbuf)
                        nisa.dma_copy(dst=ys[:tc], src=y[r:r + tc, n0:n0 + nb])
                        nisa.nc_matmul(ps[:mc, :], xs[:tc, :mc], ys[:tc], accumulate=t > 0)
                    if copies[0] % 2:
                        nisa.activation(o_sb[:mc], nl.copy, ps[:mc, :])
                    else:
                        nisa.tensor_copy(o_sb[:mc], ps[:mc, :])
                    copies[0] += 1
                nisa.dma_copy(dst=out[g, m0:m0 + mc, n0:n0 + nb], src=o_sb[:mc])
    return out


def grouped_mm_ref(a, b, group_ends):
    """PyTorch reference of :func:`grouped_mm` (float32 math, output in a's dtype)."""
    import torch
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32)
    r0 = 0
    for g, r1 in enumerate(int(e) for e in group_ends):
        out[r0:r1] = a[r0:r1].float() @ b[g].float()
        r0 = r1
    return out.to(a.dtype)


def grouped_mm_wgrad_ref(x, y, group_ends):
    """PyTorch reference of :func:`grouped_mm_wgrad`."""
    import torch
    out = torch.zeros(len(group_ends), x.shape[1], y.shape[1], dtype=torch.float32)
    r0 = 0
    for g, r1 in enumerate(int(e) for e in group_ends):
        out[g] = x[r0:r1].float().T @ y[r0:r1].float()
        r0 = r1
    return out.to(x.dtype)
