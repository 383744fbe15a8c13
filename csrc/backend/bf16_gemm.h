// A bf16 x bf16 -> fp32 GEMM with AVX512-BF16 dot products (vdpbf16ps).
//
// ATen exposes oneDNN's bf16 GEMM only with a bf16 result, and MKL's bf16 x bf16 -> fp32 GEMM
// is 3.5x slower off AMX, so an exact fp32 accumulator over bf16 operands (fp8 _scaled_mm with
// row-wise scales or an fp32 output, _scaled_grouped_mm) used to cost an fp32 GEMM, 2x a bf16
// one. This kernel runs at oneDNN's bf16 rate (1024^3: 396 vs 413 GFLOP/s on 2 Zen 4 cores):
// products of bf16 values are exact in fp32, accumulation is fp32, nothing is rounded to bf16.
//
// Operands may also be 1-byte codes of a format whose values are all bf16 values (fp8): they are
// widened exactly while packed, so an fp8 GEMM needs no widened copies of its operands; and the
// fp32 sums of a finished tile go through the epilogue (alpha, row and column scales, bias) and,
// for a bf16 result, the one rounding while they are in cache.
#pragma once

#include <atomic>
#include <cstdint>

namespace torchneuron::bf16_gemm {

// Whether the kernel runs here: the CPU has AVX512-BF16 and set_enabled(false) was not called.
bool available();

// Tests turn the kernel off to exercise the routes of hosts without AVX512-BF16.
void set_enabled(bool enabled);

// Writes the exact bf16 bit patterns of `rows` rows of n 1-byte codes (e.g. an fp8 format's
// values), src row r at src + r * ld, dst row r at dst + r * ldd.
using Widen = void (*)(const uint8_t* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst, int64_t ldd);

// A rows x cols operand: element (r, c) at p[r * ld + c], or p[c * ld + r] if trans; p holds bf16
// bit patterns, or 1-byte codes that `widen` maps to bf16 when it is set.
struct Matrix {
  const void* p = nullptr;
  int64_t ld = 0;
  bool trans = false;
  Widen widen = nullptr;
};

// Where the m x n result goes: with s = the fp32 sum over k of A(i, k) * B(k, j),
//   v = ((alpha * s) * row_scale[i]) * col_scale[j] + bias[j]   (null pointers, alpha == 1: skipped)
// is stored as f32[i * ld + j] = v, or, with bf16 set instead of f32, bf16[i * ld + j] = v rounded
// to nearest even as CPU's Tensor.to(bfloat16) rounds (subnormals kept, NaN -> 0xFFFF). Exactly
// one of f32 and bf16 is set.
struct Output {
  float* f32 = nullptr;
  uint16_t* bf16 = nullptr;
  int64_t ld = 0;
  float alpha = 1.0f;
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;
  const float* bias = nullptr;
  // bf16 only: then each rounded v is multiplied by post_scale[j] in fp32 and rounded again, as
  // ATen's bf16 `mul` of the GEMM's result by a per-column vector computes it (the widened
  // vector here); an element that ends NaN sets *nan (its bits then are this epilogue's, which
  // ATen's scalar tail would write otherwise: the caller redoes the product through ATen).
  const float* post_scale = nullptr;
  std::atomic<bool>* nan = nullptr;
};

// out = epilogue(A @ B) for A m x k and B k x n (see Matrix, Output). Requires available().
void gemm(int64_t m, int64_t n, int64_t k, const Matrix& a, const Matrix& b, const Output& out);

// The pieces amx_gemm.h shares (both require AVX-512BW):
// packs lines [l0, min(l0 + 32, end)) of `lines` (element (line, k) is Matrix element (line, k))
// over k [k0, k0 + kc) as [(kc + 1) / 2][32][2] bf16: the values at k and k + 1 of each line side
// by side (vdpbf16ps' operand, AMX's VNNI layout), zeros past `end` and past k0 + kc; fp8 codes
// are widened on the way.
void pack_pairs32(const Matrix& lines, int64_t l0, int64_t end, int64_t k0, int64_t kc, uint16_t* out);

// Output's epilogue for the final fp32 sums of result rows [i0, i0 + rows) x columns
// [j0, j0 + cols), held in work (row i's sums at work + i * ldw).
void epilogue(const float* work, int64_t ldw, int64_t i0, int64_t rows, int64_t j0, int64_t cols, const Output& o);

}  // namespace torchneuron::bf16_gemm
