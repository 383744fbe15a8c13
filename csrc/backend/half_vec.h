// 16 fp32, bf16 or fp16 values at a time in fp32 AVX-512 registers, with c10's roundings: what
// the row kernels (rms_norm.cpp, embedding_backward.cpp, gelu_tanh.cpp) load and store. Callers
// run these only where cpu_features::avx512bw() holds.
#pragma once

#include <c10/core/ScalarType.h>
#include <immintrin.h>

#include <cstdint>

namespace torchneuron::half_vec {

// The mask of the first min(n - i, 16) lanes.
inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
}

// 16 two-byte values: a whole vector through a plain 32-byte move, a tail through a byte-masked
// 512-bit one (AVX-512BW, no VL needed). Masked 512-bit moves for every vector made bf16 row adds
// 2.5x slower (docs/benchmarks.md, training layers).
__attribute__((target("avx512f,avx512bw"))) inline __m256i load(const uint16_t* p, __mmask16 m) {
  if (m == 0xFFFF) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(__mmask32(m), p));
}
__attribute__((target("avx512f,avx512bw"))) inline void store(uint16_t* p, __mmask16 m, __m256i v) {
  if (m == 0xFFFF) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  else _mm512_mask_storeu_epi16(p, __mmask32(m), _mm512_castsi256_si512(v));
}

// bf16 or fp16 bits to fp32 (exact).
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen(__m256i h, bool bf16) {
  return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

// fp32 to bf16 or fp16 bits, to nearest even as c10's conversions (bf16: NaN as c10's 0x7FC0).
__attribute__((target("avx512f,avx512bw"))) inline __m256i narrow(__m512 f, bool bf16) {
  if (!bf16) return _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
  const __m512i b = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// A kernel's storage dtype (fp32 arithmetic throughout).
enum class Dt { kF32, kBF16, kF16 };
inline Dt dt_of(c10::ScalarType t) {
  return t == c10::kFloat ? Dt::kF32 : t == c10::kBFloat16 ? Dt::kBF16 : Dt::kF16;
}

// 16 (masked) values of element i on as fp32, and back with one rounding.
__attribute__((target("avx512f,avx512bw"))) inline __m512 load(const void* p, int64_t i, __mmask16 m, Dt dt) {
  if (dt == Dt::kF32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  return widen(load(static_cast<const uint16_t*>(p) + i, m), dt == Dt::kBF16);
}
__attribute__((target("avx512f,avx512bw"))) inline void store(void* p, int64_t i, __mmask16 m, __m512 f, Dt dt) {
  if (dt == Dt::kF32) _mm512_mask_storeu_ps(static_cast<float*>(p) + i, m, f);
  else store(static_cast<uint16_t*>(p) + i, m, narrow(f, dt == Dt::kBF16));
}

}  // namespace torchneuron::half_vec
