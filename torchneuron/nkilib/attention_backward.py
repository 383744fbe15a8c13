"""``attention_bwd``: flash-attention backward (dq, dk, dv) and its reference.

Layouts (upstream NKI-lib ``attention_bwd``)::

    q, o, dy   (bs, H, d, Sq)
    k, v       (bs, Hkv, d, Skv)     GQA when Hkv < H (H % Hkv == 0; head h uses kv head
                                      h // (H // Hkv))
    lse        (bs, H, 128, ceil(Sq / 128)) float32: lse[.., p, t] = log-sum-exp over the kept
               keys of softmax_scale * q_i . k_j for query i = t * 128 + p -- exactly what
               ``attention_cte(..., cache_softmax=True)`` returns (with bs*H folded)
    returns    dq (bs, H, d, Sq), dk (bs, Hkv, d, Skv), dv (bs, Hkv, d, Skv) in q's dtype

Masks as in ``attention_cte``: ``use_causal_mask`` keeps key j <= query i (top-left aligned);
``sliding_window=W`` also drops i - j >= W.

Limits: d <= 128. SBUF keeps, per kv head, its query group's scale*Q^T and dO^T [d, Sq],
the row layouts of scale*Q and dO, and fp32 dQ accumulators: about 12 * Sq * H/Hkv bytes per
partition (bf16, d = 128), i.e. Sq * H/Hkv <= ~14K; beyond that the simulator raises its
SBUF-capacity error.

Algorithm (FlashAttention-2 backward; kv groups of 512 keys outer, query tiles of 128 inner):
D = rowsum(dO * O) per query; per 128 x 512 block S = (scale Q) K^T and dP = dO V^T are one
TensorE matmul each (512-wide moving tiles), P = exp(S - lse) and dP - D run on ScalarE from
PSUM, dS = P * (dP - D) on GpSimd; dV += P^T dO and dK += dS^T (scale Q) accumulate in PSUM
over all query tiles (P and dS already have the queries on partitions, as these contractions
need; four 128-key accumulators share one bank); dS^T (TensorE transposes) gives
dQ += dS (scale K), added to fp32 SBUF accumulators. Blocks are software-pipelined (the
scores/softmax of block n+1 are issued before the gradient matmuls of block n; S and dP are
double-buffered). Matmuls in bf16 (fp32 for fp32 inputs), accumulation in fp32.

Numerics vs :func:`attention_bwd_ref`: fp32 ~1e-5 relative to max |grad|; bf16 ~3e-2.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, arg_error, cdiv, matmul_dtype, shape_error
from .attention import _mask_tile


def _check(q, k, v, o, dy, lse, softmax_scale):
    name = "attention_bwd"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        shape_error(name, f"q, k, v must be (bs, H, d, S), got {q.shape}, {k.shape}, {v.shape}",
                    "pass 4-D tensors in the (bs, heads, head_dim, seq) layout")
    bs, H, d, Sq = q.shape
    _, Hkv, dk, Skv = k.shape
    if d > P:
        shape_error(name, f"head dim d={d} exceeds the limit d <= {P}",
                    "split the head dimension or use d <= 128")
    if tuple(o.shape) != tuple(q.shape) or tuple(dy.shape) != tuple(q.shape):
        shape_error(name, f"o {o.shape} and dy {dy.shape} must match q {q.shape}",
                    "pass the forward output and its gradient in q's layout")
    if dk != d or tuple(v.shape) != tuple(k.shape) or k.shape[0] != bs:
        shape_error(name, f"k {k.shape} and v {v.shape} must be (bs={bs}, Hkv, d={d}, Skv)",
                    "pass k and v in the (bs, Hkv, d, Skv) layout")
    if H % Hkv:
        shape_error(name, f"query heads {H} not a multiple of kv heads {Hkv}",
                    "use H = Hkv * group")
    if tuple(lse.shape) != (bs, H, P, cdiv(Sq, P)):
        shape_error(name, f"lse {lse.shape} must be (bs, H, 128, ceil(Sq/128)) = "
                    f"{(bs, H, P, cdiv(Sq, P))}", "pass attention_cte's cache_softmax output")
    if not softmax_scale > 0:
        arg_error(name, f"softmax_scale={softmax_scale} must be > 0", "pass e.g. 1/sqrt(d)")
    return bs, H, Hkv, d, Sq, Skv


KW = 512  # keys per kv group: the moving free size of the S and dP matmuls


@nki.jit
def attention_bwd(q, k, v, o, dy, lse, use_causal_mask=True, softmax_scale=1.0,
                  sliding_window=None):
    """Flash-attention backward; see the module docstring. Returns ``(dq, dk, dv)``."""
    bs, H, Hkv, d, Sq, Skv = _check(q, k, v, o, dy, lse, softmax_scale)
    mdt = matmul_dtype(q.dtype)
    group = H // Hkv
    nqt = cdiv(Sq, P)
    scale = float(softmax_scale)
    dq = nl.ndarray((bs, H, d, Sq), q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((bs, Hkv, d, Skv), q.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((bs, Hkv, d, Skv), q.dtype, buffer=nl.shared_hbm)
    ident = nl.shared_identity_matrix(P, mdt)
    ident32 = ident if mdt == nl.float32 else nl.shared_identity_matrix(P, nl.float32)

    # PSUM (8 banks): S x2, dP x2, dS^T (4 blocks of 128 keys), dK and dV accumulators for 512
    # keys ([128, 4, d] fp32 each), and one bank holding two dQ partials + transpose scratch.
    s_ps = [nl.ndarray((P, KW), nl.float32, buffer=nl.psum) for _ in range(2)]
    dp_ps = [nl.ndarray((P, KW), nl.float32, buffer=nl.psum) for _ in range(2)]
    dst_ps = nl.ndarray((P, 4, P), mdt, buffer=nl.psum)
    dk_ps = nl.ndarray((P, 4, P), nl.float32, buffer=nl.psum)
    dv_ps = nl.ndarray((P, 4, P), nl.float32, buffer=nl.psum)
    misc_ps = nl.ndarray((P, 4 * P), nl.float32, buffer=nl.psum)
    dq_ps = [misc_ps[:, 0:P], misc_ps[:, P:2 * P]]
    tr_ps = misc_ps[:, 2 * P:3 * P]

    def ident_for(t):
        # the identity must be fp32 exactly when the transposed tile is
        return ident32 if t.dtype == nl.float32 else ident

    def to_rows(src_T, n, sc):
        """[d, n] SBUF -> [n, d] mdt tile (TensorE transpose), times sc."""
        nisa.nc_matmul(tr_ps[:n, :d], src_T, ident_for(src_T)[:d, :d], is_transpose=True)
        t = nl.ndarray((P, d), mdt, buffer=nl.sbuf)
        nisa.tensor_scalar(t[:n, :], tr_ps[:n, :d], nl.multiply, sc)
        return t

    def store_T(rows_tile, n, dst):
        """[n, d] fp32 SBUF -> transpose -> dst [d, n] in HBM."""
        nisa.nc_matmul(tr_ps[:d, :n], rows_tile, ident32[:n, :n], is_transpose=True)
        t = nl.ndarray((d, n), q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(t, tr_ps[:d, :n])
        nisa.dma_copy(dst=dst, src=t)

    masks = {}

    def mask_for(rows, kw, q0, k0, causal, window):
        key = (rows, kw, q0 - k0, causal, window)
        if key not in masks:
            m = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
            _mask_tile(rows, kw, q0, k0, causal, window, m)
            masks[key] = m
        return masks[key]

    counter = [0]
    pid = nl.program_id(0)
    nprog = nl.num_programs()
    heads = [(b, h) for b in range(bs) for h in range(Hkv)]
    for n in range(pid, len(heads), nprog):  # LNC=2: kv heads split between the programs
        b, hk = heads[n]
        # ---- per query head of the group: Q, dO and statistics, prepared per query tile on
        # first use (so the work spreads into the first kv group instead of a long prologue)
        qs = []
        for g in range(group):
            h = hk * group + g
            qT = nl.ndarray((d, Sq), mdt, buffer=nl.sbuf)  # scale * Q^T
            dyT = nl.ndarray((d, Sq), mdt, buffer=nl.sbuf)
            nlse = nl.ndarray((P, nqt), nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(dst=nlse, src=lse[b, h])
            nisa.tensor_scalar(nlse, nlse, nl.multiply, -1.0, engine=nisa.engine.gpsimd)
            qs.append((h, qT, dyT, nlse, [None] * nqt, [None] * nqt, [None] * nqt,
                       [None] * nqt))

        def prepare(qd, i):
            """Load and derive everything query tile i of head qd needs (once)."""
            h, qT, dyT, nlse, qrows, dyrows, ndcol, dqacc = qd
            if qrows[i] is not None:
                return
            q0 = i * P
            rows = min(P, Sq - q0)
            raw = nl.ndarray((d, rows), q.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=raw, src=q[b, h, :, q0:q0 + rows])
            nisa.tensor_scalar(qT[:, q0:q0 + rows], raw, nl.multiply, scale)
            nisa.dma_copy(dst=dyT[:, q0:q0 + rows], src=dy[b, h, :, q0:q0 + rows])
            oT = nl.ndarray((d, rows), o.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=oT, src=o[b, h, :, q0:q0 + rows])
            qrows[i] = to_rows(qT[:, q0:q0 + rows], rows, 1.0)  # scale*Q [q, d]
            dyr = to_rows(dyT[:, q0:q0 + rows], rows, 1.0)
            dyrows[i] = dyr
            # -D = -rowsum(dO * O), from O transposed to the query-row layout
            nisa.nc_matmul(tr_ps[:rows, :d], oT, ident_for(oT)[:d, :d], is_transpose=True)
            prod = nl.ndarray((rows, d), nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(prod, tr_ps[:rows, :d], dyr[:rows, :], nl.multiply)
            nd = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(nd[:rows, :], nl.add, prod, axis=1, negate=True)
            ndcol[i] = nd
            acc = nl.ndarray((P, d), nl.float32, buffer=nl.sbuf)
            nisa.memset(acc, 0.0, engine=nisa.engine.gpsimd)
            dqacc[i] = acc

        # ---- kv groups of 512 keys ----------------------------------------------------------
        for j0 in range(0, Skv, KW):
            kw = min(KW, Skv - j0)
            nch = cdiv(kw, P)
            kT = nl.ndarray((d, kw), mdt, buffer=nl.sbuf)
            vT = nl.ndarray((d, kw), mdt, buffer=nl.sbuf)
            nisa.dma_copy(dst=kT, src=k[b, hk, :, j0:j0 + kw])
            nisa.dma_copy(dst=vT, src=v[b, hk, :, j0:j0 + kw])
            krows = [to_rows(kT[:, c * P:c * P + min(P, kw - c * P)], min(P, kw - c * P), scale)
                     for c in range(nch)]  # scale * K chunks [k, d]
            blocks = []
            for qd in qs:
                for i in range(nqt):
                    q0 = i * P
                    rows = min(P, Sq - q0)
                    if use_causal_mask and q0 + rows - 1 < j0:
                        continue  # every key of the group is in every query's future
                    if sliding_window is not None and q0 - (j0 + kw - 1) >= sliding_window:
                        continue  # every key is outside every query's window
                    blocks.append((qd, i, q0, rows))
            first = [True]

            def stage_a(blk):
                """S, P = exp(S - lse), dP and dS = P * (dP - D) of one 128 x 512 block."""
                qd, i, q0, rows = blk
                prepare(qd, i)
                h, qT, dyT, nlse, qrows, dyrows, ndcol, dqacc = qd
                u = counter[0] % 2
                counter[0] += 1
                s = s_ps[u][:rows, :kw]
                nisa.nc_matmul(s, qT[:, q0:q0 + rows], kT, accumulate=False)
                need_c = use_causal_mask and j0 + kw - 1 > q0
                need_w = sliding_window is not None and j0 <= q0 + rows - 1 - sliding_window
                if need_c or need_w:
                    mask = mask_for(rows, kw, q0, j0, need_c, sliding_window if need_w else None)
                    nisa.nc_matmul(s, ident[:rows, :rows], mask, accumulate=True)
                p_sb = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
                nisa.activation(p_sb, nl.exp, s, bias=nlse[:rows, i:i + 1])
                dp = dp_ps[u][:rows, :kw]
                nisa.nc_matmul(dp, dyT[:, q0:q0 + rows], vT, accumulate=False)
                dpm = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
                nisa.activation(dpm, nl.identity, dp, bias=ndcol[i][:rows, :])  # dP - D (ScalarE)
                ds = nl.ndarray((rows, kw), mdt, buffer=nl.sbuf)
                nisa.tensor_tensor(ds, dpm, p_sb, nl.multiply, engine=nisa.engine.gpsimd)
                return (blk, p_sb, ds)

            def stage_b(res):
                """dV += P^T dO, dK += dS^T (scale Q), dQ += dS (scale K) for one block."""
                (qd, i, q0, rows), p_sb, ds = res
                h, qT, dyT, nlse, qrows, dyrows, ndcol, dqacc = qd
                acc = not first[0]
                first[0] = False
                # dS^T first: its PSUM->SBUF copy overlaps the dV and dK matmuls
                for c in range(nch):
                    kc = min(P, kw - c * P)
                    nisa.nc_matmul(dst_ps[:kc, c, :rows], ds[:, c * P:c * P + kc],
                                   ident[:rows, :rows], is_transpose=True)
                dsT = nl.ndarray((P, 4, P), mdt, buffer=nl.sbuf)
                if kw == KW:
                    nisa.tensor_copy(dsT[:, :, :rows], dst_ps[:, :, :rows])
                else:
                    for c in range(nch):
                        kc = min(P, kw - c * P)
                        nisa.tensor_copy(dsT[:kc, c, :rows], dst_ps[:kc, c, :rows])
                for c in range(nch):
                    kc = min(P, kw - c * P)
                    nisa.nc_matmul(dv_ps[:kc, c, :d], p_sb[:, c * P:c * P + kc],
                                   dyrows[i][:rows, :], accumulate=acc)
                for c in range(nch):
                    kc = min(P, kw - c * P)
                    nisa.nc_matmul(dk_ps[:kc, c, :d], ds[:, c * P:c * P + kc], qrows[i][:rows, :],
                                   accumulate=acc)
                dqp = dq_ps[counter[0] % 2][:rows, :d]
                for c in range(nch):
                    kc = min(P, kw - c * P)
                    nisa.nc_matmul(dqp, dsT[:kc, c, :rows], krows[c][:kc, :], accumulate=c > 0)
                nisa.tensor_tensor(dqacc[i][:rows, :], dqacc[i][:rows, :], dqp, nl.add)

            # software pipeline: block n+1's scores/softmax before block n's gradient matmuls
            pending = None
            for blk in blocks:
                res = stage_a(blk)
                if pending is not None:
                    stage_b(pending)
                pending = res
            if pending is not None:
                stage_b(pending)
            for c in range(nch):
                kc = min(P, kw - c * P)
                for acc_ps, dst in ((dk_ps, dk), (dv_ps, dv)):
                    res_t = nl.ndarray((kc, d), nl.float32, buffer=nl.sbuf)
                    if first[0]:  # no query attends to these keys: zero gradient
                        nisa.memset(res_t, 0.0)
                    else:
                        nisa.tensor_copy(res_t, acc_ps[:kc, c, :d])
                    store_T(res_t, kc, dst[b, hk, :, j0 + c * P:j0 + c * P + kc])
        for qd in qs:
            for i in range(nqt):
                prepare(qd, i)  # (a query tile no block used still gets its zero gradient)
                q0 = i * P
                rows = min(P, Sq - q0)
                store_T(qd[7][i][:rows, :], rows, dq[b, qd[0], :, q0:q0 + rows])
    return dq, dk, dv


def attention_bwd_ref(q, k, v, o, dy, lse, use_causal_mask=True, softmax_scale=1.0,
                      sliding_window=None):
    """PyTorch reference of :func:`attention_bwd` (autograd through an fp32 attention in the
    same layouts; ``o`` and ``lse`` are recomputed, as the kernel's results depend only on
    them through the true forward). Returns ``(dq, dk, dv)`` in q's dtype."""
    import torch
    bs, H, d, Sq = q.shape
    Hkv, Skv = k.shape[1], k.shape[3]
    g = H // Hkv
    qf = q.float().transpose(2, 3).detach().requires_grad_(True)  # (bs, H, Sq, d)
    kf = k.float().transpose(2, 3).detach().requires_grad_(True)
    vf = v.float().transpose(2, 3).detach().requires_grad_(True)
    kk = kf.repeat_interleave(g, 1)
    vv = vf.repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", qf, kk) * softmax_scale
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Skv)[None, :]
    keep = torch.ones(Sq, Skv, dtype=torch.bool)
    if use_causal_mask:
        keep &= j <= i
    if sliding_window is not None:
        keep &= (i - j) < sliding_window
    s = s.masked_fill(~keep, float("-inf"))
    out = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), vv)
    out.backward(dy.float().transpose(2, 3))
    t = lambda x: x.grad.transpose(2, 3).contiguous().to(q.dtype)  # noqa: E731
    return t(qf), t(kf), t(vf)
