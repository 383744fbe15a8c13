#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Nested neuron tensors: the NestedTensorPrivateUse1 dispatch key (see nested.h).
//
// Two routes, as for sparse tensors (sparse.cpp):
//   * ops whose NestedTensorCPU kernel is device-generic and must stay so run it directly on
//     the neuron tensors (generic_kernel, fallback.h): the kernels that build results from the
//     options they are given (.to(), empty_like, ones_like, cross-device copy_, pinning), the
//     random ones (their CPU kernels call dropout/normal_ on the buffer, which then draws from
//     the neuron generator, as CUDA's do from CUDA's), and the metadata accessors (they return
//     the CPU metadata tensors, on CUDA too);
//   * every other op goes through cpu_fallback (fallback.cpp), which aliases nested arguments
//     with NestedAliases below and runs the NestedTensorCPU kernel. Many of those kernels are
//     device-generic as well, but some read the buffer's bytes directly (CPU's bmm, padding,
//     the transformer's bias/rescale) and the aliases make every one of them safe, including
//     with kernels still queued on the device.
// Both are registered per op, for every op with a NestedTensorCPU kernel: the nested keys get an
// op's CompositeImplicitAutograd kernel before a backend fallback, and where CPU overrides that
// decomposition with a nested kernel (matmul, linear, ...) the decomposition fails on nested
// tensors. Ops with no NestedTensorCPU kernel reach the backend fallback, which raises CPU's error.
#include "nested.h"

#include "fallback.h"

#include <ATen/NestedTensorImpl.h>
#include <ATen/native/nested/NestedTensorUtils.h>
#include <torch/library.h>

#include <string>

namespace torchneuron {

at::Tensor NestedAliases::in(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1,
              "Expected all tensors to be on the same device, but found a nested tensor on ", t.device(),
              " next to neuron tensors; move it with .to(\"neuron\") first.");
  const auto* impl = at::native::get_nested_tensor_impl(t);
  // The whole storage as a 1-d neuron tensor, aliased like any dense argument (this runs the
  // execution engine's queue: the CPU kernel reads the bytes).
  const at::Tensor buffer = zc_.in(impl->get_unsafe_storage_as_tensor());
  at::Tensor alias = at::detail::make_tensor<at::native::NestedTensorImpl>(
      buffer, impl->get_nested_sizes(), impl->get_nested_strides(), impl->get_storage_offsets());
  entries_.emplace_back(t, alias);
  return alias;
}

at::Tensor NestedAliases::out(const at::Tensor& cpu) {
  if (cpu.device().type() != c10::DeviceType::CPU) return cpu;
  for (const auto& [device, alias] : entries_) {
    if (alias.unsafeGetTensorImpl() == cpu.unsafeGetTensorImpl()) return device;  // in place
  }
  const auto* impl = at::native::get_nested_tensor_impl(cpu);
  const at::Tensor buffer = zc_.out(impl->get_unsafe_storage_as_tensor());
  return at::detail::make_tensor<at::native::NestedTensorImpl>(
      buffer, impl->get_nested_sizes(), impl->get_nested_strides(), impl->get_storage_offsets());
}

namespace {

void nested_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cpu_fallback(op, stack, c10::DispatchKey::NestedTensorCPU);
}

// Dense ops that build nested tensors from CPU metadata tensors (each component's sizes, strides
// and offsets live on the CPU for every device): the fallback takes those CPU arguments.
void metadata_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cpu_fallback(op, stack, c10::DispatchKey::CPU, /*cpu_tensors=*/true);
}

// The generic route (see the top of this file). Each is registered for NestedTensorCPU in
// torch 2.13 with the same function as for NestedTensorCUDA (tests/device/test_nested.py checks
// that they are NestedTensorCPU ops).
const char* const kGenericNested[] = {
    "_to_copy", "empty_like", "ones_like", "copy_", "_pin_memory", "is_pinned", "native_dropout",
    "normal_", "_nested_tensor_size", "_nested_tensor_strides", "_nested_tensor_storage_offsets"};

}  // namespace

std::vector<std::string> nested_generic_ops() {
  return {std::begin(kGenericNested), std::end(kGenericNested)};
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_nested_view_from_buffer", torch::CppFunction::makeFromBoxedFunction<&metadata_fallback>());
  m.impl("_nested_from_padded", torch::CppFunction::makeFromBoxedFunction<&metadata_fallback>());
}
TORCH_LIBRARY_IMPL(_, NestedTensorPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&nested_fallback>());
}
TORCH_LIBRARY_IMPL(aten, NestedTensorPrivateUse1, m) {
  register_layout_ops<c10::DispatchKey::NestedTensorCPU, &nested_fallback>(m, kGenericNested);
}

}  // namespace torchneuron
