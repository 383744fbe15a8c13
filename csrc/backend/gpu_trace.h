// PyTorch's GPU trace hooks for neuron: streams, events, synchronizations and device memory
// reported to Python callbacks in torch.neuron._gpu_trace, the counterpart of
// torch.cuda._gpu_trace that the stream sanitizer (torch.neuron._sanitizer) listens to.
//
// The path is PyTorch's own: c10::impl::GPUTrace holds the Python interpreter once
// torch._C._activate_gpu_trace() ran, and its trace_gpu_* methods take a device type and call
// torch.<device name>._gpu_trace.<Registry>.fire_callbacks under the GIL, so PrivateUse1
// ("neuron") needs no binding of its own. The hooks fire only after
// torch.neuron._gpu_trace.activate() (set_enabled below): another tool activating the GPU trace
// for CUDA must not make every neuron allocation call into Python.
//
// Call them without holding allocator locks: the callbacks take the GIL and may allocate.
#pragma once

#include <c10/core/impl/GPUTrace.h>

#include <atomic>
#include <cstdint>

namespace torchneuron::gpu_trace {

extern std::atomic<bool> g_enabled;

// The interpreter to report to, or nullptr when tracing is off (the common, fast case).
inline const c10::impl::PyInterpreter* active() noexcept {
  if (C10_LIKELY(!g_enabled.load(std::memory_order_relaxed))) return nullptr;
  return c10::impl::GPUTrace::get_trace();
}

void set_enabled(bool on);

// A stream as one integer: (device << 32) | stream id (torch.neuron._gpu_trace decodes it).
inline uintptr_t stream_handle(int device, int64_t stream_id) noexcept {
  return (static_cast<uintptr_t>(device) << 32) | static_cast<uint32_t>(stream_id);
}

void event_creation(const void* event);
void event_deletion(const void* event);
void event_record(const void* event, int device, int64_t stream_id);
void event_wait(const void* event, int device, int64_t stream_id);
void event_synchronization(const void* event);
void stream_creation(int device, int64_t stream_id);  // once per (device, stream id)
void stream_synchronization(int device, int64_t stream_id);
// PyTorch's hook carries no device index; the callback reads it with sync_device().
void device_synchronization(int device);
void memory_allocation(const void* ptr, int device, size_t nbytes);
void memory_deallocation(const void* ptr, int device, size_t nbytes);

// Details the hooks cannot carry, for the callback running on this thread: the device of a
// device synchronization, the device and size of an allocation or deallocation.
struct Details {
  int device = -1;
  size_t nbytes = 0;
};
Details details() noexcept;

}  // namespace torchneuron::gpu_trace
