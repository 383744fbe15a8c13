#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Caching allocator for neuron device memory, in the shape of CUDA's and Neuron's:
//   * a small pool (requests < 1 MiB, carved from 2 MiB segments) and a large pool;
//   * requests < 16 MiB rounded up to a size class (4 classes per power of two, >= 256 B),
//     larger ones to 512 B;
//   * freed blocks are cached, split and coalesced inside their segment, and only returned
//     to the runtime by empty_cache() or when an allocation would otherwise fail;
//   * exceeding the device's capacity frees the cache, retries, then raises OutOfMemoryError;
//   * stream-ordered reuse: a block used on other streams (record_stream) is, when freed,
//     "pending": it leaves the allocated counters at once but stays active and out of the
//     pool until the host has observed each of those streams past the free (runtime.h,
//     host-observed progress), checked like CUDA's process_events at the next allocation.
//   * memory pools (torch.neuron.MemPool / use_mem_pool, as CUDA's): a thread's allocations
//     inside use_mem_pool come from, and return to, that pool's own segments;
//   * PYTORCH_ALLOC_CONF (also PYTORCH_CUDA_ALLOC_CONF, or torch._C._accelerator_setAllocatorSettings
//     at run time; c10's AcceleratorAllocatorConfig parses it) tunes it as it tunes CUDA's:
//     max_split_size_mb, max_non_split_rounding_mb, garbage_collection_threshold,
//     roundup_power2_divisions, large_segment_size_mb and expandable_segments (below).
//   * expandable segments (CUDA's design, its Note [Expandable Segments]): instead of a segment
//     per large request, one segment per stream and pool reserves address space for 9/8 of the
//     device's capacity and maps heap-file pages into it as it grows (2 MiB chunks for the small
//     pool, large_segment_size_mb for the large); a request takes the lowest address where free
//     and unmapped space fit it, so blocks of slightly different sizes tile one segment instead
//     of leaving slivers at the ends of many. empty_cache and the OOM retry unmap every whole
//     chunk of free blocks in them (the address space stays reserved for the segment to regrow). As in CUDA: mapped bytes count in reserved_bytes (not in the
//     segment counts), their free blocks are not inactive splits, MemPools keep ordinary
//     segments, and the snapshot shows each mapped run as a segment (is_expandable). The
//     runtime's heap file makes it real: reserved address space backed by a sparse file range,
//     pages mapped and unmapped in place (runtime.h, map_pages / unmap_pages).
//   * caching off (PYTORCH_NO_CUDA_MEMORY_CACHING set, or caching_allocator_enable(False)), as
//     CUDA's: each allocation is its own runtime allocation, freed at once, outside the cache
//     and its statistics (a debugging aid: nothing hides a use after free in cached memory).
// Stats follow c10::CachingDeviceAllocator::DeviceStats so torch.accelerator.* and
// torch.neuron.memory_* report them.
#include "allocator.h"

#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "../runtime/engine.h"
#include "../runtime/runtime.h"
#include "gpu_trace.h"
#include "ipc.h"

namespace torchneuron {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kMinBlock = 256;
constexpr size_t kSmallSize = 1 << 20;         // small pool threshold
constexpr size_t kSmallBuffer = 2 << 20;       // small segment size
constexpr size_t kMinLargeAlloc = 10 << 20;    // above: segment = request rounded to 2 MiB
constexpr size_t kRoundLarge = 2 << 20;
constexpr size_t kSizeClassLimit = 16 << 20;   // below: round to a size class

using Config = c10::CachingAllocator::AcceleratorAllocatorConfig;

// Whether roundup_power2_divisions was configured (c10's default: none anywhere).
bool configured_rounding() {
  for (size_t d : Config::roundup_power2_divisions()) {
    if (d != 0) return true;
  }
  return false;
}

size_t round_size(size_t n) {
  if (n < kMinBlock) return kMinBlock;
  if (configured_rounding()) {
    // CUDA's rule: `divisions` evenly spaced sizes between consecutive powers of two where
    // configured for this size, else a multiple of 512 B.
    const size_t divisions = Config::roundup_power2_divisions(n);
    if (divisions > 1 && n > 512 * divisions) {
      const size_t pow2 = size_t(1) << (63 - __builtin_clzll(n));
      if (pow2 == n) return n;
      const size_t step = std::max<size_t>(pow2 / divisions, 1);
      return (n + step - 1) / step * step;
    }
    return (n + 511) & ~size_t(511);
  }
  if (n >= kSizeClassLimit) return (n + 511) & ~size_t(511);
  // Four evenly spaced classes between consecutive powers of two.
  size_t pow2 = size_t(1) << (63 - __builtin_clzll(n));
  if (pow2 == n) return n;
  size_t step = pow2 / 4;
  return (n + step - 1) / step * step;
}

size_t segment_size(size_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  // (large_segment_size_mb, as CUDA's kLargeBuffer: 20 MiB unless configured)
  if (rounded < kMinLargeAlloc) return std::max(Config::large_segment_size(), rounded);
  return (rounded + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

struct Block {
  int device;
  int64_t stream;
  size_t size;
  size_t requested = 0;
  char* ptr;
  bool is_large;
  bool allocated = false;
  // ... and when it was last allocated, and that allocation's number (Adaptive Eager,
  // allocation_stamp, freed_by).
  uint64_t allocated_at = 0;
  uint64_t generation = 0;
  uint64_t free_tick = 0;  // when it was last freed, in frees (garbage collection: oldest first)
  bool oversize = false;   // allocated at least max_split_size_mb (counted in oversize_allocations)
  uint64_t mem_pool = 0;   // the MemPool its segment belongs to (0: the device's own)
  // Freed while other streams used it: out of the pool until event_count marks are observed.
  bool pending = false;
  int event_count = 0;
  Block* prev = nullptr;  // neighbours inside the segment
  Block* next = nullptr;
  std::vector<std::pair<int, int64_t>> stream_uses;  // record_stream: (device, stream id)
  std::shared_ptr<c10::GatheredContext> context;  // memory history: where it was allocated
  // Its segment is a graph memory pool's (mem_pool is then the pool): the replays of the graphs
  // captured into the pool read and write its free blocks too, so none is ever free for
  // Adaptive Eager (freed_by: their frees are not noted). Cleared when the pool is released.
  bool graph = false;
  struct Expandable* es = nullptr;  // the expandable segment it lies in, if any
  MemPoolOptions::FreeFn raw_free = nullptr;  // a MemPool allocator's free, for its segments
  bool remap = false;  // its segment is reserved address space with pages mapped (a remappable pool's)
  bool mapped = true;  // false: address space of an expandable segment with no pages behind it
  Block(int d, int64_t s, size_t sz, char* p, bool large)
      : device(d), stream(s), size(sz), ptr(p), is_large(large) {}
};

// An expandable segment: `span` bytes of reserved address space from `base`, whose pages are
// mapped `chunk` bytes at a time. Its blocks (mapped or not) always cover the whole span, so
// its head block starts at `base`.
struct Expandable {
  char* base;
  size_t span;
  size_t chunk;
};

// Unmapped blocks, by stream, pool and address: the lowest address that fits comes first.
struct UnmappedLess {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->is_large != b->is_large) return a->is_large < b->is_large;
    return a->ptr < b->ptr;
  }
};

struct BlockLess {
  bool operator()(const Block* a, const Block* b) const {
    if (a->mem_pool != b->mem_pool) return a->mem_pool < b->mem_pool;
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->ptr < b->ptr;
  }
};

// Memory a CPU kernel allocated and the device adopted (zero-copy outputs).
struct Adopted {
  c10::DataPtr cpu;
  int device;
  size_t nbytes;
  std::shared_ptr<c10::GatheredContext> context;  // memory history
  // record_stream, as for blocks: freed while used elsewhere, the memory is kept (pending)
  // until the host observed those streams, instead of going back to the host allocator.
  std::vector<std::pair<int, int64_t>> stream_uses = {};
  int event_count = 0;
  bool pending = false;
};

// A free-time mark on a stream that used a pending block (CUDA's outstanding event).
struct Outstanding {
  int device;
  int64_t stream;
  uint64_t mark;
  Block* block;       // a caching-allocator block, or
  Adopted* adopted;   // adopted memory
};

struct DeviceCache {
  std::mutex mu;
  std::deque<Outstanding> outstanding;  // in free order
  std::set<Block*, BlockLess> small_free, large_free;  // free mapped blocks
  std::set<Block*, UnmappedLess> unmapped;  // the unmapped blocks of expandable segments
  std::map<uintptr_t, Block*> segments;  // first block of each segment by base address
  std::unordered_set<Adopted*> adopted;
  // Segments of remappable pools whose pages are unmapped (sleep_mem_pool), by base address,
  // with the copy of their bytes when they were offloaded; and how many each pool has.
  std::map<uintptr_t, std::unique_ptr<char[]>> asleep;
  std::unordered_map<uint64_t, int> sleeping_pools;
  DeviceStats stats;
  uint64_t free_ticks = 0;  // frees so far (Block::free_tick)
};

DeviceCache g_cache[neuron::rt::kMaxDevices];

// Memory history recorder (null unless torch.neuron.memory._record_memory_history is on).
std::atomic<AllocatorRecorder*> g_recorder{nullptr};

inline std::shared_ptr<c10::GatheredContext> history_context(bool for_free = false) {
  AllocatorRecorder* r = g_recorder.load(std::memory_order_acquire);
  return r ? r->context(for_free) : nullptr;
}

inline void history(AllocAction action, int device, const void* ptr, size_t size, int64_t stream,
                    const std::shared_ptr<c10::GatheredContext>& ctx = nullptr) {
  if (AllocatorRecorder* r = g_recorder.load(std::memory_order_acquire)) {
    r->record(action, device, reinterpret_cast<size_t>(ptr), size, stream, ctx);
  }
}

inline void stat_add(StatArray& arr, bool large, int64_t delta) {
  auto apply = [delta](Stat& s) {
    if (delta >= 0) s.increase(static_cast<size_t>(delta));
    else s.decrease(static_cast<size_t>(-delta));
  };
  apply(arr[static_cast<size_t>(StatType::AGGREGATE)]);
  apply(arr[static_cast<size_t>(large ? StatType::LARGE_POOL : StatType::SMALL_POOL)]);
}

template <class F>
void for_each_stat(DeviceStats& s, F f) {
  for (StatArray* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                       &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                       &s.requested_bytes}) {
    for (Stat& st : *a) f(st);
  }
}

// Adopted memory is its own segment, fully allocated: it moves every counter at once.
// Caller holds c.mu; sign is +1 on adoption, -1 on release.
void count_adopted(DeviceCache& c, size_t nbytes, int sign) {
  const bool large = nbytes > kSmallSize;
  const int64_t bytes = sign * static_cast<int64_t>(nbytes);
  stat_add(c.stats.allocation, large, sign);
  stat_add(c.stats.active, large, sign);
  stat_add(c.stats.segment, large, sign);
  stat_add(c.stats.allocated_bytes, large, bytes);
  stat_add(c.stats.active_bytes, large, bytes);
  stat_add(c.stats.requested_bytes, large, bytes);
  stat_add(c.stats.reserved_bytes, large, bytes);
}

// A free block inside a segment that holds other blocks is an "inactive split" (CUDA's
// fragmentation counters). Call with sign -1 before a free block leaves its pool or changes
// size, +1 after it enters; the block's neighbour links must be the current ones.
// Not for expandable segments' blocks (CUDA's rule: their whole free chunks can be returned).
void count_free_split(DeviceCache& c, const Block* b, int sign) {
  if (b->es != nullptr || (b->prev == nullptr && b->next == nullptr)) return;
  stat_add(c.stats.inactive_split, b->is_large, sign);
  stat_add(c.stats.inactive_split_bytes, b->is_large, sign * static_cast<int64_t>(b->size));
}

std::string format_size(size_t bytes) {
  char buf[64];
  if (bytes < (1 << 10)) snprintf(buf, sizeof buf, "%zu bytes", bytes);
  else if (bytes < (1 << 20)) snprintf(buf, sizeof buf, "%.2f KiB", bytes / 1024.0);
  else if (bytes < (size_t(1) << 30)) snprintf(buf, sizeof buf, "%.2f MiB", bytes / 1048576.0);
  else snprintf(buf, sizeof buf, "%.2f GiB", bytes / 1073741824.0);
  return buf;
}

// Adopted memory whose free completed under the lock, deleted after it is released (its
// host deleter runs code that is not ours). Declare one before the lock guard.
using Graveyard = std::vector<std::unique_ptr<Adopted>>;
void process_events_locked(DeviceCache& c, bool sync, Graveyard& dead);

// The bytes of the segment whose first block is `head`.
size_t segment_bytes(const Block* head) {
  size_t n = 0;
  for (const Block* b = head; b != nullptr; b = b->next) n += b->size;
  return n;
}

using Asleep = std::map<uintptr_t, std::unique_ptr<char[]>>::iterator;

// The sleeping segment `asleep` (of pool `pool`) is awake again, or gone. Caller holds c.mu.
void forget_asleep_locked(DeviceCache& c, Asleep asleep, uint64_t pool) {
  if (--c.sleeping_pools[pool] == 0) c.sleeping_pools.erase(pool);
  c.asleep.erase(asleep);
}

// Map the pages of sleeping segment `head` again and restore its offloaded bytes (else the fresh
// pages read zeros); false, leaving it asleep, if the device has no room. Caller holds c.mu.
bool wake_segment_locked(DeviceCache& c, int device, Asleep asleep, Block* head) {
  const size_t size = segment_bytes(head);
  if (!neuron::rt::map_pages(device, head->ptr, size)) return false;
  if (asleep->second) std::memcpy(head->ptr, asleep->second.get(), size);
  forget_asleep_locked(c, asleep, head->mem_pool);
  return true;
}

// An ordinary segment that is one free block, returnable to the runtime.
bool idle_segment(const Block* head) {
  return head->es == nullptr && !head->allocated && !head->pending && head->next == nullptr;
}

// ... and not a live MemPool's: as CUDA's, a pool keeps its cached memory until it is released
// (empty_cache and the OOM retry leave it; use_on_oom lends it).
bool releasable_segment(const Block* head) { return head->mem_pool == 0 && idle_segment(head); }

bool expandable_on() { return Config::use_expandable_segments(); }

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// Point the segment map at `b` if it is its segment's first block. Caller holds c.mu.
void note_head(DeviceCache& c, Block* b) {
  if (b->prev == nullptr) c.segments[reinterpret_cast<uintptr_t>(b->ptr)] = b;
}

// Put `b` between `before` and `after` (either may be null).
void splice(Block* b, Block* before, Block* after) {
  b->prev = before;
  b->next = after;
  if (before) before->next = b;
  if (after) after->prev = b;
}

// A piece of `from` (same segment, stream and pool) at [ptr, ptr + size).
Block* piece_of(const Block* from, char* ptr, size_t size) {
  Block* b = new Block(from->device, from->stream, size, ptr, from->is_large);
  b->mem_pool = from->mem_pool;
  b->graph = from->graph;
  b->es = from->es;
  b->raw_free = from->raw_free;
  b->remap = from->remap;
  b->mapped = from->mapped;
  b->free_tick = from->free_tick;
  return b;
}

// `b` takes over the bytes of its neighbour `n` (b->prev or b->next), which is deleted; the
// caller has taken `n` out of its set.
void absorb(Block* b, Block* n) {
  if (n == b->prev) {
    b->ptr = n->ptr;
    splice(b, n->prev, b->next);
  } else {
    splice(b, b->prev, n->next);
  }
  b->size += n->size;
  b->free_tick = std::max(b->free_tick, n->free_tick);
  delete n;
}

// Merge unmapped neighbour `n` of unmapped block `b` into it. Caller holds c.mu.
void merge_unmapped(DeviceCache& c, Block* b, Block* n) {
  if (n == nullptr || n->mapped) return;
  c.unmapped.erase(n);
  absorb(b, n);
}

// Return idle segment `head` to the runtime; the caller erases it from c.segments. Caller
// holds c.mu.
void free_segment_locked(DeviceCache& c, int device, Block* head) {
  (head->is_large ? c.large_free : c.small_free).erase(head);
  stat_add(c.stats.reserved_bytes, head->is_large, -static_cast<int64_t>(head->size));
  stat_add(c.stats.segment, head->is_large, -1);
  c.stats.num_device_free++;
  history(AllocAction::SegmentFree, device, head->ptr, head->size, head->stream);
  if (head->remap) {  // (an idle segment: head->size is the segment's)
    auto asleep = c.asleep.find(reinterpret_cast<uintptr_t>(head->ptr));
    if (asleep != c.asleep.end()) {  // its pages (and capacity) are already gone
      forget_asleep_locked(c, asleep, head->mem_pool);
    } else {
      neuron::rt::unmap_pages(device, head->ptr, head->size);
    }
    neuron::rt::release_address_space(device, head->ptr);
  } else if (head->raw_free != nullptr) {
    head->raw_free(head->ptr, head->size, device, reinterpret_cast<void*>(head->stream));
    neuron::rt::release(device, head->size);
  } else {
    neuron::rt::free(device, head->ptr, head->size);
  }
  delete head;
}

// Unmap the whole chunks inside free block `b` of an expandable segment (CUDA's unmap_block):
// what is left of it on either side stays a free mapped block. Caller holds c.mu.
void unmap_block_locked(DeviceCache& c, int device, Block* b) {
  const Expandable& es = *b->es;
  const size_t offset = static_cast<size_t>(b->ptr - es.base);
  const size_t begin = round_up(offset, es.chunk), end = (offset + b->size) / es.chunk * es.chunk;
  if (begin >= end) return;
  auto& pool = b->is_large ? c.large_free : c.small_free;
  pool.erase(b);
  char* first = es.base + begin;
  const size_t len = end - begin;
  if (first > b->ptr) {
    Block* before = piece_of(b, b->ptr, static_cast<size_t>(first - b->ptr));
    splice(before, b->prev, b);
    note_head(c, before);
    pool.insert(before);
    b->ptr = first;
    b->size -= before->size;
  }
  if (b->size > len) {
    Block* after = piece_of(b, first + len, b->size - len);
    splice(after, b, b->next);
    pool.insert(after);
    b->size = len;
  }
  neuron::rt::unmap_pages(device, first, len, /*keep=*/true);  // (its next map is cheap)
  b->mapped = false;
  merge_unmapped(c, b, b->prev);
  merge_unmapped(c, b, b->next);
  note_head(c, b);
  c.unmapped.insert(b);
  stat_add(c.stats.reserved_bytes, b->is_large, -static_cast<int64_t>(len));
  c.stats.num_device_free++;
  history(AllocAction::SegmentUnmap, device, first, len, b->stream);
}

// Return every fully free segment to the runtime, and the free pages of expandable segments.
// An expandable segment left without pages keeps its address space (it costs no memory): it
// regrows in place, on the pages it unmapped last, which the runtime keeps (up to 64 MiB per
// device) so that mapping them again costs no page faults. Caller holds c.mu.
void release_cached_locked(DeviceCache& c, int device) {
  std::vector<Block*> expandable_free;
  for (const auto* pool : {&c.large_free, &c.small_free}) {
    for (Block* b : *pool) {
      if (b->es != nullptr) expandable_free.push_back(b);
    }
  }
  for (Block* b : expandable_free) unmap_block_locked(c, device, b);
  for (auto it = c.segments.begin(); it != c.segments.end();) {
    Block* head = it->second;
    if (releasable_segment(head)) {
      free_segment_locked(c, device, head);
      it = c.segments.erase(it);
    } else {
      ++it;
    }
  }
}

// garbage_collection_threshold (CUDA's garbage_collect): before a new large segment would
// take the device's reserved memory above threshold x the memory this process may use, return
// whole free large segments to the runtime, least recently freed first, until it would not
// (or none is left). Caller holds c.mu.
void garbage_collect_locked(DeviceCache& c, int device, size_t incoming) {
  const double target = Config::garbage_collection_threshold() * static_cast<double>(neuron::rt::memory_limit(device));
  auto reserved = [&] { return static_cast<double>(c.stats.reserved_bytes[0].current + incoming); };
  if (reserved() <= target) return;
  std::vector<Block*> idle;
  for (const auto& [addr, head] : c.segments) {
    if (head->is_large && releasable_segment(head)) idle.push_back(head);
  }
  std::sort(idle.begin(), idle.end(), [](const Block* a, const Block* b) { return a->free_tick < b->free_tick; });
  for (Block* head : idle) {
    if (reserved() <= target) break;
    c.segments.erase(reinterpret_cast<uintptr_t>(head->ptr));
    free_segment_locked(c, device, head);
  }
}

[[noreturn]] void raise_oom(DeviceCache& c, int device, size_t requested) {
  c.stats.num_ooms++;
  history(AllocAction::Oom, device, nullptr, requested, neuron::rt::current_stream(device));
  size_t cap = neuron::rt::capacity(device);
  size_t used = neuron::rt::used(device);
  size_t allocated = c.stats.allocated_bytes[0].current;
  size_t reserved = c.stats.reserved_bytes[0].current;
  c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(requested), allocated, reserved,
                                   c10::Device(c10::DeviceType::PrivateUse1, device));
  const size_t limit = neuron::rt::memory_limit(device);
  std::string allowed;
  if (limit < cap) {
    allowed = " This process may use " + format_size(limit) + " of it (set_per_process_memory_fraction(" +
              c10::str(neuron::rt::memory_fraction(device)) + ")).";
  }
  TORCH_CHECK_WITH(
      OutOfMemoryError, false, "neuron out of memory. Tried to allocate ", format_size(requested),
      ". neuron:", device, " has a total capacity of ", format_size(cap), " of which ",
      format_size(cap > used ? cap - used : 0), " is free.", allowed, " Of the allocated memory ",
      format_size(allocated), " is allocated by PyTorch, and ",
      format_size(reserved > allocated ? reserved - allocated : 0),
      " is reserved by PyTorch but unallocated.",
      reserved > allocated && !expandable_on()
          ? " If reserved but unallocated memory is large, try PYTORCH_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation."
          : "",
      " Free tensors you no longer need (del x), reduce the batch size, or set "
      "TORCHNEURON_DEVICE_MEMORY to emulate a larger device (see docs/env-vars.md).");
}

void delete_block(void* ctx);
void delete_adopted(void* ctx);

// Allocations are numbered (from 1); the last frees are remembered by number with the engine's
// last enqueued sequence number at the free, in a ring (Adaptive Eager asks about allocations
// freed while their kernels were queued, a few hundred at most: older ones count as unknown).
std::atomic<uint64_t> g_generation{0};
uint64_t next_generation() { return g_generation.fetch_add(1, std::memory_order_relaxed) + 1; }
struct Freed {
  uint64_t generation = 0;
  uint64_t seq = 0;
};
constexpr size_t kFreedRing = 4096;
std::mutex g_freed_mu;
std::array<Freed, kFreedRing> g_freed;
void note_free(uint64_t generation) {
  if (generation == 0) return;
  std::lock_guard<std::mutex> lock(g_freed_mu);
  g_freed[generation % kFreedRing] = {generation, neuron::rt::engine::last()};
}

void report_usage(DeviceCache& c, int device, void* ptr, int64_t delta) {
  if (!c10::memoryProfilingEnabled()) return;
  c10::reportMemoryUsageToProfiler(ptr, delta, c.stats.allocated_bytes[0].current,
                                   c.stats.reserved_bytes[0].current,
                                   c10::Device(c10::DeviceType::PrivateUse1, device));
}

// MemPools (torch.neuron.MemPool): ids from the graph pools' sequence, so no id means both.
std::mutex g_mem_pools_mu;
std::unordered_map<uint64_t, MemPoolOptions> g_mem_pools;  // live pools
// use_mem_pool on this thread: (device, pool), innermost last.
thread_local std::vector<std::pair<int, uint64_t>> t_mem_pools;

// The graph memory pool a capture is allocating into (graph.cpp), or 0. While one is open, every
// neuron allocation comes from that pool (its own segments; blocks freed in it serve only its
// later allocations), as CUDA routes a capture's allocations to its private pool.
std::atomic<uint64_t> g_capturing_graph{0};

uint64_t current_mem_pool(int device) {
  for (auto it = t_mem_pools.rbegin(); it != t_mem_pools.rend(); ++it) {
    if (it->first == device) return it->second;
  }
  return 0;
}

MemPoolOptions mem_pool_options(uint64_t pool) {
  if (pool == 0) return {};
  std::lock_guard<std::mutex> lock(g_mem_pools_mu);
  auto it = g_mem_pools.find(pool);
  return it != g_mem_pools.end() ? it->second : MemPoolOptions{};
}

// The pools an allocation outside any pool may take free blocks of when the device is full
// (use_on_oom), oldest first.
std::vector<uint64_t> oom_pools() {
  std::vector<uint64_t> ids;
  std::lock_guard<std::mutex> lock(g_mem_pools_mu);
  for (const auto& [id, options] : g_mem_pools) {
    if (options.use_on_oom) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

// The smallest cached block of pool `mem_pool` and this stream that fits (best fit), out of
// the free pool; nullptr if none. With max_split_size_mb, as CUDA: a request below it does not
// take an oversize block (which would not be split), and an oversize request takes one at most
// max_non_split_rounding_mb larger than itself. (Larger blocks fail the same tests, so the
// smallest decides.) Caller holds c.mu.
Block* take_cached_locked(DeviceCache& c, int device, bool large, uint64_t mem_pool, int64_t stream, size_t size) {
  auto& pool = large ? c.large_free : c.small_free;
  Block key(device, stream, size, nullptr, large);
  key.mem_pool = mem_pool;
  auto it = pool.lower_bound(&key);
  auto ours = [&](std::set<Block*, BlockLess>::iterator i) {
    return i != pool.end() && (*i)->mem_pool == mem_pool && (*i)->stream == stream;
  };
  if (ours(it) && (*it)->es != nullptr) {
    if (expandable_on()) {
      // As CUDA: a free block that an unmapped block follows can grow; best fit counts it at
      // that size, so a block of fixed size that fits is taken before it.
      auto growable = [](const Block* b) {
        return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
      };
      for (auto next = std::next(it); (*it)->es != nullptr && ours(next) && growable(*next) < growable(*it); ++next) {
        it = next;
      }
    } else {
      // Expandable segments switched off at run time: only ordinary segments serve requests.
      while (ours(it) && (*it)->es != nullptr) ++it;
    }
  }
  const size_t max_split = Config::max_split_size();
  if (!ours(it) || (size < max_split && (*it)->size >= max_split) ||
      (size >= max_split && (*it)->size >= size + Config::max_non_split_rounding_size())) {
    return nullptr;
  }
  Block* block = *it;
  pool.erase(it);
  count_free_split(c, block, -1);
  return block;
}

// A new segment of `seg` bytes from the runtime, or from the pool's own allocator (a MemPool
// made with one: its capacity still counted). nullptr when the device is full.
char* segment_memory(int device, size_t seg, int64_t stream, const MemPoolOptions& options) {
  if (options.remappable) {  // pages that can leave and come back at the same address
    void* ptr = neuron::rt::reserve_address_space(device, seg);
    if (ptr != nullptr && !neuron::rt::map_pages(device, ptr, seg)) {
      neuron::rt::release_address_space(device, ptr);
      ptr = nullptr;
    }
    return static_cast<char*>(ptr);
  }
  if (options.alloc_fn == nullptr) return static_cast<char*>(neuron::rt::malloc(device, seg));
  if (!neuron::rt::reserve(device, seg)) return nullptr;
  void* ptr = options.alloc_fn(seg, device, reinterpret_cast<void*>(stream));
  if (ptr == nullptr) neuron::rt::release(device, seg);
  return static_cast<char*>(ptr);
}

void try_merge(DeviceCache& c, std::set<Block*, BlockLess>& pool, Block* b, Block* n);

// Free what an allocation's retry may use (CUDA's free-and-retry): blocks shared with other
// processes that those have released wait in the IPC limbo (ipc.h), queued kernels
// (runtime/engine.h) hold the memory of tensors dropped since the call, pending blocks wait for
// other streams, and cached segments go back to the runtime. `lock` (on c.mu) is released
// meanwhile: freeing a block takes it.
void release_for_retry_locked(DeviceCache& c, int device, std::unique_lock<std::mutex>& lock, Graveyard& dead) {
  c.stats.num_alloc_retries++;
  lock.unlock();
  ipc_collect();
  neuron::rt::engine::drain_quietly();
  lock.lock();
  process_events_locked(c, /*sync=*/true, dead);
  release_cached_locked(c, device);
}

// The lowest address of this stream's expandable segments (of the pool) where free and
// unmapped space together fit `size`, starting at an unmapped block or the free block before
// it (CUDA's find_expandable_block); a new segment if none has room. nullptr if the host has no
// address space left. Caller holds c.mu.
Block* find_expandable_locked(DeviceCache& c, int device, int64_t stream, bool large, size_t size) {
  auto usable = [](const Block* b) { return b != nullptr && !b->allocated && !b->pending; };
  Block key(device, stream, 0, nullptr, large);
  for (auto it = c.unmapped.lower_bound(&key);
       it != c.unmapped.end() && (*it)->stream == stream && (*it)->is_large == large; ++it) {
    Block* start = usable((*it)->prev) ? (*it)->prev : *it;
    size_t room = 0;
    for (Block* b = start; b != nullptr && room < size && usable(b); b = b->next) room += b->size;
    if (room >= size) return start;
  }
  const size_t chunk = large ? Config::large_segment_size() : kSmallBuffer;
  const size_t cap = neuron::rt::capacity(device);
  const size_t span = round_up(cap + cap / 8, chunk);
  char* base = static_cast<char*>(neuron::rt::reserve_address_space(device, span));
  if (base == nullptr) return nullptr;
  Block* all = new Block(device, stream, span, base, large);
  all->es = new Expandable{base, span, chunk};
  all->mapped = false;
  c.unmapped.insert(all);
  c.segments.emplace(reinterpret_cast<uintptr_t>(base), all);
  return all;
}

// Map the first `n` bytes (rounded up to chunks) of unmapped block `b`; the mapped part joins
// its free neighbours, in the free pool. Returns that free block, or nullptr when the device
// has no room for the pages. Caller holds c.mu.
Block* map_block_locked(DeviceCache& c, int device, Block* b, size_t n,
                        const std::shared_ptr<c10::GatheredContext>& ctx) {
  const size_t len = std::min(round_up(n, b->es->chunk), b->size);
  if (!neuron::rt::map_pages(device, b->ptr, len)) return nullptr;
  c.unmapped.erase(b);
  if (len < b->size) {
    Block* rest = piece_of(b, b->ptr + len, b->size - len);
    splice(rest, b, b->next);
    c.unmapped.insert(rest);
    b->size = len;
  }
  b->mapped = true;
  stat_add(c.stats.reserved_bytes, b->is_large, static_cast<int64_t>(len));
  c.stats.num_device_alloc++;
  history(AllocAction::SegmentMap, device, b->ptr, len, b->stream, ctx);
  auto& pool = b->is_large ? c.large_free : c.small_free;
  try_merge(c, pool, b, b->prev);
  try_merge(c, pool, b, b->next);
  note_head(c, b);
  pool.insert(b);
  return b;
}

// A free block of at least `size` bytes from the stream's expandable segments, mapping what it
// needs (CUDA's try_allocate_expandable_block), out of the free pool; nullptr when the device
// is full (chunks mapped before the failure stay mapped and free). Caller holds c.mu.
Block* alloc_expandable_locked(DeviceCache& c, int device, int64_t stream, bool large, size_t size,
                               const std::shared_ptr<c10::GatheredContext>& ctx) {
  Block* b = find_expandable_locked(c, device, stream, large, size);
  if (b == nullptr) return nullptr;
  if (!b->mapped) b = map_block_locked(c, device, b, std::min(b->size, size), ctx);
  // Free, then unmapped blocks follow until there is room (find's guarantee).
  while (b != nullptr && b->size < size) {
    b = map_block_locked(c, device, b->next, std::min(size - b->size, b->next->size), ctx);
  }
  if (b != nullptr) (large ? c.large_free : c.small_free).erase(b);
  return b;
}

Block* malloc_block(int device, size_t nbytes) {
  neuron::rt::lazy_init();
  auto& c = g_cache[device];
  const size_t size = round_size(nbytes);
  const bool large = size > kSmallSize;
  const int64_t stream = neuron::rt::current_stream(device);
  const uint64_t graph_pool = g_capturing_graph.load(std::memory_order_acquire);
  const uint64_t mem_pool = graph_pool != 0 ? graph_pool : t_mem_pools.empty() ? 0 : current_mem_pool(device);
  const MemPoolOptions options = mem_pool_options(mem_pool);
  auto ctx = history_context();
  Graveyard dead;
  std::unique_lock<std::mutex> lock(c.mu);
  if (!c.outstanding.empty()) process_events_locked(c, /*sync=*/false, dead);
  TORCH_CHECK(mem_pool == 0 || c.sleeping_pools.count(mem_pool) == 0,
              "neuron: allocation in memory pool ", mem_pool, " while its memory is asleep on neuron:",
              device, " (sleep_mem_pool): wake it first");
  auto& pool = large ? c.large_free : c.small_free;
  const size_t max_split = Config::max_split_size();

  Block* block = take_cached_locked(c, device, large, mem_pool, stream, size);
  if (block == nullptr && expandable_on() && mem_pool == 0) {
    block = alloc_expandable_locked(c, device, stream, large, size, ctx);
    if (block == nullptr) {
      release_for_retry_locked(c, device, lock, dead);
      block = alloc_expandable_locked(c, device, stream, large, size, ctx);
    }
  } else if (block == nullptr) {
    const size_t seg = segment_size(size);
    if (large && Config::garbage_collection_threshold() > 0) garbage_collect_locked(c, device, seg);
    char* ptr = segment_memory(device, seg, stream, options);
    if (ptr == nullptr) {
      release_for_retry_locked(c, device, lock, dead);
      ptr = segment_memory(device, seg, stream, options);
    }
    if (ptr != nullptr) {
      c.stats.num_device_alloc++;
      history(AllocAction::SegmentAlloc, device, ptr, seg, stream, ctx);
      block = new Block(device, stream, seg, ptr, large);
      block->mem_pool = mem_pool;
      block->graph = graph_pool != 0;
      block->raw_free = options.free_fn;
      block->remap = options.remappable;
      c.segments.emplace(reinterpret_cast<uintptr_t>(ptr), block);
      stat_add(c.stats.segment, large, 1);
      stat_add(c.stats.reserved_bytes, large, static_cast<int64_t>(seg));
      if (size >= max_split) c.stats.oversize_segments.increase(1);
    }
  }
  // Out of memory: as a last resort, free blocks of the pools made with use_on_oom (CUDA's).
  if (block == nullptr && mem_pool == 0) {
    for (uint64_t id : oom_pools()) {
      if (c.sleeping_pools.count(id) != 0) continue;
      if ((block = take_cached_locked(c, device, large, id, stream, size)) != nullptr) break;
    }
  }
  if (block == nullptr) raise_oom(c, device, nbytes);
  // (a use_on_oom pool's block splits by that pool's rule)
  const bool no_split = block->mem_pool == mem_pool ? options.no_split : mem_pool_options(block->mem_pool).no_split;

  // Split off the remainder when it is worth keeping as its own block (never an oversize
  // request's: CUDA's should_split, which splits any remainder with expandable segments on).
  const size_t remaining = block->size - size;
  if (!no_split && (large && !expandable_on() ? remaining > kSmallSize && size < max_split
                                               : remaining >= kMinBlock)) {
    Block* rest = piece_of(block, block->ptr + size, remaining);
    splice(rest, block, block->next);
    block->size = size;
    pool.insert(rest);
    count_free_split(c, rest, +1);
  }
  block->allocated = true;
  block->allocated_at = neuron::rt::engine::last();
  block->generation = next_generation();
  block->requested = nbytes;
  block->context = ctx;
  block->oversize = block->size >= max_split;
  if (block->oversize) c.stats.oversize_allocations.increase(1);
  history(AllocAction::Alloc, device, block->ptr, block->size, stream, ctx);
  stat_add(c.stats.allocation, large, 1);
  stat_add(c.stats.active, large, 1);
  stat_add(c.stats.allocated_bytes, large, static_cast<int64_t>(block->size));
  stat_add(c.stats.active_bytes, large, static_cast<int64_t>(block->size));
  stat_add(c.stats.requested_bytes, large, static_cast<int64_t>(nbytes));
  report_usage(c, device, block->ptr, static_cast<int64_t>(block->size));
  return block;
}

// Merge `b` with free neighbour `n` (n is b->prev or b->next). Caller holds the lock.
void try_merge(DeviceCache& c, std::set<Block*, BlockLess>& pool, Block* b, Block* n) {
  if (!n || n->allocated || n->pending || !n->mapped) return;
  pool.erase(n);
  count_free_split(c, n, -1);
  absorb(b, n);
}

// The second half of a free (CUDA's free_block): the block stops being active and returns to
// its pool, merged with free neighbours. Caller holds c.mu.
void free_block_locked(DeviceCache& c, Block* b,
                       const std::shared_ptr<c10::GatheredContext>& ctx) {
  const bool large = b->is_large;
  history(AllocAction::FreeCompleted, b->device, b->ptr, b->size, b->stream, ctx);
  b->context.reset();
  stat_add(c.stats.active, large, -1);
  stat_add(c.stats.active_bytes, large, -static_cast<int64_t>(b->size));
  stat_add(c.stats.requested_bytes, large, -static_cast<int64_t>(b->requested));
  b->pending = false;
  b->requested = 0;
  b->free_tick = ++c.free_ticks;
  auto& pool = large ? c.large_free : c.small_free;
  const bool was_head = b->prev == nullptr;
  uintptr_t old_head_key = 0;
  if (!was_head) {
    Block* head = b;
    while (head->prev) head = head->prev;
    old_head_key = reinterpret_cast<uintptr_t>(head->ptr);
  }
  try_merge(c, pool, b, b->prev);
  try_merge(c, pool, b, b->next);
  if (!was_head && b->prev == nullptr) c.segments[old_head_key] = b;  // b became the head
  pool.insert(b);
  count_free_split(c, b, +1);
}

// A free requested by the block's owner (CUDA's free): it stops being allocated at once; it
// returns to the pool now unless other streams used it, then once the host has observed
// them past this point (process_events).
void release_block_locked(DeviceCache& c, Block* b,
                          const std::shared_ptr<c10::GatheredContext>& ctx) {
  const bool large = b->is_large;
  history(AllocAction::FreeRequested, b->device, b->ptr, b->size, b->stream, ctx);
  stat_add(c.stats.allocation, large, -1);
  stat_add(c.stats.allocated_bytes, large, -static_cast<int64_t>(b->size));
  if (b->oversize) c.stats.oversize_allocations.decrease(1);  // (the limit may have changed since)
  b->oversize = false;
  report_usage(c, b->device, b->ptr, -static_cast<int64_t>(b->size));
  b->allocated = false;
  if (b->stream_uses.empty()) {
    free_block_locked(c, b, ctx);
    return;
  }
  b->pending = true;
  for (const auto& [device, stream] : b->stream_uses) {
    const uint64_t mark = neuron::rt::mark_stream(device, stream);
    c.outstanding.push_back({device, stream, mark, b, nullptr});
    b->event_count++;
  }
  b->stream_uses.clear();
}

// Adopted memory is its own segment: its free completes by freeing the segment, returning
// the bytes to the host allocator. Caller holds c.mu; the caller deletes `a` after unlocking.
void free_adopted_locked(DeviceCache& c, Adopted* a,
                         const std::shared_ptr<c10::GatheredContext>& ctx) {
  const bool large = a->nbytes > kSmallSize;
  const auto bytes = static_cast<int64_t>(a->nbytes);
  history(AllocAction::FreeCompleted, a->device, a->cpu.get(), a->nbytes, 0, ctx);
  history(AllocAction::SegmentFree, a->device, a->cpu.get(), a->nbytes, 0, ctx);
  stat_add(c.stats.active, large, -1);
  stat_add(c.stats.segment, large, -1);
  stat_add(c.stats.active_bytes, large, -bytes);
  stat_add(c.stats.requested_bytes, large, -bytes);
  stat_add(c.stats.reserved_bytes, large, -bytes);
  c.adopted.erase(a);
  neuron::rt::release(a->device, a->nbytes);
}

// Return pending blocks whose marks the host has observed (CUDA's process_events, which
// queries each outstanding event). With sync, wait for them all instead (CUDA's
// synchronize_and_free_events, before memory is released to the device). Caller holds c.mu.
void process_events_locked(DeviceCache& c, bool sync, Graveyard& dead) {
  for (auto it = c.outstanding.begin(); it != c.outstanding.end();) {
    if (sync) {
      neuron::rt::observe(it->device, it->stream, it->mark);
    } else if (!neuron::rt::observed(it->device, it->stream, it->mark)) {
      ++it;
      continue;
    }
    Block* b = it->block;
    Adopted* a = it->adopted;
    it = c.outstanding.erase(it);
    if (b != nullptr && --b->event_count == 0) free_block_locked(c, b, nullptr);
    if (a != nullptr && --a->event_count == 0) {
      free_adopted_locked(c, a, nullptr);
      dead.emplace_back(a);
    }
  }
}

// Graph memory pools (graph.cpp): how many graphs hold a capture made into each. A pool's
// segments stay reserved for it until the last of them lets it go: their replays write them.
std::atomic<uint64_t> g_next_pool{1};
std::mutex g_graphs_mu;
std::unordered_map<uint64_t, int> g_graph_users;

void delete_block(void* ctx) {
  Block* b = static_cast<Block*>(ctx);
  auto& c = g_cache[b->device];
  gpu_trace::memory_deallocation(b->ptr, b->device, b->size);
  auto context = history_context(/*for_free=*/true);
  std::lock_guard<std::mutex> lock(c.mu);
  // Not a free for Adaptive Eager while other streams may still read it (record_stream), nor
  // in a graph's pool, whose replays read it again.
  if (b->stream_uses.empty() && !b->graph) note_free(b->generation);
  release_block_locked(c, b, context);
}

void delete_adopted(void* ctx) {
  auto* a = static_cast<Adopted*>(ctx);
  auto& c = g_cache[a->device];
  gpu_trace::memory_deallocation(a->cpu.get(), a->device, a->nbytes);
  auto context = history_context(/*for_free=*/true);
  {
    std::lock_guard<std::mutex> lock(c.mu);
    history(AllocAction::FreeRequested, a->device, a->cpu.get(), a->nbytes, 0, context);
    const bool large = a->nbytes > kSmallSize;
    stat_add(c.stats.allocation, large, -1);
    stat_add(c.stats.allocated_bytes, large, -static_cast<int64_t>(a->nbytes));
    report_usage(c, a->device, a->cpu.get(), -static_cast<int64_t>(a->nbytes));
    if (!a->stream_uses.empty()) {  // pending: completed by process_events_locked
      a->pending = true;
      for (const auto& [device, stream] : a->stream_uses) {
        c.outstanding.push_back({device, stream, neuron::rt::mark_stream(device, stream),
                                 nullptr, a});
        a->event_count++;
      }
      a->stream_uses.clear();
      return;
    }
    free_adopted_locked(c, a, context);
  }
  // Frees the CPU memory through its own deleter, once no queued kernel can still use it.
  neuron::rt::engine::after_queue([a] { delete a; });
}

// --- caching off ---------------------------------------------------------------------------
// CUDA's rule: the variable's presence turns caching off for the process.
const bool g_no_caching_env = std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING") != nullptr;
std::atomic<bool> g_caching_enabled{true};  // caching_allocator_enable

struct Uncached {
  int device;
  void* ptr;
  size_t nbytes;
};
std::mutex g_uncached_mu;
std::map<uintptr_t, Uncached*> g_uncached;  // live uncached allocations by address (device_of)

void delete_uncached(void* ctx) {
  auto* u = static_cast<Uncached*>(ctx);
  {
    std::lock_guard<std::mutex> lock(g_uncached_mu);
    g_uncached.erase(reinterpret_cast<uintptr_t>(u->ptr));
  }
  gpu_trace::memory_deallocation(u->ptr, u->device, u->nbytes);
  neuron::rt::free(u->device, u->ptr, u->nbytes);
  delete u;
}

c10::DataPtr allocate_uncached(int device, size_t nbytes) {
  TORCH_CHECK(g_capturing_graph.load(std::memory_order_acquire) == 0,
              "neuron: the caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING or "
              "torch.neuron.memory.caching_allocator_enable(False)), and a graph capture needs it to "
              "keep the graph's memory: turn caching on around the capture");
  void* ptr = neuron::rt::malloc(device, nbytes);
  if (ptr == nullptr) {
    // Memory the cache holds, IPC limbo and queued kernels are released first, as for a block.
    ipc_collect();
    neuron::rt::engine::drain_quietly();
    device_allocator()->emptyCache();
    ptr = neuron::rt::malloc(device, nbytes);
    if (ptr == nullptr) {
      auto& c = g_cache[device];
      std::lock_guard<std::mutex> lock(c.mu);
      raise_oom(c, device, nbytes);
    }
  }
  auto* u = new Uncached{device, ptr, nbytes};
  {
    std::lock_guard<std::mutex> lock(g_uncached_mu);
    g_uncached[reinterpret_cast<uintptr_t>(ptr)] = u;
  }
  gpu_trace::memory_allocation(ptr, device, nbytes);
  return c10::DataPtr(ptr, u, &delete_uncached, c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device)));
}

}  // namespace

void set_caching_enabled(bool enabled) { g_caching_enabled.store(enabled); }
bool caching_enabled() { return g_caching_enabled.load() && !g_no_caching_env; }

c10::DataPtr NeuronAllocator::allocate_on(int device, size_t nbytes) {
  neuron::rt::check_device(device);
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  if (nbytes == 0) {
    neuron::rt::lazy_init();
    return c10::DataPtr(nullptr, nullptr, nullptr, dev);
  }
  if (C10_UNLIKELY(!caching_enabled())) return allocate_uncached(device, nbytes);
  Block* b = malloc_block(device, nbytes);
  gpu_trace::memory_allocation(b->ptr, device, b->size);
  return c10::DataPtr(b->ptr, b, &delete_block, dev);
}

// A released pool (MemPool or graph pool): its idle segments go back to the runtime; the rest
// join the device's own pool (blocks still held return there when freed), as CUDA frees a
// destroyed pool's cached memory.
void dissolve_pool(uint64_t pool) {
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    auto& c = g_cache[d];
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto it = c.segments.begin(); it != c.segments.end();) {
      Block* head = it->second;
      if (head->mem_pool != pool) {
        ++it;
        continue;
      }
      if (idle_segment(head)) {
        free_segment_locked(c, d, head);
        it = c.segments.erase(it);
        continue;
      }
      auto asleep = c.asleep.find(it->first);
      // Tensors still use it: a sleeping segment's pages come back first.
      if (asleep != c.asleep.end() && !wake_segment_locked(c, d, asleep, head)) {
        TORCH_WARN("neuron: a released memory pool's segment still used by tensors could not get its "
                   "pages back (the device is full); it stays unmapped");
        ++it;
        continue;
      }
      for (Block* b = head; b; b = b->next) {
        auto& free_set = b->is_large ? c.large_free : c.small_free;
        const bool cached = !b->allocated && !b->pending && free_set.erase(b) != 0;
        b->mem_pool = 0;
        b->graph = false;
        if (cached) free_set.insert(b);
      }
      ++it;
    }
  }
}

uint64_t new_graph_pool_id() { return g_next_pool.fetch_add(1); }

void retain_graph_pool(uint64_t pool) {
  std::lock_guard<std::mutex> glock(g_graphs_mu);
  g_graph_users[pool]++;
}

void begin_graph_allocations(uint64_t pool) { g_capturing_graph.store(pool, std::memory_order_release); }

void end_graph_allocations() { g_capturing_graph.store(0, std::memory_order_release); }

void release_graph_pool(uint64_t pool) {
  {
    std::lock_guard<std::mutex> glock(g_graphs_mu);
    auto it = g_graph_users.find(pool);
    if (it == g_graph_users.end() || --it->second > 0) return;
    g_graph_users.erase(it);
  }
  dissolve_pool(pool);
}

uint64_t create_mem_pool(const MemPoolOptions& options) {
  TORCH_CHECK((options.alloc_fn == nullptr) == (options.free_fn == nullptr),
              "neuron: a memory pool's allocator needs both an allocation and a free function");
  const uint64_t id = new_graph_pool_id();
  std::lock_guard<std::mutex> lock(g_mem_pools_mu);
  g_mem_pools.emplace(id, options);
  return id;
}

void begin_mem_pool(int device, uint64_t pool) {
  neuron::rt::check_device(device);
  {
    std::lock_guard<std::mutex> lock(g_mem_pools_mu);
    TORCH_CHECK(g_mem_pools.count(pool) != 0, "neuron: memory pool ", pool, " does not exist (released?)");
  }
  t_mem_pools.emplace_back(device, pool);
}

void end_mem_pool(int device, uint64_t pool) {
  for (auto it = t_mem_pools.rbegin(); it != t_mem_pools.rend(); ++it) {
    if (it->first == device && it->second == pool) {
      t_mem_pools.erase(std::next(it).base());
      return;
    }
  }
  TORCH_CHECK(false, "neuron: memory pool ", pool, " is not in use on this thread for neuron:", device);
}

void release_mem_pool(uint64_t pool) {
  {
    std::lock_guard<std::mutex> lock(g_mem_pools_mu);
    if (g_mem_pools.erase(pool) == 0) return;
  }
  dissolve_pool(pool);
}

void sleep_mem_pool(uint64_t pool, bool offload) {
  neuron::rt::engine::drain();  // queued kernels may still use the memory
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    auto& c = g_cache[d];
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto& [base, head] : c.segments) {
      if (head->mem_pool != pool || c.asleep.count(base) != 0) continue;
      TORCH_CHECK(head->remap, "neuron: memory pool ", pool, " is not remappable (create it with remappable=True)");
      const size_t size = segment_bytes(head);
      std::unique_ptr<char[]> copy;
      if (offload) {
        copy.reset(new char[size]);
        std::memcpy(copy.get(), head->ptr, size);
      }
      neuron::rt::unmap_pages(d, head->ptr, size);
      c.asleep.emplace(base, std::move(copy));
      c.sleeping_pools[pool]++;
    }
  }
}

void wake_mem_pool(uint64_t pool) {
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    auto& c = g_cache[d];
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto it = c.asleep.begin(); it != c.asleep.end();) {
      Block* head = c.segments.at(it->first);
      auto next = std::next(it);
      if (head->mem_pool == pool && !wake_segment_locked(c, d, it, head)) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "neuron out of memory: waking memory pool ", pool,
                         " needs ", format_size(segment_bytes(head)), " more on neuron:", d, " (",
                         format_size(neuron::rt::used(d)), " of ", format_size(neuron::rt::memory_limit(d)),
                         " in use); free memory and wake it again");
      }
      it = next;
    }
  }
}

c10::DataPtr NeuronAllocator::allocate(size_t nbytes) {
  return allocate_on(neuron::rt::current_device(), nbytes);
}

c10::DataPtr NeuronAllocator::adopt(int device, c10::DataPtr cpu_data, size_t nbytes) {
  // Inside use_mem_pool the thread's allocations come from the pool: a CPU kernel's result is
  // copied into a block of it instead (the pool, e.g. vLLM's sleep mode, must hold it).
  if (C10_UNLIKELY(!t_mem_pools.empty()) && current_mem_pool(device) != 0) {
    c10::DataPtr block = allocate_on(device, nbytes);
    std::memcpy(block.get(), cpu_data.get(), nbytes);
    return block;
  }
  auto& c = g_cache[device];
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
  void* ptr = cpu_data.get();
  if (!neuron::rt::reserve(device, nbytes)) {
    Graveyard dead;
    std::unique_lock<std::mutex> lock(c.mu);
    release_for_retry_locked(c, device, lock, dead);
    if (!neuron::rt::reserve(device, nbytes)) raise_oom(c, device, nbytes);
  }
  auto context = history_context();
  auto* a = new Adopted{std::move(cpu_data), device, nbytes, context};
  {
    std::lock_guard<std::mutex> lock(c.mu);
    history(AllocAction::SegmentAlloc, device, ptr, nbytes, 0, context);
    history(AllocAction::Alloc, device, ptr, nbytes, 0, context);
    count_adopted(c, nbytes, 1);
    c.adopted.insert(a);
    report_usage(c, device, ptr, static_cast<int64_t>(nbytes));
  }
  gpu_trace::memory_allocation(ptr, device, nbytes);
  return c10::DataPtr(ptr, a, &delete_adopted, dev);
}

void NeuronAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

void NeuronAllocator::emptyCache(c10::MempoolId_t) {
  neuron::rt::engine::drain_quietly();  // memory queued kernels hold is released by them
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    auto& c = g_cache[d];
    Graveyard dead;
    std::lock_guard<std::mutex> lock(c.mu);
    process_events_locked(c, /*sync=*/true, dead);  // as CUDA's release_cached_blocks
    release_cached_locked(c, d);
  }
}

void NeuronAllocator::recordStream(const c10::DataPtr& ptr, c10::Stream stream) {
  const std::pair<int, int64_t> use{stream.device_index(), stream.id()};
  auto add = [&use](std::vector<std::pair<int, int64_t>>& uses) {
    for (const auto& u : uses) {
      if (u == use) return;
    }
    uses.push_back(use);
  };
  if (ptr.get_deleter() == &delete_adopted) {
    // Adopted memory belongs to no stream (a CPU kernel allocated it on the host): every
    // recorded stream counts, as a block's foreign streams do.
    auto* a = static_cast<Adopted*>(ptr.get_context());
    std::lock_guard<std::mutex> lock(g_cache[a->device].mu);
    add(a->stream_uses);
    return;
  }
  if (ptr.get_deleter() != &delete_block) return;  // empty tensors, memory of other processes
  Block* b = static_cast<Block*>(ptr.get_context());
  std::lock_guard<std::mutex> lock(g_cache[b->device].mu);
  // Uses on the block's own stream are ordered with its reuse already (as in CUDA).
  if (stream.device_index() == b->device && stream.id() == b->stream) return;
  add(b->stream_uses);
}

DeviceStats NeuronAllocator::getDeviceStats(c10::DeviceIndex device) {
  neuron::rt::check_device(device);
  auto& c = g_cache[device];
  std::lock_guard<std::mutex> lock(c.mu);
  return c.stats;
}

void NeuronAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  neuron::rt::check_device(device);
  auto& c = g_cache[device];
  std::lock_guard<std::mutex> lock(c.mu);
  for_each_stat(c.stats, [](Stat& s) { s.reset_accumulated(); });
  c.stats.num_alloc_retries = 0;
  c.stats.num_ooms = 0;
  c.stats.num_device_alloc = 0;
  c.stats.num_device_free = 0;
}

void NeuronAllocator::resetPeakStats(c10::DeviceIndex device) {
  neuron::rt::check_device(device);
  auto& c = g_cache[device];
  std::lock_guard<std::mutex> lock(c.mu);
  for_each_stat(c.stats, [](Stat& s) { s.reset_peak(); });
}

std::pair<size_t, size_t> NeuronAllocator::getMemoryInfo(c10::DeviceIndex device) {
  size_t cap = neuron::rt::capacity(device);
  size_t used = neuron::rt::used(device);
  return {cap > used ? cap - used : 0, cap};
}

int NeuronAllocator::device_of(const void* ptr) {
  auto p = reinterpret_cast<uintptr_t>(ptr);
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    auto& c = g_cache[d];
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.segments.upper_bound(p);
    if (it != c.segments.begin()) {
      --it;
      size_t total = 0;
      for (Block* b = it->second; b; b = b->next) total += b->size;
      if (p < it->first + total) return d;
    }
    for (Adopted* a : c.adopted) {
      auto base = reinterpret_cast<uintptr_t>(a->cpu.get());
      if (p >= base && p < base + a->nbytes) return d;
    }
  }
  std::lock_guard<std::mutex> lock(g_uncached_mu);
  auto it = g_uncached.upper_bound(p);
  if (it != g_uncached.begin() && p < std::prev(it)->first + std::prev(it)->second->nbytes) {
    return std::prev(it)->second->device;
  }
  return -1;
}

AllocationStamp allocation_stamp(const c10::DataPtr& data) {
  if (data.get_deleter() != &delete_block || data.get_context() == nullptr) return {};
  const Block* b = static_cast<const Block*>(data.get_context());
  std::lock_guard<std::mutex> lock(g_cache[b->device].mu);
  return {b->allocated_at, b->generation};
}

bool freed_by(uint64_t generation, uint64_t seq) {
  if (generation == 0) return false;
  std::lock_guard<std::mutex> lock(g_freed_mu);
  const Freed& f = g_freed[generation % kFreedRing];
  return f.generation == generation && f.seq <= seq;
}

std::vector<SegmentRecord> NeuronAllocator::snapshot() {
  std::vector<SegmentRecord> out;
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    auto& c = g_cache[d];
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto& [base, head] : c.segments) {
      // An expandable segment shows each run of mapped blocks as a segment, as CUDA's.
      for (Block* first = head; first != nullptr;) {
        if (!first->mapped) {
          first = first->next;
          continue;
        }
        SegmentRecord s{d, reinterpret_cast<size_t>(first->ptr), 0, 0, 0, 0, head->stream,
                        head->is_large, {}, head->mem_pool, head->es != nullptr, head->graph};
        Block* b = first;
        for (; b != nullptr && b->mapped; b = b->next) {
          s.total_size += b->size;
          if (b->allocated) s.allocated_size += b->size;
          if (b->allocated || b->pending) {
            s.active_size += b->size;
            s.requested_size += b->requested;
          }
          s.blocks.push_back({reinterpret_cast<size_t>(b->ptr), b->size, b->requested, b->allocated,
                              b->pending, b->allocated || b->pending ? b->context : nullptr});
        }
        out.push_back(std::move(s));
        first = b;
      }
    }
    for (Adopted* a : c.adopted) {
      auto addr = reinterpret_cast<size_t>(a->cpu.get());
      const size_t allocated = a->pending ? 0 : a->nbytes;
      out.push_back({d, addr, a->nbytes, allocated, a->nbytes, a->nbytes, 0, a->nbytes > kSmallSize,
                     {{addr, a->nbytes, a->nbytes, !a->pending, a->pending, a->context}}});
    }
  }
  return out;
}

NeuronAllocator* device_allocator() {
  static NeuronAllocator instance;
  return &instance;
}

void set_allocator_recorder(AllocatorRecorder* recorder) {
  g_recorder.store(recorder, std::memory_order_release);
}

// Registered for PrivateUse1 so at::empty, storage allocation and torch.accelerator.memory_*
// find it.
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, device_allocator())

// --- pinned host memory ------------------------------------------------------------------
namespace {
std::mutex g_host_mu;
std::unordered_map<void*, size_t> g_host_blocks;
at::HostStats g_host_stats;

int64_t micros_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
}

void delete_host(void* ptr) {
  bool known = false;
  {
    // Forgotten before the memory is freed: once freed, another thread may get the address.
    std::lock_guard<std::mutex> lock(g_host_mu);
    auto it = g_host_blocks.find(ptr);
    if (it != g_host_blocks.end()) {
      g_host_stats.active_requests.decrease(1);
      g_host_stats.active_bytes.decrease(it->second);
      g_host_stats.allocations.decrease(1);
      g_host_stats.allocated_bytes.decrease(it->second);
      g_host_stats.num_host_free++;
      g_host_blocks.erase(it);
      known = true;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  c10::free_cpu(ptr);
  if (known) {
    const int64_t took = micros_since(t0);
    std::lock_guard<std::mutex> lock(g_host_mu);
    g_host_stats.host_free_time.increase(took);  // (CUDA's: time in cudaHostFree)
  }
}
}  // namespace

c10::DataPtr NeuronHostAllocator::allocate(size_t nbytes) {
  c10::Device cpu(c10::DeviceType::CPU);
  if (nbytes == 0) return c10::DataPtr(nullptr, nullptr, nullptr, cpu);
  const auto t0 = std::chrono::steady_clock::now();
  void* ptr = c10::alloc_cpu(nbytes);
  const int64_t took = micros_since(t0);
  {
    std::lock_guard<std::mutex> lock(g_host_mu);
    g_host_blocks.emplace(ptr, nbytes);
    g_host_stats.active_requests.increase(1);
    g_host_stats.active_bytes.increase(nbytes);
    g_host_stats.allocations.increase(1);
    g_host_stats.allocated_bytes.increase(nbytes);
    g_host_stats.num_host_alloc++;
    g_host_stats.host_alloc_time.increase(took);  // (CUDA's: time in cudaHostAlloc)
  }
  return c10::DataPtr(ptr, ptr, &delete_host, cpu);
}

void NeuronHostAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

bool NeuronHostAllocator::record_event(void*, void*, c10::Stream) { return true; }
void NeuronHostAllocator::empty_cache() {}  // nothing is cached: blocks are freed at once

at::HostStats NeuronHostAllocator::get_stats() {
  std::lock_guard<std::mutex> lock(g_host_mu);
  return g_host_stats;
}
void NeuronHostAllocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(g_host_mu);
  g_host_stats.active_requests.reset_accumulated();
  g_host_stats.active_bytes.reset_accumulated();
  g_host_stats.allocations.reset_accumulated();
  g_host_stats.allocated_bytes.reset_accumulated();
  g_host_stats.num_host_alloc = 0;
  g_host_stats.num_host_free = 0;
  g_host_stats.host_alloc_time.reset_accumulated();
  g_host_stats.host_free_time.reset_accumulated();
}
void NeuronHostAllocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(g_host_mu);
  g_host_stats.active_requests.reset_peak();
  g_host_stats.active_bytes.reset_peak();
  g_host_stats.allocations.reset_peak();
  g_host_stats.allocated_bytes.reset_peak();
  g_host_stats.host_alloc_time.reset_peak();
  g_host_stats.host_free_time.reset_peak();
}

bool NeuronHostAllocator::is_pinned(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_host_mu);
  if (g_host_blocks.count(const_cast<void*>(ptr))) return true;
  // Interior pointers (views of pinned tensors) are pinned too.
  auto p = reinterpret_cast<uintptr_t>(ptr);
  for (auto& [base, n] : g_host_blocks) {
    auto b = reinterpret_cast<uintptr_t>(base);
    if (p >= b && p < b + n) return true;
  }
  return false;
}

NeuronHostAllocator* host_allocator() {
  static NeuronHostAllocator instance;
  return &instance;
}

REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, host_allocator())

}  // namespace torchneuron
