// The boxed zero-copy fallback (fallback.cpp), callable directly: Python kernels registered for
// PrivateUse1 (torchneuron/kernels/) use it to run an op's CPU kernel for the cases CPU covers.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <iterator>
#include <string>
#include <unordered_set>
#include <tuple>
#include <utility>

namespace torchneuron {

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// The same, redispatching to `cpu_key` (CPU, SparseCPU, SparseCsrCPU or NestedTensorCPU): the
// CPU twin of the neuron dispatch key that was called (sparse.cpp and nested.cpp register it for
// the sparse and nested keys). cpu_tensors: CPU tensors may be arguments next to neuron ones, for
// ops whose metadata arguments are CPU tensors on every device (nested tensors' sizes).
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, c10::DispatchKey cpu_key,
                  bool cpu_tensors = false);

// For ops whose CPU kernel of another layout (sparse, nested) is device-generic, i.e. only builds
// tensors from options and metadata and calls other ops: run it on the neuron tensors themselves,
// under a guard for their device (what the generated CUDA wrappers do), so new tensors land there.
template <c10::DispatchKey CpuKey>
void generic_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  c10::OptionalDeviceGuard guard;
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    const c10::IValue& v = (*stack)[i];
    if (v.isTensor() && v.toTensor().device().type() == c10::DeviceType::PrivateUse1) {
      guard.reset_device(v.toTensor().device());
      break;
    }
    if (v.isDevice() && v.toDevice().type() == c10::DeviceType::PrivateUse1 && v.toDevice().has_index()) {
      guard.reset_device(v.toDevice());
      break;
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(CpuKey), stack);
}

// The per-op registration of a layout's neuron key (sparse.cpp, nested.cpp): every aten op with a
// kernel for the layout's CPU key (read from the dispatcher at load time, so the list is complete
// by construction) gets generic_kernel if listed in `generic`, else `Fallback`, unless `special`
// registers one of its own for it (and returns true).
template <c10::DispatchKey CpuKey, c10::BoxedKernel::BoxedKernelFunction* Fallback, size_t N>
void register_layout_ops(torch::Library& m, const char* const (&generic)[N],
                         bool (*special)(torch::Library&, const std::string&) = nullptr) {
  const std::unordered_set<std::string> generic_names(std::begin(generic), std::end(generic));
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNamesForDispatchKey(CpuKey)) {
    if (op.name.rfind("aten::", 0) != 0) continue;
    std::string name = op.name.substr(6);
    if (!op.overload_name.empty()) name += "." + op.overload_name;
    if (special != nullptr && special(m, name)) continue;
    if (generic_names.count(name) > 0) {
      m.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&generic_kernel<CpuKey>>());
    } else {
      m.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<Fallback>());
    }
  }
}

// Unboxed kernels' way into the fallback: their synchronous path, or the cases they leave to it.
// `Name` is "aten::op.overload" (or "aten::op"): the handle is looked up once per hot op.
template <const char* Name> const c10::OperatorHandle& op_handle() {
  static const c10::OperatorHandle op = [] {
    const std::string full(Name);
    const auto dot = full.find('.');
    return dot == std::string::npos ? c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), "")
                                    : c10::Dispatcher::singleton().findSchemaOrThrow(
                                          full.substr(0, dot).c_str(), full.substr(dot + 1).c_str());
  }();
  return op;
}

// Runs the op through the boxed fallback; returns the stack (the op's results).
template <const char* Name, class... A> torch::jit::Stack via_fallback(const A&... args) {
  torch::jit::Stack stack;
  stack.reserve(sizeof...(A));
  torch::jit::push(stack, args...);
  cpu_fallback(op_handle<Name>(), &stack, c10::DispatchKey::CPU);
  return stack;
}

// The op's results, the last entries of the fallback's stack, as the kernel's return type.
template <class R> struct FromStack {
  static R get(torch::jit::Stack&& s) { return s.back().template to<R>(); }
};
template <class... T> struct FromStack<std::tuple<T...>> {
  static std::tuple<T...> get(torch::jit::Stack&& s) {
    return get(std::move(s), std::index_sequence_for<T...>{});
  }
  template <size_t... I>
  static std::tuple<T...> get(torch::jit::Stack&& s, std::index_sequence<I...>) {
    const size_t first = s.size() - sizeof...(T);
    return {std::move(s[first + I]).template to<T>()...};
  }
};

}  // namespace torchneuron
