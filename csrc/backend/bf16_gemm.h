// A bf16 x bf16 -> fp32 GEMM with AVX512-BF16 dot products (vdpbf16ps).
//
// ATen exposes oneDNN's bf16 GEMM only with a bf16 result, and MKL's bf16 x bf16 -> fp32 GEMM
// is 3.5x slower off AMX, so an exact fp32 accumulator over bf16 operands (fp8 _scaled_mm with
// row-wise scales or an fp32 output, _scaled_grouped_mm) used to cost an fp32 GEMM, 2x a bf16
// one. This kernel runs at oneDNN's bf16 rate (1024^3: 396 vs 413 GFLOP/s on 2 Zen 4 cores):
// products of bf16 values are exact in fp32, accumulation is fp32, nothing is rounded to bf16.
#pragma once

#include <cstdint>

namespace torchneuron::bf16_gemm {

// Whether this CPU has AVX512-BF16 (and the kernel can run).
bool available();

// c[i * ldc + j] = alpha * sum_k A(i, k) * B(k, j) + beta * c[i * ldc + j] for i < m, j < n, with
// A(i, k) = a[i * lda + k] (or a[k * lda + i] if trans_a) and B(k, j) = b[k * ldb + j] (or
// b[j * ldb + k] if trans_b), all as bf16 bit patterns. beta == 0 ignores c's contents.
// Requires available().
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
          int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace torchneuron::bf16_gemm
