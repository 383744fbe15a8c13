// The execution engine: asynchronous streams (issue 13, first part).
//
// With the engine on, an op whose output metadata is known at the call (preallocated outputs:
// in-place and out= ops, elementwise ops over same-shaped operands) does not run its kernel: it
// enqueues it and returns, so the host (Python) runs ahead of the device as on a real
// accelerator. Each stream's queue runs in order where PyTorch semantics force the host to wait
// (engine.cpp says why on the waiting thread rather than an executor thread of its own, and how
// streams are scheduled: by priority, then enqueue order; wait_event orders them). Every other
// op is a synchronization point: it runs the queues first, then runs as before. So within a
// stream, ordering and results are those of synchronous execution; what changes is when
// kernels run, and where a kernel's error surfaces: at the next synchronization point, naming
// the op and where it was enqueued.
//
// Like the runtime, this knows nothing of PyTorch: work is a closure, and "where it was
// enqueued" an opaque object (a Python stack, captured by the layer above) that a hook of the
// layer above describes.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "trace.h"

namespace neuron::rt::engine {

// Inline state for the checks every op makes (one load each when the engine is off).
namespace detail {
extern std::atomic<bool> g_on;
extern std::atomic<bool> g_capturing;      // a graph capture is open (begin_capture)
extern std::atomic<uint64_t> g_enqueued;   // last sequence number enqueued
extern std::atomic<uint64_t> g_completed;  // last sequence number run
bool running() noexcept;                   // this thread is running queued kernels
}  // namespace detail

using Work = std::function<void()>;
// Where an op was enqueued (opaque here: the layer above captures a Python stack), turned into
// text by the describe hook (set_describe) only when its kernel failed.
using Where = std::shared_ptr<const void>;
// What a fuser needs to know of a kernel (opaque here: the layer above defines it). Work that
// carries one may run as part of a fused kernel instead of on its own (Adaptive Eager).
using Record = std::shared_ptr<const void>;

// Whether ops may be enqueued now: the engine is on (by default; not TORCHNEURON_ASYNC_EXECUTION=0
// or NEURON_LAUNCH_BLOCKING=1; or set_enabled), the profiler is not recording device activity,
// and the caller is not running queued kernels (a kernel's own ops run inline).
inline bool configured() noexcept {  // on by configuration (ignores the profiler and the thread)
  return detail::g_on.load(std::memory_order_relaxed);
}
// Graph capture (below) queues whatever can be queued, engine on or off.
inline bool capturing() noexcept { return detail::g_capturing.load(std::memory_order_relaxed); }
inline bool enabled() noexcept {
  return !detail::running() && (capturing() || (configured() && !trace::active()));
}
void set_enabled(bool on) noexcept;
inline bool on_executor() noexcept { return detail::running(); }  // running queued kernels

// Whether enqueued work has not completed yet (one atomic load: the cheap test every
// synchronous kernel makes before it touches device memory).
// While a graph is being captured it is always true: the synchronous paths that test it then
// call drain() or wait(), which raise (a kernel run now would be missing from the graph).
inline bool queued() noexcept {  // work is in the queues (captures aside)
  return detail::g_completed.load(std::memory_order_acquire) != detail::g_enqueued.load(std::memory_order_acquire);
}
inline bool pending() noexcept { return queued() || capturing(); }

// What the profiler would have recorded for a work item's launch, given by kernels that know
// it while a graph is captured, so that a replay's activity repeats the launch's: operands
// (tensors, the profiler's encoding: backend/profiler.h), kind and arguments (meta; a compiled
// kernel's FLOPs and source), and the launching Python frames (context). Times unset.
using TracePayload = std::shared_ptr<const trace::Record>;

// Queue `work` on (device, stream); returns its sequence number. `name` (a stable string)
// and `where` name the work in an error report; `tensors` is kept by a capture only.
uint64_t enqueue(int device, int64_t stream, const char* name, Work work, Where where,
                 Record record = nullptr, TracePayload tensors = nullptr);
// Work enqueued on (device, stream) from now on runs only after work `after` (of any stream)
// has completed: the queue side of wait_event. Nothing to do if it has.
void enqueue_wait(int device, int64_t stream, uint64_t after);

// Adaptive Eager: when the queue runs and its next kernels carry records, the fuser is offered
// the records of that run of kernels (in order, at most the queue limit). It either ran
// the first `fused` of them as one (their own work is then dropped unrun), or asks that the
// first `unfused` run on their own before it is asked again. Never both. A fused run that
// failed part-way reports `error` (it cannot be run again unfused: some of it ran), which
// surfaces like a kernel's; an exception from the fuser means it ran nothing: {0, 1}.
// `seqs[i]` is the sequence number of the kernel of `records[i]`.
struct Decision {
  size_t fused = 0;
  size_t unfused = 0;
  std::string error;
};
using Fuser = Decision (*)(const std::vector<const void*>& records, const std::vector<uint64_t>& seqs);
// `flush` (optional) runs after each run of the queue: the fuser's batched follow-up work.
// Installed only while fusion is on (nullptr removes it), so an engine without fusion never
// looks for records.
void set_fuser(Fuser fuser, void (*flush)()) noexcept;
// The executor thread (off by default; TORCHNEURON_EXECUTOR_THREAD=1): queued kernels run on a
// thread of their own as soon as they are enqueued (while fusing, a trailing run of fusible
// kernels waits for the kernel that ends it or a host wait), overlapping the host. Host waits
// are unchanged. `init` runs first on that thread (the layer above gives it the host's
// intra-op thread count, so its kernels compute what the host's would, bit for bit).
void set_executor_thread(bool on) noexcept;
bool executor_thread() noexcept;
void set_executor_thread_init(void (*init)()) noexcept;
// How many kernels queue up before the queue runs (AWS's concatenation buffer), and so the
// most kernels one fused region takes. At least 2.
void set_queue_limit(size_t n) noexcept;

// The sequence number of the last work enqueued on (device, stream), or on any stream.
uint64_t last(int device, int64_t stream) noexcept;
uint64_t last() noexcept;
bool completed(uint64_t seq) noexcept;
// Whether `seq` had completed; if not, lets the queue run up to it (a polling loop finishes;
// an error stays for the next wait) and returns false.
bool poll(uint64_t seq) noexcept;

// Host waits: for work up to `seq`, for everything. Then throws the first error a kernel
// raised since the last report, if any (std::runtime_error naming the op, the error and the
// enqueueing stack); the engine stays usable.
void wait(uint64_t seq);
void drain();
// Drain without reporting (destructors, noexcept paths); the error stays for the next wait.
void drain_quietly() noexcept;

// Run `fn` once every kernel queued so far has run (now, if none is queued): the release of
// memory that queued kernels may still use (memory the device adopted from the host allocator,
// memory mapped from another process). The caching allocator's own blocks need no such care:
// a freed block is only written again by a later kernel (queued behind, or run after the queue)
// and returned to the runtime only after the queue ran.
void after_queue(Work fn);

// The steady-clock time at which work `seq` completed (0 if unknown: not completed, or too old).
// Events recorded behind queued work take their time from here (device-side timing).
int64_t completion_time(uint64_t seq) noexcept;

// How a host thread blocks while another runs the queue: the layer above wraps the wait so
// that a thread holding the Python interpreter's lock releases it meanwhile (a kernel's
// teardown may need it, e.g. a memory-history or sanitizer callback). Default: wait as is.
using BlockingWait = void (*)(const std::function<void()>& wait);
void set_blocking_wait(BlockingWait wrapper) noexcept;

// The text of a kernel's exception in an error report (the layer above drops what the user
// cannot act on, such as a C++ backtrace of whichever thread ran the queue). Default: what().
using ErrorText = std::string (*)(const std::exception& e);
void set_error_text(ErrorText text) noexcept;
// The text of a failed kernel's Where (the enqueueing stack). Default: none.
using Describe = std::string (*)(const void* where);
void set_describe(Describe describe) noexcept;
// How a queued kernel runs: the layer above sets the thread's dispatch state the kernel expects
// (PyTorch: below autograd, whatever mode the draining thread is in). Default: work() as is.
using RunWork = void (*)(const Work& work);
void set_run_work(RunWork run) noexcept;
// How a kernel's failure is raised at the synchronization that reports it: the layer above
// throws its own exception type (PyTorch's AcceleratorError, as CUDA's device errors).
// Default: std::runtime_error. Must throw.
using Raise = void (*)(const std::string& message);
void set_raise(Raise raise) noexcept;
// The calling thread's stack as a Where (for a graph capture's violation report). Default: none.
using CurrentWhere = Where (*)();
void set_current_where(CurrentWhere current) noexcept;

// Graph capture (torch.accelerator.Graph; backend/graph.cpp). Between begin_capture and
// end_capture, work enqueued on the capturing (device, stream) is recorded instead of queued:
// it does not run, and the recording can be enqueued again and again (replay). Everything that
// would make the host wait for the device, or run a kernel now, raises instead (drain, wait;
// drain_quietly does nothing): on neuron a synchronous kernel would run outside the graph.
// Work enqueued on another stream raises too (one stream is captured). A capture that raised
// is failed: end_capture raises its first error and records nothing.
// What a capture records per work item (`tensors`: the launch's trace record, see TracePayload).
struct Captured {
  const char* name;
  Work work;
  Where where;
  Record record;
  TracePayload tensors;
};
// Runs the queues first; raises if a capture is open.
void begin_capture(int device, int64_t stream);
std::vector<Captured> end_capture();

struct Stats {
  uint64_t enqueued = 0;  // work items queued since start
  uint64_t executed = 0;  // ... and run
  uint64_t drains = 0;    // host waits that found work pending
  uint64_t fused = 0;     // work items run as part of a fused kernel
  uint64_t regions = 0;   // fused kernels (regions) run
};
Stats stats() noexcept;

}  // namespace neuron::rt::engine
