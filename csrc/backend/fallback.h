// The boxed zero-copy fallback (fallback.cpp), callable directly: Python kernels registered for
// PrivateUse1 (torchneuron/kernels/) use it to run an op's CPU kernel for the cases CPU covers.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace torchneuron {

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace torchneuron
