// torchneuron._C._cpu_kernel: run one ATen overload's CPU kernel over neuron memory from Python.
//
// A Python kernel registered for PrivateUse1 replaces the boxed fallback for its op, so calling
// the same op again from that kernel would re-enter it. Kernels that handle only what CPU lacks
// (integer histc, CUDA-only dtypes, ...) hand every other case to this function, which parses the
// arguments against the overload's schema and runs the zero-copy fallback: the same path, and
// the same results, as if no Python kernel existed.
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include "fallback.h"

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

}  // namespace

void bind_cpu_kernel_call(py::module& m) {
  m.def("_cpu_kernel", &cpu_kernel, py::arg("name"), py::arg("overload"),
        "Run the CPU kernel of ATen overload name.overload zero-copy on neuron tensors (the boxed "
        "fallback), bypassing any Python kernel registered for the neuron key.");
}

}  // namespace torchneuron
