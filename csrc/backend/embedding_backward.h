// embedding's weight gradient written into the device's own result (see embedding_backward.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace torchneuron::embedding {

// Whether dense_backward takes these arguments: a contiguous floating gradient (fp32, fp64,
// bf16, fp16), contiguous int64/int32 indices, no scaling by frequency.
bool direct(const at::Tensor& grad, const at::Tensor& indices, bool scale_grad_by_freq);

// out (a contiguous [num_weights, D] CPU alias) = CPU's embedding_dense_backward(grad, indices,
// num_weights, padding_idx, false), bit for bit, without CPU's fresh allocation and the copy.
void dense_backward(const at::Tensor& out, const at::Tensor& grad, const at::Tensor& indices, int64_t padding_idx);

}  // namespace torchneuron::embedding
