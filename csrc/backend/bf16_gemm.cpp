// bf16 x bf16 -> fp32 GEMM (see bf16_gemm.h). The classic blocked structure: B is packed by
// panels of kNR columns and A by panels of kMR rows, both in pairs of k (the operand layout of
// vdpbf16ps, which multiplies bf16 pairs and adds both products to an fp32 lane); an 8 x 32
// micro-kernel keeps its 16 accumulators in registers over a kKC-deep slice of k. Packing pads
// with zeros (odd k, partial panels), so the micro-kernel always runs whole; edge tiles are
// stored with masks. The k slices accumulate in fp32 (in c itself when beta is 0), then alpha
// and beta are applied in one pass.
#include "bf16_gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torchneuron::bf16_gemm {

#if defined(__x86_64__)
namespace {

constexpr int64_t kMR = 8, kNR = 32;  // micro-tile: 8 rows x 2 zmm of 16 fp32
constexpr int64_t kKC = 512;          // k slice (even): a packed A panel is 8 KiB, B panel 32 KiB
constexpr int64_t kMC = 64;           // rows a task packs and runs at a time
constexpr int64_t kNC = 1024;         // columns of B packed at a time (kKC x kNC bf16: 1 MiB)

struct View {
  const uint16_t* p;
  int64_t ld;
  bool trans;
  uint16_t at(int64_t r, int64_t c) const { return trans ? p[c * ld + r] : p[r * ld + c]; }
};

// One panel of W lines (rows of A, columns of B) over k [k0, k0 + kc), as [k / 2][W][2]: line
// l's values at k and k + 1 side by side, the pair vdpbf16ps multiplies. `lines` reads element
// (line, k); lines from `end` on and k from k0 + kc on are zeros.
template <int64_t W>
void pack_panel(const View& lines, int64_t l0, int64_t end, int64_t k0, int64_t kc, uint16_t* out) {
  const int64_t kp = (kc + 1) / 2, kend = k0 + kc;
  const bool full = l0 + W <= end;
  for (int64_t kk = 0; kk < kp; ++kk) {
    const int64_t c = k0 + 2 * kk;
    if (full && !lines.trans && c + 1 < kend) {  // each line's k pair is one 32-bit word
      auto* o32 = reinterpret_cast<uint32_t*>(out);
      for (int64_t l = 0; l < W; ++l) std::memcpy(o32 + l, lines.p + (l0 + l) * lines.ld + c, 4);
      out += W * 2;
      continue;
    }
    for (int64_t l = l0; l < l0 + W; ++l) {
      *out++ = l < end && c < kend ? lines.at(l, c) : 0;
      *out++ = l < end && c + 1 < kend ? lines.at(l, c + 1) : 0;
    }
  }
}

// B rows [k0, k0 + kc) x columns [j0, j0 + nc) as panels of kNR columns, packed in parallel.
// B's columns are the lines: B read transposed (a column-major B is row-major lines).
void pack_b(const View& B, int64_t k0, int64_t kc, int64_t j0, int64_t nc, uint16_t* out) {
  const View lines{B.p, B.ld, !B.trans};
  const int64_t panels = (nc + kNR - 1) / kNR, kp = (kc + 1) / 2;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pack_panel<kNR>(lines, j0 + p * kNR, j0 + nc, k0, kc, out + p * kp * kNR * 2);
  });
}

// A rows [i0, i0 + mc) x k [k0, k0 + kc) as panels of kMR rows.
void pack_a(const View& A, int64_t i0, int64_t mc, int64_t k0, int64_t kc, uint16_t* out) {
  const int64_t panels = (mc + kMR - 1) / kMR, kp = (kc + 1) / 2;
  for (int64_t p = 0; p < panels; ++p) pack_panel<kMR>(A, i0 + p * kMR, i0 + mc, k0, kc, out + p * kp * kMR * 2);
}

// work[r][0:cols] += (packed A panel) x (packed B panel) over kp pairs, for r < rows.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void micro(int64_t kp, const uint16_t* pa,
                                                                  const uint16_t* pb, float* work,
                                                                  int64_t ldw, int64_t rows, int64_t cols) {
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
    _mm512_mask_storeu_ps(w, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, w), c[i][0]));
    _mm512_mask_storeu_ps(w + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, w + 16), c[i][1]));
  }
}

}  // namespace

bool available() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
          int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  const View A{a, lda, trans_a}, B{b, ldb, trans_b};
  // The fp32 sums accumulate in c itself when its old contents do not matter (no page faults for
  // a fresh buffer), else in a separate buffer that beta * c is added to at the end.
  std::vector<float> own(beta == 0.0f ? 0 : static_cast<size_t>(m * n));
  float* work = beta == 0.0f ? c : own.data();
  const int64_t ldw = beta == 0.0f ? ldc : n;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) std::fill(work + i * ldw, work + i * ldw + n, 0.0f);
  });
  std::vector<uint16_t> pb(static_cast<size_t>(kKC * (kNC + kNR)));
  for (int64_t j0 = 0; j0 < n; j0 += kNC) {
    const int64_t nc = std::min(kNC, n - j0);
    for (int64_t k0 = 0; k0 < k; k0 += kKC) {
      const int64_t kc = std::min(kKC, k - k0), kp = (kc + 1) / 2;
      pack_b(B, k0, kc, j0, nc, pb.data());
      const int64_t blocks = (m + kMC - 1) / kMC;
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        std::vector<uint16_t> pa(static_cast<size_t>(kMC * (kKC + 1)));
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t i0 = blk * kMC, mc = std::min(kMC, m - i0);
          pack_a(A, i0, mc, k0, kc, pa.data());
          for (int64_t jr = 0; jr < nc; jr += kNR) {
            for (int64_t ir = 0; ir < mc; ir += kMR) {
              micro(kp, pa.data() + (ir / kMR) * kp * kMR * 2, pb.data() + (jr / kNR) * kp * kNR * 2,
                    work + (i0 + ir) * ldw + j0 + jr, ldw, std::min(kMR, mc - ir), std::min(kNR, nc - jr));
            }
          }
        }
      });
    }
  }
  if (beta == 0.0f && alpha == 1.0f) return;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const float* w = work + i * ldw;
      float* o = c + i * ldc;
      if (beta == 0.0f) {
        for (int64_t j = 0; j < n; ++j) o[j] = alpha * w[j];
      } else {
        for (int64_t j = 0; j < n; ++j) o[j] = alpha * w[j] + beta * o[j];
      }
    }
  });
}
#else
bool available() { return false; }
void gemm(bool, bool, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*, int64_t, float,
          float*, int64_t) {}
#endif

}  // namespace torchneuron::bf16_gemm
