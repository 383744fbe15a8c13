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

}  // namespace torchneuron
