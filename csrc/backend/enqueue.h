// Kernels the backend hands to the execution engine (runtime/engine.h) instead of running them.
//
// An op may enqueue its kernel when its outputs exist before the kernel runs (in-place and
// out= ops; elementwise ops whose output the op allocates itself) and every error it can raise
// from its arguments' metadata was raised at the call. The kernel runs later, when the queue
// runs (engine.h), over CPU aliases made at the call (zero_copy.h), so later changes to the
// tensors' metadata (t_, set_, resize_) cannot reach it. Every other kernel runs the queue
// first (ZeroCopy::in, at its first neuron tensor).
#pragma once

#include <functional>

#include "../runtime/engine.h"

namespace torchneuron {

inline bool may_enqueue() noexcept { return neuron::rt::engine::enabled(); }

// Queue `work` on the current stream of `device`, with the caller's Python stack for an error
// report. `name` must outlive the work (a literal or a dispatcher-owned name). `record`, if any,
// lets the kernel run fused with its neighbours (fusion.h).
void enqueue_kernel(int device, const char* name, std::function<void()> work,
                    neuron::rt::engine::Record record = nullptr);

}  // namespace torchneuron
