#include "runtime.h"

#include "trace.h"

#include <pthread.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace neuron::rt {
namespace {

struct DeviceState {
  size_t capacity = 0;
  std::atomic<size_t> used{0};
  std::atomic<uint32_t> next_pool_stream[kNumPriorities] = {};
};

std::array<DeviceState, kMaxDevices> g_devices;
std::atomic<int> g_device_count{0};
std::atomic<bool> g_initialized{false};
std::atomic<bool> g_bad_fork{false};
std::once_flag g_atfork_once;

thread_local int t_current_device = 0;
// Current stream per device for this thread; 0 is the default stream.
thread_local std::array<int64_t, kMaxDevices> t_current_stream = {};

void on_fork_child() {
  // CUDA's rule: a child forked after initialisation must not touch the device.
  if (g_initialized.load()) g_bad_fork.store(true);
  g_initialized.store(false);
}

}  // namespace

void configure(const std::vector<size_t>& capacities) {
  if (capacities.size() > static_cast<size_t>(kMaxDevices)) {
    throw std::invalid_argument("too many neuron devices: " + std::to_string(capacities.size()) +
                                " (at most " + std::to_string(kMaxDevices) + ")");
  }
  for (size_t i = 0; i < capacities.size(); ++i) g_devices[i].capacity = capacities[i];
  g_device_count.store(static_cast<int>(capacities.size()));
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, on_fork_child); });
}

int device_count() noexcept { return g_device_count.load(std::memory_order_relaxed); }

void check_device(int device) {
  int n = device_count();
  if (device < 0 || device >= n) {
    throw std::out_of_range(
        "Invalid device index neuron:" + std::to_string(device) + ": this process has " +
        std::to_string(n) + " neuron device(s) (valid indices 0.." + std::to_string(n - 1) +
        "). Check NEURON_RT_VISIBLE_CORES, NEURON_LOGICAL_NC_CONFIG and TORCHNEURON_NUM_CHIPS.");
  }
}

size_t capacity(int device) {
  check_device(device);
  return g_devices[device].capacity;
}

int current_device() noexcept { return t_current_device; }

void set_current_device(int device) {
  check_device(device);
  t_current_device = device;
}

void lazy_init() {
  if (g_initialized.load(std::memory_order_acquire)) return;
  if (g_bad_fork.load()) {
    throw std::runtime_error(
        "Cannot re-initialize neuron in forked subprocess. To use neuron with multiprocessing, "
        "you must use the 'spawn' start method");
  }
  g_initialized.store(true, std::memory_order_release);
}

bool is_initialized() noexcept { return g_initialized.load(); }
bool in_bad_fork() noexcept { return g_bad_fork.load(); }

bool reserve(int device, size_t nbytes) noexcept {
  auto& d = g_devices[device];
  size_t cur = d.used.load(std::memory_order_relaxed);
  do {
    if (cur + nbytes > d.capacity) return false;
  } while (!d.used.compare_exchange_weak(cur, cur + nbytes));
  return true;
}

void release(int device, size_t nbytes) noexcept { g_devices[device].used.fetch_sub(nbytes); }

size_t used(int device) noexcept { return g_devices[device].used.load(); }

void* malloc(int device, size_t nbytes) {
  lazy_init();
  if (!reserve(device, nbytes)) return nullptr;
  // 64-byte alignment matches c10's CPU allocator, so device bytes can alias as CPU tensors
  // and vectorised CPU kernels see the alignment they expect.
  void* ptr = nullptr;
  if (posix_memalign(&ptr, 64, nbytes == 0 ? 64 : nbytes) != 0) {
    release(device, nbytes);
    return nullptr;  // the host itself is out of memory: report it as device OOM
  }
  return ptr;
}

void free(int device, void* ptr, size_t nbytes) noexcept {
  std::free(ptr);
  release(device, nbytes);
}

int64_t default_stream_id() noexcept { return 0; }

int64_t pool_stream_id(int device, int priority) noexcept {
  int slot = priority < 0 ? 1 : 0;
  uint32_t idx = g_devices[device].next_pool_stream[slot].fetch_add(1) % kStreamsPerPool;
  return 1 + slot * kStreamsPerPool + idx;
}

int stream_priority(int64_t stream_id) noexcept {
  if (stream_id <= 0) return 0;
  return (stream_id - 1) / kStreamsPerPool == 1 ? -1 : 0;
}

int64_t current_stream(int device) noexcept { return t_current_stream[device]; }

void set_current_stream(int device, int64_t stream_id) noexcept {
  t_current_stream[device] = stream_id;
}

bool query_stream(int, int64_t) noexcept { return true; }

// Synchronous execution: nothing to wait for. The profiler still sees the synchronization
// points (their blocked time is measured; the estimated timeline replays them as stalls).
void synchronize_stream(int device, int64_t stream_id) noexcept {
  if (!trace::active()) return;
  const int64_t t = trace::now_ns();
  trace::record_sync("neuronStreamSynchronize", device, stream_id, t, trace::now_ns());
}

void synchronize_device(int device) noexcept {
  if (!trace::active()) return;
  const int64_t t = trace::now_ns();
  trace::record_sync("neuronDeviceSynchronize", device, -1, t, trace::now_ns());
}

int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {
// Event record / wait as trace records: the estimated timeline orders queues by them.
void trace_event(trace::Kind kind, const char* name, const Event* event, int device,
                 int64_t stream_id) {
  trace::Record r;
  r.id = trace::next_id();
  r.external = trace::current_correlation();
  r.kind = kind;
  r.device = device;
  r.stream = stream_id;
  r.tid = trace::thread_id();
  r.scope = trace::current_scope();
  r.launch_start_ns = r.launch_end_ns = r.start_ns = r.end_ns = trace::now_ns();
  r.name = name;
  r.meta.emplace_back("event", std::to_string(reinterpret_cast<uintptr_t>(event)));
  r.meta.emplace_back("event_stream", std::to_string(event->stream_id));
  trace::record(std::move(r));
}
}  // namespace

void record_event(Event* event, int device, int64_t stream_id) noexcept {
  event->device = device;
  event->stream_id = stream_id;
  event->recorded = true;
  event->time_ns = now_ns();
  if (trace::active()) trace_event(trace::Kind::EventRecord, "neuronEventRecord", event, device, stream_id);
}

void synchronize_event(const Event* event) noexcept {
  if (!trace::active() || event == nullptr || !event->recorded) return;
  const int64_t t = trace::now_ns();
  trace::record_sync("neuronEventSynchronize", event->device, event->stream_id, t, trace::now_ns());
}

void wait_event(const Event* event, int device, int64_t stream_id) noexcept {
  if (!trace::active() || event == nullptr || !event->recorded) return;
  trace_event(trace::Kind::Wait, "neuronStreamWaitEvent", event, device, stream_id);
}

double elapsed_ms(const Event& start, const Event& end) {
  if (!start.timing || !end.timing) {
    throw std::invalid_argument(
        "Both events must be created with enable_timing=True to measure elapsed time.");
  }
  if (!start.recorded || !end.recorded) {
    throw std::invalid_argument(
        "Both events must be recorded before calculating elapsed time.");
  }
  return static_cast<double>(end.time_ns - start.time_ns) / 1e6;
}

}  // namespace neuron::rt
