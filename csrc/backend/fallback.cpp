#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// The boxed fallback: any ATen op without a neuron kernel runs its CPU kernel zero-copy over
// device memory (see zero_copy.h; sparse and nested arguments and results through layouts.h).
// This is what makes "every op that runs on CPU runs on neuron" true; the hot ops in ops.cpp
// skip the boxing for speed.
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/result_type.h>
#include <ATen/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../runtime/runtime.h"
#include "enqueue.h"
#include "fusion.h"
#include "fallback.h"
#include "layouts.h"
#include "sync_debug.h"
#include "vml_threads.h"
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

// Replace every tensor argument on the stack by its CPU alias (pass 1 of the fallback): tensors
// and devices decide the op's device. cpu_tensors: CPU tensor arguments are allowed (see
// cpu_fallback).
void alias_arguments(ZeroCopy& zc, LayoutAliases& sp, const c10::FunctionSchema& schema,
                     torch::jit::Stack* stack, size_t begin, bool cpu_tensors = false) {
  const size_t num_args = schema.arguments().size();
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& v = (*stack)[begin + i];
    // How the profiler counts the argument's bytes: out= buffers are written, arguments
    // mutated in place are read and written.
    const auto& arg = schema.arguments()[i];
    const int64_t tf = arg.is_out() ? prof::kOutput
                       : (arg.alias_info() && arg.alias_info()->isWrite()) ? (prof::kOutput | prof::kRead)
                                                                          : 0;
    if (v.isTensor()) {
      v = alias_in(zc, sp, v.toTensor(), cpu_tensors, tf);
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
      for (const at::Tensor& t : list) aliased.push_back(alias_in(zc, sp, t, cpu_tensors, tf));
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
}

// Run the CPU kernel on the aliased arguments at stack[begin:], with the widening retry for
// narrow dtypes CPU refuses; leaves the results on the stack.
void run_on_aliases(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t begin, c10::DispatchKey cpu_key) {
  // A small vector-math call on one MKL thread (vml_threads.h); the first argument is the input.
  // Every bound is at most ATen's grain: larger calls skip the op lookup (every fallback call
  // comes here).
  const bool serial_vml = begin < stack->size() && (*stack)[begin].isTensor() &&
                          (*stack)[begin].toTensor().numel() < kVmlGrain &&
                          (*stack)[begin].toTensor().numel() < serial_vml_bound(op.operator_name());
  SerialVml vml(serial_vml);
  // Dense ops with a narrow floating argument keep their arguments for the widening retry.
  bool narrow = false;
  if (cpu_key == c10::DispatchKey::CPU) {
    for (size_t i = begin; i < stack->size() && !narrow; ++i) narrow = has_narrow_tensor((*stack)[i]);
  }
  if (!narrow) {
    op.redispatchBoxed(c10::DispatchKeySet(cpu_key), stack);
    return;
  }
  std::vector<c10::IValue> saved(stack->begin() + static_cast<std::ptrdiff_t>(begin), stack->end());
  try {
    op.redispatchBoxed(c10::DispatchKeySet(cpu_key), stack);
  } catch (const c10::NotImplementedError& e) {
    if (!refuses_narrow(e.what())) throw;
    stack->resize(begin);
    run_widened(op, saved, stack, cpu_key);
  }
}

// ---- enqueued ops (enqueue.h) -------------------------------------------------------------
// In-place and out= ops write only their arguments, so their results exist at the call. Such an
// op is enqueued when its kernel can neither change a tensor's metadata nor fail on metadata
// the call could have checked:
//  - every tensor argument is a dense neuron tensor of one device and one dtype (Python numbers
//    too, if they do not promote it), so no cast can fail;
//  - every tensor argument has the written argument's shape or is 0-dim (lists: element by
//    element), so nothing broadcasts and an in-place op cannot fail on shapes;
//  - out= ops are pointwise (tagged so) and their outs have the result's shape already, so the
//    CPU kernel never resizes one;
//  - no written argument overlaps itself or partially overlaps another (CPU kernels raise).
// Meta kernels would check more, but many are Python (torch/_meta_registrations.py): 0.1-1 ms a
// call, 30-300x the kernel of a small op. Everything else runs synchronously.
struct Deferred {
  ZeroCopy zc{ZeroCopy::Queued{}};
  LayoutAliases sp{zc};
  torch::jit::Stack args;
};

bool writes_only_arguments(const c10::FunctionSchema& schema) {
  bool writes = false;
  for (const auto& a : schema.arguments()) {
    if (is_optional_generator(a) || a.real_type()->kind() == c10::TypeKind::DeviceObjType) return false;
    writes = writes || (a.alias_info() && a.alias_info()->isWrite());
  }
  if (!writes) return false;
  for (const auto& r : schema.returns()) {
    if (!r.alias_info() || !r.alias_info()->isWrite()) return false;
  }
  return true;
}

// The index of the argument a written return aliases.
size_t returned_argument(const c10::FunctionSchema& schema, size_t ret) {
  const auto& sets = schema.returns()[ret].alias_info()->beforeSets();
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto* info = schema.arguments()[i].alias_info();
    if (info && info->isWrite() && info->beforeSets() == sets) return i;
  }
  return SIZE_MAX;
}

bool plain_neuron(const at::Tensor& t, int* device) {
  if (!t.defined()) return true;
  if (is_number(t)) return true;  // a Python number
  if (!t.is_privateuseone() || t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return false;
  if (*device < 0) *device = t.device().index();
  return t.device().index() == *device;
}


bool enqueue_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t begin) {
  const auto& schema = op.schema();
  if (!writes_only_arguments(schema)) return false;
  const size_t num_args = schema.arguments().size();
  bool out_form = false;
  int device = -1;
  std::vector<at::Tensor> written, read, wrapped, singles;  // singles: tensors not in a list
  std::vector<c10::List<at::Tensor>> lists;
  std::vector<bool> list_written;
  for (size_t i = 0; i < num_args; ++i) {
    const c10::IValue& v = (*stack)[begin + i];
    const auto& arg = schema.arguments()[i];
    const bool write = arg.alias_info() && arg.alias_info()->isWrite();
    out_form = out_form || arg.is_out();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) continue;
      if (!plain_neuron(t, &device)) return false;
      if (t.is_cpu()) {
        wrapped.push_back(t);
      } else {
        (write ? written : read).push_back(t);
        singles.push_back(t);
      }
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (const at::Tensor& t : list) {
        if (!t.defined() || t.is_cpu() || !plain_neuron(t, &device)) return false;
        (write ? written : read).push_back(t);
      }
      lists.push_back(std::move(list));
      list_written.push_back(write);
    } else if (v.isList() && is_optional_tensor_list(arg)) {
      return false;  // indices (devices and generators: writes_only_arguments refused them)
    }
  }
  if (device < 0 || written.empty()) return false;
  if (out_form && !op.hasTag(at::Tag::pointwise)) return false;
  const at::Tensor& ref = written.front();  // shape and dtype to match
  // One dtype; Python numbers must not promote it.
  for (const auto* group : {&written, &read}) {
    for (const at::Tensor& t : *group) {
      if (t.scalar_type() != ref.scalar_type()) return false;
    }
  }
  for (const at::Tensor& w : wrapped) {
    if (!number_keeps_dtype(ref, w)) return false;
  }
  // Shapes: lists element by element (all lists of one length), single tensors 0-dim or the
  // written argument's shape.
  if (!lists.empty()) {
    const size_t n = lists.front().size();
    for (const auto& l : lists) {
      if (l.size() != n) return false;
    }
    // Element j of every list is one call of the per-tensor op: the written element's shape
    // (a read element may also be 0-dim, broadcast, as the capturable optimizers' step-derived
    // scalars are), and (as each such call checks) no written element partially overlapping
    // another element of its call.
    const size_t shape_list = static_cast<size_t>(
        std::find(list_written.begin(), list_written.end(), true) - list_written.begin());
    for (size_t j = 0; j < n; ++j) {
      const at::Tensor first = lists[shape_list < lists.size() ? shape_list : 0].get(j);
      for (size_t k = 0; k < lists.size(); ++k) {
        const at::Tensor e = lists[k].get(j);
        if (e.sizes() != first.sizes() && !(e.dim() == 0 && !list_written[k])) return false;
        if (!list_written[k]) continue;
        if (at::has_internal_overlap(e) == at::MemOverlap::Yes) return false;
        for (size_t m = 0; m < lists.size(); ++m) {
          const at::Tensor o = lists[m].get(j);
          if (m != k && partially_overlap(e, o)) return false;
        }
      }
    }
    // Tensors outside the lists broadcast to every element: 0-dim only.
    for (const at::Tensor& t : singles) {
      if (t.dim() != 0) return false;
    }
  } else {
    for (const auto* group : {&written, &read}) {
      for (const at::Tensor& t : *group) {
        if (t.dim() != 0 && t.sizes() != ref.sizes()) return false;
      }
    }
  }
  if (out_form) {
    // An out= must already have the result's shape (functional wrappers often pass an empty
    // one for the kernel to resize): the shape of a non-0-dim input, or 0-dim if all are.
    if (!lists.empty() || read.empty()) return false;
    const bool any_full = std::any_of(read.begin(), read.end(), [](const at::Tensor& t) { return t.dim() != 0; });
    for (const at::Tensor& w : written) {
      if ((w.dim() == 0) == any_full) return false;
    }
  }
  // No written tensor may overlap itself or partially overlap another argument of its call
  // (CPU kernels raise). Only a pointwise op may read the tensor it writes (x.add_(x)); others
  // raise for it (scatter_ with its own index) or depend on their order of writes.
  // List elements were checked call by call above.
  const bool pointwise = op.hasTag(at::Tag::pointwise);
  for (const at::Tensor& w : written) {
    if (lists.empty()) {
      if (at::has_internal_overlap(w) == at::MemOverlap::Yes) return false;
      for (const auto* group : {&written, &read}) {
        for (const at::Tensor& r : *group) {
          if (partially_overlap(w, r)) return false;
          if (!pointwise && group == &read && !disjoint_memory(w, r)) return false;
        }
      }
    } else {
      for (const at::Tensor& r : singles) {
        if (partially_overlap(w, r)) return false;
      }
    }
  }

  // Alias now (device checks raise here, at the call), run later.
  torch::jit::Stack originals(stack->begin() + static_cast<std::ptrdiff_t>(begin), stack->end());
  auto d = std::make_shared<Deferred>();
  alias_arguments(d->zc, d->sp, schema, stack, begin);
  d->args.assign(stack->begin() + static_cast<std::ptrdiff_t>(begin), stack->end());
  d->zc.release_tensors();
  stack->resize(begin);
  for (size_t r = 0; r < schema.returns().size(); ++r) {
    const size_t i = returned_argument(schema, r);
    TORCH_INTERNAL_ASSERT(i < originals.size(), schema.operator_name(), ": return ", r, " aliases no argument");
    stack->push_back(originals[i]);
  }
  // (Foreach lists carry records whenever the interpreted kernel may fuse them: fusion.h.)
  const bool record = lists.empty() ? fusion::enabled() : fusion::lists_enabled();
  enqueue_kernel(
      d->zc.device(), schema.operator_name().name.c_str(),
      [d, op] {
        d->zc.launch(op.schema().operator_name());
        torch::jit::Stack args = d->args;  // (a copy: a captured graph runs it again)
        run_on_aliases(op, &args, 0, c10::DispatchKey::CPU);
      },
      record ? fusion::boxed(op, originals) : nullptr, d->zc.captured_tensors());
  return true;
}

}  // namespace

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, c10::DispatchKey cpu_key,
                  bool cpu_tensors) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t begin = stack->size() - num_args;
  if (C10_UNLIKELY(sync_debug::enabled())) sync_debug::on_op(op, *stack, begin);  // nonzero, x[mask], ...
  if (may_enqueue() && cpu_key == c10::DispatchKey::CPU && enqueue_fallback(op, stack, begin)) return;
  ZeroCopy zc;
  LayoutAliases sp(zc);  // sparse and nested arguments and results (layouts.h); idle for dense ops

  alias_arguments(zc, sp, schema, stack, begin, cpu_tensors);
  zc.launch(schema.operator_name());
  run_on_aliases(op, stack, begin, cpu_key);
  zc.sync_inputs();
  sp.sparse.sync();

  // A quantized CPU result (quantize_per_tensor and the like) has no neuron form: adopted, it
  // would become a plain tensor of its integer codes, silently.
  auto map = [&](const at::Tensor& t) {
    TORCH_CHECK_NOT_IMPLEMENTED(!t.is_quantized(), "quantized neuron tensors are not implemented: ",
                                schema.name(), " would return one. Quantize on the CPU (torch.ao), "
                                "or use torchao's quantization, whose tensors run on neuron.");
    return alias_out(zc, sp, t);
  };
  const size_t num_rets = schema.returns().size();
  const size_t rbegin = stack->size() - num_rets;
  for (size_t i = 0; i < num_rets; ++i) {
    c10::IValue& v = (*stack)[rbegin + i];
    if (v.isTensor()) {
      v = map(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      c10::List<at::Tensor> mapped;
      mapped.reserve(list.size());
      for (const at::Tensor& t : list) mapped.push_back(map(t));
      v = c10::IValue(std::move(mapped));
    }
  }
}

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  cpu_fallback(op, stack, c10::DispatchKey::CPU);
}

namespace {

// Quantized tensors are not implemented: one clear error instead of the dispatcher's list.
// (Sparse and nested layouts run through cpu_fallback too; see sparse.cpp and nested.cpp.)
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

// Ops with both a CPU kernel and a CompositeExplicitAutograd or CompositeImplicitAutograd
// "math" kernel: PrivateUse1 would get the math version (different numerics, many small ops).
// Send them to the CPU kernel, so neuron results are bit-identical to CPU. The list is every
// such op in torch 2.13 (tests/device/test_dispatch.py keeps it complete); native_layer_norm,
// native_group_norm and silu_backward, also such ops, are registered unboxed in ops.cpp.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  for (const char* name : {"mish_backward", "native_channel_shuffle", "addr", "addr.out", "_stack",
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
