"""Kernels shared by several NKI tests (written the way NKI users write them)."""

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def matmul_kernel(lhsT, rhs):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N] (fp32 out), tiled 128 x 128 x 512.

    Keeps TensorE busy: A tiles stay resident in SBUF after their first use, the B column
    block of the next N step is prefetched while the current one is multiplied, PSUM
    accumulates over K, and fresh PSUM/SBUF tiles per block let the copy-out and store of one
    block overlap the matmuls of the next.
    """
    K, M = lhsT.shape
    _, N = rhs.shape
    TK, TM, TN = 128, 128, 512
    KT, MT, NT = K // TK, M // TM, N // TN
    out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)

    def load_a(m):
        for k in range(KT):
            a = nl.ndarray((TK, TM), lhsT.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
            a_tiles[m][k] = a

    def load_b(n, k):
        b = nl.ndarray((TK, TN), rhs.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
        return b

    a_tiles = [[None] * KT for _ in range(MT)]
    b_next = [load_b(0, k) for k in range(KT)]
    load_a(0)
    for n in range(NT):
        b_tiles = b_next
        b_next = [None] * KT
        for m in range(MT):
            # Software pipelining: issue the DMAs the *next* iteration needs before this
            # iteration's matmuls, so they overlap TensorE work instead of stalling it.
            if n == 0 and m + 1 < MT:
                load_a(m + 1)
            if n + 1 < NT:
                for k in range(m * KT // MT, (m + 1) * KT // MT):
                    b_next[k] = load_b(n + 1, k)
            ps = nl.ndarray((TM, TN), nl.float32, buffer=nl.psum)
            for k in range(KT):
                nisa.nc_matmul(ps, a_tiles[m][k], b_tiles[k])
            res = nl.ndarray((TM, TN), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(res, ps)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def copy_kernel(src):
    """HBM -> SBUF -> HBM copy in [128, F] chunks of 16 KiB per partition (DMA bound)."""
    P, F = src.shape
    TF = 4096
    out = nl.ndarray(src.shape, src.dtype, buffer=nl.shared_hbm)
    for j in range(F // TF):
        t = nl.ndarray((P, TF), src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=src[:, j * TF:(j + 1) * TF])
        nisa.dma_copy(dst=out[:, j * TF:(j + 1) * TF], src=t)
    return out


@nki.jit
def softmax_kernel(x):
    """Row softmax of a [P<=128, F] input with one fused exp+sum activation."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x)
    nl.store(out, nl.softmax(t))
    return out
