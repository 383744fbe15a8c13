#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// torch.profiler for neuron: the kineto PrivateUse1 plugin and the legacy profiler stubs.
//
// Why C++: kineto child profilers and ProfilerStubs are C++-only interfaces. Everything that
// can be Python is (estimation, export, report, source resolution): this file turns the
// runtime's trace records (runtime/trace.h) into kineto activities and nothing more.
//
// Per record the trace gets two activities, as a CUDA trace does:
//   * the host-side launch (PRIVATEUSE1_RUNTIME, on the launching thread, flow start), and
//   * the device activity (CONCURRENT_KERNEL / GPU_MEMCPY / GPU_MEMSET, pid = device,
//     tid = stream, flow end), linked to the framework op that launched it.
// Both carry `correlation` (the record's own id) and `stream`, which is what Holistic Trace
// Analysis pairs on; `External id` (the framework op) is added by kineto from the link.
// Synchronizations and event record/wait are host-side runtime activities only.
#include "profiler.h"

#include <ATen/record_function.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/csrc/profiler/stubs/base.h>
// torch/csrc/utils/pybind.h, not torch/extension.h: the latter pulls in the whole C++ frontend
// (torch/all.h), which more than doubles this unit's compile time.
#include <torch/csrc/utils/pybind.h>

#include <GenericTraceActivity.h>
#include <IActivityProfiler.h>
#include <libkineto.h>

#include <exception>
#include <map>
#include <set>
#include <unordered_map>
#include <unistd.h>

#include "../runtime/engine.h"
#include "../runtime/runtime.h"
#include "trace_api.h"

// From torch/csrc/profiler/python/combined_traceback.h (exported by libtorch_python), which
// cannot be included here: it needs nlohmann/json, which the wheel does not ship.
namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
void freeDeadCapturedTracebackFrames();
void installCapturedTracebackPython();
}  // namespace torch

namespace torchneuron::prof {

namespace rtt = neuron::rt::trace;
using libkineto::ActivityType;

// ---------------------------------------------------------------------------------------------
// Recording hook
// ---------------------------------------------------------------------------------------------
namespace {
std::atomic<bool> g_source_capture{true};
}  // namespace

bool source_capture_enabled() noexcept { return g_source_capture.load(std::memory_order_relaxed); }
void set_source_capture(bool on) noexcept { g_source_capture.store(on); }

void encode_tensor(std::vector<int64_t>& out, const at::Tensor& t, int64_t flags) {
  if (!t.defined()) return;
  if (t.device().type() != c10::DeviceType::PrivateUse1) flags |= kCpu;
  const auto* impl = t.unsafeGetTensorImpl();
  const int64_t ndim = impl->dim();
  int64_t key = 0, nbytes = 0;
  if (impl->has_storage()) {
    const auto& st = impl->unsafe_storage();
    key = reinterpret_cast<int64_t>(st.data_ptr().get());
    nbytes = static_cast<int64_t>(st.nbytes());
  }
  out.reserve(out.size() + 6 + 2 * ndim);
  out.push_back(flags);
  out.push_back(static_cast<int64_t>(t.scalar_type()));
  out.push_back(ndim);
  out.push_back(key);
  out.push_back(nbytes);
  out.push_back(impl->storage_offset());
  for (int64_t s : impl->sizes()) out.push_back(s);
  for (int64_t s : impl->strides()) out.push_back(s);
}

std::string kernel_name(const char* qualified) {
  std::string s(qualified);
  if (s.rfind("aten::", 0) == 0) s.erase(0, 6);
  return "nc::" + s;
}

std::function<void()> traced_replay(std::function<void()> work, const char* name, int device, int64_t stream,
                                    uint64_t graph_id, const rtt::Record* captured) {
  auto rec = std::make_shared<rtt::Record>();
  if (captured != nullptr) {
    rec->kind = captured->kind;
    rec->copy = captured->copy;
    rec->bytes = captured->bytes;
    rec->name = captured->name;
    rec->tensors = captured->tensors;
    rec->meta = captured->meta;
    rec->context = captured->context;  // (shared: symbolized per trace, never consumed)
  }
  rec->launch_start_ns = rec->launch_end_ns = rtt::now_ns();
  rec->external = rtt::current_correlation();
  rec->scope = rtt::current_scope();
  rec->tid = rtt::thread_id();
  // A compiled kernel keeps Inductor's name, as its eager launches (profiler/compiled.py); a
  // template may name the activity as the launch would have (copies, fills).
  if (rec->name.empty()) rec->name = rec->kind == rtt::Kind::Compiled ? std::string(name) : kernel_name(name);
  rec->device = device;
  rec->stream = stream;
  rec->meta.emplace_back("graph", std::to_string(graph_id));
  return [work = std::move(work), rec]() {
    {
      // As begin_execution: the emulated kernel's own CPU ops are not framework ops of the trace.
      at::DisableRecordFunctionGuard off;
      rec->start_ns = rtt::now_ns();
      work();  // a failed kernel is not an activity (as finish()): its exception leaves here
      rec->end_ns = rtt::now_ns();
    }
    rec->id = rtt::next_id();
    try {
      rtt::record(rtt::Record(*rec));
    } catch (...) {
    }
  };
}

std::unique_ptr<Pending> begin_launch() {
  auto p = std::make_unique<Pending>();
  p->rec.launch_start_ns = rtt::now_ns();
  p->rec.external = rtt::current_correlation();
  p->rec.scope = rtt::current_scope();
  p->rec.tid = rtt::thread_id();
  p->uncaught = std::uncaught_exceptions();
  return p;
}

// The launching Python frames: code objects and instruction indices only (cheap), symbolized
// once, in bulk, when the trace is processed.
std::shared_ptr<void> capture_source() {
  if (!source_capture_enabled() || rtt::suppressed() || !Py_IsInitialized()) return nullptr;
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
}

std::shared_ptr<rtt::Record> capture_template() {
  auto rec = std::make_shared<rtt::Record>();
  rec->context = capture_source();
  return rec;
}

void begin_execution(Pending& p, rtt::Kind kind, std::string name) {
  p.launched = true;
  p.rec.kind = kind;
  p.rec.name = std::move(name);
  p.rec.context = capture_source();
  p.rf_was_enabled = at::isRecordFunctionEnabled();
  if (p.rf_was_enabled) {
    at::enableRecordFunction(false);
    p.rf_disabled = true;
  }
  p.rec.launch_end_ns = p.rec.start_ns = rtt::now_ns();
}

void end_execution(Pending& p) noexcept {
  if (!p.launched || p.ended) return;
  p.rec.end_ns = rtt::now_ns();
  p.ended = true;
  if (p.rf_disabled) {
    at::enableRecordFunction(true);
    p.rf_disabled = false;
  }
}

void finish(std::unique_ptr<Pending> p, int device) noexcept {
  if (!p->launched) return;
  end_execution(*p);
  if (std::uncaught_exceptions() > p->uncaught) return;  // the kernel failed: no activity
  try {
    if (device < 0) device = neuron::rt::current_device();
    p->rec.device = device;
    // The queue the work ran on comes from the runtime, not from the caller.
    if (p->rec.kind != rtt::Kind::Collective) p->rec.stream = neuron::rt::current_stream(device);
    p->rec.id = rtt::next_id();
    rtt::record(std::move(p->rec));
  } catch (...) {
    // Out of memory while tracing: drop the record rather than fail the op.
  }
}

// ---------------------------------------------------------------------------------------------
// Python callbacks (set by torchneuron.profiler): session start/stop and trace annotation
// ---------------------------------------------------------------------------------------------
namespace {
// Leaked on purpose: they must outlive interpreter shutdown ordering of static destructors.
PyObject* g_on_start = nullptr;
PyObject* g_on_stop = nullptr;
PyObject* g_annotate = nullptr;
std::string g_device_label = "neuron";
std::string g_device_properties;

// Runs with the thread's Python profile function suspended: the callbacks run inside
// torch.profiler's own start/stop, and with_stack's Python tracer must not see their frames
// (it would record calls it never sees return, with garbage names).
struct SuspendPythonProfiler {
  PyThreadState* ts = PyThreadState_Get();
  Py_tracefunc func = ts->c_profilefunc;
  PyObject* obj = ts->c_profileobj;
  SuspendPythonProfiler() {
    Py_XINCREF(obj);
    if (func) PyEval_SetProfile(nullptr, nullptr);
  }
  ~SuspendPythonProfiler() {
    if (func) PyEval_SetProfile(func, obj);
    Py_XDECREF(obj);
  }
};

void call_python(PyObject* fn) {
  if (fn == nullptr || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  SuspendPythonProfiler suspend;
  try {
    py::handle callback(fn);  // (not `py::handle(fn)();`: that declares a function)
    callback();
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable("torchneuron profiler callback");
  }
}

// on_start as a pending call (see start() below): the main thread runs it at its next bytecode,
// holding the GIL. It reads the slot when it runs, so no reference is taken without the GIL.
int run_on_start(void*) {
  call_python(g_on_start);
  return 0;
}

void set_callback(PyObject*& slot, py::object fn) {
  PyObject* old = slot;
  slot = fn.is_none() ? nullptr : fn.inc_ref().ptr();
  Py_XDECREF(old);
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// kineto plugin
// ---------------------------------------------------------------------------------------------
namespace {

ActivityType device_type_of(rtt::Kind k) {
  switch (k) {
    case rtt::Kind::Memcpy: return ActivityType::GPU_MEMCPY;
    case rtt::Kind::Memset: return ActivityType::GPU_MEMSET;
    default: return ActivityType::CONCURRENT_KERNEL;
  }
}

bool host_only(rtt::Kind k) {
  return k == rtt::Kind::Sync || k == rtt::Kind::Wait || k == rtt::Kind::EventRecord;
}

const char* launch_name(const rtt::Record& r) {
  switch (r.kind) {
    case rtt::Kind::Memcpy: return r.blocking ? "neuronMemcpy" : "neuronMemcpyAsync";
    case rtt::Kind::Memset: return "neuronMemsetAsync";
    case rtt::Kind::Collective: return "neuronCollectiveLaunch";
    case rtt::Kind::NkiKernel: return "neuronLaunchNkiKernel";
    default: return "neuronLaunchKernel";
  }
}

const char* kind_name(rtt::Kind k) {
  switch (k) {
    case rtt::Kind::Kernel: return "kernel";
    case rtt::Kind::Memcpy: return "memcpy";
    case rtt::Kind::Memset: return "memset";
    case rtt::Kind::Collective: return "collective";
    case rtt::Kind::NkiKernel: return "nki";
    case rtt::Kind::Compiled: return "compiled";
    case rtt::Kind::Sync: return "sync";
    case rtt::Kind::Wait: return "wait";
    case rtt::Kind::EventRecord: return "event_record";
  }
  return "kernel";
}

const char* copy_name(rtt::CopyKind c) {
  switch (c) {
    case rtt::CopyKind::HtoD: return "HtoD";
    case rtt::CopyKind::DtoH: return "DtoH";
    case rtt::CopyKind::DtoD: return "DtoD";
    default: return "";
  }
}

std::string int_list(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(v[i]);
  }
  return out + "]";
}

class NeuronSession : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    rtt::start();
    status_ = libkineto::TraceStatus::RECORDING;
    // kineto calls this holding its controller's mutex, after torch's Python tracer (with_stack,
    // Python events) was installed on every thread. Running Python here could hand the GIL to
    // another thread, whose first traced call registers that thread with kineto and waits for
    // the mutex while holding the GIL, as this thread waits for the GIL: a deadlock (seen under
    // pytest-xdist, whose I/O thread runs Python). So the callback is a pending call, run by the
    // main thread at its next bytecode, once enableProfiler has returned and released the
    // mutex; that is before the program's next statement. (Py_AddPendingCall needs no GIL.)
    if (g_on_start != nullptr && Py_IsInitialized() && Py_AddPendingCall(&run_on_start, nullptr) != 0) {
      TORCH_WARN("torchneuron profiler: could not schedule the session's start callback; module scopes "
                 "are not recorded in this trace");
    }
  }

  void stop() override {
    rtt::stop();
    records_ = rtt::drain();
    status_ = libkineto::TraceStatus::PROCESSING;
    call_python(g_on_stop);
  }

  std::vector<std::string> errors() override { return {}; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    processTrace(logger, [](int32_t) -> const libkineto::ITraceActivity* { return nullptr; }, 0, 0);
  }

  void processTrace(libkineto::ActivityLogger& logger,
                    libkineto::getLinkedActivityCallback linked_of, int64_t, int64_t) override {
    buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
    buffer_->span.name = "neuron";
    buffer_->gpuOpCount = -1;
    if (!annotated_) annotate();
    const int64_t pid = getpid();
    for (size_t i = 0; i < records_.size(); ++i) {
      const rtt::Record& r = records_[i];
      const libkineto::ITraceActivity* linked =
          r.external ? linked_of(static_cast<int32_t>(r.external)) : nullptr;
      streams_.insert({r.device, r.stream});
      // Host side: the launch (or the synchronization) on the launching thread.
      auto& host = emplace(host_only(r.kind) ? r.name : std::string(launch_name(r)),
                           ActivityType::PRIVATEUSE1_RUNTIME);
      host.device = static_cast<int32_t>(pid);
      host.resource = r.tid;
      host.threadId = r.tid;
      host.startTime = host_only(r.kind) ? r.start_ns : r.launch_start_ns;
      host.endTime = host_only(r.kind) ? r.end_ns : r.launch_end_ns;
      host.id = static_cast<int32_t>(r.id);
      host.linked = linked;
      host.addMetadata("correlation", r.id);
      host.addMetadata("device", r.device);
      // "queue", not "stream": trace tools take an event with a stream arg for device work.
      host.addMetadata("queue", r.stream);
      if (host_only(r.kind)) {
        host.addMetadataQuoted("kind", kind_name(r.kind));
        if (r.kind == rtt::Kind::Sync) host.addMetadata("blocked_ns", r.end_ns - r.start_ns);
        for (const auto& [k, v] : r.meta) host.addMetadata(k, v);
        if (i < notes_.size()) add_annotations(host, notes_[i].meta);
        host.log(logger);
        continue;
      }
      host.flow.id = static_cast<uint32_t>(r.id);
      host.flow.type = libkineto::kLinkAsyncCpuGpu;
      host.flow.start = 1;
      host.log(logger);

      // Device side: the kernel / copy / collective on its queue.
      auto& dev = emplace(r.name, device_type_of(r.kind));
      dev.device = r.device;
      dev.resource = static_cast<int32_t>(r.stream);
      dev.threadId = static_cast<int32_t>(r.stream);
      dev.startTime = r.start_ns;
      dev.endTime = r.end_ns;
      dev.id = static_cast<int32_t>(r.id);
      dev.linked = linked;
      dev.flow.id = static_cast<uint32_t>(r.id);
      dev.flow.type = libkineto::kLinkAsyncCpuGpu;
      dev.flow.start = 0;
      dev.addMetadata("device", r.device);
      dev.addMetadata("stream", r.stream);
      dev.addMetadata("correlation", r.id);
      dev.addMetadataQuoted("kind", kind_name(r.kind));
      if (r.copy != rtt::CopyKind::None) dev.addMetadataQuoted("copy", copy_name(r.copy));
      if (r.blocking) dev.addMetadata("blocking", 1);
      if (r.bytes) dev.addMetadata("bytes", r.bytes);
      if (!r.tensors.empty()) dev.addMetadata("tensors", int_list(r.tensors));
      dev.addMetadata("launch_ns", r.start_ns - r.launch_start_ns);
      dev.addMetadata("thread", r.tid);
      if (r.external) dev.addMetadata("op_correlation", r.external);
      for (const auto& [k, v] : r.meta) dev.addMetadata(k, v);
      if (i < notes_.size()) add_annotations(dev, notes_[i].meta);
      dev.log(logger);

    }
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    // kineto takes one device per child session: name the first one used (the Python exporter
    // names the others).
    int device = streams_.empty() ? 0 : streams_.begin()->first;
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{
        device, device + 0x1000000, g_device_label + ":" + std::to_string(device),
        g_device_label});
  }

  static std::string queue_name(int64_t stream) {
    return stream >= kCommStreamBase ? "comm queue " + std::to_string(stream - kCommStreamBase)
                                     : "stream " + std::to_string(stream);
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> out;
    for (const auto& [device, stream] : streams_) {
      if (stream < 0) continue;
      out.push_back(libkineto::ResourceInfo{stream, stream, device, queue_name(stream)});
    }
    return out;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override { return std::move(buffer_); }

  void pushCorrelationId(uint64_t id) override { rtt::push_correlation(id); }
  void popCorrelationId() override { rtt::pop_correlation(); }

  std::string getDeviceProperties() override { return g_device_properties; }

  // Called by kineto before processTrace (and before the trace header is written): annotate
  // here so trace-level results (interned stacks, module names, the estimate's summary) can go
  // into the trace's top-level metadata.
  std::unordered_map<std::string, std::string> getMetadata() override {
    if (!annotated_) annotate();
    return trace_meta_;
  }

  static constexpr int64_t kCommStreamBase = 1 << 20;

 private:
  libkineto::GenericTraceActivity& emplace(const std::string& name, ActivityType type) {
    buffer_->emplace_activity(buffer_->span, type, name);
    return libkineto::CpuTraceBuffer::toRef(buffer_->activities.back());
  }

  static void add_annotations(libkineto::GenericTraceActivity& act,
                              const std::vector<std::pair<std::string, std::string>>& kv) {
    for (const auto& [k, v] : kv) act.addMetadata(k, v);
  }


  // The Python layer (torchneuron.profiler) sees every record once, with its captured
  // traceback symbolized (in one batch), and returns extra args per record (source line,
  // module path, FLOPs, bytes, engine, the estimated Trainium start and duration) plus
  // trace-level metadata. The estimated timeline becomes a track of its own when the trace is
  // exported (torchneuron.profiler.trace): an extra kineto activity here would be taken for
  // a framework op or a device kernel by PyTorch's event parser.
  struct Note {
    std::vector<std::pair<std::string, std::string>> meta;
  };

  void annotate() {
    annotated_ = true;
    notes_.clear();
    trace_meta_.clear();
    if (g_annotate == nullptr || records_.empty() || !Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    SuspendPythonProfiler suspend;
    try {
      std::vector<torch::CapturedTraceback*> tbs;
      std::vector<size_t> owner;
      for (size_t i = 0; i < records_.size(); ++i) {
        if (records_[i].context) {
          tbs.push_back(static_cast<torch::CapturedTraceback*>(records_[i].context.get()));
          owner.push_back(i);
        }
      }
      std::vector<py::object> frames = torch::py_symbolize(tbs);
      std::vector<py::object> stacks(records_.size(), py::none());
      for (size_t j = 0; j < owner.size(); ++j) stacks[owner[j]] = frames[j];
      py::list items(records_.size());
      for (size_t i = 0; i < records_.size(); ++i) {
        const rtt::Record& r = records_[i];
        py::list meta;
        for (const auto& kv : r.meta) meta.append(py::make_tuple(kv.first, kv.second));
        py::tuple t = py::make_tuple(
            r.id, kind_name(r.kind), r.name, r.device, r.stream, r.tid, r.launch_start_ns,
            r.launch_end_ns, r.start_ns, r.end_ns, r.bytes, copy_name(r.copy), r.blocking,
            py::cast(r.tensors), meta, stacks[i], r.scope, r.external);
        items[i] = t;
      }
      py::tuple both = py::handle(g_annotate)(items).cast<py::tuple>();
      for (auto kv : both[1].cast<py::dict>()) {
        trace_meta_[kv.first.cast<std::string>()] = kv.second.cast<std::string>();
      }
      py::object result = both[0];
      notes_.resize(records_.size());
      size_t i = 0;
      for (py::handle item : result) {
        if (i >= notes_.size()) break;
        if (!item.is_none()) {
          notes_[i].meta = item.cast<std::vector<std::pair<std::string, std::string>>>();
        }
        ++i;
      }
      // Tracebacks hold Python code objects: release them while the GIL is held.
      for (auto& r : records_) r.context.reset();
      torch::freeDeadCapturedTracebackFrames();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("torchneuron profiler annotation");
      notes_.clear();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(nullptr);
      notes_.clear();
    }
  }

  std::vector<rtt::Record> records_;
  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_;
  std::set<std::pair<int, int64_t>> streams_;
  std::vector<Note> notes_;
  std::unordered_map<std::string, std::string> trace_meta_;
  bool annotated_ = false;
};

class NeuronActivityProfiler : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }
  const std::set<ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      const std::set<ActivityType>& activity_types, const libkineto::Config&) override {
    // Only when the user asked for device activities (ProfilerActivity.PrivateUse1).
    if (!activity_types.count(ActivityType::CONCURRENT_KERNEL)) return nullptr;
    return std::make_unique<NeuronSession>();
  }
  std::unique_ptr<libkineto::IActivityProfilerSession> configure(
      int64_t, int64_t, const std::set<ActivityType>& activity_types,
      const libkineto::Config& config) override {
    return configure(activity_types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<ActivityType> activities_{ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_MEMCPY,
                                     ActivityType::GPU_MEMSET, ActivityType::PRIVATEUSE1_RUNTIME};
};

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

// ---------------------------------------------------------------------------------------------
// Legacy profiler stubs: torch.autograd.profiler.profile(use_device="neuron", use_kineto=False)
// times each op with a pair of device events. The device is synchronous, so an event's time
// is the host time at which all earlier work completed; elapsed is never negative.
// ---------------------------------------------------------------------------------------------
struct NeuronStubs final : public torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    if (device) *device = static_cast<c10::DeviceIndex>(neuron::rt::current_device());
    auto* t = new int64_t(neuron::rt::now_ns());
    *event = std::shared_ptr<void>(t, [](void* p) { delete static_cast<int64_t*>(p); });
    if (cpu_ns) *cpu_ns = c10::getTime();
  }
  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* e1,
                const torch::profiler::impl::ProfilerVoidEventStub* e2) const override {
    TORCH_CHECK(e1 && e2 && *e1 && *e2, "neuron profiler: elapsed() of an unrecorded event");
    const int64_t a = *static_cast<int64_t*>(e1->get());
    const int64_t b = *static_cast<int64_t*>(e2->get());
    return b > a ? static_cast<float>(b - a) / 1000.0f : 0.0f;  // microseconds
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    const int saved = neuron::rt::current_device();
    for (int d = 0; d < neuron::rt::device_count(); ++d) {
      neuron::rt::set_current_device(d);
      op(d);
    }
    if (neuron::rt::device_count() > 0) neuron::rt::set_current_device(saved);
  }
  void synchronize() const override { neuron::rt::synchronize_device(neuron::rt::current_device()); }
};

struct RegisterStubs {
  RegisterStubs() {
    static NeuronStubs stubs;
    torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  }
} g_register_stubs;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Python bindings (called from module.cpp)
// ---------------------------------------------------------------------------------------------
namespace {

// A device activity driven from Python: NKI kernels and torch.compile kernels.
class PyActivity {
 public:
  PyActivity(int kind, std::string name, int device) : device_(device) {
    if (!rtt::active()) return;
    p_ = begin_launch();
    kind_ = static_cast<rtt::Kind>(kind);
    name_ = std::move(name);
  }
  bool active() const { return p_ != nullptr; }
  void tensors(const std::vector<at::Tensor>& ts, bool output) {
    if (!p_) return;
    for (const auto& t : ts) {
      encode_tensor(p_->rec.tensors, t, output ? kOutput : 0);
      if (device_ < 0 && t.defined() && t.device().type() == c10::DeviceType::PrivateUse1) {
        device_ = t.device().index();
      }
    }
  }
  void begin() {
    if (!p_) return;
    begin_execution(*p_, kind_, name_);
    // Host code runs the emulated kernel: its framework ops are not device ops either.
  }
  void end(const std::vector<std::pair<std::string, std::string>>& meta, int64_t bytes) {
    if (!p_) return;
    end_execution(*p_);
    for (const auto& kv : meta) p_->rec.meta.push_back(kv);
    p_->rec.bytes = bytes;
    finish(std::move(p_), device_);
  }
  void cancel() {
    if (!p_) return;
    end_execution(*p_);
    p_.reset();
  }

 private:
  std::unique_ptr<Pending> p_;
  rtt::Kind kind_ = rtt::Kind::Kernel;
  std::string name_;
  int device_;
};

// Collective records from the c10d backend (a separate extension), through a capsule.
void record_collective_c(const char* name, int device, int64_t queue,
                                    uint64_t external, int32_t tid, int64_t launch_start_ns,
                                    int64_t launch_end_ns, int64_t start_ns, int64_t end_ns,
                                    int64_t bytes, const char* meta_json_pairs,
                                    const std::vector<int64_t>* tensors) {
  rtt::Record r;
  r.id = rtt::next_id();
  r.external = external;
  r.kind = rtt::Kind::Collective;
  r.device = device;
  r.stream = NeuronSession::kCommStreamBase + queue;
  r.tid = tid;
  r.launch_start_ns = launch_start_ns;
  r.launch_end_ns = launch_end_ns;
  r.start_ns = start_ns;
  r.end_ns = end_ns;
  r.bytes = bytes;
  r.name = name;
  if (tensors) r.tensors = *tensors;
  // meta_json_pairs: "key\x1fvalue\x1e..." (unit/record separators; values are raw JSON)
  std::string s = meta_json_pairs ? meta_json_pairs : "";
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find('\x1e', pos);
    if (end == std::string::npos) end = s.size();
    std::string item = s.substr(pos, end - pos);
    size_t sep = item.find('\x1f');
    if (sep != std::string::npos) r.meta.emplace_back(item.substr(0, sep), item.substr(sep + 1));
    pos = end + 1;
  }
  rtt::record(std::move(r));
}

bool api_active() { return rtt::active(); }
uint64_t api_corr() { return rtt::current_correlation(); }
int32_t api_tid() { return rtt::thread_id(); }
int64_t api_now() { return rtt::now_ns(); }

void api_drain() { neuron::rt::engine::drain(); }

TraceApi g_api{kTraceApiVersion, &api_active, &api_corr, &api_tid, &api_now, &record_collective_c, &encode_tensor,
               &api_drain};

}  // namespace

void bind_profiler(py::module& m) {
  static bool installed = false;
  if (!installed) {
    torch::installCapturedTracebackPython();
    rtt::set_context_hook(&capture_source);  // synchronizations get their launch site too
    installed = true;
  }
  m.def("_trace_active", &rtt::active);
  m.def("_trace_set_scope", &rtt::set_scope);
  m.def("_trace_scope", &rtt::current_scope);
  m.def("_trace_suppress", &rtt::suppress);
  m.def("_trace_now_ns", &rtt::now_ns);
  m.def("_profiler_set_source_capture", &set_source_capture);
  m.def("_profiler_source_capture", &source_capture_enabled);
  m.def("_profiler_set_callbacks", [](py::object on_start, py::object on_stop, py::object annotate) {
    set_callback(g_on_start, std::move(on_start));
    set_callback(g_on_stop, std::move(on_stop));
    set_callback(g_annotate, std::move(annotate));
  });
  m.def("_profiler_set_device_info", [](std::string label, std::string properties) {
    g_device_label = std::move(label);
    g_device_properties = std::move(properties);
  });
  m.attr("_trace_api") = py::capsule(&g_api, "torchneuron._trace_api");
  py::class_<PyActivity>(m, "_Activity")
      .def(py::init<int, std::string, int>(), py::arg("kind"), py::arg("name"), py::arg("device") = -1)
      .def_property_readonly("active", &PyActivity::active)
      .def("tensors", &PyActivity::tensors, py::arg("tensors"), py::arg("output"))
      .def("begin", &PyActivity::begin)
      .def("end", &PyActivity::end, py::arg("meta") = std::vector<std::pair<std::string, std::string>>{},
           py::arg("bytes") = 0)
      .def("cancel", &PyActivity::cancel);
}

}  // namespace torchneuron::prof
