"""``mlp``: gated (SwiGLU) MLP, ``out = (silu(x Wg) * (x Wu)) Wd``, and its reference.

Layouts: ``x`` (T, H); ``w_gate``, ``w_up`` (H, I); ``w_down`` (I, H) -- weights as
``[in, out]`` (transpose ``nn.Linear.weight``); ``out`` (T, H) in x's dtype.

Tiling (shared with ``moe_cte``): tokens in tiles of up to 512. x^T [H, 512] is built with
TensorE transposes; phase 1 computes h^T [I, 512] = silu(Wg^T x^T) * (Wu^T x^T) per 128-row
chunk of I (weights are the stationary operand, 512 tokens the moving one: every matmul is a
full [128 x 128] x [128 x 512] tile), SiLU on ScalarE straight from PSUM and the product on
VectorE; phase 2 computes out [128 tokens, 512 of H] = sum over I chunks of
h^T[chunk]^T Wd[chunk] (h^T already has I on partitions, so no transpose is needed).
Weights stream from HBM once per token tile (512 tokens x 2 flops per weight byte pair keeps
TensorE, not HBM, the bound). LNC=2 splits the token tiles between the programs.

Limits: any T, H, I >= 1 (ragged tiles handled). Numerics: bf16 matmuls (fp32 for fp32
inputs) with fp32 accumulation; h is rounded to the matmul dtype. Tolerance vs
:func:`mlp_ref`: fp32 1e-4 relative to max |out|; bf16 2e-2.

:func:`mlp_bwd` is the backward kernel (recomputes h_g, h_u; see its docstring),
:func:`mlp_bwd_ref` its reference. Tolerance (max |err| / max |ref|): fp32 1e-5, bf16 2e-2.
Limit: the per-token-tile SBUF working set (x^T, dy^T [H, tokens], dh_g^T, dh_u^T
[I, tokens], streamed weight blocks) must fit with 128-token tiles: about 16 H + 4 I + 6K
bytes per partition (bf16; twice that for fp32) <= 170000 -- e.g. bf16 H = 4096 with I up to
~24K, H = 8192 with I up to ~8K, not H = 16384; larger shapes raise an NKIShapeError (shard
I across calls). 512-token tiles (full weight reuse) need about 4 x the x^T / dh^T part.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, cdiv, matmul_dtype, shape_error

TT = 512  # tokens per tile (the moving free size of every matmul)
HO = 512  # output columns per down-projection matmul


def load_row_chunks(dst, src, nrows, row_stride, col_off, ncols, pre=(), offset=0,
                    scalar_offset=None):
    """DMA rows r = c*128 + p (r < nrows) of a row-major HBM matrix into ``dst[p, c, :ncols]``.

    Element (r, j) sits at ``offset + r*row_stride + col_off + j`` of ``src``'s storage,
    after the optional leading ``pre`` pattern pairs (e.g. an expert dimension selected at run
    time by ``scalar_offset``). Full 128-row chunks move in one DMA, the ragged tail in another.
    """
    full = nrows // P
    tail = nrows % P
    kw = {} if scalar_offset is None else {"scalar_offset": scalar_offset, "indirect_dim": 0}
    if full:
        nisa.dma_copy(dst=dst[:, :full, :ncols], src=src.ap(
            list(pre) + [[row_stride, P], [P * row_stride, full], [1, ncols]],
            offset=offset + col_off, **kw))
    if tail:
        nisa.dma_copy(dst=dst[:tail, full, :ncols], src=src.ap(
            list(pre) + [[row_stride, tail], [1, ncols]],
            offset=offset + full * P * row_stride + col_off, **kw))


class GatedMLP:
    """Trace-time helper holding the PSUM tiles and identities of the gated-MLP tile loop."""

    def __init__(self, H, I, mdt):
        self.H, self.I, self.mdt = H, I, mdt
        self.HC, self.IC = cdiv(H, P), cdiv(I, P)
        self.ident = nl.shared_identity_matrix(P, mdt)
        self.tr_ps = nl.ndarray((P, TT), mdt, buffer=nl.psum)
        self.gu_ps = [nl.ndarray((P, TT), nl.float32, buffer=nl.psum) for _ in range(4)]
        self.o_ps = [nl.ndarray((P, HO), nl.float32, buffer=nl.psum) for _ in range(2)]
        self.n = 0

    def transpose_in(self, x_rows, tt):
        """x_rows: list of SBUF [rows, H] tiles (mdt) for tt tokens -> x^T [128, HC, tt]."""
        H, HC = self.H, self.HC
        xT = nl.ndarray((P, HC, TT), self.mdt, buffer=nl.sbuf)
        for hc in range(HC):
            kh = min(P, H - hc * P)
            for s, xr in enumerate(x_rows):
                rows = xr.shape[0]
                nisa.nc_matmul(self.tr_ps[:kh, s * P:s * P + rows], xr[:, hc * P:hc * P + kh],
                               self.ident[:rows, :rows], is_transpose=True)
            nisa.tensor_copy(xT[:kh, hc, :tt], self.tr_ps[:kh, :tt])
        return xT

    def up(self, xT, tt, load_gate, load_up):
        """Phase 1: h^T chunks [128, tt] (mdt) = silu(Wg^T x^T) * (Wu^T x^T)."""
        H, I, HC = self.H, self.I, self.HC
        hT = []
        for ic in range(self.IC):
            ki = min(P, I - ic * P)
            wg = nl.ndarray((P, HC, P), self.mdt, buffer=nl.sbuf)
            wu = nl.ndarray((P, HC, P), self.mdt, buffer=nl.sbuf)
            load_gate(wg, ic, ki)
            load_up(wu, ic, ki)
            g = self.gu_ps[(2 * ic) % 4][:ki, :tt]
            u = self.gu_ps[(2 * ic + 1) % 4][:ki, :tt]
            for hc in range(HC):
                kh = min(P, H - hc * P)
                nisa.nc_matmul(g, wg[:kh, hc, :ki], xT[:kh, hc, :tt], accumulate=hc > 0)
            for hc in range(HC):
                kh = min(P, H - hc * P)
                nisa.nc_matmul(u, wu[:kh, hc, :ki], xT[:kh, hc, :tt], accumulate=hc > 0)
            sg = nl.ndarray((ki, tt), nl.float32, buffer=nl.sbuf)
            nisa.activation(sg, nl.silu, g)
            h = nl.ndarray((P, TT), self.mdt, buffer=nl.sbuf)
            nisa.tensor_tensor(h[:ki, :tt], sg, u, nl.multiply)
            hT.append(h)
        return hT

    def down(self, hT, tt, load_down, emit):
        """Phase 2: for each 128-token subtile and 512 output columns, emit(s, rows, h0, hw,
        psum tile [rows, hw]) with sum_ic h^T[ic]^T Wd[ic]."""
        H, I, IC = self.H, self.I, self.IC
        for h0 in range(0, H, HO):
            hw = min(HO, H - h0)
            wd = nl.ndarray((P, IC, HO), self.mdt, buffer=nl.sbuf)
            load_down(wd, h0, hw)
            for s in range(cdiv(tt, P)):
                rows = min(P, tt - s * P)
                o = self.o_ps[self.n % 2][:rows, :hw]
                self.n += 1
                for ic in range(IC):
                    ki = min(P, I - ic * P)
                    nisa.nc_matmul(o, hT[ic][:ki, s * P:s * P + rows], wd[:ki, ic, :hw],
                                   accumulate=ic > 0)
                emit(s, rows, h0, hw, o)


@nki.jit
def mlp(x, w_gate, w_up, w_down):
    """Gated MLP ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``; see the module docstring."""
    if x.ndim != 2:
        shape_error("mlp", f"x must be (T, H), got {x.shape}", "flatten leading dims into T")
    T, H = x.shape
    I = w_gate.shape[1]
    if tuple(w_gate.shape) != (H, I) or tuple(w_up.shape) != (H, I) or \
            tuple(w_down.shape) != (I, H):
        shape_error("mlp", f"weights must be w_gate/w_up (H, I) = ({H}, I) and w_down (I, H); "
                    f"got {w_gate.shape}, {w_up.shape}, {w_down.shape}",
                    "pass [in, out] weights (transpose nn.Linear.weight)")
    mdt = matmul_dtype(x.dtype)
    out = nl.ndarray((T, H), x.dtype, buffer=nl.shared_hbm)
    g = GatedMLP(H, I, mdt)

    def load_gate(dst, ic, ki):
        load_row_chunks(dst, w_gate, H, I, ic * P, ki)

    def load_up(dst, ic, ki):
        load_row_chunks(dst, w_up, H, I, ic * P, ki)

    def load_down(dst, h0, hw):
        load_row_chunks(dst, w_down, I, H, h0, hw)

    pid = nl.program_id(0)
    for ti in range(pid, cdiv(T, TT), nl.num_programs()):
        t0 = ti * TT
        tt = min(TT, T - t0)
        rows_tiles = []
        for s in range(cdiv(tt, P)):
            rows = min(P, tt - s * P)
            xr = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
            nisa.dma_copy(dst=xr, src=x[t0 + s * P:t0 + s * P + rows, :])
            rows_tiles.append(xr)
        xT = g.transpose_in(rows_tiles, tt)
        hT = g.up(xT, tt, load_gate, load_up)

        def emit(s, rows, h0, hw, o):
            res = nl.ndarray((rows, hw), x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(res, o)
            nisa.dma_copy(dst=out[t0 + s * P:t0 + s * P + rows, h0:h0 + hw], src=res)

        g.down(hT, tt, load_down, emit)
    return out


def mlp_ref(x, w_gate, w_up, w_down):
    """PyTorch reference (fp32 math, output in x's dtype)."""
    import torch
    xf = x.float()
    h = torch.nn.functional.silu(xf @ w_gate.float()) * (xf @ w_up.float())
    return (h @ w_down.float()).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
IB = 128  # intermediate columns per phase-1 matmul (moving free size; stationary = 128 tokens)
DXW = 256  # dx columns per PSUM accumulation (keeps the streamed W^T blocks small)
ICG = 16  # 128-row chunks of I per streamed W^T block in the dx phase
SBUF_BUDGET = 170000  # bytes per partition for mlp_bwd's per-token-tile working set
WGRAD_RESIDENT_BYTES = 110000  # phase 2: bytes per partition for a resident operand


def store_row_chunks(src, dst, nrows, row_stride, col_off, ncols, offset=0):
    """Inverse of :func:`load_row_chunks`: ``src[p, c, :ncols]`` -> rows r = c*128 + p
    (r < nrows) of a row-major HBM matrix (element (r, j) at offset + r*row_stride + col_off
    + j)."""
    full = nrows // P
    tail = nrows % P
    if full:
        nisa.dma_copy(dst=dst.ap([[row_stride, P], [P * row_stride, full], [1, ncols]],
                                 offset=offset + col_off), src=src[:, :full, :ncols])
    if tail:
        nisa.dma_copy(dst=dst.ap([[row_stride, tail], [1, ncols]],
                                 offset=offset + full * P * row_stride + col_off),
                      src=src[:tail, full, :ncols])


class TensorEScratch:
    """TensorE working state shared by the backward kernels: the identity for transposes,
    ``n_tr`` PSUM transpose tiles and ``n_acc`` fp32 PSUM accumulators used round-robin (so
    consecutive matmuls never wait on one bank's evacuation), PSUM -> SBUF copies alternating
    VectorE / ScalarE, and the two transposes built from them."""

    def __init__(self, mdt, tr_shape, acc_shape, n_tr=2, n_acc=6):
        self.mdt = mdt
        self.ident = nl.shared_identity_matrix(P, mdt)
        self._tr = [nl.ndarray(tr_shape, mdt, buffer=nl.psum) for _ in range(n_tr)]
        self._acc = [nl.ndarray(acc_shape, nl.float32, buffer=nl.psum) for _ in range(n_acc)]
        self._cnt = {"tr": 0, "acc": 0, "copy": 0}

    def next_tr(self):
        self._cnt["tr"] += 1
        return self._tr[self._cnt["tr"] % len(self._tr)]

    def next_acc(self):
        self._cnt["acc"] += 1
        return self._acc[self._cnt["acc"] % len(self._acc)]

    def evacuate(self, dst, src):
        self._cnt["copy"] += 1
        if self._cnt["copy"] % 2:
            nisa.tensor_copy(dst, src)
        else:
            nisa.activation(dst, nl.identity, src)

    def transpose_to_hbm(self, src, R, C, dst, off=0, rs=None, doff=0):
        """Matrix (R, C), element (r, c) at ``off + r*rs + c`` of ``src``'s storage (``rs``
        defaults to C) -> ``dst`` (C, R) at ``doff``, in 128-row blocks through TensorE."""
        rs = C if rs is None else rs
        ident = self.ident
        CC = cdiv(C, P)
        for r0 in range(0, R, P):
            rr = min(P, R - r0)
            blk = nl.ndarray((P, C), self.mdt, buffer=nl.sbuf)
            nisa.dma_copy(dst=blk[:rr, :], src=src.ap([[rs, rr], [1, C]], offset=off + r0 * rs))
            outT = nl.ndarray((P, CC, P), self.mdt, buffer=nl.sbuf)
            for k0 in range(0, CC, 4):
                ps = self.next_tr()
                nk = min(4, CC - k0)
                for k in range(k0, k0 + nk):
                    cc = min(P, C - k * P)
                    nisa.nc_matmul(ps[:cc, (k - k0) * P:(k - k0) * P + rr],
                                   blk[:rr, k * P:k * P + cc], ident[:rr, :rr], is_transpose=True)
                for k in range(k0, k0 + nk):
                    cc = min(P, C - k * P)
                    self.evacuate(outT[:cc, k, :rr], ps[:cc, (k - k0) * P:(k - k0) * P + rr])
            store_row_chunks(outT, dst, C, R, r0, rr, offset=doff)

    def transpose_rows(self, rows_t, tt, H, TB):
        """Row tiles ``rows_t`` ((rows, H) each, consecutive 128-token slices of ``tt`` tokens)
        -> [128, ceil(H/128), TB] with H on partitions."""
        out = nl.ndarray((P, cdiv(H, P), TB), self.mdt, buffer=nl.sbuf)
        for hc in range(cdiv(H, P)):
            kh = min(P, H - hc * P)
            ps = self.next_tr()
            for s, xr in enumerate(rows_t):
                rows = xr.shape[0]
                nisa.nc_matmul(ps[:kh, s * P:s * P + rows], xr[:, hc * P:hc * P + kh],
                               self.ident[:rows, :rows], is_transpose=True)
            self.evacuate(out[:kh, hc, :tt], ps[:kh, :tt])
        return out


@nki.jit
def mlp_bwd(x, w_gate, w_up, w_down, dy):
    """Backward of :func:`mlp`: ``(dx, dw_gate, dw_up, dw_down)`` for the upstream gradient
    ``dy`` (T, H).

    With h_g = x Wg, h_u = x Wu, s = sigmoid(h_g), a = silu(h_g) h_u:
    da = dy Wd^T, dWd = a^T dy, dh_u = da silu(h_g), dh_g = da h_u s (1 + h_g (1 - s)),
    dx = dh_g Wg^T + dh_u Wu^T, dWg = x^T dh_g, dWu = x^T dh_u (h_g, h_u recomputed).

    Outputs: dx (T, H) in x's dtype; under LNC=1 the weight gradients in the weights' dtypes
    and shapes; under LNC=2 the programs split the token tiles and each writes fp32 partial
    weight gradients over its tokens, shapes (2, H, I), (2, H, I), (2, I, H): the caller sums
    dim 0 (as moe_cte's shard-on-block; no cross-core synchronisation).

    Phases (all matmuls full 128-row stationaries, bf16 or fp32 operands, fp32 PSUM):

    0. Wg^T, Wu^T (I, H) and Wd^T (H, I) are built once with TensorE transposes into private
       HBM scratch (every contraction over I needs I on partitions, Wd's over H needs H).
    1. Per tile of 512 tokens: x^T, dy^T [H, tokens] (TensorE transposes); per 128 columns of
       I and 128 tokens, h_g, h_u and da (token-major [128, 128], stationary x^T / dy^T,
       moving Wg / Wu / Wd^T) accumulate over H in PSUM; the elementwise chain (ScalarE
       sigmoid, VectorE / GpSimd products) gives a, dh_g, dh_u, stored token-major to
       scratch for phase 2, and dh_g^T, dh_u^T (TensorE transposes) stay in SBUF for
       dx [128 tokens, 512 of H] = sum over I of dh_g^T^T Wg^T + dh_u^T^T Wu^T.
    2. Weight gradients contract over this program's tokens (already on partitions):
       dWg / dWu [3 x 128 of H, 512 of I] and dWd [6 x 128 of I, 512 of H] accumulate in PSUM
       over all token chunks, read back from HBM (x, dy, scratch).
    """
    name = "mlp_bwd"
    if x.ndim != 2 or dy.ndim != 2 or tuple(dy.shape) != tuple(x.shape):
        shape_error(name, f"x and dy must be (T, H) of the same shape, got {x.shape} and "
                    f"{dy.shape}", "flatten leading dims into T")
    T, H = x.shape
    I = w_gate.shape[1] if w_gate.ndim == 2 else -1
    if w_gate.ndim != 2 or tuple(w_gate.shape) != (H, I) or tuple(w_up.shape) != (H, I) or \
            tuple(w_down.shape) != (I, H):
        shape_error(name, f"weights must be w_gate/w_up (H, I) = ({H}, I) and w_down (I, H); "
                    f"got {w_gate.shape}, {w_up.shape}, {w_down.shape}",
                    "pass [in, out] weights (transpose nn.Linear.weight)")
    mdt = matmul_dtype(x.dtype)
    nprog = nl.num_programs()
    pid = nl.program_id(0)
    HC, IC = cdiv(H, P), cdiv(I, P)
    dx = nl.ndarray((T, H), x.dtype, buffer=nl.shared_hbm)
    if nprog > 1:
        dwg = nl.ndarray((nprog, H, I), nl.float32, buffer=nl.shared_hbm)
        dwu = nl.ndarray((nprog, H, I), nl.float32, buffer=nl.shared_hbm)
        dwd = nl.ndarray((nprog, I, H), nl.float32, buffer=nl.shared_hbm)
        wbase = pid * H * I
    else:
        dwg = nl.ndarray((H, I), w_gate.dtype, buffer=nl.shared_hbm)
        dwu = nl.ndarray((H, I), w_up.dtype, buffer=nl.shared_hbm)
        dwd = nl.ndarray((I, H), w_down.dtype, buffer=nl.shared_hbm)
        wbase = 0
    # token tile: 512 unless the per-tile SBUF working set (x^T, dy^T, dh^T and streamed
    # weight blocks, bytes per partition) needs a smaller one
    b = mdt.itemsize
    TB = None
    for tb in (TT, 256, P):
        est = (2 * HC + 2 * IC) * tb * b + 8 * IB * 4 + \
            max(6 * HC * IB * b + 6 * cdiv(tb, P) * IB * b, 4 * min(IC, ICG) * DXW * b,
                cdiv(tb, P) * H * b)
        if est <= SBUF_BUDGET:
            TB = tb
            break
    if TB is None:
        shape_error(name, f"H={H}, I={I} need about {est} bytes per SBUF partition even with "
                    f"128-token tiles (limit {SBUF_BUDGET}: x^T, dy^T [H, tokens], "
                    "dh_g^T, dh_u^T [I, tokens] and streamed weight blocks)",
                    "split the MLP (e.g. shard I across calls and sum dx)")
    te = TensorEScratch(mdt, (P, TT), (P, HO))
    ident, next_tr, next_acc, evacuate = te.ident, te.next_tr, te.next_acc, te.evacuate

    # ---- phase 0: transposed weights in private HBM scratch ---------------------------------
    wgT = nl.ndarray((I, H), mdt, buffer=nl.private_hbm)
    wuT = nl.ndarray((I, H), mdt, buffer=nl.private_hbm)
    wdT = nl.ndarray((H, I), mdt, buffer=nl.private_hbm)

    te.transpose_to_hbm(w_gate, H, I, wgT)
    te.transpose_to_hbm(w_up, H, I, wuT)
    te.transpose_to_hbm(w_down, I, H, wdT)

    # ---- phase 1: recompute, da, dh (token-major, to scratch), dx ---------------------------
    a_s = nl.ndarray((T, I), mdt, buffer=nl.private_hbm)
    dg_s = nl.ndarray((T, I), mdt, buffer=nl.private_hbm)
    du_s = nl.ndarray((T, I), mdt, buffer=nl.private_hbm)
    tiles = [(ti * TB, min(TB, T - ti * TB)) for ti in range(pid, cdiv(T, TB), nprog)]

    def load_transposed(src, t0, tt):
        """src (T, H) rows t0..t0+tt -> [128, HC, TT] (H on partitions)."""
        rows_t = []
        for s in range(cdiv(tt, P)):
            rows = min(P, tt - s * P)
            xr = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
            nisa.dma_copy(dst=xr, src=src[t0 + s * P:t0 + s * P + rows, :])
            rows_t.append(xr)
        return te.transpose_rows(rows_t, tt, H, TB)

    for (t0, tt) in tiles:
        NS = cdiv(tt, P)
        xT = load_transposed(x, t0, tt)
        dyT = load_transposed(dy, t0, tt)
        dgT = nl.ndarray((P, IC, TB), mdt, buffer=nl.sbuf)
        duT = nl.ndarray((P, IC, TB), mdt, buffer=nl.sbuf)
        for ic in range(IC):
            i0 = ic * IB
            iw = min(IB, I - i0)
            wg = nl.ndarray((P, HC, IB), mdt, buffer=nl.sbuf)
            wu = nl.ndarray((P, HC, IB), mdt, buffer=nl.sbuf)
            wd = nl.ndarray((P, HC, IB), mdt, buffer=nl.sbuf)
            load_row_chunks(wg, w_gate, H, I, i0, iw)
            load_row_chunks(wu, w_up, H, I, i0, iw)
            load_row_chunks(wd, wdT, H, I, i0, iw)
            a_b = nl.ndarray((P, NS, IB), mdt, buffer=nl.sbuf)
            dg_b = nl.ndarray((P, NS, IB), mdt, buffer=nl.sbuf)
            du_b = nl.ndarray((P, NS, IB), mdt, buffer=nl.sbuf)
            for s in range(NS):
                rows = min(P, tt - s * P)
                cols = slice(s * P, s * P + rows)
                hg, hu, da = [next_acc()[:rows, :iw] for _ in range(3)]
                for dst, lhs, w in ((hg, xT, wg), (hu, xT, wu), (da, dyT, wd)):
                    for hc in range(HC):
                        kh = min(P, H - hc * P)
                        nisa.nc_matmul(dst, lhs[:kh, hc, cols], w[:kh, hc, :iw],
                                       accumulate=hc > 0)
                sg = nl.ndarray((rows, iw), nl.float32, buffer=nl.sbuf)
                nisa.activation(sg, nl.sigmoid, hg)
                hus = nl.ndarray((rows, iw), nl.float32, buffer=nl.sbuf)
                nisa.activation(hus, nl.identity, hu)
                silu = nl.ndarray((rows, iw), nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(silu, hg, sg, nl.multiply)
                nisa.tensor_tensor(a_b[:rows, s, :iw], silu, hus, nl.multiply,
                                   engine=nisa.engine.gpsimd)
                nisa.tensor_tensor(du_b[:rows, s, :iw], da, silu, nl.multiply)
                dah = nl.ndarray((rows, iw), nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dah, da, hus, nl.multiply)
                # silu'(h) = s (1 + h (1 - s)) = (1 - s) silu + s
                ds = nl.ndarray((rows, iw), nl.float32, buffer=nl.sbuf)
                nisa.tensor_scalar(ds, sg, nl.subtract, 1.0, reverse0=True,
                                   engine=nisa.engine.gpsimd)
                nisa.tensor_tensor(ds, ds, silu, nl.multiply, engine=nisa.engine.gpsimd)
                nisa.tensor_tensor(ds, ds, sg, nl.add, engine=nisa.engine.gpsimd)
                nisa.tensor_tensor(dg_b[:rows, s, :iw], dah, ds, nl.multiply,
                                   engine=nisa.engine.gpsimd)
                # dh^T (I on partitions) for the dx contraction
                ps = next_tr()
                nisa.nc_matmul(ps[:iw, 0:rows], dg_b[:rows, s, :iw], ident[:rows, :rows],
                               is_transpose=True)
                nisa.nc_matmul(ps[:iw, P:P + rows], du_b[:rows, s, :iw], ident[:rows, :rows],
                               is_transpose=True)
                evacuate(dgT[:iw, ic, cols], ps[:iw, 0:rows])
                evacuate(duT[:iw, ic, cols], ps[:iw, P:P + rows])
            for src, dst in ((a_b, a_s), (dg_b, dg_s), (du_b, du_s)):
                store_row_chunks(src, dst, tt, I, i0, iw, offset=t0 * I)
            del wg, wu, wd, a_b, dg_b, du_b  # free SBUF (tiles die with their last reference)
        # dx [128 tokens, 256 of H] = sum over I of dh_g Wg^T + dh_u Wu^T
        # (W^T streamed in blocks of ICG 128-row chunks of I, accumulating in PSUM)
        for h0 in range(0, H, DXW):
            hw = min(DXW, H - h0)
            accs = [next_acc() for _ in range(NS)]
            for g0 in range(0, IC, ICG):
                ng = min(ICG, IC - g0)
                wgt = nl.ndarray((P, ICG, DXW), mdt, buffer=nl.sbuf)
                wut = nl.ndarray((P, ICG, DXW), mdt, buffer=nl.sbuf)
                nr = min(I - g0 * P, ng * P)
                load_row_chunks(wgt, wgT, nr, H, h0, hw, offset=g0 * P * H)
                load_row_chunks(wut, wuT, nr, H, h0, hw, offset=g0 * P * H)
                for s in range(NS):
                    rows = min(P, tt - s * P)
                    cols = slice(s * P, s * P + rows)
                    n = 0
                    for lhsT, wt in ((dgT, wgt), (duT, wut)):
                        for k in range(ng):
                            ki = min(P, I - (g0 + k) * P)
                            nisa.nc_matmul(accs[s][:rows, :hw], lhsT[:ki, g0 + k, cols],
                                           wt[:ki, k, :hw], accumulate=g0 > 0 or n > 0)
                            n += 1
                del wgt, wut
            for s in range(NS):
                rows = min(P, tt - s * P)
                res = nl.ndarray((rows, hw), x.dtype, buffer=nl.sbuf)
                evacuate(res, accs[s][:rows, :hw])
                nisa.dma_copy(dst=dx[t0 + s * P:t0 + s * P + rows, h0:h0 + hw], src=res)
        # free this tile's SBUF before the next one (loop variables keep tiles alive too)
        del xT, dyT, dgT, duT, lhsT, wt, sg, hus, silu, dah, ds, res

    # ---- phase 2: weight gradients over this program's tokens ------------------------------
    # out[m, n] = sum_t lhs[t, m] rhs[t, n]: stationary lhs [128 tokens, 128 of M], moving
    # rhs [128 tokens, 512 of N], `group` 128-row output chunks accumulated in PSUM over all
    # token chunks. One operand stays resident in SBUF (loaded once) when it fits, the other
    # is streamed once in column blocks; otherwise both are streamed per output block.
    nck = sum(cdiv(tt, P) for (_, tt) in tiles)
    RES = WGRAD_RESIDENT_BYTES

    def load_cols(src, ncols_total, c0, cw, width):
        """Columns c0..c0+cw of this program's token rows of src: one [128, NS, width] tile
        per token tile."""
        out = []
        for (t0, tt) in tiles:
            t = nl.ndarray((P, cdiv(tt, P), width), mdt, buffer=nl.sbuf)
            load_row_chunks(t, src, tt, ncols_total, c0, cw, offset=t0 * ncols_total)
            out.append(t)
        return out

    def wgrad(lhs_src, M, rhs_src, N, out, group):
        mgroups = [(m0, min(group * P, M - m0)) for m0 in range(0, M, group * P)]
        nblocks = [(n0, min(HO, N - n0)) for n0 in range(0, N, HO)]

        def block(m0, mw, n0, nw, lts, lo, rts, ro):
            mchunks = [(m, min(P, M - m)) for m in range(m0, m0 + mw, P)]
            accs = [next_acc() for _ in mchunks]
            for ti, (t0, tt) in enumerate(tiles):
                for sc in range(cdiv(tt, P)):
                    rows = min(P, tt - sc * P)
                    for k, (m, mk) in enumerate(mchunks):
                        nisa.nc_matmul(accs[k][:mk, :nw],
                                       lts[ti][:rows, sc, m - lo:m - lo + mk],
                                       rts[ti][:rows, sc, n0 - ro:n0 - ro + nw],
                                       accumulate=not (ti == 0 and sc == 0))
            for k, (m, mk) in enumerate(mchunks):
                res = nl.ndarray((P, HO), out.dtype, buffer=nl.sbuf)
                if not tiles:  # this program has no tokens: zero partial
                    nisa.memset(res[:mk, :nw], 0.0)
                else:
                    evacuate(res[:mk, :nw], accs[k][:mk, :nw])
                nisa.dma_copy(dst=out.ap([[N, mk], [1, nw]], offset=wbase + m * N + n0),
                              src=res[:mk, :nw])

        if nck * N * b <= RES:  # rhs resident, lhs streamed once per row group
            rts = load_cols(rhs_src, N, 0, N, N) if tiles else []
            for (m0, mw) in mgroups:
                lts = load_cols(lhs_src, M, m0, mw, group * P)
                for (n0, nw) in nblocks:
                    block(m0, mw, n0, nw, lts, m0, rts, 0)
        elif nck * M * b <= RES:  # lhs resident, rhs streamed once per column block
            lts = load_cols(lhs_src, M, 0, M, M) if tiles else []
            for (n0, nw) in nblocks:
                rts = load_cols(rhs_src, N, n0, nw, HO)
                for (m0, mw) in mgroups:
                    block(m0, mw, n0, nw, lts, 0, rts, n0)
        else:  # stream both per output block
            for (n0, nw) in nblocks:
                for (m0, mw) in mgroups:
                    lts = load_cols(lhs_src, M, m0, mw, group * P)
                    rts = load_cols(rhs_src, N, n0, nw, HO)
                    block(m0, mw, n0, nw, lts, m0, rts, n0)

    wgrad(x, H, dg_s, I, dwg, 6)
    wgrad(x, H, du_s, I, dwu, 6)
    wgrad(a_s, I, dy, H, dwd, 6)
    return dx, dwg, dwu, dwd


def mlp_bwd_ref(x, w_gate, w_up, w_down, dy):
    """PyTorch reference of :func:`mlp_bwd` (fp32 math, explicit formulas): ``(dx, dw_gate,
    dw_up, dw_down)`` in the inputs' dtypes."""
    import torch
    xf, wg, wu, wd, g = (t.float() for t in (x, w_gate, w_up, w_down, dy))
    hg, hu = xf @ wg, xf @ wu
    s = torch.sigmoid(hg)
    silu = hg * s
    a = silu * hu
    da = g @ wd.t()
    dhu = da * silu
    dhg = da * hu * s * (1 + hg * (1 - s))
    dx = dhg @ wg.t() + dhu @ wu.t()
    return (dx.to(x.dtype), (xf.t() @ dhg).to(w_gate.dtype), (xf.t() @ dhu).to(w_up.dtype),
            (a.t() @ g).to(w_down.dtype))
