// bf16 x bf16 -> fp32 GEMM (see bf16_gemm.h). The classic blocked structure: B is packed by
// panels of kNR columns and A by panels of kMR rows, both in pairs of k (the operand layout of
// vdpbf16ps, which multiplies bf16 pairs and adds both products to an fp32 lane); an 8 x 32
// micro-kernel keeps its 16 accumulators in registers over a kKC-deep slice of k. Packing pads
// with zeros (odd k, partial panels), so the micro-kernel always runs whole; edge tiles are
// stored with masks. 1-byte codes are widened into a small staging block first, then packed
// like bf16.
//
// A task owns a block of rows (and, when rows alone cannot keep the threads busy, a range of
// columns) over all of k: its fp32 sums stay in a task-local buffer in cache across the k
// slices, and the epilogue turns them into the result the moment they are final, so no m x n
// fp32 accumulator goes through memory. B is packed once per column block over all of k.
#include "bf16_gemm.h"
#include "cpu_features.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torchneuron::bf16_gemm {

#if defined(__x86_64__)
namespace {

constexpr int64_t kMR = 8, kNR = 32;         // micro-tile: 8 rows x 2 zmm of 16 fp32
constexpr int64_t kKC = 512;                 // k slice (even): a packed A panel is 8 KiB, B panel 32 KiB
constexpr int64_t kMC = 64;                  // rows of a task
constexpr int64_t kNC = 1024;                // most columns of B packed at a time
constexpr int64_t kPackedB = int64_t{8} << 20;  // bytes of packed B at a time (fewer columns for a deep k)

// A bf16 matrix: element (r, c) at p[r * ld + c], or p[c * ld + r] if trans.
struct View {
  const uint16_t* p;
  int64_t ld;
  bool trans;
  uint16_t at(int64_t r, int64_t c) const { return trans ? p[c * ld + r] : p[r * ld + c]; }
};

// out[q * ldo + 0:8] = column q of the 8 x 8 matrix of 32-bit words whose row r starts at
// in + r * ld (16-bit units): the AVX2 unpack network of an 8 x 8 transpose, fully unrolled so
// the 24 vectors live in registers.
__attribute__((target("avx2"), always_inline)) inline void transpose8x8(const uint16_t* in, int64_t ld, uint32_t* out,
                                                                         int64_t ldo) {
  __m256i r[8], t[8], u[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i * ld));
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 8; h += 4) {  // rows 0-3 and 4-7: u[h + q] holds columns q and q + 4
    u[h + 0] = _mm256_unpacklo_epi64(t[h + 0], t[h + 2]);
    u[h + 1] = _mm256_unpackhi_epi64(t[h + 0], t[h + 2]);
    u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
    u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + q * ldo), _mm256_permute2x128_si256(u[q], u[q + 4], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q + 4) * ldo),
                        _mm256_permute2x128_si256(u[q], u[q + 4], 0x31));
  }
}

// The whole pairs of a full panel, vectorized; returns how many pairs it packed (the rest, at
// most 7 pairs and an odd tail, go through pack_panel's element loop).
//  - lines stored along k (rows of a row-major A, columns of a column-major B): each line's
//    pair is a 32-bit word, and 8 lines x 8 pairs are an 8 x 8 word transpose;
//  - lines stored across k (a row-major B, a column-major A): rows c and c + 1 are interleaved.
template <int64_t W>
__attribute__((target("avx512f,avx512bw,avx2"))) int64_t pack_full_pairs(const View& lines, int64_t l0, int64_t k0,
                                                                         int64_t pairs, uint16_t* out) {
  if (!lines.trans) {
    const int64_t blocks = pairs / 8;
    const uint16_t* base = lines.p + l0 * lines.ld + k0;
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t g = 0; g < W; g += 8) {
        transpose8x8(base + g * lines.ld + 16 * b, lines.ld, reinterpret_cast<uint32_t*>(out) + b * 8 * W + g, W);
      }
    }
    return blocks * 8;
  }
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* r0 = lines.p + (k0 + 2 * kk) * lines.ld + l0;
    const uint16_t* r1 = r0 + lines.ld;
    uint16_t* o = out + kk * W * 2;
    if constexpr (W == 32) {
      // Word i of the result: r0[i / 2] for even i, r1[i / 2] for odd (index bit 5 picks r1).
      const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
      const __m512i a = _mm512_loadu_si512(r0), b = _mm512_loadu_si512(r1);
      _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(a, hi, b));
    } else {
      static_assert(W == 8, "panels are 8 or 32 lines wide");
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm_unpacklo_epi16(a, b));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8), _mm_unpackhi_epi16(a, b));
    }
  }
  return pairs;
}

// One panel of W lines (rows of A, columns of B) over k [k0, k0 + kc), as [k / 2][W][2]: line
// l's values at k and k + 1 side by side, the pair vdpbf16ps multiplies. `lines` reads element
// (line, k); lines from `end` on and k from k0 + kc on are zeros.
template <int64_t W>
void pack_panel(const View& lines, int64_t l0, int64_t end, int64_t k0, int64_t kc, uint16_t* out) {
  const int64_t kp = (kc + 1) / 2, kend = k0 + kc;
  const int64_t done = l0 + W <= end ? pack_full_pairs<W>(lines, l0, k0, kc / 2, out) : 0;
  out += done * W * 2;
  for (int64_t kk = done; kk < kp; ++kk) {
    const int64_t c = k0 + 2 * kk;
    for (int64_t l = l0; l < l0 + W; ++l) {
      *out++ = l < end && c < kend ? lines.at(l, c) : 0;
      *out++ = l < end && c + 1 < kend ? lines.at(l, c + 1) : 0;
    }
  }
}

// pack_panel over a Matrix of lines: codes are first widened into `stage` (the panel's lines
// over the slice, in the source's orientation so each widen call reads contiguous bytes).
template <int64_t W>
void pack_lines(const Matrix& lines, int64_t l0, int64_t end, int64_t k0, int64_t kc, uint16_t* out,
                std::vector<uint16_t>& stage) {
  if (lines.widen == nullptr) {
    pack_panel<W>(View{static_cast<const uint16_t*>(lines.p), lines.ld, lines.trans}, l0, end, k0, kc, out);
    return;
  }
  const auto* p = static_cast<const uint8_t*>(lines.p);
  const int64_t n = std::min(W, end - l0);
  stage.resize(static_cast<size_t>(W * kc));
  if (!lines.trans) {  // line l's k values are contiguous
    lines.widen(p + l0 * lines.ld + k0, lines.ld, n, kc, stage.data(), kc);
    pack_panel<W>(View{stage.data(), kc, false}, 0, n, 0, kc, out);
  } else {  // each k holds the lines contiguously
    lines.widen(p + k0 * lines.ld + l0, lines.ld, kc, n, stage.data(), n);
    pack_panel<W>(View{stage.data(), n, true}, 0, n, 0, kc, out);
  }
}

// work[r][0:cols] += (packed A panel) x (packed B panel) over kp pairs, for r < rows; `first`
// stores the sums instead (work's old contents are not read: no zeroing pass).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void micro(int64_t kp, const uint16_t* pa,
                                                                  const uint16_t* pb, float* work,
                                                                  int64_t ldw, int64_t rows, int64_t cols,
                                                                  bool first) {
  __m512 c[kMR][2];
  for (int64_t i = 0; i < kMR; ++i) c[i][0] = c[i][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp; ++kk) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + kk * kNR * 2);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + kk * kNR * 2 + 32);
    const auto* a = reinterpret_cast<const int32_t*>(pa + kk * kMR * 2);
#pragma GCC unroll 8
    for (int64_t i = 0; i < kMR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(a[i]);
      c[i][0] = _mm512_dpbf16_ps(c[i][0], ai, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], ai, b1);
    }
  }
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int64_t i = 0; i < rows; ++i) {
    float* w = work + i * ldw;
    if (first) {
      _mm512_mask_storeu_ps(w, m0, c[i][0]);
      _mm512_mask_storeu_ps(w + 16, m1, c[i][1]);
    } else {
      _mm512_mask_storeu_ps(w, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, w), c[i][0]));
      _mm512_mask_storeu_ps(w + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, w + 16), c[i][1]));
    }
  }
}

// v rounded to bf16 (in the low half of each lane) as CPU's Tensor.to(bfloat16) rounds.
__attribute__((target("avx512f"))) inline __m512i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
}

// The epilogue of bf16_gemm.h's Output for the final sums of rows [i0, i0 + rows) x columns
// [j0, j0 + cols), held in work (leading dimension ldw). Products in the documented order; the
// bf16 rounding is CPU's Tensor.to(bfloat16) (round to nearest even on the bits, subnormals
// kept, every NaN -> 0xFFFF), not vcvtneps2bf16, which flushes fp32 subnormals.
__attribute__((target("avx512f,avx512bw"))) void store(const float* work, int64_t ldw, int64_t i0,
                                                       int64_t rows, int64_t j0, int64_t cols, const Output& o) {
  const __m512 alpha = _mm512_set1_ps(o.alpha);
  for (int64_t i = 0; i < rows; ++i) {
    const float* w = work + i * ldw;
    const __m512 r = _mm512_set1_ps(o.row_scale != nullptr ? o.row_scale[i0 + i] : 1.0f);
    for (int64_t j = 0; j < cols; j += 16) {
      const __mmask16 m = cols - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (cols - j)) - 1);
      __m512 v = _mm512_maskz_loadu_ps(m, w + j);
      if (o.alpha != 1.0f) v = _mm512_mul_ps(alpha, v);
      if (o.row_scale != nullptr) v = _mm512_mul_ps(v, r);
      if (o.col_scale != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, o.col_scale + j0 + j));
      if (o.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, o.bias + j0 + j));
      const int64_t at = (i0 + i) * o.ld + j0 + j;
      if (o.f32 != nullptr) {
        _mm512_mask_storeu_ps(o.f32 + at, m, v);
        continue;
      }
      __m512i h = round_bf16(v);
      if (o.post_scale != nullptr) {  // the rounded value (its bf16 bits in the high half) times the column's
        v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)), _mm512_maskz_loadu_ps(m, o.post_scale + j0 + j));
        h = round_bf16(v);
        if (_mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) != 0 && o.nan != nullptr) {
          o.nan->store(true, std::memory_order_relaxed);
        }
      }
      _mm512_mask_cvtepi32_storeu_epi16(o.bf16 + at, m, h);
    }
  }
}

template <class T>
T* grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace

namespace {
std::atomic<bool> enabled{true};
}

bool available() {
  return cpu_features::avx512bf16() && enabled.load(std::memory_order_relaxed);
}

void set_enabled(bool on) { enabled.store(on); }

void pack_pairs32(const Matrix& lines, int64_t l0, int64_t end, int64_t k0, int64_t kc, uint16_t* out) {
  thread_local std::vector<uint16_t> stage;
  pack_lines<kNR>(lines, l0, end, k0, kc, out, stage);
}

void epilogue(const float* work, int64_t ldw, int64_t i0, int64_t rows, int64_t j0, int64_t cols, const Output& o) {
  store(work, ldw, i0, rows, j0, cols, o);
}

void gemm(int64_t m, int64_t n, int64_t k, const Matrix& a, const Matrix& b, const Output& out) {
  if (m <= 0 || n <= 0) return;
  const int64_t kp_all = (std::max<int64_t>(k, 0) + 1) / 2;  // k pairs of a packed panel
  const int64_t panel = kp_all * kNR * 2;                      // uint16 per packed B panel
  // B's columns are the lines it is packed by: B read transposed.
  const Matrix b_lines{b.p, b.ld, !b.trans, b.widen};
  const int64_t nc_max = kp_all == 0 ? kNC : std::clamp<int64_t>(kPackedB / (kp_all * 4) / kNR * kNR, kNR, kNC);
  const int64_t mblocks = (m + kMC - 1) / kMC;
  // With one block of rows each B panel is used once: its task packs it into cache right before
  // using it, instead of a shared packed B that goes through memory (16 x 1024 x 1024: packing
  // dominated the product). Otherwise B is packed once for all the blocks of rows, into a buffer
  // kept per calling thread: a fresh one would be zero-filled and page-faulted on every call.
  const bool local_b = mblocks == 1;
  thread_local std::vector<uint16_t> packed_b;
  uint16_t* pb = local_b ? nullptr : grow(packed_b, std::max<int64_t>(1, (nc_max / kNR) * panel));
  const int64_t want_tasks = 2 * static_cast<int64_t>(at::get_num_threads());
  for (int64_t j0 = 0; j0 < n; j0 += nc_max) {
    const int64_t nc = std::min(nc_max, n - j0), panels = (nc + kNR - 1) / kNR;
    at::parallel_for(0, local_b ? 0 : panels, 1, [&](int64_t p0, int64_t p1) {
      thread_local std::vector<uint16_t> stage;
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t k0 = 0; k0 < k; k0 += kKC) {  // slices start at even k: they concatenate
          pack_lines<kNR>(b_lines, j0 + p * kNR, j0 + nc, k0, std::min(kKC, k - k0),
                          pb + p * panel + k0 * kNR, stage);
        }
      }
    });
    // Columns are split among tasks only when blocks of rows are too few for the threads.
    const int64_t chunks = mblocks >= want_tasks ? 1 : std::min(panels, (want_tasks + mblocks - 1) / mblocks);
    const int64_t chunk_panels = (panels + chunks - 1) / chunks;
    const int64_t ntasks = mblocks * ((panels + chunk_panels - 1) / chunk_panels);
    const int64_t ldw = chunk_panels * kNR;
    at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
      thread_local std::vector<uint16_t> pa, stage, own_b;
      thread_local std::vector<float> work;
      uint16_t* pap = grow(pa, kMC * (kKC + 1));
      uint16_t* ob = local_b ? grow(own_b, kKC * kNR) : nullptr;
      float* w = grow(work, kMC * ldw);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t mb = t / (ntasks / mblocks), cb = t % (ntasks / mblocks);
        const int64_t i0 = mb * kMC, mc = std::min(kMC, m - i0);
        const int64_t c0 = cb * ldw, cw = std::min(ldw, nc - c0);
        if (k <= 0) {  // an empty sum
          for (int64_t i = 0; i < mc; ++i) std::fill(w + i * ldw, w + i * ldw + cw, 0.0f);
        }
        for (int64_t k0 = 0; k0 < k; k0 += kKC) {
          const int64_t kc = std::min(kKC, k - k0), kp = (kc + 1) / 2;
          for (int64_t ir = 0; ir < mc; ir += kMR) {
            pack_lines<kMR>(a, i0 + ir, i0 + mc, k0, kc, pap + (ir / kMR) * kp * kMR * 2, stage);
          }
          for (int64_t jr = 0; jr < cw; jr += kNR) {
            const uint16_t* bp = ob;
            if (local_b) pack_lines<kNR>(b_lines, j0 + c0 + jr, j0 + nc, k0, kc, ob, stage);
            else bp = pb + ((c0 + jr) / kNR) * panel + k0 * kNR;
            for (int64_t ir = 0; ir < mc; ir += kMR) {
              micro(kp, pap + (ir / kMR) * kp * kMR * 2, bp, w + ir * ldw + jr, ldw, std::min(kMR, mc - ir),
                    std::min(kNR, cw - jr), k0 == 0);
            }
          }
        }
        store(w, ldw, i0, mc, j0 + c0, cw, out);
      }
    });
  }
}
#else
bool available() { return false; }
void set_enabled(bool) {}
void gemm(int64_t, int64_t, int64_t, const Matrix&, const Matrix&, const Output&) {}
void pack_pairs32(const Matrix&, int64_t, int64_t, int64_t, int64_t, uint16_t*) {}
void epilogue(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const Output&) {}
#endif

}  // namespace torchneuron::bf16_gemm
