#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// The boxed fallback: any ATen op without a neuron kernel runs its CPU kernel zero-copy over
// device memory (see zero_copy.h; sparse arguments and results through sparse.h). This is what
// makes "every op that runs on CPU runs on neuron" true; the hot ops in ops.cpp skip the boxing
// for speed.
#include <ATen/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "../runtime/runtime.h"
#include "fallback.h"
#include "sparse.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

bool is_optional_generator(const c10::Argument& arg) {
  const auto& t = arg.real_type();
  if (t->kind() == c10::TypeKind::GeneratorType) return true;
  if (t->kind() != c10::TypeKind::OptionalType) return false;
  return t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

bool is_optional_tensor_list(const c10::Argument& arg) {
  const auto& t = arg.real_type();
  if (t->kind() != c10::TypeKind::ListType) return false;
  return t->castRaw<c10::ListType>()->getElementType()->kind() == c10::TypeKind::OptionalType;
}

// ---- CUDA dtype parity: widen what the CPU kernel lacks ------------------------------------
// CUDA kernels compute fp16/bf16 (and complex32) in fp32 (opmath) and round once; many CPU
// kernels have no fp16/bf16/complex32 instantiation at all ("... not implemented for 'Half'").
// When a CPU kernel refuses a narrow dtype, the fallback runs it again on widened copies
// (Half/BFloat16 -> Float, ComplexHalf -> ComplexFloat) and rounds the results once to the
// narrow dtype: CUDA's numerics for elementwise ops and reductions, where CPU had none.
bool is_narrow(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16 || t == c10::ScalarType::ComplexHalf;
}

c10::ScalarType widened(c10::ScalarType t) {
  return t == c10::ScalarType::ComplexHalf ? c10::ScalarType::ComplexFloat
         : is_narrow(t)                    ? c10::ScalarType::Float
                                           : t;
}

bool has_narrow_tensor(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && is_narrow(v.toTensor().scalar_type());
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) {
      if (t.defined() && is_narrow(t.scalar_type())) return true;
    }
  }
  return false;
}

bool is_scalar_type_arg(const c10::Argument& arg) {
  const auto& t = arg.real_type();
  if (t->kind() == c10::TypeKind::ScalarTypeType) return true;
  return t->kind() == c10::TypeKind::OptionalType &&
         t->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::ScalarTypeType;
}

bool refuses_narrow(const char* what) {
  const std::string msg(what);
  return msg.find("not implemented for 'Half'") != std::string::npos ||
         msg.find("not implemented for 'BFloat16'") != std::string::npos ||
         msg.find("not implemented for 'ComplexHalf'") != std::string::npos;
}

// Run `op` on widened copies of the (CPU alias) arguments in `args`; outputs written in place
// are copied back (rounded) into the original aliases; fresh results are rounded to the narrow
// dtype they were widened from. Leaves the results on `stack`.
void run_widened(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args, torch::jit::Stack* stack,
                 c10::DispatchKey cpu_key) {
  const auto& schema = op.schema();
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (original alias, widened copy)
  c10::ScalarType narrow_real = c10::ScalarType::Undefined, narrow_complex = c10::ScalarType::Undefined;
  auto widen = [&](const at::Tensor& t, bool write) {
    if (!t.defined() || !is_narrow(t.scalar_type())) return t;
    if (t.scalar_type() == c10::ScalarType::ComplexHalf) {
      narrow_complex = c10::ScalarType::ComplexHalf;
      if (narrow_real == c10::ScalarType::Undefined) narrow_real = c10::ScalarType::Half;
    } else {
      narrow_real = t.scalar_type();
    }
    at::Tensor w = t.to(widened(t.scalar_type()));
    if (write) written.emplace_back(t, w);
    return w;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& arg = schema.arguments()[i];
    const bool write = arg.alias_info() && arg.alias_info()->isWrite();
    c10::IValue v = args[i];
    if (v.isTensor()) {
      v = widen(v.toTensor(), write);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(widen(t, write));
      v = c10::IValue(std::move(list));
    } else if (v.isInt() && is_scalar_type_arg(arg)) {
      const auto t = static_cast<c10::ScalarType>(v.toInt());
      if (is_narrow(t)) {
        if (t == c10::ScalarType::ComplexHalf) narrow_complex = t;
        else narrow_real = t;
        v = c10::IValue(static_cast<int64_t>(widened(t)));
      }
    }
    stack->push_back(std::move(v));
  }
  op.redispatchBoxed(c10::DispatchKeySet(cpu_key), stack);
  for (auto& [orig, w] : written) {
    if (orig.sizes() != w.sizes()) orig.resize_(w.sizes());
    orig.copy_(w);
  }
  const size_t num_rets = schema.returns().size();
  const size_t rbegin = stack->size() - num_rets;
  auto narrow_back = [&](const at::Tensor& r) -> at::Tensor {
    if (!r.defined()) return r;
    for (auto& [orig, w] : written) {
      if (r.unsafeGetTensorImpl() == w.unsafeGetTensorImpl()) return orig;
    }
    if (r.scalar_type() == c10::ScalarType::Float && narrow_real != c10::ScalarType::Undefined) {
      return r.to(narrow_real);
    }
    if (r.scalar_type() == c10::ScalarType::ComplexFloat && narrow_complex != c10::ScalarType::Undefined) {
      return r.to(narrow_complex);
    }
    return r;
  };
  for (size_t i = 0; i < num_rets; ++i) {
    c10::IValue& v = (*stack)[rbegin + i];
    if (v.isTensor()) {
      v = narrow_back(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(narrow_back(t));
      v = c10::IValue(std::move(list));
    }
  }
}

}  // namespace

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, c10::DispatchKey cpu_key) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t begin = stack->size() - num_args;
  ZeroCopy zc;
  SparseAliases sp(zc);  // sparse arguments and results (sparse.h); idle for dense ops

  // Pass 1: tensors and devices decide the op's device and are replaced by CPU aliases.
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& v = (*stack)[begin + i];
    // How the profiler counts the argument's bytes: out= buffers are written, arguments
    // mutated in place are read and written.
    const auto& arg = schema.arguments()[i];
    const int64_t tf = arg.is_out() ? prof::kOutput
                       : (arg.alias_info() && arg.alias_info()->isWrite()) ? (prof::kOutput | prof::kRead)
                                                                          : 0;
    if (v.isTensor()) {
      v = alias_in(zc, sp, v.toTensor(), /*allow_cpu=*/false, tf);
    } else if (v.isDevice()) {
      c10::Device d = v.toDevice();
      if (d.type() == c10::DeviceType::PrivateUse1) {
        zc.set_device(d.has_index() ? d.index() : neuron::rt::current_device());
        v = c10::IValue(c10::Device(c10::kCPU));
      }
    } else if (v.isTensorList()) {
      // Lists are shared with the caller: build a new one rather than edit theirs.
      auto list = v.toTensorList();
      c10::List<at::Tensor> aliased;
      aliased.reserve(list.size());
      for (const at::Tensor& t : list) aliased.push_back(alias_in(zc, sp, t, /*allow_cpu=*/false, tf));
      v = c10::IValue(std::move(aliased));
    } else if (v.isList() && is_optional_tensor_list(schema.arguments()[i])) {
      // Tensor?[] (indices): CPU index tensors are allowed with neuron data, as on CUDA.
      auto list = v.toList();
      c10::List<std::optional<at::Tensor>> aliased;
      aliased.reserve(list.size());
      for (size_t j = 0; j < list.size(); ++j) {
        c10::IValue e = list.get(j);
        if (e.isTensor()) aliased.push_back(zc.in(e.toTensor(), /*allow_cpu=*/true));
        else aliased.push_back(std::nullopt);
      }
      v = c10::IValue(std::move(aliased));
    }
  }
  // Random ops have neuron kernels (random.cpp) drawing from the device's Philox generators; a
  // CPU kernel would draw from the CPU generator instead, so none may run here.
  for (size_t i = 0; i < num_args; ++i) {
    TORCH_CHECK_NOT_IMPLEMENTED(!is_optional_generator(schema.arguments()[i]), schema.operator_name(),
                                " draws random numbers and has no neuron kernel (csrc/backend/random.cpp "
                                "registers every random op with a CPU kernel); run it on the CPU.");
  }

  // Dense ops with a narrow floating argument keep their arguments for the widening retry.
  bool narrow = false;
  if (cpu_key == c10::DispatchKey::CPU) {
    for (size_t i = 0; i < num_args && !narrow; ++i) narrow = has_narrow_tensor((*stack)[begin + i]);
  }
  std::vector<c10::IValue> saved;
  if (narrow) saved.assign(stack->begin() + static_cast<std::ptrdiff_t>(begin), stack->end());

  zc.launch(schema.operator_name());
  if (!narrow) {
    op.redispatchBoxed(c10::DispatchKeySet(cpu_key), stack);
  } else {
    try {
      op.redispatchBoxed(c10::DispatchKeySet(cpu_key), stack);
    } catch (const c10::NotImplementedError& e) {
      if (!refuses_narrow(e.what())) throw;
      stack->resize(begin);
      run_widened(op, saved, stack, cpu_key);
    }
  }
  zc.sync_inputs();
  sp.sync();

  const size_t num_rets = schema.returns().size();
  const size_t rbegin = stack->size() - num_rets;
  for (size_t i = 0; i < num_rets; ++i) {
    c10::IValue& v = (*stack)[rbegin + i];
    if (v.isTensor()) {
      v = alias_out(zc, sp, v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> mapped;
      mapped.reserve(list.size());
      for (const at::Tensor& t : list) mapped.push_back(alias_out(zc, sp, t));
      v = c10::IValue(std::move(mapped));
    }
  }
}

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cpu_fallback(op, stack, c10::DispatchKey::CPU);
}

namespace {

// Quantized tensors are not implemented: one clear error instead of the dispatcher's list.
// (Sparse layouts run through cpu_fallback too; see sparse.cpp.)
void unsupported_layout(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "quantized neuron tensors are not implemented: ", op.schema().name(),
                              " was called with a quantized neuron tensor. Keep quantized work "
                              "on the CPU, or dequantize first.");
}

}  // namespace

TORCH_LIBRARY_IMPL(_, QuantizedPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&unsupported_layout>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
}

// Ops with both a CPU kernel and a CompositeExplicitAutograd "math" kernel: PrivateUse1 would
// get the math version (different numerics, many small ops). Send them to the CPU kernel,
// so neuron results are bit-identical to CPU. The list is every such op in torch 2.13
// (tests/device/test_dispatch.py keeps it complete).
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"native_layer_norm", "native_group_norm", "addr", "addr.out", "_stack",
                           "_stack.out", "all.dims_out", "any.dims_out", "linalg__powsum"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
  }
  // CompositeExplicitAutograd kernels that are device-specific inside: mode_out refuses devices
  // other than CPU/CUDA/XPU, conj_physical_ calls a DispatchStub (no neuron entry). Run on the
  // CPU aliases, where they take their CPU branch (tests/device/test_device_checks.py).
  for (const char* name : {"mode.values", "conj_physical_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
  }
}

}  // namespace torchneuron
