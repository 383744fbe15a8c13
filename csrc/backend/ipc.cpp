#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Interprocess sharing of neuron storages (see ipc.h for the protocol and CUDA's rules).
#include "ipc.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "../runtime/engine.h"
#include "../runtime/runtime.h"
#include "allocator.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

// Reference counters live in pages of the device's heap file, so a consumer maps them
// from the file descriptor it already receives for the data.
constexpr size_t kCounterPage = 4096;

struct CounterSlot {
  int64_t* ptr;
  size_t offset;  // in the heap file
};

struct CounterPool {
  std::mutex mu;
  std::vector<CounterSlot> free;

  CounterSlot acquire(int device) {
    std::lock_guard<std::mutex> lock(mu);
    if (free.empty()) {
      auto* page = static_cast<int64_t*>(neuron::rt::malloc_aux(device, kCounterPage));
      neuron::rt::SharedRange r{};
      TORCH_INTERNAL_ASSERT(neuron::rt::find_shared(device, page, &r));
      for (size_t i = 0; i < kCounterPage / sizeof(int64_t); ++i) {
        free.push_back({page + i, r.offset + i * sizeof(int64_t)});
      }
    }
    CounterSlot slot = free.back();
    free.pop_back();
    __atomic_store_n(slot.ptr, 1, __ATOMIC_RELEASE);
    return slot;
  }
  void release(CounterSlot slot) {
    std::lock_guard<std::mutex> lock(mu);
    free.push_back(slot);
  }
};
CounterPool g_counters[neuron::rt::kMaxDevices];

// What the producer's storage holds after an export: the original allocation and the
// counter consumers decrement.
struct SentData {
  c10::DataPtr original;
  int device;
  CounterSlot counter;
  int64_t consumers() const { return __atomic_load_n(counter.ptr, __ATOMIC_ACQUIRE); }
  ~SentData() { g_counters[device].release(counter); }  // `original` is freed after this
};

class Limbo {
 public:
  void add(std::unique_ptr<SentData> sd) {
    std::lock_guard<std::mutex> lock(mu_);
    blocks_.push_back(std::move(sd));
  }
  bool collect() {
    std::vector<std::unique_ptr<SentData>> released;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<std::unique_ptr<SentData>> kept;
      for (auto& sd : blocks_) (sd->consumers() > 0 ? kept : released).push_back(std::move(sd));
      blocks_ = std::move(kept);
    }
    // Freed outside the lock: freeing an original may free another sent block (a storage
    // sent twice), which collects again.
    const bool freed = !released.empty();
    released.clear();
    return freed;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return blocks_.size();
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<SentData>> blocks_;
};

// Never destroyed: blocks still held by consumers at exit stay mapped in those consumers
// (the pages outlive this process), and static destruction order must not matter.
Limbo& limbo() {
  static Limbo* instance = new Limbo();
  return *instance;
}

void delete_sent(void* ctx) {
  std::unique_ptr<SentData> sd(static_cast<SentData*>(ctx));
  if (sd->consumers() > 0) limbo().add(std::move(sd));
  limbo().collect();
}

// The consumer's side of a storage: its mapping and the producer's counter.
struct Received {
  void* data;
  size_t nbytes;
  int64_t* counter;
};

void delete_received(void* ctx) {
  // Released (the producer may reuse the block, the mapping goes) once every kernel that may use
  // the storage has run: after the execution engine's queue (runtime/engine.h).
  neuron::rt::engine::after_queue([r = static_cast<Received*>(ctx)] {
    std::unique_ptr<Received> owned(r);
    __atomic_fetch_sub(owned->counter, 1, __ATOMIC_ACQ_REL);
    neuron::rt::unmap_shared(owned->counter, sizeof(int64_t));
    neuron::rt::unmap_shared(owned->data, owned->nbytes);
  });
}

void init_runtime() {
  try {
    neuron::rt::lazy_init();
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

IpcHandle ipc_export(const c10::Storage& storage) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->device_type() == c10::DeviceType::PrivateUse1, "ipc_export: not a neuron storage");
  TORCH_CHECK(impl->data_ptr().get_deleter() != &delete_received,
              "Attempted to send neuron tensor received from another process; this is not "
              "currently supported. Consider cloning before sending.");
  const size_t nbytes = impl->nbytes();
  TORCH_CHECK(nbytes > 0, "ipc_export: empty storages are sent without memory");
  // The consumer must see every write queued before the send, as CUDA's sharing makes it
  // wait on an event the producer records (runtime/engine.h).
  neuron::rt::engine::drain();
  init_runtime();  // a forked child must not hand out its parent's memory
  const int device = impl->device().index();
  neuron::rt::SharedRange range{};
  if (!neuron::rt::find_shared(device, impl->data_ptr().get(), &range)) {
    c10::DataPtr fresh = device_allocator()->allocate_on(device, nbytes);
    std::memcpy(fresh.get(), impl->data_ptr().get(), nbytes);
    impl->set_data_ptr_noswap(std::move(fresh));
    TORCH_INTERNAL_ASSERT(neuron::rt::find_shared(device, impl->data_ptr().get(), &range));
  }
  auto* sd = new SentData{c10::DataPtr(), device, g_counters[device].acquire(device)};
  const size_t counter_offset = sd->counter.offset;
  c10::DataPtr sent(impl->data_ptr().get(), sd, &delete_sent, impl->device());
  sd->original = impl->set_data_ptr(std::move(sent));
  return {device, range.fd, range.offset, nbytes, counter_offset};
}

c10::Storage ipc_import(const IpcHandle& h) {
  init_runtime();  // the rule for forked children applies to receivers too
  try {
    neuron::rt::check_device(h.device);
  } catch (const std::out_of_range& e) {
    TORCH_CHECK(false, "Cannot receive a tensor on neuron:", h.device,
                " from another process: ", e.what());
  }
  void* data = nullptr;
  int64_t* counter = nullptr;
  try {
    data = neuron::rt::map_shared(h.fd, h.offset, h.nbytes);
    counter = static_cast<int64_t*>(neuron::rt::map_shared(h.fd, h.counter_offset, sizeof(int64_t)));
  } catch (const std::runtime_error& e) {
    if (data != nullptr) neuron::rt::unmap_shared(data, h.nbytes);
    TORCH_CHECK(false, e.what());
  }
  c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(h.device));
  c10::DataPtr ptr(data, new Received{data, h.nbytes, counter}, &delete_received, dev);
  // Not resizable: growing it would write past the producer's block (CUDA's rule).
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), h.nbytes, std::move(ptr), /*allocator=*/nullptr,
      /*resizable=*/false));
}

void ipc_release_counter(int fd, size_t counter_offset) {
  auto* counter = static_cast<int64_t*>(neuron::rt::map_shared(fd, counter_offset, sizeof(int64_t)));
  __atomic_fetch_sub(counter, 1, __ATOMIC_ACQ_REL);
  neuron::rt::unmap_shared(counter, sizeof(int64_t));
}

bool ipc_collect() { return limbo().collect(); }
size_t ipc_limbo_size() { return limbo().size(); }

}  // namespace torchneuron
