#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Bool inputs CUDA accepts and CPU's kernels refuse (CUDA dtype parity, issue 11): `abs` and
// `trace`. (`softsign` is x / (1 + |x|) in Python and follows from `abs`.) Every other dtype
// goes on to the boxed fallback unchanged, so those results stay CPU's; the bool test is one
// dtype compare on a path that is boxed anyway.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <torch/library.h>

#include "fallback.h"

namespace torchneuron {
namespace {

// aten::abs.out(Tensor self, *, Tensor(a!) out): CUDA's abs kernel is instantiated for bool and
// |b| == b, so the result is the input (cast to out's dtype as any unary out= op). The
// functional and in-place forms are composites over this one.
void abs_out(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t begin = stack->size() - 2;
  const at::Tensor self = (*stack)[begin].toTensor();
  if (self.scalar_type() != at::kBool) return neuron_fallback(op, stack);
  at::Tensor out = (*stack)[begin + 1].toTensor();
  TORCH_CHECK(out.device() == self.device(), "abs: expected out on ", self.device(), " (the input's device), got ",
              out.device());
  if (!out.is_same(self)) {
    at::native::resize_output(out, self.sizes());
    out.copy_(self);
  }
  stack->resize(begin);
  stack->emplace_back(out);
}

// aten::trace(Tensor self): CUDA sums the diagonal with sum's rules, so a bool matrix gives the
// number of true diagonal elements as int64 (CPU has no bool trace kernel).
void trace(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t begin = stack->size() - 1;
  const at::Tensor self = (*stack)[begin].toTensor();
  if (self.scalar_type() != at::kBool) return neuron_fallback(op, stack);
  TORCH_CHECK(self.dim() == 2, "trace: expected a matrix, but got tensor with dim ", self.dim());
  at::Tensor result = self.diagonal().sum();
  stack->resize(begin);
  stack->emplace_back(std::move(result));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("abs.out", torch::CppFunction::makeFromBoxedFunction<&abs_out>());
  m.impl("trace", torch::CppFunction::makeFromBoxedFunction<&trace>());
}

}  // namespace torchneuron
