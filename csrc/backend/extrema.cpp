#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Whole-tensor max/min/amax/amin of a permuted dense tensor (a transpose, a permute) over its
// memory in address order.
//
// CPU's reduction walks such a tensor in its logical order, striding through memory: 1.2 ms for
// the max of a transposed 1024 x 2048 bf16 tensor against 0.08 ms contiguous. torchao's float8
// training takes `max(abs(x))` of transposed tensors for every cast scale. An extremum does not
// depend on the order it is taken in, with two exceptions the kernel leaves to CPU's own walk:
// a zero result (+0 and -0 compare equal, which one comes first decides its sign) and NaN (which
// payload). Any other result has exactly one bit pattern, so it is CPU's bit for bit.
//
// With the execution engine on (or a graph capturing) they are queued when CPU's kernel can
// raise nothing: no complex dtype, every reduced dim named once and non-empty. FP8 layers take
// their dynamic scales this way (`x.abs().amax(dim=-1)`, `x.abs().max()`), and a decode graph
// captures them.
#include <ATen/core/Tensor.h>
#include <ATen/native/ReduceOpsUtils.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/ops/amax_cpu_dispatch.h>
#include <ATen/ops/amin_cpu_dispatch.h>
#include <ATen/ops/as_strided.h>
#include <ATen/ops/max_cpu_dispatch.h>
#include <ATen/ops/min_cpu_dispatch.h>
#include <ATen/ops/view.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "enqueue.h"
#include "extrema.h"
#include "fusion.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

// A permutation of a dense block (not already in order), large enough for the order to matter.
bool permuted_dense(const at::Tensor& t) {
  return t.dim() >= 2 && t.numel() >= 4096 && !t.is_complex() && !t.is_contiguous() &&
         t.is_non_overlapping_and_dense();
}

// `reduce` of the CPU alias `s` over all its elements (0-dim result).
template <class Reduce>
at::Tensor whole(const at::Tensor& s, Reduce reduce) {
  if (!permuted_dense(s)) return reduce(s);
  // Non-overlapping and dense: the elements fill numel slots from the lowest address, the
  // storage offset (strides are never negative).
  at::Tensor r = reduce(s.as_strided({s.numel()}, {1}, s.storage_offset()));
  if (c10::isFloatingType(s.scalar_type())) {
    const double v = r.item<double>();
    if (v == 0 || std::isnan(v)) r = reduce(s);  // which zero, which NaN: CPU's walk decides
  }
  return r;
}

constexpr char kMax[] = "aten::max";
constexpr char kMin[] = "aten::min";
constexpr char kAmax[] = "aten::amax";
constexpr char kAmin[] = "aten::amin";

// Whether `self` reduced over `dim` (every dim when empty) may be queued: see the top.
// make_dim_mask raises CPU's errors for a dim out of range or repeated, at the call.
bool queueable_extremum(const at::Tensor& self, at::IntArrayRef dim) {
  if (!may_enqueue() || !queueable_like(self, self) || self.is_complex()) return false;
  const auto mask = at::native::make_dim_mask(dim, self.dim());
  for (int64_t d = 0; d < self.dim(); ++d) {
    if (mask[d] && self.size(d) == 0) return false;  // the synchronous path raises CPU's error
  }
  return self.numel() > 0 || !dim.empty();
}

template <const char* Name, at::Tensor (*F)(const at::Tensor&)>
at::Tensor extremum(const at::Tensor& self) {
  if (queueable_extremum(self, {})) {
    QueuedCall q;
    at::Tensor a = q.in(self), out;
    at::Tensor o = q.out(out, {}, self.scalar_type());
    q.enqueue(Name, [a, o]() mutable { o.copy_(whole(a, F)); },
              Name == kMax && fusion::tiles_enabled() ? fusion::max_all(out, self) : nullptr);
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self);
  zc.launch(Name);
  return zc.out(whole(s, F));
}

// amax/amin over every dim (an empty list, or each dim once) is the whole-tensor reduction. A
// repeated dim is left to CPU's kernel, which raises on it.
bool all_dims(const at::Tensor& t, at::IntArrayRef dim) {
  if (dim.empty()) return true;
  if (static_cast<int64_t>(dim.size()) != t.dim()) return false;
  std::vector<bool> seen(static_cast<size_t>(t.dim()), false);
  for (int64_t d : dim) {
    const auto i = static_cast<size_t>(at::maybe_wrap_dim(d, t.dim()));
    if (seen[i]) return false;
    seen[i] = true;
  }
  return true;
}

template <const char* Name, at::Tensor (*F)(const at::Tensor&, at::IntArrayRef, bool),
          at::Tensor& (*Out)(at::Tensor&, const at::Tensor&, at::IntArrayRef, bool)>
at::Tensor extremum_dims(const at::Tensor& self, at::IntArrayRef dim, bool keepdim) {
  if (queueable_extremum(self, dim)) {
    const auto shape =
        at::native::shape_from_dim_mask(self, at::native::make_dim_mask(dim, self.dim()), keepdim);
    QueuedCall q;
    at::Tensor a = q.in(self), out;
    at::Tensor o = q.out(out, shape, self.scalar_type());
    q.enqueue(Name, [a, o, dims = dim.vec(), keepdim]() mutable {
      if (permuted_dense(a) && all_dims(a, dims)) o.copy_(whole(a, [](const at::Tensor& x) { return F(x, {}, false); }).view(o.sizes()));
      else Out(o, a, dims, keepdim);
    });
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self);
  zc.launch(Name);
  if (!permuted_dense(s) || !all_dims(s, dim)) return zc.out(F(s, dim, keepdim));
  at::Tensor r = whole(s, [](const at::Tensor& x) { return F(x, {}, false); });
  if (keepdim) r = r.view(c10::SmallVector<int64_t, 6>(static_cast<size_t>(s.dim()), 1));
  return zc.out(r);
}

}  // namespace

at::Tensor extrema::max_all(const at::Tensor& t) {
  return whole(t, static_cast<at::Tensor (*)(const at::Tensor&)>(&at::cpu::max));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("max", TORCH_FN((extremum<kMax, &at::cpu::max>)));
  m.impl("min", TORCH_FN((extremum<kMin, &at::cpu::min>)));
  m.impl("amax", TORCH_FN((extremum_dims<kAmax, &at::cpu::amax, &at::cpu::amax_out>)));
  m.impl("amin", TORCH_FN((extremum_dims<kAmin, &at::cpu::amin, &at::cpu::amin_out>)));
}

}  // namespace torchneuron
