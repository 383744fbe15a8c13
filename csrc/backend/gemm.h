// TensorE precision for host GEMMs (see gemm.cpp): what the GEMM family, convolution and
// attention share when a dtype has no fast exact CPU kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include "zero_copy.h"

namespace torchneuron::gemm {

// fp16 runs as TensorE runs it: exact products, fp32 accumulation, one rounding to fp16.
// CPU's own fp16 kernels are exact-product/fp32-accumulate too on some paths, but 10-400x
// slower than bf16 on a CPU without AVX512-FP16/AMX; fp32 is the fastest exact host path.
inline bool via_fp32(const at::Tensor& t) { return t.scalar_type() == at::kHalf; }

// A CPU tensor over a fresh buffer from the device's caching allocator (no page faults for
// large temporaries, unlike host allocations). `zc` keeps the buffer alive for the op.
at::Tensor scratch(ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype,
                   c10::IntArrayRef strides = {});

// An exact fp32 copy of `t` (fp16/bf16/fp32) in a scratch buffer, keeping a dense layout
// (a transposed operand stays transposed, which oneDNN reads without a reorder).
at::Tensor upcast(ZeroCopy& zc, const at::Tensor& t);

// out = alpha * (a @ b) + beta * out over fp32 CPU tensors, 2-d or 3-d (batched), through
// oneDNN where it is usable and faster than MKL (see gemm.cpp). beta == 0 ignores `out`.
void matmul_f32(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                float alpha);

// Whether oneDNN's bf16/fp32 matmul can run on this CPU (ATen checks the same ISA).
bool onednn_matmul_usable();

// Whether a (batch x) m x k @ k x n product is large enough for oneDNN to beat MKL (oneDNN has
// ~10 us of fixed cost per call; MKL wins on tiny and matrix-vector shapes).
bool prefer_onednn(int64_t m, int64_t n, int64_t k, int64_t batch = 1);

// out = alpha * (a @ b) + beta * out with a, b bf16 and out bf16 through oneDNN: fp32
// accumulation, alpha/beta applied in fp32, one rounding. Requires onednn_matmul_usable().
void matmul_bf16(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                 float alpha);

}  // namespace torchneuron::gemm
