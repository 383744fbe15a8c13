// Ops the execution engine queues with their results laid out by ATen's own shape functions:
// the scan (cumsum), the index reductions (argmax/argmin, max/min over a dim), the triangle
// masks (triu/tril), the infinity tests, the boolean reductions over dims, where (SDPA's
// _safe_softmax under an attention mask) and the vector norms (linalg_vector_norm, _foreach_norm:
// clip_grad_norm_), and the indexing a mixture-of-experts layer routes tokens with (topk, sort,
// gather, scatter, x[idx], index_put_, floor_divide, _grouped_mm): ops a training step calls on data it does
// not read back (position ids from an attention mask, a causal mask built each step, the
// gradients' norm, a metric kept on the device, the experts each token goes to).
//
// ATen's structured meta function for each (at::meta::*, C++; run on meta tensors of the
// arguments' sizes and strides; for where, which is not structured, TensorIterator on meta
// tensors as CPU's where builds it) raises CPU's argument errors at the call and gives the
// results' sizes, strides and dtype; the kernel is CPU's out= kernel over aliases, so results
// are CPU's bit for bit. Calls that cannot queue (engine off, arguments on other devices, lazy
// conj/neg bits) take the boxed fallback as before.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/ExpandUtils.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/GroupedMMUtils.h>
#include <ATen/ops/_grouped_mm_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/_index_put_impl_cpu_dispatch.h>
#include <ATen/ops/abs_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/abs_cpu_dispatch.h>
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
#include <ATen/ops/floor_divide_cpu_dispatch.h>
#include <ATen/ops/gather_cpu_dispatch.h>
#include <ATen/ops/gather_meta_dispatch.h>
#include <ATen/ops/index_cpu_dispatch.h>
#include <ATen/ops/index_meta_dispatch.h>
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
#include <ATen/ops/scatter_add_cpu_dispatch.h>
#include <ATen/ops/scatter_add_meta_dispatch.h>
#include <ATen/ops/scatter_cpu_dispatch.h>
#include <ATen/ops/scatter_meta_dispatch.h>
#include <ATen/ops/sort_cpu_dispatch.h>
#include <ATen/ops/sort_meta_dispatch.h>
#include <ATen/ops/topk_cpu_dispatch.h>
#include <ATen/ops/topk_meta_dispatch.h>
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
#include "fusion.h"
#include "fallback.h"
#include "gemm.h"
#include "sync_debug.h"
#include "zero_copy.h"

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
at::Tensor enqueue_unary(const char* name, const at::Tensor& self, Meta&& meta, Cpu cpu,
                         neuron::rt::engine::Record (*record)(const at::Tensor&, const at::Tensor&) = nullptr) {
  const at::Tensor m = meta(meta_like(self));
  QueuedCall q;
  at::Tensor x = q.in(self), out;
  at::Tensor o = out_like(q, out, m);
  q.enqueue(name, [x, o, cpu]() mutable { cpu(o, x); }, record != nullptr ? record(out, self) : nullptr);
  return out;
}

// The queued call of an op with one tensor argument and two results (values and indices):
// `m` is the meta results, `cpu(values_alias, indices_alias, self_alias)` the CPU out= kernel.
template <class Cpu>
Pair enqueue_pair(const char* name, const at::Tensor& self, const Pair& m, Cpu cpu) {
  QueuedCall q;
  at::Tensor x = q.in(self), values, indices;
  at::Tensor v = out_like(q, values, std::get<0>(m)), i = out_like(q, indices, std::get<1>(m));
  q.enqueue(name, [x, v, i, cpu]() mutable { cpu(v, i, x); });
  return {values, indices};
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
    return enqueue_pair(Name, self, Meta(meta_like(self), dim, keepdim),
                        [dim, keepdim](at::Tensor& v, at::Tensor& i, const at::Tensor& x) { Cpu(v, i, x, dim, keepdim); });
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

// topk / sort (a router's choice of experts, and the tokens grouped by expert)
constexpr char kTopk[] = "aten::topk";
Pair topk(const at::Tensor& self, int64_t k, int64_t dim, bool largest, bool sorted) {
  if (queueable(self)) {
    return enqueue_pair(kTopk, self, at::meta::topk(meta_like(self), k, dim, largest, sorted),
                        [k, dim, largest, sorted](at::Tensor& v, at::Tensor& i, const at::Tensor& x) {
                          at::cpu::topk_out(v, i, x, k, dim, largest, sorted);
                        });
  }
  return FromStack<Pair>::get(via_fallback<kTopk>(self, k, dim, largest, sorted));
}

constexpr char kSort[] = "aten::sort.stable";
Pair sort(const at::Tensor& self, std::optional<bool> stable, int64_t dim, bool descending) {
  if (queueable(self)) {
    return enqueue_pair(kSort, self, at::meta::sort(meta_like(self), stable, dim, descending),
                        [stable, dim, descending](at::Tensor& v, at::Tensor& i, const at::Tensor& x) {
                          at::cpu::sort_out(v, i, x, stable, dim, descending);
                        });
  }
  return FromStack<Pair>::get(via_fallback<kSort>(self, stable, dim, descending));
}

// gather / scatter: int64 or int32 indices on self's device. An index out of range is found by
// the kernel and reported at the next synchronization (as on CUDA, where the kernel asserts).
bool queueable_with_index(const at::Tensor& self, const at::Tensor& index) {
  return queueable(self) && queueable_index(self, index);
}

constexpr char kGather[] = "aten::gather";
at::Tensor gather(const at::Tensor& self, int64_t dim, const at::Tensor& index, bool sparse_grad) {
  if (queueable_with_index(self, index)) {
    const at::Tensor m = at::meta::gather(meta_like(self), dim, meta_like(index), sparse_grad);
    QueuedCall q;
    at::Tensor x = q.in(self), i = q.in(index), out;
    at::Tensor o = out_like(q, out, m);
    q.enqueue(kGather, [x, i, o, dim, sparse_grad]() mutable { at::cpu::gather_out(o, x, dim, i, sparse_grad); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kGather>(self, dim, index, sparse_grad));
}

// scatter.src, scatter.value, scatter_add (functional) and their in-place forms. `Src` is the
// source tensor or number. In place, a self overlapping the index (CPU's kernel raises) or the
// source (whose values would depend on the order the kernel writes) runs synchronously; the meta
// function raises for a self overlapping itself.
template <class Src> bool queueable_src(const at::Tensor& self, const Src& src) {
  if constexpr (std::is_same_v<Src, at::Tensor>) return queueable_like(self, src);
  else return number_fits(self.scalar_type(), src);
}
template <class Src> Src queued_src(QueuedCall& q, const Src& src) {
  if constexpr (std::is_same_v<Src, at::Tensor>) return q.in(src);
  else return src;
}
bool writable_without_overlap(const at::Tensor& self, const at::Tensor& other) { return disjoint_memory(self, other); }
template <class Src> bool in_place_fits(const at::Tensor& self, const at::Tensor& index, const Src& src) {
  if (!writable_without_overlap(self, index)) return false;
  if constexpr (std::is_same_v<Src, at::Tensor>) return writable_without_overlap(self, src);
  else return true;
}

template <const char* Name, class Src, at::Tensor (*Meta)(const at::Tensor&, int64_t, const at::Tensor&, const Src&),
          at::Tensor& (*Cpu)(at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const Src&)>
at::Tensor scatter(const at::Tensor& self, int64_t dim, const at::Tensor& index, const Src& src) {
  if (queueable_with_index(self, index) && queueable_src(self, src)) {
    const at::Tensor m = [&] {
      if constexpr (std::is_same_v<Src, at::Tensor>) return Meta(meta_like(self), dim, meta_like(index), meta_like(src));
      else return Meta(meta_like(self), dim, meta_like(index), src);
    }();
    QueuedCall q;
    at::Tensor x = q.in(self), i = q.in(index), out;
    Src v = queued_src(q, src);
    at::Tensor o = out_like(q, out, m);
    q.enqueue(Name, [x, i, v, o, dim]() mutable { Cpu(o, x, dim, i, v); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<Name>(self, dim, index, src));
}

template <const char* Name, class Src, at::Tensor& (*Meta)(at::Tensor&, int64_t, const at::Tensor&, const Src&),
          at::Tensor& (*Cpu)(at::Tensor&, int64_t, const at::Tensor&, const Src&)>
at::Tensor& scatter_(at::Tensor& self, int64_t dim, const at::Tensor& index, const Src& src) {
  if (queueable_with_index(self, index) && queueable_src(self, src) && in_place_fits(self, index, src)) {
    at::Tensor m = meta_like(self);
    if constexpr (std::is_same_v<Src, at::Tensor>) Meta(m, dim, meta_like(index), meta_like(src));
    else Meta(m, dim, meta_like(index), src);
    QueuedCall q;
    at::Tensor s = q.inout(self), i = q.in(index);
    Src v = queued_src(q, src);
    q.enqueue(Name, [s, i, v, dim]() mutable { Cpu(s, dim, i, v); });
    return self;
  }
  via_fallback<Name>(self, dim, index, src);
  return self;
}
constexpr char kScatterSrc[] = "aten::scatter.src";
constexpr char kScatterValue[] = "aten::scatter.value";
constexpr char kScatterAdd[] = "aten::scatter_add";
constexpr char kScatterSrc_[] = "aten::scatter_.src";
constexpr char kScatterValue_[] = "aten::scatter_.value";
constexpr char kScatterAdd_[] = "aten::scatter_add_";

// x[idx] with integer index tensors (the tokens an expert takes): the result's layout is the
// structured index's. Boolean masks (data-dependent shapes) and index tensors on the CPU (whose
// bytes could change before the kernel reads them) take the synchronous path.
using Indices = c10::List<std::optional<at::Tensor>>;
bool queueable_indices(const at::Tensor& self, const Indices& indices) {
  bool any = false;
  for (size_t k = 0; k < indices.size(); ++k) {
    const std::optional<at::Tensor> t = indices.get(k);
    if (!t.has_value() || !t->defined()) continue;
    if (!queueable_index(self, *t)) return false;
    any = true;
  }
  return any && queueable(self);
}
Indices meta_indices(const Indices& indices) {
  Indices m;
  m.reserve(indices.size());
  for (size_t k = 0; k < indices.size(); ++k) m.push_back(meta_like(indices.get(k)));
  return m;
}
Indices queued_indices(QueuedCall& q, const Indices& indices) {
  Indices a;
  a.reserve(indices.size());
  for (size_t k = 0; k < indices.size(); ++k) a.push_back(q.in(indices.get(k)));
  return a;
}

constexpr char kIndex[] = "aten::index.Tensor";
at::Tensor index(const at::Tensor& self, const Indices& indices) {
  if (queueable_indices(self, indices)) {
    const at::Tensor m = at::meta::index(meta_like(self), meta_indices(indices));
    QueuedCall q;
    at::Tensor x = q.in(self), out;
    Indices idx = queued_indices(q, indices);
    at::Tensor o = out_like(q, out, m);
    q.enqueue(kIndex, [x, idx, o]() mutable { at::cpu::index_out(o, x, idx); });
    return out;
  }
  // Index tensors may live on the CPU, as on CUDA.
  ZeroCopy zc;
  at::Tensor s = zc.in(self);
  Indices idx;
  idx.reserve(indices.size());
  bool mask = false;  // x[mask]: the result's shape is the mask's count of true elements
  for (size_t k = 0; k < indices.size(); ++k) {
    const std::optional<at::Tensor> t = indices.get(k);
    if (t.has_value() && t->defined()) {
      mask = mask || sync_debug::is_mask(*t);
      idx.push_back(zc.in(*t, /*allow_cpu=*/true));
    } else {
      idx.push_back(std::nullopt);
    }
  }
  if (mask) sync_debug::on_sync("aten::index.Tensor with a boolean mask (x[mask])");
  zc.launch(kIndex);
  return zc.out(at::cpu::index(s, idx));
}

// index_put_ / x[idx] = v (index_put_'s composite calls this): in place, values of self's dtype
// that broadcast to the indexed shape, no overlap between self and the values or indices (CPU
// raises for each; those calls run synchronously and raise at the call).
constexpr char kIndexPut[] = "aten::_index_put_impl_";
at::Tensor& index_put_impl_(at::Tensor& self, const Indices& indices, const at::Tensor& values, bool accumulate,
                            bool unsafe) {
  bool fits = queueable_indices(self, indices) && queueable_like(self, values) &&
              at::has_internal_overlap(self) != at::MemOverlap::Yes && writable_without_overlap(self, values);
  for (size_t k = 0; fits && k < indices.size(); ++k) {
    const std::optional<at::Tensor> t = indices.get(k);
    fits = !t.has_value() || !t->defined() || writable_without_overlap(self, *t);
  }
  if (fits) {
    try {  // the indexed shape: index's own errors (too many indices, shapes) raise at the call
      fits = at::is_expandable_to(values.sizes(), at::meta::index(meta_like(self), meta_indices(indices)).sizes());
    } catch (const c10::Error&) {
      fits = false;  // the synchronous path raises CPU's error
    }
  }
  if (fits) {
    QueuedCall q;
    at::Tensor s = q.inout(self), v = q.in(values);
    Indices idx = queued_indices(q, indices);
    q.enqueue(kIndexPut, [s, idx, v, accumulate, unsafe]() mutable {
      at::cpu::_index_put_impl_(s, idx, v, accumulate, unsafe);
    });
    return self;
  }
  via_fallback<kIndexPut>(self, indices, values, accumulate, unsafe);
  return self;
}

// floor_divide (`ids // k`: the token each routed slot came from): CPU's binary-op iterator
// (promoted dtype, broadcast shape, the operands' layout) worked out on meta operands. An integer
// division by zero is found by the kernel and reported at the next synchronization.
constexpr char kFloorDivide[] = "aten::floor_divide";
at::Tensor floor_divide(const at::Tensor& self, const at::Tensor& other) {
  if (queueable(self) && queueable_value(self, other)) {
    const auto meta = [](const at::Tensor& t) { return t.is_cpu() ? t : meta_like(t); };
    at::TensorIteratorConfig config;  // build_borrowing_binary_op's: raises CPU's errors at the call
    config.set_check_mem_overlap(true)
        .allow_cpu_scalars(true)
        .promote_inputs_to_common_dtype(true)
        .cast_common_dtype_to_outputs(true)
        .enforce_safe_casting_to_output(true)
        .add_owned_output(at::Tensor())
        .add_owned_const_input(meta(self))
        .add_owned_const_input(meta(other));
    const at::Tensor m = config.build().output(0);
    QueuedCall q;
    at::Tensor a = q.in(self), b = queued_value(q, other), out;
    at::Tensor o = out_like(q, out, m);
    q.enqueue(kFloorDivide, [a, b, o]() mutable { at::cpu::floor_divide_out(o, a, b); });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kFloorDivide>(self, other));
}

// abs of a real tensor (T5's relative-position buckets over int64): ATen's composite allocates
// an empty result for abs.out to resize, which the fallback cannot queue. The result keeps the
// dtype, laid out by CPU's unary iterator. Bool and complex inputs take the composite (bool:
// bool_ops.cpp; complex: a real result).
constexpr char kAbs[] = "aten::abs";
at::Tensor abs(const at::Tensor& self) {
  const c10::ScalarType dtype = self.scalar_type();
  if (queueable(self) && dtype != at::kBool && !c10::isComplexType(dtype) && self.numel() > 0) {
    return enqueue_unary(
        kAbs, self,
        [](const at::Tensor& m) {
          at::TensorIteratorConfig config;
          config.add_owned_output(at::Tensor()).add_owned_const_input(m);
          return config.build().output(0);
        },
        [](at::Tensor& o, const at::Tensor& x) { at::cpu::abs_out(o, x); },
        [](const at::Tensor& out, const at::Tensor& x) {  // Adaptive Eager: max(abs(x)), a scale's amax
          return fusion::tiles_enabled() ? fusion::abs(out, x) : nullptr;
        });
  }
  return at::compositeexplicitautograd::abs(self);
}

// _grouped_mm (mixture-of-experts GEMMs, one per expert's token group): ATen's composite reads
// the group offsets on the host (offs.cpu()) before its per-group GEMMs. Queued, the same
// composite runs later over the aliases, so the offsets are read when the kernel runs. Layout
// and argument checks are the composite's own (GroupedMMUtils.h). Dtypes whose GEMMs leave CPU's
// kernel (gemm.h, product_routed) keep the composite, whose per-group mm calls take that route.
constexpr char kGroupedMm[] = "aten::_grouped_mm";
at::Tensor grouped_mm(const at::Tensor& self, const at::Tensor& mat2, const std::optional<at::Tensor>& offs,
                      const std::optional<at::Tensor>& bias, std::optional<c10::ScalarType> out_dtype) {
  if (queueable(self) && queueable_like(self, mat2) && !gemm::product_routed(self) && !bias.has_value() &&
      (!offs.has_value() || queueable_index(self, *offs))) {
    at::native::_grouped_mm_validate_inputs(self, mat2, offs, bias, out_dtype);
    const c10::ScalarType dtype = at::native::_resolve_grouped_mm_out_dtype(self, mat2, out_dtype);
    const at::Tensor m =
        at::native::create_grouped_gemm_output_tensor(meta_like(self), meta_like(mat2), meta_like(offs), dtype);
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), out;
    std::optional<at::Tensor> o_offs = q.in(offs);
    at::Tensor o = out_like(q, out, m);
    q.enqueue(kGroupedMm, [a, b, o_offs, o, dtype]() mutable {
      at::native::_grouped_mm_fallback(a, b, o_offs, std::nullopt, dtype, o);
    });
    return out;
  }
  return at::compositeexplicitautograd::_grouped_mm(self, mat2, offs, bias, out_dtype);
}

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
  m.impl("topk", TORCH_FN(topk));
  m.impl("sort.stable", TORCH_FN(sort));
  m.impl("gather", TORCH_FN(gather));
  m.impl("scatter.src", TORCH_FN((scatter<kScatterSrc, at::Tensor, &at::meta::scatter, &at::cpu::scatter_out>)));
  m.impl("scatter.value", TORCH_FN((scatter<kScatterValue, at::Scalar, &at::meta::scatter, &at::cpu::scatter_out>)));
  m.impl("scatter_add", TORCH_FN((scatter<kScatterAdd, at::Tensor, &at::meta::scatter_add, &at::cpu::scatter_add_out>)));
  m.impl("scatter_.src", TORCH_FN((scatter_<kScatterSrc_, at::Tensor, &at::meta::scatter_, &at::cpu::scatter_>)));
  m.impl("scatter_.value", TORCH_FN((scatter_<kScatterValue_, at::Scalar, &at::meta::scatter_, &at::cpu::scatter_>)));
  m.impl("scatter_add_", TORCH_FN((scatter_<kScatterAdd_, at::Tensor, &at::meta::scatter_add_, &at::cpu::scatter_add_>)));
  m.impl("index.Tensor", TORCH_FN(index));
  m.impl("_index_put_impl_", TORCH_FN(index_put_impl_));
  m.impl("_grouped_mm", TORCH_FN(grouped_mm));
  m.impl("floor_divide", TORCH_FN(floor_divide));
  m.impl("abs", TORCH_FN(abs));
  m.impl("tril", TORCH_FN((triangle<kTril, &at::meta::tril, &at::cpu::tril_out>)));
}

}  // namespace structured_queued
}  // namespace torchneuron
