// Per-device random number generators.
//
// CPU kernels insist on a CPU-typed generator (check_generator<CPUGeneratorImpl> compares
// device types), and silently use the *CPU* default generator when given none. So each neuron
// generator owns a CPU "twin" that does the actual work: the fallback hands kernels the twin
// of the generator they were given (or of the device's default generator when given None),
// and seeding/state calls on the neuron generator forward to the twin. Kernels lock the twin's
// mutex, so concurrent use from several threads is as safe as on CPU.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

namespace torchneuron {

class NeuronGeneratorImpl final : public c10::GeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(c10::DeviceIndex device);
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

  // The CPU generator kernels actually draw from.
  const at::Generator& twin() const { return twin_; }

 private:
  NeuronGeneratorImpl* clone_impl() const override;
  mutable at::Generator twin_;  // mutable: its mutex is locked by const readers
};

const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);
// The CPU generator to hand a CPU kernel for `gen` on `device` (gen may be undefined).
at::Generator cpu_twin(const std::optional<at::Generator>& gen, c10::DeviceIndex device);

}  // namespace torchneuron
