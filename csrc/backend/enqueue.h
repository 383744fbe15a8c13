// Kernels the backend hands to the execution engine (runtime/engine.h) instead of running them.
//
// An op may enqueue its kernel when its outputs exist before the kernel runs (in-place and
// out= ops; elementwise ops whose output the op allocates itself) and every error it can raise
// from its arguments' metadata was raised at the call. The kernel runs later, when the queue
// runs (engine.h), over CPU aliases made at the call (zero_copy.h), so later changes to the
// tensors' metadata (t_, set_, resize_) cannot reach it. Every other kernel runs the queue
// first (ZeroCopy::in, at its first neuron tensor).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/ExpandUtils.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/result_type.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/strides.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../runtime/engine.h"
#include "zero_copy.h"

namespace torchneuron {

// The copies CPU's kernel does slowly, run at memory speed with its bits (ops.cpp): transposes
// and fp8 conversions. False: the caller runs CPU's copy (`d.copy_(s)`), as the queued copy does.
bool fast_copy(const at::Tensor& d, const at::Tensor& s);

inline bool may_enqueue() noexcept { return neuron::rt::engine::enabled(); }

// The argument rules every queued kernel shares (the hot ops in ops.cpp, the boxed fallback's
// in fallback.cpp), so that no error or cast is left for the kernel.
// A Python number: a CPU wrapped-number tensor.
inline bool is_number(const at::Tensor& t) { return t.is_cpu() && t.unsafeGetTensorImpl()->is_wrapped_number(); }
// ... that does not promote `ref`'s dtype.
inline bool number_keeps_dtype(const at::Tensor& ref, const at::Tensor& number) {
  return at::result_type(ref, number) == ref.scalar_type();
}
// A real Python number's value cast to Tp as TensorIterator casts it (static_cast); false for
// a complex one.
template <class Tp> bool number_value(const at::Tensor& number, Tp* out) {
  const void* p = number.const_data_ptr();
  switch (number.scalar_type()) {
    case c10::ScalarType::Double: *out = static_cast<Tp>(*static_cast<const double*>(p)); return true;
    case c10::ScalarType::Long: *out = static_cast<Tp>(*static_cast<const int64_t*>(p)); return true;
    case c10::ScalarType::Bool: *out = *static_cast<const bool*>(p) ? Tp(1) : Tp(0); return true;
    case c10::ScalarType::Float: *out = static_cast<Tp>(*static_cast<const float*>(p)); return true;
    default: return false;
  }
}
// Whether a number converts to `dtype` as CPU's kernels convert it (Scalar::to, which raises for
// one out of the dtype's range): checked at the call, so the queued kernel cannot fail on it.
inline bool number_fits(c10::ScalarType dtype, const at::Scalar& value) {
  if (value.isComplex() && !c10::isComplexType(dtype)) return false;
  try {
    AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(at::kHalf, at::kBFloat16, at::kBool, dtype, "number_fits",
                                           [&] { (void)value.to<scalar_t>(); });
  } catch (const c10::Error&) {
    return false;  // out of range, or a dtype no kernel takes: the synchronous path raises
  }
  return true;
}
// Whether a and b share no memory. ATen's overlap test answers "too hard" for any operand that
// is not dense (a slice of a wider buffer, as Inductor passes to its extern calls), so the
// storages' byte ranges are compared first: disjoint ranges cannot overlap.
inline bool disjoint_memory(const at::Tensor& a, const at::Tensor& b) {
  const auto pa = reinterpret_cast<uintptr_t>(a.storage().data());
  const auto pb = reinterpret_cast<uintptr_t>(b.storage().data());
  const size_t na = a.storage().nbytes(), nb = b.storage().nbytes();
  if (na == 0 || nb == 0 || pa + na <= pb || pb + nb <= pa) return true;
  return at::get_overlap_status(a, b) == at::MemOverlapStatus::No;
}
// Two arguments partially overlapping (an element of the other, say): CPU kernels raise for a
// written one, so such a call runs synchronously and raises at the call.
inline bool partially_overlap(const at::Tensor& a, const at::Tensor& b) {
  return !a.is_same(b) && at::get_overlap_status(a, b) == at::MemOverlapStatus::Partial;
}

// The text of a queued kernel's error (unfused or fused): c10 errors carry a C++ backtrace of
// whichever thread ran the queue, which says nothing the user can act on, so the report gives
// the message (with the Python stack that enqueued the op).
std::string error_text(const std::exception& e);

// Queue `work` on the current stream of `device`, with the caller's Python stack for an error
// report. `name` must outlive the work (a literal or a dispatcher-owned name). `record`, if any,
// lets the kernel run fused with its neighbours (fusion.h).
// `tensors`: what a traced launch would record (operands in the profiler's encoding, launching
// frames; profiler.h, capture_template), kept by a graph capture for the replays' activities
// (QueuedCall gives it while a capture is open).
void enqueue_kernel(int device, const char* name, std::function<void()> work,
                    neuron::rt::engine::Record record = nullptr,
                    neuron::rt::engine::TracePayload tensors = nullptr);

// A kernel an op runs itself over raw pointers to device bytes (no ZeroCopy: the small ops in
// ops.cpp): queued when the engine is on (raw pointers are what a queued kernel's aliases are,
// release_tensors in zero_copy.h: the stream-ordered allocator hands a freed block only to
// later kernels), with the fusion record `record()` makes; otherwise run now, after the queue
// (as ZeroCopy::in does for the kernels it aliases for). `record` is called only when queuing.
// `captured`: what the op's traced launch would record (captured_launch), while a graph is
// captured.
template <class Work, class MakeRecord>
void run_or_enqueue(int device, const char* name, Work&& work, MakeRecord&& record,
                    neuron::rt::engine::TracePayload captured = nullptr) {
  if (may_enqueue()) {
    enqueue_kernel(device, name, std::forward<Work>(work), record(), std::move(captured));
    return;
  }
  if (C10_UNLIKELY(neuron::rt::engine::pending())) neuron::rt::engine::drain();
  work();
}
template <class Work>
void run_or_enqueue(int device, const char* name, Work&& work, neuron::rt::engine::TracePayload captured) {
  run_or_enqueue(device, name, std::forward<Work>(work), [] { return neuron::rt::engine::Record(); },
                 std::move(captured));
}

// While a graph is captured, what a raw-pointer op's traced launch would record for the replays'
// activities (profiler.h, capture_template): its kind and operands (tensor, flags; a null tensor
// is skipped), and for a copy or fill its activity name and bytes. Null when no capture is open
// (one branch).
inline neuron::rt::engine::TracePayload captured_launch(
    neuron::rt::trace::Kind kind, std::initializer_list<std::pair<const at::Tensor*, int64_t>> tensors,
    const char* name = nullptr, int64_t bytes = 0,
    neuron::rt::trace::CopyKind copy = neuron::rt::trace::CopyKind::None) {
  if (C10_LIKELY(!neuron::rt::engine::capturing())) return nullptr;
  auto rec = prof::capture_template();
  rec->kind = kind;
  if (name != nullptr) rec->name = name;
  rec->bytes = bytes;
  rec->copy = copy;
  for (const auto& [t, flags] : tensors) {
    if (t != nullptr) prof::encode_tensor(rec->tensors, *t, flags);
  }
  return rec;
}

// A functional op queued with its results allocated at the call: from the device pool, with the
// sizes, strides and dtype CPU's kernel gives them. The caller has raised every error the kernel
// could raise from its arguments' metadata, and passes only neuron tensors of one device (a CPU
// tensor's bytes could change before the kernel reads them). The kernel writes the results
// through CPU out= kernels on their aliases, or through `copy_result` from CPU's functional
// kernel where CPU has no out= kernel of the same numerics:
//   QueuedCall q;  at::Tensor a = q.in(x), out;  at::Tensor o = q.out(out, sizes, dtype);
//   q.enqueue("aten::op", [a, o]() mutable { at::cpu::op_out(o, a); });  return out;
// Work is run again by graph replays (graphs.cpp): it must not consume what it captured.
class QueuedCall {
 public:
  QueuedCall() : zc_(std::make_shared<ZeroCopy>(ZeroCopy::Queued{})) {}
  at::Tensor in(const at::Tensor& t) { return zc_->in(t); }
  std::optional<at::Tensor> in(const std::optional<at::Tensor>& t) {
    if (t.has_value() && t->defined()) return zc_->in(*t);
    return t;
  }
  // A device tensor the kernel writes in place (an in-place op's self): its alias.
  at::Tensor inout(const at::Tensor& t) { return zc_->in_output(t, /*allow_cpu=*/false, prof::kRead); }
  // A device tensor the kernel overwrites without reading it (a copy's destination): its alias.
  at::Tensor into(const at::Tensor& t) { return zc_->in_output(t); }
  // A copy (a graph replay's activity is then the copy's, as a traced launch's: launch_copy).
  void as_copy(neuron::rt::trace::CopyKind kind, const char* name, int64_t bytes) {
    zc_->captured_as_copy(kind, name, bytes);
  }
  // Allocates `result` (the device tensor the op returns); returns its alias for the kernel.
  at::Tensor out(at::Tensor& result, c10::IntArrayRef sizes, c10::ScalarType dtype, c10::IntArrayRef strides = {}) {
    result = pooled(*zc_, sizes, dtype, strides);
    return zc_->in_output(result);
  }
  // `bytes` of device memory for the kernel's temporaries, allocated now from the caching
  // allocator (the kernel may not enter it): the kernel passes the returned alias to its
  // ZeroCopy's set_scratch_arena. Undefined for 0 bytes.
  at::Tensor arena(int64_t bytes) {
    if (bytes <= 0) return at::Tensor();
    at::Tensor block;
    at::Tensor alias = out(block, {bytes}, at::kByte);
    arenas_.push_back(std::move(block));
    return alias;
  }
  template <class Work>
  void enqueue(const char* name, Work&& work, neuron::rt::engine::Record record = nullptr) {
    zc_->release_tensors();
    enqueue_kernel(
        zc_->device(), name,
        [zc = zc_, name, w = std::forward<Work>(work)]() mutable {
          zc->launch(name);
          w();
        },
        std::move(record), zc_->captured_tensors());
    arenas_.clear();  // the stream-ordered pool hands their blocks only to later kernels
  }

 private:
  std::shared_ptr<ZeroCopy> zc_;
  std::vector<at::Tensor> arenas_;  // the device blocks behind arena(), held until enqueued
};

// A value operand of a queued kernel: a neuron tensor of ref's device (strided, without lazy
// conj/neg bits), or a 0-dim CPU tensor (a Python number, or a CPU scalar PyTorch lets mix with
// device tensors). queued_value copies a CPU one at the call, so the kernel reads the value the
// call saw (as CUDA reads it at launch).
inline bool queueable_value(const at::Tensor& ref, const at::Tensor& t) {
  if (t.is_cpu()) return t.dim() == 0 && t.layout() == c10::kStrided;
  return t.is_privateuseone() && t.device() == ref.device() && t.layout() == c10::kStrided && !t.is_conj() &&
         !t.is_neg();
}
inline at::Tensor queued_value(QueuedCall& q, const at::Tensor& t) {
  if (!t.is_cpu()) return q.in(t);
  at::Tensor copy = t.clone();
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) copy.unsafeGetTensorImpl()->set_wrapped_number(true);
  return copy;
}

// Whether `t` may be an argument of a queued functional op whose reference argument is `ref`:
// a neuron tensor of ref's device and dtype, without lazy conj/neg bits.
inline bool queueable_like(const at::Tensor& ref, const at::Tensor& t) {
  return t.defined() && t.is_privateuseone() && t.device() == ref.device() && t.scalar_type() == ref.scalar_type() &&
         t.layout() == c10::kStrided && !t.is_conj() && !t.is_neg();
}

// An optional argument of a queued kernel: absent, or as queueable_like.
inline bool queueable_opt(const at::Tensor& ref, const std::optional<at::Tensor>& t) {
  return !t.has_value() || !t->defined() || queueable_like(ref, *t);
}

// An index tensor a queued kernel may read: on ref's device, int64 or int32.
inline bool queueable_index(const at::Tensor& ref, const at::Tensor& index) {
  return index.is_privateuseone() && index.device() == ref.device() && index.layout() == c10::kStrided &&
         (index.scalar_type() == at::kLong || index.scalar_type() == at::kInt);
}

// A meta tensor of t's sizes, strides and dtype: structured ops' meta functions, run on these,
// give the results' layout and raise CPU's argument errors at the call.
inline at::Tensor meta_like(const at::Tensor& t) {
  return ::at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
}
inline std::optional<at::Tensor> meta_like(const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) return meta_like(*t);
  return std::nullopt;
}

// The strides of a dense tensor of `sizes` in `format` (contiguous or channels-last).
inline std::vector<int64_t> strides_for(c10::IntArrayRef sizes, at::MemoryFormat format) {
  if (format == at::MemoryFormat::ChannelsLast) return c10::get_channels_last_strides_2d(sizes);
  if (format == at::MemoryFormat::ChannelsLast3d) return c10::get_channels_last_strides_3d(sizes);
  const auto s = c10::contiguous_strides(sizes);
  return std::vector<int64_t>(s.begin(), s.end());
}

// The strides of a tensor of t's sizes in t's suggested memory format (channels-last or
// contiguous): what CPU's norm kernels give their results (empty_like(t, suggest_memory_format)).
// Computed here: empty_like on a meta tensor runs torch's Python meta function once Python meta
// registrations are loaded (tens of microseconds a call).
inline std::vector<int64_t> suggested_strides(const at::Tensor& t) {
  return strides_for(t.sizes(), t.suggest_memory_format());
}

// The strides empty_like(t) gives (memory format preserved): t's own if t is dense and
// non-overlapping, else dense strides in t's stride order (ATen's empty_like, in C++ for the
// reason above).
inline std::vector<int64_t> preserved_strides(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return t.strides().vec();
  return ::at::infer_dense_strides(t.sizes(), t.strides());
}

// A queued kernel's result from CPU's functional kernel, copied into the result allocated at the
// call. The call predicted the result's layout; a kernel that gives another is a bug here, named.
void copy_result(const char* op, const at::Tensor& out, const at::Tensor& r);

}  // namespace torchneuron
