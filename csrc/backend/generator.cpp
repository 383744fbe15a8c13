#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "generator.h"

#include <ATen/Utils.h>
#include <ATen/core/Generator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/util/CallOnce.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>

#include "../runtime/runtime.h"

namespace torchneuron {

NeuronGeneratorImpl::NeuronGeneratorImpl(c10::DeviceIndex device, c10::intrusive_ptr<PhiloxState> state)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, device),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
      state_(std::move(state)) {}

namespace {
// The open graph capture's generators (begin_graph_rng): its device (-1: none) and the states
// drawn from so far. A state joins under its own lock, then this one's (end_graph_rng never
// holds both).
std::atomic<int> g_rng_capture_device{-1};
std::mutex g_rng_mu;
std::vector<GraphRngUse> g_rng_uses;

// The state of a generator of a device with an open capture cannot be read or set: its ops draw
// offsets relative to the graph, fixed at each replay (torch.utils.checkpoint's saved state
// restored inside a capture would give the recomputation other numbers than the forward's).
// CUDA raises too (assertNotCapturing).
void check_not_capturing(c10::DeviceIndex device, const char* what) {
  TORCH_CHECK(g_rng_capture_device.load(std::memory_order_acquire) != device, "neuron: ", what,
              " while a graph capture on neuron:", static_cast<int>(device), " is open: random ops inside it draw "
              "offsets relative to the graph, fixed at each replay. Read or set generator states before or after "
              "the capture, as on CUDA");
}
}  // namespace

// As CUDA: a new seed restarts the stream at offset 0.
void NeuronGeneratorImpl::set_current_seed(uint64_t seed) {
  check_not_capturing(device().index(), "cannot seed a generator");
  state_->seed = seed;
  state_->offset = 0;
}

void NeuronGeneratorImpl::set_offset(uint64_t offset) {
  TORCH_CHECK(offset % 4 == 0, "offset must be a multiple of 4");
  check_not_capturing(device().index(), "cannot set a generator's offset");
  state_->offset = offset;
}

uint64_t NeuronGeneratorImpl::get_offset() const {
  check_not_capturing(device().index(), "cannot read a generator's offset");
  return state_->offset;
}
uint64_t NeuronGeneratorImpl::current_seed() const { return state_->seed; }

uint64_t NeuronGeneratorImpl::seed() {
  const uint64_t s = c10::detail::getNonDeterministicRandom(/*is_cuda=*/true);
  set_current_seed(s);
  return s;
}

// CUDA's layout: uint64 seed, int64 offset (an 8-byte state sets the seed alone).
void NeuronGeneratorImpl::set_state(const c10::TensorImpl& new_state) {
  constexpr size_t seed_size = sizeof(uint64_t), offset_size = sizeof(int64_t);
  at::detail::check_rng_state(new_state);
  check_not_capturing(device().index(), "cannot set a generator's state");
  const auto size = static_cast<size_t>(new_state.numel());
  TORCH_CHECK(size == seed_size + offset_size || size == seed_size,
              "RNG state is wrong size: a neuron generator state is 16 bytes (uint64 seed, int64 "
              "offset), as CUDA's; got ", size, " bytes");
  const auto* bytes = new_state.data_dtype_initialized<uint8_t>();
  uint64_t seed = 0;
  int64_t offset = 0;
  std::memcpy(&seed, bytes, seed_size);
  if (size == seed_size + offset_size) std::memcpy(&offset, bytes + seed_size, offset_size);
  TORCH_CHECK(offset >= 0 && offset % 4 == 0, "offset must be a multiple of 4");
  state_->seed = seed;
  state_->offset = static_cast<uint64_t>(offset);
}

c10::intrusive_ptr<c10::TensorImpl> NeuronGeneratorImpl::get_state() const {
  constexpr size_t seed_size = sizeof(uint64_t), offset_size = sizeof(int64_t);
  check_not_capturing(device().index(), "cannot read a generator's state");
  auto state = at::detail::empty_cpu({static_cast<int64_t>(seed_size + offset_size)}, at::kByte,
                                     std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  auto* bytes = state.data_ptr<uint8_t>();
  const uint64_t seed = state_->seed;
  const auto offset = static_cast<int64_t>(state_->offset);
  std::memcpy(bytes, &seed, seed_size);
  std::memcpy(bytes + seed_size, &offset, offset_size);
  return state.getIntrusivePtr();
}

// Graph-safe state: generators share one (seed, offset) object, as CUDA's do.
void NeuronGeneratorImpl::graphsafe_set_state(const c10::intrusive_ptr<c10::GeneratorImpl>& gen) {
  auto* other = dynamic_cast<NeuronGeneratorImpl*>(gen.get());
  TORCH_CHECK(other != nullptr, "Expected a 'neuron' Generator, got one on ", gen->device());
  state_ = other->state_;
}

c10::intrusive_ptr<c10::GeneratorImpl> NeuronGeneratorImpl::graphsafe_get_state() const {
  return c10::make_intrusive<NeuronGeneratorImpl>(device().index(), state_);
}

PhiloxArgs NeuronGeneratorImpl::philox_engine_inputs(uint64_t increment) {
  const uint64_t step = (increment + 3) / 4 * 4;
  std::lock_guard<std::mutex> lock(state_->mu);
  if (C10_UNLIKELY(g_rng_capture_device.load(std::memory_order_acquire) == device().index())) {
    if (!state_->cell) {
      state_->cell = std::make_shared<GraphRngCell>();
      state_->intragraph = 0;
      std::lock_guard<std::mutex> reg(g_rng_mu);
      g_rng_uses.push_back(GraphRngUse{state_, state_->cell, 0});
    }
    PhiloxArgs args{0, state_->intragraph, state_->cell};
    state_->intragraph += step;
    return args;
  }
  const uint64_t offset = state_->offset;
  state_->offset = offset + step;
  return {state_->seed, offset, nullptr};
}

void begin_graph_rng(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> reg(g_rng_mu);
  g_rng_uses.clear();
  g_rng_capture_device.store(device, std::memory_order_release);
}

std::vector<GraphRngUse> end_graph_rng() {
  std::vector<GraphRngUse> uses;
  {
    std::lock_guard<std::mutex> reg(g_rng_mu);
    g_rng_capture_device.store(-1, std::memory_order_release);
    uses.swap(g_rng_uses);
  }
  for (GraphRngUse& use : uses) {
    std::lock_guard<std::mutex> lock(use.state->mu);
    use.increment = use.state->intragraph;
    use.state->cell.reset();
    use.state->intragraph = 0;
  }
  return uses;
}

std::pair<uint64_t, uint64_t> GraphRngUse::advance() const {
  std::lock_guard<std::mutex> lock(state->mu);
  const uint64_t offset = state->offset;
  state->offset = offset + increment;
  return {state->seed, offset};
}

NeuronGeneratorImpl* NeuronGeneratorImpl::clone_impl() const {
  auto state = c10::make_intrusive<PhiloxState>();
  state->seed = state_->seed;
  state->offset = state_->offset;
  return new NeuronGeneratorImpl(device().index(), std::move(state));
}

namespace {
std::once_flag g_defaults_once;
std::deque<at::Generator> g_defaults;  // one per device, created together on first use

void init_defaults() {
  for (int d = 0; d < neuron::rt::device_count(); ++d) {
    g_defaults.push_back(at::make_generator<NeuronGeneratorImpl>(static_cast<c10::DeviceIndex>(d)));
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

PhiloxArgs reserve_philox(const std::optional<at::Generator>& gen, c10::DeviceIndex device, uint64_t increment) {
  auto* impl = at::get_generator_or_default<NeuronGeneratorImpl>(gen, default_generator(device));
  std::lock_guard<std::mutex> lock(impl->mutex_);
  return impl->philox_engine_inputs(increment);
}

}  // namespace torchneuron
