#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "sync_debug.h"

#include <c10/util/Exception.h>

#include <string>

namespace torchneuron::sync_debug {

namespace detail {
std::atomic<int> g_mode{0};

void report(const char* what) {
  if (g_mode.load(std::memory_order_relaxed) == 2) {
    TORCH_CHECK(false, "called a synchronizing neuron operation: ", what,
                " (torch.neuron.set_sync_debug_mode is \"error\")");
  }
  TORCH_WARN("called a synchronizing neuron operation: ", what);
}
}  // namespace detail

void set_mode(int mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "invalid value of debug_mode, expected one of 0, 1, 2 "
              "(\"default\", \"warn\", \"error\"), got ", mode);
  detail::g_mode.store(mode);
}

int mode() noexcept { return detail::g_mode.load(); }

void on_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t begin) {
  const std::string& name = op.schema().name();
  if (op.hasTag(at::Tag::dynamic_output_shape) || op.hasTag(at::Tag::data_dependent_output)) {
    detail::report(name.c_str());
    return;
  }
  // index.Tensor, index_put_, _index_put_impl_ (x[mask], x[mask] = v): the Tensor?[] indices.
  if (name != "aten::index" && name != "aten::index_put_" && name != "aten::index_put" &&
      name != "aten::_index_put_impl_") {
    return;
  }
  for (size_t i = begin; i < stack.size(); ++i) {
    if (!stack[i].isList()) continue;
    for (const c10::IValue& e : stack[i].toListRef()) {
      if (e.isTensor() && is_mask(e.toTensor())) {
        detail::report((name + " with a boolean mask").c_str());
        return;
      }
    }
  }
}

}  // namespace torchneuron::sync_debug
