#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Fast, exact fp8 conversions (see fp8.h).
#include "fp8.h"
#include "cpu_features.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torchneuron::fp8 {
namespace {

// ---- fp8 -> fp32 / bf16: tables of c10's results ---------------------------------------------
template <class F8>
std::array<uint32_t, 256> f32_table() {
  std::array<uint32_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    const float f = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
    std::memcpy(&t[i], &f, 4);
  }
  return t;
}

template <class F8>
std::array<uint16_t, 256> bf16_table() {
  std::array<uint16_t, 256> t{};
  for (int i = 0; i < 256; ++i) {
    // CPU's copy converts through float: c10::BFloat16(float) (NaN -> 0x7FC0).
    const c10::BFloat16 b(static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits())));
    t[i] = b.x;
  }
  return t;
}

const std::array<uint32_t, 256>& f32_of(c10::ScalarType t) {
  static const auto e4m3 = f32_table<c10::Float8_e4m3fn>();
  static const auto e5m2 = f32_table<c10::Float8_e5m2>();
  return t == at::kFloat8_e4m3fn ? e4m3 : e5m2;
}

const std::array<uint16_t, 256>& bf16_of(c10::ScalarType t) {
  static const auto e4m3 = bf16_table<c10::Float8_e4m3fn>();
  static const auto e5m2 = bf16_table<c10::Float8_e5m2>();
  return t == at::kFloat8_e4m3fn ? e4m3 : e5m2;
}

// The upper halves of c10's fp32 values of the codes 0..127 (the sign is bit 7). Every fp8 value
// is exact in bf16, so the lower halves are zero (NaNs too: c10 gives 0x7FF00000 / 0x7FE00000).
const std::array<uint16_t, 128>& upper_of(c10::ScalarType t) {
  auto build = [](const std::array<uint32_t, 256>& f32) {
    std::array<uint16_t, 128> u{};
    for (int i = 0; i < 128; ++i) {
      TORCH_INTERNAL_ASSERT((f32[i] & 0xFFFF) == 0 && (f32[i + 128] ^ f32[i]) == 0x80000000u);
      u[i] = static_cast<uint16_t>(f32[i] >> 16);
    }
    return u;
  };
  static const auto e4m3 = build(f32_of(at::kFloat8_e4m3fn));
  static const auto e5m2 = build(f32_of(at::kFloat8_e5m2));
  return t == at::kFloat8_e4m3fn ? e4m3 : e5m2;
}

template <class T>
void widen_table(const uint8_t* src, T* dst, int64_t n, const T* table) {
  // A table load per element: ~1 cycle each, no branches (CPU's path: ~6 ns an element).
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
}

#if defined(__x86_64__)
// 8 codes (zero-extended in 32-bit lanes) -> their fp32 bit patterns by arithmetic: normal
// numbers re-bias the exponent (a shift and an add), subnormals (m * 2^-9 / 2^-16) convert
// exactly through cvtdq2ps and one exact multiply. NaN/Inf codes are not handled here: the
// caller takes the table for any group of 8 that holds one (`special` mask).
template <bool E4M3>
__attribute__((target("avx2,fma"))) inline __m256i widen8(__m256i x, __m256i* special) {
  const __m256i m = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  constexpr int kShift = E4M3 ? 20 : 21;
  constexpr int kBias = E4M3 ? 120 : 112;  // 127 - 7, 127 - 15
  constexpr int kSubMax = E4M3 ? 8 : 4;    // codes below are subnormal (or zero)
  constexpr float kSubScale = E4M3 ? 1.0f / 512 : 1.0f / 65536;
  const __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(m, kShift), _mm256_set1_epi32(kBias << 23));
  const __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(kSubScale)));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(kSubMax), m);
  *special = _mm256_cmpgt_epi32(m, _mm256_set1_epi32(E4M3 ? 0x7E : 0x7B));
  return _mm256_or_si256(_mm256_blendv_epi8(nrm, sub, is_sub), sign);
}

template <bool E4M3, bool F32>
__attribute__((target("avx2,fma"))) void widen_avx2(const uint8_t* src, void* dst, int64_t n,
                                                     const uint32_t* f32_table, const uint16_t* bf16_table) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256i s0, s1;
    const __m256i r0 = widen8<E4M3>(_mm256_cvtepu8_epi32(bytes), &s0);
    const __m256i r1 = widen8<E4M3>(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), &s1);
    if (!_mm256_testz_si256(_mm256_or_si256(s0, s1), _mm256_or_si256(s0, s1))) {
      // A NaN or Inf among these 16: the table (c10's exact bits, NaN payloads included).
      if constexpr (F32) widen_table(src + i, static_cast<uint32_t*>(dst) + i, 16, f32_table);
      else widen_table(src + i, static_cast<uint16_t*>(dst) + i, 16, bf16_table);
      continue;
    }
    if constexpr (F32) {
      auto* d = static_cast<uint32_t*>(dst) + i;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), r0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 8), r1);
    } else {
      // Finite fp8 values are exact in bf16: the upper half of the fp32 pattern. packus per
      // 128-bit half, then the permute restores element order.
      const __m256i p = _mm256_packus_epi32(_mm256_srli_epi32(r0, 16), _mm256_srli_epi32(r1, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i),
                          _mm256_permute4x64_epi64(p, 0xD8));
    }
  }
  if constexpr (F32) widen_table(src + i, static_cast<uint32_t*>(dst) + i, n - i, f32_table);
  else widen_table(src + i, static_cast<uint16_t*>(dst) + i, n - i, bf16_table);
}
#endif

#if defined(__x86_64__)
// 32 codes per step (AVX-512BW): the low 7 bits index upper_of's 128 entries held in four
// registers (vpermi2w twice, then a blend on bit 6), the sign bit is or-ed back in; bf16 then
// maps every NaN to c10's 0x7FC0 (c10::BFloat16(float) drops a NaN's sign). fp32 is the
// pattern shifted up: c10's bits exactly, NaNs included. Tails take the tables.
template <bool F32>
__attribute__((target("avx512f,avx512bw"))) void widen_avx512(const uint8_t* src, void* dst, int64_t n,
                                                               const uint16_t* upper, const uint32_t* f32_table,
                                                               const uint16_t* bf16_table) {
  const __m512i t0 = _mm512_loadu_si512(upper), t1 = _mm512_loadu_si512(upper + 32);
  const __m512i t2 = _mm512_loadu_si512(upper + 64), t3 = _mm512_loadu_si512(upper + 96);
  const __m512i low7 = _mm512_set1_epi16(0x7F), bit6 = _mm512_set1_epi16(0x40), signbit = _mm512_set1_epi16(0x80);
  const __m512i mag = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80), qnan = _mm512_set1_epi16(0x7FC0);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m512i m = _mm512_and_si512(x, low7);
    const __m512i lo = _mm512_permutex2var_epi16(t0, m, t1);  // entries 0-63 (index bits 0-5)
    const __m512i hi = _mm512_permutex2var_epi16(t2, m, t3);  // entries 64-127
    __m512i r = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(m, bit6), lo, hi);
    r = _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(x, signbit), 8));
    if constexpr (F32) {
      uint32_t* d = static_cast<uint32_t*>(dst) + i;
      _mm512_storeu_si512(d, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(r)), 16));
      _mm512_storeu_si512(d + 16, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(r, 1)), 16));
    } else {
      const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(r, mag), inf);
      _mm512_storeu_si512(static_cast<uint16_t*>(dst) + i, _mm512_mask_mov_epi16(r, nan, qnan));
    }
  }
  if constexpr (F32) widen_table(src + i, static_cast<uint32_t*>(dst) + i, n - i, f32_table);
  else widen_table(src + i, static_cast<uint16_t*>(dst) + i, n - i, bf16_table);
}
#endif

#if defined(__x86_64__)
// bf16 results as two byte tables (AVX512-VBMI): vpermi2b looks up 64 codes at once in 128
// bytes, so the high bytes of bf16_of's 256 entries take two lookups and a blend on the sign
// bit, the low bytes one (they do not depend on the sign: a NaN's is 0xC0 either way), and byte
// unpacks interleave them into words; 64 codes in ~11 instructions against ~24 for the word
// tables above. Exactly bf16_of's entries (NaNs included), by construction.
struct ByteTables {
  alignas(64) uint8_t high[256];
  alignas(64) uint8_t low[128];
};

const ByteTables& bytes_of(c10::ScalarType t) {
  auto build = [](const std::array<uint16_t, 256>& b) {
    ByteTables bt{};
    for (int i = 0; i < 256; ++i) bt.high[i] = static_cast<uint8_t>(b[i] >> 8);
    for (int i = 0; i < 128; ++i) {
      TORCH_INTERNAL_ASSERT((b[i] & 0xFF) == (b[i + 128] & 0xFF));
      bt.low[i] = static_cast<uint8_t>(b[i] & 0xFF);
    }
    return bt;
  };
  static const ByteTables e4m3 = build(bf16_of(at::kFloat8_e4m3fn));
  static const ByteTables e5m2 = build(bf16_of(at::kFloat8_e5m2));
  return t == at::kFloat8_e4m3fn ? e4m3 : e5m2;
}

// Rows r < rows: dst[r * ldd + i] = bf16 of src[r * ld + i] for i < n (tables loaded once).
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void widen_vbmi(const uint8_t* src, int64_t ld, int64_t rows,
                                                                      int64_t n, uint16_t* dst, int64_t ldd,
                                                                      const ByteTables& bt, const uint16_t* table) {
  const __m512i h0 = _mm512_load_si512(bt.high), h1 = _mm512_load_si512(bt.high + 64);
  const __m512i h2 = _mm512_load_si512(bt.high + 128), h3 = _mm512_load_si512(bt.high + 192);
  const __m512i l0 = _mm512_load_si512(bt.low), l1 = _mm512_load_si512(bt.low + 64);
  // Byte unpacks interleave within 128-bit lanes: with the input's 8-byte groups in the order
  // 0 4 1 5 2 6 3 7, the low unpacks hold codes 0-31 in order and the high ones 32-63.
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * ld;
    uint16_t* d = dst + r * ldd;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m512i x = _mm512_permutexvar_epi64(order, _mm512_loadu_si512(s + i));
      const __m512i pos = _mm512_permutex2var_epi8(h0, x, h1);  // index bits 0-6: codes 0-127
      const __m512i neg = _mm512_permutex2var_epi8(h2, x, h3);  // codes 128-255
      const __m512i high = _mm512_mask_mov_epi8(pos, _mm512_movepi8_mask(x), neg);
      const __m512i low = _mm512_permutex2var_epi8(l0, x, l1);
      _mm512_storeu_si512(d + i, _mm512_unpacklo_epi8(low, high));
      _mm512_storeu_si512(d + i + 32, _mm512_unpackhi_epi8(low, high));
    }
    widen_table(s + i, d + i, n - i, table);
  }
}
#endif

// ---- fp32 / bf16 -> fp8: c10's algorithm ------------------------------------------------------
inline uint8_t narrow_scalar(float f, bool e4m3) {
  return e4m3 ? c10::Float8_e4m3fn(f).x : c10::Float8_e5m2(f).x;
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__x86_64__)
// c10::detail::fp8e4m3fn_from_fp32_value's / fp8e5m2_from_fp32_value's constants, on |f|'s bits.
template <bool E4M3>
struct NarrowConstants {
  static constexpr uint32_t kDenormMask = E4M3 ? (141u << 23) : (134u << 23);
  static constexpr uint32_t kMinNormal = E4M3 ? (121u << 23) : (113u << 23);
  static constexpr int kShift = E4M3 ? 20 : 21;  // dropped mantissa bits
  static constexpr uint32_t kRebias = E4M3 ? ((static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu)
                                           : ((static_cast<uint32_t>(15 - 127) << 23) + 0xFFFFFu);
};

// 8 fp32 bit patterns -> 8 fp8 codes (in the low byte of each 32-bit lane), exactly as
// c10::detail::fp8e4m3fn_from_fp32_value / fp8e5m2_from_fp32_value compute them.
template <bool E4M3>
__attribute__((target("avx2,fma"))) inline __m256i narrow8(__m256i f) {
  const __m256i signbit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i sign = _mm256_and_si256(f, signbit);
  const __m256i a = _mm256_xor_si256(f, sign);  // |f| bits, < 2^31: signed compares are safe
  using C = NarrowConstants<E4M3>;
  // Normal: re-bias, round to nearest even on the dropped bits. From the largest finite code up
  // (e4m3fn rounding into its NaN code, e5m2 into Inf, Inf itself, and the re-biased bits of
  // anything larger, all above the code) the unsigned min gives c10's result: e4m3fn saturates to
  // 0x7E, e5m2 becomes Inf (0x7C). Subnormal lanes wrap to large values here and are replaced.
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, C::kShift), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(static_cast<int>(C::kRebias))), odd), C::kShift);
  r = _mm256_min_epu32(r, _mm256_set1_epi32(E4M3 ? 0x7E : 0x7C));
  // Below the smallest normal: the float addition of the magic constant rounds to nearest even.
  const __m256i dmask = _mm256_set1_epi32(static_cast<int>(C::kDenormMask));
  const __m256i den = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(dmask))), dmask);
  r = _mm256_blendv_epi8(r, den, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(C::kMinNormal)), a));
  // NaN -> 0x7F. Every lane now holds its code (< 256).
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

// 8 source elements as fp32 bit patterns (bf16 widens exactly by a shift).
template <bool BF16>
__attribute__((target("avx2,fma"))) inline __m256i load8(const void* src, int64_t i) {
  if constexpr (BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
    return _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const float*>(src) + i));
  }
}

template <bool E4M3, bool BF16>
__attribute__((target("avx2,fma"))) void narrow_avx2(const void* src, uint8_t* dst, int64_t n) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i r0 = narrow8<E4M3>(load8<BF16>(src, i)), r1 = narrow8<E4M3>(load8<BF16>(src, i + 8));
    const __m256i r2 = narrow8<E4M3>(load8<BF16>(src, i + 16)), r3 = narrow8<E4M3>(load8<BF16>(src, i + 24));
    // Codes are 0..255: the saturating packs are exact; packs work per 128-bit half, the
    // final permute restores element order.
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(r0, r1), _mm256_packus_epi32(r2, r3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permutevar8x32_epi32(p, order));
  }
  for (; i < n; ++i) {
    const float f = BF16 ? bf16_to_float(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
    dst[i] = narrow_scalar(f, E4M3);
  }
}
#endif

#if defined(__x86_64__)
// narrow8's algorithm on 16 lanes (AVX-512: mask registers instead of blends, and vpmovdb
// narrows the 16 codes in order). Where 512-bit integer ops run at full width (Intel) it does
// twice narrow8's work per instruction; Zen 4 splits them and gains nothing (see narrow).
template <bool E4M3>
__attribute__((target("avx512f,avx512bw"))) inline __m128i narrow16(__m512i f) {
  const __m512i sign = _mm512_and_si512(f, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(f, sign);
  using C = NarrowConstants<E4M3>;
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, C::kShift), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>(C::kRebias))), odd), C::kShift);
  r = _mm512_min_epu32(r, _mm512_set1_epi32(E4M3 ? 0x7E : 0x7C));  // (narrow8 says why)
  const __m512i dmask = _mm512_set1_epi32(static_cast<int>(C::kDenormMask));
  const __m512i den = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(dmask))), dmask);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(C::kMinNormal)), a), den);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(r, _mm512_srli_epi32(sign, 24)));
}

template <bool E4M3, bool BF16>
__attribute__((target("avx512f,avx512bw"))) void narrow_avx512(const void* src, uint8_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i f;
    if constexpr (BF16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i));
      f = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    } else {
      f = _mm512_loadu_si512(static_cast<const float*>(src) + i);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), narrow16<E4M3>(f));
  }
  for (; i < n; ++i) {
    const float fv = BF16 ? bf16_to_float(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
    dst[i] = narrow_scalar(fv, E4M3);
  }
}

// Whether 512-bit integer ops run at full width: Intel's AVX-512 cores (AMD's Zen 4 splits them,
// and narrow16 measured no faster than narrow8 there).
bool wide_avx512() {
  static const bool yes = cpu_features::avx512bw() && __builtin_cpu_is("intel");
  return yes;
}
#endif

void narrow(const void* src, bool bf16, uint8_t* dst, bool e4m3, int64_t n) {
#if defined(__x86_64__)
  if (wide_avx512()) {
    if (e4m3) bf16 ? narrow_avx512<true, true>(src, dst, n) : narrow_avx512<true, false>(src, dst, n);
    else bf16 ? narrow_avx512<false, true>(src, dst, n) : narrow_avx512<false, false>(src, dst, n);
    return;
  }
  if (cpu_features::avx2_fma()) {
    if (e4m3) bf16 ? narrow_avx2<true, true>(src, dst, n) : narrow_avx2<true, false>(src, dst, n);
    else bf16 ? narrow_avx2<false, true>(src, dst, n) : narrow_avx2<false, false>(src, dst, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float f = bf16 ? bf16_to_float(static_cast<const uint16_t*>(src)[i]) : static_cast<const float*>(src)[i];
    dst[i] = narrow_scalar(f, e4m3);
  }
}

bool wide(c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

#if defined(__x86_64__)
// torchao's scaling cast in registers: each 16 values loaded (bf16 widened by a shift), times
// the scale, clamped, narrowed and stored as 16 codes, where the precompiled family's tiles
// (tile_fusion.cpp) store and reload the float32 vector between the steps. The same
// instructions as its steps (one vmulps, the bounds' vmaxps then vminps, narrow16), so the
// same bits; the tail runs them on masked lanes. Without a scale the factor is 1 and without
// a clamp the bounds are infinite: both then pass every value on to the same fp8 code (a
// signaling NaN comes out quiet, a subnormal flushed under FTZ/DAZ stays a signed zero: fp8
// keeps only a NaN's sign, and float32 subnormals round to +-0 in fp8).
template <bool E4M3>
__attribute__((target("avx512f,avx512bw"))) inline __m128i scaled_narrow16(__m512i f, __m512 s, __m512 l, __m512 h) {
  const __m512 v = _mm512_min_ps(h, _mm512_max_ps(l, _mm512_mul_ps(_mm512_castsi512_ps(f), s)));
  return narrow16<E4M3>(_mm512_castps_si512(v));
}
// 16 source values (the lanes in m, zeros elsewhere) as fp32 bit patterns.
template <bool BF16>
__attribute__((target("avx512f,avx512bw"))) inline __m512i load16(const void* src, int64_t i, __mmask16 m) {
  if constexpr (BF16) {
    // (a 512-bit masked load: AVX-512BW alone, no VL)
    const __m256i b = _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + i));
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16);
  } else {
    return _mm512_maskz_loadu_epi32(m, static_cast<const float*>(src) + i);
  }
}
template <bool E4M3, bool BF16>
__attribute__((target("avx512f,avx512bw"))) void scaled_narrow_avx512(const void* src, float scale, float lo,
                                                                       float hi, uint8_t* dst, int64_t n) {
  const __m512 s = _mm512_set1_ps(scale), l = _mm512_set1_ps(lo), h = _mm512_set1_ps(hi);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), scaled_narrow16<E4M3>(load16<BF16>(src, i, 0xFFFF), s, l, h));
  }
  if (i < n) {
    const auto m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m128i codes = scaled_narrow16<E4M3>(load16<BF16>(src, i, m), s, l, h);
    _mm512_mask_storeu_epi8(dst + i, m, _mm512_castsi128_si512(codes));
  }
}
#endif

}  // namespace

bool vectorized() { return cpu_features::avx2_fma(); }

bool scaled_narrow_available() {
#if defined(__x86_64__)
  return wide_avx512();
#else
  return false;
#endif
}

void scaled_narrow(const void* src, bool bf16, const float* scale, const float* bounds, uint8_t* dst, bool e4m3,
                   int64_t n) {
#if defined(__x86_64__)
  TORCH_INTERNAL_ASSERT(wide_avx512(), "fp8::scaled_narrow needs full-width AVX-512");
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float s = scale ? *scale : 1.f, lo = bounds ? bounds[0] : -kInf, hi = bounds ? bounds[1] : kInf;
  auto* run = e4m3 ? (bf16 ? scaled_narrow_avx512<true, true> : scaled_narrow_avx512<true, false>)
                   : (bf16 ? scaled_narrow_avx512<false, true> : scaled_narrow_avx512<false, false>);
  run(src, s, lo, hi, dst, n);
#else
  TORCH_INTERNAL_ASSERT(false, "fp8::scaled_narrow needs full-width AVX-512");
#endif
}

bool convert(const void* src, c10::ScalarType from, void* dst, c10::ScalarType to, int64_t n) {
  if (is_fp8(from) && wide(to)) {
    const auto* s = static_cast<const uint8_t*>(src);
    const uint32_t* t32 = f32_of(from).data();
    const uint16_t* t16 = bf16_of(from).data();
#if defined(__x86_64__)
    if (to == at::kBFloat16 && cpu_features::avx512vbmi()) {
      widen_vbmi(s, 0, 1, n, static_cast<uint16_t*>(dst), 0, bytes_of(from), t16);
      return true;
    }
    if (cpu_features::avx512bw()) {
      const uint16_t* up = upper_of(from).data();
      if (to == at::kFloat) widen_avx512<true>(s, dst, n, up, t32, t16);
      else widen_avx512<false>(s, dst, n, up, t32, t16);
      return true;
    }
    if (cpu_features::avx2_fma()) {
      const bool e4m3 = from == at::kFloat8_e4m3fn, f32 = to == at::kFloat;
      if (e4m3) f32 ? widen_avx2<true, true>(s, dst, n, t32, t16) : widen_avx2<true, false>(s, dst, n, t32, t16);
      else f32 ? widen_avx2<false, true>(s, dst, n, t32, t16) : widen_avx2<false, false>(s, dst, n, t32, t16);
      return true;
    }
#endif
    if (to == at::kFloat) widen_table(s, static_cast<uint32_t*>(dst), n, t32);
    else widen_table(s, static_cast<uint16_t*>(dst), n, t16);
    return true;
  }
  if (wide(from) && is_fp8(to)) {
    narrow(src, from == at::kBFloat16, static_cast<uint8_t*>(dst), to == at::kFloat8_e4m3fn, n);
    return true;
  }
  return false;
}

void widen_rows_bf16(const uint8_t* src, int64_t ld, c10::ScalarType from, int64_t rows, int64_t n, uint16_t* dst,
                     int64_t ldd) {
#if defined(__x86_64__)
  if (cpu_features::avx512vbmi()) {
    widen_vbmi(src, ld, rows, n, dst, ldd, bytes_of(from), bf16_of(from).data());
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r) convert(src + r * ld, from, dst + r * ldd, at::kBFloat16, n);
}

bool try_copy(const at::Tensor& dst, const at::Tensor& src) {
  const auto from = src.scalar_type(), to = dst.scalar_type();
  if (!((is_fp8(from) && wide(to)) || (wide(from) && is_fp8(to)))) return false;
  if (src.is_conj() || src.is_neg() || dst.is_conj() || dst.is_neg()) return false;
  if (!src.sizes().equals(dst.sizes()) || !src.strides().equals(dst.strides())) return false;
  if (!src.is_non_overlapping_and_dense() || !dst.is_non_overlapping_and_dense()) return false;
  const int64_t n = src.numel();
  if (n == 0) return true;
  // Same dense layout: the elements are the same permutation of both buffers, so a flat
  // conversion from each tensor's lowest address is the elementwise copy.
  for (int64_t i = 0; i < src.dim(); ++i) {
    if (src.stride(i) < 0) return false;
  }
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  const int64_t ss = src.element_size(), ds = dst.element_size();
  // Overlapping source and destination bytes would need CPU's overlap handling.
  const char* s_end = s + n * ss;
  const char* d_end = d + n * ds;
  if (s < d_end && d < s_end) return false;
  at::parallel_for(0, n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    convert(s + begin * ss, from, d + begin * ds, to, end - begin);
  });
  return true;
}

}  // namespace torchneuron::fp8
