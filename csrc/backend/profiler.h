// Device activities for torch.profiler: the recording hook the execution paths call, and the
// helpers the kineto plugin (profiler.cpp) and the Python bindings share.
//
// An op's kernel is recorded by its ZeroCopy (zero_copy.h): construction starts the host-side
// launch, `launch(name)` marks where the kernel starts executing, the first of
// sync_inputs()/out()/destruction marks its end. Tensors seen by in()/out() are encoded into
// the record so the estimator knows shapes, dtypes, strides and which storages were read and
// written. Everything is behind `neuron::rt::trace::active()`: one branch when off.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <memory>
#include <string>

#include "../runtime/trace.h"

namespace torchneuron::prof {

// Tensor encoding in Record::tensors, one group per tensor:
//   [flags, dtype, ndim, storage_key, storage_nbytes, storage_offset, sizes..., strides...]
// flags: bit 0 written, bit 1 on the CPU (not device memory), bit 2 also read (in place).
constexpr int64_t kOutput = 1;
constexpr int64_t kCpu = 2;
constexpr int64_t kRead = 4;
void encode_tensor(std::vector<int64_t>& out, const at::Tensor& t, int64_t flags);

// A device activity under construction (only allocated while a session records).
struct Pending {
  neuron::rt::trace::Record rec;
  bool launched = false;
  bool ended = false;
  bool rf_was_enabled = true;
  bool rf_disabled = false;
  int uncaught = 0;  // std::uncaught_exceptions() at launch: a kernel that throws is not recorded
};

// Start / mark execution / finish a pending activity. `begin_execution` turns RecordFunction
// off on this thread while the emulated kernel runs, so CPU ops a CPU kernel calls internally
// (e.g. relu -> clamp_min) do not appear as framework ops nested in the device op.
std::unique_ptr<Pending> begin_launch();
void begin_execution(Pending& p, neuron::rt::trace::Kind kind, std::string name);
void end_execution(Pending& p) noexcept;
void finish(std::unique_ptr<Pending> p, int device) noexcept;

// "aten::add.Tensor" -> "nc::add.Tensor": a name distinct from the framework op's, so
// key_averages() shows the kernel as its own device row instead of merging it into the op's.
std::string kernel_name(const char* qualified);

// A graph replay's recorded kernel as a device activity: `work` wrapped so that, when it runs,
// it is timed and recorded (launched now by the calling thread, meta "graph": graph_id).
// Replayed kernels carry no launch-time record of their own: their ops were enqueued at the
// capture. `captured`: what the capture noted of the launch (capture_template: its operands,
// whose shapes, dtypes and storages are the replay's, the launching Python frames, and for a
// compiled kernel its kind and attribution), or null (kernels that gave none: an activity named
// by kernel_name, with no tensor metadata and no source).
std::function<void()> traced_replay(std::function<void()> work, const char* name, int device, int64_t stream,
                                    uint64_t graph_id, const neuron::rt::trace::Record* captured);

// A record to fill with what a kernel captured in a graph notes of its launch (tensors, kind,
// meta; a name, bytes and copy kind for copies and fills, else named by traced_replay) for
// traced_replay, holding the launching Python frames already (if source capture is on).
std::shared_ptr<neuron::rt::trace::Record> capture_template();

// Python source capture per launch (on by default; torchneuron.profiler.set_options).
bool source_capture_enabled() noexcept;
void set_source_capture(bool on) noexcept;

}  // namespace torchneuron::prof
