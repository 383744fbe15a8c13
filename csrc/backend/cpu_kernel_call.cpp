// torchneuron._C._cpu_kernel: run one ATen overload's CPU kernel over neuron memory from Python.
//
// A Python kernel registered for PrivateUse1 replaces the boxed fallback for its op, so calling
// the same op again from that kernel would re-enter it. Kernels that handle only what CPU lacks
// (integer histc, CUDA-only dtypes, ...) hand every other case to this function, which parses the
// arguments against the overload's schema and runs the zero-copy fallback: the same path, and
// the same results, as if no Python kernel existed.
#include <torch/csrc/jit/python/pybind_utils.h>
// torch/csrc/utils/pybind.h, not torch/extension.h: the latter pulls in the whole C++ frontend
// (torch/all.h), which more than doubles this unit's compile time.
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <set>

#include "fallback.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

py::object cpu_kernel(const std::string& name, const std::string& overload, py::args args,
                      const py::kwargs& kwargs) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  torch::jit::Stack stack =
      torch::jit::createStackForSchema(op.schema(), torch::jit::tuple_slice(std::move(args)), kwargs, std::nullopt);
  {
    py::gil_scoped_release no_gil;
    neuron_fallback(op, &stack);
  }
  return torch::jit::createPyObjectForStack(std::move(stack));
}

// Python kernels (torchneuron/kernels) compute CUDA-only ops with CPU torch ops. Run on the
// neuron tensors themselves, every one of those ops would go through the boxed fallback; run on
// zero-copy CPU aliases (one ZeroCopy for the whole kernel) they are plain CPU calls, and the
// kernel's results map back as the fallback's do (inputs stay themselves, views stay views,
// fresh results are adopted without a copy).
py::object alias_args(ZeroCopy& zc, const py::handle& obj) {
  if (THPVariable_Check(obj.ptr())) {
    return py::cast(zc.in(THPVariable_Unpack(obj.ptr()), /*allow_cpu=*/false));
  }
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    py::list out;
    for (const auto& e : obj) out.append(alias_args(zc, e));
    if (py::isinstance<py::tuple>(obj)) return py::tuple(out);
    return std::move(out);
  }
  return py::reinterpret_borrow<py::object>(obj);
}

py::object map_results(ZeroCopy& zc, const py::handle& obj) {
  if (THPVariable_Check(obj.ptr())) return py::cast(zc.out(THPVariable_Unpack(obj.ptr())));
  if (py::isinstance<py::tuple>(obj) || py::isinstance<py::list>(obj)) {
    py::list out;
    for (const auto& e : obj) out.append(map_results(zc, e));
    if (py::isinstance<py::tuple>(obj)) return py::tuple(out);
    return std::move(out);
  }
  return py::reinterpret_borrow<py::object>(obj);
}

// Op counting keys on stable name addresses (zero_copy.h): intern each kernel name once.
const char* interned(const std::string& name) {
  static std::mutex mu;
  static std::set<std::string> names;
  std::lock_guard<std::mutex> lock(mu);
  return names.insert(name).first->c_str();
}

py::object on_cpu(const std::string& name, const py::function& fn, const py::args& args) {
  ZeroCopy zc;
  py::tuple aliased = alias_args(zc, args);
  zc.launch(interned(name));
  py::object result = fn(*aliased);
  zc.sync_inputs();
  return map_results(zc, result);
}

}  // namespace

void bind_cpu_kernel_call(py::module& m) {
  m.def("_cpu_kernel", &cpu_kernel, py::arg("name"), py::arg("overload"),
        "Run the CPU kernel of ATen overload name.overload zero-copy on neuron tensors (the boxed "
        "fallback), bypassing any Python kernel registered for the neuron key.");
  m.def("_on_cpu", &on_cpu, py::arg("name"), py::arg("fn"),
        "_on_cpu(name, fn, *args): call fn with every neuron tensor in args (also inside lists and "
        "tuples) replaced by a zero-copy CPU alias, then map fn's CPU results back to neuron "
        "tensors without copies. Devices are checked as for any op; name is the kernel's name "
        "in get_executed_ops and the profiler.");
}

}  // namespace torchneuron
