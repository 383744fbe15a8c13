#include "generator.h"

#include <c10/util/CallOnce.h>

#include <deque>
#include <mutex>

#include "../runtime/runtime.h"

namespace torchneuron {

NeuronGeneratorImpl::NeuronGeneratorImpl(c10::DeviceIndex device)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      twin_(at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val)) {}

// The twin's own mutex serialises access, exactly as kernels lock it.
#define WITH_TWIN(stmt)                          \
  std::lock_guard<std::mutex> lock(twin_.mutex()); \
  stmt

void NeuronGeneratorImpl::set_current_seed(uint64_t seed) { WITH_TWIN(twin_.set_current_seed(seed)); }
void NeuronGeneratorImpl::set_offset(uint64_t offset) { WITH_TWIN(twin_.set_offset(offset)); }
uint64_t NeuronGeneratorImpl::get_offset() const { WITH_TWIN(return twin_.get_offset()); }
uint64_t NeuronGeneratorImpl::current_seed() const { WITH_TWIN(return twin_.current_seed()); }
uint64_t NeuronGeneratorImpl::seed() { WITH_TWIN(return twin_.seed()); }
void NeuronGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  WITH_TWIN(twin_.unsafeGetGeneratorImpl()->set_state(new_state));
}
c10::intrusive_ptr<c10::TensorImpl> NeuronGeneratorImpl::get_state() const {
  WITH_TWIN(return twin_.unsafeGetGeneratorImpl()->get_state());
}
#undef WITH_TWIN

NeuronGeneratorImpl* NeuronGeneratorImpl::clone_impl() const {
  auto* gen = new NeuronGeneratorImpl(device().index());
  std::lock_guard<std::mutex> lock(twin_.mutex());
  gen->twin_ = twin_.clone();
  return gen;
}

namespace {
std::once_flag g_defaults_once;
std::deque<at::Generator> g_defaults;  // one per device, created together on first use

void init_defaults() {
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    g_defaults.push_back(at::make_generator<NeuronGeneratorImpl>(static_cast<c10::DeviceIndex>(d)));
    // Distinct default streams per device, as CUDA's default generators seed by index.
    g_defaults.back().set_current_seed(c10::default_rng_seed_val);
  }
}

c10::DeviceIndex resolve(c10::DeviceIndex device) {
  if (device < 0) device = static_cast<c10::DeviceIndex>(neuron::rt::current_device());
  neuron::rt::check_device(device);
  return device;
}
}  // namespace

const at::Generator& default_generator(c10::DeviceIndex device) {
  device = resolve(device);
  std::call_once(g_defaults_once, init_defaults);
  return g_defaults[device];
}

at::Generator new_generator(c10::DeviceIndex device) {
  return at::make_generator<NeuronGeneratorImpl>(resolve(device));
}

at::Generator cpu_twin(const std::optional<at::Generator>& gen, c10::DeviceIndex device) {
  if (gen.has_value() && gen->defined()) {
    if (gen->device().type() == c10::DeviceType::CPU) return *gen;
    TORCH_CHECK(gen->device().type() == c10::DeviceType::PrivateUse1,
                "Expected a 'neuron' or 'cpu' generator, but got one on ", gen->device());
    return static_cast<NeuronGeneratorImpl*>(gen->unsafeGetGeneratorImpl())->twin();
  }
  return static_cast<NeuronGeneratorImpl*>(default_generator(device).unsafeGetGeneratorImpl())
      ->twin();
}

}  // namespace torchneuron
