#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// PrivateUse1 hooks: what ATen asks of an accelerator (availability, generators, pinned
// memory, storage resize, pointer → device).
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/StorageImpl.h>

#include "../runtime/runtime.h"
#include "allocator.h"
#include "generator.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

struct NeuronHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return neuron::rt::device_count() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return neuron::rt::is_initialized(); }
  void init() const override { neuron::rt::lazy_init(); }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(neuron::rt::device_count());
  }
  void setCurrentDevice(c10::DeviceIndex d) const override { neuron::rt::set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(neuron::rt::current_device());
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = getCurrentDevice();
    if (d >= 0 && d != old) neuron::rt::set_current_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex d) const override {
    return default_generator(d);
  }
  at::Generator getNewGenerator(c10::DeviceIndex d) const override { return new_generator(d); }
  at::Device getDeviceFromPtr(void* data) const override {
    int d = device_allocator()->device_of(data);
    TORCH_CHECK(d >= 0, "pointer ", data, " does not point into neuron device memory");
    return at::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(d));
  }
  bool isPinnedPtr(const void* data) const override { return host_allocator()->is_pinned(data); }
  at::Allocator* getPinnedMemoryAllocator() const override { return host_allocator(); }

  // UntypedStorage.resize_ and FSDP2's resize_(0): reallocate on the storage's device and
  // keep the common prefix of the old bytes.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

}  // namespace

void register_hooks() {
  static NeuronHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}

}  // namespace torchneuron
