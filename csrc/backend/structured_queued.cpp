// Ops the execution engine queues with their results laid out by ATen's own shape functions:
// the scan (cumsum), the index reductions (argmax/argmin, max/min over a dim), the triangle
// masks (triu/tril), the infinity tests, the boolean reductions over dims, where (SDPA's
// _safe_softmax under an attention mask) and the vector norms (linalg_vector_norm, _foreach_norm:
// clip_grad_norm_): ops a training step calls on data it does not read back (position ids from
// an attention mask, a causal mask built each step, the gradients' norm, a metric kept on the
// device).
//
// ATen's structured meta function for each (at::meta::*, C++; run on meta tensors of the
// arguments' sizes and strides; for where, which is not structured, TensorIterator on meta
// tensors as CPU's where builds it) raises CPU's argument errors at the call and gives the
// results' sizes, strides and dtype; the kernel is CPU's out= kernel over aliases, so results
// are CPU's bit for bit. Calls that cannot queue (engine off, arguments on other devices, lazy
// conj/neg bits) take the boxed fallback as before.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/all_cpu_dispatch.h>
#include <ATen/ops/all_meta_dispatch.h>
#include <ATen/ops/any_cpu_dispatch.h>
#include <ATen/ops/any_meta_dispatch.h>
#include <ATen/ops/argmax_cpu_dispatch.h>
#include <ATen/ops/argmax_meta_dispatch.h>
#include <ATen/ops/argmin_cpu_dispatch.h>
#include <ATen/ops/argmin_meta_dispatch.h>
#include <ATen/ops/cumsum_cpu_dispatch.h>
#include <ATen/ops/cumsum_meta_dispatch.h>
#include <ATen/ops/isneginf_cpu_dispatch.h>
#include <ATen/ops/isneginf_meta_dispatch.h>
#include <ATen/ops/isposinf_cpu_dispatch.h>
#include <ATen/ops/isposinf_meta_dispatch.h>
#include <ATen/ops/linalg_vector_norm_cpu_dispatch.h>
#include <ATen/ops/linalg_vector_norm_meta_dispatch.h>
#include <ATen/ops/max_cpu_dispatch.h>
#include <ATen/ops/max_meta_dispatch.h>
#include <ATen/ops/min_cpu_dispatch.h>
#include <ATen/ops/min_meta_dispatch.h>
#include <ATen/ops/tril_cpu_dispatch.h>
#include <ATen/ops/tril_meta_dispatch.h>
#include <ATen/ops/triu_cpu_dispatch.h>
#include <ATen/ops/triu_meta_dispatch.h>
#include <ATen/ops/where_cpu_dispatch.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

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

// The queued call of an op with one tensor argument and one result: `meta(meta_self)` is the
// op's meta function, `cpu(out_alias, self_alias)` its CPU out= kernel.
template <class Meta, class Cpu>
at::Tensor enqueue_unary(const char* name, const at::Tensor& self, Meta&& meta, Cpu cpu) {
  const at::Tensor m = meta(meta_like(self));
  QueuedCall q;
  at::Tensor x = q.in(self), out;
  at::Tensor o = out_like(q, out, m);
  q.enqueue(name, [x, o, cpu]() mutable { cpu(o, x); });
  return out;
}

// An optional list of dims a kernel keeps (the caller's list does not outlive the call).
std::optional<std::vector<int64_t>> owned(at::OptionalIntArrayRef dims) {
  if (!dims.has_value()) return std::nullopt;
  return dims->vec();
}
at::OptionalIntArrayRef ref(const std::optional<std::vector<int64_t>>& dims) {
  if (!dims.has_value()) return std::nullopt;
  return at::IntArrayRef(*dims);
}

constexpr char kCumsum[] = "aten::cumsum";
at::Tensor cumsum(const at::Tensor& self, int64_t dim, std::optional<c10::ScalarType> dtype) {
  if (queueable(self)) {
    return enqueue_unary(
        kCumsum, self, [&](const at::Tensor& m) { return at::meta::cumsum(m, dim, dtype); },
        [dim, dtype](at::Tensor& o, const at::Tensor& x) { at::cpu::cumsum_out(o, x, dim, dtype); });
  }
  return FromStack<at::Tensor>::get(via_fallback<kCumsum>(self, dim, dtype));
}

// argmax / argmin
using ArgFn = at::Tensor (*)(const at::Tensor&, std::optional<int64_t>, bool);
using ArgOutFn = at::Tensor& (*)(at::Tensor&, const at::Tensor&, std::optional<int64_t>, bool);
template <const char* Name, ArgFn Meta, ArgOutFn Cpu>
at::Tensor arg_extremum(const at::Tensor& self, std::optional<int64_t> dim, bool keepdim) {
  if (queueable(self)) {
    return enqueue_unary(
        Name, self, [&](const at::Tensor& m) { return Meta(m, dim, keepdim); },
        [dim, keepdim](at::Tensor& o, const at::Tensor& x) { Cpu(o, x, dim, keepdim); });
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
    return enqueue_unary(
        Name, self, [&](const at::Tensor& m) { return Meta(m, diagonal); },
        [diagonal](at::Tensor& o, const at::Tensor& x) { Cpu(o, x, diagonal); });
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self, diagonal));
}
constexpr char kTriu[] = "aten::triu";
constexpr char kTril[] = "aten::tril";

// isneginf / isposinf
using UnaryFn = at::Tensor (*)(const at::Tensor&);
using UnaryOutFn = at::Tensor& (*)(at::Tensor&, const at::Tensor&);
template <const char* Name, UnaryFn Meta, UnaryOutFn Cpu>
at::Tensor unary(const at::Tensor& self) {
  if (queueable(self)) {
    return enqueue_unary(
        Name, self, [](const at::Tensor& m) { return Meta(m); }, [](at::Tensor& o, const at::Tensor& x) { Cpu(o, x); });
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self));
}
constexpr char kIsneginf[] = "aten::isneginf";
constexpr char kIsposinf[] = "aten::isposinf";

// all / any over dims
using BoolFn = at::Tensor (*)(const at::Tensor&, at::OptionalIntArrayRef, bool);
using BoolOutFn = at::Tensor& (*)(at::Tensor&, const at::Tensor&, at::OptionalIntArrayRef, bool);
template <const char* Name, BoolFn Meta, BoolOutFn Cpu>
at::Tensor bool_reduction(const at::Tensor& self, at::OptionalIntArrayRef dim, bool keepdim) {
  if (queueable(self)) {
    return enqueue_unary(
        Name, self, [&](const at::Tensor& m) { return Meta(m, dim, keepdim); },
        [d = owned(dim), keepdim](at::Tensor& o, const at::Tensor& x) { Cpu(o, x, ref(d), keepdim); });
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self, dim, keepdim));
}
constexpr char kAllDims[] = "aten::all.dims";
constexpr char kAnyDims[] = "aten::any.dims";
// all.dim / any.dim: one dim
template <const char* Name, BoolFn Meta, BoolOutFn Cpu>
at::Tensor bool_reduction_dim(const at::Tensor& self, int64_t dim, bool keepdim) {
  if (queueable(self)) {
    const std::vector<int64_t> d{dim};
    return enqueue_unary(
        Name, self, [&](const at::Tensor& m) { return Meta(m, d, keepdim); },
        [d, keepdim](at::Tensor& o, const at::Tensor& x) { Cpu(o, x, d, keepdim); });
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self, dim, keepdim));
}
constexpr char kAllDim[] = "aten::all.dim";
constexpr char kAnyDim[] = "aten::any.dim";

// Vector norms. The kernel is CPU's: its reduction order depends on the thread count, which
// the queue runs with the host's (enqueue.cpp).
constexpr char kVectorNorm[] = "aten::linalg_vector_norm";
at::Tensor vector_norm(const at::Tensor& self, const at::Scalar& ord, at::OptionalIntArrayRef dim, bool keepdim,
                       std::optional<c10::ScalarType> dtype) {
  if (queueable(self)) {
    return enqueue_unary(
        kVectorNorm, self, [&](const at::Tensor& m) { return at::meta::linalg_vector_norm(m, ord, dim, keepdim, dtype); },
        [ord, d = owned(dim), keepdim, dtype](at::Tensor& o, const at::Tensor& x) {
          at::cpu::linalg_vector_norm_out(o, x, ord, ref(d), keepdim, dtype);
        });
  }
  return FromStack<at::Tensor>::get(via_fallback<kVectorNorm>(self, ord, dim, keepdim, dtype));
}

// _foreach_norm: CPU's is a norm of each tensor (foreach_tensor_norm_slow); one queued kernel
// computes them all, each with CPU's kernel.
constexpr char kForeachNorm[] = "aten::_foreach_norm.Scalar";
std::vector<at::Tensor> foreach_norm(at::TensorList tensors, const at::Scalar& ord, std::optional<c10::ScalarType> dtype) {
  bool queue = may_enqueue() && !tensors.empty();
  for (const at::Tensor& t : tensors) queue = queue && queueable_like(tensors[0], t);
  if (queue) {
    std::vector<at::Tensor> metas;
    metas.reserve(tensors.size());
    for (const at::Tensor& t : tensors) metas.push_back(at::meta::linalg_vector_norm(meta_like(t), ord, std::nullopt, false, dtype));
    QueuedCall q;
    std::vector<at::Tensor> xs, os, results(tensors.size());
    for (size_t k = 0; k < tensors.size(); ++k) {
      xs.push_back(q.in(tensors[k]));
      os.push_back(out_like(q, results[k], metas[k]));
    }
    q.enqueue(kForeachNorm, [xs, os, ord, dtype]() mutable {
      for (size_t k = 0; k < xs.size(); ++k) at::cpu::linalg_vector_norm_out(os[k], xs[k], ord, std::nullopt, false, dtype);
    });
    return results;
  }
  return FromStack<std::vector<at::Tensor>>::get(via_fallback<kForeachNorm>(tensors, ord, dtype));
}

// where(condition, self, other): a bool condition and values that are neuron tensors or 0-dim
// CPU tensors (Python numbers; _safe_softmax's zero), broadcast together (enqueue.h,
// queueable_value).
bool is_cpu_scalar(const at::Tensor& t) { return t.is_cpu() && t.dim() == 0; }

// The result's layout (a meta tensor) if where(condition, self, other) may queue, else nullopt.
// CPU's where casts a tensor value of another dtype first (.to(), which may change its layout):
// such calls stay synchronous. The iterator's layout depends on the operands' sizes and strides
// only, so the meta operands share one dtype (TensorIterator requires that).
std::optional<at::Tensor> where_layout(const at::Tensor& condition, const at::Tensor& self, const at::Tensor& other) {
  if (!may_enqueue() || condition.scalar_type() != at::kBool || !queueable_like(condition, condition) ||
      !queueable_value(condition, self) || !queueable_value(condition, other)) {
    return std::nullopt;
  }
  const c10::ScalarType dtype = at::result_type(self, other);
  if (!(is_cpu_scalar(self) || self.scalar_type() == dtype) || !(is_cpu_scalar(other) || other.scalar_type() == dtype)) {
    return std::nullopt;
  }
  const auto meta = [dtype](const at::Tensor& t) {
    return at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta).dtype(dtype));
  };
  at::TensorIteratorConfig config;  // raises CPU's broadcast error at the call
  config.add_owned_output(at::Tensor())
      .add_owned_const_input(meta(condition))
      .add_owned_const_input(meta(self))
      .add_owned_const_input(meta(other));
  return config.build().output(0);
}

constexpr char kWhere[] = "aten::where.self";
at::Tensor where(const at::Tensor& condition, const at::Tensor& self, const at::Tensor& other) {
  if (const auto m = where_layout(condition, self, other)) {
    QueuedCall q;
    at::Tensor c = q.in(condition), a = queued_value(q, self), b = queued_value(q, other);
    at::Tensor out, o = q.out(out, m->sizes(), m->scalar_type(), m->strides());
    q.enqueue(kWhere, [c, a, b, o]() mutable { at::cpu::where_out(o, c, a, b); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kWhere>(condition, self, other));
}

// where.self_out, as _safe_softmax calls it (into its softmax result): queued when out already
// has the result's shape and dtype (no resize) and does not overlap itself or partially
// overlap an input (CPU raises for those).
constexpr char kWhereOut[] = "aten::where.self_out";
at::Tensor& where_out(const at::Tensor& condition, const at::Tensor& self, const at::Tensor& other, at::Tensor& out) {
  const auto m = where_layout(condition, self, other);
  if (m && out.is_privateuseone() && out.device() == condition.device() &&
      out.layout() == c10::kStrided && !out.is_conj() && !out.is_neg() && out.scalar_type() == m->scalar_type() &&
      out.sizes() == m->sizes() && at::has_internal_overlap(out) != at::MemOverlap::Yes &&
      !partially_overlap(out, condition) && !partially_overlap(out, self) && !partially_overlap(out, other)) {
    QueuedCall q;
    at::Tensor c = q.in(condition), a = queued_value(q, self), b = queued_value(q, other), o = q.inout(out);
    q.enqueue(kWhereOut, [c, a, b, o]() mutable { at::cpu::where_out(o, c, a, b); });
    return out;
  }
  via_fallback<kWhereOut>(condition, self, other, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("where.self", TORCH_FN(where));
  m.impl("where.self_out", TORCH_FN(where_out));
  m.impl("isneginf", TORCH_FN((unary<kIsneginf, &at::meta::isneginf, &at::cpu::isneginf_out>)));
  m.impl("isposinf", TORCH_FN((unary<kIsposinf, &at::meta::isposinf, &at::cpu::isposinf_out>)));
  m.impl("all.dims", TORCH_FN((bool_reduction<kAllDims, &at::meta::all, &at::cpu::all_out>)));
  m.impl("any.dims", TORCH_FN((bool_reduction<kAnyDims, &at::meta::any, &at::cpu::any_out>)));
  m.impl("all.dim", TORCH_FN((bool_reduction_dim<kAllDim, &at::meta::all, &at::cpu::all_out>)));
  m.impl("any.dim", TORCH_FN((bool_reduction_dim<kAnyDim, &at::meta::any, &at::cpu::any_out>)));
  m.impl("linalg_vector_norm", TORCH_FN(vector_norm));
  m.impl("_foreach_norm.Scalar", TORCH_FN(foreach_norm));
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
