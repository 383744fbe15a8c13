"""SDPA's CUDA backend kernels, called directly: ``_flash_attention_forward`` and
``_efficient_attention_forward`` (CUDA dtype parity: OpInfo lists them for CUDA only) and their
backward ops ``_flash_attention_backward`` and ``_efficient_attention_backward`` (autograd
through the forwards).

Neuron's SDPA choice never picks them (``sdpa.cpp`` reports its own efficient-attention op), but
code written for CUDA calls them by name. They take ``[batch, seq, heads, dim]`` inputs (not
SDPA's ``[batch, heads, seq, dim]``) and return CUDA's tuples:

- flash: ``(output, logsumexp [B, H, Sq] fp32, rng_state, unused, debug_attn_mask)``;
  ``is_causal`` aligns the mask to the bottom-right corner (FlashAttention-2's rule when
  ``Sq != Sk``); key/value may have fewer heads (grouped-query attention);
- efficient: ``(output, logsumexp [B, H, ceil(Sq/32)*32] fp32 or [B, H, 0], philox_seed,
  philox_offset, max_seqlen_q, max_seqlen_k)``; ``custom_mask_type`` 0 none, 1 causal from the
  top-left, 2 causal from the bottom-right; an additive ``bias`` broadcast to ``[B, H, Sq, Sk]``.

Arithmetic is fp32 (fp64 for fp64 inputs), rounded once to the input dtype, as the CUDA kernels
accumulate. The backward ops recompute the probabilities from the forward's ``logsumexp`` (as
flash attention does, instead of saving them) and read the forward's rounded ``out`` for the
``rowsum(dO * O)`` term, as CUDA's do. Rows with every key masked give zeros (logsumexp ``-inf``), as on CUDA. The efficient
kernel takes variable-length batches (``cu_seqlens_q/k``: one packed sequence, each segment
attending within itself).

Dropout: the forward reserves one Philox position per element of the ``[B, H, Sq, Sk]`` mask on
the device's default generator, draws the keep mask with the device generator's Philox4x32-10 at
that ``(seed, offset)`` and returns the pair as CUDA does (flash: ``rng_state``; efficient:
``philox_seed``, ``philox_offset``); the backward regenerates the same mask from them. The flash
kernel's variable-length form (``cum_seq_*``), sliding windows, ALiBi, paged KV, dropout with the
efficient kernel's packed batches and flash's debug mask with dropout raise
``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

import math

import torch

from . import on_cpu

__all__ = ["flash_attention_forward", "efficient_attention_forward", "flash_attention_backward",
           "efficient_attention_backward"]

_LSE_ALIGN = 32  # the efficient kernel pads its logsumexp to a multiple of 32 queries


def _check_dropout(op: str, dropout_p: float) -> float:
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise RuntimeError(f"{op}: dropout_p must be in [0, 1), got {p}")
    return p


def _reserve(device: torch.device, numel: int) -> tuple[int, int]:
    """(seed, offset) of ``device``'s default generator for a dropout mask of ``numel`` elements,
    advancing the generator's offset past them (``numel`` rounded up to 4, as every neuron random
    op reserves). CUDA's kernels advance less (a Philox subsequence per batch and head); neuron's
    generator numbers elements consecutively, so it reserves one position per element."""
    gen = torch.neuron.random._generator(device)
    seed, offset = gen.initial_seed(), gen.get_offset()
    gen.set_offset(offset + -(-numel // 4) * 4)
    return seed, offset


def _keep_mask(device: torch.device, shape, dropout_p: float, seed: int, offset: int) -> torch.Tensor:
    """The dropout keep mask (1.0 kept, 0.0 dropped) [B, H, Sq, Sk] as a function of (seed, offset)
    only: the device generator's Philox4x32-10 Bernoulli draw at that state, so the forward and
    the backward (which gets (seed, offset) back from the forward's outputs) agree."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2 ** 64)  # the efficient kernel returns the uint64 seed as int64, as CUDA does
    gen.set_offset(offset)
    return torch.empty(shape, dtype=torch.float32, device=device).bernoulli_(1.0 - dropout_p, generator=gen)


def _check_efficient_heads_and_mask(op: str, query, key, custom_mask_type: int) -> None:
    """The efficient kernel's rules shared by its forward and backward (CUDA's messages)."""
    if key.shape[2] != query.shape[2]:
        raise RuntimeError(f"{op}: query and key must have the same number of heads")
    if custom_mask_type not in (0, 1, 2):
        raise RuntimeError(f"{op}: custom_mask_type must be 0 (none), 1 (causal from top-left) or 2 (causal from "
                           f"bottom-right), got {custom_mask_type}")


def _refuse(op: str, **named) -> None:
    for name, value in named.items():
        if value is not None and value is not False and not (isinstance(value, float) and value == 0.0):
            raise NotImplementedError(f"{op} on neuron: {name}={value!r} is not implemented; call "
                                      "torch.nn.functional.scaled_dot_product_attention instead")


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads(q, k, v):
    """[B, S, H, D] inputs to [B, H, S, D] in the accumulation dtype, key/value heads repeated
    to the query's (grouped-query attention)."""
    acc = _acc(q.dtype)
    qt, kt, vt = (t.to(acc).transpose(1, 2) for t in (q, k, v))
    heads, kv_heads = qt.shape[1], kt.shape[1]
    if kv_heads != heads:
        if heads % kv_heads:
            raise RuntimeError(f"Number of heads in key/value ({kv_heads}) must divide the number of heads in "
                               f"query ({heads})")
        kt = kt.repeat_interleave(heads // kv_heads, dim=1)
        vt = vt.repeat_interleave(heads // kv_heads, dim=1)
    return qt, kt, vt


def _scores(qt, kt, scale, bias, causal_offset):
    scores = torch.matmul(qt, kt.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if causal_offset is not None:
        keep = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool).tril(causal_offset)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _probs(scores, lse):
    """softmax(scores) recomputed from the row logsumexp (what the forward returned, as flash
    attention's backward does); rows with every key masked (lse -inf) give zeros."""
    p = torch.exp(scores - lse.unsqueeze(-1))
    return torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros((), dtype=scores.dtype), p)


def _attend(q, k, v, scale, bias, causal_offset, keep=None, dropout_p=0.0):
    """q [B, Sq, H, D], k/v [B, Sk, Hk, D]. causal_offset: None, or the diagonal offset of the
    causal mask (0 top-left, Sk - Sq bottom-right). keep: the dropout mask [B, H, Sq, Sk] (kept
    probabilities scaled by 1 / (1 - dropout_p)) or None. Returns (out [B, Sq, H, Dv] in q's
    dtype, lse [B, H, Sq] fp32 or fp64)."""
    qt, kt, vt = _heads(q, k, v)
    scores = _scores(qt, kt, scale, bias, causal_offset)
    lse = torch.logsumexp(scores, dim=-1)
    p = _probs(scores, lse)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p, vt).transpose(1, 2).to(q.dtype)
    return out, lse


def _attend_backward(dout, q, k, v, out, lse, scale, bias, causal_offset, keep=None, dropout_p=0.0):
    """Gradients of _attend in fp32 (fp64 for fp64), from the forward's output and logsumexp
    [B, H, Sq]: dV = P'^T dO, dP' = dO V^T, dS = P * (dP' * mask - rowsum(dO * O)), dQ = scale dS K,
    dK = scale dS^T Q (P' = P with the dropout mask applied). Key/value gradients of grouped
    heads are summed. Returns (dq, dk, dv in their inputs' dtypes, dS [B, H, Sq, Sk] in fp32/fp64)."""
    qt, kt, vt = _heads(q, k, v)
    acc = qt.dtype
    do = dout.to(acc).transpose(1, 2)
    p = _probs(_scores(qt, kt, scale, bias, causal_offset), lse.to(acc))
    dp = torch.matmul(do, vt.transpose(-2, -1))
    if keep is not None:
        scaled = keep.to(acc) / (1.0 - dropout_p)
        dv = torch.matmul((p * scaled).transpose(-2, -1), do)
        dp = dp * scaled
    else:
        dv = torch.matmul(p.transpose(-2, -1), do)
    delta = (do * out.to(acc).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kt) * scale
    dk = torch.matmul(ds.transpose(-2, -1), qt) * scale
    kv_heads = k.shape[2]
    if kv_heads != q.shape[2]:
        b, h, s = dk.shape[0], dk.shape[1], dk.shape[2]
        dk = dk.reshape(b, kv_heads, h // kv_heads, s, -1).sum(2)
        dv = dv.reshape(b, kv_heads, h // kv_heads, s, -1).sum(2)
    return (dq.transpose(1, 2).to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), ds)


def _flash_cpu(q, k, v, is_causal, return_debug_mask, scale, keep, dropout_p, seed, offset):
    sq, sk = q.shape[1], k.shape[1]
    out, lse = _attend(q, k, v, scale, None, (sk - sq) if is_causal else None, keep, dropout_p)
    rng_state = torch.tensor([seed, offset], dtype=torch.uint64)  # CUDA's (seed, offset) pair
    unused = torch.empty((), dtype=torch.uint64)
    debug = torch.empty(0, dtype=q.dtype)
    if return_debug_mask:  # the attention probabilities, as FlashAttention's debug mask holds them
        debug = torch.exp(_attend_scores(q, k, scale, (sk - sq) if is_causal else None) - lse.unsqueeze(-1)).to(q.dtype)
    return out.contiguous(), lse.contiguous(), rng_state, unused, debug


def _attend_scores(q, k, scale, causal_offset):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qt, kt = q.to(acc).transpose(1, 2), k.to(acc).transpose(1, 2)
    if kt.shape[1] != qt.shape[1]:
        kt = kt.repeat_interleave(qt.shape[1] // kt.shape[1], dim=1)
    s = torch.matmul(qt, kt.transpose(-2, -1)) * scale
    if causal_offset is not None:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(causal_offset)
        s = s.masked_fill(~keep, float("-inf"))
    return s


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """``aten::_flash_attention_forward`` (CUDA's FlashAttention-2 entry point)."""
    op = "_flash_attention_forward"
    p = _check_dropout(op, dropout_p)
    _refuse(op, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k,
            return_debug_mask_with_dropout=bool(return_debug_mask and p), window_size_left=window_size_left, window_size_right=window_size_right, seqused_k=seqused_k,
            alibi_slopes=alibi_slopes, block_table=block_table)
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise RuntimeError(f"{op}: expected 4-D [batch, seq, heads, dim] query/key/value")
    sc = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    keep, seed, offset = None, 0, 0
    if p:
        shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
        seed, offset = _reserve(query.device, math.prod(shape))
        keep = _keep_mask(query.device, shape, p, seed, offset)
    return on_cpu(op, _flash_cpu, query, key, value, bool(is_causal), bool(return_debug_mask), sc, keep, p, seed,
                  offset)


def _efficient_dense(q, k, v, bias, mask_type, scale, keep=None, dropout_p=0.0):
    sq, sk = q.shape[1], k.shape[1]
    offset = {0: None, 1: 0, 2: sk - sq}[mask_type]
    if bias is not None:
        bias = bias.expand(q.shape[0], q.shape[2], sq, sk)
    return _attend(q, k, v, scale, bias, offset, keep, dropout_p)


def _efficient_cpu(q, k, v, bias, cu_q, cu_k, mask_type, compute_lse, scale, max_q, max_k, keep, dropout_p, seed,
                   rng_offset):
    h = q.shape[2]
    if cu_q is None:
        out, lse = _efficient_dense(q, k, v, bias, mask_type, scale, keep, dropout_p)
        lses = [lse]
    else:
        # Variable-length batch: one packed sequence ([1, total, H, D]); sequence i is the rows
        # cu_q[i]:cu_q[i+1] of the queries and cu_k[i]:cu_k[i+1] of the keys, attending only within.
        cq, ck = cu_q.tolist(), cu_k.tolist()
        out = torch.empty(q.shape[:3] + v.shape[3:], dtype=q.dtype)
        lses = []
        for i in range(len(cq) - 1):
            sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            o, lse = _efficient_dense(q[:, sl_q], k[:, sl_k], v[:, sl_k], None, mask_type, scale)
            out[:, sl_q] = o
            lses.append(lse)
    if compute_lse:
        padded = torch.full((len(lses) if cu_q is not None else q.shape[0], h, -(-max_q // _LSE_ALIGN) * _LSE_ALIGN),
                            float("inf"), dtype=torch.float32)
        if cu_q is None:
            padded[:, :, :lses[0].shape[-1]] = lses[0]
        else:
            for i, lse in enumerate(lses):
                padded[i, :, :lse.shape[-1]] = lse[0]
    else:
        padded = torch.empty((len(lses) if cu_q is not None else q.shape[0], h, 0), dtype=torch.float32)
    # CUDA returns the Philox seed and offset as int64 scalars (the uint64 seed reinterpreted)
    seed_t = torch.tensor(seed - 2 ** 64 if seed >= 2 ** 63 else seed, dtype=torch.int64)
    return out.contiguous(), padded, seed_t, torch.tensor(rng_offset, dtype=torch.int64), max_q, max_k


def efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p, custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None,
                                window_size=None):
    """``aten::_efficient_attention_forward`` (CUDA's memory-efficient attention entry point)."""
    op = "_efficient_attention_forward"
    p = _check_dropout(op, dropout_p)
    _refuse(op, seqlen_k=seqlen_k, window_size=window_size,
            dropout_with_cu_seqlens=bool(p and cu_seqlens_q is not None))
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise RuntimeError(f"{op}: cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is not None:
        if query.shape[0] != 1 or bias is not None:
            raise RuntimeError(f"{op}: a variable-length batch is one packed sequence (batch size 1) without bias")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise RuntimeError(f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise RuntimeError(f"{op}: expected 4-D [batch, seq, heads, dim] query/key/value")
    _check_efficient_heads_and_mask(op, query, key, custom_mask_type)
    sc = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if cu_seqlens_q is not None:
        mq = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if max_seqlen_q is None else max_seqlen_q
        mk = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if max_seqlen_k is None else max_seqlen_k
    else:
        mq = max_seqlen_q if max_seqlen_q is not None else query.shape[1]
        mk = max_seqlen_k if max_seqlen_k is not None else key.shape[1]
    keep, seed, rng_offset = None, 0, 0
    if p:
        shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
        seed, rng_offset = _reserve(query.device, math.prod(shape))
        keep = _keep_mask(query.device, shape, p, seed, rng_offset)
    out, lse, seed, offset, _, _ = on_cpu(op, _efficient_cpu, query, key, value, bias, cu_seqlens_q, cu_seqlens_k,
                                          int(custom_mask_type), bool(compute_log_sumexp), sc, mq, mk, keep, p, seed,
                                          rng_offset)
    return out, lse, seed.cpu(), offset.cpu(), mq, mk


def _flash_backward_cpu(dout, q, k, v, out, lse, is_causal, scale, keep, dropout_p):
    sq, sk = q.shape[1], k.shape[1]
    dq, dk, dv, _ = _attend_backward(dout, q, k, v, out, lse, scale, None, (sk - sq) if is_causal else None, keep,
                                     dropout_p)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                             dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                             window_size_right=None):
    """``aten::_flash_attention_backward``: ``(grad_query, grad_key, grad_value)`` of
    ``_flash_attention_forward``, recomputing the probabilities from its ``logsumexp``."""
    op = "_flash_attention_backward"
    varlen = lambda t: t if t is not None and t.numel() else None  # autograd passes undefined tensors
    p = _check_dropout(op, dropout_p)
    _refuse(op, cum_seq_q=varlen(cum_seq_q), cum_seq_k=varlen(cum_seq_k),
            window_size_left=window_size_left, window_size_right=window_size_right)
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    _check_backward(op, grad_out, query, key, value, out, logsumexp, query.shape[1])
    sc = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    keep = None
    if p:  # the forward's mask, regenerated from the (seed, offset) it returned in rng_state
        seed, offset = (int(x) for x in rng_state.cpu().tolist())
        keep = _keep_mask(query.device, (query.shape[0], query.shape[2], query.shape[1], key.shape[1]), p, seed,
                          offset)
    return on_cpu(op, _flash_backward_cpu, grad_out, query, key, value, out, logsumexp, bool(is_causal), sc, keep, p)


def _check_backward(op, grad_out, query, key, value, out, logsumexp, sq):
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out), ("grad_out", grad_out)):
        if t.dim() != 4:
            raise RuntimeError(f"{op}: expected 4-D [batch, seq, heads, dim] {name}, got shape {tuple(t.shape)}")
    if grad_out.shape != out.shape:
        raise RuntimeError(f"{op}: grad_out {tuple(grad_out.shape)} and out {tuple(out.shape)} must have one shape")
    if logsumexp.dim() != 3 or logsumexp.shape[-1] < sq:
        raise RuntimeError(f"{op}: logsumexp of shape {tuple(logsumexp.shape)} holds fewer than the {sq} queries; "
                           "run the forward with its logsumexp (compute_log_sumexp=True for the efficient kernel)")


def _efficient_backward_cpu(dout, q, k, v, bias, out, cu_q, cu_k, lse, mask_type, bias_grad, scale, keep, dropout_p):
    if cu_q is None:
        sq, sk = q.shape[1], k.shape[1]
        offset = {0: None, 1: 0, 2: sk - sq}[mask_type]
        full = bias.expand(q.shape[0], q.shape[2], sq, sk) if bias is not None else None
        dq, dk, dv, ds = _attend_backward(dout, q, k, v, out, lse[:, :, :sq], scale, full, offset, keep, dropout_p)
        if not bias_grad:
            return dq.contiguous(), dk.contiguous(), dv.contiguous(), torch.empty((), dtype=q.dtype)
        # the gradient of a broadcast bias is dS summed over the broadcast dimensions
        dims = [i for i in range(4) if bias.shape[i] == 1 and ds.shape[i] != 1]
        db = ds.sum(dims, keepdim=True) if dims else ds
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), db.to(bias.dtype).contiguous()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):  # one packed sequence: each segment attends within itself
        sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        sq, sk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        offset = {0: None, 1: 0, 2: sk - sq}[mask_type]
        g = _attend_backward(dout[:, sl_q], q[:, sl_q], k[:, sl_k], v[:, sl_k], out[:, sl_q], lse[i:i + 1, :, :sq],
                             scale, None, offset)
        dq[:, sl_q], dk[:, sl_k], dv[:, sl_k] = g[0], g[1], g[2]
    return dq, dk, dv, torch.empty((), dtype=q.dtype)


def efficient_attention_backward(grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type,
                                 bias_requires_grad, *, scale=None, num_splits_key=None, window_size=None,
                                 shared_storage_dqdkdv=False):
    """``aten::_efficient_attention_backward``: ``(grad_query, grad_key, grad_value, grad_bias)``
    of ``_efficient_attention_forward`` (``grad_bias`` has ``bias``'s shape when
    ``bias_requires_grad``, else it is an empty 0-dim tensor), recomputing the probabilities from
    its padded ``logsumexp``. ``num_splits_key`` and ``shared_storage_dqdkdv`` are CUDA scheduling
    and allocation hints and change nothing here."""
    op = "_efficient_attention_backward"
    p = _check_dropout(op, dropout_p)
    _refuse(op, window_size=window_size, dropout_with_cu_seqlens=bool(p and cu_seqlens_q is not None))
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise RuntimeError(f"{op}: cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is not None and (query.shape[0] != 1 or bias is not None):
        raise RuntimeError(f"{op}: a variable-length batch is one packed sequence (batch size 1) without bias")
    _check_efficient_heads_and_mask(op, query, key, custom_mask_type)
    longest = query.shape[1] if cu_seqlens_q is None else int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    _check_backward(op, grad_out_, query, key, value, out, logsumexp, longest)
    if bias_requires_grad and bias is None:
        raise RuntimeError(f"{op}: bias_requires_grad=True without a bias")
    sc = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    keep = None
    if p:  # the forward's mask, regenerated from the philox_seed and philox_offset it returned
        keep = _keep_mask(query.device, (query.shape[0], query.shape[2], query.shape[1], key.shape[1]), p,
                          int(philox_seed.item()), int(philox_offset.item()))
    return on_cpu(op, _efficient_backward_cpu, grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k,
                  logsumexp, int(custom_mask_type), bool(bias_requires_grad), sc, keep, p)


def register(lib: torch.library.Library) -> None:
    lib.impl("_flash_attention_forward", flash_attention_forward, "PrivateUse1")
    lib.impl("_efficient_attention_forward", efficient_attention_forward, "PrivateUse1")
    lib.impl("_flash_attention_backward", flash_attention_backward, "PrivateUse1")
    lib.impl("_efficient_attention_backward", efficient_attention_backward, "PrivateUse1")
