// Whole-tensor extrema with CPU's bits (extrema.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace torchneuron::extrema {

// torch.max(t) of a CPU tensor (an alias of device memory), as the queued neuron kernel takes
// it: a permuted dense tensor over its memory in address order, CPU's own walk where the order
// could show (a zero or NaN result).
at::Tensor max_all(const at::Tensor& t);

}  // namespace torchneuron::extrema
