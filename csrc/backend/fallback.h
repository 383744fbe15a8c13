// The boxed zero-copy fallback (fallback.cpp), callable directly: Python kernels registered for
// PrivateUse1 (torchneuron/kernels/) use it to run an op's CPU kernel for the cases CPU covers.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace torchneuron {

void neuron_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// The same, redispatching to `cpu_key` (CPU, SparseCPU or SparseCsrCPU): the CPU twin of the
// neuron dispatch key that was called (sparse.cpp registers it for the sparse keys).
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack, c10::DispatchKey cpu_key);

}  // namespace torchneuron
