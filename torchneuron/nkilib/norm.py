"""``rmsnorm``: RMS normalisation with a learned scale, and its reference.

Layout: ``x`` (N, H) -- fold leading dims into N; ``w`` (H,); ``out`` (N, H) in x's dtype:
``out = x * rsqrt(mean(x**2, -1) + eps) * w`` (Llama RMSNorm).

Tiling: 128 x J rows per tile (J consecutive rows per partition, J = 16 KiB / row bytes, so
each DMA moves ~2 MiB), the whole hidden dim on the free axis (H <= 16384). Per row: ScalarE squares
with a fused row sum, ScalarE rsqrt(sum / H + eps) in one activation (scale and bias), VectorE
scales by the per-row factor (16-bit fast path) and multiplies by the weight, which is
broadcast to all partitions once by DMA. LNC=2 splits the row tiles between the programs.

Numerics: statistics in fp32; the output is rounded once. Tolerance vs :func:`rmsnorm_ref`:
fp32 1e-5, bf16 1e-2 (one bf16 rounding of x * r plus the output rounding).

:func:`rmsnorm_bwd` (dx, dw) is the backward kernel, :func:`rmsnorm_bwd_ref` its reference;
tolerance fp32 1e-5, bf16 1e-2 (dy w and dy x are rounded to bf16 before the fp32 sums and
TensorE products; the per-row factors keep ~fp32 precision).
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, matmul_dtype, shape_error

H_MAX = 16384


@nki.jit
def rmsnorm(x, w, eps=1e-6):
    """RMSNorm of ``x`` (N, H) with weight ``w`` (H,). See the module docstring."""
    if x.ndim != 2 or w.ndim != 1 or w.shape[0] != x.shape[1]:
        shape_error("rmsnorm", f"x must be (N, H) and w (H,), got {x.shape} and {w.shape}",
                    "flatten leading dimensions of x into N")
    N, H = x.shape
    if H > H_MAX:
        shape_error("rmsnorm", f"hidden size H={H} exceeds the limit H <= {H_MAX} (one SBUF "
                    "row per token)", "split the hidden dimension")
    out = nl.ndarray((N, H), x.dtype, buffer=nl.shared_hbm)
    wb = nl.ndarray((P, H), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=wb, src=w.reshape((1, H)).broadcast_to((P, H)))
    # J consecutive rows per partition (contiguous in HBM) so each DMA moves ~2 MiB: the
    # fixed cost per DMA chunk makes 64 KiB chunks only ~70% efficient
    J = max(1, min(8, 16384 // (H * x.dtype.itemsize)))
    tiles = []
    r = 0
    while r < N:
        if N - r >= P * J:
            tiles.append((r, P, J))
            r += P * J
        else:
            rows = min(P, N - r)
            tiles.append((r, rows, 1))
            r += rows
    pid = nl.program_id(0)
    for (r0, rows, j) in tiles[pid::nl.num_programs()]:
        xt = nl.ndarray((rows, j, H), x.dtype, buffer=nl.sbuf)
        src = x[r0:r0 + rows * j, :].reshape((rows, j, H))
        nisa.dma_copy(dst=xt, src=src)
        ss = nl.ndarray((rows, j), nl.float32, buffer=nl.sbuf)
        sq = nl.ndarray((rows, H), x.dtype, buffer=nl.sbuf)
        for jj in range(j):
            nisa.activation(sq, nl.square, xt[:, jj, :], reduce_op=nl.add,
                            reduce_res=ss[:, jj:jj + 1])
        rinv = nl.ndarray((rows, j), nl.float32, buffer=nl.sbuf)
        nisa.activation(rinv, nl.rsqrt, ss, scale=1.0 / H, bias=float(eps))
        o = nl.ndarray((rows, j, H), x.dtype, buffer=nl.sbuf)
        for jj in range(j):
            nisa.tensor_scalar(o[:, jj, :], xt[:, jj, :], nl.multiply, rinv[:, jj:jj + 1])
            nisa.tensor_tensor(o[:, jj, :], o[:, jj, :], wb[:rows, :], nl.multiply)
        nisa.dma_copy(dst=out[r0:r0 + rows * j, :].reshape((rows, j, H)), src=o)
    return out


def rmsnorm_ref(x, w, eps=1e-6):
    """PyTorch reference (fp32 math, output in x's dtype)."""
    import torch
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


CW = 2048  # columns per elementwise chunk of the backward (bounds the SBUF temporaries)
XW = 512   # columns per dx matmul (one fp32 PSUM bank)


def _split_hi_lo(col, rows, mdt):
    """[rows, 1] fp32 -> (hi, lo) in mdt with hi + lo ~= col to ~2^-17 (bf16), or (col,)
    unchanged for fp32 -- lets bf16 TensorE products carry fp32 per-row factors."""
    if mdt == nl.float32:
        return (col,)
    hi = nl.ndarray((rows, 1), mdt, buffer=nl.sbuf)
    nisa.tensor_copy(hi, col)
    lo32 = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(lo32, col, hi, nl.subtract)
    lo = nl.ndarray((rows, 1), mdt, buffer=nl.sbuf)
    nisa.tensor_copy(lo, lo32)
    return (hi, lo)


@nki.jit
def rmsnorm_bwd(x, w, dy, eps=1e-6):
    """Backward of :func:`rmsnorm`: ``(dx, dw)`` for ``x``, ``dy`` (N, H) and ``w`` (H,).

    With r = rsqrt(mean(x^2) + eps) and g = dy * w per row: ``dx = r g - x r^3 mean(g x)``,
    ``dw = sum over rows of dy x r``. dx is in x's dtype. dw: (H,) in w's dtype under LNC=1;
    under LNC=2 each core writes its own fp32 partial sum over its row tiles, dw is (2, H)
    float32 and the caller sums dim 0 (no cross-core synchronisation, like moe_cte's
    shard-on-block).

    Per 128-row tile (rows on partitions, the hidden dim on the free axis, in chunks of 2048
    columns): GpSimd g = dy w; ScalarE sum(x^2) -> r; VectorE p = dy x, GpSimd p w with the
    row sums on VectorE -> mean(g x); TensorE does the cross-partition reduction and the row
    scalings: dw[h] += sum_rows p[row, h] r[row] (stationary p chunk [rows, 128], moving
    r [rows, 1]; dw lives in one PSUM bank as [128, H/128] and accumulates over all row
    tiles), and dx = diag(r) g + diag(-c) x (stationary diagonal matrices, moving 512-column
    chunks, summed in PSUM), copied out on ScalarE. For bf16 the per-row factors are split
    hi + lo in bf16 (two matmuls each) so they act at ~fp32 precision. Tiles are
    software-pipelined (statistics of tile i+1 issued before the dx of tile i; loads up to two
    tiles ahead). Rows too large to keep x, dy, g and p resident (fp32 H > ~6K, bf16
    H > ~12K) stream dy in chunks instead (dy is then read twice).
    """
    name = "rmsnorm_bwd"
    if x.ndim != 2 or w.ndim != 1 or w.shape[0] != x.shape[1] or \
            tuple(dy.shape) != tuple(x.shape):
        shape_error(name, f"x and dy must be (N, H) and w (H,), got x {x.shape}, w {w.shape}, "
                    f"dy {dy.shape}", "flatten leading dimensions of x and dy into N")
    N, H = x.shape
    if H > H_MAX:
        shape_error(name, f"hidden size H={H} exceeds the limit H <= {H_MAX} (one SBUF row "
                    "per token)", "split the hidden dimension")
    mdt = matmul_dtype(x.dtype)
    nprog = nl.num_programs()
    pid = nl.program_id(0)
    dx = nl.ndarray((N, H), x.dtype, buffer=nl.shared_hbm)
    dw_all = nl.ndarray((nprog, H) if nprog > 1 else (H,),
                        nl.float32 if nprog > 1 else w.dtype, buffer=nl.shared_hbm)
    HC = (H + P - 1) // P
    NCH = (H + CW - 1) // CW
    ident = nl.shared_identity_matrix(P, nl.float32)
    wb = nl.ndarray((P, H), mdt, buffer=nl.sbuf)
    nisa.dma_copy(dst=wb, src=w.reshape((1, H)).broadcast_to((P, H)))
    dw_ps = nl.ndarray((P, HC), nl.float32, buffer=nl.psum)  # dw[hc*128 + p] at [p, hc]
    dx_ps = [nl.ndarray((P, XW), nl.float32, buffer=nl.psum) for _ in range(3)]
    b = mdt.itemsize
    # Large rows (fp32 H > ~6K, bf16 H > ~12K): x resident, dy streamed in 2048-column chunks
    # (read twice: for the statistics and for dx), p and g per chunk, dx stored per chunk.
    lowmem = 6 * H * b + 6 * CW * b > 190000
    whole_dx = not lowmem  # dx row tile in SBUF, stored with one DMA
    state = {"n_mm": 0, "first": True}

    def load(t0):
        rows = min(P, N - t0)
        xt = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)  # (DMA casts other floats)
        nisa.dma_copy(dst=xt, src=x[t0:t0 + rows, :])
        dyt = None
        if not lowmem:
            dyt = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
            nisa.dma_copy(dst=dyt, src=dy[t0:t0 + rows, :])
        return t0, rows, xt, dyt

    def dy_chunk(t0, rows, c0, cw):
        t = nl.ndarray((rows, cw), mdt, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=dy[t0:t0 + rows, c0:c0 + cw])
        return t

    def sumsq_parts(rows, xt):
        """Per-chunk sums of x^2 of a row tile (ScalarE), (rows, NCH) fp32."""
        ssp = nl.ndarray((rows, NCH), nl.float32, buffer=nl.sbuf)
        for ci in range(NCH):
            c0 = ci * CW
            cw = min(CW, H - c0)
            sq = nl.ndarray((rows, cw), mdt, buffer=nl.sbuf)
            nisa.activation(sq, nl.square, xt[:, c0:c0 + cw], reduce_op=nl.add,
                            reduce_res=ssp[:, ci:ci + 1])
        return ssp

    def stage_a_lowmem(t0, rows, xt):
        """stage_a for large rows: statistics first, then one pass over dy chunks."""
        ssp = sumsq_parts(rows, xt)
        ss = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(ss, nl.add, ssp, axis=1)
        r = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(r, nl.rsqrt, ss, scale=1.0 / H, bias=float(eps))
        r_parts = _split_hi_lo(r, rows, mdt)
        sp = nl.ndarray((rows, NCH), nl.float32, buffer=nl.sbuf)
        for ci in range(NCH):
            c0 = ci * CW
            cw = min(CW, H - c0)
            dyc = dy_chunk(t0, rows, c0, cw)
            pc = nl.ndarray((rows, cw), mdt, buffer=nl.sbuf)
            nisa.tensor_tensor(pc, dyc, xt[:, c0:c0 + cw], nl.multiply)
            for hc in range(c0 // P, (c0 + cw + P - 1) // P):
                kh = min(P, H - hc * P)
                for k, rp in enumerate(r_parts):
                    nisa.nc_matmul(dw_ps[:kh, hc:hc + 1], pc[:, hc * P - c0:hc * P - c0 + kh],
                                   rp, accumulate=not (state["first"] and k == 0))
            q = nl.ndarray((rows, cw), mdt, buffer=nl.sbuf)
            nisa.tensor_tensor(q, pc, wb[:rows, c0:c0 + cw], nl.multiply,
                               engine=nisa.engine.gpsimd)
            nisa.tensor_reduce(sp[:, ci:ci + 1], nl.add, q, axis=1)
        return r, sp

    def stage_a(ld):
        """r, the dw contribution, -c = -r^3 mean(g x) and the dx diagonals of a row tile."""
        t0, rows, xt, dyt = ld
        if lowmem:
            r, sp = stage_a_lowmem(t0, rows, xt)
            return finish_a(t0, rows, xt, None, r, sp)
        # g = dy w first (GpSimd): stage_b's inputs then depend on nothing issued after this
        # tile's statistics, so the per-engine queues never chain consecutive tiles
        g = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
        for c0 in range(0, H, CW):
            cw = min(CW, H - c0)
            nisa.tensor_tensor(g[:, c0:c0 + cw], dyt[:, c0:c0 + cw], wb[:rows, c0:c0 + cw],
                               nl.multiply, engine=nisa.engine.gpsimd)
        # sum(x^2) on ScalarE; p = dy x (VectorE) and p w (GpSimd) need no statistics, so
        # they are issued before the row factors (in-order queues)
        ssp = sumsq_parts(rows, xt)
        p = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
        qs = []
        for ci in range(NCH):
            c0 = ci * CW
            cw = min(CW, H - c0)
            nisa.tensor_tensor(p[:, c0:c0 + cw], dyt[:, c0:c0 + cw], xt[:, c0:c0 + cw],
                               nl.multiply)
            q = nl.ndarray((rows, cw), mdt, buffer=nl.sbuf)
            nisa.tensor_tensor(q, p[:, c0:c0 + cw], wb[:rows, c0:c0 + cw], nl.multiply,
                               engine=nisa.engine.gpsimd)
            qs.append(q)
        # r = rsqrt(mean(x^2) + eps)
        ss = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(ss, nl.add, ssp, axis=1)
        r = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(r, nl.rsqrt, ss, scale=1.0 / H, bias=float(eps))
        r_parts = _split_hi_lo(r, rows, mdt)
        # dw[h] += sum_rows p[row, h] r[row] (TensorE, accumulated in PSUM over row tiles)
        for hc in range(HC):
            kh = min(P, H - hc * P)
            for k, rp in enumerate(r_parts):
                nisa.nc_matmul(dw_ps[:kh, hc:hc + 1], p[:, hc * P:hc * P + kh], rp,
                               accumulate=not (state["first"] and k == 0))
        # mean(g x) = sum(p w) / H
        sp = nl.ndarray((rows, NCH), nl.float32, buffer=nl.sbuf)
        for ci in range(NCH):
            nisa.tensor_reduce(sp[:, ci:ci + 1], nl.add, qs[ci], axis=1)
        return finish_a(t0, rows, xt, g, r, sp)

    def finish_a(t0, rows, xt, g, r, sp):
        state["first"] = False
        s = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(s, nl.add, sp, axis=1)
        # -c = -r^3 s / H
        nc = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(nc, r, r, nl.multiply, engine=nisa.engine.gpsimd)
        nisa.tensor_tensor(nc, nc, r, nl.multiply, engine=nisa.engine.gpsimd)
        nisa.scalar_tensor_tensor(nc, nc, nl.multiply, -1.0 / H, nl.multiply, s)
        diags = []
        for col, data in ((r, "g"), (nc, "x")):
            for part in _split_hi_lo(col, rows, mdt):
                d = nl.ndarray((rows, rows), mdt, buffer=nl.sbuf)
                nisa.tensor_scalar(d, ident[:rows, :rows], nl.multiply, part,
                                   engine=nisa.engine.gpsimd)
                diags.append((d, data))
        return t0, rows, xt, g, diags

    def stage_b(st):
        """dx = diag(r) g + diag(-c) x, summed in PSUM, copied out on ScalarE, stored."""
        t0, rows, xt, g, diags = st
        if whole_dx:
            dxt = nl.ndarray((rows, H), x.dtype, buffer=nl.sbuf)
        for ci in range(NCH):
            c0 = ci * CW
            cw = min(CW, H - c0)
            if not whole_dx:
                dxc = nl.ndarray((rows, cw), x.dtype, buffer=nl.sbuf)
            if g is None:  # large rows: g = dy w for this chunk only
                gc = nl.ndarray((rows, cw), mdt, buffer=nl.sbuf)
                nisa.tensor_tensor(gc, dy_chunk(t0, rows, c0, cw), wb[:rows, c0:c0 + cw],
                                   nl.multiply, engine=nisa.engine.gpsimd)
            else:
                gc = g[:, c0:c0 + cw]
            for m0 in range(0, cw, XW):
                mw = min(XW, cw - m0)
                ps = dx_ps[state["n_mm"] % len(dx_ps)][:rows, :mw]
                state["n_mm"] += 1
                for k, (d, data) in enumerate(diags):
                    mov = gc[:, m0:m0 + mw] if data == "g" else xt[:, c0 + m0:c0 + m0 + mw]
                    nisa.nc_matmul(ps, d, mov, accumulate=k > 0)
                dst = dxt[:, c0 + m0:c0 + m0 + mw] if whole_dx else dxc[:, m0:m0 + mw]
                nisa.activation(dst, nl.identity, ps)
            if not whole_dx:
                nisa.dma_copy(dst=dx[t0:t0 + rows, c0:c0 + cw], src=dxc)
        if whole_dx:
            nisa.dma_copy(dst=dx[t0:t0 + rows, :], src=dxt)

    # software pipeline: tile i's dx (stage_b) is issued after tile i+1's statistics
    # (stage_a) and loads run `ahead` tiles in front. The engines are in-order queues and each
    # tile's work is a chain across all of them (ScalarE -> VectorE -> GpSimd -> TensorE ->
    # ScalarE); this order lets consecutive tiles' chains overlap. Not pipelined when the live
    # tiles would not fit in SBUF (large H).
    starts = list(range(pid * P, N, nprog * P))
    tile_bytes = 4 * H * b
    depth, ahead = 0, 0
    for dpt, ahd in ((1, 2), (1, 1)):
        if not lowmem and (dpt + ahd + 1) * tile_bytes + H * x.dtype.itemsize <= 120000:
            depth, ahead = dpt, ahd
            break
    loads = [load(t) for t in starts[:ahead + 1]]
    staged = []
    for i in range(len(starts)):
        staged.append(stage_a(loads[i]))
        loads[i] = None
        if not depth:  # one tile at a time: finish it before the next load
            stage_b(staged[i])
            staged[i] = None
        if i + ahead + 1 < len(starts):
            loads.append(load(starts[i + ahead + 1]))
        if depth and i >= depth:
            stage_b(staged[i - depth])
            staged[i - depth] = None
    for i in range(max(0, len(starts) - depth), len(starts)):
        if staged[i] is not None:
            stage_b(staged[i])
            staged[i] = None
    first = state["first"]
    # dw: [p, hc] (h = hc*128 + p) -> HBM
    dwt = nl.ndarray((P, HC), dw_all.dtype, buffer=nl.sbuf)
    if first:  # this program got no rows (LNC=2, N <= 128): zero partial
        nisa.memset(dwt, 0.0)
    else:
        if H >= P:
            nisa.tensor_copy(dwt[:, :H // P], dw_ps[:, :H // P])
        if H % P:
            nisa.tensor_copy(dwt[:H % P, H // P:HC], dw_ps[:H % P, H // P:HC])
    base = pid * H if nprog > 1 else 0
    if H >= P:
        nisa.dma_copy(dst=dw_all.ap([[1, P], [P, H // P]], offset=base), src=dwt[:, :H // P])
    if H % P:
        nisa.dma_copy(dst=dw_all.ap([[1, H % P], [1, 1]], offset=base + (H // P) * P),
                      src=dwt[:H % P, H // P:HC])
    return dx, dw_all


def rmsnorm_bwd_ref(x, w, dy, eps=1e-6):
    """PyTorch reference of :func:`rmsnorm_bwd` (fp32 math): ``(dx in x's dtype, dw (H,) in
    w's dtype)``."""
    import torch
    xf, wf, gf = x.float(), w.float(), dy.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    g = gf * wf
    dx = r * g - xf * r.pow(3) * (g * xf).mean(-1, keepdim=True)
    dw = (gf * xf * r).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)
