// A bf16 x bf16 -> fp32 GEMM on AMX tiles (TDPBF16PS) whose weight operand may be fp8 codes,
// widened in cache: TensorE's fp8 matmul on the one host unit that multiplies 16-bit tiles.
//
// MKL's AMX GEMM (gemm.h, amx_bf16) reads bf16 only, so an fp8 GEMM handed to it first widens
// both operands to bf16 copies in memory, then MKL packs B again: at decode shapes (16 x 4096 x
// 4096) that is 12.3 ms against 1.1-1.6 ms for a bf16 matmul, and the AVX512-BF16 kernel
// (bf16_gemm.h), which widens in cache, is compute-bound at 4.7 ms. This kernel reads each fp8
// weight byte once: 32 weight rows (B's columns, contiguous along k: B column-major, as
// nn.Linear's weight.t() and _scaled_mm's mat2 are) are widened 256 k values at a time into a
// 16 KiB buffer in L1 and multiplied as AMX's row operand against the activations, packed once
// per call in AMX's pair (VNNI) layout. The product is so computed transposed (C^T = B^T A^T);
// each finished 32 x 32 block is transposed back in registers and goes through bf16_gemm.h's
// epilogue (alpha, row and column scales, bias, one rounding). 16 x 4096 x 4096 row-wise ->
// bf16: 0.79-0.92 ms, 0.68-0.85x a bf16 matmul; 1024^3 0.59-0.61x; 2048^3 1.1x.
//
// Numerics: bf16 products are exact in fp32 and TDPBF16PS accumulates them in fp32, in the
// order of k (the hardware's order within each instruction's 32 values), so every sum is MKL's
// AMX GEMM's bit for bit (checked by the tests) and independent of the other rows. Products of
// fp8 values are at least 2^-18 in magnitude: AMX's flushing of fp32 subnormals never applies.
#pragma once

#include <cstdint>
#include <vector>

#include "bf16_gemm.h"

namespace torchneuron::amx_gemm {

// Whether the kernel runs here: the CPU has AMX-BF16, the OS granted the tile state, and the
// tests have not switched AMX off (gemm::set_amx_enabled).
bool available();

// Whether gemm() takes these operands: B's columns contiguous along k (b.trans), any A.
bool supports(const bf16_gemm::Matrix& a, const bf16_gemm::Matrix& b);

// out = epilogue(A @ B) for A m x k and B k x n (bf16_gemm.h's Matrix and Output). Requires
// available() and supports(a, b).
void gemm(int64_t m, int64_t n, int64_t k, const bf16_gemm::Matrix& a, const bf16_gemm::Matrix& b,
          const bf16_gemm::Output& out);

// A bf16_gemm::Widen for int8 codes: every int8 value is exactly a bf16 one, so an int8 weight
// is read as its bf16 cast would be (torchao's weight-only int8 linear; fusion.cpp's GEMM family).
// Requires AVX512-FP16, which every AMX host has (fusion.cpp records an int8 widening only where
// cpu_features::avx512fp16() says so).
void widen_int8(const uint8_t* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst, int64_t ldd);

// One of several independent products (the groups of a grouped GEMM).
struct Product {
  int64_t m, n, k;
  bf16_gemm::Matrix a, b;
  bf16_gemm::Output out;
};

// Every product, their packing in one parallel region and their tasks in another: small groups
// share the threads instead of each paying two barriers.
void gemm(const std::vector<Product>& products);

}  // namespace torchneuron::amx_gemm
