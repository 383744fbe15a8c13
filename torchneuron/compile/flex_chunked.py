"""Memory-bounded FlexAttention training path for large problems on neuron.

The default training route (:mod:`.flex_attention`) replaces the HOP by its math definition
and lets AOTAutograd derive the backward: fast for short sequences, but the score matrix
(B*H*Lq*Lkv) is materialised in the forward and kept for the backward, so memory grows with
the square of the sequence. Above ``TORCHNEURON_FLEX_CHUNK_BYTES`` (size of one fp32 score
matrix; default 64 MiB) the call goes here instead: two opaque custom ops,

* ``torchneuron::flex_chunked_fwd`` -- queries in chunks, each chunk's scores built, modified
  (``score_mod``), masked (``mask_mod``) and soft-maxed, then dropped; returns out, lse, max;
* ``torchneuron::flex_chunked_bwd`` -- the flash-attention backward: per chunk the scores are
  recomputed from q, k and the saved lse, ``dP = dO V^T``, ``dS = P (dP - delta)``; the
  gradient through ``score_mod`` (to the scores and to captured buffers such as a learnable
  bias) comes from autograd of the recomputed chunk.

Being opaque to AOTAutograd is the point: traced, the partitioner would keep every chunk's
probabilities for the backward again. Working memory is O(chunk * Lkv) per (batch, head);
saved state is q, k, v, out and lse. The chunk computations run as eager ATen ops on neuron
(no Inductor fusion), so this path is slower per FLOP than the fused one and is only chosen
where the fused one would materialise large score matrices. Block sparsity is used at the
granularity of key ranges: each chunk computes only the keys between the first and last KV
block the BlockMask lists for its query blocks (``mask_mod`` decides inside the range).

``score_mod`` / ``mask_mod`` are FX graph modules, which custom ops cannot take as arguments:
they are registered in a process-local table under a key derived from their code, and the
ops receive the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import uuid
from typing import Any, Callable, Sequence

import torch

_LN2 = math.log(2.0)
_DEFAULT_THRESHOLD = 64 << 20
_CHUNK_TARGET_BYTES = 2 << 20  # one fp32 chunk of scores across all (batch, head) pairs

_lock = threading.Lock()
_mods: dict[int, tuple[Callable, Callable]] = {}


def threshold_bytes() -> int:
    """Score-matrix size (bytes, fp32) above which training calls take this path."""
    return int(os.environ.get("TORCHNEURON_FLEX_CHUNK_BYTES", _DEFAULT_THRESHOLD))


def applies(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether a FlexAttention call with these (possibly fake) inputs takes this path: static
    shapes only (a symbolic size keeps the traced math path, which handles it)."""
    sizes = (query.size(0), query.size(1), query.size(2), key.size(2))
    if not all(isinstance(s, int) for s in sizes):
        return False
    b, h, lq, lkv = sizes
    return b * h * lq * lkv * 4 > threshold_bytes()


def register(score_mod: Callable, mask_mod: Callable) -> int:
    # Key = hash of the modules' code, so the same model compiled in another process gives
    # the same graph (and hits the compile cache); modules holding state beyond their code
    # (get_attr constants) get a unique key instead, since equal code would not mean equal mods.
    parts = []
    for m in (score_mod, mask_mod):
        code = getattr(m, "code", None)
        graph = getattr(m, "graph", None)
        stateful = graph is None or any(n.op == "get_attr" for n in graph.nodes)
        parts.append(uuid.uuid4().hex if code is None or stateful else code)
    k = int.from_bytes(hashlib.sha256("\0".join(parts).encode()).digest()[:7], "little")
    with _lock:
        _mods.setdefault(k, (score_mod, mask_mod))
    return k


def _chunk_rows(bh: int, lkv: int) -> int:
    rows = _CHUNK_TARGET_BYTES // max(1, bh * lkv * 4)
    return int(min(512, max(16, rows)))


def _mods_for(key: int) -> tuple[Callable, Callable]:
    try:
        return _mods[key]
    except KeyError:
        raise RuntimeError(
            "torchneuron::flex_chunked: score_mod/mask_mod not registered in this process "
            "(the graph was loaded without passing through the neuron backend's legalisation); "
            "recompile with backend='neuron'") from None


def _post_mod(s, i0, j0, score_mod, mask_mod, sbufs, mbufs):
    """``score_mod`` applied to the scaled scores ``s`` (B, H, rows, keys) of query rows
    ``i0..`` and keys ``j0..``, masked to -inf by ``mask_mod``.

    The mods are called once on broadcastable index grids (b as (B,1,1,1), h as (1,H,1,1), ...)
    instead of under vmap: they are elementwise by contract, AOTAutograd's runtime runs
    compiled code with functorch transforms disabled, and one broadcast call is cheaper than
    four nested vmaps."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    dev = s.device
    b = torch.arange(s.size(0), device=dev).view(-1, 1, 1, 1)
    h = torch.arange(s.size(1), device=dev).view(1, -1, 1, 1)
    m = torch.arange(i0, i0 + s.size(2), device=dev).view(1, 1, -1, 1)
    n = torch.arange(j0, j0 + s.size(3), device=dev).view(1, 1, 1, -1)
    with TransformGetItemToIndex():
        keep = mask_mod(b, h, m, n, *mbufs)
        mod = score_mod(s, b, h, m, n, *sbufs)
    return torch.where(keep, mod, torch.tensor(-math.inf, dtype=s.dtype, device=dev))


def _key_ranges(L: int, Lkv: int, step: int, blocks: Sequence[torch.Tensor], q_bs: int,
                kv_bs: int) -> list[tuple[int, int, int, int]]:
    """(i0, i1, j0, j1) per query chunk: the key range covering every KV block the BlockMask
    lists (partial or full) for any query block of the chunk, in any batch or head. Keys
    outside it are masked for all of the chunk's rows, so they are never computed; ``mask_mod``
    still decides inside the range."""
    chunks = [(i0, min(L, i0 + step)) for i0 in range(0, L, step)]
    if not blocks or q_bs <= 0 or kv_bs <= 0:
        return [(i0, i1, 0, Lkv) for i0, i1 in chunks]
    nkb = -(-Lkv // kv_bs)
    used = None
    for num, idx in zip(blocks[0::2], blocks[1::2]):
        num, idx = num.detach().cpu().long(), idx.detach().cpu().long()
        valid = torch.arange(idx.size(-1)) < num.unsqueeze(-1)
        u = torch.zeros(*idx.shape[:-1], nkb + 1, dtype=torch.bool)
        u.scatter_(-1, torch.where(valid, idx.clamp(0, nkb - 1), nkb), True)
        u = u[..., :nkb].flatten(0, -3).any(0)  # over batch and head: (query blocks, kv blocks)
        used = u if used is None else used | u
    out = []
    for i0, i1 in chunks:
        qb0, qb1 = i0 // q_bs, (i1 - 1) // q_bs + 1
        if qb1 > used.size(0):  # the mask describes fewer query rows: no pruning
            out.append((i0, i1, 0, Lkv))
            continue
        cols = used[qb0:qb1].any(0).nonzero().flatten()
        if cols.numel() == 0:
            out.append((i0, i1, 0, 0))
        else:
            out.append((i0, i1, int(cols[0]) * kv_bs, min(Lkv, (int(cols[-1]) + 1) * kv_bs)))
    return out


def _wp(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("torchneuron::flex_chunked_fwd", mutates_args=())
def flex_chunked_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int, scale: float,
                     n_score_bufs: int, bufs: Sequence[torch.Tensor],
                     blocks: Sequence[torch.Tensor], q_bs: int, kv_bs: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked FlexAttention forward on equal-head q/k/v: (out, lse, max) in natural log.
    ``blocks``: the BlockMask's (kv_num_blocks, kv_indices[, full_kv_num_blocks,
    full_kv_indices]) with block sizes ``q_bs`` x ``kv_bs``, used to skip key ranges."""
    with _no_modes():
        return _fwd(q, k, v, key, scale, n_score_bufs, bufs, blocks, q_bs, kv_bs)


@contextlib.contextmanager
def _no_modes():
    """The op bodies run plain eager code: without the dispatch modes AOTAutograd's runtime may
    have active (an aliasing checker), and with autograd recording on again, which a custom
    op's kernel runs below (the backward differentiates the recomputed ``score_mod``)."""
    from torch.utils._python_dispatch import _disable_current_modes

    dk = torch._C.DispatchKey
    autograd = (torch._C.DispatchKeySet(dk.AutogradFunctionality)
                | torch._C.DispatchKeySet(dk.AutogradOther)
                | torch._C.DispatchKeySet(dk.AutogradNestedTensor))
    with _disable_current_modes(), torch._C._ForceDispatchKeyGuard(
            torch._C._dispatch_tls_local_include_set(),
            torch._C._dispatch_tls_local_exclude_set() - autograd):
        yield


def _fwd(q, k, v, key, scale, n_score_bufs, bufs, blocks, q_bs, kv_bs):
    wp = _wp(q)
    sm, mm = _mods_for(key)
    sbufs, mbufs = tuple(bufs[:n_score_bufs]), tuple(bufs[n_score_bufs:])
    B, H, L, _ = q.shape
    out = torch.empty(B, H, L, v.size(-1), dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, L, dtype=wp, device=q.device)
    mx = torch.empty(B, H, L, dtype=wp, device=q.device)
    kt, vv = k.to(wp).transpose(-2, -1), v.to(q.dtype)
    step = _chunk_rows(B * H, k.size(2))
    with torch.no_grad():
        for i0, i1, j0, j1 in _key_ranges(L, k.size(2), step, blocks, q_bs, kv_bs):
            if j1 <= j0:  # every row fully masked
                out[:, :, i0:i1] = 0
                lse[:, :, i0:i1] = -math.inf
                mx[:, :, i0:i1] = -math.inf
                continue
            post = _post_mod((q[:, :, i0:i1].to(wp) @ kt[..., j0:j1]) * scale, i0, j0, sm, mm,
                             sbufs, mbufs)
            m = post.amax(-1)
            # fully masked rows: lse = -inf and probabilities 0, as the HOP defines them
            l = torch.where(m == -math.inf, -math.inf, post.logsumexp(-1))
            p = torch.exp(post - l.unsqueeze(-1)).nan_to_num_(0.0)
            out[:, :, i0:i1] = p.to(q.dtype) @ vv[:, :, j0:j1]
            lse[:, :, i0:i1] = l
            mx[:, :, i0:i1] = m
    return out, lse, mx


@flex_chunked_fwd.register_fake
def _(q, k, v, key, scale, n_score_bufs, bufs, blocks, q_bs, kv_bs):
    wp = _wp(q)
    B, H, L, _ = q.shape
    return (q.new_empty(B, H, L, v.size(-1)), q.new_empty(B, H, L, dtype=wp),
            q.new_empty(B, H, L, dtype=wp))


@torch.library.custom_op("torchneuron::flex_chunked_bwd", mutates_args=())
def flex_chunked_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor, key: int,
                     scale: float, n_score_bufs: int, bufs: Sequence[torch.Tensor],
                     buf_grad: Sequence[bool], blocks: Sequence[torch.Tensor], q_bs: int,
                     kv_bs: int) -> list[torch.Tensor]:
    """Flash-attention backward of :func:`flex_chunked_fwd`: [dq, dk, dv, d(score bufs)...]
    (a zero tensor for buffers that need no gradient)."""
    with _no_modes():
        return _bwd(q, k, v, out, lse, dout, dlse, key, scale, n_score_bufs, bufs, buf_grad,
                    blocks, q_bs, kv_bs)


def _bwd(q, k, v, out, lse, dout, dlse, key, scale, n_score_bufs, bufs, buf_grad, blocks, q_bs,
         kv_bs):
    wp = _wp(q)
    sm, mm = _mods_for(key)
    sbufs, mbufs = list(bufs[:n_score_bufs]), tuple(bufs[n_score_bufs:])
    B, H, L, _ = q.shape
    kw, vw = k.to(wp), v.to(wp)
    # delta = rowsum(dO * O); a gradient on lse adds -dlse (d lse / d s = P)
    delta = (dout.to(wp) * out.to(wp)).sum(-1) - dlse.to(wp)
    dq = torch.empty(q.shape, dtype=wp, device=q.device)
    dk = torch.zeros(k.shape, dtype=wp, device=q.device)
    dv = torch.zeros(v.shape, dtype=wp, device=q.device)
    want = [i for i, g in enumerate(buf_grad) if g and sbufs[i].is_floating_point()]
    dbufs = {i: torch.zeros(sbufs[i].shape, dtype=wp, device=q.device) for i in want}
    step = _chunk_rows(B * H, k.size(2))
    for i0, i1, j0, j1 in _key_ranges(L, k.size(2), step, blocks, q_bs, kv_bs):
        if j1 <= j0:  # fully masked rows: no gradient
            dq[:, :, i0:i1] = 0
            continue
        qc, kc = q[:, :, i0:i1].to(wp), kw[:, :, j0:j1]
        with torch.enable_grad():
            s = ((qc @ kc.transpose(-2, -1)) * scale).requires_grad_()
            leaves = [t.detach().requires_grad_() if i in dbufs else t for i, t in enumerate(sbufs)]
            post = _post_mod(s, i0, j0, sm, mm, leaves, mbufs)
        with torch.no_grad():
            p = torch.exp(post.detach() - lse[:, :, i0:i1].unsqueeze(-1)).nan_to_num_(0.0)
            doc = dout[:, :, i0:i1].to(wp)
            dpost = p * (doc @ vw[:, :, j0:j1].transpose(-2, -1)
                         - delta[:, :, i0:i1].unsqueeze(-1))
        grads = torch.autograd.grad(post, [s] + [leaves[i] for i in want], dpost,
                                    allow_unused=True)
        with torch.no_grad():
            ds = grads[0] * scale
            dq[:, :, i0:i1] = ds @ kc
            dk[:, :, j0:j1] += ds.transpose(-2, -1) @ qc
            dv[:, :, j0:j1] += p.transpose(-2, -1) @ doc
            for i, g in zip(want, grads[1:]):
                if g is not None:
                    dbufs[i] += g
    res = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    for i, t in enumerate(sbufs):
        res.append(dbufs[i].to(t.dtype) if i in dbufs else torch.zeros_like(t))
    return res


@flex_chunked_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, key, scale, n_score_bufs, bufs, buf_grad, blocks, q_bs,
      kv_bs):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + [
        torch.empty_like(t) for t in bufs[:n_score_bufs]]


def _setup(ctx, inputs, output):
    q, k, v, key, scale, n_s, bufs, blocks, q_bs, kv_bs = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, *bufs, *blocks)
    ctx.args = (key, scale, n_s, len(bufs), q_bs, kv_bs)
    ctx.buf_grad = [bool(t.requires_grad) for t in bufs[:n_s]]


def _backward(ctx, dout, dlse, dmax):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    key, scale, n_s, n_bufs, q_bs, kv_bs = ctx.args
    bufs, blocks = rest[:n_bufs], rest[n_bufs:]
    buf_grad = ctx.buf_grad
    grads = flex_chunked_bwd(q, k, v, out, lse, dout.contiguous(), dlse.contiguous(), key,
                             scale, n_s, bufs, buf_grad, blocks, q_bs, kv_bs)
    dbufs = [g if need else None for g, need in zip(grads[3:], buf_grad)]
    dbufs += [None] * (len(bufs) - n_s)
    return (grads[0], grads[1], grads[2], None, None, None, dbufs, [None] * len(blocks), None,
            None)


flex_chunked_fwd.register_autograd(_backward, setup_context=_setup)


def flex_attention_chunked(query, key, value, score_mod, block_mask, scale, kernel_options,
                           score_mod_other_buffers=(), mask_mod_other_buffers=()) -> Any:
    """Same contract as ``torch.ops.higher_order.flex_attention`` (out, lse and max in log2
    units), through the chunked ops."""
    from torch._higher_order_ops.flex_attention import _permute_strides

    g = query.size(1) // key.size(1)  # GQA: repeat kv heads (autograd sums them back)
    key = torch.repeat_interleave(key, g, dim=1).expand(query.size(0), -1, -1, -1)
    value = torch.repeat_interleave(value, g, dim=1).expand(query.size(0), -1, -1, -1)
    k = register(score_mod, block_mask[-1])
    bufs = [*score_mod_other_buffers, *mask_mod_other_buffers]
    # BlockMask.as_tuple(): (Q_LEN, KV_LEN, kv_num_blocks, kv_indices, full_kv_num_blocks,
    # full_kv_indices, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)
    blocks = [t for t in block_mask[2:6] if isinstance(t, torch.Tensor)]
    q_bs, kv_bs = block_mask[-3], block_mask[-2]
    if len(blocks) % 2 or not (isinstance(q_bs, int) and isinstance(kv_bs, int)):
        blocks, q_bs, kv_bs = [], 0, 0  # unexpected layout: compute every key
    out, lse, mx = flex_chunked_fwd(query.contiguous(), key.contiguous(), value.contiguous(), k,
                                    float(scale), len(score_mod_other_buffers), bufs, blocks,
                                    q_bs, kv_bs)
    return _permute_strides(out, query.stride()), lse / _LN2, mx / _LN2
