// Kernels the backend hands to the execution engine (runtime/engine.h) instead of running them.
//
// An op may enqueue its kernel when its outputs exist before the kernel runs (in-place and
// out= ops; elementwise ops whose output the op allocates itself) and every error it can raise
// from its arguments' metadata was raised at the call. The kernel runs later, when the queue
// runs (engine.h), over CPU aliases made at the call (zero_copy.h), so later changes to the
// tensors' metadata (t_, set_, resize_) cannot reach it. Every other kernel runs the queue
// first (ZeroCopy::in, at its first neuron tensor).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/Tensor.h>
#include <ATen/ops/result_type.h>

#include <exception>
#include <functional>
#include <string>

#include "../runtime/engine.h"

namespace torchneuron {

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
void enqueue_kernel(int device, const char* name, std::function<void()> work,
                    neuron::rt::engine::Record record = nullptr);

// A kernel an op runs itself over raw pointers to device bytes (no ZeroCopy: the small ops in
// ops.cpp): queued when the engine is on (raw pointers are what a queued kernel's aliases are,
// release_tensors in zero_copy.h: the stream-ordered allocator hands a freed block only to
// later kernels), with the fusion record `record()` makes; otherwise run now, after the queue
// (as ZeroCopy::in does for the kernels it aliases for). `record` is called only when queuing.
template <class Work, class MakeRecord>
void run_or_enqueue(int device, const char* name, Work&& work, MakeRecord&& record) {
  if (may_enqueue()) {
    enqueue_kernel(device, name, std::forward<Work>(work), record());
    return;
  }
  if (C10_UNLIKELY(neuron::rt::engine::pending())) neuron::rt::engine::drain();
  work();
}
template <class Work> void run_or_enqueue(int device, const char* name, Work&& work) {
  run_or_enqueue(device, name, std::forward<Work>(work), [] { return neuron::rt::engine::Record(); });
}

}  // namespace torchneuron
