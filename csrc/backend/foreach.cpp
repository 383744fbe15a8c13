// In-place `_foreach_*_` ops as one kernel over the whole list.
//
// ATen has no CPU foreach kernels: every backend without its own (CUDA has fused ones) gets the
// CompositeExplicitAutograd "slow path", which calls the per-tensor op once per element. On
// neuron that is one full dispatch, aliasing and (with the engine on) one queued kernel per
// tensor: an AdamW step of 16 parameters made 144 of them. Here the list op itself runs
// through the boxed fallback instead: one dispatch and one aliasing pass, and the CPU slow path
// on the aliases (the same per-tensor CPU kernels, so the same bits). With the engine on it is
// one queued kernel.
//
// The slow path stays for what one list kernel cannot take: lists spanning devices or holding
// CPU tensors (the fallback would refuse the mix; the slow path copies per tensor). Adaptive
// Eager fuses a queued list kernel whole, from one record per element (fusion.cpp).
//
// One functional list op is here too: `_foreach_sqrt`, the Adam family's denominators, between
// the in-place lists of the step. As one kernel it joins Adaptive Eager's region with them (the
// whole AdamW step then runs as one fused kernel per element count).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_foreach_sqrt_ops.h>
#include <ATen/ops/sqrt_cpu_dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "enqueue.h"
#include "fallback.h"
#include "fusion.h"
#include "vml_threads.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

// Every tensor argument a neuron tensor of one device, or a CPU 0-dim tensor (a scalar).
bool one_neuron_device(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size();
  int device = -1;
  auto fits = [&](const at::Tensor& t) {
    if (!t.defined()) return true;
    if (t.is_cpu()) return t.dim() == 0;
    if (!t.is_privateuseone()) return false;
    if (device < 0) device = t.device().index();
    return t.device().index() == device;
  };
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      if (!fits(v.toTensor())) return false;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) {
        if (!fits(t)) return false;
      }
    }
  }
  return true;  // (dispatch reached PrivateUse1: some argument is a neuron tensor)
}

void foreach_inplace(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (one_neuron_device(op, *stack)) {
    neuron_fallback(op, stack);
    return;
  }
  // The slow path: CPU has no kernel of its own, so its entry is the composite one, which
  // calls the per-tensor op on these (neuron) tensors.
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

constexpr const char* kForeachSqrt = "aten::_foreach_sqrt";

// `_foreach_sqrt` over contiguous floating neuron tensors of one device: per element CPU's sqrt
// kernel on the alias into a result from the device pool, as the slow path's per-tensor sqrt
// does on neuron (ops.cpp), so the same bits; one dispatch, one aliasing pass, one queued
// kernel. Anything else (CPU tensors, mixed devices, strided or integer elements, an empty
// list and its error) takes the slow path.
std::vector<at::Tensor> foreach_sqrt(at::TensorList self) {
  const bool fast = !self.empty() && std::all_of(self.begin(), self.end(), [&](const at::Tensor& t) {
    return t.defined() && t.is_privateuseone() && t.device() == self.front().device() &&
           c10::isFloatingType(t.scalar_type()) && t.is_contiguous() && !t.is_conj() && !t.is_neg();
  });
  if (!fast) return at::_ops::_foreach_sqrt::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), self);
  const bool queued = may_enqueue();
  auto zc = queued ? std::make_shared<ZeroCopy>(ZeroCopy::Queued{}) : std::make_shared<ZeroCopy>();
  std::vector<at::Tensor> outs, in, out;
  outs.reserve(self.size());
  in.reserve(self.size());
  out.reserve(self.size());
  for (const at::Tensor& t : self) {
    in.push_back(zc->in(t));
    outs.push_back(pooled(*zc, t.sizes(), t.scalar_type()));
    out.push_back(zc->in_output(outs.back()));
  }
  auto run = [zc, in = std::move(in), out = std::move(out)]() mutable {
    zc->launch(kForeachSqrt);
    for (size_t i = 0; i < in.size(); ++i) {
      SerialVml vml(in[i].numel() < kCheapVmlBound);  // vml_threads.h
      at::cpu::sqrt_out(out[i], in[i]);
    }
  };
  if (!queued) {
    run();
    return outs;
  }
  auto record = fusion::lists_enabled() ? fusion::list_sqrt(outs, self.vec(), kForeachSqrt) : nullptr;
  zc->release_tensors();
  enqueue_kernel(zc->device(), kForeachSqrt, std::move(run), std::move(record), zc->captured_tensors());
  return outs;
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) { m.impl("_foreach_sqrt", TORCH_FN(foreach_sqrt)); }

// Registered at load for every in-place foreach op whose CPU entry is the composite slow path
// (all of them in torch 2.13; tests/device/test_foreach.py checks the list is not empty).
const bool g_registered = [] {
  static torch::Library lib(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::_foreach_", 0) != 0 || name.name.back() != '_') continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      continue;
    }
    const std::string full = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    lib.impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&foreach_inplace>());
  }
  return true;
}();

}  // namespace
}  // namespace torchneuron
