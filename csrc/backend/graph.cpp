// torch.accelerator.Graph on neuron: capture a stream's work once, replay it many times.
//
// torch 2.13 gives accelerators one graph API (at::GraphImplInterface, registered by device
// type); CUDA implements it with CUDA graphs. Here a graph is a recording of the execution
// engine's work items (runtime/engine.h, begin_capture): while capturing, an op that neuron
// queues (in-place and out= ops, same-shaped elementwise ops, foreach lists, small copies and
// fills, pinned non_blocking copies) is recorded instead of run, its outputs allocated as
// usual; replay() enqueues the recorded kernels again on the current stream, over the same
// memory. So, as with CUDA graphs, a capture does not run anything (`x += 1` captured leaves x
// unchanged until a replay), replays read the inputs' current contents and write the same
// outputs, and Adaptive Eager fuses replayed kernels like any others.
//
// What cannot be captured raises at the op and fails the capture: an op that runs its kernel
// synchronously on neuron (it would run now, outside the graph: fp16 convolutions, selections
// such as median, ops with data-dependent shapes), anything that makes the host wait for the
// device (.item(), .cpu(), synchronize), and work on another stream. CUDA raises for the
// second and third kind too; the first is this device's: its kernels are host code that
// runs where queuing is not possible.
//
// Random ops are captured as on CUDA (generator.h, begin_graph_rng): their kernels read the
// generator's (seed, offset) from a cell each replay writes first, in stream order, with the
// generator's values at the replay; the replay then moves the generator past the graph's draws.
//
// Memory (allocator.h): the capture allocates from the graph's memory pool (CUDA's
// graph-private pool): its own segments, whose blocks freed during the capture serve the
// capture's later allocations (a replay runs the kernels in the order they were recorded, so
// the later writer runs after the earlier reader, as on CUDA) and never an allocation outside
// the pool, until every graph captured into the pool is reset or destroyed. A capture given
// `pool` (another graph's pool() or torch.neuron.graph_pool_handle()) allocates into that
// pool and may reuse what the earlier captures freed, so graphs sharing a pool must be
// replayed one at a time (CUDA's rule); make_graphed_callables and vLLM's captures do.
#include <ATen/core/GraphImplInterface.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <fstream>
#include <string>
#include <vector>

#include "../runtime/engine.h"
#include "../runtime/runtime.h"
#include "allocator.h"
#include "generator.h"
#include "profiler.h"

namespace torchneuron {
namespace {

namespace engine = neuron::rt::engine;

class NeuronGraph final : public at::GraphImplInterface {
 public:
  explicit NeuronGraph(const at::GraphImplArgs& /*args*/) : id_(new_graph_pool_id()) {}
  ~NeuronGraph() override {
    if (capturing_) {  // destroyed mid-capture (capture_end never called): close it, keep nothing
      capturing_ = false;
      end_graph_allocations();
      end_graph_rng();
      try {
        engine::end_capture();
      } catch (...) {
      }
    }
    release();
  }

  void capture_begin(at::MempoolId_t pool, at::GraphCaptureMode /*mode*/) override {
    TORCH_CHECK(!captured_ && !capturing_,
                "neuron: this graph already holds a capture; call reset() before capturing again");
    TORCH_CHECK(pool.second == 0,
                "neuron: (", pool.first, ", ", pool.second, ") is not a neuron graph memory pool; pass another "
                "graph's pool() or torch.neuron.graph_pool_handle()");
    device_ = neuron::rt::current_device();
    stream_ = neuron::rt::current_stream(device_);
    pool_ = pool.first != 0 ? pool.first : id_;
    retain_graph_pool(pool_);
    begin_graph_allocations(pool_);
    try {
      engine::begin_capture(device_, stream_);
    } catch (...) {
      end_graph_allocations();
      release_pool();
      throw;
    }
    begin_graph_rng(static_cast<c10::DeviceIndex>(device_));
    capturing_ = true;
  }

  void capture_end() override {
    TORCH_CHECK(capturing_, "neuron: capture_end() without capture_begin()");
    capturing_ = false;
    end_graph_allocations();
    std::vector<GraphRngUse> rng = end_graph_rng();
    try {
      items_ = engine::end_capture();
    } catch (...) {
      release_pool();
      throw;
    }
    rng_ = std::move(rng);
    captured_ = true;
  }

  // Nothing to build: the recording is what replay() enqueues.
  void instantiate() override { TORCH_CHECK(captured_, "neuron: instantiate() before a capture"); }

  void replay() override {
    TORCH_CHECK(captured_, "neuron: replay() before a capture ended");
    TORCH_CHECK(!engine::capturing(), "neuron: replaying a graph while a graph is being captured");
    const int64_t stream = neuron::rt::current_stream(device_);
    // Each generator the graph draws from gives this replay its own numbers: the graph's range of
    // offsets starts at the generator's offset now, which moves past it (CUDA's replay_prologue).
    // The recorded kernels read the start from the cell, written in stream order before them.
    for (const GraphRngUse& use : rng_) {
      const auto [seed, offset] = use.advance();
      engine::enqueue(
          device_, stream, "neuron::graph_rng_state",
          [cell = use.cell, seed = seed, offset = offset]() {
            cell->seed = seed;
            cell->offset = offset;
          },
          nullptr);
    }
    // Under torch.profiler each replayed kernel is a device activity (tagged with the graph),
    // as CUDA's profiler shows a graph's kernels; its fusion record is dropped so it runs, and is
    // timed, as itself.
    const bool traced = neuron::rt::trace::active();
    for (const engine::Captured& item : items_) {
      if (traced) {
        engine::enqueue(device_, stream, item.name, prof::traced_replay(item.work, item.name, device_, stream, id_, item.tensors.get()),
                        item.where, nullptr);
      } else {
        engine::enqueue(device_, stream, item.name, item.work, item.where, item.record);
      }
    }
    // With the engine off every op is synchronous, and so is a replay.
    if (!engine::configured()) engine::drain();
  }

  void reset() override {
    TORCH_CHECK(!capturing_, "neuron: reset() during a capture; end it first");
    release();
  }

  // The pool this graph's capture allocates (allocated) into: its own unless given another.
  at::MempoolId_t pool() const override { return {static_cast<c10::CaptureId_t>(pool_ != 0 ? pool_ : id_), 0}; }

  void enable_debug_mode() override {}  // debug_dump works without it

  // One line per recorded kernel, in replay order.
  void debug_dump(const std::string& path) override {
    TORCH_CHECK(captured_, "neuron: debug_dump() before a capture ended");
    std::ofstream out(path);
    TORCH_CHECK(out, "neuron: cannot write ", path);
    out << "neuron graph " << id_ << ": " << items_.size() << " kernels, device " << device_ << "\n";
    for (const engine::Captured& item : items_) out << item.name << "\n";
  }

 private:
  void release() {
    if (captured_) engine::drain_quietly();  // replays still queued use the graph's memory
    items_.clear();
    rng_.clear();
    captured_ = false;
    release_pool();
  }
  void release_pool() {
    if (pool_ != 0) release_graph_pool(pool_);
    pool_ = 0;
  }

  const uint64_t id_;
  uint64_t pool_ = 0;  // retained from capture_begin until released
  int device_ = 0;
  int64_t stream_ = 0;
  bool capturing_ = false;
  bool captured_ = false;
  std::vector<engine::Captured> items_;
  std::vector<GraphRngUse> rng_;  // the generators the recorded kernels draw from
};

}  // namespace
}  // namespace torchneuron

// The registry is keyed by c10::DeviceTypeName(PrivateUse1, /*lower_case=*/false): the
// backend's name, upper case.
namespace at {
C10_REGISTER_TYPED_CLASS(GraphImplRegistry, "NEURON", torchneuron::NeuronGraph)
}  // namespace at
