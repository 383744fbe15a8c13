// Per-device random number generators: counter-based Philox, like CUDA's.
//
// A generator is a (seed, offset) pair. Random kernels (random.cpp) reserve a range of offsets
// under the generator's mutex and compute every element from Philox4x32-10 keyed by the seed at
// counter (offset + element index) / 4, so a kernel's numbers do not depend on threads, chunking
// or what other ops ran before it, only on (seed, offset). This is what DTensor's offset-based
// tracker (torch/distributed/tensor/_random.py) relies on: a shard of a random tensor is the
// same op run at offset + (shard start), so sharded and unsharded random ops give the same
// full tensor. The state tensor is CUDA's: 16 bytes, uint64 seed then int64 offset.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace torchneuron {

// A captured graph's view of one generator: the (seed, offset) its replay starts from, written
// by each replay in stream order before the graph's kernels (CUDA's seed_extragraph /
// offset_extragraph, which a replay fills on the device).
struct GraphRngCell {
  uint64_t seed = 0, offset = 0;
};

// Where a queued random kernel gets its (seed, offset): fixed at the call, or, for a kernel
// recorded into a graph, the cell's values at the kernel's run plus its offset within the graph
// (CUDA's PhiloxCudaState). Resolved by get() when the kernel runs.
struct PhiloxArgs {
  uint64_t seed = 0, offset = 0;
  std::shared_ptr<const GraphRngCell> cell;  // set for a recorded kernel
  std::pair<uint64_t, uint64_t> get() const {
    if (cell) return {cell->seed, cell->offset + offset};
    return {seed, offset};
  }
};

// The state a generator and its graph-safe views share (CUDA's CUDAGeneratorState).
struct PhiloxState : c10::intrusive_ptr_target {
  std::mutex mu;  // offsets are reserved by any view's ops and by graph replays
  uint64_t seed = c10::default_rng_seed_val;
  uint64_t offset = 0;  // a multiple of 4 (one Philox block holds 4 32-bit words)
  // While a graph capture draws from this generator: the capture's cell, and the offsets the
  // graph has reserved so far (its kernels' offsets relative to the replay's start). The
  // generator's own offset does not move during a capture, as on CUDA.
  std::shared_ptr<GraphRngCell> cell;
  uint64_t intragraph = 0;
};

class NeuronGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(c10::DeviceIndex device,
                               c10::intrusive_ptr<PhiloxState> state = c10::make_intrusive<PhiloxState>());
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  void graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& state) override;
  c10::intrusive_ptr<c10::GeneratorImpl> graphsafe_get_state() const override;
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  // The (seed, offset) an op uses, advancing the offset by `increment` rounded up to a
  // multiple of 4; inside a graph capture of this generator's device, offsets within the graph.
  PhiloxArgs philox_engine_inputs(uint64_t increment);

 private:
  NeuronGeneratorImpl* clone_impl() const override;
  c10::intrusive_ptr<PhiloxState> state_;
};

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);

// The (seed, offset) for a random op on `device` drawing `increment` Philox words per block
// position: from `gen`, or the device's default generator when gen is None. A generator of
// another device type is rejected with CUDA's message. Inside a graph capture on `device` the
// result reads the graph's cell (the op must then be queued, hence recorded); a kernel run at
// the call resolves it at once with get().
PhiloxArgs reserve_philox(const std::optional<at::Generator>& gen, c10::DeviceIndex device, uint64_t increment);

// Random numbers in graphs (graph.cpp). Between begin_graph_rng(device) and end_graph_rng(),
// every generator of `device` a random op draws from joins the capture (CUDA asks for
// register_generator_state for generators other than the default; neuron registers each at its
// first use). end_graph_rng returns what each replay needs: the generator's state, the cell its
// recorded kernels read and the offsets one replay consumes.
struct GraphRngUse {
  c10::intrusive_ptr<PhiloxState> state;
  std::shared_ptr<GraphRngCell> cell;
  uint64_t increment;
  // At a replay: the generator's (seed, offset) now, its offset advanced past the graph's draws.
  std::pair<uint64_t, uint64_t> advance() const;
};
void begin_graph_rng(c10::DeviceIndex device);
std::vector<GraphRngUse> end_graph_rng();

}  // namespace torchneuron
