"""``rmsnorm_tkg``: RMSNorm for token generation, writing the hidden dim onto partitions.

AWS NKI-lib's sub-kernel signature (``nkilib.core.subkernels.rmsnorm_tkg``)::

    rmsnorm_tkg(input, gamma, output, eps=1e-6, hidden_actual=None, hidden_dim_tp=False,
                single_core_forced=False, shard_on_h=False, use_heap_memory=False, sbm=None)

``input`` is (B, S, H) in HBM or already (128, B*S, H/128) in SBUF, ``gamma`` (1, H) in HBM,
``output`` (128, B*S, H/128) in HBM or SBUF (written and returned). H % 128 == 0. With
T = B*S tokens and y = x / sqrt(mean(x^2) + eps) * gamma (mean over ``hidden_actual`` when
the input is zero-padded), ``output[p, t, j] = y[t, h(p, j)]`` with

* LNC=1, or ``single_core_forced``: h = p * H/128 + j
* LNC=2: each H half is laid out that way on its half of j:
  h = (j // n2) * H/2 + p * n2 + j % n2 with n2 = H/256 (the layout that lets each core
  take one half of H in a following sharded matmul)
* ``hidden_dim_tp``: h = j * 128 + p

The kernel computes in that layout directly: x is DMA-ed into [128, T, H/128] with the
mapping above (no transposes), sums of squares reduce along the free axis per partition and
across partitions with one TensorE matmul against a ones matrix (which also broadcasts the
total to every partition), then scale, gamma and the store.

LNC=2 splits the tokens between the cores; ``shard_on_h=True`` instead gives each core one
half of H: each core's partial sums of squares go to the other core with ``nisa.sendrecv``
and both normalise their half. ``use_heap_memory`` and ``sbm`` (AWS's SBUF manager) are
accepted and ignored: tiles are auto-allocated.
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, arg_error, shape_error

FREE = 4096  # elements per partition per instruction


def _layout_view(src, T, H, lnc2, hidden_dim_tp):
    """View of an HBM (T, H) tensor as [128, T, ...] with the output's hidden-dim mapping."""
    n = H // P
    if hidden_dim_tp:
        return src.reshape((T, n, P)).permute((2, 0, 1))  # [128, T, n]
    if lnc2:
        return src.reshape((T, 2, P, n // 2)).permute((2, 0, 1, 3))  # [128, T, 2, n/2]
    return src.reshape((T, P, n)).permute((1, 0, 2))  # [128, T, n]


def rmsnorm_tkg(input, gamma, output, eps=1e-6, hidden_actual=None, hidden_dim_tp=False,
                single_core_forced=False, shard_on_h=False, use_heap_memory=False, sbm=None):
    """RMSNorm of ``input`` into ``output`` [128, B*S, H/128] (see the module docstring)."""
    name = "rmsnorm_tkg"
    nprog = nl.num_programs() if nl.program_ndim() else 1
    pid = nl.program_id(0) if nl.program_ndim() else 0
    if single_core_forced:
        nprog = 1
        if pid != 0:
            return output
    if input.buffer.is_hbm:
        if input.ndim != 3:
            shape_error(name, f"HBM input must be (B, S, H), got {input.shape}", "pass [B, S, H]")
        B, S, H = input.shape
        T = B * S
    else:
        if input.ndim != 3 or input.shape[0] != P:
            shape_error(name, f"SBUF input must be [128, B*S, H/128], got {input.shape}",
                        "pass the transposed SBUF layout")
        T, H = input.shape[1], P * input.shape[2]
    if H % P:
        shape_error(name, f"H={H} must be a multiple of 128", "pad the hidden dim")
    n = H // P
    if tuple(output.shape) != (P, T, n):
        shape_error(name, f"output {output.shape} must be (128, B*S, H/128) = ({P}, {T}, {n})",
                    "allocate the output in the transposed layout")
    if tuple(gamma.shape) not in ((1, H), (H,)):
        shape_error(name, f"gamma {gamma.shape} must be (1, H)", "pass gamma as (1, H)")
    if shard_on_h and (nprog != 2 or hidden_dim_tp):
        arg_error(name, "shard_on_h needs an LNC=2 launch and hidden_dim_tp=False",
                  "launch with kernel[2](...) or pass shard_on_h=False")
    lnc2 = nprog == 2 and not hidden_dim_tp
    if lnc2 and n % 2:
        shape_error(name, f"LNC=2 needs H/128={n} even", "pad H to a multiple of 256")
    count = float(hidden_actual if hidden_actual is not None else H)
    # this core's tokens and hidden columns (j range of the [128, T, n] layout)
    if shard_on_h:
        t_lo, t_hi = 0, T
        j_lo, j_hi = pid * (n // 2), (pid + 1) * (n // 2)
    else:
        per = -(-T // nprog)
        t_lo, t_hi = min(T, pid * per), min(T, (pid + 1) * per)
        j_lo, j_hi = 0, n
    nj = j_hi - j_lo
    if t_hi <= t_lo:
        return output
    xv = _layout_view(input.reshape((T, H)), T, H, lnc2, hidden_dim_tp) \
        if input.buffer.is_hbm else None
    gv = _layout_view(gamma.reshape((1, H)), 1, H, lnc2, hidden_dim_tp)
    g = nl.ndarray((P, 1, n), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=g.reshape((P, 1, 2, n // 2)) if (lnc2 and not hidden_dim_tp) else g,
                  src=gv)
    ones = nl.ndarray((P, P), nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0, engine=nisa.engine.gpsimd)
    tot_ps = nl.ndarray((P, 512), nl.float32, buffer=nl.psum)
    tt = max(1, min(512, FREE // nj))
    for t0 in range(t_lo, t_hi, tt):
        w = min(tt, t_hi - t0)
        x = nl.ndarray((P, w, n), nl.float32 if input.dtype == nl.float32 else input.dtype,
                       buffer=nl.sbuf)
        if xv is not None:
            dst = x.reshape((P, w, 2, n // 2)) if lnc2 else x
            nisa.dma_copy(dst=dst, src=xv[:, t0:t0 + w])
        else:
            nisa.tensor_copy(x, input[:, t0:t0 + w, :])
        xs = x[:, :, j_lo:j_hi]
        sq = nl.ndarray((P, w, nj), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(sq, xs, xs, nl.multiply)
        part = nl.ndarray((P, w), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(part, nl.add, sq, axis=2)
        if shard_on_h:
            # the other core's partial sums of squares for the same tokens
            other = nl.ndarray((P, w), nl.float32, buffer=nl.sbuf)
            nisa.sendrecv(part, other, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
            nisa.tensor_tensor(part, part, other, nl.add)
        # column sums of the partials, replicated on every partition: ones^T @ part
        nisa.nc_matmul(tot_ps[:, :w], ones, part)
        rstd = nl.ndarray((P, w, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(rstd[:, :, 0], tot_ps[:, :w], nl.multiply, 1.0 / count,
                           op1=nl.add, operand1=float(eps))
        nisa.activation(rstd[:, :, 0], nl.rsqrt, rstd[:, :, 0])
        y = nl.ndarray((P, w, nj), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(y, xs, rstd.broadcast(2, nj), nl.multiply)
        o = nl.ndarray((P, w, nj), output.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(o, y, g[:, :, j_lo:j_hi].broadcast(1, w), nl.multiply,
                           engine=nisa.engine.gpsimd)
        if output.buffer.is_hbm:
            nisa.dma_copy(dst=output[:, t0:t0 + w, j_lo:j_hi], src=o)
        else:
            nisa.tensor_copy(output[:, t0:t0 + w, j_lo:j_hi], o)
    return output


@nki.jit
def rmsnorm_tkg_kernel(input, gamma, eps=1e-6, hidden_actual=None, hidden_dim_tp=False,
                       single_core_forced=False, shard_on_h=False):
    """:func:`rmsnorm_tkg` as a kernel: allocates the (128, B*S, H/128) output in HBM."""
    B, S, H = input.shape
    out = nl.ndarray((P, B * S, H // P), input.dtype, buffer=nl.shared_hbm)
    return rmsnorm_tkg(input, gamma, out, eps, hidden_actual, hidden_dim_tp, single_core_forced,
                       shard_on_h)


def rmsnorm_tkg_ref(input, gamma, eps=1e-6, hidden_actual=None, hidden_dim_tp=False, lnc=1):
    """PyTorch reference: (128, B*S, H/128) in input's dtype, in the layout of ``lnc``."""
    import torch
    B, S, H = input.shape
    x = input.float().reshape(B * S, H)
    count = hidden_actual if hidden_actual is not None else H
    y = x * torch.rsqrt((x * x).sum(-1, keepdim=True) / count + eps) * gamma.float().reshape(1, H)
    n = H // P
    if hidden_dim_tp:
        out = y.reshape(B * S, n, P).permute(2, 0, 1)
    elif lnc == 2:
        out = y.reshape(B * S, 2, P, n // 2).permute(2, 0, 1, 3).reshape(P, B * S, n)
    else:
        out = y.reshape(B * S, P, n).permute(1, 0, 2)
    return out.contiguous().to(input.dtype)
