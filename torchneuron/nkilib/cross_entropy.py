"""``cross_entropy_fwd`` / ``cross_entropy_bwd``: softmax cross-entropy over a vocabulary.

Layouts: ``logits`` (N, V) any float dtype; ``labels`` (N,) int32 (``ignore_index`` rows get
zero loss and zero gradient).

* forward returns ``loss`` (N,) float32 = logsumexp(logits[n]) - logits[n, labels[n]] and
  ``lse`` (N,) float32 (saved for the backward);
* backward takes ``dloss`` (N,) float32 and returns
  ``dlogits = (softmax(logits) - onehot(labels)) * dloss[:, None]`` in logits' dtype.

Tiling: 128 rows per tile, the vocabulary in chunks of 8192 columns. The forward keeps an
online log-sum-exp (VectorE chunk max, ScalarE exp with a fused sum, running rescale) so the
logits are read once; the target logit is fetched with one indirect DMA (index
row * V + label per partition). The backward writes softmax * dloss (ScalarE exp, VectorE
scale) and then corrects the single label element of each row with a gather (the target
logit) and a one-element-per-partition scatter of (p_label - 1) * dloss.
LNC=2 splits row tiles between the programs.

Limits: any N, V >= 1; N * V < 2^31. Numerics: fp32 statistics; tolerance vs
:func:`cross_entropy_ref` 1e-5 (fp32 logits) / 1e-2 (bf16 dlogits).
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, cdiv, shape_error

VC = 8192  # vocabulary chunk (2 MiB bf16 DMAs per 128 rows)


def _check(logits, labels):
    if logits.ndim != 2 or tuple(labels.shape) != (logits.shape[0],):
        shape_error("cross_entropy", f"logits must be (N, V) and labels (N,), got {logits.shape} "
                    f"and {labels.shape}", "flatten leading dims into N")
    return logits.shape


def _labels(labels, r0, rows, ignore_index):
    """(label fp32 [rows,1], valid fp32 [rows,1], clamped label int32 [rows,1])."""
    lab = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lab, src=labels.reshape((labels.shape[0], 1))[r0:r0 + rows, :])
    labf = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(labf, lab)
    valid = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(valid, labf, nl.not_equal, float(ignore_index))
    clamped = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(clamped, lab, nl.maximum, 0.0)
    return labf, valid, clamped


@nki.jit
def cross_entropy_fwd(logits, labels, ignore_index=-100):
    """Per-row cross-entropy loss and log-sum-exp; see the module docstring."""
    N, V = _check(logits, labels)
    loss = nl.ndarray((N,), nl.float32, buffer=nl.shared_hbm)
    lse = nl.ndarray((N,), nl.float32, buffer=nl.shared_hbm)
    flat = logits.reshape((N * V, 1))
    pid = nl.program_id(0)
    for i in range(pid, cdiv(N, P), nl.num_programs()):
        r0 = i * P
        rows = min(P, N - r0)
        labf, valid, clamped = _labels(labels, r0, rows, ignore_index)
        m_run = None
        l_run = None
        for c0 in range(0, V, VC):
            w = min(VC, V - c0)
            x = nl.ndarray((rows, w), logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x, src=logits[r0:r0 + rows, c0:c0 + w])
            m = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(m, nl.maximum, x, axis=1)
            if m_run is not None:
                nisa.tensor_tensor(m, m, m_run, nl.maximum, engine=nisa.engine.gpsimd)
            nm = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(nm, m, nl.multiply, -1.0, engine=nisa.engine.gpsimd)
            junk = nl.ndarray((rows, w), nl.bfloat16, buffer=nl.sbuf)
            s = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation(junk, nl.exp, x, bias=nm, reduce_op=nl.add, reduce_res=s)
            if l_run is not None:
                alpha = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
                nisa.activation(alpha, nl.exp, m_run, bias=nm)  # exp(m_old - m_new)
                nisa.scalar_tensor_tensor(s, l_run, nl.multiply, alpha, nl.add, s)
            m_run, l_run = m, s
        out_lse = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(out_lse, nl.log, l_run)
        nisa.tensor_tensor(out_lse, out_lse, m_run, nl.add)
        # target logit: one gather of element row * V + label per partition
        idx = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
        nisa.iota(idx, pattern=[[0, 1]], offset=r0 * V, channel_multiplier=V)
        nisa.tensor_tensor(idx, idx, clamped, nl.add)
        tgt = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tgt, src=flat.ap([[1, rows], [1, 1]], vector_offset=idx,
                                           indirect_dim=0))
        li = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(li, out_lse, nl.subtract, tgt, nl.multiply, valid)
        nisa.dma_copy(dst=loss.reshape((N, 1))[r0:r0 + rows, :], src=li)
        nisa.dma_copy(dst=lse.reshape((N, 1))[r0:r0 + rows, :], src=out_lse)
    return loss, lse


@nki.jit
def cross_entropy_bwd(logits, labels, lse, dloss, ignore_index=-100):
    """Gradient of the per-row loss w.r.t. the logits; see the module docstring."""
    N, V = _check(logits, labels)
    dlogits = nl.ndarray((N, V), logits.dtype, buffer=nl.shared_hbm)
    flat_in = logits.reshape((N * V, 1))
    flat_out = dlogits.reshape((N * V, 1))
    pid = nl.program_id(0)
    for i in range(pid, cdiv(N, P), nl.num_programs()):
        r0 = i * P
        rows = min(P, N - r0)
        labf, valid, clamped = _labels(labels, r0, rows, ignore_index)
        nlse = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=nlse, src=lse.reshape((N, 1))[r0:r0 + rows, :])
        nisa.tensor_scalar(nlse, nlse, nl.multiply, -1.0, engine=nisa.engine.gpsimd)
        g = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=g, src=dloss.reshape((N, 1))[r0:r0 + rows, :])
        nisa.tensor_tensor(g, g, valid, nl.multiply, engine=nisa.engine.gpsimd)
        # softmax(x) * g everywhere: exp on ScalarE, the scale on VectorE (16-bit fast path)
        for c0 in range(0, V, VC):
            w = min(VC, V - c0)
            x = nl.ndarray((rows, w), logits.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x, src=logits[r0:r0 + rows, c0:c0 + w])
            p = nl.ndarray((rows, w), logits.dtype, buffer=nl.sbuf)
            nisa.activation(p, nl.exp, x, bias=nlse)
            nisa.tensor_scalar(p, p, nl.multiply, g)
            nisa.dma_copy(dst=dlogits[r0:r0 + rows, c0:c0 + w], src=p)
        # the one-hot term touches one element per row: recompute (p_label - 1) * g from the
        # gathered target logit and scatter it over the stored value
        idx = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
        nisa.iota(idx, pattern=[[0, 1]], offset=r0 * V, channel_multiplier=V)
        nisa.tensor_tensor(idx, idx, clamped, nl.add)
        tgt = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tgt, src=flat_in.ap([[1, rows], [1, 1]], vector_offset=idx,
                                              indirect_dim=0))
        pl = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(pl, nl.exp, tgt, bias=nlse)
        fix = nl.ndarray((rows, 1), logits.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(fix, pl, nl.subtract, 1.0, nl.multiply, g)
        nisa.dma_copy(dst=flat_out.ap([[1, rows], [1, 1]], vector_offset=idx, indirect_dim=0),
                      src=fix)
    return dlogits


def cross_entropy_ref(logits, labels, ignore_index=-100):
    """PyTorch reference of the forward: (loss (N,) fp32, lse (N,) fp32)."""
    import torch
    lf = logits.float()
    loss = torch.nn.functional.cross_entropy(lf, labels.long(), reduction="none",
                                             ignore_index=ignore_index)
    return loss, torch.logsumexp(lf, -1)


def cross_entropy_bwd_ref(logits, labels, lse, dloss, ignore_index=-100):
    """PyTorch reference of the backward (autograd of the fp32 loss)."""
    import torch
    lf = logits.float().detach().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(lf, labels.long(), reduction="none",
                                             ignore_index=ignore_index)
    loss.backward(dloss.float())
    return lf.grad.to(logits.dtype)
