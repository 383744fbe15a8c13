#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Matrix-vector products (mv, addmv, one-row mm) at the speed of reading the matrix, and
// few-row products (decode steps) reading each weight row once.
//
// A matrix-vector product reads every element of the matrix once, so its time is the matrix's
// bytes over memory bandwidth, and TensorE's contract (exact products, fp32 sums, one rounding)
// costs nothing extra: widening an fp16 element to fp32 is one instruction. Where ATen gives fp16
// gemv to oneDNN (AVX512-FP16 hosts) it took 262 us for 1024^2 against 64 us for bf16 (a matmul
// primitive on one column), and so did bf16 on hosts whose bf16 dot products run at half rate
// (gemm.h, bf16_half_rate: 309 us against fp16's 48 us through this kernel); this kernel reads
// the 16-bit matrix directly, in either layout:
//   - row-major (unit column stride): one fp32 dot product per row, 64 columns per step in four
//     independent accumulators;
//   - column-major (unit row stride, e.g. mv(A.t(), x)): blocks of 128 rows accumulated in eight
//     registers, one column's 128 contiguous values per step.
// Rows are shared by the intra-op threads. The vector is widened once into fp32.
//
// The same reading of a weight serves products of a few rows (few_rows: decode steps of several
// sequences, 4 activation rows per weight row read from L1), and, for Adaptive Eager's GEMM
// family (fusion.cpp), weights of int8 codes (torchao's weight-only linear), widened in
// registers as cheaply as bf16 values, with the column product in the epilogue; fp8 GEMMs of a
// few rows (scaled_mm.cpp) read fp8 weight codes, widened to bf16 per chunk in cache.
#include "gemv.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16_gemm.h"
#include "cpu_features.h"
#include "fp8.h"
#include "half_vec.h"

namespace torchneuron::gemv {
namespace {

#if defined(__x86_64__)
// 16 values widened exactly to fp32: fp16 by F16C's conversion, bf16 by shifting its bits into
// the top half of an fp32 word.
template <bool BF16>
__attribute__((target("avx512f,avx512bw,f16c,fma"))) inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

template <bool BF16>
inline float widen1(uint16_t b) {
  if constexpr (BF16) return static_cast<float>(c10::BFloat16(b, c10::BFloat16::from_bits()));
  else return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
}

// 16 values (n <= 16 of them, the rest zero) of a 16-bit row widened to fp32.
template <bool BF16>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline __m512 widen16_tail(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

// fp32 scratch aligned to a cache line, so the kernels' 64-byte loads of it never straddle two
// lines (malloc's 16-byte alignment made most of them do: ~7 % of a few-row product's time).
class Floats {
 public:
  explicit Floats(int64_t n)
      : p_(static_cast<float*>(std::aligned_alloc(64, (std::max<int64_t>(n, 1) * sizeof(float) + 63) / 64 * 64))) {
    TORCH_CHECK(p_ != nullptr, "out of host memory for a ", n, "-float scratch");
  }
  ~Floats() { std::free(p_); }
  Floats(const Floats&) = delete;
  Floats& operator=(const Floats&) = delete;
  Floats(Floats&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  float* data() const { return p_; }

 private:
  float* p_;
};

// A 16-bit vector (fp16 or bf16, by `dtype`) widened to fp32, 16 values per step.
__attribute__((target("avx512f,avx512bw"))) Floats widened(const uint16_t* v, int64_t n, c10::ScalarType dtype) {
  Floats x(n);
  const half_vec::Dt dt = half_vec::dt_of(dtype);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = half_vec::lanes(j, n);
    half_vec::store(x.data(), j, m, half_vec::load(v, j, m, dt), half_vec::Dt::kF32);
  }
  return x;
}

// The weight formats block() reads: 16-bit floats, or int8 (torchao's weight-only codes), whose
// values are exact in fp32 and bf16 alike; widening 16 of them costs two instructions either way
// (a sign/zero extension and a shift or conversion), so int8 reads half the bytes for nothing.
enum Src { kF16, kBF16, kI8 };
template <int S>
using Elem = std::conditional_t<S == kI8, int8_t, uint16_t>;

template <int S>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline __m512 wload(const Elem<S>* p) {
  if constexpr (S == kI8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  else return widen16<S == kBF16>(p);
}
template <int S>
inline float wload1(const Elem<S>* p) {
  if constexpr (S == kI8) return static_cast<float>(*p);
  else return widen1<S == kBF16>(*p);
}
template <int S>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) inline __m512 wload_tail(const Elem<S>* p, __mmask16 m) {
  if constexpr (S == kI8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  else return widen16_tail<S == kBF16>(p, m);
}

// acc[i] = sum_j m[i * ld + j] * x[j] for rows [r0, r1) (m in format S)
template <int S>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void rows_dot(const Elem<S>* m, int64_t ld,
                                                                             const float* x, int64_t k, float* acc,
                                                                             int64_t r0, int64_t r1) {
  for (int64_t i = r0; i < r1; ++i) {
    const Elem<S>* row = m + i * ld;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 64 <= k; j += 64) {
      a0 = _mm512_fmadd_ps(wload<S>(row + j), _mm512_loadu_ps(x + j), a0);
      a1 = _mm512_fmadd_ps(wload<S>(row + j + 16), _mm512_loadu_ps(x + j + 16), a1);
      a2 = _mm512_fmadd_ps(wload<S>(row + j + 32), _mm512_loadu_ps(x + j + 32), a2);
      a3 = _mm512_fmadd_ps(wload<S>(row + j + 48), _mm512_loadu_ps(x + j + 48), a3);
    }
    for (; j + 16 <= k; j += 16) a0 = _mm512_fmadd_ps(wload<S>(row + j), _mm512_loadu_ps(x + j), a0);
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; j < k; ++j) sum = std::fma(wload1<S>(row + j), x[j], sum);
    acc[i] = sum;
  }
}

// acc[i] = sum_j m[j * ld + i] * x[j] for rows [r0, r1) (a column-major matrix)
template <bool BF16>
__attribute__((target("avx512f,avx512bw,f16c,fma"))) void cols_axpy(const uint16_t* m, int64_t ld, const float* x,
                                                                    int64_t k, float* acc, int64_t r0, int64_t r1) {
  constexpr int64_t kBlock = 128;
  int64_t i0 = r0;
  for (; i0 + kBlock <= r1; i0 += kBlock) {
    __m512 a[8];
    for (auto& r : a) r = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; ++j) {
      const uint16_t* col = m + j * ld + i0;
      const __m512 xj = _mm512_set1_ps(x[j]);
      for (int v = 0; v < 8; ++v) a[v] = _mm512_fmadd_ps(widen16<BF16>(col + 16 * v), xj, a[v]);
    }
    for (int v = 0; v < 8; ++v) _mm512_storeu_ps(acc + i0 + 16 * v, a[v]);
  }
  if (i0 < r1) {  // the last rows, in the same order of sums
    for (int64_t i = i0; i < r1; ++i) acc[i] = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const uint16_t* col = m + j * ld;
      for (int64_t i = i0; i < r1; ++i) acc[i] = std::fma(widen1<BF16>(col[i]), x[j], acc[i]);
    }
  }
}

// The partial sums of R activation rows (fp32, a[r * lda + j]) with T weight rows (format S, the
// value at k index j of row t at w[t * ldw + j - j0]) over k in [j0, j1): R x T vectors of 16
// lanes, part[(r * T + t) * 16 + lane], each lane summing its k values in order; zero-initialized
// when `first`. j0 is a multiple of 16; only j1 = k may leave a tail.
template <int S, int R, int T>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma"))) void block(const float* a, int64_t lda,
                                                                          const Elem<S>* w, int64_t ldw,
                                                                          int64_t j0, int64_t j1, float* part,
                                                                          bool first) {
  __m512 c[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) c[r][t] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (r * T + t) * 16);
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    __m512 wv[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) wv[t] = wload<S>(w + t * ldw + (j - j0));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_loadu_ps(a + r * lda + j);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) c[r][t] = _mm512_fmadd_ps(av, wv[t], c[r][t]);
    }
  }
  if (j < j1) {
    const __mmask16 m = static_cast<__mmask16>((1u << (j1 - j)) - 1u);
    __m512 wv[T];
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) wv[t] = wload_tail<S>(w + t * ldw + (j - j0), m);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_maskz_loadu_ps(m, a + r * lda + j);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) c[r][t] = _mm512_fmadd_ps(av, wv[t], c[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(part + (r * T + t) * 16, c[r][t]);
}

__attribute__((target("avx512f"))) inline float reduce16(const float* v) {
  return _mm512_reduce_add_ps(_mm512_loadu_ps(v));
}

// acc (m x n, leading dimension ldc) for weight rows [n0, n1) against all m activation rows (fp32,
// leading dimension lda), over all of k: k in chunks of kChunk; per chunk, blocks of 4 weight
// rows (then single ones), each multiplied with every group of 4 activation rows while the
// chunk's weight values and activations (m x 2 KiB) sit in L1, so each weight row is read from
// memory once. 1-byte weight codes (fp8, int8: w their codes) are widened exactly to bf16 by
// `widen` per chunk into a 4 KiB stage first. The 16-lane partial sums (`part`, ceil(m / 4) x (n1 - n0)
// x 4 x 16 floats) are kept between chunks, so every lane sums its k values in order as one pass
// would, and reduced at the end.
constexpr int64_t kChunk = 512;
template <int S, int T>
void weight_block(const float* a, int64_t m, int64_t lda, const Elem<S>* w, int64_t ldw, int64_t j0, int64_t j1,
                  float* part, int64_t stride) {
  for (int64_t g = 0; g * 4 < m; ++g) {
    const float* ar = a + g * 4 * lda;
    float* pg = part + g * stride;
    switch (std::min<int64_t>(4, m - g * 4)) {
      case 4: block<S, 4, T>(ar, lda, w, ldw, j0, j1, pg, j0 == 0); break;
      case 3: block<S, 3, T>(ar, lda, w, ldw, j0, j1, pg, j0 == 0); break;
      case 2: block<S, 2, T>(ar, lda, w, ldw, j0, j1, pg, j0 == 0); break;
      default: block<S, 1, T>(ar, lda, w, ldw, j0, j1, pg, j0 == 0); break;
    }
  }
}

template <int S>
void weight_rows(const float* a, int64_t m, int64_t lda, const void* w, bf16_gemm::Widen widen, int64_t ldw, int64_t k,
                 float* acc, int64_t ldc, int64_t n0, int64_t n1, float* part) {
  const int64_t stride = (n1 - n0) * 64;  // a group's partials
  alignas(64) uint16_t stage[4 * kChunk];
  const bool staged = widen != nullptr;  // (S == kBF16)
  for (int64_t j0 = 0; j0 < k; j0 += kChunk) {
    const int64_t j1 = std::min(k, j0 + kChunk);
    for (int64_t t = n0; t < n1;) {
      const int64_t rows = t + 4 <= n1 ? 4 : 1;
      const Elem<S>* wt = static_cast<const Elem<S>*>(w) + t * ldw + j0;
      int64_t ld = ldw;
      if constexpr (S == kBF16) {
        if (staged) {
          widen(static_cast<const uint8_t*>(w) + t * ldw + j0, ldw, rows, j1 - j0, stage, kChunk);
          wt = stage;
          ld = kChunk;
        }
      }
      float* pt = part + (t - n0) * 64;
      if (rows == 4) weight_block<S, 4>(a, m, lda, wt, ld, j0, j1, pt, stride);
      else weight_block<S, 1>(a, m, lda, wt, ld, j0, j1, pt, stride);
      t += rows;
    }
  }
  for (int64_t g = 0; g * 4 < m; ++g) {
    const int64_t rows = std::min<int64_t>(4, m - g * 4);
    const float* pg = part + g * stride;
    int64_t t = n0;
    for (; t + 4 <= n1; t += 4)
      for (int64_t r = 0; r < rows; ++r)
        for (int u = 0; u < 4; ++u) acc[(g * 4 + r) * ldc + t + u] = reduce16(pg + (t - n0) * 64 + (r * 4 + u) * 16);
    for (; t < n1; ++t)
      for (int64_t r = 0; r < rows; ++r) acc[(g * 4 + r) * ldc + t] = reduce16(pg + (t - n0) * 64 + r * 16);
  }
}

// fp8 codes widened as fp8::convert widens them (bf16_gemm::Widen's form, one per format)
void widen_e4m3(const uint8_t* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst, int64_t ldd) {
  fp8::widen_rows_bf16(src, ld, at::kFloat8_e4m3fn, rows, n, dst, ldd);
}
void widen_e5m2(const uint8_t* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst, int64_t ldd) {
  fp8::widen_rows_bf16(src, ld, at::kFloat8_e5m2, rows, n, dst, ldd);
}

// acc (m x n fp32, contiguous) = the sums of a @ w.t(): a (m x k) bf16, fp16 or fp8, w (n x k, unit
// column stride) of a's 16-bit dtype, int8, or fp8 codes that `widen` maps to bf16.
void accumulate(const at::Tensor& a, const at::Tensor& w, float* acc, bf16_gemm::Widen widen) {
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  const auto wt = w.scalar_type();
  TORCH_INTERNAL_ASSERT((widen != nullptr) == fp8::is_fp8(wt));
  const auto rows = widen != nullptr || wt == at::kBFloat16 ? weight_rows<kBF16>
                    : wt == at::kChar                      ? weight_rows<kI8>
                                                           : weight_rows<kF16>;
  // the activations widened once (m x k fp32, contiguous)
  const at::Tensor ac = a.contiguous();
  const bool fp8_a = fp8::is_fp8(a.scalar_type());
  Floats af = fp8_a ? Floats(m * k) : widened(static_cast<const uint16_t*>(ac.const_data_ptr()), m * k, a.scalar_type());
  if (fp8_a) fp8::convert(ac.const_data_ptr(), a.scalar_type(), af.data(), at::kFloat, m * k);
  const int64_t ldw = w.stride(0);
  // weight rows shared by the threads, 64 at a time (the sums do not depend on the split)
  at::parallel_for(0, (n + 63) / 64, 1, [&](int64_t b0, int64_t b1) {
    const Floats part((m + 3) / 4 * 64 * 64);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 64, n1 = std::min(n, n0 + 64);
      rows(af.data(), m, k, w.const_data_ptr(), widen, ldw, k, acc, n, n0, n1, part.data());
    }
  });
}

// c10's round to nearest even of 16 fp32 values to bf16 bits (subnormals kept; NaN lanes, which
// c10 writes as 0x7FC0, set in *nan instead of being rounded).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m256i round16(__m512 v, __mmask16* nan) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  *nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_cvtepi32_epi16(_mm512_cvtepi32_epi16(r), *nan, _mm512_set1_epi32(0x7FC0));
}

// round_scale_bf16 over one row's first multiple of 16 values; returns how many it wrote.
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t round_scale_row(const float* src, int64_t n,
                                                                              const float* post, uint16_t* dst,
                                                                              bool* ok) {
  int64_t j = 0;
  __mmask16 any = 0;
  for (; j + 16 <= n; j += 16) {
    __mmask16 nan;
    __m256i r = round16(_mm512_loadu_ps(src + j), &nan);
    if (post != nullptr) {
      const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
      r = round16(_mm512_mul_ps(wide, _mm512_loadu_ps(post + j)), &nan);
      any |= nan;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), r);
  }
  if (any != 0) *ok = false;
  return j;
}
#endif

}  // namespace

bool available() {
#if defined(__x86_64__)
  return cpu_features::avx512bw();
#else
  return false;
#endif
}

bool gemv(const at::Tensor& o, const at::Tensor& s, const at::Tensor& m, const at::Tensor& v, float beta,
          float alpha) {
#if defined(__x86_64__)
  const int64_t rows = m.size(0), k = m.size(1);
  const bool row_major = m.stride(1) == 1 || k <= 1, col_major = m.stride(0) == 1 || rows <= 1;
  if (!available() || !o.is_contiguous() || (!row_major && !col_major)) return false;
  const bool bf16 = m.scalar_type() == at::kBFloat16;
  const auto wide = bf16 ? widen1<true> : widen1<false>;
  const at::Tensor vc = v.contiguous();
  const Floats x = widened(static_cast<const uint16_t*>(vc.const_data_ptr()), k, v.scalar_type());
  std::vector<float> acc(static_cast<size_t>(rows));
  const auto* mp = static_cast<const uint16_t*>(m.const_data_ptr());
  // (a matrix with one row or column is both: read it along its unit stride)
  const bool by_rows = row_major && (m.stride(1) == 1 || !col_major);
  const int64_t ld = by_rows ? m.stride(0) : m.stride(1);
  // about 64 KiB of the matrix per task
  const int64_t grain = std::max<int64_t>(by_rows ? 1 : 128, (int64_t{32} << 10) / std::max<int64_t>(1, k));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    if (by_rows) (bf16 ? rows_dot<kBF16> : rows_dot<kF16>)(mp, ld, x.data(), k, acc.data(), r0, r1);
    else (bf16 ? cols_axpy<true> : cols_axpy<false>)(mp, ld, x.data(), k, acc.data(), r0, r1);
  });
  auto* op = static_cast<uint16_t*>(o.data_ptr());
  const at::Tensor se = beta != 0.0f ? s.expand({rows}) : at::Tensor();
  const auto* sp = beta != 0.0f ? static_cast<const uint16_t*>(se.const_data_ptr()) : nullptr;
  const int64_t ss = beta != 0.0f ? se.stride(0) : 0;
  for (int64_t i = 0; i < rows; ++i) {
    float r = alpha == 0.0f ? 0.0f : alpha * acc[i];  // (BLAS: alpha = 0 reads no product, NaN or not)
    if (sp) r += beta * wide(sp[i * ss]);
    op[i] = bf16 ? c10::BFloat16(r).x : c10::Half(r).x;  // round to nearest even, as CPU's casts
  }
  return true;
#else
  (void)o, (void)s, (void)m, (void)v, (void)beta, (void)alpha;
  return false;
#endif
}

bool few_rows(const at::Tensor& o, const at::Tensor* s, const at::Tensor& a, const at::Tensor& w, float beta,
              float alpha) {
#if defined(__x86_64__)
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  if (!available() || !o.is_contiguous() || w.stride(1) != 1 || m < 1 || k < 1) return false;
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  const auto wide = bf16 ? widen1<true> : widen1<false>;
  std::vector<float> acc(static_cast<size_t>(m * n));
  accumulate(a, w, acc.data(), nullptr);
  auto* op = static_cast<uint16_t*>(o.data_ptr());
  if (bf16 && alpha == 1.0f && (s == nullptr || beta == 0.0f)) return round_scale_bf16(acc.data(), m, n, nullptr, op);
  const at::Tensor se = s != nullptr && beta != 0.0f ? s->expand({m, n}) : at::Tensor();
  const auto* sp = se.defined() ? static_cast<const uint16_t*>(se.const_data_ptr()) : nullptr;
  const int64_t s0 = se.defined() ? se.stride(0) : 0, s1 = se.defined() ? se.stride(1) : 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float r = alpha * acc[i * n + j];
      if (sp) r += beta * wide(sp[i * s0 + j * s1]);
      op[i * n + j] = bf16 ? c10::BFloat16(r).x : c10::Half(r).x;
    }
  }
  return true;
#else
  (void)o, (void)s, (void)a, (void)w, (void)beta, (void)alpha;
  return false;
#endif
}

bool few_rows_f32(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& w, float alpha) {
#if defined(__x86_64__)
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  if (!available() || !acc.is_contiguous() || acc.scalar_type() != at::kFloat || w.stride(1) != 1 || m < 1 ||
      k < 1 || n < 1) {
    return false;
  }
  auto* p = acc.data_ptr<float>();
  const auto wt = w.scalar_type();
  accumulate(a, w, p, wt == at::kFloat8_e4m3fn ? widen_e4m3 : wt == at::kFloat8_e5m2 ? widen_e5m2 : nullptr);
  if (alpha != 1.0f) at::Tensor(acc).mul_(alpha);
  return true;
#else
  (void)acc, (void)a, (void)w, (void)alpha;
  return false;
#endif
}

bool round_scale_bf16(const float* acc, int64_t m, int64_t n, const float* post_scale, uint16_t* out) {
  bool finite = true;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, n));  // ~32 K values
  at::parallel_for(0, m, grain, [&](int64_t i0, int64_t i1) {
    bool ok = true;
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = acc + i * n;
      uint16_t* dst = out + i * n;
      int64_t j = 0;
#if defined(__x86_64__)
      if (available()) j = round_scale_row(src, n, post_scale, dst, &ok);
#endif
      for (; j < n; ++j) {
        const c10::BFloat16 r(src[j]);  // the product's one rounding
        if (post_scale == nullptr) {
          dst[j] = r.x;
          continue;
        }
        const float v = static_cast<float>(r) * post_scale[j];
        ok = ok && !std::isnan(v);
        dst[j] = c10::BFloat16(v).x;
      }
    }
    if (!ok) finite = false;  // (a benign race: every writer stores false)
  });
  return finite;
}

bool few_rows_bf16(const at::Tensor& o, const at::Tensor& a, const at::Tensor& w, const float* post_scale) {
#if defined(__x86_64__)
  const int64_t m = a.size(0), n = w.size(0);
  TORCH_INTERNAL_ASSERT(available() && o.is_contiguous() && w.stride(1) == 1 && m >= 1 && a.size(1) >= 1 &&
                        a.scalar_type() == at::kBFloat16 && o.scalar_type() == at::kBFloat16 &&
                        (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kChar));
  std::vector<float> acc(static_cast<size_t>(m * n));
  if (m == 1) {  // the matrix-vector kernel's sums (gemv's by rows: gemm.cpp's one-row products)
    const int64_t k = a.size(1);
    const at::Tensor ac = a.contiguous();
    const Floats x = widened(static_cast<const uint16_t*>(ac.const_data_ptr()), k, at::kBFloat16);
    const bool i8 = w.scalar_type() == at::kChar;
    at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{32} << 10) / k), [&](int64_t r0, int64_t r1) {
      if (i8) rows_dot<kI8>(w.const_data_ptr<int8_t>(), w.stride(0), x.data(), k, acc.data(), r0, r1);
      else rows_dot<kBF16>(static_cast<const uint16_t*>(w.const_data_ptr()), w.stride(0), x.data(), k, acc.data(), r0,
                           r1);
    });
  } else {
    accumulate(a, w, acc.data(), nullptr);
  }
  return round_scale_bf16(acc.data(), m, n, post_scale, static_cast<uint16_t*>(o.data_ptr()));
#else
  (void)o, (void)a, (void)w, (void)post_scale;
  TORCH_INTERNAL_ASSERT(false, "few_rows_bf16 needs x86-64");
#endif
}

}  // namespace torchneuron::gemv
