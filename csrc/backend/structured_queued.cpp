// Structured ops the execution engine queues from their meta functions: the scan (cumsum), the
// index reductions (argmax/argmin, max/min over a dim) and the triangle masks (triu/tril), ops a
// training step calls on data it does not read back (position ids from an attention mask, a
// causal mask built each step, a metric kept on the device).
//
// ATen's structured meta function for each (at::meta::*, C++; run on meta tensors of the
// arguments' sizes and strides) raises CPU's argument errors at the call and gives the results'
// sizes, strides and dtype; the kernel is CPU's out= kernel over aliases, so results are CPU's bit
// for bit. Calls that cannot queue (engine off, arguments on other devices, lazy conj/neg bits)
// take the boxed fallback as before.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/argmax_cpu_dispatch.h>
#include <ATen/ops/argmax_meta_dispatch.h>
#include <ATen/ops/argmin_cpu_dispatch.h>
#include <ATen/ops/argmin_meta_dispatch.h>
#include <ATen/ops/cumsum_cpu_dispatch.h>
#include <ATen/ops/cumsum_meta_dispatch.h>
#include <ATen/ops/max_cpu_dispatch.h>
#include <ATen/ops/max_meta_dispatch.h>
#include <ATen/ops/min_cpu_dispatch.h>
#include <ATen/ops/min_meta_dispatch.h>
#include <ATen/ops/tril_cpu_dispatch.h>
#include <ATen/ops/tril_meta_dispatch.h>
#include <ATen/ops/triu_cpu_dispatch.h>
#include <ATen/ops/triu_meta_dispatch.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "enqueue.h"
#include "fallback.h"

namespace torchneuron {
namespace structured_queued {
namespace {

using Pair = std::tuple<at::Tensor, at::Tensor>;

bool queueable(const at::Tensor& self) { return may_enqueue() && queueable_like(self, self); }

// One result allocated as the meta result `m` describes it; returns the kernel's alias.
at::Tensor out_like(QueuedCall& q, at::Tensor& result, const at::Tensor& m) {
  return q.out(result, m.sizes(), m.scalar_type(), m.strides());
}

constexpr char kCumsum[] = "aten::cumsum";
at::Tensor cumsum(const at::Tensor& self, int64_t dim, std::optional<c10::ScalarType> dtype) {
  if (queueable(self)) {
    const at::Tensor m = at::meta::cumsum(meta_like(self), dim, dtype);
    QueuedCall q;
    at::Tensor x = q.in(self), out;
    at::Tensor o = out_like(q, out, m);
    q.enqueue(kCumsum, [x, o, dim, dtype]() mutable { at::cpu::cumsum_out(o, x, dim, dtype); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kCumsum>(self, dim, dtype));
}

// argmax / argmin
using ArgFn = at::Tensor (*)(const at::Tensor&, std::optional<int64_t>, bool);
using ArgOutFn = at::Tensor& (*)(at::Tensor&, const at::Tensor&, std::optional<int64_t>, bool);
template <const char* Name, ArgFn Meta, ArgOutFn Cpu>
at::Tensor arg_extremum(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim) {
  if (queueable(self)) {
    const at::Tensor m = Meta(meta_like(self), dim, keepdim);
    QueuedCall q;
    at::Tensor x = q.in(self), out;
    at::Tensor o = out_like(q, out, m);
    q.enqueue(Name, [x, o, dim, keepdim]() mutable { Cpu(o, x, dim, keepdim); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self, dim, keepdim));
}
constexpr char kArgmax[] = "aten::argmax";
constexpr char kArgmin[] = "aten::argmin";

// max.dim / min.dim: values and indices
using DimFn = Pair (*)(const at::Tensor&, int64_t, bool);
using DimOutFn = std::tuple<at::Tensor&, at::Tensor&> (*)(at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, bool);
template <const char* Name, DimFn Meta, DimOutFn Cpu>
Pair dim_extremum(const at::Tensor& self, int64_t dim, bool keepdim) {
  if (queueable(self)) {
    const auto [mv, mi] = Meta(meta_like(self), dim, keepdim);
    QueuedCall q;
    at::Tensor x = q.in(self), values, indices;
    at::Tensor v = out_like(q, values, mv), i = out_like(q, indices, mi);
    q.enqueue(Name, [x, v, i, dim, keepdim]() mutable { Cpu(v, i, x, dim, keepdim); });
    return {values, indices};
  }
  return FromStack<Pair>::get(via_fallback<Name>(self, dim, keepdim));
}
constexpr char kMaxDim[] = "aten::max.dim";
constexpr char kMinDim[] = "aten::min.dim";

// triu / tril
using TriFn = at::Tensor (*)(const at::Tensor&, int64_t);
using TriOutFn = at::Tensor& (*)(at::Tensor&, const at::Tensor&, int64_t);
template <const char* Name, TriFn Meta, TriOutFn Cpu>
at::Tensor triangle(const at::Tensor& self, int64_t diagonal) {
  if (queueable(self)) {
    const at::Tensor m = Meta(meta_like(self), diagonal);
    QueuedCall q;
    at::Tensor x = q.in(self), out;
    at::Tensor o = out_like(q, out, m);
    q.enqueue(Name, [x, o, diagonal]() mutable { Cpu(o, x, diagonal); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self, diagonal));
}
constexpr char kTriu[] = "aten::triu";
constexpr char kTril[] = "aten::tril";

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("cumsum", TORCH_FN(cumsum));
  m.impl("argmax", TORCH_FN((arg_extremum<kArgmax, &at::meta::argmax, &at::cpu::argmax_out>)));
  m.impl("argmin", TORCH_FN((arg_extremum<kArgmin, &at::meta::argmin, &at::cpu::argmin_out>)));
  m.impl("max.dim", TORCH_FN((dim_extremum<kMaxDim, &at::meta::max, &at::cpu::max_out>)));
  m.impl("min.dim", TORCH_FN((dim_extremum<kMinDim, &at::meta::min, &at::cpu::min_out>)));
  m.impl("triu", TORCH_FN((triangle<kTriu, &at::meta::triu, &at::cpu::triu_out>)));
  m.impl("tril", TORCH_FN((triangle<kTril, &at::meta::tril, &at::cpu::tril_out>)));
}

}  // namespace structured_queued
}  // namespace torchneuron
