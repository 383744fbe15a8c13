// Activity tracing of the emulated runtime: the CUPTI of this device.
//
// While a profiler session is active, the code that executes device work (kernels, copies,
// collectives, NKI kernels, synchronizations) appends one Record per piece of work. A record
// is created at *launch* (it captures the launching thread, the innermost framework op's
// correlation id and the stream) and stamped when the work *executes*. Today both happen in
// the same call (execution is synchronous); an asynchronous executor would carry the Record
// with the queued work and stamp start/end where the kernel runs.
//
// No PyTorch types here: tensor metadata is an opaque int64 vector the layer above encodes,
// `context` an opaque pointer it owns. When no session is active every hook costs one
// relaxed atomic load.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace neuron::rt::trace {

enum class Kind : uint8_t {
  Kernel = 0,      // an op's kernel (hot op, boxed fallback, SDPA, convolution)
  Memcpy = 1,      // a copy: copy_kind says the direction
  Memset = 2,      // a fill of device memory
  Collective = 3,  // a collective on a communication queue
  NkiKernel = 4,   // an @nki.jit kernel
  Compiled = 5,    // a torch.compile (Inductor) kernel
  Sync = 6,        // host blocked on the device: device/stream/event synchronize
  Wait = 7,        // a stream waits for an event recorded on another stream
  EventRecord = 8  // an event recorded on a stream
};

enum class CopyKind : uint8_t { None = 0, HtoD = 1, DtoH = 2, DtoD = 3 };

struct Record {
  uint64_t id = 0;           // unique per record (the trace's "correlation" of launch/kernel)
  uint64_t external = 0;     // correlation id of the innermost framework op at launch
  Kind kind = Kind::Kernel;
  CopyKind copy = CopyKind::None;
  bool blocking = false;     // the host waited for the work (D2H copy, item())
  int32_t device = 0;
  int64_t stream = 0;
  int32_t tid = 0;           // system thread id of the launching thread
  int32_t scope = 0;         // module scope id set by the framework layer (0: none)
  int64_t launch_start_ns = 0, launch_end_ns = 0;  // host side, CLOCK_REALTIME
  int64_t start_ns = 0, end_ns = 0;                // device side, CLOCK_REALTIME
  int64_t bytes = 0;
  std::string name;
  std::vector<std::pair<std::string, std::string>> meta;  // extra args: key, raw JSON value
  std::vector<int64_t> tensors;   // encoded tensor metadata (see backend/profiler.h)
  std::shared_ptr<void> context;  // e.g. a captured Python traceback
};

namespace detail {
extern std::atomic<bool> g_active;
}

// True while a session records. The one branch every hook takes when profiling is off.
inline bool active() noexcept { return detail::g_active.load(std::memory_order_relaxed); }

// Session control (the profiler plugin). start() clears what an earlier session left.
void start();
void stop();
std::vector<Record> drain();

// Clock of the records: CLOCK_REALTIME ns, the clock of PyTorch's profiler events.
int64_t now_ns() noexcept;
int32_t thread_id() noexcept;
uint64_t next_id() noexcept;

// Append a finished record (thread-safe). Dropped when the session has stopped or this thread
// suppresses recording.
void record(Record&& r);

// Correlation stack of this thread: the profiler pushes the id of every framework op it
// enters, launches take the top.
void push_correlation(uint64_t id);
void pop_correlation();
uint64_t current_correlation() noexcept;

// Module scope of this thread (ids interned by the framework layer).
void set_scope(int32_t scope) noexcept;
int32_t current_scope() noexcept;

// Work this thread does that is not device work (host staging copies of the emulator, e.g.
// NKI's simulator reading device tensors) is not recorded while suppressed (nestable).
void suppress(bool on) noexcept;
bool suppressed() noexcept;

// A host-side synchronization (device/stream/event) with the time the host was blocked.
void record_sync(const char* name, int device, int64_t stream, int64_t start_ns, int64_t end_ns);

// Where the layer above captures the caller's context (e.g. a Python stack) for records the
// runtime makes itself (synchronizations). Null: none.
using ContextHook = std::shared_ptr<void> (*)();
void set_context_hook(ContextHook hook) noexcept;

}  // namespace neuron::rt::trace
