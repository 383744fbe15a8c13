// An fp16 or bf16 matrix-vector product with TensorE's numerics for hosts whose CPU gemv in
// that dtype is slow.
#pragma once

#include <ATen/core/Tensor.h>

namespace torchneuron::gemv_f16 {

// Whether gemv() runs here: x86-64 with AVX-512 (fp16 -> fp32 conversion and FMA in zmm).
bool available();

// o = round(beta * s + alpha * (m @ v)) with m (rows x k), v (k), s (rows, or broadcast to it;
// ignored when beta == 0) and o (rows, contiguous) CPU tensors of one dtype, fp16 or bf16; m with a unit stride in
// either dimension. Products exact in fp32, sums in fp32, one rounding. False (and nothing
// written) when the layout is not one it reads.
bool gemv(const at::Tensor& o, const at::Tensor& s, const at::Tensor& m, const at::Tensor& v, float beta,
          float alpha);

}  // namespace torchneuron::gemv_f16
