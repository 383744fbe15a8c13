// torch.compile's C++ kernels on the execution engine.
//
// Inductor compiles a neuron graph's fused loops into C++ functions over raw pointers (as for
// the CPU) and its Python wrapper calls them. Called synchronously, each kernel had to drain the
// queues first and ran at once: compiled graphs made the host wait at every kernel, and a graph
// capture (graph.cpp) could not record them. Here a kernel call is a queued kernel like an eager
// op's: the wrapper passes the kernel's packed entry point (torchneuron/compile/kernels.py adds
// it to Inductor's source: one int64 slot per argument, so one C++ signature calls them all) and
// its arguments; the pointers and numbers are read at the call, as a CUDA launch reads them, and
// the kernel runs when the queue runs, in stream order with the eager ops around it.
//
// A kernel given a tensor that is not neuron memory of one device (a CPU scalar lifted into the
// graph), or called while the engine cannot queue (off, profiling, a queued kernel's own code),
// runs now, after the queue, as before.
//
// Captured in a graph, a kernel notes what its traced launch would have recorded
// (profiler/compiled.py): its operands (read: Inductor's const pointers; written: the others),
// the launching Python frames and, given by `_kernel_call_captured`, its attribution (FLOPs,
// source line, module, FX ops), so that each replay under torch.profiler is the same compiled
// activity with the same Trainium estimate as the kernel's eager launches.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "enqueue.h"
#include "profiler.h"

namespace torchneuron {
namespace {

using PackedEntry = void (*)(const int64_t* slots);

// A registered kernel. Never freed: queued work and graph recordings keep its name, and a
// process compiles a bounded number of kernels.
struct CompiledKernel {
  PackedEntry entry;
  std::string name;
  std::string kinds;  // per argument: 'p' pointer read, 'o' pointer written (tensors), 'i' integer, 'f' float
};

std::mutex g_kernels_mutex;
std::deque<CompiledKernel> g_kernels;  // a deque: registering one never moves the others

// Registers Inductor's kernel `name` whose packed entry point is at `entry`; returns the handle
// `_kernel_call` takes.
uintptr_t register_kernel(uintptr_t entry, const std::string& name, const std::string& kinds) {
  TORCH_CHECK(entry != 0, "neuron: compiled kernel ", name, " has no packed entry point");
  for (char k : kinds) {
    TORCH_CHECK(k == 'p' || k == 'o' || k == 'i' || k == 'f', "neuron: compiled kernel ", name,
                ": unknown argument kind '", k, "'");
  }
  std::lock_guard<std::mutex> lock(g_kernels_mutex);
  g_kernels.push_back({reinterpret_cast<PackedEntry>(entry), name, kinds});
  return reinterpret_cast<uintptr_t>(&g_kernels.back());
}

using Meta = std::vector<std::pair<std::string, std::string>>;

// Runs or queues kernel `args[0]` (a handle) on `args[1:]`; `meta`: the kernel's attribution
// for a graph's replays (or null).
void call_kernel(PyObject* const* args, Py_ssize_t nargs, Meta* meta) {
  TORCH_CHECK(nargs >= 1, "_kernel_call(handle, *args)");
  const auto* k = reinterpret_cast<const CompiledKernel*>(PyLong_AsVoidPtr(args[0]));
  if (k == nullptr && PyErr_Occurred()) throw python_error();
  TORCH_CHECK(k != nullptr, "_kernel_call: null kernel handle");
  const size_t n = static_cast<size_t>(nargs - 1);
  TORCH_CHECK(n == k->kinds.size(), "neuron: compiled kernel ", k->name, " takes ", k->kinds.size(),
              " arguments, got ", n);
  std::vector<int64_t> slots(n);
  int device = -1;
  bool queueable = true;
  std::shared_ptr<neuron::rt::trace::Record> captured;  // what the replays' activities record
  if (C10_UNLIKELY(neuron::rt::engine::capturing())) {
    captured = prof::capture_template();
    captured->kind = neuron::rt::trace::Kind::Compiled;
    if (meta != nullptr) captured->meta = std::move(*meta);
  }
  for (size_t i = 0; i < n; ++i) {
    PyObject* a = args[i + 1];
    switch (k->kinds[i]) {
      case 'p':
      case 'o': {
        TORCH_CHECK(THPVariable_Check(a), "neuron: compiled kernel ", k->name, ": argument ", i, " must be a tensor");
        const at::Tensor& t = THPVariable_Unpack(a);
        if (C10_UNLIKELY(captured != nullptr)) prof::encode_tensor(captured->tensors, t, k->kinds[i] == 'o' ? prof::kOutput : 0);
        if (t.is_privateuseone() && (device < 0 || device == t.get_device())) {
          device = t.get_device();
        } else {
          queueable = false;  // host memory, or two devices: only a synchronous call reads it safely
        }
        slots[i] = reinterpret_cast<int64_t>(t.data_ptr());
        break;
      }
      case 'i': {
        const long long v = PyLong_AsLongLong(a);
        if (v == -1 && PyErr_Occurred()) throw python_error();
        slots[i] = static_cast<int64_t>(v);
        break;
      }
      default: {  // 'f': the value as a double's bits; the entry point narrows it as Inductor's binding does
        const double v = PyFloat_AsDouble(a);
        if (v == -1.0 && PyErr_Occurred()) throw python_error();
        std::memcpy(&slots[i], &v, sizeof v);
      }
    }
  }
  const PackedEntry entry = k->entry;
  if (queueable && device >= 0 && may_enqueue()) {
    enqueue_kernel(device, k->name.c_str(), [entry, slots = std::move(slots)] { entry(slots.data()); }, nullptr,
                   std::move(captured));
    return;
  }
  {
    pybind11::gil_scoped_release no_gil;  // the queue's kernels may need the GIL (engine.h)
    if (neuron::rt::engine::pending()) neuron::rt::engine::drain();
  }
  entry(slots.data());  // under the GIL, as Inductor's own binding calls it
}

// _kernel_call(handle, *args): fastcall, as it runs once per kernel of every compiled call.
PyObject* kernel_call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  call_kernel(args, nargs, nullptr);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _kernel_call_captured(meta, handle, *args): _kernel_call inside a graph capture, with the
// kernel's attribution for the replays' activities: `meta` a list of (key, JSON value) pairs.
PyObject* kernel_call_captured(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs >= 2, "_kernel_call_captured(meta, handle, *args)");
  Meta meta = py::handle(args[0]).cast<Meta>();
  call_kernel(args + 1, nargs - 1, &meta);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef g_kernel_call_def = {"_kernel_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&kernel_call)),
                                 METH_FASTCALL, "Run or queue a compiled neuron kernel: _kernel_call(handle, *args)."};
PyMethodDef g_kernel_call_captured_def = {
    "_kernel_call_captured", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&kernel_call_captured)),
    METH_FASTCALL, "_kernel_call in a graph capture, with the kernel's profiler attribution: (meta, handle, *args)."};

}  // namespace

void bind_compiled_kernels(py::module& m) {
  m.def("_kernel_register", &register_kernel, py::arg("entry"), py::arg("name"), py::arg("kinds"));
  for (PyMethodDef* def : {&g_kernel_call_def, &g_kernel_call_captured_def}) {
    PyObject* fn = PyCFunction_NewEx(def, nullptr, m.ptr());
    if (fn == nullptr) throw python_error();
    m.add_object(def->ml_name, py::reinterpret_steal<py::object>(fn));
  }
  // Whether a compiled kernel call needs more than _kernel_call: a profiler session records
  // device activity, or a graph is being captured (profiler/compiled.py, call).
  m.def("_trace_or_capture", [] { return neuron::rt::trace::active() || neuron::rt::engine::capturing(); });
}

}  // namespace torchneuron
