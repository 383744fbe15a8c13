// GELU's tanh approximation with SLEEF's 3.5-ULP tanh (see gelu_tanh.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace torchneuron::gelu_tanh {

// Whether forward/backward take these CPU aliases: contiguous fp32/bf16/fp16 of one dtype and
// shape, an AVX-512 host, and TORCHNEURON_FAST_TANH_GELU not 0.
bool available(const at::Tensor& a, const at::Tensor* grad = nullptr);

// out = gelu(a, approximate="tanh"); out = gelu_backward(grad, a, approximate="tanh").
void forward(const at::Tensor& out, const at::Tensor& a);
void backward(const at::Tensor& out, const at::Tensor& grad, const at::Tensor& a);

}  // namespace torchneuron::gelu_tanh
