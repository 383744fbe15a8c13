// The sync debug mode (torch.neuron.set_sync_debug_mode, as torch.cuda's): with the execution
// engine the host runs ahead of the device, and a program is only as fast as its host waits
// are few. Set to warn (1) or error (2), every operation that makes the host wait for the device
// says so: .item() and other data-dependent results (torch.equal, is_nonzero), blocking
// device-to-host copies (.cpu(), .tolist(), printing), ops whose output shape depends on values
// (nonzero, masked_select, unique, boolean indexing) and Stream.synchronize(). As on CUDA,
// torch.neuron.synchronize() and Event.synchronize() do not (a program that calls them means
// to wait), and neither do ops that wait only because this emulator runs them synchronously.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>

namespace torchneuron::sync_debug {

namespace detail {
extern std::atomic<int> g_mode;  // 0 off, 1 warn, 2 error
void report(const char* what);
}  // namespace detail

void set_mode(int mode);  // 0, 1 or 2
int mode() noexcept;

inline bool enabled() noexcept { return detail::g_mode.load(std::memory_order_relaxed) != 0; }

// The host is about to wait for the device because of `what` (an op or an API name).
inline void on_sync(const char* what) {
  if (C10_UNLIKELY(enabled())) detail::report(what);
}
// A fallback op with its arguments at stack[begin:]: reports if its result depends on device
// values (its dynamic_output_shape or data_dependent_output tag, or indexing by a boolean mask,
// whose positions are the mask's nonzero elements).
void on_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t begin);
// An index tensor that selects by mask (x[mask]), as ATen's indexing reads a bool or uint8 one.
inline bool is_mask(const at::Tensor& t) { return t.scalar_type() == at::kBool || t.scalar_type() == at::kByte; }

}  // namespace torchneuron::sync_debug
