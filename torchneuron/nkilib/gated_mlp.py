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
