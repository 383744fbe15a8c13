// The execution engine (engine.h): one FIFO of kernels for all streams and devices, executed by
// the host thread that needs them.
//
// Why no executor thread: kernels are host code, and the host has only the cores the caller's
// own intra-op parallelism already uses. An executor thread next to the Python thread was
// measured on the 2-core host (docs/benchmarks.md, Execution engine): every synchronous op then
// waits for a thread hand-off, and under any other load the three runnable threads
// (host, executor, intra-op team) made eager training 2x and small ops 12x slower than without
// the engine. So the queue runs where PyTorch semantics force a wait (a synchronization point,
// which runs it on the waiting thread, with the caller's intra-op threads), when it reaches
// g_max_queued kernels, and when the host polls a stream or event (which reports "not ready" and
// lets the queue run, so polling loops finish). Enqueue order is a legal schedule of any set of
// streams (each stream's order is kept, and every cross-stream wait is satisfied by then).
#include "engine.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "runtime.h"
#include "trace.h"

namespace neuron::rt::engine {

namespace detail {
std::atomic<bool> g_on{false};
std::atomic<uint64_t> g_enqueued{0};
std::atomic<uint64_t> g_completed{0};
}  // namespace detail

namespace {

struct Item {
  uint64_t seq;
  const char* name;
  Work work;
  Describe where;
  Record record;  // for the fuser (engine.h, Adaptive Eager)
};

bool env_on() {
  const char* blocking = std::getenv("NEURON_LAUNCH_BLOCKING");
  if (blocking != nullptr && std::strcmp(blocking, "1") == 0) return false;
  const char* on = std::getenv("TORCHNEURON_ASYNC_EXECUTION");
  return on != nullptr && std::strcmp(on, "1") == 0;
}

constexpr size_t kTimes = 1 << 16;   // completion times kept (a ring indexed by sequence number)
// A queue this long runs at the next enqueue. Measured on the 16-element add (bench/engine.py):
// 1,024 queued kernels cost 12.1 us an op, 64 cost 4.9, 16 about the same as 64: every queued
// kernel holds a few heap blocks (its aliases, closure, stack), and a deep queue pushes them
// out of malloc's per-thread caches. set_queue_limit sets it.
std::atomic<size_t> g_max_queued{64};

struct Engine {
  std::mutex mu;      // the queue and the bookkeeping below
  std::mutex run_mu;  // one thread runs kernels at a time, in order
  std::deque<Item> queue;
  std::unordered_map<int64_t, uint64_t> last;  // (device, stream) key -> seq
  std::string error;                           // first unreported kernel error
  Describe error_where;                        // ... and where its op was enqueued
  std::array<std::atomic<int64_t>, kTimes> times{};
  std::atomic<uint64_t> drains{0};
  std::atomic<uint64_t> fused{0};
  std::atomic<uint64_t> regions{0};
};

// Never destroyed: tensors held by queued kernels may outlive static destructors. A child
// forked with work queued starts with a fresh engine (the parent's lock may be held).
Engine* g_engine = nullptr;
std::once_flag g_engine_once;

Engine& engine() {
  std::call_once(g_engine_once, [] {
    g_engine = new Engine();
    pthread_atfork(nullptr, nullptr, [] {
      g_engine = new Engine();
      detail::g_completed.store(detail::g_enqueued.load());  // the parent's queue stays behind
    });
  });
  return *g_engine;
}

thread_local bool t_running = false;  // this thread is running queued kernels
std::atomic<BlockingWait> g_blocking_wait{nullptr};
std::atomic<Fuser> g_fuser{nullptr};
std::atomic<void (*)()> g_flush{nullptr};

int64_t key(int device, int64_t stream) noexcept { return (static_cast<int64_t>(device) << 32) ^ stream; }

// Offer the fuser the run of record-carrying kernels at the front of the queue (up to `seq`:
// a wait never runs kernels queued after what it waits for). Returns how many kernels to run
// on their own next (0: a fused region ran).
size_t try_fuse(Engine& e, uint64_t seq) {
  Fuser fuser = g_fuser.load(std::memory_order_acquire);
  if (fuser == nullptr) return 1;
  std::vector<Record> held;  // keeps the records alive while the fuser reads them
  std::vector<const void*> records;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.queue.empty()) return 1;  // the caller finds it empty too, and stops
    const size_t limit = g_max_queued.load(std::memory_order_relaxed);
    for (const Item& item : e.queue) {
      if (!item.record || item.seq > seq || records.size() >= limit) break;
      held.push_back(item.record);
      records.push_back(item.record.get());
    }
  }
  if (records.size() < 2) return 1;
  Decision d;
  try {
    d = fuser(records);
  } catch (...) {
    d = Decision{0, 1};
  }
  if (d.fused == 0) return std::max<size_t>(d.unfused, 1);
  // Only this thread pops (it holds run_mu), so the first `fused` items are the ones offered.
  std::deque<Item> done;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    for (size_t i = 0; i < d.fused; ++i) {
      done.push_back(std::move(e.queue.front()));
      e.queue.pop_front();
    }
  }
  const int64_t t = now_ns();
  for (Item& item : done) e.times[item.seq % kTimes].store(t, std::memory_order_relaxed);
  const uint64_t last_seq = done.back().seq;
  if (!d.error.empty()) {
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.error.empty()) {
      e.error = "neuron: a fused region of " + std::to_string(d.fused) + " kernels (the first " +
                done.front().name + ") failed on the device (TORCH_NEURONX_ENABLE_CONCATENATION=0 runs "
                "them one by one): " + d.error;
      e.error_where = std::move(done.front().where);
    }
  }
  done.clear();  // releases the kernels' aliases before the region counts as complete
  held.clear();
  e.fused.fetch_add(d.fused, std::memory_order_relaxed);
  e.regions.fetch_add(1, std::memory_order_relaxed);
  detail::g_completed.store(last_seq, std::memory_order_release);
  return 0;
}

// Run queued kernels on this thread until `seq` has completed (another thread may be running
// them: then wait for it). Kernel errors are kept for the next report.
void run_until(Engine& e, uint64_t seq) {
  if (t_running || detail::g_completed.load(std::memory_order_acquire) >= seq) return;
  std::unique_lock<std::mutex> run_lock(e.run_mu, std::try_to_lock);
  if (!run_lock.owns_lock()) {
    BlockingWait wrapper = g_blocking_wait.load(std::memory_order_acquire);
    if (wrapper != nullptr) wrapper([&] { run_lock.lock(); });
    else run_lock.lock();
  }
  t_running = true;
  size_t unfused = 0;  // kernels the fuser asked to run on their own before it is asked again
  while (detail::g_completed.load(std::memory_order_acquire) < seq) {
    if (unfused == 0) unfused = try_fuse(e, seq);
    if (unfused == 0) continue;  // a fused region ran
    --unfused;
    Item item;
    {
      std::lock_guard<std::mutex> lock(e.mu);
      if (e.queue.empty()) break;
      item = std::move(e.queue.front());
      e.queue.pop_front();
    }
    std::string failure;
    try {
      item.work();
    } catch (const std::exception& ex) {
      failure = ex.what();
    } catch (...) {
      failure = "unknown exception";
    }
    // Release what the work held (tensors: their memory returns to the allocator) before it
    // counts as complete, so memory stats are exact after a synchronization.
    item.work = nullptr;
    item.record = nullptr;
    e.times[item.seq % kTimes].store(now_ns(), std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(e.mu);
    if (!failure.empty() && e.error.empty()) {
      e.error = std::string("neuron: ") + item.name +
                " failed on the device (executed asynchronously; NEURON_LAUNCH_BLOCKING=1 raises "
                "at the call instead): " + failure;
      e.error_where = std::move(item.where);  // described when reported
    }
    detail::g_completed.store(item.seq, std::memory_order_release);
  }
  if (auto flush = g_flush.load(std::memory_order_acquire)) {
    try {
      flush();
    } catch (...) {
    }
  }
  t_running = false;
}

void report(Engine& e) {
  std::unique_lock<std::mutex> lock(e.mu);
  if (e.error.empty()) return;
  std::string msg = std::move(e.error);
  Describe where = std::move(e.error_where);
  e.error.clear();
  e.error_where = nullptr;
  lock.unlock();
  if (where) {
    try {
      const std::string stack = where();
      if (!stack.empty()) msg += "\nThe op was enqueued at (most recent call last):\n" + stack;
    } catch (...) {
    }
  }
  throw std::runtime_error(msg);
}

}  // namespace

namespace detail {
bool running() noexcept { return t_running; }
// The configuration, read when the library loads.
const bool g_configured = [] {
  g_on.store(env_on());
  return true;
}();
}  // namespace detail

void set_enabled(bool on) noexcept {
  if (!on) drain_quietly();
  detail::g_on.store(on);
}

uint64_t enqueue(int device, int64_t stream, const char* name, Work work, Describe where, Record record) {
  Engine& e = engine();
  uint64_t seq;
  size_t queued;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    seq = detail::g_enqueued.load(std::memory_order_relaxed) + 1;  // written under mu only
    e.last[key(device, stream)] = seq;
    e.queue.push_back(Item{seq, name, std::move(work), std::move(where), std::move(record)});
    queued = e.queue.size();
    detail::g_enqueued.store(seq, std::memory_order_release);
  }
  if (queued >= g_max_queued.load(std::memory_order_relaxed)) run_until(e, seq);
  return seq;
}

uint64_t last(int device, int64_t stream) noexcept {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.last.find(key(device, stream));
  return it == e.last.end() ? 0 : it->second;
}

uint64_t last() noexcept { return detail::g_enqueued.load(std::memory_order_acquire); }

bool completed(uint64_t seq) noexcept { return detail::g_completed.load(std::memory_order_acquire) >= seq; }

bool poll(uint64_t seq) noexcept {
  Engine& e = engine();
  if (detail::g_completed.load(std::memory_order_acquire) >= seq) return true;
  try {
    run_until(e, seq);
  } catch (...) {
  }
  return false;
}

void wait(uint64_t seq) {
  Engine& e = engine();
  if (t_running) return;  // a queued kernel's own ops run inline, in order
  if (detail::g_completed.load(std::memory_order_acquire) < seq) {
    e.drains.fetch_add(1, std::memory_order_relaxed);
    run_until(e, seq);
  }
  report(e);
}

void drain() { wait(last()); }

void drain_quietly() noexcept {
  if (t_running) return;
  try {
    run_until(engine(), last());
  } catch (...) {
  }
}

void after_queue(Work fn) {
  if (!pending()) {
    fn();
    return;
  }
  enqueue(-1, -1, "deferred release", std::move(fn), nullptr);
}

int64_t completion_time(uint64_t seq) noexcept {
  Engine& e = engine();
  const uint64_t done = detail::g_completed.load(std::memory_order_acquire);
  if (seq == 0 || seq > done || done - seq >= kTimes) return 0;
  return e.times[seq % kTimes].load(std::memory_order_relaxed);
}

void set_queue_limit(size_t n) noexcept { g_max_queued.store(std::max<size_t>(n, 2), std::memory_order_relaxed); }

void set_fuser(Fuser fuser, void (*flush)()) noexcept {
  g_flush.store(flush, std::memory_order_release);
  g_fuser.store(fuser, std::memory_order_release);
}

void set_blocking_wait(BlockingWait wrapper) noexcept { g_blocking_wait.store(wrapper, std::memory_order_release); }

Stats stats() noexcept {
  Engine& e = engine();
  Stats s;
  s.enqueued = detail::g_enqueued.load();
  s.executed = detail::g_completed.load();
  s.drains = e.drains.load();
  s.fused = e.fused.load();
  s.regions = e.regions.load();
  return s;
}

}  // namespace neuron::rt::engine
