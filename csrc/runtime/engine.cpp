// The execution engine (engine.h): one queue per stream, executed by the host thread that
// needs them, or (set_executor_thread) by an executor thread as soon as they hold work.
//
// Why no executor thread by default: kernels are host code, and the host has only the cores the
// caller's own intra-op parallelism already uses. An executor thread next to the Python thread,
// when most ops still ran synchronously, made every such op wait for a thread hand-off, and
// under any other load the three runnable threads (host, executor, intra-op team) made eager
// training 2x and small ops 12x slower than without the engine (docs/benchmarks.md). So by
// default the queues run where PyTorch semantics force a wait (a synchronization point, which
// runs them on the waiting thread, with the caller's intra-op threads), when they hold
// g_max_queued kernels, and when the host polls a stream or event (which reports "not ready"
// and lets the queues run, so polling loops finish). Now that training steps queue nearly every
// kernel the hand-offs are gone, but an executor with the host's intra-op thread count (needed
// for the host's bits) makes libgomp throttle every team of the process: still slower here
// (executor_main below, off by default; docs/architecture.md, "Threads and cores").
//
// Which stream's kernel runs next (pick_locked): the highest-priority stream's, then the
// earliest enqueued. Streams of one priority therefore run in enqueue order, a legal schedule
// of any set of streams; a high-priority stream overtakes, so work on it really does run before
// earlier work of other streams, and only wait_event/wait_stream (wait markers in the queue)
// order it after them.
#include "engine.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#include "runtime.h"
#include "trace.h"

namespace neuron::rt::engine {

namespace detail {
std::atomic<bool> g_on{false};
std::atomic<bool> g_capturing{false};
std::atomic<uint64_t> g_enqueued{0};
std::atomic<uint64_t> g_completed{0};
}  // namespace detail

namespace {

struct Item {
  uint64_t seq;
  const char* name;
  Work work;      // null: a wait marker, complete as soon as its condition holds
  Where where;
  Record record;  // for the fuser (engine.h, Adaptive Eager)
  // Runs only once `after` has completed (an event's work: wait_event), or with `barrier`,
  // once everything up to `after` has (after_queue). 0: no condition.
  uint64_t after = 0;
  bool barrier = false;
};

// One stream's queue: its items run in order. Streams are independent except for waits.
struct StreamQueue {
  std::deque<Item> items;
  int priority = 0;  // as CUDA: lower runs first (-1 high, 0 normal)
  uint64_t last = 0;  // seq of the last work enqueued here (engine.h, last)
};

// On by default (twenty-second session: with it the demo trains 1.19x faster and no measured
// training step is slower, docs/benchmarks.md); TORCHNEURON_ASYNC_EXECUTION=0 or
// NEURON_LAUNCH_BLOCKING=1 keeps every kernel synchronous.
bool env_on() {
  const char* blocking = std::getenv("NEURON_LAUNCH_BLOCKING");
  if (blocking != nullptr && std::strcmp(blocking, "1") == 0) return false;
  const char* on = std::getenv("TORCHNEURON_ASYNC_EXECUTION");
  return on == nullptr || std::strcmp(on, "0") != 0;
}

constexpr size_t kTimes = 1 << 16;   // completions kept (a ring indexed by sequence number)
// A queue this long runs at the next enqueue. Measured on the 16-element add (bench/engine.py):
// 1,024 queued kernels cost 12.1 us an op, 64 cost 4.9, 16 about the same as 64: every queued
// kernel holds a few heap blocks (its aliases, closure, stack), and a deep queue pushes them
// out of malloc's per-thread caches. set_queue_limit sets it.
std::atomic<size_t> g_max_queued{64};

struct Engine {
  std::mutex mu;      // the queues and the bookkeeping below
  std::mutex run_mu;  // one thread runs kernels at a time
  std::map<int64_t, StreamQueue> streams;      // (device, stream) key -> its queue (never erased)
  size_t queued = 0;                           // items in all queues
  uint64_t running = 0;                        // first item being run now (0: none)
  std::string error;                           // first unreported kernel error
  Where error_where;                           // ... and where its op was enqueued
  std::array<std::atomic<int64_t>, kTimes> times{};  // completion time of seq (slot seq % kTimes)
  std::array<std::atomic<uint64_t>, kTimes> done{};  // the seq that completed in that slot
  std::atomic<uint64_t> drains{0};
  std::atomic<uint64_t> fused{0};
  std::atomic<uint64_t> regions{0};
  // The executor thread (set_executor_thread), if started: it sleeps on `wake` (with mu).
  bool executor_started = false;  // under mu
  bool executor_waiting = false;  // under mu: asleep, to be woken by enqueue
  std::condition_variable wake;
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

// The open graph capture (engine.h, begin_capture). Guarded by its own lock: work is
// recorded without touching the queues.
struct Capture {
  std::mutex mu;
  int device = -1;
  int64_t stream = 0;
  std::vector<Captured> items;
  std::string error;  // the first violation: the capture failed
};
Capture g_capture;

std::atomic<Describe> g_describe{nullptr};
std::atomic<Raise> g_raise{nullptr};
std::atomic<RunWork> g_run_work{nullptr};
std::atomic<CurrentWhere> g_current_where{nullptr};

// The violation names where the program made it: code between capture_begin and capture_end
// (a library's forward, say) may catch the op's exception, and capture_end then reports it.
[[noreturn]] void capture_violation(const std::string& what) {
  std::string text = what;
  const CurrentWhere current = g_current_where.load(std::memory_order_acquire);
  const Describe describe = g_describe.load(std::memory_order_acquire);
  if (current != nullptr && describe != nullptr) {
    try {
      if (Where where = current()) {
        const std::string stack = describe(where.get());
        if (!stack.empty()) text += "\nThe operation was called at (most recent call last):\n" + stack;
      }
    } catch (...) {
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_capture.mu);
    if (g_capture.error.empty()) g_capture.error = text;
  }
  throw std::runtime_error("neuron: " + text);
}

thread_local bool t_running = false;  // this thread is running queued kernels
std::atomic<BlockingWait> g_blocking_wait{nullptr};
std::atomic<ErrorText> g_error_text{nullptr};
std::atomic<Fuser> g_fuser{nullptr};
std::atomic<bool> g_executor{false};  // set_executor_thread
std::atomic<void (*)()> g_executor_init{nullptr};
std::atomic<void (*)()> g_flush{nullptr};

int64_t key(int device, int64_t stream) noexcept { return (static_cast<int64_t>(device) << 32) ^ stream; }

// Completion of one item. Items of different streams complete out of order, so g_completed is
// the low-water mark (everything up to it has completed) and the ring knows the rest.
bool is_done(Engine& e, uint64_t seq) noexcept {
  return seq <= detail::g_completed.load(std::memory_order_acquire) ||
         e.done[seq % kTimes].load(std::memory_order_acquire) == seq;
}

void mark_done(Engine& e, uint64_t seq, int64_t t) noexcept {
  e.times[seq % kTimes].store(t, std::memory_order_relaxed);
  e.done[seq % kTimes].store(seq, std::memory_order_release);
}

// Under e.mu: the low-water mark after completions.
void advance_locked(Engine& e) noexcept {
  uint64_t low = detail::g_enqueued.load(std::memory_order_relaxed);
  for (const auto& [k, q] : e.streams) {
    if (!q.items.empty()) low = std::min(low, q.items.front().seq - 1);
  }
  if (e.running != 0) low = std::min(low, e.running - 1);
  detail::g_completed.store(low, std::memory_order_release);
}

StreamQueue& stream_locked(Engine& e, int device, int64_t stream) {
  auto [it, fresh] = e.streams.try_emplace(key(device, stream));
  if (fresh) it->second.priority = device < 0 ? 0 : stream_priority(stream);
  return it->second;
}

// Under e.mu: queue `item` (its seq assigned here) on (device, stream); returns how many items
// are queued now.
size_t push_locked(Engine& e, int device, int64_t stream, Item item) {
  item.seq = detail::g_enqueued.load(std::memory_order_relaxed) + 1;  // written under mu only
  const uint64_t seq = item.seq;
  StreamQueue& q = stream_locked(e, device, stream);
  if (device >= 0) q.last = seq;
  // The executor thread, asleep, runs a queue that gained a kernel it may run now: anything but
  // a record-carrying kernel while fusing, which may still grow into a longer region
  // (executor_limit_locked). No wake-up (a futex call) for the others.
  const bool wakes = !item.record || g_fuser.load(std::memory_order_relaxed) == nullptr;
  q.items.push_back(std::move(item));
  detail::g_enqueued.store(seq, std::memory_order_release);
  if (e.executor_waiting && wakes && g_executor.load(std::memory_order_relaxed)) e.wake.notify_one();
  return ++e.queued;
}

// Under e.mu, a full queue about to run (Adaptive Eager on): how far to run it. A run of
// record-carrying kernels at the back of (device, stream)'s queue may still grow into a fused
// region: it stays queued and the queue runs up to the kernel before it, so regions end where
// the program puts a non-fusible kernel, never where the count of queued kernels happened to
// reach the limit. A training loop that never synchronizes would otherwise cut its regions at a
// point moving from step to step (the step's kernel count modulo the limit), and every cut is
// a new signature to compile. A queue of nothing but such a run runs whole (up to the limit:
// a region that long is cut where it began plus the limit, the same every time).
// The first item of the run of record-carrying kernels at the back of `q` (0: none).
uint64_t open_run_start(const StreamQueue& q) noexcept {
  uint64_t start = 0;
  for (auto it = q.items.rbegin(); it != q.items.rend() && it->record; ++it) start = it->seq;
  return start;
}

uint64_t run_before_open_region_locked(Engine& e, int device, int64_t stream, uint64_t seq) {
  const StreamQueue& q = stream_locked(e, device, stream);
  const uint64_t start = open_run_start(q);
  return start == 0 || start == q.items.front().seq ? seq : start - 1;
}

bool satisfied(Engine& e, const Item& item) noexcept {
  if (item.after == 0) return true;
  return item.barrier ? detail::g_completed.load(std::memory_order_acquire) >= item.after : is_done(e, item.after);
}

// Under e.mu: the stream whose first item runs next among items up to `limit` (a wait never
// runs kernels queued after what it waits for), or nullptr if none is left. Wait markers whose
// condition holds complete here. The schedule: the highest-priority stream, then the earliest
// item. With streams of one priority that is enqueue order; a high-priority stream's work
// overtakes earlier work of others, so a cross-stream dependency without wait_stream/wait_event
// breaks here as on a GPU. Never stuck: the earliest pending item's condition names earlier
// work, which has completed.
StreamQueue* pick_locked(Engine& e, uint64_t limit) {
  for (;;) {
    advance_locked(e);
    StreamQueue* best = nullptr;
    bool markers = false;
    for (auto& [k, q] : e.streams) {
      if (q.items.empty()) continue;
      Item& head = q.items.front();
      if (head.seq > limit || !satisfied(e, head)) continue;
      if (!head.work) {
        mark_done(e, head.seq, now_ns());
        q.items.pop_front();
        --e.queued;
        markers = true;
        continue;
      }
      if (best == nullptr || q.priority < best->priority ||
          (q.priority == best->priority && head.seq < best->items.front().seq)) {
        best = &q;
      }
    }
    if (!markers || best != nullptr) return best;
  }
}

// Offer the fuser the run of record-carrying kernels at the front of queue `q` (up to `seq`).
// Returns how many kernels to run on their own next (0: a fused region ran).
size_t try_fuse(Engine& e, StreamQueue& q, uint64_t seq) {
  Fuser fuser = g_fuser.load(std::memory_order_acquire);
  if (fuser == nullptr) return 1;
  std::vector<Record> held;  // keeps the records alive while the fuser reads them
  std::vector<const void*> records;
  std::vector<uint64_t> seqs;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    const size_t limit = g_max_queued.load(std::memory_order_relaxed);
    for (const Item& item : q.items) {
      if (!item.record || item.seq > seq || records.size() >= limit) break;
      held.push_back(item.record);
      records.push_back(item.record.get());
      seqs.push_back(item.seq);
    }
    if (!records.empty()) e.running = q.items.front().seq;
  }
  if (records.empty()) return 1;  // (one item may hold many records: a list kernel)
  Decision d;
  try {
    d = fuser(records, seqs);
  } catch (...) {
    d = Decision{0, 1};
  }
  if (d.fused == 0) {
    std::lock_guard<std::mutex> lock(e.mu);
    e.running = 0;
    advance_locked(e);
    return std::max<size_t>(d.unfused, 1);
  }
  std::deque<Item> done;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    // Only this thread pops (it holds run_mu), so the first `fused` items are the ones offered.
    for (size_t i = 0; i < d.fused; ++i) {
      done.push_back(std::move(q.items.front()));
      q.items.pop_front();
      --e.queued;
    }
    if (!d.error.empty() && e.error.empty()) {
      e.error = "neuron: a fused region of " + std::to_string(d.fused) + " kernels (the first " +
                done.front().name + ") failed on the device (TORCH_NEURONX_ENABLE_CONCATENATION=0 runs "
                "them one by one): " + d.error;
      e.error_where = std::move(done.front().where);
    }
  }
  seqs.resize(d.fused);  // the fused kernels' (the first offered)
  done.clear();  // releases the kernels' aliases before the region counts as complete
  held.clear();
  e.fused.fetch_add(d.fused, std::memory_order_relaxed);
  e.regions.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(e.mu);
  const int64_t t = now_ns();
  for (uint64_t s : seqs) mark_done(e, s, t);
  e.running = 0;
  advance_locked(e);
  return 0;
}

// Run queued kernels on this thread until `seq` has completed, or with `all`, everything up to
// it (another thread may be running them: then wait for it). Kernel errors are kept for the
// next report.
void run_until(Engine& e, uint64_t seq, bool all) {
  auto finished = [&] { return all ? detail::g_completed.load(std::memory_order_acquire) >= seq : is_done(e, seq); };
  if (t_running || finished()) return;
  std::unique_lock<std::mutex> run_lock(e.run_mu, std::try_to_lock);
  if (!run_lock.owns_lock()) {
    BlockingWait wrapper = g_blocking_wait.load(std::memory_order_acquire);
    if (wrapper != nullptr) wrapper([&] { run_lock.lock(); });
    else run_lock.lock();
  }
  t_running = true;
  const bool fusing = g_fuser.load(std::memory_order_acquire) != nullptr;
  size_t unfused = 0;  // kernels the fuser asked to run on their own before it is asked again
  // The queue lock is taken twice per kernel: to pick and pop it, and to mark it done (a
  // small share of a small kernel's host cost: three times measured ~2 % of a 16-element add).
  std::unique_lock<std::mutex> lock(e.mu);
  while (!finished()) {
    StreamQueue* q = pick_locked(e, seq);
    if (q == nullptr) break;
    if (fusing && unfused == 0) {
      lock.unlock();
      unfused = try_fuse(e, *q, seq);
      lock.lock();
      if (unfused == 0) continue;  // a fused region ran
    }
    if (unfused > 0) --unfused;
    Item item = std::move(q->items.front());
    q->items.pop_front();
    --e.queued;
    e.running = item.seq;
    lock.unlock();
    std::string failure;
    try {
      if (const RunWork run = g_run_work.load(std::memory_order_acquire)) {
        run(item.work);
      } else {
        item.work();
      }
    } catch (const std::exception& ex) {
      ErrorText text = g_error_text.load(std::memory_order_acquire);
      failure = text != nullptr ? text(ex) : ex.what();
    } catch (...) {
      failure = "unknown exception";
    }
    // Release what the work held (tensors: their memory returns to the allocator) before it
    // counts as complete, so memory stats are exact after a synchronization.
    item.work = nullptr;
    item.record = nullptr;
    if (failure.empty()) item.where = nullptr;  // (kept for the report otherwise)
    const int64_t t = now_ns();
    lock.lock();
    mark_done(e, item.seq, t);
    e.running = 0;
    advance_locked(e);
    if (!failure.empty() && e.error.empty()) {
      e.error = std::string("neuron: ") + item.name +
                " failed on the device (executed asynchronously; NEURON_LAUNCH_BLOCKING=1 raises "
                "at the call instead): " + failure;
      e.error_where = std::move(item.where);  // described when reported
    }
  }
  lock.unlock();
  if (auto flush = g_flush.load(std::memory_order_acquire)) {
    try {
      flush();
    } catch (...) {
    }
  }
  t_running = false;
}

// ---- the executor thread (set_executor_thread; off by default) ------------------------------
// With it the queues run on a thread of their own as soon as there is work, while Python runs
// ahead: the host's time and the kernels' overlap instead of adding up. Its kernels run with the
// host's intra-op thread count (the hook set_executor_thread_init), so they give the host's
// bits; the price is a second OpenMP team, which makes libgomp throttle every team of the
// process (docs/architecture.md, "Threads and cores": slower on the 2-core host). The host still
// runs the queues itself where it waits (run_until: it takes over once the executor's current
// batch is done), so ordering, error reports and stream semantics are unchanged; what changes is
// that a kernel may run any time after its enqueue.

// Under e.mu: how far the executor runs the queues now. Everything, except while fusing the run
// of record-carrying kernels at the back of each stream, which may still grow into a longer
// region: regions end where the program puts a non-fusible kernel or waits, not where the
// executor happened to catch up (which would make them depend on timing, and each new cut a
// kernel to compile).
uint64_t executor_limit_locked(Engine& e) {
  uint64_t upto = detail::g_enqueued.load(std::memory_order_relaxed);
  if (g_fuser.load(std::memory_order_acquire) == nullptr) return upto;
  for (const auto& [k, q] : e.streams) {
    if (const uint64_t open = open_run_start(q)) upto = std::min(upto, open - 1);
  }
  return upto;
}

void executor_main() {
  if (auto init = g_executor_init.load(std::memory_order_acquire)) {
    try {
      init();
    } catch (...) {
    }
  }
  Engine& e = engine();
  for (;;) {
    uint64_t upto = 0;
    {
      std::unique_lock<std::mutex> lock(e.mu);
      for (;;) {
        upto = g_executor.load(std::memory_order_acquire) ? executor_limit_locked(e) : 0;
        if (upto > detail::g_completed.load(std::memory_order_acquire)) break;
        e.executor_waiting = true;
        e.wake.wait(lock);
        e.executor_waiting = false;
      }
    }
    run_until(e, upto, /*all=*/true);
  }
}

// Under e.mu: start the executor thread of this engine (once; a forked child's engine starts
// its own at its first enqueue).
void start_executor_locked(Engine& e) {
  if (e.executor_started) return;
  e.executor_started = true;
  std::thread(executor_main).detach();  // never joined: it sleeps when there is nothing to run
}

void report(Engine& e) {
  std::unique_lock<std::mutex> lock(e.mu);
  if (e.error.empty()) return;
  std::string msg = std::move(e.error);
  Where where = std::move(e.error_where);
  e.error.clear();
  e.error_where = nullptr;
  lock.unlock();
  const Describe describe = g_describe.load(std::memory_order_acquire);
  if (where && describe) {
    try {
      const std::string stack = describe(where.get());
      if (!stack.empty()) msg += "\nThe op was enqueued at (most recent call last):\n" + stack;
    } catch (...) {
    }
  }
  if (const Raise raise = g_raise.load(std::memory_order_acquire)) raise(msg);
  throw std::runtime_error(msg);
}

}  // namespace

namespace detail {
bool running() noexcept { return t_running; }
// The configuration, read when the library loads.
const bool g_configured = [] {
  g_on.store(env_on());
  const char* thread = std::getenv("TORCHNEURON_EXECUTOR_THREAD");
  g_executor.store(thread != nullptr && std::strcmp(thread, "1") == 0);
  return true;
}();
}  // namespace detail

void set_enabled(bool on) noexcept {
  if (!on) drain_quietly();
  detail::g_on.store(on);
}

uint64_t enqueue(int device, int64_t stream, const char* name, Work work, Where where, Record record,
                 TracePayload tensors) {
  if (capturing()) {
    {
      std::lock_guard<std::mutex> lock(g_capture.mu);
      if (device == g_capture.device && stream == g_capture.stream) {
        g_capture.items.push_back(
            Captured{name, std::move(work), std::move(where), std::move(record), std::move(tensors)});
        return 0;
      }
    }
    capture_violation(std::string(name) + " was enqueued on another stream while a graph is being captured "
                      "(neuron captures the one stream current at capture_begin)");
  }
  Engine& e = engine();
  uint64_t seq, upto;
  size_t queued;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    if (__builtin_expect(g_executor.load(std::memory_order_relaxed) && !e.executor_started, 0)) {
      start_executor_locked(e);
    }
    queued = push_locked(e, device, stream, Item{0, name, std::move(work), std::move(where), std::move(record)});
    seq = upto = detail::g_enqueued.load(std::memory_order_relaxed);
    if (queued >= g_max_queued.load(std::memory_order_relaxed) && g_fuser.load(std::memory_order_acquire) != nullptr) {
      upto = run_before_open_region_locked(e, device, stream, seq);
    }
  }
  if (queued >= g_max_queued.load(std::memory_order_relaxed)) run_until(e, upto, /*all=*/true);
  return seq;
}

void enqueue_wait(int device, int64_t stream, uint64_t after) {
  Engine& e = engine();
  if (after == 0 || is_done(e, after)) return;
  Item marker{0, "wait_event", nullptr, nullptr, nullptr};
  marker.after = after;
  std::lock_guard<std::mutex> lock(e.mu);
  push_locked(e, device, stream, std::move(marker));  // an event recorded behind it waits too
}

uint64_t last(int device, int64_t stream) noexcept {
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.mu);
  auto it = e.streams.find(key(device, stream));
  return it == e.streams.end() ? 0 : it->second.last;
}

uint64_t last() noexcept { return detail::g_enqueued.load(std::memory_order_acquire); }

bool completed(uint64_t seq) noexcept { return is_done(engine(), seq); }

bool poll(uint64_t seq) noexcept {
  Engine& e = engine();
  if (is_done(e, seq)) return true;
  // A wait marker whose event has completed is not work: complete such markers first, so a
  // stream whose only pending items are satisfied waits queries idle (as cudaStreamQuery does
  // for a stream that waited on a completed event). Only if no thread is running the queue.
  if (std::unique_lock<std::mutex> run_lock(e.run_mu, std::try_to_lock); run_lock.owns_lock()) {
    std::lock_guard<std::mutex> lock(e.mu);
    (void)pick_locked(e, seq);
  }
  if (is_done(e, seq)) return true;
  if (g_executor.load(std::memory_order_acquire)) {
    // Never wait behind the executor's batch; when it is idle, run what it leaves (a trailing
    // fusible run) so a polling loop still finishes.
    std::unique_lock<std::mutex> run_lock(e.run_mu, std::try_to_lock);
    if (!run_lock.owns_lock()) return false;
  }
  try {
    run_until(e, seq, /*all=*/false);
  } catch (...) {
  }
  return false;
}

namespace {
void wait_for(uint64_t seq, bool all) {
  Engine& e = engine();
  if (t_running) return;  // a queued kernel's own ops run inline, in order
  if (capturing()) {
    capture_violation(
        "this operation cannot run while a graph is being captured (torch.accelerator.Graph): it makes the "
        "host wait for the device, or runs its kernel synchronously on neuron, outside the graph. neuron "
        "captures the ops it queues: in-place and out= ops, elementwise ops, matmuls, fp32/bf16 "
        "convolutions, layer and batch norm, GELU, relu, softmax, max pooling, sum/mean, losses, attention, "
        "scans, sorts, random ops, foreach lists, device copies and fills, non_blocking copies with pinned memory, "
        "torch.compile's kernels, and their backward; run the others (fp16 convolutions, selections such as "
        "median, reading values, ...) before or after the capture");
  }
  if (all ? detail::g_completed.load(std::memory_order_acquire) < seq : !is_done(e, seq)) {
    e.drains.fetch_add(1, std::memory_order_relaxed);
    run_until(e, seq, all);
  }
  report(e);
}
}  // namespace

void wait(uint64_t seq) { wait_for(seq, /*all=*/false); }

void drain() { wait_for(last(), /*all=*/true); }

void drain_quietly() noexcept {
  if (t_running || capturing()) return;  // (during a capture nothing is queued that could run)
  try {
    run_until(engine(), last(), /*all=*/true);
  } catch (...) {
  }
}

void after_queue(Work fn) {
  if (!queued()) {  // (not pending(): a capture must not hold releases back)
    fn();
    return;
  }
  Engine& e = engine();
  uint64_t seq;
  size_t queued;
  {
    std::lock_guard<std::mutex> lock(e.mu);
    Item item{0, "deferred release", std::move(fn), nullptr, nullptr};
    item.after = detail::g_enqueued.load(std::memory_order_relaxed);  // behind everything so far
    item.barrier = true;                                                // on every stream
    queued = push_locked(e, -1, -1, std::move(item));
    seq = detail::g_enqueued.load(std::memory_order_relaxed);
  }
  if (queued >= g_max_queued.load(std::memory_order_relaxed)) run_until(e, seq, /*all=*/true);
}

void begin_capture(int device, int64_t stream) {
  if (capturing()) throw std::runtime_error("neuron: a graph is already being captured (one capture at a time)");
  drain();  // work queued before the capture runs now: it is not part of the graph
  std::lock_guard<std::mutex> lock(g_capture.mu);
  if (detail::g_capturing.load()) {
    throw std::runtime_error("neuron: a graph is already being captured (one capture at a time)");
  }
  g_capture.device = device;
  g_capture.stream = stream;
  g_capture.items.clear();
  g_capture.error.clear();
  detail::g_capturing.store(true);
}

std::vector<Captured> end_capture() {
  std::vector<Captured> items;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(g_capture.mu);
    if (!detail::g_capturing.load()) throw std::runtime_error("neuron: no graph is being captured");
    detail::g_capturing.store(false);
    items.swap(g_capture.items);
    error.swap(g_capture.error);
  }
  if (!error.empty()) {
    items.clear();  // (releases what the recorded work held)
    throw std::runtime_error("neuron: the graph capture failed: " + error);
  }
  return items;
}

int64_t completion_time(uint64_t seq) noexcept {
  Engine& e = engine();
  if (seq == 0 || e.done[seq % kTimes].load(std::memory_order_acquire) != seq) return 0;
  return e.times[seq % kTimes].load(std::memory_order_relaxed);
}

void set_current_where(CurrentWhere current) noexcept { g_current_where.store(current, std::memory_order_release); }

void set_executor_thread(bool on) noexcept {
  g_executor.store(on, std::memory_order_release);
  Engine& e = engine();
  std::lock_guard<std::mutex> lock(e.mu);
  if (on) start_executor_locked(e);
  e.wake.notify_one();
}
bool executor_thread() noexcept { return g_executor.load(std::memory_order_acquire); }
void set_executor_thread_init(void (*init)()) noexcept { g_executor_init.store(init, std::memory_order_release); }

void set_queue_limit(size_t n) noexcept { g_max_queued.store(std::max<size_t>(n, 2), std::memory_order_relaxed); }

void set_fuser(Fuser fuser, void (*flush)()) noexcept {
  g_flush.store(flush, std::memory_order_release);
  g_fuser.store(fuser, std::memory_order_release);
}

void set_blocking_wait(BlockingWait wrapper) noexcept { g_blocking_wait.store(wrapper, std::memory_order_release); }

void set_error_text(ErrorText text) noexcept { g_error_text.store(text, std::memory_order_release); }

void set_describe(Describe describe) noexcept { g_describe.store(describe, std::memory_order_release); }
void set_raise(Raise raise) noexcept { g_raise.store(raise, std::memory_order_release); }
void set_run_work(RunWork run) noexcept { g_run_work.store(run, std::memory_order_release); }

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
