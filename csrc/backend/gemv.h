// Matrix-vector and few-row products with TensorE's numerics (exact products, fp32 sums, one
// rounding), for hosts whose CPU kernels are slow there: fp16 and bf16 operands, and weights of
// int8 (Adaptive Eager's GEMM family) or fp8 codes (scaled_mm.cpp), read as they are.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace torchneuron::gemv {

// The most activation rows few_rows() takes in bf16 (also fp8 operands, widened to bf16) and in
// fp16 (gemm.cpp's and scaled_mm.cpp's routes; the figures that chose them are in gemm.cpp).
constexpr int64_t kFewRowsBf16 = 16;
constexpr int64_t kFewRowsFp16 = 8;

// Whether gemv() runs here: x86-64 with AVX-512 (fp16 -> fp32 conversion and FMA in zmm).
bool available();

// o = round(beta * s + alpha * (m @ v)) with m (rows x k), v (k), s (rows, or broadcast to it;
// ignored when beta == 0) and o (rows, contiguous) CPU tensors of one dtype, fp16 or bf16; m with a unit stride in
// either dimension. Products exact in fp32, sums in fp32, one rounding. False (and nothing
// written) when the layout is not one it reads.
bool gemv(const at::Tensor& o, const at::Tensor& s, const at::Tensor& m, const at::Tensor& v, float beta,
          float alpha);

// o (m x n, contiguous) = round(alpha * a @ w.t() + beta * s) for a few activation rows a (m x k)
// and a weight w (n x k) with unit column stride (nn.Linear's weight; the product's B = w.t()),
// all of one dtype, fp16 or bf16; s (broadcast to m x n) read only when given and beta != 0.
// Each weight row is widened in registers and multiplied with 4 activation rows at a time: fp32
// sums of 16 lanes along k, reduced once, independent of the thread count; one rounding. False
// (nothing written) for another layout.
bool few_rows(const at::Tensor& o, const at::Tensor* s, const at::Tensor& a, const at::Tensor& w, float beta,
              float alpha);

// acc (m x n fp32, contiguous) = alpha * a @ w.t(), the few-row kernel's sums unrounded: a (m x k)
// fp16, bf16 or fp8, w (n x k, unit column stride) fp16/bf16 as a, or fp8 (its rows widened
// exactly to bf16 per chunk of k in cache). fp8 GEMMs of a few rows (scaled_mm.cpp) take it.
bool few_rows_f32(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& w, float alpha);

// few_rows(o, nullptr, a, W, 0, 1) (with one row: gemv's product, in its order) for a bf16
// weight W = w (n x k, unit column stride), or W =
// w.to(bf16) for int8 codes w (torchao's weight-only weight) read as they are: every int8 value is
// exact in bf16 and fp32, so the sums are few_rows's, in its order, and so are the bits. With
// post_scale (n floats, each a bf16 value) every rounded result r is then replaced by round(r *
// post_scale[j]) computed in fp32: ATen's bf16 `mul` by a column vector, element by element.
// Returns false if such a scaled result is NaN (fusion.cpp then redoes the mul through ATen, whose
// NaN bits depend on its path). a: m x k bf16, o: m x n bf16, contiguous.
bool few_rows_bf16(const at::Tensor& o, const at::Tensor& a, const at::Tensor& w, const float* post_scale);

// out[i * n + j] (bf16 bits) = acc[i * n + j] rounded to nearest even, and then, with post_scale,
// multiplied by post_scale[j] in fp32 and rounded again (few_rows_bf16's epilogue, also the
// routed GEMM's in fusion.cpp). False if a scaled result is NaN.
bool round_scale_bf16(const float* acc, int64_t m, int64_t n, const float* post_scale, uint16_t* out);

}  // namespace torchneuron::gemv
