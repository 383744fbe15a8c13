#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// DDP's time statistics (``model._get_ddp_logging_data()``: forward / backward compute and
// backward communication times) come from a c10d::Timer that the Reducer creates for its
// parameters' device type through c10d::TimerRegistry. torch registers CPU's (host clock) and
// CUDA's (CUDA events); without one, DDP on neuron warns "Time stats are currently only
// collected for CPU and CUDA devices" and reports nothing. This timer does what CudaTimer does
// with the device's own events: each DDP event is recorded on the device's current stream and
// the times are the events' elapsed time, so they follow device work, not host calls.
// Registered when this library loads (torchneuron.distributed registers the c10d backend).
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace {

class NeuronTimer : public c10d::Timer {
 public:
  explicit NeuronTimer(c10::Device device) : device_(device) {}

  void record(Event event) override {
    Timer::record(event);  // the host timestamp the Reducer also reads
    c10::DeviceGuard guard(device_);
    c10::impl::VirtualGuardImpl impl(device_.type());
    events_[index(event)].record(impl.getStream(device_));
  }

  std::optional<int64_t> measureDifference(Event start, Event end) override {
    auto& s = events_[index(start)];
    auto& e = events_[index(end)];
    // An event of this iteration not recorded yet (e.g. no communication happened).
    if (!s.was_marked_for_recording() || !e.was_marked_for_recording()) return std::nullopt;
    s.synchronize();
    e.synchronize();
    double ms = s.elapsedTime(e);
    // Events recorded out of order (a start from this iteration, an end from the last).
    if (ms < 0) return std::nullopt;
    return static_cast<int64_t>(ms * 1e6);
  }

 private:
  static size_t index(Event event) { return static_cast<size_t>(event); }

  c10::Device device_;
  // One device event per Timer::Event (kForwardStart .. kBackwardCommEnd); timing enabled
  // (BACKEND_DEFAULT, as torch.Event(enable_timing=True)).
  std::array<c10::Event, 5> events_{
      c10::Event(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT),
      c10::Event(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT),
      c10::Event(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT),
      c10::Event(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT),
      c10::Event(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT)};
};

}  // namespace

namespace c10d {
// (The macro names the registry unqualified, so it is expanded inside c10d.)
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, NeuronTimer)
}  // namespace c10d
