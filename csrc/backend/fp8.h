// fp8 conversions at memory speed, bit-identical to CPU's (c10's scalar conversions).
//
// CPU's copy_ converts float8_e4m3fn / float8_e5m2 element by element through c10's branchy
// scalar functions (~6 ns an element from fp8, ~1 ns to fp8 on the AVX2 host), a cost torchao's
// float8 training pays on every cast of every linear. Here: fp8 -> fp32/bf16 from tables of
// c10's own conversions (exact by construction, NaN bit patterns included), held in registers
// and indexed 32 codes at a time with AVX-512BW (else AVX2 bit arithmetic, or a load per
// element); fp32/bf16 -> fp8 with c10's integer algorithm on 8 lanes at a time (AVX2), c10's
// scalar function for tails and other CPUs. Also the widening of fp8 GEMM operands
// (scaled_mm.cpp, bf16_gemm.cpp's packing).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace torchneuron::fp8 {

inline bool is_fp8(c10::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// dst[i] = convert(src[i]) for i < n between an fp8 format and fp32 or bf16, either way.
// Returns false (doing nothing) for any other pair of dtypes.
bool convert(const void* src, c10::ScalarType from, void* dst, c10::ScalarType to, int64_t n);

// dst[r * ldd + i] = the bf16 value of code src[r * ld + i] (fp8 format `from`) for r < rows,
// i < n: convert's results, with one dispatch for a block of rows (GEMM kernels widening the
// rows of a tile call it per block).
void widen_rows_bf16(const uint8_t* src, int64_t ld, c10::ScalarType from, int64_t rows, int64_t n, uint16_t* dst,
                     int64_t ldd);

// dst.copy_(src) for CPU tensors of the same sizes and the same dense layout whose dtypes
// `convert` handles (parallel over the elements). Returns false, doing nothing, otherwise.
bool try_copy(const at::Tensor& dst, const at::Tensor& src);

// dst[i] = the fp8 code (e4m3 or e5m2) of min(max(v * *scale, bounds[0]), bounds[1]), v = src[i]
// (bf16 widened, or float32), the product skipped without `scale` and the clamp without
// `bounds`: the float32 kernels one after the other (ATen's clamp, c10's narrowing), bit for
// bit, in one pass in registers. Only where scaled_narrow_available().
void scaled_narrow(const void* src, bool bf16, const float* scale, const float* bounds, uint8_t* dst, bool e4m3,
                   int64_t n);
// Whether the host runs 512-bit integer ops at full width (Intel's AVX-512 cores), which
// scaled_narrow needs.
bool scaled_narrow_available();

// Whether the vectorized (AVX2) path of the fp32/bf16 -> fp8 conversion is in use.
bool vectorized();

}  // namespace torchneuron::fp8
