#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// c10 device guard for neuron: current device, streams and events, on top of the runtime.
// Backs torch.Stream / torch.Event / torch.accelerator.* and every DeviceGuard in ATen.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "../runtime/runtime.h"
#include "allocator.h"
#include "gpu_trace.h"
#include "sync_debug.h"

namespace torchneuron {
namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

// torch.Stream(device="neuron") arrives with index -1: it means the current device
// (indexing per-device arrays with -1 corrupts memory).
DeviceIndex normalize(DeviceIndex index) {
  if (index < 0) return static_cast<DeviceIndex>(neuron::rt::current_device());
  return index;
}

void check(DeviceIndex index) {
  try {
    neuron::rt::check_device(index);
  } catch (const std::out_of_range& e) {
    TORCH_CHECK_INDEX(false, e.what());
  }
}

Stream make_stream(DeviceIndex index, int64_t id) {
  return Stream(Stream::UNSAFE, Device(DeviceType::PrivateUse1, index), id);
}

struct NeuronGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::PrivateUse1; }

  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  Device getDevice() const override {
    return Device(DeviceType::PrivateUse1, static_cast<DeviceIndex>(neuron::rt::current_device()));
  }
  void setDevice(Device d) const override {
    TORCH_CHECK(d.type() == DeviceType::PrivateUse1, "expected a neuron device, got ", d);
    DeviceIndex index = normalize(d.index());
    check(index);
    neuron::rt::set_current_device(index);
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    DeviceIndex index = normalize(d.index());
    if (index < neuron::rt::device_count()) neuron::rt::set_current_device(index);
  }

  Stream getStream(Device d) const override {
    DeviceIndex index = normalize(d.index());
    check(index);
    return make_stream(index, neuron::rt::current_stream(index));
  }
  Stream getDefaultStream(Device d) const override {
    DeviceIndex index = normalize(d.index());
    check(index);
    return make_stream(index, neuron::rt::default_stream_id());
  }
  Stream getStreamFromGlobalPool(Device d, bool isHighPriority) const override {
    DeviceIndex index = normalize(d.index());
    check(index);
    int64_t id = neuron::rt::pool_stream_id(index, isHighPriority ? -1 : 0);
    gpu_trace::stream_creation(index, id);
    return make_stream(index, id);
  }
  Stream getNewStream(Device d, int priority) const override {
    DeviceIndex index = normalize(d.index());
    check(index);
    int64_t id = neuron::rt::pool_stream_id(index, priority);
    gpu_trace::stream_creation(index, id);
    return make_stream(index, id);
  }
  Stream exchangeStream(Stream s) const override {
    DeviceIndex index = normalize(s.device_index());
    check(index);
    Stream old = make_stream(index, neuron::rt::current_stream(index));
    neuron::rt::set_current_stream(index, s.id());
    return old;
  }
  DeviceIndex deviceCount() const noexcept override {
    return static_cast<DeviceIndex>(neuron::rt::device_count());
  }

  // Events: a runtime Event object behind the opaque void*.
  void record(void** event, const Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "Event device index ", device_index, " does not match recording stream's device ",
                "index ", stream.device_index(), ".");
    auto* e = static_cast<neuron::rt::Event*>(*event);
    if (e == nullptr) {
      e = new neuron::rt::Event();
      e->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
      *event = e;
      gpu_trace::event_creation(e);  // created lazily at the first record, as CUDA's
    }
    const DeviceIndex index = normalize(stream.device_index());
    neuron::rt::record_event(e, index, stream.id());
    gpu_trace::event_record(e, index, stream.id());
  }
  void block(void* event, const Stream& stream) const override {
    // Work recorded before the event has completed (synchronous execution): the stream
    // need not wait. Still validate the pairing like a real device would.
    auto* e = static_cast<neuron::rt::Event*>(event);
    if (e == nullptr || !e->recorded) return;
    const DeviceIndex index = normalize(stream.device_index());
    neuron::rt::wait_event(e, index, stream.id());
    gpu_trace::event_wait(e, index, stream.id());
  }
  bool queryEvent(void* event) const override {
    // Recorded or never recorded: both report completion (a true query lets the allocator
    // reuse memory freed across streams before the record, runtime.h).
    return neuron::rt::query_event(static_cast<neuron::rt::Event*>(event));
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    if (event == nullptr) return;
    try {
      gpu_trace::event_deletion(event);
    } catch (...) {  // the hook logs its own errors; nothing may escape a noexcept destructor
    }
    delete static_cast<neuron::rt::Event*>(event);
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<neuron::rt::Event*>(event);
    neuron::rt::synchronize_event(e);
    if (e != nullptr && e->recorded) gpu_trace::event_synchronization(e);
  }
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end,
                "Both events must be recorded before calculating elapsed time.");
    try {
      return neuron::rt::elapsed_ms(*static_cast<neuron::rt::Event*>(start),
                                    *static_cast<neuron::rt::Event*>(end));
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK(false, e.what());
    }
  }

  bool queryStream(const Stream& s) const override {
    return neuron::rt::query_stream(normalize(s.device_index()), s.id());
  }
  void synchronizeStream(const Stream& s) const override {
    sync_debug::on_sync("Stream.synchronize");  // as CUDA's stream_synchronize (not the device's)
    const DeviceIndex index = normalize(s.device_index());
    neuron::rt::synchronize_stream(index, s.id());
    gpu_trace::stream_synchronization(index, s.id());
  }
  void synchronizeDevice(const DeviceIndex index) const override {
    DeviceIndex i = normalize(index);
    check(i);
    neuron::rt::synchronize_device(i);
    gpu_trace::device_synchronization(i);
  }
  void recordDataPtrOnStream(const c10::DataPtr& ptr, const Stream& s) const override {
    device_allocator()->recordStream(ptr, s);
  }
  // torch.accelerator.get_device_capability(): the dtypes neuron tensors can be allocated in and
  // converted between (the contract torch documents). Not listed: quantized dtypes (quantized
  // neuron tensors are not implemented), the bit containers bits1x8..bits16, the sub-byte shells
  // int1..int7 / uint1..uint7 and float4_e2m1fn_x2, which no copy kernel converts (on CPU
  // either). tests/device/test_accelerator.py checks the list both ways.
  c10::DeviceCapability getDeviceCapability(Device) const override {
    c10::DeviceCapability cap;
    cap.capability_data.capability_bits = 0;
    auto& t = cap.capability_data.supported_scalar_types;
#define TORCHNEURON_SUPPORTS(name) t.has_##name = 1;
    TORCHNEURON_SUPPORTS(Byte) TORCHNEURON_SUPPORTS(Char) TORCHNEURON_SUPPORTS(Short) TORCHNEURON_SUPPORTS(Int)
    TORCHNEURON_SUPPORTS(Long) TORCHNEURON_SUPPORTS(Half) TORCHNEURON_SUPPORTS(Float) TORCHNEURON_SUPPORTS(Double)
    TORCHNEURON_SUPPORTS(ComplexHalf) TORCHNEURON_SUPPORTS(ComplexFloat) TORCHNEURON_SUPPORTS(ComplexDouble)
    TORCHNEURON_SUPPORTS(Bool) TORCHNEURON_SUPPORTS(BFloat16) TORCHNEURON_SUPPORTS(Float8_e5m2)
    TORCHNEURON_SUPPORTS(Float8_e4m3fn) TORCHNEURON_SUPPORTS(Float8_e5m2fnuz) TORCHNEURON_SUPPORTS(Float8_e4m3fnuz)
    TORCHNEURON_SUPPORTS(UInt16) TORCHNEURON_SUPPORTS(UInt32) TORCHNEURON_SUPPORTS(UInt64)
    TORCHNEURON_SUPPORTS(Float8_e8m0fnu)
#undef TORCHNEURON_SUPPORTS
    return cap;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl)

}  // namespace
}  // namespace torchneuron
