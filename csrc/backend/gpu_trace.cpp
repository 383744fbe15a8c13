#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "gpu_trace.h"

#include <c10/core/DeviceType.h>

#include <mutex>
#include <set>
#include <utility>

namespace torchneuron::gpu_trace {

std::atomic<bool> g_enabled{false};

namespace {
thread_local Details t_details;

// Sets the details for the duration of one hook call (hooks may nest: a callback allocates).
struct Scope {
  Details saved;
  Scope(int device, size_t nbytes) : saved(t_details) { t_details = {device, nbytes}; }
  ~Scope() { t_details = saved; }
};

inline uintptr_t handle(const void* p) { return reinterpret_cast<uintptr_t>(p); }
constexpr auto kNeuron = c10::DeviceType::PrivateUse1;
}  // namespace

void set_enabled(bool on) { g_enabled.store(on, std::memory_order_relaxed); }

Details details() noexcept { return t_details; }

void event_creation(const void* event) {
  if (auto* interp = active()) (*interp)->trace_gpu_event_creation(kNeuron, handle(event));
}
void event_deletion(const void* event) {
  if (auto* interp = active()) (*interp)->trace_gpu_event_deletion(kNeuron, handle(event));
}
void event_record(const void* event, int device, int64_t stream_id) {
  if (auto* interp = active()) {
    (*interp)->trace_gpu_event_record(kNeuron, handle(event), stream_handle(device, stream_id));
  }
}
void event_wait(const void* event, int device, int64_t stream_id) {
  if (auto* interp = active()) {
    (*interp)->trace_gpu_event_wait(kNeuron, handle(event), stream_handle(device, stream_id));
  }
}
void event_synchronization(const void* event) {
  if (auto* interp = active()) (*interp)->trace_gpu_event_synchronization(kNeuron, handle(event));
}

void stream_creation(int device, int64_t stream_id) {
  auto* interp = active();
  if (interp == nullptr) return;
  // Pool streams are handed out round-robin, again and again; report each one once.
  static std::mutex mu;
  static std::set<std::pair<int, int64_t>> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.emplace(device, stream_id).second) return;
  }
  (*interp)->trace_gpu_stream_creation(kNeuron, stream_handle(device, stream_id));
}
void stream_synchronization(int device, int64_t stream_id) {
  if (auto* interp = active()) {
    (*interp)->trace_gpu_stream_synchronization(kNeuron, stream_handle(device, stream_id));
  }
}
void device_synchronization(int device) {
  if (auto* interp = active()) {
    Scope scope(device, 0);
    (*interp)->trace_gpu_device_synchronization(kNeuron);
  }
}
void memory_allocation(const void* ptr, int device, size_t nbytes) {
  if (auto* interp = active()) {
    Scope scope(device, nbytes);
    (*interp)->trace_gpu_memory_allocation(kNeuron, handle(ptr));
  }
}
void memory_deallocation(const void* ptr, int device, size_t nbytes) {
  if (auto* interp = active()) {
    Scope scope(device, nbytes);
    (*interp)->trace_gpu_memory_deallocation(kNeuron, handle(ptr));
  }
}

}  // namespace torchneuron::gpu_trace
