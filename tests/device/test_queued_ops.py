"""Functional ops the execution engine queues with their results allocated at the call: the GEMM
family, GELU, layer norm, sum/mean, pow, the pooled unary/softmax ops and their backward,
nll_loss, embedding's gradient, cat, attention, elementwise arithmetic over broadcast or strided
operands or mixed dtypes, copies into views and casts, and a convolutional network's ops
(convolution, batch and group norm, relu, max pooling, nearest upsampling, and their backward).

Each op, with the engine on, (1) returns before its kernel ran (no host wait), (2) gives the
result CPU PyTorch gives (values bit for bit, and shape, strides and dtype; GELU, whose neuron
kernel differs from CPU's oneDNN one by design, against neuron with the engine off) and
(3) raises CPU's error at the call when its arguments are wrong, not later.
"""

from __future__ import annotations

import sys
import os

import pytest
import torch
import torch.nn.functional as F

from engine_steps import trains_without_waiting
from torchneuron import _C

engine = torch.neuron.engine
# Hosts without native bf16 kernels (no AVX-512 BF16) compute bf16 GEMMs, convolutions and
# attention through the routed exact path (docs/architecture.md, *Precision*), not CPU's kernel
# bit for bit, so the bf16 cases comparing those ops with CPU apply to the other hosts only.
BF16_ROUTED = not _C._precision_routes()["bf16_cpu_kernels"]
bf16_routed_skip = pytest.mark.skipif(BF16_ROUTED, reason="this host routes bf16 GEMMs (not CPU's bits)")
gen = torch.Generator().manual_seed(0)


pytestmark = pytest.mark.usefixtures("engine_on")  # (tests/conftest.py)


def _pool_input_and_indices():
    x = r(2, 3, 8, 7)
    return x, torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2])[1]


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def n(t):
    return t.to("neuron") if isinstance(t, torch.Tensor) else t


def queued(fn, *args):
    """fn(*args) on neuron, checking it queued its kernel without waiting for the device."""
    torch.neuron.synchronize()
    before = engine.stats()
    out = fn(*args)
    after = engine.stats()
    assert after["drains"] == before["drains"], "the op waited for the device"
    assert after["enqueued"] > before["enqueued"], "the op ran synchronously"
    return out


def same(got, want):
    """got (neuron) is want (CPU): values bit for bit, shape, strides, dtype."""
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            same(g, w)
        return
    if want is None:
        assert got is None
        return
    assert got.device.type == "neuron"
    assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


CASES = {
    # extrema (an FP8 layer's dynamic scales); whole reductions of a transposed block take the
    # address-order walk (extrema.cpp)
    "amax_rows": (lambda x: x.abs().amax(dim=-1, keepdim=True), lambda: (r(6, 33),)),
    "amax_dims": (lambda x: x.amax((0, 2)), lambda: (r(3, 4, 5),)),
    "amin_bf16": (lambda x: x.amin(1), lambda: (r(4, 40, dtype=torch.bfloat16),)),
    "amax_int": (lambda x: x.amax(0), lambda: (torch.randint(-9, 9, (5, 7), generator=gen),)),
    "amax_empty_rows": (lambda x: x.amax(1), lambda: (r(0, 3),)),
    "amax_transposed_whole": (lambda x: x.t().amax((0, 1), keepdim=True), lambda: (r(64, 96),)),
    "max_whole": (lambda x: x.abs().max(), lambda: (r(7, 9),)),
    "min_whole_transposed": (lambda x: x.t().min(), lambda: (r(80, 64),)),
    # GEMM family (fp32 and bf16; operands transposed as autograd passes them)
    "mm": (torch.mm, lambda: (r(8, 16), r(16, 4))),
    "mm_transposed": (torch.mm, lambda: (r(16, 8).t(), r(4, 16).t())),
    "mm_bf16": (torch.mm, lambda: (r(32, 64, dtype=torch.bfloat16), r(64, 16, dtype=torch.bfloat16))),
    "addmm_bias": (torch.addmm, lambda: (r(4), r(8, 16), r(4, 16).t())),
    "addmm_beta_alpha": (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=-2), lambda: (r(8, 4), r(8, 3), r(3, 4))),
    "addmm_beta0": (lambda s, a, b: torch.addmm(s, a, b, beta=0), lambda: (r(1, 4), r(8, 3), r(3, 4))),
    "bmm": (torch.bmm, lambda: (r(3, 5, 7), r(3, 7, 2))),
    "bmm_transposed": (torch.bmm, lambda: (r(3, 7, 5).transpose(1, 2), r(3, 7, 2))),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, alpha=0.25), lambda: (r(5, 2), r(3, 5, 7), r(3, 7, 2))),
    "matmul_3d_2d": (torch.matmul, lambda: (r(2, 3, 8), r(8, 5))),
    "linear": (F.linear, lambda: (r(6, 10), r(7, 10), r(7))),
    # layer norm (forward returns out, mean, rstd)
    "layer_norm": (lambda x, w, b: torch.ops.aten.native_layer_norm(x, [16], w, b, 1e-5),
                   lambda: (r(4, 3, 16), r(16), r(16))),
    "layer_norm_no_affine": (lambda x: torch.ops.aten.native_layer_norm(x, [3, 16], None, None, 1e-5),
                             lambda: (r(4, 3, 16),)),
    "layer_norm_bf16": (lambda x, w, b: torch.ops.aten.native_layer_norm(x, [16], w, b, 1e-6),
                        lambda: (r(8, 16, dtype=torch.bfloat16), r(16, dtype=torch.bfloat16),
                                 r(16, dtype=torch.bfloat16))),
    # reductions
    "sum_dim": (lambda x: x.sum(1), lambda: (r(4, 5, 6),)),
    "sum_dims_keepdim": (lambda x: x.sum((0, -1), keepdim=True), lambda: (r(4, 5, 6),)),
    "sum_all": (lambda x: x.sum(), lambda: (r(33, 7),)),
    "sum_strided": (lambda x: x.sum(0), lambda: (r(6, 4).t(),)),
    "mean_dim": (lambda x: x.mean(-1), lambda: (r(4, 5, 6),)),
    "mean_all": (lambda x: x.mean(), lambda: (r(8, 1),)),
    "sum_0dim": (lambda x: x.sum(0), lambda: (torch.tensor(2.5),)),
    # pooled elementwise (results of the input's shape)
    "pow_2": (lambda x: x.pow(2), lambda: (r(5, 7),)),
    "pow_half": (lambda x: x.abs().pow(0.5), lambda: (r(5, 7),)),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: (r(4, 9),)),
    "log_softmax_dim0": (lambda x: torch.log_softmax(x, 0), lambda: (r(4, 9),)),
    "silu": (F.silu, lambda: (r(100),)),
    "exp": (torch.exp, lambda: (r(3, 3),)),
    "clamp_min": (lambda x: torch.clamp(x, min=-0.5), lambda: (r(10),)),
    "clamp_max": (lambda x: torch.clamp(x, max=0.1), lambda: (r(10),)),
    # the rest of a language model's step
    "nll_loss_mean": (lambda x, t: torch.ops.aten.nll_loss_forward(x, t, None, 1, -100), lambda: (r(6, 5), torch.tensor([0, 4, 2, 1, 3, 0]))),
    "nll_loss_none_weighted": (lambda x, t, w: torch.ops.aten.nll_loss_forward(x, t, w, 0, 2),
                               lambda: (r(6, 5), torch.tensor([0, 4, 2, 1, 3, 2]), r(5).abs())),
    "nll_loss_backward": (lambda g, x, t, tw: torch.ops.aten.nll_loss_backward(g, x, t, None, 1, -100, tw),
                          lambda: (torch.tensor(0.5), r(6, 5), torch.tensor([0, 4, 2, 1, 3, 0]), torch.tensor(6.0))),
    "cross_entropy": (F.cross_entropy, lambda: (r(7, 11), torch.tensor([1, 0, 10, 3, 3, 5, 9]))),
    "embedding": (F.embedding, lambda: (torch.tensor([[0, 8, 2, 2], [5, 0, 1, 8]]), r(9, 3))),
    "index_select_dim1": (lambda x, i: torch.index_select(x, 1, i), lambda: (r(3, 6), torch.tensor([5, 0, 0]))),
    "embedding_backward": (lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 9, -1, False),
                           lambda: (r(2, 4, 3), torch.tensor([[0, 8, 2, 2], [5, 0, 1, 8]]))),
    "embedding_backward_padding_scaled": (lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 9, 2, True),
                                          lambda: (r(4, 3), torch.tensor([2, 8, 2, 7]))),
    "cat_dim1": (lambda a, b, c: torch.cat([a, b, c], 1), lambda: (r(3, 2), r(3, 4), r(3, 1))),
    "cat_transposed": (lambda a, b: torch.cat([a, b], 0), lambda: (r(3, 5).t(), r(3, 5).t())),
    "cat_channels_last": (lambda a, b: torch.cat([a, b], 1),
                          lambda: tuple(r(2, c, 3, 4).contiguous(memory_format=torch.channels_last) for c in (3, 5))),
    "softmax_backward": (lambda g, y: torch.ops.aten._softmax_backward_data(g, y, 1, torch.float32),
                         lambda: (r(4, 6), torch.softmax(r(4, 6), 1))),
    "log_softmax_backward": (lambda g, y: torch.ops.aten._log_softmax_backward_data(g, y, 0, torch.float32),
                             lambda: (r(4, 6), torch.log_softmax(r(4, 6), 0))),
    # copies within the device: layouts, broadcasts, casts
    "contiguous_of_transpose": (lambda x: x.t().contiguous(), lambda: (r(5, 7),)),
    "copy_broadcast": (lambda d, s: d.copy_(s), lambda: (r(4, 3), r(3))),
    "cast_to_bf16": (lambda x: x.to(torch.bfloat16), lambda: (r(6, 5).t(),)),
    "cast_from_bf16": (lambda x: x.float(), lambda: (r(6, 5, dtype=torch.bfloat16),)),
    # elementwise over broadcast / strided operands (layout as CPU's TensorIterator gives it)
    "div_expanded_by_number": (lambda x: x.expand(8, 3) / 8, lambda: (r(1, 3),)),
    "mul_broadcast": (torch.mul, lambda: (r(4, 1), r(1, 5))),
    "add_row_alpha": (lambda a, b: torch.add(a, b, alpha=3), lambda: (r(6, 5), r(5))),
    "sub_permuted": (torch.sub, lambda: (r(4, 3, 2).permute(2, 1, 0), r(2, 3, 4))),
    "mul_channels_last": (torch.mul, lambda: (r(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), r(3, 1, 1))),
    "div_0dim_tensor": (torch.div, lambda: (r(3, 4), torch.tensor(1.5))),
    # a convolutional network's step: convolution, batch norm, relu, max pooling, and backward
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), lambda: (r(2, 3, 8, 8), r(4, 3, 3, 3), r(4))),
    "conv2d_strided_dilated_groups": (lambda x, w: F.conv2d(x, w, stride=2, dilation=2, groups=2),
                                      lambda: (r(2, 4, 11, 9), r(6, 2, 3, 2))),
    "conv1d": (lambda x, w: F.conv1d(x, w, padding=2), lambda: (r(3, 2, 10), r(5, 2, 4))),
    "conv3d": (lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1)), lambda: (r(1, 2, 5, 6, 4), r(3, 2, 2, 3, 2), r(3))),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1, groups=2),
                         lambda: (r(2, 4, 5, 6), r(4, 3, 3, 3), r(6))),
    "conv2d_bf16": (lambda x, w: F.conv2d(x, w, padding=1),
                    lambda: (r(2, 3, 8, 8, dtype=torch.bfloat16), r(4, 3, 3, 3, dtype=torch.bfloat16))),
    "conv2d_backward": (lambda g, x, w: torch.ops.aten.convolution_backward(g, x, w, [4], [1, 1], [1, 1], [1, 1],
                                                                            False, [0, 0], 1, [True, True, True]),
                        lambda: (r(2, 4, 8, 8), r(2, 3, 8, 8), r(4, 3, 3, 3))),
    "conv_transpose2d_backward_input_only": (
        lambda g, x, w: torch.ops.aten.convolution_backward(g, x, w, None, [2, 2], [0, 0], [1, 1], True, [1, 1], 2,
                                                            [True, False, False]),
        lambda: (r(2, 6, 12, 14), r(2, 4, 5, 6), r(4, 3, 3, 3))),
    "batch_norm_train": (lambda x, w, b, m, v: torch.ops.aten.native_batch_norm(x, w, b, m, v, True, 0.1, 1e-5),
                         lambda: (r(4, 3, 5, 5), r(3), r(3), r(3), r(3).abs())),
    "batch_norm_eval": (lambda x, w, b, m, v: torch.ops.aten.native_batch_norm(x, w, b, m, v, False, 0.1, 1e-5),
                        lambda: (r(4, 3, 5), r(3), r(3), r(3), r(3).abs())),
    "batch_norm_no_affine_no_stats": (lambda x: torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1,
                                                                                 1e-3), lambda: (r(6, 2),)),
    "batch_norm_bf16_fp32_params": (lambda x, w, b, m, v: torch.ops.aten.native_batch_norm(x, w, b, m, v, True, 0.1, 1e-5),
                                    lambda: (r(4, 3, 5, 5, dtype=torch.bfloat16), r(3), r(3), r(3), r(3).abs())),
    "batch_norm_channels_last": (lambda x, w, b: torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5),
                                 lambda: (r(2, 5, 3, 4).contiguous(memory_format=torch.channels_last), r(5), r(5))),
    "batch_norm_backward_train": (
        lambda g, x, w, m, s: torch.ops.aten.native_batch_norm_backward(g, x, w, None, None, m, s, True, 1e-5,
                                                                        [True, True, True]),
        lambda: (r(4, 3, 5, 5), r(4, 3, 5, 5), r(3), r(3), r(3).abs())),
    "batch_norm_backward_eval_input_only": (
        lambda g, x, m, v: torch.ops.aten.native_batch_norm_backward(g, x, None, m, v, None, None, False, 1e-5,
                                                                     [True, False, False]),
        lambda: (r(4, 3, 5), r(4, 3, 5), r(3), r(3).abs())),
    "batch_norm_backward_channels_last": (
        lambda g, x, w, m, s: torch.ops.aten.native_batch_norm_backward(g, x, w, None, None, m, s, True, 1e-5,
                                                                        [True, True, True]),
        lambda: tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
                      for t in (r(2, 5, 3, 4), r(2, 5, 3, 4), r(5), r(5), r(5).abs()))),
    "relu": (torch.relu, lambda: (r(4, 7),)),
    "max_pool2d": (lambda x: torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2]), lambda: (r(2, 3, 8, 7),)),
    "max_pool2d_padded_dilated_ceil": (lambda x: torch.ops.aten.max_pool2d_with_indices(x, [3, 2], [2, 1], [1, 1],
                                                                                        [1, 2], True),
                                       lambda: (r(3, 9, 8),)),
    "max_pool2d_channels_last": (lambda x: torch.ops.aten.max_pool2d_with_indices(x, [2, 2], [2, 2]),
                                 lambda: (r(2, 3, 6, 6).contiguous(memory_format=torch.channels_last),)),
    "max_pool2d_backward": (lambda g, x, i: torch.ops.aten.max_pool2d_with_indices_backward(g, x, [2, 2], [2, 2], [0, 0],
                                                                                            [1, 1], False, i),
                            lambda: (r(2, 3, 4, 3), *_pool_input_and_indices())),
    # group norm and nearest upsampling (a UNet's)
    "group_norm": (lambda x, w, b: torch.ops.aten.native_group_norm(x, w, b, 2, 6, 20, 3, 1e-5),
                   lambda: (r(2, 6, 4, 5), r(6), r(6))),
    "group_norm_channels_last_bf16_fp32_params": (
        lambda x, w, b: torch.ops.aten.native_group_norm(x, w, b, 2, 8, 12, 4, 1e-5),
        lambda: (r(2, 8, 3, 4, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last), r(8), r(8))),
    "group_norm_backward": (
        lambda g, x, m, s, w: torch.ops.aten.native_group_norm_backward(g, x, m, s, w, 2, 6, 20, 3, [True, True, True]),
        lambda: (r(2, 6, 4, 5), r(2, 6, 4, 5), r(2, 3), r(2, 3).abs(), r(6))),
    "upsample_nearest2d": (lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest"), lambda: (r(2, 3, 4, 5),)),
    "upsample_nearest2d_sized_channels_last": (lambda x: F.interpolate(x, size=(7, 3), mode="nearest"),
                                               lambda: (r(1, 4, 5, 6).contiguous(memory_format=torch.channels_last),)),
    "upsample_nearest2d_backward": (lambda g: torch.ops.aten.upsample_nearest2d_backward(g, [8, 10], [2, 3, 4, 5]),
                                    lambda: (r(2, 3, 8, 10),)),
    # pointwise ops over strided operands, copies into views, slices' gradients, casts
    "neg_of_a_slice": (lambda x: -x[:, ::2], lambda: (r(4, 6),)),
    "silu_channels_last": (F.silu, lambda: (r(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),)),
    "threshold_backward_transposed": (lambda g, x: torch.ops.aten.threshold_backward(g.t(), x.t(), 0.0),
                                      lambda: (r(5, 4), r(5, 4))),
    "copy_into_a_slice": (lambda d, s: d[:, 1:4].copy_(s), lambda: (r(3, 6), r(3, 3))),
    "slice_backward": (lambda g: torch.ops.aten.slice_backward(g, [4, 6], 1, 1, 5, 2), lambda: (r(4, 2),)),
    "select_backward": (lambda g: torch.ops.aten.select_backward(g, [3, 4, 5], 1, 2), lambda: (r(3, 5),)),
    "pad": (lambda x: F.pad(x, (1, 2, 0, 1)), lambda: (r(2, 3, 4),)),
    "cast_int64_to_float": (lambda x: x.float(), lambda: (torch.tensor([[3, -7], [2 ** 40, 0]]),)),
    "cast_float_to_int32": (lambda x: x.int(), lambda: (r(3, 4) * 100,)),
    "mul_int64_by_float_number": (lambda x: x * 0.5, lambda: (torch.tensor([1, 2, 3]),)),
    "mul_float_by_0dim_int64": (torch.mul, lambda: (r(3, 4), torch.tensor(3))),
    "div_int64_by_float_broadcast": (torch.div, lambda: (torch.tensor([[1], [2]]), r(3))),
    "add_bias_in_place_broadcast": (lambda y, b: y.add_(b), lambda: (r(2, 3, 4), r(4))),
    "add_int64_broadcast": (torch.add, lambda: (torch.tensor([[1], [2]]), torch.tensor([10, 20, 2 ** 62]))),
    "mul_int32_by_int_number": (lambda x: x * 3, lambda: (torch.arange(6, dtype=torch.int32).view(2, 3).t(),)),
    # attention's causal mask
    "masked_fill_causal": (lambda x, m: x.masked_fill(m, float("-inf")),
                           lambda: (r(2, 4, 4), torch.ones(4, 4).triu(1).bool())),
    "masked_fill_inplace_int64_label_ids": (lambda x: x.masked_fill_(x == -100, 0),
                                            lambda: (torch.tensor([[3, -100, 7], [-100, -100, 1]]),)),
    "masked_fill_inplace_bool_broadcast_mask": (lambda x, m: x.masked_fill_(m, True),
                                                lambda: (torch.rand(4, 5, generator=gen) > 0.5,
                                                         torch.rand(5, generator=gen) > 0.5)),
    "masked_fill_inplace_bf16_transposed": (lambda x, m: x.t().masked_fill_(m, -3.5),
                                            lambda: (r(5, 3, dtype=torch.bfloat16), torch.rand(3, 5) > 0.5)),
    # losses of diffusion models
    "mse_loss_mean": (F.mse_loss, lambda: (r(4, 5), r(4, 5))),
    "mse_loss_none": (lambda a, b: F.mse_loss(a, b, reduction="none"), lambda: (r(3, 2, 2), r(3, 2, 2))),
    "mse_loss_backward_sum": (lambda g, a, b: torch.ops.aten.mse_loss_backward(g, a, b, 2),
                              lambda: (torch.tensor(0.25), r(4, 5), r(4, 5))),
    # integer arithmetic in place (BatchNorm's num_batches_tracked += 1)
    "add_int64_inplace": (lambda t: t.add_(1), lambda: (torch.tensor(41),)),
    "sub_int32_inplace_alpha": (lambda a, b: a.sub_(b, alpha=2), lambda: (torch.arange(6, dtype=torch.int32),
                                                                          torch.ones(6, dtype=torch.int32))),
    "mul_int64_inplace_wraps": (lambda t: t.mul_(2 ** 62), lambda: (torch.tensor([3, -5]),)),
    # scans, index reductions and triangle masks (structured_queued.cpp)
    "cumsum": (lambda x: x.cumsum(1), lambda: (r(4, 9),)),
    "cumsum_int32_to_int64": (lambda x: x.cumsum(-1), lambda: (torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]],
                                                                             dtype=torch.int32),)),
    "cumsum_bool_mask": (lambda x: x.cumsum(0), lambda: (r(7) > 0,)),
    "cumsum_dtype": (lambda x: torch.cumsum(x, -1, dtype=torch.float64), lambda: (r(3, 5),)),
    "cumsum_strided_bf16": (lambda x: x.cumsum(0), lambda: (r(6, 4, dtype=torch.bfloat16).t(),)),
    "argmax_dim": (lambda x: x.argmax(-1), lambda: (r(5, 7),)),
    "argmax_all": (lambda x: x.argmax(), lambda: (r(5, 7),)),
    "argmin_keepdim_strided": (lambda x: x.argmin(0, keepdim=True), lambda: (r(7, 5).t(),)),
    "max_dim": (lambda x: x.max(1), lambda: (r(4, 6),)),
    "max_dim_nan": (lambda x: x.max(0), lambda: (torch.tensor([[1.0, float("nan")], [2.0, 0.5]]),)),
    "min_dim_keepdim_int": (lambda x: x.min(-1, keepdim=True), lambda: (torch.tensor([[3, -2, 7], [0, 0, 1]]),)),
    "triu": (lambda x: x.triu(1), lambda: (r(5, 5),)),
    "tril_batched_negative_diagonal": (lambda x: x.tril(-1), lambda: (r(2, 4, 6),)),
    "triu_bool_causal_mask": (lambda x: x.triu(1), lambda: (torch.ones(4, 4, dtype=torch.bool),)),
    # norms (clip_grad_norm_), infinity tests, boolean reductions and where (_safe_softmax)
    "vector_norm": (torch.linalg.vector_norm, lambda: (r(5, 7),)),
    "vector_norm_ord1_dim_keepdim": (lambda x: torch.linalg.vector_norm(x, 1, dim=-1, keepdim=True), lambda: (r(5, 7),)),
    "vector_norm_inf_bf16_as_fp32": (lambda x: torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32),
                                     lambda: (r(4, 6, dtype=torch.bfloat16),)),
    "foreach_norm": (lambda a, b, c: torch._foreach_norm([a, b, c]), lambda: (r(5, 3), r(7), r(2, 2, 2))),
    "foreach_norm_ord_inf": (lambda a, b: torch._foreach_norm([a, b], float("inf")), lambda: (r(5, 3), r(7))),
    "isneginf": (torch.isneginf, lambda: (torch.tensor([1.0, float("-inf"), float("inf"), float("nan")]),)),
    "isposinf": (torch.isposinf, lambda: (torch.tensor([1.0, float("-inf"), float("inf"), float("nan")]),)),
    "all_dim_keepdim": (lambda x: x.all(-1, keepdim=True), lambda: (r(4, 5) > -1,)),
    "any_dims": (lambda x: x.any((0, 2)), lambda: (r(3, 4, 5) > 1,)),
    "all_uint8_stays_uint8": (lambda x: x.all(0), lambda: ((r(3, 4) > 0).to(torch.uint8),)),
    "where_broadcast": (torch.where, lambda: (r(4, 1) > 0, r(4, 5), r(5))),
    "where_python_number": (lambda c, x: torch.where(c, x, 0.0), lambda: (r(3, 4) > 0, r(3, 4))),
    "where_int64": (torch.where, lambda: (r(6) > 0, torch.arange(6), torch.zeros(6, dtype=torch.int64))),
    "where_transposed_layout": (torch.where, lambda: (r(5, 4).t() > 0, r(5, 4).t(), r(5, 4).t())),
    "where_out_into_a_value": (lambda c, a, o: torch.where(c, a, o, out=o), lambda: (r(3, 1) > 0, r(3, 4), r(3, 4))),
    "safe_softmax_fully_masked_row": (lambda x: torch.ops.aten._safe_softmax(x, -1),
                                      lambda: (torch.tensor([[0.5, 1.0, float("-inf")], [float("-inf")] * 3]),)),
    # comparisons above the small path's size, any real dtype
    "gt_float_large": (lambda x: x > 0, lambda: (r(64, 64),)),
    "ne_int64_labels": (lambda t: t != -100, lambda: (torch.tensor([3, -100, 7, -100] * 750),)),
    "lt_broadcast_large": (lambda a, b: a < b, lambda: (r(64, 64), r(64))),
    "eq_transposed_number": (lambda x: x.t() == 0.25, lambda: (torch.tensor([0.25, 1.0, -0.5] * 1000).view(60, 50),)),
    "ge_int64_vs_float": (lambda a, b: a >= b, lambda: (torch.arange(3000), r(3000) * 3000)),
    "le_bf16_0dim": (lambda a, b: a <= b, lambda: (r(50, 50, dtype=torch.bfloat16), torch.tensor(0.5))),
    # dropout's backward (its forward draws random numbers: test_dropout_* below)
    # a mixture-of-experts layer's routing (tests/device/test_moe_queued.py: a whole step)
    "topk": (lambda x: torch.topk(x, 3, dim=1), lambda: (r(5, 8),)),
    "topk_smallest_unsorted_dim0": (lambda x: torch.topk(x, 2, dim=0, largest=False, sorted=False), lambda: (r(5, 8),)),
    "topk_transposed": (lambda x: torch.topk(x.t(), 4), lambda: (r(6, 5),)),
    "sort": (lambda x: torch.sort(x), lambda: (r(4, 9),)),
    "sort_stable_descending_dim0": (lambda x: torch.sort(x, dim=0, descending=True, stable=True),
                                    lambda: (torch.randint(0, 3, (9, 4), generator=gen),)),
    "gather": (lambda x, i: torch.gather(x, 1, i), lambda: (r(4, 6), torch.randint(0, 6, (4, 3), generator=gen))),
    "gather_int32_index": (lambda x, i: torch.gather(x, 1, i),
                           lambda: (r(4, 6), torch.randint(0, 6, (4, 3), generator=gen).int())),
    "gather_transposed_source": (lambda x, i: torch.gather(x.t(), 0, i),
                                 lambda: (r(6, 4), torch.randint(0, 4, (2, 6), generator=gen))),
    "scatter_src": (lambda x, i, s: torch.scatter(x, 1, i, s),
                    lambda: (r(4, 6), torch.randint(0, 6, (4, 3), generator=gen), r(4, 3))),
    "scatter_value": (lambda x, i: torch.scatter(x, 0, i, -2.5), lambda: (r(4, 6), torch.randint(0, 4, (2, 6), generator=gen))),
    "scatter_add_duplicates": (lambda x, i, s: torch.scatter_add(x, 0, i, s),
                               lambda: (r(3, 5), torch.randint(0, 3, (6, 5), generator=gen), r(6, 5))),
    "scatter_inplace": (lambda x, i, s: x.scatter_(1, i, s), lambda: (r(4, 6), torch.randint(0, 6, (4, 2), generator=gen), r(4, 2))),
    "scatter_value_inplace": (lambda x, i: x.scatter_(1, i, 7.0), lambda: (r(4, 6), torch.randint(0, 6, (4, 2), generator=gen))),
    "scatter_add_inplace_int64": (lambda x, i, s: x.scatter_add_(0, i, s),
                                  lambda: (torch.zeros(4, dtype=torch.long), torch.randint(0, 4, (10,), generator=gen),
                                           torch.ones(10, dtype=torch.long))),
    "index_rows": (lambda x, i: x[i], lambda: (r(6, 4), torch.randint(0, 6, (5,), generator=gen))),
    "index_two_tensors_broadcast": (lambda x, i, j: x[i, j], lambda: (r(5, 7), torch.randint(0, 5, (3, 1), generator=gen),
                                                                      torch.randint(0, 7, (4,), generator=gen))),
    "index_after_slice_int32": (lambda x, i: x[:, i], lambda: (r(3, 6, 2), torch.randint(0, 6, (4,), generator=gen).int())),
    "index_put_accumulate_duplicates": (lambda x, i, v: x.index_put_((i,), v, accumulate=True),
                                        lambda: (r(5, 3), torch.tensor([1, 4, 1, 1]), r(4, 3))),
    "index_put_broadcast_value": (lambda x, i, j, v: x.index_put_((i, j), v),
                                  lambda: (r(5, 6), torch.tensor([0, 2]), torch.tensor([5, 1]), r(1))),
    "index_put_functional": (lambda x, i, v: torch.index_put(x, (i,), v),
                             lambda: (r(5, 3), torch.tensor([3, 0]), r(2, 3))),
    "grouped_mm_2d_3d": (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs),
                         lambda: (r(10, 8), r(3, 8, 4), torch.tensor([3, 3, 10], dtype=torch.int32))),
    "grouped_mm_3d_3d": (lambda a, b: torch._grouped_mm(a, b), lambda: (r(2, 5, 8), r(2, 8, 4))),
    "neg_int64": (lambda a: -a, lambda: (torch.arange(-5, 6).view(1, 11),)),
    "abs_int64": (lambda a: torch.abs(a), lambda: (torch.arange(-5, 6).view(11, 1),)),
    "abs_float_transposed": (lambda a: a.t().abs(), lambda: (r(3, 5),)),
    "floor_divide_by_number": (lambda a: a // 3, lambda: (torch.arange(-7, 8),)),
    "floor_divide_broadcast_promoting": (lambda a, b: torch.floor_divide(a, b),
                                         lambda: (torch.arange(-6, 6).view(3, 4), r(4) + 3)),
    "floor_divide_by_cpu_scalar_transposed": (lambda a, b: torch.floor_divide(a.t(), b), lambda: (r(3, 5), torch.tensor(0.7))),
    "dropout_backward": (lambda g, m: torch.ops.aten.native_dropout_backward(g, m, 1.25),
                         lambda: (r(6, 7), r(6, 7) > 0.3)),
    "dropout_backward_bf16": (lambda g, m: torch.ops.aten.native_dropout_backward(g, m, 1 / 0.9),
                              lambda: (r(5, 8, dtype=torch.bfloat16), r(5, 8) > -0.5)),
}


ROUTED_BF16_CASES = {"mm_bf16", "conv2d_bf16"}


@pytest.mark.parametrize("name", [pytest.param(k, marks=bf16_routed_skip) if k in ROUTED_BF16_CASES else k
                                  for k in sorted(CASES)])
def test_a_queued_op_returns_before_it_ran_and_matches_cpu(name):
    fn, make = CASES[name]
    args = make()
    dev = [n(a) for a in args]  # before CPU runs fn: in-place ops change their arguments
    want = fn(*args)
    got = queued(fn, *dev)
    same(got, want)


def test_results_keep_their_layouts_when_operand_geometries_repeat():
    # Broadcast and strided pointwise results take the layouts TensorIterator gives them, which
    # are remembered by the operands' sizes and strides (ops.cpp, LayoutCache): operands of one
    # shape and different strides each keep their own layout, in any order.
    a, t, s, c = r(4, 6), r(6, 4).t(), r(4, 12)[:, ::2], r(6)  # three (4, 6) layouts, a row
    for x, y in ((a, c), (t, c), (a, c), (c, t), (s, c), (t, a), (a, t), (t, c)):
        same(queued(torch.add, n(x), n(y)), x + y)
    for x in (t, s, t, s):  # one strided operand: the pointwise route (neg keeps x's layout)
        same(queued(torch.neg, n(x)), torch.neg(x))


def test_a_broadcast_that_cannot_happen_raises_after_others_were_remembered():
    a, c = r(4, 6), r(6)
    same(queued(torch.add, n(a), n(c)), a + c)
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.add(n(a), n(r(5)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("numel", [2048, 20000])  # below and above the oneDNN break-even (ops.cpp)
def test_gelu_and_its_backward_queue_with_the_synchronous_results(approximate, numel):
    x, g = r(numel), r(numel)
    engine.set_enabled(False)
    want = (F.gelu(n(x), approximate=approximate).cpu(),
            torch.ops.aten.gelu_backward(n(g), n(x), approximate=approximate).cpu())
    engine.set_enabled(True)
    got = (queued(lambda t: F.gelu(t, approximate=approximate), n(x)),
           queued(lambda a, b: torch.ops.aten.gelu_backward(a, b, approximate=approximate), n(g), n(x)))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_layer_norm_backward_queues_each_requested_gradient(mask):
    x, w, b, dy = r(6, 16), r(16), r(16), r(6, 16)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [16], w, b, 1e-5)
    want = torch.ops.aten.native_layer_norm_backward(dy, x, [16], mean, rstd, w, b, list(mask))
    got = queued(lambda *a: torch.ops.aten.native_layer_norm_backward(*a[:2], [16], *a[2:], list(mask)),
                 n(dy), n(x), n(mean), n(rstd), n(w), n(b))
    same(got, want)


def synchronous(fn):
    """fn() with the engine off (each kernel run at its call), the engine turned back on."""
    engine.set_enabled(False)
    try:
        return fn()
    finally:
        engine.set_enabled(True)


def attention_reference(L, dtype, cpu_inputs, grad, make_neuron_inputs):
    """What queued attention must give: CPU's results (values, layout) where neuron runs CPU's
    flash kernel (8 queries), neuron's synchronous results where fp32 runs small_attention.cpp's
    kernel (16 queries: CPU's results only to fp32 rounding, checked here too)."""
    want = F.scaled_dot_product_attention(*cpu_inputs, is_causal=True)
    want.backward(grad)
    cpu = [want.detach()] + [c.grad for c in cpu_inputs]
    if L < 16 or dtype != torch.float32:
        return cpu

    def run():
        dev = [x.detach().requires_grad_() for x in make_neuron_inputs()]
        out = F.scaled_dot_product_attention(*dev, is_causal=True)
        out.backward(n(grad))
        return [out.detach().cpu()] + [d.grad.cpu() for d in dev]
    sync = synchronous(run)
    for a, b in zip(sync, cpu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return sync


@pytest.mark.parametrize("L", [8, 16], ids=["cpu_flash_kernel", "small_kernel"])
@pytest.mark.parametrize("layout", ["contiguous", "split_heads"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=bf16_routed_skip)])
def test_attention_forward_and_backward_queue_with_the_synchronous_results(layout, dtype, L):
    B, H, E = 2, 3, 8

    def qkv(t):
        if layout == "contiguous":
            return [x.contiguous() for x in t.view(B, L, 3, H, E).permute(2, 0, 3, 1, 4)]
        return [x.view(B, L, H, E).transpose(1, 2) for x in t.split(H * E, -1)]  # as nn attention does

    base = r(B, L, 3 * H * E, dtype=dtype)
    grad = r(B, H, L, E, dtype=dtype)
    cpu = [x.requires_grad_() for x in (t.detach() for t in qkv(base))]
    want = attention_reference(L, dtype, cpu, grad, lambda: qkv(base.to("neuron")))
    dev = [x.requires_grad_() for x in (t.detach() for t in qkv(base.to("neuron")))]
    got = queued(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True), *dev)
    queued(lambda g: got.backward(g), n(grad))
    for g, w in zip([got.detach()] + [d.grad for d in dev], want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_routed_attention_queues_with_the_synchronous_results(dtype, mask):
    # fp16 attention (bf16 on hosts without AVX512-BF16) runs CPU's fp32 flash kernels on exact
    # copies (sdpa.cpp): queued, the same kernels with the copies in host scratch.
    if dtype == torch.bfloat16 and not BF16_ROUTED:
        pytest.skip("CPU's bf16 kernels are fast on this host: bf16 is not routed")
    q, k, v, g = (r(2, 3, 16, 8, dtype=dtype) for _ in range(4))
    m = r(16, 16, dtype=dtype) if mask else None
    kwargs = dict(attn_mask=n(m)) if mask else dict(is_causal=True)
    results = []
    for on in (True, False):
        engine.set_enabled(on)
        try:
            dev = [n(t).requires_grad_() for t in (q, k, v)]
            run = queued if on else (lambda f, *a: f(*a))
            out = run(lambda *a: F.scaled_dot_product_attention(*a, **kwargs), *dev)
            run(lambda gr: out.backward(gr), n(g))
            results.append([out.detach().cpu()] + [t.grad.cpu() for t in dev])
        finally:
            engine.set_enabled(True)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "split_heads"])
def test_attention_ops_queue_the_synchronous_results_and_layouts(layout):
    B, H, L, E = 2, 3, 16, 8
    base, grad = n(r(B, L, 3 * H * E)), n(r(B, H, L, E))
    if layout == "contiguous":
        q, k, v = [x.contiguous() for x in base.view(B, L, 3, H, E).permute(2, 0, 3, 1, 4)]
    else:
        q, k, v = [x.view(B, L, H, E).transpose(1, 2) for x in base.split(H * E, -1)]

    def run():
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
        grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True)
        return [out, lse] + list(grads[:3])

    engine.set_enabled(False)
    want = [t.cpu() for t in run()]
    strides = [t.stride() for t in run()]
    engine.set_enabled(True)
    got = queued(run)
    assert [t.stride() for t in got] == strides
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


BAD_MASKS = {  # for q, k, v of (2, 2, 20, 8): masks CPU's flash kernel rejects
    "bool": lambda: torch.rand(20, 20) > 0.3,
    "float64": lambda: torch.randn(20, 20, dtype=torch.float64),
    "3d": lambda: torch.randn(2, 20, 20),
    "wrong_keys": lambda: torch.randn(20, 21),
    "wrong_queries": lambda: torch.randn(19, 20),
    "wrong_batch": lambda: torch.randn(3, 1, 20, 20),
}


@pytest.mark.parametrize("op", ["flash", "efficient"])
@pytest.mark.parametrize("make_mask", BAD_MASKS.values(), ids=BAD_MASKS.keys())
def test_attention_with_a_mask_cpu_rejects_raises_cpus_error_at_the_call(make_mask, op):
    # As CUDA checks arguments before a launch, the call raises (not the next synchronization),
    # with CPU's message, and the device stays usable.
    q, mask = torch.randn(2, 2, 20, 8), make_mask()
    with pytest.raises(RuntimeError) as cpu_error:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, False, attn_mask=mask)
    qn = n(q)
    with pytest.raises(RuntimeError) as error:
        if op == "flash":
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qn, qn, qn, 0.0, False, attn_mask=n(mask))
        else:
            torch.ops.aten._scaled_dot_product_efficient_attention(qn, qn, qn, n(mask), False)
    assert "asynchronously" not in str(error.value)
    assert str(cpu_error.value).splitlines()[0] in str(error.value)
    torch.neuron.synchronize()
    assert torch.equal((qn + 1).cpu(), q + 1)


@pytest.mark.parametrize("L", [8, 16], ids=["cpu_flash_kernel", "small_kernel"])
@pytest.mark.parametrize("queue", [True, False])
def test_attention_over_reused_device_memory_gives_the_fresh_memory_results(queue, L):
    # CPU's flash kernels write neuron's results in place (sdpa.cpp, direct_flash); the backward
    # kernel accumulates into its gradients, so they must start from zero even in a pooled block
    # that held other values (NaNs here, freed just before), and the efficient op's logsumexp
    # goes to scratch when it is not returned. small_attention.cpp's kernel (16 queries) zeroes
    # the key gradients it accumulates likewise.
    B, H, E = 2, 4, 8
    q, k, v, g = (r(B, H, L, E) for _ in range(4))
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention_reference(L, torch.float32, cpu, g, lambda: [n(q), n(k), n(v)])
    if L < 16:
        want_nolse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    else:
        want_nolse = synchronous(lambda: torch.ops.aten._scaled_dot_product_efficient_attention(
            n(q), n(k), n(v), None, False, 0.0, True)[0].cpu())
    engine.set_enabled(queue)
    try:
        junk = [torch.full((B, H, L, E), float("nan"), device="neuron") for _ in range(16)]
        torch.neuron.synchronize()
        del junk
        dev = [n(t).requires_grad_() for t in (q, k, v)]
        run = queued if queue else (lambda f, *a: f(*a))
        out = run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True), *dev)
        run(lambda gr: out.backward(gr), n(g))
        out_nolse = run(lambda *a: torch.ops.aten._scaled_dot_product_efficient_attention(*a, None, False, 0.0, True),
                        n(q), n(k), n(v))[0]
        for got, w in zip([out.detach()] + [d.grad for d in dev], want):
            assert torch.equal(got.cpu(), w)
        assert torch.equal(out_nolse.cpu(), want_nolse)
    finally:
        engine.set_enabled(True)


@pytest.mark.parametrize("case", ["affine", "channels_last_bf16_fp32_params", "no_affine"])
def test_group_norm_results_over_reused_device_memory_are_cpus(case):
    # CPU's group norm stubs write neuron's results in place (ops.cpp): every element of the
    # output, the statistics and the gradients, over pooled blocks that held NaNs just before.
    dtype = torch.bfloat16 if case.startswith("channels_last") else torch.float32
    x, g = r(2, 8, 5, 6, dtype=dtype), r(2, 8, 5, 6, dtype=dtype)
    if case.startswith("channels_last"):
        x, g = (t.contiguous(memory_format=torch.channels_last) for t in (x, g))
    params = [] if case == "no_affine" else [r(8), r(8)]
    cpu = [t.clone().requires_grad_() for t in [x, *params]]
    want = F.group_norm(cpu[0], 4, *cpu[1:])
    want.backward(g)
    junk = [torch.full((2, 8, 5, 6), float("nan"), device="neuron") for _ in range(16)]
    junk += [torch.full((8,), float("nan"), device="neuron") for _ in range(16)]
    torch.neuron.synchronize()
    del junk
    dev = [n(t).requires_grad_() for t in [x, *params]]
    out = queued(lambda *a: F.group_norm(a[0], 4, *a[1:]), *dev)
    queued(lambda gr: out.backward(gr), n(g))
    assert out.stride() == want.stride()
    assert torch.equal(out.detach().cpu(), want.detach())
    for i, (d, c) in enumerate(zip(dev, cpu)):
        assert d.grad.stride() == c.grad.stride()
        if i == 1 and case.startswith("channels_last"):
            # PyTorch's derivative formula hands devices other than CPU (and XPU) contiguous
            # copies of a channels-last input and gradient, so the weight's gradient comes from
            # CPU's contiguous kernel, whose sums run in another order than its channels-last
            # kernel's: equal to fp32 rounding (bit for bit for about 70 % of random inputs).
            torch.testing.assert_close(d.grad.cpu(), c.grad, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(d.grad.cpu(), c.grad)


@pytest.mark.parametrize("case", ["contiguous", "channels_last", "channels_last_bf16_fp32_params", "eval"])
def test_batch_norm_gradients_over_reused_device_memory_are_cpus(case):
    # CPU's batch norm backward stub writes neuron's gradients in place (conv_net.cpp) for inputs
    # dense in one layout: every element, over pooled blocks that held NaNs just before.
    dtype = torch.bfloat16 if "bf16" in case else torch.float32
    x, g = r(4, 6, 5, 3, dtype=dtype), r(4, 6, 5, 3, dtype=dtype)
    if case.startswith("channels_last"):
        x, g = (t.contiguous(memory_format=torch.channels_last) for t in (x, g))
    w, b, rm, rv = r(6), r(6), r(6), r(6).abs() + 0.5
    training = case != "eval"
    cpu = [t.clone().requires_grad_() for t in (x, w, b)]
    want = F.batch_norm(cpu[0], rm.clone(), rv.clone(), cpu[1], cpu[2], training=training)
    want.backward(g)
    junk = [torch.full((4, 6, 5, 3), float("nan"), device="neuron") for _ in range(16)]
    junk += [torch.full((6,), float("nan"), device="neuron") for _ in range(16)]
    torch.neuron.synchronize()
    del junk
    dev = [n(t).requires_grad_() for t in (x, w, b)]
    out = F.batch_norm(dev[0], n(rm), n(rv), dev[1], dev[2], training=training)
    queued(lambda gr: out.backward(gr), n(g))
    for d, c in zip(dev, cpu):
        assert d.grad.stride() == c.grad.stride()
        assert torch.equal(d.grad.cpu(), c.grad)


def test_queued_products_read_their_operands_when_they_run():
    # the product is computed from the values its operands have when the queue reaches it
    a, b = n(torch.ones(64, 64)), n(torch.ones(64, 64))
    torch.neuron.synchronize()
    a.mul_(3)       # queued before the product: seen
    c = a @ b
    a.fill_(100)    # queued after it: not seen
    assert torch.equal(c.cpu(), torch.full((64, 64), 192.0))


ERRORS = {
    "mm_shapes": (lambda: torch.mm(n(r(3, 4)), n(r(5, 6))), "cannot be multiplied"),
    "mm_dtypes": (lambda: torch.mm(n(r(3, 4)), n(r(4, 6, dtype=torch.float64))), "same dtype"),
    "addmm_bias": (lambda: torch.addmm(n(r(5)), n(r(3, 4)), n(r(4, 6))), "expand"),
    "addmm_alpha_overflows_float": (lambda: torch.addmm(n(r(3)), n(r(2, 4)), n(r(4, 3)), alpha=1e300), "overflow"),
    "bmm_batch": (lambda: torch.bmm(n(r(2, 3, 4)), n(r(3, 4, 5))), "batch2"),
    "layer_norm_shape": (lambda: F.layer_norm(n(r(4, 8)), [6]), "normalized_shape"),
    "layer_norm_weight": (lambda: F.layer_norm(n(r(4, 8)), [8], n(r(7))), "weight"),
    "sum_dim": (lambda: n(r(3, 4)).sum(2), "Dimension out of range"),
    "cumsum_dim": (lambda: n(r(3, 4)).cumsum(2), "Dimension out of range"),
    "argmax_of_empty": (lambda: n(r(0, 3)).argmax(), "Expected reduction dim"),
    "max_dim_of_empty": (lambda: n(r(0, 3)).max(0), "non-zero size"),
    "triu_of_a_vector": (lambda: n(r(5)).triu(), "at least 2 dimensions"),
    "where_shapes": (lambda: torch.where(n(r(3, 1) > 0), n(r(3, 4)), n(r(5))), "must match"),
    "comparison_shapes": (lambda: n(r(64, 64)) > n(r(63)), "must match"),
    "vector_norm_integer": (lambda: torch.linalg.vector_norm(n(torch.arange(4))), "floating point or complex"),
    "sum_repeated_dim": (lambda: n(r(3, 4)).sum((1, 1)), "appears multiple times"),
    "softmax_dim": (lambda: torch.softmax(n(r(3, 4)), 5), "Dimension out of range"),
    "broadcast": (lambda: n(r(3, 1)).expand(3, 4) + n(r(5)), "must match"),
    "complex_alpha": (lambda: torch.add(n(r(3, 1)), n(r(3, 4)), alpha=1j), "alpha"),
    "clamp_no_bound": (lambda: torch.clamp(n(r(3))), "At least one of 'min' or 'max'"),
    "device_mismatch": (lambda: torch.mm(n(r(3, 4)), r(4, 2)), "neuron"),
    "nll_loss_target_shape": (lambda: F.nll_loss(n(r(4, 5)), n(torch.tensor([1, 2, 3]))), "size mismatch|Expected"),
    "float4_cast": (lambda: torch.empty(2, 2, dtype=torch.float4_e2m1fn_x2, device="neuron").float(),
                    "not implemented for 'Float4_e2m1fn_x2'"),
    "copy_shapes": (lambda: n(r(3, 4)).copy_(n(r(5))), "must match|expand"),
    "index_select_dim": (lambda: torch.index_select(n(r(3, 6)), 2, n(torch.tensor([0]))), "Dimension out of range"),
    "cat_shapes": (lambda: torch.cat([n(r(3, 2)), n(r(4, 2))], 1), "Sizes of tensors must match"),
    "conv_channels": (lambda: F.conv2d(n(r(1, 3, 5, 5)), n(r(2, 4, 3, 3))), "expected input"),
    "conv_kernel_too_large": (lambda: F.conv2d(n(r(1, 1, 2, 2)), n(r(1, 1, 3, 3))), "Kernel size can't be greater"),
    "batch_norm_weight_size": (lambda: torch.ops.aten.native_batch_norm(n(r(4, 3)), n(r(2)), None, None, None, True,
                                                                        0.1, 1e-5), "weight should contain 3 elements"),
    "batch_norm_eval_without_stats": (lambda: torch.ops.aten.native_batch_norm(n(r(4, 3)), None, None, None, None,
                                                                               False, 0.1, 1e-5),
                                      "running_mean and running_var must be defined"),
    "batch_norm_backward_eval_without_stats": (
        lambda: torch.ops.aten.native_batch_norm_backward(n(r(4, 3)), n(r(4, 3)), None, None, None, None, None, False,
                                                          1e-5, [True, False, False]), "must be defined"),
    "max_pool_padding": (lambda: torch.ops.aten.max_pool2d_with_indices(n(r(1, 4, 4)), [2, 2], [2, 2], [2, 2]),
                         "pad should be at most half"),
    "group_norm_groups": (lambda: torch.ops.aten.native_group_norm(n(r(2, 6, 4)), None, None, 2, 6, 4, 4, 1e-5),
                          "divisible"),
    "upsample_size": (lambda: F.interpolate(n(r(1, 1, 2, 2)), size=(0, 3)), "greater than 0"),
    "masked_fill_overflow": (lambda: n(torch.zeros(2, dtype=torch.bfloat16)).masked_fill_(n(torch.tensor([True, False])),
                                                                                          1e300), "overflow"),
    "masked_fill_int8_overflow": (lambda: n(torch.zeros(2, dtype=torch.int8)).masked_fill_(n(torch.tensor([True, False])),
                                                                                        300), "overflow"),
    "masked_fill_mask_shape": (lambda: n(r(2, 3)).masked_fill_(n(torch.tensor([True, False])), 1.0), "must match|expand"),
    "add_int_float_alpha": (lambda: n(torch.arange(3)).add_(n(torch.arange(3)), alpha=0.5), "alpha"),
    "topk_k_too_large": (lambda: torch.topk(n(r(3, 4)), 5), "out of range"),
    "sort_dim": (lambda: torch.sort(n(r(3, 4)), dim=3), "Dimension out of range"),
    "gather_index_dims": (lambda: torch.gather(n(r(3, 4)), 1, n(torch.zeros(3, dtype=torch.long))),
                          "Index tensor must have the same number of dimensions"),
    "gather_int16_index": (lambda: torch.gather(n(r(3, 4)), 1, n(torch.zeros(3, 1, dtype=torch.int16))), "int32/int64"),
    "scatter_src_dtype": (lambda: torch.scatter(n(r(3, 4)), 1, n(torch.zeros(3, 1, dtype=torch.long)),
                                                n(torch.ones(3, 1, dtype=torch.double))), "dtype"),
    "scatter_inplace_index_size": (lambda: n(r(3, 4)).scatter_(1, n(torch.zeros(5, 1, dtype=torch.long)), 1.0),
                                   "Expected index"),
    "index_too_many": (lambda: n(r(3, 4))[n(torch.tensor([0])), n(torch.tensor([0])), n(torch.tensor([0]))],
                       "too many indices"),
    "index_shapes": (lambda: n(r(3, 4))[n(torch.tensor([0, 1])), n(torch.tensor([0, 1, 2]))], "shape mismatch"),
    "index_put_value_shape": (lambda: n(r(5, 3)).index_put_((n(torch.tensor([0, 1])),), n(r(3, 3))), "shape mismatch"),
    "index_put_dtype": (lambda: n(r(5, 3)).index_put_((n(torch.tensor([0])),), n(torch.ones(1, 3, dtype=torch.double))),
                        "dtype"),
    "floor_divide_shapes": (lambda: n(r(3, 4)) // n(r(5)), "must match"),
    "scatter_value_int8_overflow": (lambda: torch.scatter(n(torch.zeros(3, dtype=torch.int8)), 0, n(torch.tensor([0])), 300),
                                    "overflow"),
    "scatter_inplace_into_expanded": (lambda: n(r(1, 4)).expand(3, 4).scatter_(1, n(torch.zeros(3, 1, dtype=torch.long)),
                                                                                1.0), "memory location"),
    "scatter_inplace_index_is_self": (lambda: (lambda x: x.scatter_(0, x, 1))(n(torch.zeros(4, dtype=torch.long))),
                                      "memory location"),
    "index_without_index_tensors": (lambda: torch.ops.aten.index(n(r(3, 4)), [None]), "ntensor"),
    "index_put_index_is_self": (lambda: (lambda x: x.index_put_((x,), n(torch.tensor(1))))(n(torch.zeros(4, dtype=torch.long))),
                                "memory location"),
    "index_put_overlapping_values": (lambda: (lambda x: x.index_put_((n(torch.tensor([0])),), x[1:2]))(n(r(3, 4))),
                                     "memory location"),
    "grouped_mm_offs_dtype": (lambda: torch._grouped_mm(n(r(10, 8)), n(r(3, 8, 4)), offs=n(torch.tensor([3, 3, 10]))),
                              "int32"),
    "amax_repeated_dim": (lambda: n(r(3, 4)).amax((1, 1)), "appears multiple times"),
    "amax_of_an_empty_dim": (lambda: n(r(0, 3)).amax(0), "zero-size|non-zero size|empty"),
    "max_of_empty": (lambda: n(r(0, 3)).max(), "numel|empty|non-empty"),
    "scaled_mm_shapes": (lambda: torch._scaled_mm(n(r(4, 32).to(torch.float8_e4m3fn)), n(r(16, 8).to(torch.float8_e4m3fn)),
                                                  n(torch.ones(1)), n(torch.ones(1))), "cannot be multiplied"),
    "scaled_mm_scales": (lambda: torch._scaled_mm(n(r(4, 32).to(torch.float8_e4m3fn)), n(r(8, 32).to(torch.float8_e4m3fn).t()),
                                                  n(torch.ones(4)), n(torch.ones(1))), "scaling configuration"),
    "int_mm_shapes": (lambda: torch._int_mm(n(torch.ones(17, 32, dtype=torch.int8)), n(torch.ones(16, 8, dtype=torch.int8))),
                      "cannot be multiplied|size"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_a_bad_call_raises_at_the_call_and_leaves_the_engine_usable(name):
    fn, match = ERRORS[name]
    with pytest.raises((RuntimeError, IndexError, ValueError), match=match):
        fn()
    torch.neuron.synchronize()  # nothing failed later
    x = n(r(4, 4))
    assert torch.equal((x @ x).cpu(), x.cpu() @ x.cpu())


@pytest.mark.parametrize("args,dtype", [((5,), torch.int64), ((10, -2, -3), torch.int32), ((2, 9), torch.int64),
                                        ((0, 3.5, 0.5), torch.float32), ((10, -2, -3), torch.float32),
                                        ((-1, 1, 0.25), torch.bfloat16)], ids=str)
def test_arange_queues_cpus_values(args, dtype):
    # behind a queued kernel: sizing the factory's empty result must not wait for it
    want = torch.arange(*args, dtype=dtype)
    pending = n(r(64))
    same(queued(lambda: (pending.mul_(2), torch.arange(*args, dtype=dtype, device="neuron"))[1]), want)


def test_arange_raises_cpus_errors_at_the_call():
    with pytest.raises(RuntimeError, match="upper bound and lower bound inconsistent"):
        torch.arange(0, 5, -1, device="neuron")
    with pytest.raises(RuntimeError, match="step must be nonzero"):
        torch.arange(0, 5, 0, device="neuron")
    with pytest.raises(ValueError, match="step must be nonzero"):  # 0.5 as int64 (CPU's ValueError)
        torch.arange(0, 3.5, 0.5, dtype=torch.int64, device="neuron")


@pytest.mark.parametrize("layout", ["contiguous", "split_heads", "sequence_major", "packed_qkv", "padded_heads"])
@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention (enable_gqa)
def test_flash_attention_queues_the_synchronous_results_and_layouts(layout, kv_heads):
    # CPU lays the output out like q (empty_like: q's strides when dense, else dense in q's
    # stride order): the queued op must predict it for every layout, dense or not.
    B, H, L, E = 2, 4, 8, 16

    def make(heads):  # (B, heads, L, E) in `layout`
        if layout == "sequence_major":  # (L, B, heads, E) permuted: dense, not contiguous
            return n(r(L, B, heads, E)).permute(1, 2, 0, 3)
        if layout == "packed_qkv":  # a view of a fused (B, L, 3 * heads * E) projection: not dense
            return n(r(B, L, 3, heads, E))[:, :, 0].transpose(1, 2)
        if layout == "padded_heads":  # (B, heads, L, 2E)[..., :E]: not dense, in (B, heads, L) order
            return n(r(B, heads, L, 2 * E))[..., :E]
        t = r(B, L, heads, E)
        return n(t).transpose(1, 2) if layout == "split_heads" else n(t.transpose(1, 2).contiguous())
    q, k, v, go = make(H), make(kv_heads), make(kv_heads), make(H)

    def run():
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(go, q, k, v, out, lse, 0.0, True)
        return [out, lse, *grads]

    engine.set_enabled(False)
    want = run()
    engine.set_enabled(True)
    got = queued(run)
    assert [t.stride() for t in got] == [t.stride() for t in want]
    for a, e in zip(got, want):
        assert torch.equal(a.cpu(), e.cpu())


@pytest.mark.parametrize("input_cl,weight_cl", [(True, False), (False, True), (True, True)])
def test_channels_last_convolutions_queue_the_synchronous_results_and_layouts(input_cl, weight_cl):
    cl = torch.channels_last
    x, w, b, g = r(2, 3, 7, 6), r(5, 3, 3, 3), r(5), r(2, 5, 7, 6)
    x, w = (x.contiguous(memory_format=cl) if input_cl else x), (w.contiguous(memory_format=cl) if weight_cl else w)

    x, w, b, g = n(x), n(w), n(b), n(g)

    def run():
        out = torch.ops.aten.convolution(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        grads = torch.ops.aten.convolution_backward(g, x, w, [5], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                    [True, True, True])
        return [out, *grads]

    engine.set_enabled(False)
    want = run()
    engine.set_enabled(True)
    got = queued(run)
    assert [t.stride() for t in got] == [t.stride() for t in want]
    for a, e in zip(got, want):
        assert torch.equal(a.cpu(), e.cpu())


def test_batch_norm_of_a_permuted_input_gives_cpus_values():
    # CPU's out= kernel is wrong for an input not dense in its suggested layout (torch 2.13): such
    # an input runs the functional kernel (synchronously), the values CPU's batch norm gives
    x = r(2, 5, 4, 3).transpose(2, 3)
    want = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    same(torch.ops.aten.native_batch_norm(n(x), None, None, None, None, True, 0.1, 1e-5), want)


def _cnn(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(inplace=True),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10)).to(device)


def _cnn_steps(steps=3):
    model = _cnn("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    x = n(torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(0)))
    y = n(torch.tensor([1, 7, 0, 3]))
    losses, waits = [], []
    for _ in range(steps):
        torch.neuron.synchronize()
        before = engine.stats()["drains"]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        waits.append(engine.stats()["drains"] - before)
        losses.append(loss.detach())
    return [l.cpu() for l in losses], [p.cpu() for p in model.state_dict().values()], waits


def test_a_cnn_training_step_never_waits_and_gives_the_synchronous_bits():
    # convolutions, batch norm (running statistics, num_batches_tracked), relu, max pooling,
    # adaptive average pooling, cross entropy, SGD with momentum: every kernel queued
    losses, state, waits = _cnn_steps()
    assert waits == [0, 0, 0]
    engine.set_enabled(False)
    want_losses, want_state, _ = _cnn_steps()
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    assert all(torch.equal(a, b) for a, b in zip(state, want_state))


def test_a_vit_training_step_never_waits_for_the_device():
    # Hugging Face's ViT (patch convolution, attention, layer norm, GELU, the class token's
    # select and its gradient, cross-entropy, AdamW), built from a config
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5)
    model = transformers.ViTForImageClassification(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = n(r(2, 3, 16, 16)), n(torch.tensor([1, 4]))
    trains_without_waiting(lambda: model(pixel_values=x, labels=y).loss, opt)


def test_a_llama_training_step_never_waits_for_the_device():
    # Hugging Face's Llama (rotary embeddings over slices, grouped-query attention, RMSNorm,
    # SiLU gating, position ids from arange), built from a config
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = n(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)))
    trains_without_waiting(lambda: model(input_ids=ids, labels=ids).loss, opt)


def test_a_diffusion_unet_training_step_never_waits_for_the_device():
    # diffusers' UNet2DModel (convolutions, group norm, SiLU, attention, nearest upsampling, a
    # timestep embedding from arange and an int64 timestep, MSE loss), built from a config
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                                  block_out_channels=(16, 32), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, t = n(r(2, 3, 8, 8)), n(torch.tensor([10, 500]))
    trains_without_waiting(lambda: F.mse_loss(model(x, t).sample, x), opt)


def _demo_gpt():
    """The demo's model (embedding, attention, loss) on neuron, its AdamW and a batch."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from eager_overhead import GPT, CharDataset, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = CharDataset(block_size=cfg.block_size).batch(4, torch.Generator().manual_seed(0))
    return model, opt, x.to("neuron"), y.to("neuron")


def test_a_gpt_training_step_never_waits_for_the_device():
    model, opt, x, y = _demo_gpt()
    trains_without_waiting(lambda: model(x, y)[1], opt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_autocast_gpt_training_step_never_waits_for_the_device(dtype):
    # Under autocast the GEMMs run in fp16/bf16, which the exact route computes (gemm.cpp): fp16
    # on every host, bf16 on hosts without AVX512-BF16. Those products and the attention are
    # queued like fp32's.
    model, opt, x, y = _demo_gpt()

    def loss():
        with torch.autocast("neuron", dtype=dtype):
            return model(x, y)[1]
    trains_without_waiting(loss, opt)


def test_an_mlp_training_step_never_waits_for_the_device():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from engine import mlp_model  # the pointwise-heavy model of bench/engine.py (d)

    model = mlp_model("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)
    x = n(r(8, 256))
    assert all(k >= 40 for k in trains_without_waiting(lambda: model(x).square().mean(), opt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_queues_and_draws_what_a_synchronous_call_draws(dtype):
    # The generator's offsets are reserved at the call, in program order: output, mask and the
    # generator's state after two dropouts are those of the engine off, bit for bit.
    x = n(r(300, 7, dtype=dtype))
    results = []
    for on in (False, True):
        engine.set_enabled(on)
        torch.manual_seed(5)
        if on:
            got = queued(lambda: (torch.ops.aten.native_dropout(x, 0.3, True), F.dropout(x, 0.5)))
        else:
            got = (torch.ops.aten.native_dropout(x, 0.3, True), F.dropout(x, 0.5))
        (out, mask), second = got
        results.append((out.cpu(), mask.cpu(), second.cpu(), torch.neuron.get_rng_state()))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert results[1][1].dtype == torch.bool and 0 < results[1][1].sum() < x.numel()


def test_dropout_with_an_invalid_probability_raises_at_the_call():
    with pytest.raises(RuntimeError, match="p to be in"):
        torch.ops.aten.native_dropout(n(r(8)), 1.5, True)


def test_a_training_step_with_dropout_never_waits_for_the_device():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 4)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = n(r(8, 16))
    trains_without_waiting(lambda: model(x).square().mean(), opt)


def test_dropout_backward_over_a_strided_gradient_runs_cpus_kernel():
    g, m = r(7, 6).t(), r(6, 7) > 0
    got = torch.ops.aten.native_dropout_backward(n(g), n(m), 2.0)
    same(got, torch.ops.aten.native_dropout_backward(g, m, 2.0))


def test_where_reads_a_cpu_scalar_value_at_the_call():
    c, x, z = n(r(3, 4) > 0), n(r(3, 4)), torch.tensor(2.5)
    out = queued(torch.where, c, z, x)
    z.fill_(7.0)  # after the call, before the kernel ran
    same(out, torch.where(c.cpu(), torch.tensor(2.5), x.cpu()))


def test_a_step_clipping_the_gradients_norm_never_waits_for_the_device():
    # clip_grad_norm_: _foreach_norm, the norm of the norms, the clamped coefficient, _foreach_mul_
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = n(r(4, 8))
    for _ in range(2):
        torch.neuron.synchronize()
        before = engine.stats()
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        assert engine.stats()["drains"] == before["drains"], "the step waited for the device"
    assert norm.cpu() > 0


def test_a_gpt2_training_step_never_waits_for_the_device():
    # Hugging Face's GPT-2 (SDPA with its causal mask: _safe_softmax, where into the softmax),
    # built from a config
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = n(torch.randint(0, 128, (2, 16), generator=gen))
    trains_without_waiting(lambda: model(input_ids=ids, labels=ids).loss, opt)


@pytest.mark.parametrize("arch", ["Mixtral", "Qwen3Moe"])
def test_a_hugging_face_mixture_of_experts_training_step_never_waits_for_the_device(arch):
    # Top-k routing, tokens sorted and counted per expert (histc over integers), _grouped_mm
    # per expert group, results scattered back (transformers' grouped_mm experts)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    if arch == "Mixtral":
        cfg = transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
    else:
        cfg = transformers.Qwen3MoeConfig(**sizes, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = n(torch.randint(0, 128, (2, 16), generator=gen))
    trains_without_waiting(lambda: model(input_ids=ids, labels=ids).loss, opt)


def test_a_t5_training_step_never_waits_for_the_device():
    # T5's relative-position buckets: neg and abs of int64 positions, integer min/where/log
    # casts (it waited twice a step on neg and abs before they queued over integers)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=2, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = n(torch.randint(0, 128, (2, 16), generator=gen))
    trains_without_waiting(lambda: model(input_ids=ids, labels=ids).loss, opt)


def test_integer_histc_with_bounds_queues_cudas_counts():
    x = torch.tensor([-3, 0, 1, 1, 2, 5, 9, 3, 3, 3], dtype=torch.int32)
    got = queued(lambda t: torch.histc(t, bins=4, min=0, max=3), n(x))
    assert torch.equal(got.cpu(), torch.tensor([1, 2, 1, 3], dtype=torch.int32))  # 0 | 1 1 | 2 | 3 3 3


def test_a_comparison_reads_a_cpu_scalar_value_at_the_call():
    x, z = n(r(64, 64)), torch.tensor(0.1)
    out = queued(torch.gt, x, z)
    z.fill_(7.0)  # after the call, before the kernel ran
    same(out, x.cpu() > 0.1)


@pytest.mark.parametrize("op", ["gather", "scatter_add_", "index", "index_put_"])
def test_an_index_out_of_range_surfaces_at_the_next_synchronization(op):
    # Only the kernel reads the indices (as on CUDA): the error is reported where the host next
    # waits, naming the op, and the device stays usable.
    x, bad = n(r(4, 5)), n(torch.tensor([[0], [9], [1], [2]]))
    run = {"gather": lambda: torch.gather(x, 1, bad),
           "scatter_add_": lambda: x.scatter_add_(1, bad, n(r(4, 1))),
           "index": lambda: x[bad.view(-1)],
           "index_put_": lambda: x.index_put_((bad.view(-1),), n(r(4, 5)))}[op]
    queued(run)
    name = {"index": "index.Tensor", "index_put_": "_index_put_impl_"}.get(op, op)
    with pytest.raises(RuntimeError, match=f"(?s)aten::{name} failed on the device.*out of bounds"):
        torch.neuron.synchronize()
    torch.neuron.synchronize()
    assert torch.equal((x @ x.t()).cpu(), x.cpu() @ x.cpu().t())


ROUTED_PRODUCTS = {
    "mm": (torch.mm, lambda dt: (r(8, 40, dtype=dt), r(40, 4, dtype=dt))),
    "mm_transposed": (torch.mm, lambda dt: (r(40, 8, dtype=dt).t(), r(4, 40, dtype=dt).t())),
    "addmm": (lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=-2),
              lambda dt: (r(4, dtype=dt), r(8, 40, dtype=dt), r(40, 4, dtype=dt))),
    "bmm": (torch.bmm, lambda dt: (r(3, 5, 40, dtype=dt), r(3, 40, 2, dtype=dt))),
    "baddbmm": (lambda s, a, b: torch.baddbmm(s, a, b, alpha=0.25),
                lambda dt: (r(5, 2, dtype=dt), r(3, 5, 40, dtype=dt), r(3, 40, 2, dtype=dt))),
    "linear": (F.linear, lambda dt: (r(6, 40, dtype=dt), r(7, 40, dtype=dt), r(7, dtype=dt))),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ROUTED_PRODUCTS))
def test_a_routed_product_queues_and_equals_the_synchronous_one(name, dtype):
    # fp16 (and bf16 on hosts without AVX512-BF16) products take the exact route (gemm.cpp): queued
    # too, the kernel being the synchronous path's own, so an AMP step does not wait at its GEMMs.
    if dtype == torch.bfloat16 and not BF16_ROUTED:
        pytest.skip("CPU's bf16 kernels are fast on this host: bf16 is not routed")
    fn, make = ROUTED_PRODUCTS[name]
    dev = [n(a) for a in make(dtype)]
    got = queued(fn, *dev)
    engine.set_enabled(False)
    try:
        want = fn(*dev)
    finally:
        engine.set_enabled(True)
    same(got, want.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grouped_mm_in_a_routed_dtype_takes_the_routed_gemms(dtype):
    # fp16 (and bf16 where CPU's bf16 kernels are slow) GEMMs leave CPU's kernel (gemm.h; CPU's
    # fp16 GEMM is 10-400x slower than bf16): each group's product is the neuron mm of that group.
    a, b = n(r(10, 64, dtype=dtype)), n(r(3, 64, 8, dtype=dtype))
    offs = n(torch.tensor([3, 3, 10], dtype=torch.int32))
    if dtype == torch.bfloat16 and not BF16_ROUTED:
        pytest.skip("CPU's bf16 kernels are fast on this host: bf16 is not routed")
    if dtype == torch.float16 and _C._precision_routes()["fp16_cpu_product_kernels"]:
        pytest.skip("CPU's fp16 GEMMs are oneDNN's on this host (AVX512-FP16): fp16 products are not routed")
    n(r(64)).mul_(2)  # pending work
    before = engine.stats()["drains"]
    got = torch._grouped_mm(a, b, offs=offs)
    # ATen's composite, not the queued kernel: it reads the offsets on the host (a wait), and
    # its per-group products take the routed mm (synchronous, gemm.cpp)
    assert engine.stats()["drains"] > before
    want = torch.cat([a[0:3] @ b[0], a[3:3] @ b[1], a[3:10] @ b[2]])
    assert torch.equal(got.cpu(), want.cpu())


def test_a_mixture_of_experts_training_step_never_waits_for_the_device():
    # Top-k routing, tokens sorted and counted by expert, one GEMM per expert's group
    # (_grouped_mm), the weighted results scattered back: the shape of Hugging Face's MoE
    # layers, with the counts computed by scatter_add (histc over integers waits; see
    # docs/architecture.md).
    torch.manual_seed(0)
    experts, top_k, d = 4, 2, 8
    router = torch.nn.Linear(d, experts).to("neuron")
    w1 = torch.nn.Parameter(n(r(experts, d, 16) * 0.1))
    w2 = torch.nn.Parameter(n(r(experts, 16, d) * 0.1))
    opt = torch.optim.SGD([*router.parameters(), w1, w2], lr=0.1)
    x = n(r(12, d))

    def loss():
        weights, chosen = torch.topk(router(x).softmax(-1), top_k)
        flat = chosen.reshape(-1)
        order = flat.sort(stable=True).indices
        counts = torch.zeros(experts, dtype=torch.long, device="neuron").scatter_add(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).int()
        tokens = x[order // top_k]
        h = torch._grouped_mm(tokens, w1, offs=offs).relu()
        out = torch._grouped_mm(h, w2, offs=offs) * weights.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(x).index_put_((order // top_k,), out, accumulate=True)
        return y.square().mean()

    trains_without_waiting(loss, opt)


def test_abs_of_a_bool_tensor_gives_cudas_result_with_the_engine_on():
    # CUDA's |b| == b; CPU has no bool abs kernel (bool_ops.cpp), so bool stays off the queued
    # path of the real dtypes
    x = n(torch.tensor([True, False, True]))
    got = torch.abs(x)
    torch.neuron.synchronize()
    assert torch.equal(got.cpu(), x.cpu())


_OUT_PRODUCTS = {  # op: (call with operands and out=, operand shapes, result shape)
    "mm": (lambda a, o: torch.mm(*a, out=o), [(5, 7), (7, 3)], (5, 3)),
    "addmm": (lambda a, o: torch.addmm(*a, beta=0.5, alpha=2.0, out=o), [(3,), (5, 7), (7, 3)], (5, 3)),
    "bmm": (lambda a, o: torch.bmm(*a, out=o), [(2, 5, 7), (2, 7, 3)], (2, 5, 3)),
    "baddbmm": (lambda a, o: torch.baddbmm(*a, beta=0.5, alpha=2.0, out=o), [(2, 5, 3), (2, 5, 7), (2, 7, 3)],
                (2, 5, 3)),
}


@pytest.mark.parametrize("op", sorted(_OUT_PRODUCTS))
@pytest.mark.parametrize("out_layout", ["contiguous", "transposed"])
def test_out_products_queue_with_cpus_results(op, out_layout):
    # Inductor's extern kernels call the out= forms: queued, compiled graphs stay asynchronous.
    call, shapes, result = _OUT_PRODUCTS[op]
    args = [r(*s) for s in shapes]
    args[-1] = args[-1].transpose(-1, -2).contiguous().transpose(-1, -2)  # a transposed operand too
    k = args[-2].shape[-1]
    wide = r(*args[-2].shape[:-1], k + 5)  # and a slice of a wider buffer (not dense)
    args[-2] = wide[..., :k]
    nargs = [n(a) for a in args]
    nargs[-2] = n(wide)[..., :k]  # sliced on the device (.to() would make the slice dense)

    def make_out():
        t = torch.full(result[:-2] + result[:-3:-1], float("nan"))
        return t.transpose(-1, -2) if out_layout == "transposed" else torch.full(result, float("nan"))
    want = make_out()
    call(args, want)
    out = n(make_out())
    queued(call, nargs, out)
    same(out, want)


@pytest.mark.parametrize("op", ["addmm_", "baddbmm_"])
def test_in_place_products_queue_with_cpus_results(op):
    bias, a, b = (r(5, 3), r(5, 7), r(7, 3)) if op == "addmm_" else (r(2, 5, 3), r(2, 5, 7), r(2, 7, 3))
    want = getattr(bias.clone(), op)(a, b, beta=0.5, alpha=2.0)
    got = n(bias)
    queued(lambda: getattr(got, op)(n(a), n(b), beta=0.5, alpha=2.0))
    same(got, want)


def test_out_products_that_resize_or_overlap_run_at_the_call_as_cpus():
    a, b = r(5, 7), r(7, 5)
    out = n(torch.empty(0))  # resized by CPU's kernel: synchronous
    torch.mm(n(a), n(b), out=out)
    same(out, torch.mm(a, b))
    with pytest.raises(RuntimeError, match="Expected out tensor to have dtype float"):  # CPU's, at the call
        torch.mm(n(a), n(b), out=n(torch.empty(5, 5, dtype=torch.long)))
    x = r(5, 5)
    want = x.clone()
    torch.mm(want, x, out=want)  # out is an operand: whatever CPU's kernel makes of it
    got = n(x)
    before = engine.stats()["enqueued"]
    torch.mm(got, n(x), out=got)
    assert engine.stats()["enqueued"] == before
    same(got, want)


def test_in_place_index_ops_reading_slices_of_wider_buffers_queue_with_cpus_results():
    # Operands that are not dense (a slice of a wider buffer) in separate memory: ATen's overlap
    # test calls them "too hard"; they cannot overlap what the op writes, so the op queues.
    wide, idx = r(4, 9), torch.randint(0, 4, (4, 5), generator=gen)
    want = torch.zeros(4, 5).scatter_(0, idx, wide[:, :5])
    got = n(torch.zeros(4, 5))
    nwide = n(wide)
    queued(lambda: got.scatter_(0, n(idx), nwide[:, :5]))
    same(got, want)
    rows = torch.tensor([0, 2])
    want = torch.zeros(4, 5).index_put_((rows,), wide[:2, :5])
    got = n(torch.zeros(4, 5))
    queued(lambda: got.index_put_((n(rows),), nwide[:2, :5]))
    same(got, want)


def _fp8(*shape):
    return (r(*shape) * 4).to(torch.float8_e4m3fn)


SCALED_MM = {
    "tensorwise_bf16": lambda: ((_fp8(16, 64), _fp8(24, 64).t(), torch.tensor([0.5]), torch.tensor([0.25])),
                                dict(out_dtype=torch.bfloat16)),
    "rowwise_bias_fp32": lambda: ((_fp8(16, 64), _fp8(24, 64).t(), torch.rand(16, 1) + 0.5, torch.rand(1, 24) + 0.5),
                                  dict(bias=r(24), out_dtype=torch.float32)),
    "tensorwise_fp16": lambda: ((_fp8(5, 32), _fp8(32, 7), torch.tensor([2.0]), torch.tensor([0.125])),
                                dict(out_dtype=torch.float16)),
}


@pytest.mark.parametrize("case", sorted(SCALED_MM))
def test_scaled_mm_queues_and_equals_the_synchronous_one(case):
    # FP8 GEMMs queue (vLLM's FP8 layers in decode graphs, dynamic activation scales computed
    # by the queued ops before them): the kernel reads the scales when it runs
    args, kwargs = SCALED_MM[case]()
    dev = [n(a) for a in args]
    kwargs = {k: n(v) for k, v in kwargs.items()}
    got = queued(lambda *a: torch._scaled_mm(*a, **kwargs), *dev)
    engine.set_enabled(False)
    try:
        want = torch._scaled_mm(*dev, **kwargs)
    finally:
        engine.set_enabled(True)
    same(got, want.cpu())


def test_a_queued_scaled_mm_reads_a_scale_computed_by_the_ops_queued_before_it():
    x, w = r(8, 64), _fp8(16, 64)
    xd = n(x)
    scale = (xd.abs().amax() / 448.0).reshape(1)  # queued, not yet computed
    q = (xd * scale.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn)
    got = queued(lambda a, b, sa, sb: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32),
                 q, n(w).t(), scale, n(torch.tensor([0.5])))
    s = (x.abs().amax() / 448.0).reshape(1)
    qc = (x * s.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = (qc.float() @ w.float().t()) * (s * 0.5)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_int_mm_queues_and_equals_the_synchronous_one():
    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (64, 24), dtype=torch.int8, generator=gen)
    got = queued(torch._int_mm, n(a), n(b))
    assert torch.equal(got.cpu(), a.int() @ b.int())
