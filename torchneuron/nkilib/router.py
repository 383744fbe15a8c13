"""``router_topk``: MoE router -- softmax over experts, top-k selection -- and its reference.

Layout: ``logits`` (T, E) (router matmul output; any float dtype). Returns

* ``affinities`` (T, E) float32: the softmax probability of each selected expert, 0 elsewhere
  (the ``expert_affinities_masked`` input of ``moe_cte``, flattened there to ((T)*E, 1));
  with ``normalize=True`` the selected probabilities are rescaled to sum to 1 per token
  (Mixtral / Qwen3 ``norm_topk_prob``);
* ``indices`` (T, k) int32: the selected experts, highest probability first.

Limits: 1 <= k <= 8 (one VectorE ``max8``), 8 <= E <= 16384. Ties at the k-th value may
select extra experts in ``affinities`` (indices stay k); ties are measure-zero for real
logits.

Per 128-token tile: max, exp with a fused row sum (ScalarE), reciprocal and scale (VectorE)
give the probabilities; ``max8`` yields the 8 largest, ``nc_find_index8`` their positions; a
compare against the k-th largest builds the mask. LNC=2 splits token tiles.

Numerics: fp32 throughout; tolerance vs :func:`router_topk_ref` 1e-6 (indices exact).
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, arg_error, cdiv, shape_error


@nki.jit
def router_topk(logits, k, normalize=False):
    """Softmax + top-k routing; see the module docstring. Returns (affinities, indices)."""
    if logits.ndim != 2:
        shape_error("router_topk", f"logits must be (T, E), got {logits.shape}",
                    "flatten leading dims into T")
    T, E = logits.shape
    if not 1 <= k <= 8:
        arg_error("router_topk", f"k={k} outside 1..8 (one max8 instruction)", "use k <= 8")
    if not 8 <= E <= 16384:
        shape_error("router_topk", f"E={E} experts outside 8..16384 (max8 input limits)",
                    "pad the logits with -inf columns to 8 experts")
    aff = nl.ndarray((T, E), nl.float32, buffer=nl.shared_hbm)
    ind = nl.ndarray((T, k), nl.int32, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    for i in range(pid, cdiv(T, P), nl.num_programs()):
        r0 = i * P
        rows = min(P, T - r0)
        x = nl.ndarray((rows, E), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=logits[r0:r0 + rows, :])
        nmax = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(nmax, nl.maximum, x, axis=1, negate=True)
        e = nl.ndarray((rows, E), nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(e, nl.exp, x, bias=nmax, reduce_op=nl.add, reduce_res=s)
        rs = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(rs, s)
        p = nl.ndarray((rows, E), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(p, e, nl.multiply, rs)
        top = nl.ndarray((rows, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(top, p)
        idx = nl.ndarray((rows, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(idx, p, top)
        # mask = p >= k-th largest; affinities = p * mask (* 1/sum(top-k) if normalize)
        mask = nl.ndarray((rows, E), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(mask, p, nl.greater_equal, top[:, k - 1:k])
        a = nl.ndarray((rows, E), nl.float32, buffer=nl.sbuf)
        if normalize:
            ks = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(ks, nl.add, top[:, :k], axis=1)
            rk = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.reciprocal(rk, ks)
            nisa.scalar_tensor_tensor(a, p, nl.multiply, rk, nl.multiply, mask)
        else:
            nisa.tensor_tensor(a, p, mask, nl.multiply)
        nisa.dma_copy(dst=aff[r0:r0 + rows, :], src=a)
        ii = nl.ndarray((rows, k), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(ii, idx[:, :k])
        nisa.dma_copy(dst=ind[r0:r0 + rows, :], src=ii)
    return aff, ind


def router_topk_ref(logits, k, normalize=False):
    """PyTorch reference: (affinities (T, E) fp32, indices (T, k) int32)."""
    import torch
    p = torch.softmax(logits.float(), -1)
    v, i = p.topk(k, -1)
    if normalize:
        v = v / v.sum(-1, keepdim=True)
    aff = torch.zeros_like(p).scatter_(1, i, v)
    return aff, i.to(torch.int32)
