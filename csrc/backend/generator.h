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
#include <optional>
#include <utility>

namespace torchneuron {

// The state a generator and its graph-safe views share (CUDA's CUDAGeneratorState).
struct PhiloxState : c10::intrusive_ptr_target {
  uint64_t seed = c10::default_rng_seed_val;
  uint64_t offset = 0;  // a multiple of 4 (one Philox block holds 4 32-bit words)
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
  // multiple of 4. The caller holds mutex_ (as CUDA's philox_cuda_state callers do).
  std::pair<uint64_t, uint64_t> philox_engine_inputs(uint64_t increment);

 private:
  NeuronGeneratorImpl* clone_impl() const override;
  c10::intrusive_ptr<PhiloxState> state_;
};

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);

// The (seed, offset) for a random op on `device` drawing `increment` Philox words per block
// position: from `gen`, or the device's default generator when gen is None. A generator of
// another device type is rejected with CUDA's message.
std::pair<uint64_t, uint64_t> reserve_philox(const std::optional<at::Generator>& gen,
                                             c10::DeviceIndex device, uint64_t increment);

}  // namespace torchneuron
