"""PyTorch custom ops over the NKI-lib kernels (``torch.ops.nkilib.*``).

Every op is registered with :func:`torchneuron.nki.nki_op` (a ``torch.library.custom_op``
with an automatic fake implementation), so it runs eagerly on CPU or ``neuron`` tensors (the
kernel runs on the simulator) and is a single node under ``torch.compile``. Ops with a
backward kernel carry autograd (``register_autograd``).

Public helpers take the usual PyTorch layouts:

* :func:`attention` -- ``(B, H, Sq, d)`` queries, ``(B, Hkv, Skv, d)`` keys/values, GQA when
  Hkv < H; forward ``attention_cte``, backward ``attention_bwd``.
* :func:`cross_entropy` -- per-row loss, forward and backward kernels (autograd).
* :func:`rope` -- autograd through the same kernel (RoPE is linear: dx = rope(dy, cos, -sin)).
* :func:`moe_cte` -- blockwise MoE, forward ``moe_cte``, backward the ``moe_cte_bwd`` kernel
  (``nkilib::moe_cte_bwd``; h_g / h_u recomputed, row T of the output gradient ignored).
* :func:`rmsnorm` -- autograd (x and w) through the ``rmsnorm_bwd`` kernel
  (``nkilib::rmsnorm_bwd``).
* :func:`mlp` -- autograd (x and the three weights) through the ``mlp_bwd`` kernel
  (``nkilib::mlp_bwd``; h_g / h_u are recomputed, nothing but the inputs is saved).
* :func:`router_topk`, :func:`cumsum` -- forward only.

The backward ops take ``lnc`` (1 or 2); autograd uses 1. Under LNC=2 the kernels return one
fp32 weight-gradient partial per core (split rows / tokens) and the op sums them.

This module imports torch; :mod:`torchneuron.nkilib` itself does not.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from torchneuron.nki.torch_ops import nki_op

# kernels come from their modules (the package itself loads them lazily)
from .attention import attention_cte
from .attention_backward import attention_bwd as attention_bwd_kernel
from .cross_entropy import cross_entropy_bwd as _ce_bwd_kernel
from .cross_entropy import cross_entropy_fwd as _ce_fwd_kernel
from .gated_mlp import mlp as _mlp_kernel
from .gated_mlp import mlp_bwd as _mlp_bwd_kernel
from .moe import moe_cte as _moe_kernel
from .moe import moe_cte_bwd as _moe_bwd_kernel
from .norm import rmsnorm as _rmsnorm_kernel
from .norm import rmsnorm_bwd as _rmsnorm_bwd_kernel
from .rotary import rope as _rope_kernel
from .router import router_topk as _router_kernel
from .scan import cumsum as _cumsum_kernel


def _c(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous()


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
@nki_op("nkilib::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, sliding_window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention forward: ``(out (B, H, Sq, d), lse (B, H, 128, ceil(Sq/128)))``."""
    B, H, Sq, d = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    o, lse = attention_cte(_c(q).reshape(B * H, Sq, d), _c(k).reshape(B * Hkv, Skv, d),
                           _c(v).reshape(B * Hkv, Skv, d), scale=float(scale),
                           causal_mask=bool(causal), sliding_window=sliding_window, tp_q=True,
                           tp_k=True, tp_out=False, cache_softmax=True)
    return o.reshape(B, H, Sq, d), lse.reshape(B, H, lse.shape[1], lse.shape[2])


@nki_op("nkilib::attention_bwd", mutates_args=())
def attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                  dy: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool,
                  sliding_window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention backward in (B, H, S, d) layouts: ``(dq, dk, dv)``."""
    t = lambda x: _c(x.transpose(2, 3))  # noqa: E731  (kernel layout (B, H, d, S))
    dq, dk, dv = attention_bwd_kernel(t(q), t(k), t(v), t(o), t(dy.to(q.dtype)), _c(lse),
                                      use_causal_mask=bool(causal), softmax_scale=float(scale),
                                      sliding_window=sliding_window)
    return t(dq), t(dk), t(dv)


def _attn_setup(ctx, inputs, output):
    q, k, v, scale, causal, window = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (scale, causal, window)


def _attn_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(q, k, v, o, do, lse, *ctx.args)
    return dq, dk, dv, None, None, None


attention_fwd.register_autograd(_attn_backward, setup_context=_attn_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              causal: bool = True, sliding_window: int | None = None) -> torch.Tensor:
    """Scaled dot-product attention through the NKI kernels (differentiable).

    ``q`` (B, H, Sq, d), ``k``/``v`` (B, Hkv, Skv, d) with H % Hkv == 0; ``scale`` defaults to
    1/sqrt(d); ``causal`` is top-left aligned like ``F.scaled_dot_product_attention``.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return attention_fwd(q, k, v, float(scale), bool(causal), sliding_window)[0]


# ---------------------------------------------------------------------------------------------
# rmsnorm, rope, mlp (with backward kernels), router, cumsum
# ---------------------------------------------------------------------------------------------
@nki_op("nkilib::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading dims) with weight ``w``."""
    H = x.shape[-1]
    return _rmsnorm_kernel(_c(x).reshape(-1, H), _c(w), eps=float(eps)).reshape(x.shape)


def _lnc(lnc) -> int:
    if int(lnc) not in (1, 2):
        raise ValueError(f"lnc must be 1 or 2, got {lnc}")
    return int(lnc)


@nki_op("nkilib::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, eps: float,
                lnc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like x, dw like w) of :func:`rmsnorm` for the output gradient ``dy``."""
    H = x.shape[-1]
    args = (_c(x).reshape(-1, H), _c(w), _c(dy.to(x.dtype)).reshape(-1, H))
    if _lnc(lnc) == 2:  # one fp32 dw partial per core
        dx, dw = _rmsnorm_bwd_kernel[2](*args, eps=float(eps))
        dw = dw.sum(0).to(w.dtype)
    else:
        dx, dw = _rmsnorm_bwd_kernel(*args, eps=float(eps))
    return dx.reshape(x.shape), dw


def _rmsnorm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.eps = inputs[2]


def _rmsnorm_backward(ctx, dy):
    x, w = ctx.saved_tensors
    dx, dw = rmsnorm_bwd(x, w, dy, ctx.eps, 1)
    return dx, dw, None


rmsnorm.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


@nki_op("nkilib::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, S, H, d) with ``cos``/``sin`` (S, d/2)."""
    return _rope_kernel(_c(x), _c(cos.float()), _c(sin.float()))


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _rope_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rope(dy, cos, -sin), None, None  # the transpose of a rotation is the inverse one


rope.register_autograd(_rope_backward, setup_context=_rope_setup)


@nki_op("nkilib::mlp", mutates_args=())
def mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
        w_down: torch.Tensor) -> torch.Tensor:
    """Gated MLP of ``x`` (..., H) with [in, out] weights."""
    H = x.shape[-1]
    return _mlp_kernel(_c(x).reshape(-1, H), _c(w_gate), _c(w_up), _c(w_down)).reshape(x.shape)


@nki_op("nkilib::mlp_bwd", mutates_args=())
def mlp_bwd(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
            dy: torch.Tensor, lnc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor]:
    """(dx, dw_gate, dw_up, dw_down) of :func:`mlp` for the output gradient ``dy``."""
    H = x.shape[-1]
    args = (_c(x).reshape(-1, H), _c(w_gate), _c(w_up), _c(w_down),
            _c(dy.to(x.dtype)).reshape(-1, H))
    if _lnc(lnc) == 2:  # fp32 weight-gradient partials, one per core
        dx, dwg, dwu, dwd = _mlp_bwd_kernel[2](*args)
        dwg, dwu, dwd = (p.sum(0).to(w.dtype) for p, w in
                         ((dwg, w_gate), (dwu, w_up), (dwd, w_down)))
    else:
        dx, dwg, dwu, dwd = _mlp_bwd_kernel(*args)
    return dx.reshape(x.shape), dwg, dwu, dwd


def _mlp_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _mlp_backward(ctx, dy):
    return mlp_bwd(*ctx.saved_tensors, dy, 1)


mlp.register_autograd(_mlp_backward, setup_context=_mlp_setup)


@nki_op("nkilib::router_topk", mutates_args=())
def router_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(affinities (T, E) fp32, indices (T, k) int32) of softmax top-k routing."""
    return _router_kernel(_c(logits), k=int(k), normalize=bool(normalize))


@nki_op("nkilib::cumsum", mutates_args=())
def cumsum(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sum along the last dim."""
    L = x.shape[-1]
    return _cumsum_kernel(_c(x).reshape(-1, L)).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# cross entropy
# ---------------------------------------------------------------------------------------------
@nki_op("nkilib::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(logits: torch.Tensor, labels: torch.Tensor,
                      ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss (N,), lse (N,)) for ``logits`` (N, V) and int ``labels`` (N,)."""
    return _ce_fwd_kernel(_c(logits), _c(labels.to(torch.int32)),
                                 ignore_index=int(ignore_index))


@nki_op("nkilib::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                      dloss: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """dlogits (N, V) for the per-row loss gradient ``dloss`` (N,)."""
    return _ce_bwd_kernel(_c(logits), _c(labels.to(torch.int32)), _c(lse),
                                 _c(dloss.float()), ignore_index=int(ignore_index))


def _ce_setup(ctx, inputs, output):
    logits, labels, ignore_index = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.ignore_index = ignore_index


def _ce_backward(ctx, dloss, dlse):
    logits, labels, lse = ctx.saved_tensors
    return cross_entropy_bwd(logits, labels, lse, dloss, ctx.ignore_index), None, None


cross_entropy_fwd.register_autograd(_ce_backward, setup_context=_ce_setup)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` for (N, V) logits through the NKI kernels (differentiable).

    ``reduction``: "none", "sum", or "mean" (over the non-ignored rows, like PyTorch); any
    other value raises ValueError."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"cross_entropy: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    loss = cross_entropy_fwd(logits, labels, int(ignore_index))[0]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------
@nki_op("nkilib::moe_cte", mutates_args=())
def moe_cte(hidden_states: torch.Tensor, expert_affinities_masked: torch.Tensor,
            gate_up_proj_weight: torch.Tensor, down_proj_weight: torch.Tensor,
            token_position_to_id: torch.Tensor, block_to_expert: torch.Tensor, block_size: int,
            lnc: int) -> torch.Tensor:
    """Blockwise MoE (``moe_cte`` layouts); ``lnc=2`` runs the shard-on-block variant and sums
    the two cores' partial outputs. Returns (T+1, H)."""
    args = (_c(hidden_states), _c(expert_affinities_masked.float()), _c(gate_up_proj_weight),
            _c(down_proj_weight), _c(token_position_to_id.to(torch.int32)),
            _c(block_to_expert.to(torch.int32)), int(block_size))
    if int(lnc) == 2:
        return _moe_kernel[2](*args).sum(0, dtype=torch.float32).to(hidden_states.dtype)
    return _moe_kernel(*args)


def _moe_torch(x, aff, gu, dw, tp, be, block_size):
    """Differentiable PyTorch version of moe_cte (the tests' autograd reference)."""
    T1, H = x.shape
    E = gu.shape[0]
    affm = aff.float().reshape(T1, E)
    out = torch.zeros(T1, H, device=x.device, dtype=torch.float32)
    ids_all = tp.long().reshape(-1, block_size)
    experts = be.reshape(-1).tolist()
    for b, e in enumerate(experts):
        ids = ids_all[b]
        xb = x.float()[ids]
        h = torch.nn.functional.silu(xb @ gu[e, :, 0].float()) * (xb @ gu[e, :, 1].float())
        out = out.index_add(0, ids, (h @ dw[e].float()) * affm[ids, e][:, None])
    return out.to(x.dtype)


@nki_op("nkilib::moe_cte_bwd", mutates_args=())
def moe_cte_bwd(hidden_states: torch.Tensor, expert_affinities_masked: torch.Tensor,
                gate_up_proj_weight: torch.Tensor, down_proj_weight: torch.Tensor,
                token_position_to_id: torch.Tensor, block_to_expert: torch.Tensor,
                dout: torch.Tensor, block_size: int,
                lnc: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_hidden, d_affinities (like expert_affinities_masked), d_gate_up, d_down) of
    :func:`moe_cte` for the output gradient ``dout`` (row T ignored; row T of d_hidden and
    d_affinities is 0). ``lnc=2`` sums the shard-on-block fp32 partials."""
    args = (_c(hidden_states), _c(expert_affinities_masked.float()), _c(gate_up_proj_weight),
            _c(down_proj_weight), _c(token_position_to_id.to(torch.int32)),
            _c(block_to_expert.to(torch.int32)), _c(dout.to(hidden_states.dtype)),
            int(block_size))
    if _lnc(lnc) == 2:
        parts = _moe_bwd_kernel[2](*args)
        dx, daff, dgu, ddn = (p.sum(0).to(like.dtype) for p, like in zip(
            parts, (hidden_states, expert_affinities_masked, gate_up_proj_weight,
                    down_proj_weight)))
    else:
        dx, daff, dgu, ddn = _moe_bwd_kernel(*args)
        daff = daff.to(expert_affinities_masked.dtype)
    return dx, daff.reshape(expert_affinities_masked.shape), dgu, ddn


def _moe_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.block_size = inputs[6]


def _moe_backward(ctx, dout):
    x, aff, gu, dw, tp, be = ctx.saved_tensors
    dx, daff, dgu, ddn = moe_cte_bwd(x, aff, gu, dw, tp, be, dout, ctx.block_size, 1)
    return dx, daff, dgu, ddn, None, None, None, None


moe_cte.register_autograd(_moe_backward, setup_context=_moe_setup)


# ---------------------------------------------------------------------------------------------
# grouped matmul (torch._grouped_mm)
# ---------------------------------------------------------------------------------------------
def _ends(offs: torch.Tensor) -> tuple:
    # The kernels specialise on the group ends (trace-time constants), so they are read on
    # the host -- a sync a real device would avoid with a run-time-offset kernel.
    return tuple(int(e) for e in offs.detach().cpu().tolist())


@torch.library.custom_op("nkilib::grouped_mm", mutates_args=())
def grouped_mm_2d3d(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` 2-D x 3-D: a (T, K), b (G, K, N), offs (G,) int32 -> (T, N)."""
    from .grouped_matmul import grouped_mm as kernel
    return kernel(_c(a), _c(b), _ends(offs))


@grouped_mm_2d3d.register_fake
def _(a, b, offs):
    return a.new_empty((a.shape[0], b.shape[2]))


@torch.library.custom_op("nkilib::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: torch.Tensor, y: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group ``x^T y``: x (T, M), y (T, N), offs (G,) int32 -> (G, M, N)."""
    from .grouped_matmul import grouped_mm_wgrad as kernel
    return kernel(_c(x), _c(y), _ends(offs))


@grouped_mm_wgrad.register_fake
def _(x, y, offs):
    return x.new_empty((offs.shape[0], x.shape[1], y.shape[1]))


def _gmm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gmm_backward(ctx, dout):
    a, b, offs = ctx.saved_tensors
    dout = dout.to(a.dtype)
    da = grouped_mm_2d3d(dout, b.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    db = grouped_mm_wgrad(a, dout, offs) if ctx.needs_input_grad[1] else None
    return da, db, None


def _wgrad_backward(ctx, dout):
    x, y, offs = ctx.saved_tensors
    dout = dout.to(x.dtype)
    dx = grouped_mm_2d3d(y, dout.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dy = grouped_mm_2d3d(x, dout, offs) if ctx.needs_input_grad[1] else None
    return dx, dy, None


grouped_mm_2d3d.register_autograd(_gmm_backward, setup_context=_gmm_setup)
grouped_mm_wgrad.register_autograd(_wgrad_backward, setup_context=_gmm_setup)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch._grouped_mm`` on the NKI kernels (differentiable), every layout it accepts:

    * 2-D x 3-D: a (T, K), b (G, K, N), offs = cumulative row ends -> (T, N)
    * 3-D x 3-D: a (G, M, K), b (G, K, N), no offs -> (G, M, N) (a batched matmul)
    * 3-D x 2-D: a (G, M, K), b (K, Ntot), offs = cumulative column ends -> (M, Ntot)
    * 2-D x 2-D: a (M, Ktot), b (Ktot, N), offs = cumulative ends along K -> (G, M, N)

    ``bias`` and an ``out_dtype`` other than the inputs' raise NotImplementedError.
    """
    name = "nkilib grouped_mm (torch._grouped_mm)"
    if bias is not None:
        raise NotImplementedError(f"{name}: bias is not supported; add it after the call")
    if out_dtype is not None and out_dtype != mat_a.dtype:
        raise NotImplementedError(f"{name}: out_dtype={out_dtype} differs from the input dtype "
                                  f"{mat_a.dtype}; only same-dtype outputs are supported")
    if mat_a.dtype != mat_b.dtype or not mat_a.is_floating_point():
        raise TypeError(f"{name}: mat_a and mat_b must share a floating dtype, got "
                        f"{mat_a.dtype} and {mat_b.dtype}")
    if offs is not None and offs.dtype != torch.int32:
        raise TypeError(f"{name}: offs must be int32 (as torch._grouped_mm requires), got "
                        f"{offs.dtype}")
    da, db = mat_a.dim(), mat_b.dim()
    if (da, db) != (3, 3) and (offs is None or offs.dim() != 1):
        raise ValueError(f"{name}: a {da}-D x {db}-D grouped matmul needs offs, a 1-D int32 "
                         "tensor of cumulative group ends")
    if (da, db) == (2, 3):
        if mat_a.shape[1] != mat_b.shape[1] or offs.shape[0] != mat_b.shape[0]:
            raise ValueError(f"{name}: expected a (T, K), b (G, K, N), offs (G,), got "
                             f"{tuple(mat_a.shape)}, {tuple(mat_b.shape)}, {tuple(offs.shape)}")
        return grouped_mm_2d3d(mat_a, mat_b, offs)
    if (da, db) == (3, 3):
        G, M, K = mat_a.shape
        if offs is not None or mat_b.shape[0] != G or mat_b.shape[1] != K:
            raise ValueError(f"{name}: 3-D x 3-D takes a (G, M, K), b (G, K, N) and no offs, got "
                             f"{tuple(mat_a.shape)}, {tuple(mat_b.shape)}")
        ends = torch.arange(1, G + 1, dtype=torch.int32) * M
        return grouped_mm_2d3d(mat_a.reshape(G * M, K), mat_b, ends).reshape(G, M, -1)
    if (da, db) == (3, 2):
        G, M, K = mat_a.shape
        if mat_b.shape[0] != K or offs.shape[0] != G:
            raise ValueError(f"{name}: 3-D x 2-D takes a (G, M, K), b (K, Ntot), offs (G,), got "
                             f"{tuple(mat_a.shape)}, {tuple(mat_b.shape)}, {tuple(offs.shape)}")
        # out[:, cols of g] = a[g] @ b[:, cols of g]  <=>  out^T = grouped(b^T, a^T)
        return grouped_mm_2d3d(mat_b.t(), mat_a.transpose(1, 2), offs).t()
    if (da, db) == (2, 2):
        if mat_a.shape[1] != mat_b.shape[0]:
            raise ValueError(f"{name}: 2-D x 2-D takes a (M, Ktot), b (Ktot, N), got "
                             f"{tuple(mat_a.shape)}, {tuple(mat_b.shape)}")
        return grouped_mm_wgrad(mat_a.t(), mat_b, offs)
    raise ValueError(f"{name}: unsupported operand ranks {da}-D x {db}-D (mat_a and mat_b must "
                     "be 2-D or 3-D)")
