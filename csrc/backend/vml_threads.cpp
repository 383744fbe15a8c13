// Which ATen ops compute with MKL's vector math (vml_threads.h).
#include "vml_threads.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <unordered_map>
#include <utility>

namespace torchneuron {

int64_t serial_vml_bound(const c10::OperatorName& op) {
  // The float/double kernels ATen/cpu/vml.h implements with MKL (IMPLEMENT_VML_MKL), each as
  // functional, in-place and out= op. Keys are the dispatcher's own names (stable addresses).
  static const std::unordered_map<const c10::OperatorName*, int64_t>* bounds = [] {
    auto* map = new std::unordered_map<const c10::OperatorName*, int64_t>();
    for (const char* base : {"acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
                             "sin", "sqrt", "tan", "tanh", "trunc"}) {
      const std::string name = std::string("aten::") + base;
      const bool cheap = name == "aten::sqrt" || name == "aten::trunc";
      for (const auto& [n, overload] : {std::pair<std::string, std::string>{name, ""}, {name + "_", ""}, {name, "out"}}) {
        auto handle = c10::Dispatcher::singleton().findOp(c10::OperatorName(n, overload));
        if (handle) map->emplace(&handle->operator_name(), cheap ? kCheapVmlBound : 512);
      }
    }
    return map;
  }();
  const auto it = bounds->find(&op);
  return it == bounds->end() ? 0 : it->second;
}

}  // namespace torchneuron
