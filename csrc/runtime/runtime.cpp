#include "runtime.h"
#include "engine.h"

#include "trace.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <sstream>
#include <stdexcept>

namespace neuron::rt {
namespace {

constexpr int kStreamIds = 1 + kNumPriorities * kStreamsPerPool;  // default + pools

struct DeviceState {
  size_t capacity = 0;
  std::atomic<double> fraction{1.0};  // of the capacity, what reserve() allows this process
  std::atomic<size_t> used{0};
  std::atomic<uint32_t> next_pool_stream[kNumPriorities] = {};
  // Host-observed progress per stream id (runtime.h): marks handed out, and the watermark.
  std::atomic<uint64_t> marks[kStreamIds] = {};
  std::atomic<uint64_t> observed[kStreamIds] = {};
};

std::array<DeviceState, kMaxDevices> g_devices;

// One device's memory: a memfd whose page ranges are mapped as segments. File space is
// handed out first-fit from the holes left by freed segments, else by growing the file;
// a freed range has its pages punched out, so the file does not keep freed memory.
//
// Except the most recent freed segments, up to kRetainBytes per device: they stay mapped with
// their pages and the next segment of the same size reuses them. Faulting fresh shared-memory
// pages costs ~3 us per 4 KiB page, so without this a segment freed by empty_cache() and
// needed again costs 0.2 ms (2 MiB segment) to 3 ms (20 MiB) more than with glibc's malloc,
// which keeps freed memory below 32 MiB in its heap in the same way. Retained ranges count
// for nothing: the device's capacity was released with the segment.
constexpr size_t kRetainBytes = 64 << 20;

struct Heap {
  std::mutex mu;
  int fd = -1;
  pid_t owner = 0;        // the process that created the file (see on_fork_child)
  size_t file_size = 0;
  std::map<size_t, size_t> holes;                       // offset -> length
  std::map<uintptr_t, std::pair<size_t, size_t>> maps;  // address -> (offset, length)
  std::multimap<size_t, uintptr_t> retained;            // length -> address (still in maps)
  size_t retained_bytes = 0;
  // Pages of reserved address space unmapped with `keep` (unmap_pages): no longer accessible nor
  // counted, but still in the file; mapped again they cost no page faults. Within the same
  // kRetainBytes budget as `retained`, each list its own; over it, the oldest go first.
  struct Kept {
    size_t offset, len;  // in the file
    uint64_t seq;        // when it was kept (pieces of a range keep its number)
  };
  std::map<uintptr_t, Kept> kept;                     // by address
  std::set<std::pair<uint64_t, uintptr_t>> kept_age;  // (seq, address) of each entry, oldest first
  uint64_t kept_seq = 0;
  size_t kept_bytes = 0;
};
std::array<Heap, kMaxDevices> g_heaps;
const size_t g_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));

size_t round_pages(size_t n) { return (n + g_page - 1) / g_page * g_page; }

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::runtime_error("neuron runtime: " + what + ": " + std::strerror(errno));
}

// `len` (page multiple) bytes of the device's heap file mapped with `prot`: the first hole
// that fits, else the file grows (sparse: a file range costs nothing until its pages are
// touched). nullptr if the host is out of memory or address space. Caller holds h.mu.
void* heap_map_range_locked(Heap& h, int device, size_t len, int prot) {
  if (h.fd < 0) {
    std::string name = "neuron-hbm-" + std::to_string(device);
    h.fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    if (h.fd < 0) throw_errno("cannot create the device memory file (memfd_create)");
    h.owner = getpid();
  }
  size_t offset = h.file_size;
  auto hole = h.holes.begin();
  for (; hole != h.holes.end() && hole->second < len; ++hole) {}
  if (hole != h.holes.end()) {
    offset = hole->first;
    if (hole->second > len) h.holes.emplace(offset + len, hole->second - len);
    h.holes.erase(hole);
  } else if (ftruncate(h.fd, static_cast<off_t>(h.file_size + len)) == 0) {
    h.file_size += len;
  } else {
    return nullptr;
  }
  void* ptr = mmap(nullptr, len, prot, MAP_SHARED, h.fd, static_cast<off_t>(offset));
  if (ptr == MAP_FAILED) {
    h.holes.emplace(offset, len);  // the range stays free; the file keeps its size
    return nullptr;
  }
  h.maps.emplace(reinterpret_cast<uintptr_t>(ptr), std::make_pair(offset, len));
  return ptr;
}

// Map `len` (page multiple) new bytes of the device's heap file for a segment: a retained
// range of that length if there is one (its pages already faulted in). Caller holds h.mu.
void* heap_map_locked(Heap& h, int device, size_t len) {
  auto kept = h.retained.find(len);
  if (kept != h.retained.end()) {
    void* ptr = reinterpret_cast<void*>(kept->second);
    h.retained_bytes -= len;
    h.retained.erase(kept);
    return ptr;
  }
  return heap_map_range_locked(h, device, len, PROT_READ | PROT_WRITE);
}

// The mapping that holds `p`, or h.maps.end(). Caller holds h.mu.
std::map<uintptr_t, std::pair<size_t, size_t>>::iterator heap_find_locked(Heap& h, uintptr_t p) {
  auto it = h.maps.upper_bound(p);
  if (it == h.maps.begin()) return h.maps.end();
  --it;
  return p < it->first + it->second.second ? it : h.maps.end();
}

// Unmap a segment and return its file range. Caller holds h.mu.
void heap_release_locked(Heap& h, std::map<uintptr_t, std::pair<size_t, size_t>>::iterator it) noexcept {
  void* ptr = reinterpret_cast<void*>(it->first);
  auto [offset, len] = it->second;
  h.maps.erase(it);
  munmap(ptr, len);
  // A forked child shares the parent's file: it may drop its mappings, never the pages.
  if (h.owner != getpid()) return;
  fallocate(h.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
            static_cast<off_t>(len));
  // Coalesce with the neighbouring holes; a hole at the end shrinks the file instead.
  auto next = h.holes.lower_bound(offset);
  if (next != h.holes.end() && next->first == offset + len) {
    len += next->second;
    next = h.holes.erase(next);
  }
  if (next != h.holes.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      len += prev->second;
      h.holes.erase(prev);
    }
  }
  if (offset + len == h.file_size && ftruncate(h.fd, static_cast<off_t>(offset)) == 0) {
    h.file_size = offset;
  } else {
    h.holes.emplace(offset, len);
  }
}

void heap_unmap(int device, void* ptr) noexcept {
  Heap& h = g_heaps[device];
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.maps.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == h.maps.end()) return;
  const size_t len = it->second.second;
  if (h.owner != getpid() || len > kRetainBytes) {
    heap_release_locked(h, it);
    return;
  }
  // Keep it for reuse; over the budget, release retained ranges (smallest first).
  while (h.retained_bytes + len > kRetainBytes) {
    auto victim = h.retained.begin();
    h.retained_bytes -= victim->first;
    heap_release_locked(h, h.maps.find(victim->second));
    h.retained.erase(victim);
  }
  h.retained.emplace(len, reinterpret_cast<uintptr_t>(ptr));
  h.retained_bytes += len;
}

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
  // Another thread may have held a heap lock at the fork; the child has only this thread.
  for (auto& h : g_heaps) new (&h.mu) std::mutex();
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

void set_memory_fraction(int device, double fraction) {
  check_device(device);
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    std::ostringstream msg;
    msg << "Invalid fraction value: " << fraction << ". Allowed range: 0~1";
    throw std::invalid_argument(msg.str());
  }
  g_devices[device].fraction.store(fraction);
}

double memory_fraction(int device) {
  check_device(device);
  return g_devices[device].fraction.load();
}

namespace {
// (Exact for a fraction of 1: capacities are far below 2^53 bytes.)
size_t limit_of(const DeviceState& d) noexcept {
  return static_cast<size_t>(d.fraction.load(std::memory_order_relaxed) * static_cast<double>(d.capacity));
}
}  // namespace

size_t memory_limit(int device) {
  check_device(device);
  return limit_of(g_devices[device]);
}

bool reserve(int device, size_t nbytes) noexcept {
  auto& d = g_devices[device];
  const size_t allowed = limit_of(d);
  size_t cur = d.used.load(std::memory_order_relaxed);
  do {
    if (cur + nbytes > allowed) return false;
  } while (!d.used.compare_exchange_weak(cur, cur + nbytes));
  return true;
}

void release(int device, size_t nbytes) noexcept { g_devices[device].used.fetch_sub(nbytes); }

size_t used(int device) noexcept { return g_devices[device].used.load(); }

void* malloc(int device, size_t nbytes) {
  lazy_init();
  if (!reserve(device, nbytes)) return nullptr;
  // Page alignment (from mmap) exceeds the 64 bytes of c10's CPU allocator, so device bytes
  // alias as CPU tensors and vectorised CPU kernels see the alignment they expect.
  void* ptr = nullptr;
  {
    Heap& h = g_heaps[device];
    std::lock_guard<std::mutex> lock(h.mu);
    ptr = heap_map_locked(h, device, round_pages(nbytes == 0 ? 1 : nbytes));
  }
  if (ptr == nullptr) release(device, nbytes);  // the host is out of memory: device OOM
  return ptr;
}

void free(int device, void* ptr, size_t nbytes) noexcept {
  heap_unmap(device, ptr);
  release(device, nbytes);
}

void* reserve_address_space(int device, size_t nbytes) {
  lazy_init();
  Heap& h = g_heaps[device];
  std::lock_guard<std::mutex> lock(h.mu);
  return heap_map_range_locked(h, device, round_pages(nbytes), PROT_NONE);
}

namespace {
// Forget the kept pages inside [begin, end) (mapped again, or their reservation released),
// splitting ranges that stick out; with `punch`, return their pages to the host. Caller holds
// h.mu.
void drop_kept_locked(Heap& h, uintptr_t begin, uintptr_t end, bool punch) noexcept {
  auto it = h.kept.upper_bound(begin);
  if (it != h.kept.begin()) --it;
  while (it != h.kept.end() && it->first < end) {
    const uintptr_t a = it->first;
    const Heap::Kept k = it->second;
    const uintptr_t b = a + k.len;
    if (b <= begin) {
      ++it;
      continue;
    }
    it = h.kept.erase(it);
    h.kept_age.erase({k.seq, a});
    const uintptr_t lo = std::max(a, begin), hi = std::min(b, end);
    h.kept_bytes -= hi - lo;
    if (punch) {
      fallocate(h.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(k.offset + (lo - a)),
                static_cast<off_t>(hi - lo));
    }
    if (a < lo) {  // what sticks out stays kept, as old as it was
      h.kept.emplace(a, Heap::Kept{k.offset, lo - a, k.seq});
      h.kept_age.emplace(k.seq, a);
    }
    if (hi < b) {
      h.kept.emplace(hi, Heap::Kept{k.offset + (hi - a), b - hi, k.seq});
      h.kept_age.emplace(k.seq, hi);
    }
  }
}
}  // namespace

bool map_pages(int device, void* ptr, size_t nbytes) noexcept {
  if (!reserve(device, nbytes)) return false;
  if (mprotect(ptr, nbytes, PROT_READ | PROT_WRITE) != 0) {
    release(device, nbytes);
    return false;
  }
  Heap& h = g_heaps[device];
  std::lock_guard<std::mutex> lock(h.mu);
  if (h.kept_bytes != 0) {
    const auto p = reinterpret_cast<uintptr_t>(ptr);
    drop_kept_locked(h, p, p + nbytes, /*punch=*/false);
  }
  return true;
}

void unmap_pages(int device, void* ptr, size_t nbytes, bool keep) noexcept {
  mprotect(ptr, nbytes, PROT_NONE);
  {
    Heap& h = g_heaps[device];
    std::lock_guard<std::mutex> lock(h.mu);
    auto p = reinterpret_cast<uintptr_t>(ptr);
    auto it = heap_find_locked(h, p);
    // The pages go back to the host (a forked child shares the file: it leaves them), now or,
    // kept, once newer kept pages exceed the budget.
    if (it != h.maps.end() && h.owner == getpid()) {
      const size_t offset = it->second.first + (p - it->first);
      if (keep && nbytes <= kRetainBytes) {
        const uint64_t seq = ++h.kept_seq;
        h.kept.emplace(p, Heap::Kept{offset, nbytes, seq});
        h.kept_age.emplace(seq, p);
        h.kept_bytes += nbytes;
        while (h.kept_bytes > kRetainBytes) {
          const uintptr_t oldest = h.kept_age.begin()->second;
          drop_kept_locked(h, oldest, oldest + h.kept.at(oldest).len, /*punch=*/true);
        }
      } else {
        fallocate(h.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                  static_cast<off_t>(nbytes));
      }
    }
  }
  release(device, nbytes);
}

void release_address_space(int device, void* ptr) noexcept {
  Heap& h = g_heaps[device];
  std::lock_guard<std::mutex> lock(h.mu);
  auto it = h.maps.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == h.maps.end()) return;
  if (h.kept_bytes != 0) drop_kept_locked(h, it->first, it->first + it->second.second, /*punch=*/false);
  heap_release_locked(h, it);  // (punches the whole range)
}

bool find_shared(int device, const void* ptr, SharedRange* out) {
  Heap& h = g_heaps[device];
  std::lock_guard<std::mutex> lock(h.mu);
  auto p = reinterpret_cast<uintptr_t>(ptr);
  auto it = heap_find_locked(h, p);
  if (it == h.maps.end()) return false;
  out->fd = h.fd;
  out->offset = it->second.first + (p - it->first);
  return true;
}

void* malloc_aux(int device, size_t nbytes) {
  lazy_init();
  Heap& h = g_heaps[device];
  std::lock_guard<std::mutex> lock(h.mu);
  void* ptr = heap_map_locked(h, device, round_pages(nbytes));
  if (ptr == nullptr) throw_errno("cannot grow the device memory file");
  return ptr;
}

void* map_shared(int fd, size_t offset, size_t nbytes) {
  const size_t base = offset / g_page * g_page;
  void* ptr = mmap(nullptr, round_pages(offset - base + nbytes), PROT_READ | PROT_WRITE, MAP_SHARED,
                   fd, static_cast<off_t>(base));
  if (ptr == MAP_FAILED) throw_errno("cannot map memory shared by another process");
  return static_cast<char*>(ptr) + (offset - base);
}

void unmap_shared(void* ptr, size_t nbytes) noexcept {
  auto p = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t base = p / g_page * g_page;
  munmap(reinterpret_cast<void*>(base), round_pages(p - base + nbytes));
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

namespace {
bool known_stream(int device, int64_t stream_id) noexcept {
  return device >= 0 && device < kMaxDevices && stream_id >= 0 && stream_id < kStreamIds;
}
}  // namespace

uint64_t mark_stream(int device, int64_t stream_id) noexcept {
  if (!known_stream(device, stream_id)) return 0;
  return g_devices[device].marks[stream_id].fetch_add(1, std::memory_order_acq_rel) + 1;
}

bool observed(int device, int64_t stream_id, uint64_t mark) noexcept {
  if (!known_stream(device, stream_id)) return true;
  return g_devices[device].observed[stream_id].load(std::memory_order_acquire) >= mark;
}

void observe(int device, int64_t stream_id, uint64_t mark) noexcept {
  if (!known_stream(device, stream_id)) return;
  auto& w = g_devices[device].observed[stream_id];
  uint64_t cur = w.load(std::memory_order_relaxed);
  while (cur < mark && !w.compare_exchange_weak(cur, mark, std::memory_order_acq_rel)) {
  }
}

void observe_stream(int device, int64_t stream_id) noexcept {
  if (!known_stream(device, stream_id)) return;
  observe(device, stream_id, g_devices[device].marks[stream_id].load(std::memory_order_acquire));
}

bool query_stream(int device, int64_t stream_id) noexcept {
  if (!engine::poll(engine::last(device, stream_id))) return false;
  observe_stream(device, stream_id);  // idle: the host now knows every mark has passed
  return true;
}

// Without queued work there is nothing to wait for. The profiler still sees the
// synchronization points (their blocked time is measured; the estimated timeline replays
// them as stalls).
void synchronize_stream(int device, int64_t stream_id) {
  const int64_t t = trace::active() ? trace::now_ns() : 0;
  engine::wait(engine::last(device, stream_id));
  observe_stream(device, stream_id);
  if (!trace::active()) return;
  trace::record_sync("neuronStreamSynchronize", device, stream_id, t, trace::now_ns());
}

void synchronize_device(int device) {
  const int64_t t = trace::active() ? trace::now_ns() : 0;
  engine::drain();  // one queue for all devices: waiting for this one's work waits for all
  for (int64_t id = 0; id < kStreamIds; ++id) observe_stream(device, id);
  if (!trace::active()) return;
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
  // Behind queued work, the event completes (and takes its time) when that work has run.
  const uint64_t seq = engine::last(device, stream_id);
  event->seq = engine::completed(seq) ? 0 : seq;
  event->mark = mark_stream(device, stream_id);
  if (trace::active()) trace_event(trace::Kind::EventRecord, "neuronEventRecord", event, device, stream_id);
}

void synchronize_event(const Event* event) {
  if (event == nullptr || !event->recorded) return;
  const int64_t t = trace::active() ? trace::now_ns() : 0;
  engine::wait(event->seq);
  observe(event->device, event->stream_id, event->mark);
  if (!trace::active()) return;
  trace::record_sync("neuronEventSynchronize", event->device, event->stream_id, t, trace::now_ns());
}

bool query_event(const Event* event) noexcept {
  if (event == nullptr || !event->recorded) return true;  // never recorded: complete, as CUDA's
  if (!engine::poll(event->seq)) return false;
  observe(event->device, event->stream_id, event->mark);
  return true;
}

void wait_event(const Event* event, int device, int64_t stream_id) noexcept {
  if (event == nullptr || !event->recorded) return;
  engine::enqueue_wait(device, stream_id, event->seq);
  if (trace::active()) trace_event(trace::Kind::Wait, "neuronStreamWaitEvent", event, device, stream_id);
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
  if (start.device != end.device) {
    throw std::invalid_argument("Both events must be recorded on the same device (got neuron:" +
                                std::to_string(start.device) + " and neuron:" +
                                std::to_string(end.device) + ") to measure elapsed time.");
  }
  auto device_time = [](const Event& e) {
    if (e.seq == 0) return e.time_ns;
    if (!engine::completed(e.seq)) {
      throw std::invalid_argument(
          "Both events must have completed to measure elapsed time (work queued before a record "
          "is still running): synchronize the events or the stream first.");
    }
    const int64_t t = engine::completion_time(e.seq);
    return t != 0 ? t : e.time_ns;  // too old for the engine's record: the record time
  };
  return static_cast<double>(device_time(end) - device_time(start)) / 1e6;
}

}  // namespace neuron::rt
