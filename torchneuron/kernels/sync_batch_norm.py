"""The per-rank batch-norm pieces ``nn.SyncBatchNorm`` calls, with CUDA's semantics.

``torch/nn/modules/_functions.py`` (``SyncBatchNorm``, taken for any non-CPU device when the
process group has more than one rank) splits batch norm into ops only CUDA implements
(``aten/src/ATen/native/cuda/Normalization.cu``):

- ``batch_norm_stats(input, eps) -> (mean, invstd)``: per-channel mean and ``1/sqrt(var + eps)``
  (biased variance) of this rank's input, in the accumulation type (fp32 for fp16/bf16);
- ``batch_norm_gather_stats_with_counts(input, means, invstds, running_mean, running_var,
  momentum, eps, counts)``: the Welford merge of every rank's statistics (``[world, C]``), global
  ``(mean, invstd)``, and the running statistics updated in place (unbiased variance);
- ``batch_norm_elemt``: ``(x - mean) * invstd * weight + bias``;
- ``batch_norm_backward_reduce``: ``sum_dy``, ``sum_dy_xmu`` and the weight/bias gradients;
- ``batch_norm_backward_elemt``: the input gradient from the all-reduced sums and counts.

Channels are dim 1; every other dim is reduced. Arithmetic in the accumulation type.
"""

from __future__ import annotations

import torch

from . import on_cpu
from .out import resize_output

__all__ = ["batch_norm_stats", "batch_norm_gather_stats_with_counts", "batch_norm_gather_stats",
           "batch_norm_elemt", "batch_norm_elemt_out", "batch_norm_backward_reduce",
           "batch_norm_backward_elemt"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _bcast(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _check_input(fn: str, x: torch.Tensor) -> None:
    if x.dim() < 2:
        raise RuntimeError(f"{fn}: expected an input with at least 2 dimensions (N, C, ...), got {x.dim()}")
    if not x.is_floating_point():
        raise NotImplementedError(f'"{fn}" not implemented for \'{str(x.dtype)[6:]}\'')


def _inv_std(var: torch.Tensor, eps: float) -> torch.Tensor:
    # CUDA's InvStd: 0 when both the variance and eps are 0 (not inf).
    out = torch.rsqrt(var + eps)
    if eps == 0:
        out = torch.where(var == 0, torch.zeros_like(out), out)
    return out


def _stats(x, eps):
    acc = _acc(x.dtype)
    xa = x.to(acc)
    dims = _reduce_dims(x)
    mean = xa.mean(dims)
    var = (xa - _bcast(mean, xa)).square().mean(dims)
    return mean, _inv_std(var, eps)


def batch_norm_stats(input, eps):
    """``aten::batch_norm_stats``: this rank's ``(mean, invstd)`` per channel."""
    _check_input("batch_norm_stats", input)
    return on_cpu("batch_norm_stats", _stats, input, eps)


def _gather(means, invstds, running_mean, running_var, momentum, eps, counts):
    acc = means.dtype
    c = counts.to(acc).view(-1, 1)
    n = c.sum(0)
    mean = (means * c).sum(0) / n.clamp_min(1)
    var_i = (1.0 / invstds).square() - eps
    var_n = (var_i * c).sum(0) + ((means - mean).square() * c).sum(0)
    invstd = _inv_std(var_n / n, eps)
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean.to(acc) + momentum * mean)
    if running_var is not None:
        running_var.copy_((1 - momentum) * running_var.to(acc) + momentum * var_n / (n - 1))
    return mean, invstd


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps, counts):
    """``aten::batch_norm_gather_stats_with_counts``: the global ``(mean, invstd)`` from every
    rank's statistics and element counts; updates ``running_mean``/``running_var`` in place."""
    if mean.dim() != 2 or invstd.shape != mean.shape or counts.numel() != mean.shape[0]:
        raise RuntimeError("batch_norm_gather_stats_with_counts: expected mean and invstd of shape "
                           f"[world_size, C] and counts of world_size elements, got {list(mean.shape)}, "
                           f"{list(invstd.shape)} and {list(counts.shape)}")
    return on_cpu("batch_norm_gather_stats_with_counts", _gather, mean, invstd, running_mean, running_var,
                  momentum, eps, counts)


def batch_norm_gather_stats(input, mean, invstd, running_mean, running_var, momentum, eps, count):
    """``aten::batch_norm_gather_stats``: as ``..._with_counts`` with ``count`` elements per rank."""
    counts = torch.full((mean.shape[0],), float(count), dtype=mean.dtype, device=mean.device)
    return batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum, eps,
                                               counts)


def _elemt(x, weight, bias, mean, invstd, out):
    acc = _acc(x.dtype)
    y = (x.to(acc) - _bcast(mean.to(acc), x)) * _bcast(invstd.to(acc), x)
    if weight is not None:
        y = y * _bcast(weight.to(acc), x)
    if bias is not None:
        y = y + _bcast(bias.to(acc), x)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def batch_norm_elemt(input, weight, bias, mean, invstd, eps):
    """``aten::batch_norm_elemt``: ``(x - mean) * invstd * weight + bias`` per channel."""
    _check_input("batch_norm_elemt", input)
    return on_cpu("batch_norm_elemt", _elemt, input, weight, bias, mean, invstd, None)


def batch_norm_elemt_out(input, weight, bias, mean, invstd, eps, *, out):
    """``aten::batch_norm_elemt.out``."""
    _check_input("batch_norm_elemt", input)
    resize_output(out, input.shape, input.device)
    return on_cpu("batch_norm_elemt.out", _elemt, input, weight, bias, mean, invstd, out)


def _backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    acc = _acc(x.dtype)
    dims = _reduce_dims(x)
    dya = dy.to(acc)
    sum_dy = dya.sum(dims)
    sum_dy_xmu = (dya * (x.to(acc) - _bcast(mean.to(acc), x))).sum(dims)
    wdtype = weight.dtype if weight is not None else x.dtype
    grad_weight = (sum_dy_xmu * invstd.to(acc)).to(wdtype) if weight_g else None
    grad_bias = sum_dy.to(wdtype) if bias_g else None
    if not input_g:
        return None, None, grad_weight, grad_bias
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    """``aten::batch_norm_backward_reduce``: ``(sum_dy, sum_dy_xmu, grad_weight, grad_bias)``."""
    _check_input("batch_norm_backward_reduce", input)
    return on_cpu("batch_norm_backward_reduce", _backward_reduce, grad_out, input, mean, invstd, weight,
                  input_g, weight_g, bias_g)


def _backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    acc = _acc(x.dtype)
    n = count.to(acc).sum()
    m = _bcast(mean.to(acc), x)
    s = _bcast(invstd.to(acc), x)
    w = _bcast(weight.to(acc), x) if weight is not None else 1.0
    mean_dy = _bcast(sum_dy.to(acc), x) / n
    mean_dy_xmu = _bcast(sum_dy_xmu.to(acc), x) / n
    gi = (dy.to(acc) - mean_dy - (x.to(acc) - m) * s * s * mean_dy_xmu) * s * w
    return gi.to(x.dtype)


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """``aten::batch_norm_backward_elemt``: the input gradient from the all-reduced sums."""
    _check_input("batch_norm_backward_elemt", input)
    return on_cpu("batch_norm_backward_elemt", _backward_elemt, grad_out, input, mean, invstd, weight, sum_dy,
                  sum_dy_xmu, count)


def register(lib: torch.library.Library) -> None:
    lib.impl("batch_norm_stats", batch_norm_stats, "PrivateUse1")
    lib.impl("batch_norm_gather_stats_with_counts", batch_norm_gather_stats_with_counts, "PrivateUse1")
    lib.impl("batch_norm_gather_stats", batch_norm_gather_stats, "PrivateUse1")
    lib.impl("batch_norm_elemt", batch_norm_elemt, "PrivateUse1")
    lib.impl("batch_norm_elemt.out", batch_norm_elemt_out, "PrivateUse1")
    lib.impl("batch_norm_backward_reduce", batch_norm_backward_reduce, "PrivateUse1")
    lib.impl("batch_norm_backward_elemt", batch_norm_backward_elemt, "PrivateUse1")
