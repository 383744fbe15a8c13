#include "trace.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <mutex>

namespace neuron::rt::trace {
namespace detail {
std::atomic<bool> g_active{false};
}

namespace {
std::mutex g_mu;
std::vector<Record> g_records;
std::atomic<uint64_t> g_next_id{1};

thread_local std::vector<uint64_t> t_correlation;
thread_local int32_t t_scope = 0;
thread_local int t_suppress = 0;
thread_local int32_t t_tid = 0;
std::atomic<ContextHook> g_context_hook{nullptr};
}  // namespace

void set_context_hook(ContextHook hook) noexcept { g_context_hook.store(hook); }

void start() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_records.clear();
  detail::g_active.store(true);
}

void stop() { detail::g_active.store(false); }

std::vector<Record> drain() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<Record> out;
  out.swap(g_records);
  return out;
}

int64_t now_ns() noexcept {
  timespec t{};
  clock_gettime(CLOCK_REALTIME, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

int32_t thread_id() noexcept {
  // The id kineto and the profiler use for CPU threads (gettid), cached per thread.
  if (t_tid == 0) t_tid = static_cast<int32_t>(::syscall(SYS_gettid));
  return t_tid;
}

uint64_t next_id() noexcept { return g_next_id.fetch_add(1, std::memory_order_relaxed); }

void record(Record&& r) {
  if (!active() || t_suppress > 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_records.push_back(std::move(r));
}

void push_correlation(uint64_t id) { t_correlation.push_back(id); }

void pop_correlation() {
  if (!t_correlation.empty()) t_correlation.pop_back();
}

uint64_t current_correlation() noexcept {
  return t_correlation.empty() ? 0 : t_correlation.back();
}

void set_scope(int32_t scope) noexcept { t_scope = scope; }
int32_t current_scope() noexcept { return t_scope; }

void suppress(bool on) noexcept { t_suppress += on ? 1 : (t_suppress > 0 ? -1 : 0); }
bool suppressed() noexcept { return t_suppress > 0; }

void record_sync(const char* name, int device, int64_t stream, int64_t start_ns, int64_t end_ns) {
  if (!active() || t_suppress > 0) return;
  Record r;
  r.id = next_id();
  r.external = current_correlation();
  r.kind = Kind::Sync;
  r.blocking = true;
  r.device = device;
  r.stream = stream;
  r.tid = thread_id();
  r.scope = t_scope;
  r.launch_start_ns = r.start_ns = start_ns;
  r.launch_end_ns = r.end_ns = end_ns;
  r.name = name;
  if (ContextHook hook = g_context_hook.load()) r.context = hook();
  record(std::move(r));
}

}  // namespace neuron::rt::trace
