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
where the fused one would materialise large score matrices. Block sparsity is not exploited
(``mask_mod`` is evaluated densely), as on the math path.

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


def _post_mod(s, i0, score_mod, mask_mod, sbufs, mbufs):
    """``score_mod`` applied to the scaled scores ``s`` (B, H, rows, Lkv) of query rows
    ``i0..``, masked to -inf by ``mask_mod``.

    The mods are called once on broadcastable index grids (b as (B,1,1,1), h as (1,H,1,1), ...)
    instead of under vmap: they are elementwise by contract, AOTAutograd's runtime runs
    compiled code with functorch transforms disabled, and one broadcast call is cheaper than
    four nested vmaps."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    dev = s.device
    b = torch.arange(s.size(0), device=dev).view(-1, 1, 1, 1)
    h = torch.arange(s.size(1), device=dev).view(1, -1, 1, 1)
    m = torch.arange(i0, i0 + s.size(2), device=dev).view(1, 1, -1, 1)
    n = torch.arange(s.size(3), device=dev).view(1, 1, 1, -1)
    with TransformGetItemToIndex():
        keep = mask_mod(b, h, m, n, *mbufs)
        mod = score_mod(s, b, h, m, n, *sbufs)
    return torch.where(keep, mod, torch.tensor(-math.inf, dtype=s.dtype, device=dev))


def _wp(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("torchneuron::flex_chunked_fwd", mutates_args=())
def flex_chunked_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int, scale: float,
                     n_score_bufs: int, bufs: Sequence[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked FlexAttention forward on equal-head q/k/v: (out, lse, max) in natural log."""
    with _no_modes():
        return _fwd(q, k, v, key, scale, n_score_bufs, bufs)


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


def _fwd(q, k, v, key, scale, n_score_bufs, bufs):
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
        for i0 in range(0, L, step):
            i1 = min(L, i0 + step)
            post = _post_mod((q[:, :, i0:i1].to(wp) @ kt) * scale, i0, sm, mm, sbufs, mbufs)
            m = post.amax(-1)
            # fully masked rows: lse = -inf and probabilities 0, as the HOP defines them
            l = torch.where(m == -math.inf, -math.inf, post.logsumexp(-1))
            p = torch.exp(post - l.unsqueeze(-1)).nan_to_num_(0.0)
            out[:, :, i0:i1] = p.to(q.dtype) @ vv
            lse[:, :, i0:i1] = l
            mx[:, :, i0:i1] = m
    return out, lse, mx


@flex_chunked_fwd.register_fake
def _(q, k, v, key, scale, n_score_bufs, bufs):
    wp = _wp(q)
    B, H, L, _ = q.shape
    return (q.new_empty(B, H, L, v.size(-1)), q.new_empty(B, H, L, dtype=wp),
            q.new_empty(B, H, L, dtype=wp))


@torch.library.custom_op("torchneuron::flex_chunked_bwd", mutates_args=())
def flex_chunked_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor, key: int,
                     scale: float, n_score_bufs: int, bufs: Sequence[torch.Tensor],
                     buf_grad: Sequence[bool]) -> list[torch.Tensor]:
    """Flash-attention backward of :func:`flex_chunked_fwd`: [dq, dk, dv, d(score bufs)...]
    (a zero tensor for buffers that need no gradient)."""
    with _no_modes():
        return _bwd(q, k, v, out, lse, dout, dlse, key, scale, n_score_bufs, bufs, buf_grad)


def _bwd(q, k, v, out, lse, dout, dlse, key, scale, n_score_bufs, bufs, buf_grad):
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
    for i0 in range(0, L, step):
        i1 = min(L, i0 + step)
        qc = q[:, :, i0:i1].to(wp)
        with torch.enable_grad():
            s = ((qc @ kw.transpose(-2, -1)) * scale).requires_grad_()
            leaves = [t.detach().requires_grad_() if i in dbufs else t for i, t in enumerate(sbufs)]
            post = _post_mod(s, i0, sm, mm, leaves, mbufs)
        with torch.no_grad():
            p = torch.exp(post.detach() - lse[:, :, i0:i1].unsqueeze(-1)).nan_to_num_(0.0)
            doc = dout[:, :, i0:i1].to(wp)
            dpost = p * (doc @ vw.transpose(-2, -1) - delta[:, :, i0:i1].unsqueeze(-1))
        grads = torch.autograd.grad(post, [s] + [leaves[i] for i in want], dpost,
                                    allow_unused=True)
        with torch.no_grad():
            ds = grads[0] * scale
            dq[:, :, i0:i1] = ds @ kw
            dk += ds.transpose(-2, -1) @ qc
            dv += p.transpose(-2, -1) @ doc
            for i, g in zip(want, grads[1:]):
                if g is not None:
                    dbufs[i] += g
    res = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    for i, t in enumerate(sbufs):
        res.append(dbufs[i].to(t.dtype) if i in dbufs else torch.zeros_like(t))
    return res


@flex_chunked_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, key, scale, n_score_bufs, bufs, buf_grad):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)] + [
        torch.empty_like(t) for t in bufs[:n_score_bufs]]


def _setup(ctx, inputs, output):
    q, k, v, key, scale, n_s, bufs = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, *bufs)
    ctx.args = (key, scale, n_s)
    ctx.buf_grad = [bool(t.requires_grad) for t in bufs[:n_s]]


def _backward(ctx, dout, dlse, dmax):
    q, k, v, out, lse, *bufs = ctx.saved_tensors
    key, scale, n_s = ctx.args
    buf_grad = ctx.buf_grad
    grads = flex_chunked_bwd(q, k, v, out, lse, dout.contiguous(), dlse.contiguous(), key,
                             scale, n_s, bufs, buf_grad)
    dbufs = [g if need else None for g, need in zip(grads[3:], buf_grad)]
    dbufs += [None] * (len(bufs) - n_s)
    return grads[0], grads[1], grads[2], None, None, None, dbufs


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
    out, lse, mx = flex_chunked_fwd(query.contiguous(), key.contiguous(), value.contiguous(), k,
                                    float(scale), len(score_mod_other_buffers), bufs)
    return _permute_strides(out, query.stride()), lse / _LN2, mx / _LN2
