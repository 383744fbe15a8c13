// Nested neuron tensors (torch.nested's strided layout) over CPU nested kernels, zero-copy.
//
// A strided nested tensor is one storage plus three CPU metadata tensors: each component's
// sizes, strides and storage offset. On neuron the storage is device memory, so a nested
// neuron tensor aliases as a CPU nested tensor over the ZeroCopy alias of its storage with the
// same metadata. CPU nested kernels run on that alias; a nested result maps back as a nested
// neuron tensor over ZeroCopy::out of its storage (an argument's storage for views, the argument
// itself for in-place results, fresh storage adopted). (The jagged layout, torch.nested's
// default, is a Python subclass over dense tensors and needs none of this, except where it
// converts to the strided layout, e.g. its math attention.)
#pragma once

#include <ATen/Tensor.h>
#include <c10/util/SmallVector.h>

#include <string>
#include <utility>
#include <vector>

#include "zero_copy.h"

namespace torchneuron {

class NestedAliases {
 public:
  explicit NestedAliases(ZeroCopy& zc) : zc_(zc) {}

  // A nested neuron tensor as a nested CPU tensor over the alias of its storage; a nested
  // tensor of another device next to neuron tensors raises, naming the fix.
  at::Tensor in(const at::Tensor& t);

  // A nested CPU result as a nested neuron tensor (the argument itself for an in-place
  // result). Results on other devices are returned as they are.
  at::Tensor out(const at::Tensor& cpu);

 private:
  ZeroCopy& zc_;
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 2> entries_;  // (neuron tensor, its alias)
};

// The ops nested.cpp runs by their NestedTensorCPU kernel directly on neuron tensors.
std::vector<std::string> nested_generic_ops();

}  // namespace torchneuron
