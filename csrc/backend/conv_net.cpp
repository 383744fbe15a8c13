// The rest of a convolutional network's training step, queued (enqueue.h) like the convolution
// itself (gemm.cpp): batch norm, 2-d max pooling and 2-d nearest upsampling, forward and
// backward. With them (and relu and group norm, ops.cpp) a CNN's or a UNet's step enqueues
// every kernel and can be captured whole in a graph.
//
// Each op queues only when its arguments are neuron tensors whose metadata CPU's kernel accepts
// (checked here, so nothing can fail later); any other call takes the boxed fallback as before,
// which raises CPU's own error at the call. Results are allocated with the layout CPU's kernel
// gives them: max pooling's from its structured meta function, batch norm's by CPU's rule
// (the input's suggested memory format; saved statistics of the parameters' dtype, empty when
// not training).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "cpu_stub.h"  // before DispatchStub.h: batch norm's backward stub is called below
#include <ATen/core/Tensor.h>
#include <ATen/native/batch_norm.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/max_pool2d_with_indices_backward_cpu_dispatch.h>
#include <ATen/ops/max_pool2d_with_indices_backward_meta_dispatch.h>
#include <ATen/ops/max_pool2d_with_indices_cpu_dispatch.h>
#include <ATen/ops/max_pool2d_with_indices_meta_dispatch.h>
#include <ATen/ops/native_batch_norm_backward_cpu_dispatch.h>
#include <ATen/ops/native_batch_norm_cpu_dispatch.h>
#include <ATen/ops/upsample_nearest2d_backward_cpu_dispatch.h>
#include <ATen/ops/upsample_nearest2d_backward_meta_dispatch.h>
#include <ATen/ops/upsample_nearest2d_cpu_dispatch.h>
#include <ATen/ops/upsample_nearest2d_meta_dispatch.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "enqueue.h"
#include "fallback.h"

namespace torchneuron {
namespace {

using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

// The synchronous path of each is the boxed zero-copy fallback these ops took before they had a
// kernel here (fallback.h, via_fallback).
constexpr char kBatchNorm[] = "aten::native_batch_norm";
constexpr char kBatchNormBwd[] = "aten::native_batch_norm_backward";
constexpr char kMaxPool[] = "aten::max_pool2d_with_indices";
constexpr char kMaxPoolBwd[] = "aten::max_pool2d_with_indices_backward";
constexpr char kUpsample[] = "aten::upsample_nearest2d";
constexpr char kUpsampleBwd[] = "aten::upsample_nearest2d_backward";

// ---- batch norm ------------------------------------------------------------------------------
// The parameters' dtype if every present parameter (weight, bias, running statistics) is a
// neuron tensor on input's device with C elements, all of one dtype: input's, or fp32 under a
// bf16/fp16 input (CPU's mixed-type kernel); else nullopt.
std::optional<c10::ScalarType> batch_norm_params(const at::Tensor& input, std::initializer_list<const OptTensor*> params) {
  const int64_t C = input.size(1);
  std::optional<c10::ScalarType> dtype;
  for (const OptTensor* p : params) {
    if (!p->has_value() || !(*p)->defined()) continue;
    const at::Tensor& t = **p;
    if (!t.is_privateuseone() || t.device() != input.device() || t.layout() != c10::kStrided || t.dim() != 1 ||
        t.size(0) != C || t.is_conj() || t.is_neg() || (dtype && *dtype != t.scalar_type())) {
      return std::nullopt;
    }
    dtype = t.scalar_type();
  }
  if (!dtype) return input.scalar_type();
  const bool mixed = *dtype == at::kFloat && (input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf);
  if (*dtype != input.scalar_type() && !mixed) return std::nullopt;
  return dtype;
}
bool queueable_input(const at::Tensor& input) {
  return may_enqueue() && queueable_like(input, input) && c10::isFloatingType(input.scalar_type()) &&
         input.dim() >= 2 && input.numel() > 0;
}

// What at::batch_norm checks before it calls native_batch_norm, which CPU's kernel does not: a
// parameter of the wrong size is read out of bounds, evaluation without running statistics
// dereferences an undefined tensor (a segfault on CPU). Raised here for direct calls.
void check_batch_norm_args(const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
                           const OptTensor& running_mean, const OptTensor& running_var, bool training) {
  TORCH_CHECK(input.dim() >= 2, "native_batch_norm: expected an input with batch and channel dimensions "
              "(2 or more dims), got ", input.dim(), " dims");
  const int64_t C = input.size(1);
  auto check = [&](const OptTensor& t, const char* name) {
    TORCH_CHECK(!t.has_value() || !t->defined() || t->numel() == C, "native_batch_norm: ", name,
                " should contain ", C, " elements (the input's channels, dim 1), not ", t->numel());
  };
  check(weight, "weight");
  check(bias, "bias");
  check(running_mean, "running_mean");
  check(running_var, "running_var");
  TORCH_CHECK(training || (running_mean.has_value() && running_mean->defined() && running_var.has_value() &&
                           running_var->defined()),
              "native_batch_norm: running_mean and running_var must be defined when not training "
              "(evaluation normalizes with them)");
}

Tensor3 batch_norm(const at::Tensor& input, const OptTensor& weight, const OptTensor& bias, const OptTensor& running_mean,
                   const OptTensor& running_var, bool training, double momentum, double eps) {
  check_batch_norm_args(input, weight, bias, running_mean, running_var, training);
  const bool stats = running_mean.has_value() && running_mean->defined() && running_var.has_value() &&
                     running_var->defined();
  const bool one_stat = (running_mean.has_value() && running_mean->defined()) != (running_var.has_value() && running_var->defined());
  // CPU's out= kernel computes wrong values for an input that is not dense in its suggested
  // layout (a permuted one, say; torch 2.13): such inputs take the functional kernel, synchronously.
  if (queueable_input(input) && input.is_contiguous(input.suggest_memory_format()) && (training || stats) &&
      !one_stat) {
    if (const auto pdt = batch_norm_params(input, {&weight, &bias, &running_mean, &running_var})) {
      const int64_t C = input.size(1), saved = training ? C : 0;
      QueuedCall q;
      at::Tensor x = q.in(input), out, mean, invstd;
      OptTensor w = q.in(weight), b = q.in(bias), rm, rv;
      if (stats && training) rm = q.inout(*running_mean), rv = q.inout(*running_var);  // updated
      else if (stats) rm = q.in(*running_mean), rv = q.in(*running_var);
      at::Tensor o = q.out(out, input.sizes(), input.scalar_type(), suggested_strides(input));
      at::Tensor mo = q.out(mean, {saved}, *pdt), vo = q.out(invstd, {saved}, *pdt);
      q.enqueue(kBatchNorm, [x, w, b, rm, rv, o, mo, vo, training, momentum, eps]() mutable {
        at::cpu::native_batch_norm_out(o, mo, vo, x, w, b, rm, rv, training, momentum, eps);
      });
      return {out, mean, invstd};
    }
  }
  return FromStack<Tensor3>::get(
      via_fallback<kBatchNorm>(input, weight, bias, running_mean, running_var, training, momentum, eps));
}

// The layout t is dense in, as CPU's batch norm picks it (Normalization.cpp: is_contiguous,
// suggest_memory_format_contig): contiguous first, then channels-last 3-d and 2-d; nullopt if none.
std::optional<at::MemoryFormat> dense_format(const at::Tensor& t) {
  for (const auto f : {at::MemoryFormat::Contiguous, at::MemoryFormat::ChannelsLast3d, at::MemoryFormat::ChannelsLast}) {
    if (t.is_contiguous(f)) return f;
  }
  return std::nullopt;
}

Tensor3 batch_norm_backward(const at::Tensor& grad_out, const at::Tensor& input, const OptTensor& weight,
                            const OptTensor& running_mean, const OptTensor& running_var, const OptTensor& save_mean,
                            const OptTensor& save_invstd, bool train, double eps, std::array<bool, 3> mask) {
  const bool w_def = weight.has_value() && weight->defined();
  auto defined = [](const OptTensor& t) { return t.has_value() && t->defined(); };
  // What CPU's kernel reads: the saved statistics when training, the running ones otherwise
  // (undefined, a segfault on CPU).
  const bool reads = train ? defined(save_mean) && defined(save_invstd) : defined(running_mean) && defined(running_var);
  TORCH_CHECK(reads, "native_batch_norm_backward: ", train ? "save_mean and save_invstd" : "running_mean and running_var",
              " must be defined when ", train ? "training" : "not training");
  if (queueable_input(input) && queueable_like(input, grad_out) && grad_out.sizes() == input.sizes() &&
      grad_out.suggest_memory_format() == input.suggest_memory_format() && reads && ((!mask[1] && !mask[2]) || w_def)) {
    const auto pdt = batch_norm_params(input, {&weight, &running_mean, &running_var});
    const auto sdt = train ? batch_norm_params(input, {&weight, &save_mean, &save_invstd}) : pdt;
    if (pdt && sdt && *pdt == *sdt) {
      // CPU's template calls its stub, batch_norm_cpu_backward_stub, straight into its results
      // when input and grad_out are dense in one layout ("all_contiguous"), with grad_input dense
      // in the layout input is dense in; so does this kernel, into the device's results. Other
      // layouts take CPU's functional op and a copy of each result.
      const std::optional<at::MemoryFormat> dense = dense_format(input);
      const bool direct = dense.has_value() && dense_format(grad_out).has_value();
      QueuedCall q;
      at::Tensor g = q.in(grad_out), x = q.in(input), gi, gw, gb, gio, gwo, gbo;
      OptTensor w = q.in(weight), rm = q.in(running_mean), rv = q.in(running_var), sm = q.in(save_mean),
                si = q.in(save_invstd);
      if (mask[0]) {
        gio = q.out(gi, input.sizes(), input.scalar_type(),
                    direct ? strides_for(input.sizes(), *dense) : suggested_strides(input));
      }
      if (mask[1]) gwo = q.out(gw, {input.size(1)}, *pdt);
      if (mask[2]) gbo = q.out(gb, {input.size(1)}, *pdt);
      q.enqueue(kBatchNormBwd, [g, x, w, rm, rv, sm, si, gio, gwo, gbo, train, eps, mask, direct]() mutable {
        if (direct) {
          at::Tensor dx = gio, dw = gwo, db = gbo;  // undefined where the mask is false
          auto t = [](const OptTensor& o) { return o.value_or(at::Tensor()); };
          at::native::batch_norm_cpu_backward_stub(c10::kCPU, dx, dw, db, g, x, t(w), t(rm), t(rv), t(sm), t(si),
                                                   train, eps);
          return;
        }
        auto [dx, dw, db] = at::cpu::native_batch_norm_backward(g, x, w, rm, rv, sm, si, train, eps, mask);
        if (mask[0]) copy_result(kBatchNormBwd, gio, dx);
        if (mask[1]) copy_result(kBatchNormBwd, gwo, dw);
        if (mask[2]) copy_result(kBatchNormBwd, gbo, db);
      });
      return {gi, gw, gb};
    }
  }
  return FromStack<Tensor3>::get(via_fallback<kBatchNormBwd>(grad_out, input, weight, running_mean, running_var,
                                                              save_mean, save_invstd, train, eps, mask));
}

// ---- 2-d max pooling ---------------------------------------------------------------------------
// Structured: the meta function raises CPU's argument errors and gives the results' layout.
std::tuple<at::Tensor, at::Tensor> max_pool2d(const at::Tensor& self, at::IntArrayRef kernel_size,
                                              at::IntArrayRef stride, at::IntArrayRef padding,
                                              at::IntArrayRef dilation, bool ceil_mode) {
  if (queueable_input(self)) {
    auto [om, im] = at::meta::max_pool2d_with_indices(meta_like(self), kernel_size, stride, padding, dilation, ceil_mode);
    QueuedCall q;
    at::Tensor x = q.in(self), out, indices;
    at::Tensor o = q.out(out, om.sizes(), om.scalar_type(), om.strides());
    at::Tensor i = q.out(indices, im.sizes(), im.scalar_type(), im.strides());
    q.enqueue(kMaxPool, [x, o, i, k = kernel_size.vec(), s = stride.vec(), p = padding.vec(), d = dilation.vec(),
                         ceil_mode]() mutable { at::cpu::max_pool2d_with_indices_out(o, i, x, k, s, p, d, ceil_mode); });
    return {out, indices};
  }
  return FromStack<std::tuple<at::Tensor, at::Tensor>>::get(
      via_fallback<kMaxPool>(self, kernel_size, stride, padding, dilation, ceil_mode));
}

at::Tensor max_pool2d_backward(const at::Tensor& grad_output, const at::Tensor& self, at::IntArrayRef kernel_size,
                               at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                               bool ceil_mode, const at::Tensor& indices) {
  if (queueable_input(self) && queueable_like(self, grad_output) && queueable_index(self, indices) &&
      indices.scalar_type() == at::kLong) {
    const at::Tensor gm = at::meta::max_pool2d_with_indices_backward(
        meta_like(grad_output), meta_like(self), kernel_size, stride, padding, dilation, ceil_mode, meta_like(indices));
    QueuedCall q;
    at::Tensor g = q.in(grad_output), x = q.in(self), i = q.in(indices), out;
    at::Tensor o = q.out(out, gm.sizes(), gm.scalar_type(), gm.strides());
    q.enqueue(kMaxPoolBwd, [g, x, i, o, k = kernel_size.vec(), s = stride.vec(), p = padding.vec(),
                            d = dilation.vec(), ceil_mode]() mutable {
      at::cpu::max_pool2d_with_indices_backward_out(o, g, x, k, s, p, d, ceil_mode, i);
    });
    return out;
  }
  return FromStack<at::Tensor>::get(
      via_fallback<kMaxPoolBwd>(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices));
}

// ---- 2-d nearest upsampling (a UNet's decoder) -------------------------------------------------
// Structured, like max pooling.
at::Tensor upsample_nearest2d(const at::Tensor& self, c10::SymIntArrayRef output_size, std::optional<double> scales_h,
                              std::optional<double> scales_w) {
  if (queueable_input(self)) {
    const std::vector<int64_t> size = C10_AS_INTARRAYREF_SLOW(output_size).vec();
    const at::Tensor om = at::meta::upsample_nearest2d(meta_like(self), size, scales_h, scales_w);
    QueuedCall q;
    at::Tensor x = q.in(self), out;
    at::Tensor o = q.out(out, om.sizes(), om.scalar_type(), om.strides());
    q.enqueue(kUpsample, [x, o, size, scales_h, scales_w]() mutable {
      at::cpu::upsample_nearest2d_out(o, x, size, scales_h, scales_w);
    });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kUpsample>(self, output_size, scales_h, scales_w));
}

at::Tensor upsample_nearest2d_backward(const at::Tensor& grad_output, c10::SymIntArrayRef output_size,
                                       c10::SymIntArrayRef input_size, std::optional<double> scales_h,
                                       std::optional<double> scales_w) {
  if (queueable_input(grad_output)) {
    const std::vector<int64_t> osize = C10_AS_INTARRAYREF_SLOW(output_size).vec();
    const std::vector<int64_t> isize = C10_AS_INTARRAYREF_SLOW(input_size).vec();
    const at::Tensor gm = at::meta::upsample_nearest2d_backward(meta_like(grad_output), osize, isize, scales_h, scales_w);
    QueuedCall q;
    at::Tensor g = q.in(grad_output), out;
    at::Tensor o = q.out(out, gm.sizes(), gm.scalar_type(), gm.strides());
    q.enqueue(kUpsampleBwd, [g, o, osize, isize, scales_h, scales_w]() mutable {
      at::cpu::upsample_nearest2d_backward_out(o, g, osize, isize, scales_h, scales_w);
    });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kUpsampleBwd>(grad_output, output_size, input_size, scales_h, scales_w));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_batch_norm", TORCH_FN(batch_norm));
  m.impl("native_batch_norm_backward", TORCH_FN(batch_norm_backward));
  m.impl("max_pool2d_with_indices", TORCH_FN(max_pool2d));
  m.impl("max_pool2d_with_indices_backward", TORCH_FN(max_pool2d_backward));
  m.impl("upsample_nearest2d", TORCH_FN(upsample_nearest2d));
  m.impl("upsample_nearest2d_backward", TORCH_FN(upsample_nearest2d_backward));
}

}  // namespace torchneuron
