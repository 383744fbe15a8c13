// The neuron device allocator (c10::DeviceAllocator) and the pinned host allocator.
#pragma once

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace torchneuron {

// One block as seen by memory_snapshot().
struct BlockRecord {
  size_t address, size, requested_size;
  bool allocated;
  bool pending;  // freed, waiting for other streams (record_stream): "active_pending_free"
  std::shared_ptr<c10::GatheredContext> context;  // where it was allocated (memory history)
};
struct SegmentRecord {
  int device;
  size_t address, total_size, allocated_size, active_size, requested_size;
  int64_t stream;
  bool is_large;
  std::vector<BlockRecord> blocks;
  uint64_t mem_pool = 0;  // its MemPool's id (0: the device's own pool)
  bool is_expandable = false;  // a mapped run of an expandable segment
  bool graph = false;          // mem_pool is a graph memory pool
};

class NeuronAllocator : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const final;
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

  // Allocate on an explicit device (allocate() uses the current one).
  c10::DataPtr allocate_on(int device, size_t nbytes);
  // Take ownership of memory a CPU kernel allocated, so it becomes device memory in place
  // (zero-copy) and is counted like any allocation. Raises OutOfMemoryError past capacity.
  c10::DataPtr adopt(int device, c10::DataPtr cpu_data, size_t nbytes);
  // Device of a pointer into neuron memory, or -1.
  int device_of(const void* ptr);
  std::vector<SegmentRecord> snapshot();
};

NeuronAllocator* device_allocator();
// Of the caching allocator's allocation holding `data` (zeros for memory it did not allocate
// from a block), for Adaptive Eager's fuser (fusion.cpp): `allocated_at`, the execution
// engine's last enqueued sequence number when it was made (work enqueued up to then cannot have
// used it), and `generation`, its number.
struct AllocationStamp {
  uint64_t allocated_at = 0;
  uint64_t generation = 0;
};
AllocationStamp allocation_stamp(const c10::DataPtr& data);
// Whether allocation `generation` was freed while the engine's last enqueued work was at most
// `seq` (false if it is live, or freed too long ago to be remembered, or freed while other
// streams used it, or in a graph pool, whose replays read its free blocks). Adaptive Eager leaves
// such memory unstored in a region ending at `seq`: kernels queued after that read only what live
// tensors held when they were enqueued, and anyone else writes memory before reading it.
bool freed_by(uint64_t generation, uint64_t seq);

// Graph capture (graph.cpp). Between begin_graph_allocations(pool) and end_graph_allocations()
// every neuron allocation comes from graph memory pool `pool`, CUDA's graph-private pool: its
// own segments, whose freed blocks serve only the pool's later allocations (later in the same
// capture, or in another capture into the pool) and never anyone else's, so no allocation
// outside the pool can take memory a replay writes. Reuse inside a pool follows the captures'
// stream order; graphs sharing a pool must not be replayed concurrently (CUDA's rule), and a
// graph's outputs freed after its capture may be reused by the next capture into the pool
// (what vLLM's weak references to graph outputs rely on). The pool's segments stay reserved
// until the last graph using it lets it go; graphs may share a pool (torch.cuda.graph's
// `pool=`); each retains it for as long as it holds its capture.
uint64_t new_graph_pool_id();  // a fresh pool id (graph ids come from the same sequence)
void retain_graph_pool(uint64_t pool);
void release_graph_pool(uint64_t pool);
void begin_graph_allocations(uint64_t pool);
void end_graph_allocations();

// Memory pools (torch.neuron.MemPool, use_mem_pool; CUDA's MemPool).
// Between begin_mem_pool(device, pool) and end_mem_pool on a thread, that thread's allocations
// on `device` come from the pool's own segments, and freed blocks of those segments serve only
// the pool's later allocations. Releasing the pool returns its idle segments to the runtime;
// segments still in use join the device's own pool.
struct MemPoolOptions {
  // A pluggable allocator's functions (torch.neuron.memory.NeuronPluggableAllocator): the pool's
  // segments come from alloc_fn(size, device, stream) and go back through free_fn(ptr, size,
  // device, stream) (stream: the neuron stream id, as a pointer), still within the device's
  // capacity. Both null: the runtime's memory.
  using AllocFn = void* (*)(size_t, int, void*);
  using FreeFn = void (*)(void*, size_t, int, void*);
  AllocFn alloc_fn = nullptr;
  FreeFn free_fn = nullptr;
  bool no_split = false;    // the pool's blocks are never split
  bool use_on_oom = false;  // an allocation outside any pool that finds the device full may
                            // take the pool's free blocks (CUDA's last resort)
  // Segments are reserved address space with pages mapped (runtime.h), so the pool can sleep:
  // what vLLM's sleep mode builds on CUDA with CuMemAllocator.
  bool remappable = false;
};
uint64_t create_mem_pool(const MemPoolOptions& options);
// A remappable pool's segments give their pages back to the device (its capacity is free
// again), after a copy to host memory with `offload`; the addresses stay reserved, so tensors
// keep their data pointers. Until woken, the pool cannot allocate and its tensors must not be
// used. Waking maps the pages again: the offloaded bytes are restored, the rest read as zeros.
// Raises OutOfMemoryError if the device has no room for them.
void sleep_mem_pool(uint64_t pool, bool offload);
void wake_mem_pool(uint64_t pool);
void begin_mem_pool(int device, uint64_t pool);
void end_mem_pool(int device, uint64_t pool);
void release_mem_pool(uint64_t pool);

// Whether allocations go through the cache (torch.neuron.memory.caching_allocator_enable; off
// for the whole process while PYTORCH_NO_CUDA_MEMORY_CACHING is set). Off, each allocation is
// a runtime allocation of its own, freed when its tensor is, outside the statistics (CUDA's).
void set_caching_enabled(bool enabled);
bool caching_enabled();

// Memory history (torch.neuron.memory._record_memory_history): the allocator reports every
// allocation, free, segment change and OOM to one recorder while one is set.
enum class AllocAction : uint8_t {
  Alloc, FreeRequested, FreeCompleted, SegmentAlloc, SegmentFree, SegmentMap, SegmentUnmap, Oom
};
class AllocatorRecorder {
 public:
  virtual ~AllocatorRecorder() = default;
  // The caller's context (a stack), gathered before the allocator takes its lock: gathering
  // may take the GIL, which a thread waiting for the allocator lock might hold.
  virtual std::shared_ptr<c10::GatheredContext> context(bool for_free) = 0;
  // Called with the device's allocator lock held: must not block.
  virtual void record(AllocAction action, int device, size_t address, size_t size, int64_t stream,
                      const std::shared_ptr<c10::GatheredContext>& context) = 0;
};
void set_allocator_recorder(AllocatorRecorder* recorder);  // nullptr: off

// Pinned ("page-locked") host memory: ordinary host memory that the device tracks, so
// is_pinned() is true and non_blocking copies may be issued from it.
class NeuronHostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override;
  void empty_cache() override;
  at::HostStats get_stats() override;
  void reset_accumulated_stats() override;
  void reset_peak_stats() override;
  bool is_pinned(const void* ptr);
};

NeuronHostAllocator* host_allocator();

}  // namespace torchneuron
