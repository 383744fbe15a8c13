// Attention of short sequences in fp32 (small_attention.h). Per head, the scores of a tile of up
// to 64 queries against all (at most 512) keys stay in a per-thread buffer, so softmax and the
// products around it need no online rescaling, and one register-blocked product kernel (4 rows
// x up to 64 columns, AVX-512) computes all five GEMMs of forward and backward. Each query row
// computes keys up to a limit: causal attention's own, or an additive mask's last value above
// -inf (a causal or padding mask's tail costs nothing); a 4-row block computes up to its rows'
// largest limit, and the key-side products (dK, dV) start at the first query that sees a key.
// Tasks (a head's query tile forward, a key/value head's group backward) are independent, so the
// results do not depend on the thread count. CPU's flash kernel computes the same sums in another
// order: results differ from it by fp32 rounding (docs/architecture.md, *Precision*).
#include "small_attention.h"

#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <utility>

#include "cpu_features.h"
#include "half_vec.h"

// Exported by libtorch_cpu (ATen's vectorized log calls it); declared here because sleef.h
// declares it only when the whole file is compiled for AVX-512.
extern "C" __m512 Sleef_logf16_u10(__m512);

namespace torchneuron::small_attention {
namespace {

using half_vec::lanes;

constexpr int64_t kMaxKeys = 512;
constexpr int64_t kMaxDim = 128;
constexpr int64_t kTile = 64;  // queries per score tile

int64_t pad16(int64_t n) { return (n + 15) & ~int64_t{15}; }

// Per-thread scratch, 64-byte aligned, kept and grown (a training step calls this per layer).
float* scratch(size_t floats) {
  struct Buffer {
    float* p = nullptr;
    size_t n = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer b;
  if (b.n < floats) {
    std::free(b.p);
    b.n = 0;
    b.p = static_cast<float*>(std::aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64));
    if (b.p == nullptr) throw std::bad_alloc();
    b.n = floats;
  }
  return b.p;
}

// c[r][0, 16V) (+)= sum_{k < K} a[r * sar + k * sak] * b[k * sbk + (0, 16V)] for R rows; the last
// vector's lanes are `tail` (loads and stores masked, so rows may end anywhere).
template <int R, int V>
__attribute__((target("avx512f"))) void block(const float* a, int64_t sar, int64_t sak, const float* b, int64_t sbk,
                                              float* c, int64_t scr, int64_t K, __mmask16 tail, bool acc) {
  // The loops over R and V are unrolled so that the R x V sums stay in registers.
  __m512 s[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) s[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * sbk;
    __m512 bv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V - 1; ++v) bv[v] = _mm512_loadu_ps(bk + 16 * v);
    bv[V - 1] = _mm512_maskz_loadu_ps(tail, bk + 16 * (V - 1));
    const float* ak = a + k * sak;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(ak[r * sar]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) s[r][v] = _mm512_fmadd_ps(ar, bv[v], s[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      float* p = c + r * scr + 16 * v;
      const __mmask16 m = v == V - 1 ? tail : __mmask16(0xFFFF);
      const __m512 x = acc ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, p), s[r][v]) : s[r][v];
      _mm512_mask_storeu_ps(p, m, x);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t, __mmask16,
                         bool);

template <int R>
BlockFn pick_v(int64_t v) {
  switch (v) {
    case 1: return &block<R, 1>;
    case 2: return &block<R, 2>;
    case 3: return &block<R, 3>;
    default: return &block<R, 4>;
  }
}

BlockFn pick(int64_t r, int64_t v) {
  switch (r) {
    case 1: return pick_v<1>(v);
    case 2: return pick_v<2>(v);
    case 3: return pick_v<3>(v);
    default: return pick_v<4>(v);
  }
}

// C (M x .) (+)= A B in blocks of 4 rows: the block at row i0 with R rows computes columns
// [0, cols(i0, R)) and sums over k in [lo, hi) = krange(i0, R). A(i, k) = a[i * sai + k * sak]
// (any strides: its elements are broadcast), B's rows (stride sbk) and C's (stride sci) are
// contiguous. An empty sum writes zeros (or adds nothing).
template <class Cols, class KRange>
void product(int64_t M, const float* a, int64_t sai, int64_t sak, const float* b, int64_t sbk, float* c, int64_t sci,
             bool acc, Cols cols, KRange krange) {
  for (int64_t i0 = 0; i0 < M; i0 += 4) {
    const int64_t R = std::min<int64_t>(4, M - i0);
    const int64_t N = cols(i0, R);
    const auto [lo, hi] = krange(i0, R);
    const int64_t K = std::max<int64_t>(hi - lo, 0);
    if (K == 0 && acc) continue;
    for (int64_t n0 = 0; n0 < N; n0 += 64) {
      const int64_t w = std::min<int64_t>(64, N - n0), V = (w + 15) / 16;
      pick(R, V)(a + i0 * sai + lo * sak, sai, sak, b + lo * sbk + n0, sbk, c + i0 * sci + n0, sci, K,
                 lanes(16 * (V - 1), w), acc);
    }
  }
}


// r[i] = column i of the 16 x 16 block whose rows were r[0..15].
__attribute__((target("avx512f"))) void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]),
                  c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // r[4i + j]'s 128-bit lane L now holds column 4L + j of rows 4i..4i+3.
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
  }
}

// dst[e * ld + j] = src[j * stride + e]: a head's keys or values as E rows of S, in 16 x 16
// blocks transposed in registers (a scalar transpose took as long as the score product).
__attribute__((target("avx512f"))) void pack_transposed(float* dst, int64_t ld, const float* src, int64_t stride,
                                                        int64_t S, int64_t E) {
  __m512 r[16];
  for (int64_t j = 0; j < S; j += 16) {
    const __mmask16 keys = lanes(j, S);
    for (int64_t e = 0; e < E; e += 16) {
      const __mmask16 dims = lanes(e, E);
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = j + i < S ? _mm512_maskz_loadu_ps(dims, src + (j + i) * stride + e) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t i = 0; i < 16 && e + i < E; ++i) _mm512_mask_storeu_ps(dst + (e + i) * ld + j, keys, r[i]);
    }
  }
}

__attribute__((target("avx512f"))) void zero_rows(float* base, int64_t row, int64_t n, int64_t E) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t e = 0; e < E; e += 16) _mm512_mask_storeu_ps(base + i * row + e, lanes(e, E), _mm512_setzero_ps());
}

// x[n, width) = 0 (a row's keys its query does not see, up to the tile's widest row).
__attribute__((target("avx512f"))) inline void zero_tail(float* x, int64_t n, int64_t width) {
  for (int64_t j = n; j < width; j += 16) _mm512_mask_storeu_ps(x + j, lanes(j, width), _mm512_setzero_ps());
}

// exp of 16 values, inline (SLEEF's call was a quarter of the forward): x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial, scaled by 2^n. Within 0.94 ULP of
// the exact value over [-87.33, 1] (every float of [-104, 1] checked against double exp; 99.7 %
// correctly rounded), 0 below (no subnormal results), NaN for NaN. The softmax's arguments
// are <= 0, the backward's exceed 0 only by rounding.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.7f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));  // NaN stays
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts (0.693359375 has 10 significant bits, so n * it is exact).
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  // Results below FLT_MIN (x < -87.33) are 0: a subnormal result costs a microcode assist per
  // lane, and masked scores (-inf) all land there (a random mask made the kernel 2-3x slower).
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33f), _CMP_NLT_UQ), p, n);
}

// Lane i of the result: the sum (or max) of r[i]'s 16 lanes, for 16 rows at once (one
// transpose instead of 16 horizontal reductions, whose latency chains bounded the softmax).
__attribute__((target("avx512f"))) __m512 row_sums(__m512* r) {
  transpose16(r);
  __m512 s = r[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, r[i]);
  return s;
}
__attribute__((target("avx512f"))) __m512 row_maxes(__m512* r) {
  transpose16(r);
  __m512 s = r[0];
  for (int i = 1; i < 16; ++i) s = _mm512_max_ps(s, r[i]);
  return s;
}

// Query rows [0, m) (m <= 16) of a score tile, row r at s + r * ld seeing keys [0, lim[r]), with
// the additive mask rows mask[r] (or none): in place, t = s * scale + mask and p = exp(t - max)
// over those, zeros over the rest up to `width`; each row's max and sum of p to maxes[r] and
// sums[r]. A row whose keys are all masked has lim[r] = 0: max -inf, no p, sum 0.
__attribute__((target("avx512f"))) void softmax_rows(float* s, int64_t ld, int64_t m, const int64_t* lim,
                                                     const float* const* mask, int64_t width, float scale,
                                                     float* maxes, float* sums) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 acc[16];
  for (int64_t r = 0; r < 16; ++r) {
    acc[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    if (r >= m) continue;
    float* row = s + r * ld;
    const float* mr = mask[r];
    const int64_t n = lim[r];
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = lanes(j, n);
      const __m512 x = _mm512_maskz_loadu_ps(k, row + j);
      const __m512 t = mr == nullptr ? _mm512_mul_ps(x, sc) : _mm512_fmadd_ps(x, sc, _mm512_maskz_loadu_ps(k, mr + j));
      _mm512_mask_storeu_ps(row + j, k, t);
      acc[r] = _mm512_mask_max_ps(acc[r], k, acc[r], t);
    }
  }
  _mm512_mask_storeu_ps(maxes, lanes(0, m), row_maxes(acc));
  for (int64_t r = 0; r < 16; ++r) {
    acc[r] = _mm512_setzero_ps();
    if (r >= m) continue;
    float* row = s + r * ld;
    const int64_t n = lim[r];
    const __m512 mv = _mm512_set1_ps(maxes[r]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = lanes(j, n);
      const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), mv));
      _mm512_mask_storeu_ps(row + j, k, p);
      acc[r] = _mm512_mask_add_ps(acc[r], k, acc[r], p);
    }
    zero_tail(row, n, width);
  }
  _mm512_mask_storeu_ps(sums, lanes(0, m), row_sums(acc));
}

// The backward's probabilities from the forward's log-sum-exp: p = exp(s * scale + mask - lse)
// over [0, n), zeros over [n, width).
__attribute__((target("avx512f"))) void probabilities_row(float* s, int64_t n, int64_t width, float scale, float lse,
                                                          const float* mask) {
  const __m512 sc = _mm512_set1_ps(scale), l = _mm512_set1_ps(lse);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(j, n);
    const __m512 x = _mm512_maskz_loadu_ps(m, s + j);
    const __m512 t = mask == nullptr ? _mm512_fmsub_ps(x, sc, l)
                                     : _mm512_sub_ps(_mm512_fmadd_ps(x, sc, _mm512_maskz_loadu_ps(m, mask + j)), l);
    _mm512_mask_storeu_ps(s + j, m, exp16(t));
  }
  zero_tail(s, n, width);
}

// ds = p * (dp - d) * scale over [0, n) (ds holds dp on entry), zeros over [n, width).
__attribute__((target("avx512f"))) void score_grad_row(float* ds, const float* p, int64_t n, int64_t width, float d,
                                                        float scale) {
  const __m512 dv = _mm512_set1_ps(d), sc = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(j, n);
    const __m512 g = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j),
                                                 _mm512_sub_ps(_mm512_maskz_loadu_ps(m, ds + j), dv)),
                                   sc);
    _mm512_mask_storeu_ps(ds + j, m, g);
  }
  zero_tail(ds, n, width);
}

// The tile's log-sum-exp (max + log(sum), stored with stride `ls`) and, in place of each sum,
// its reciprocal (the output rows' factor), 16 rows at a time. A row whose keys are all masked
// (max -inf, sum 0) gets CPU's log-sum-exp, 0, and factor 1 (its output row is already 0).
__attribute__((target("avx512f"))) void finish_rows(float* lse, int64_t ls, float* sums, const float* maxes,
                                                    int64_t M) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < M; r += 16) {
    const __mmask16 m = lanes(r, M);
    const __m512 mx = _mm512_maskz_loadu_ps(m, maxes + r);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(m, mx, ninf, _CMP_NEQ_UQ);
    const __m512 sum = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), live, sums + r);
    const __m512 l = _mm512_maskz_add_ps(live, mx, Sleef_logf16_u10(sum));
    alignas(64) float out[16];
    _mm512_store_ps(out, l);
    for (int64_t i = 0; i < 16 && r + i < M; ++i) lse[(r + i) * ls] = out[i];
    _mm512_mask_storeu_ps(sums + r, m, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
  }
}

// d[r] = x_r . y_r for rows r < m (m <= 16) of E values, reduced 16 rows at once.
__attribute__((target("avx512f"))) void row_dots(float* d, const float* x, int64_t xs, const float* y, int64_t ys,
                                                 int64_t m, int64_t E) {
  __m512 acc[16];
  for (int64_t r = 0; r < 16; ++r) {
    acc[r] = _mm512_setzero_ps();
    for (int64_t e = 0; r < m && e < E; e += 16) {
      const __mmask16 k = lanes(e, E);
      acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, x + r * xs + e), _mm512_maskz_loadu_ps(k, y + r * ys + e), acc[r]);
    }
  }
  _mm512_mask_storeu_ps(d, lanes(0, m), row_sums(acc));
}

__attribute__((target("avx512f"))) void scale_row(float* x, int64_t n, float f) {
  const __m512 fv = _mm512_set1_ps(f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = lanes(j, n);
    _mm512_mask_storeu_ps(x + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), fv));
  }
}

// One head's rows: element (i, e) at base + i * row (unit stride along e).
struct Rows {
  float* base;
  int64_t row;
  float* at(int64_t i) const { return base + i * row; }
};

Rows head_rows(const at::Tensor& t, int64_t b, int64_t h) {
  return {t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1), t.stride(2)};
}

// An additive mask's rows for one (batch, head): row i's values at base + i * row, unit stride
// along the keys (an SDPA mask broadcasts: its expanded view gives size-1 dims stride 0).
struct MaskRows {
  const float* base = nullptr;  // none: no mask
  int64_t row = 0;
  const float* at(int64_t i) const { return base == nullptr ? nullptr : base + i * row; }
};

// mask (any of SDPA's broadcastable shapes) viewed (B, H, L, S), or undefined.
at::Tensor mask_view(const std::optional<at::Tensor>& mask, const at::Tensor& q, int64_t S) {
  if (!mask.has_value() || !mask->defined()) return {};
  return mask->expand({q.size(0), q.size(1), q.size(2), S});
}

MaskRows mask_rows(const at::Tensor& m, int64_t b, int64_t h) {
  if (!m.defined()) return {};
  return {m.data_ptr<float>() + b * m.stride(0) + h * m.stride(1), m.stride(2)};
}

// 1 + the index of the last of m[0, n) above -inf (NaN counts: it must reach the output), else 0.
__attribute__((target("avx512f"))) int64_t last_seen(const float* m, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = ((n - 1) / 16) * 16; n > 0 && j >= 0; j -= 16) {
    const __mmask16 k = lanes(j, n);
    const unsigned f = _mm512_mask_cmp_ps_mask(k, _mm512_maskz_loadu_ps(k, m + j), ninf, _CMP_NEQ_UQ);
    if (f != 0) return j + 32 - __builtin_clz(f);
  }
  return 0;
}

// lim[r] for the rows of the query tile [first, first + M): every key row first + r attends to
// is below it (causal: keys up to the query; a mask: up to its last value above -inf). Returns
// the largest.
int64_t tile_limits(int64_t* lim, bool causal, const MaskRows& mask, int64_t first, int64_t M, int64_t S) {
  int64_t widest = 0;
  for (int64_t r = 0; r < M; ++r) {
    int64_t n = causal ? std::min(first + r + 1, S) : S;
    if (mask.base != nullptr) n = last_seen(mask.at(first + r), n);
    lim[r] = n;
    widest = std::max(widest, n);
  }
  return widest;
}

// The keys a row block [i0, i0 + R) computes: its rows' largest limit.
int64_t block_limit(const int64_t* lim, int64_t i0, int64_t R) {
  int64_t n = 0;
  for (int64_t r = i0; r < i0 + R; ++r) n = std::max(n, lim[r]);
  return n;
}

// The first of the tile's M rows that sees key j (M if none): where the key-side products of
// key rows from j start (rows that see none of a key block's keys hold zeros there).
int64_t first_seeing(const int64_t* lim, int64_t j, int64_t M) {
  int64_t r = 0;
  while (r < M && lim[r] <= j) ++r;
  return r;
}

// The share of the scores a mask (viewed (B, H, L, S)) leaves to compute without is_causal: the
// rows' key limits summed over its distinct rows (a broadcast dim, stride 0, repeats its rows),
// over S each. A causal mask with padding leaves about half, a random one all of it.
double masked_share(const at::Tensor& m, int64_t S) {
  const auto distinct = [&m](int d) { return m.stride(d) == 0 ? int64_t{1} : m.size(d); };
  const int64_t B = distinct(0), H = distinct(1), L = distinct(2);
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const MaskRows rows = mask_rows(m, b, h);
      for (int64_t i = 0; i < L; ++i) work += last_seen(rows.at(i), S);
    }
  }
  return static_cast<double>(work) / static_cast<double>(B * H * L * S);
}

std::atomic<bool> g_enabled{true};

}  // namespace

bool available() { return cpu_features::avx512bw() && g_enabled.load(std::memory_order_relaxed); }

void set_enabled(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

bool applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
             bool is_causal) {
  if (!available()) return false;
  if (q.scalar_type() != at::kFloat || k.scalar_type() != at::kFloat || v.scalar_type() != at::kFloat) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4 || q.device() != k.device() || q.device() != v.device()) {
    return false;
  }
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), S = k.size(2);
  const int64_t Hk = k.size(1);  // grouped-query attention: H a multiple of the key/value heads
  if (!(k.size(0) == B && v.size(0) == B && Hk > 0 && H % Hk == 0 && v.size(1) == Hk && v.size(2) == S &&
        k.size(3) == E &&
        v.size(3) == E && B > 0 && H > 0 && E >= 1 && E <= kMaxDim && q.stride(3) == 1 && k.stride(3) == 1 &&
        v.stride(3) == 1)) {
    return false;
  }
  const bool masked = mask.has_value() && mask->defined();
  if (masked) {
    // An additive fp32 mask of the shapes CPU's flash kernel takes ((L, S) or 4-d, each dim
    // broadcast or full), its keys unit-strided (the rows are read as vectors).
    const at::Tensor& m = *mask;
    if (m.scalar_type() != at::kFloat || m.device() != q.device() || !(m.dim() == 2 || m.dim() == 4) ||
        m.size(-1) != S || (S > 1 && m.stride(-1) != 1) || !at::is_expandable_to(m.sizes(), {B, H, L, S})) {
      return false;
    }
  }
  // Where it was measured faster than CPU's flash kernel (docs/benchmarks.md): at least 16
  // queries (below, a row's packed keys cost more than its products), up to 512 keys causal or
  // 256 otherwise, masked or not (beyond, CPU's kernel is as fast). The backward's only
  // parallelism is over heads, as CPU's; the choice never depends on the thread count (nor do
  // the results).
  if (L < 16 || S < 1 || S > kMaxKeys) return false;
  if (is_causal || S <= kMaxKeys / 2) return true;
  // From 257 to 512 keys a mask decides by its values (this runs where the kernel runs, once the
  // mask is computed): a mask that leaves at most 60 % of the scores (a causal mask with
  // padding, about half: 0.58x CPU's time) takes the kernel, a fuller one (a random mask:
  // 1.0-1.07x) CPU's kernel. Forward and backward decide alike.
  return masked && masked_share(mask_view(mask, q, S), S) <= 0.6;
}

void forward(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const std::optional<at::Tensor>& mask, bool is_causal, double scale) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), S = k.size(2), Sp = pad16(S);
  const int64_t group = H / k.size(1);  // query heads per key/value head
  const float sc = static_cast<float>(scale);
  float* lse_base = lse.data_ptr<float>();
  const at::Tensor m = mask_view(mask, q, S);
  // Tasks are (head, query tile): a single head of a long sequence still uses every thread. A
  // thread's tasks are consecutive, so it packs a key head once for all its tiles (and for the
  // query heads of its group).
  const int64_t tiles = (L + kTile - 1) / kTile;
  at::parallel_for(0, B * H * tiles, 1, [&](int64_t begin, int64_t end) {
    float* kt = scratch(static_cast<size_t>(E * Sp + kTile * Sp + 2 * kTile));
    float* p = kt + E * Sp;
    float* sums = p + kTile * Sp;
    float* maxes = sums + kTile;
    int64_t lim[kTile];
    const float* mrows[kTile];
    int64_t packed = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / tiles, first = (task % tiles) * kTile, b = bh / H, h = bh % H, hk = h / group;
      const Rows Q = head_rows(q, b, h), K = head_rows(k, b, hk), V = head_rows(v, b, hk), O = head_rows(out, b, h);
      const MaskRows mk = mask_rows(m, b, h);
      float* lse_h = lse_base + b * lse.stride(0) + h * lse.stride(1);
      const int64_t M = std::min(kTile, L - first);
      const int64_t kmax = tile_limits(lim, is_causal, mk, first, M, S);
      for (int64_t r = 0; r < M; ++r) mrows[r] = mk.at(first + r);
      if (packed != bh / group) {
        pack_transposed(kt, Sp, K.base, K.row, S, E);
        packed = bh / group;
      }
      const auto seen = [&](int64_t i0, int64_t R) { return block_limit(lim, i0, R); };
      product(M, Q.at(first), Q.row, 1, kt, Sp, p, Sp, false, seen,
              [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, E); });
      for (int64_t r0 = 0; r0 < M; r0 += 16) {
        softmax_rows(p + r0 * Sp, Sp, std::min<int64_t>(16, M - r0), lim + r0, mrows + r0, kmax, sc, maxes + r0,
                     sums + r0);
      }
      finish_rows(lse_h + first * lse.stride(2), lse.stride(2), sums, maxes, M);
      product(M, p, Sp, 1, V.base, V.row, O.at(first), O.row, false, [&](int64_t, int64_t) { return E; },
              [&](int64_t i0, int64_t R) { return std::pair<int64_t, int64_t>(0, seen(i0, R)); });
      for (int64_t r = 0; r < M; ++r) scale_row(O.at(first + r), E, sums[r]);
    }
  });
}

void backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& go_in,
              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out_in,
              const at::Tensor& lse_in, const std::optional<at::Tensor>& mask, bool is_causal, double scale) {
  // grad_out may come expanded (a sum's backward) and out in any layout: rows must be contiguous.
  const at::Tensor go = go_in.stride(3) == 1 ? go_in : go_in.contiguous();
  const at::Tensor out = out_in.stride(3) == 1 ? out_in : out_in.contiguous();
  const at::Tensor lse = lse_in.scalar_type() == at::kFloat ? lse_in : lse_in.to(at::kFloat);
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), S = k.size(2), Sp = pad16(S);
  const float sc = static_cast<float>(scale);
  const float* lse_base = lse.data_ptr<float>();
  const at::Tensor m = mask_view(mask, q, S);
  // Tasks are key/value heads (their gradients sum over the tiles of every query head of the
  // group), as CPU's backward parallelizes over heads.
  const int64_t Hk = k.size(1), group = H / Hk;
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
    float* kt = scratch(static_cast<size_t>(2 * E * Sp + 2 * kTile * Sp + kTile));
    float* vt = kt + E * Sp;
    float* p = vt + E * Sp;
    float* ds = p + kTile * Sp;
    float* d = ds + kTile * Sp;
    int64_t lim[kTile];
    for (int64_t bhk = begin; bhk < end; ++bhk) {
      const int64_t b = bhk / Hk, hk = bhk % Hk;
      const Rows K = head_rows(k, b, hk), V = head_rows(v, b, hk), dK = head_rows(gk, b, hk), dV = head_rows(gv, b, hk);
      pack_transposed(kt, Sp, K.base, K.row, S, E);
      pack_transposed(vt, Sp, V.base, V.row, S, E);
      // The group's first tile (its first head's) writes the key gradients below its widest
      // row's limit (each such key row gets a product, zeros where no query sees it); the rest
      // add theirs.
      const int64_t written =
          tile_limits(lim, is_causal, mask_rows(m, b, hk * group), 0, std::min(kTile, L), S);
      zero_rows(dK.at(written), dK.row, S - written, E);
      zero_rows(dV.at(written), dV.row, S - written, E);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const Rows Q = head_rows(q, b, h), O = head_rows(out, b, h), dO = head_rows(go, b, h), dQ = head_rows(gq, b, h);
        const MaskRows mk = mask_rows(m, b, h);
        const float* lse_h = lse_base + b * lse.stride(0) + h * lse.stride(1);
        for (int64_t first = 0; first < L; first += kTile) {
          const int64_t M = std::min(kTile, L - first);
          const int64_t kmax = tile_limits(lim, is_causal, mk, first, M, S);
          const bool add = first > 0 || h > hk * group;
          const auto seen = [&](int64_t i0, int64_t R) { return block_limit(lim, i0, R); };
          const auto all_e = [&](int64_t, int64_t) { return std::pair<int64_t, int64_t>(0, E); };
          // Key rows [j0, j0 + R) are seen by the tile's queries from the first that sees j0 on.
          const auto seeing = [&](int64_t j0, int64_t) {
            return std::pair<int64_t, int64_t>(first_seeing(lim, j0, M), M);
          };
          product(M, Q.at(first), Q.row, 1, kt, Sp, p, Sp, false, seen, all_e);
          product(M, dO.at(first), dO.row, 1, vt, Sp, ds, Sp, false, seen, all_e);
          for (int64_t r0 = 0; r0 < M; r0 += 16) {
            row_dots(d + r0, dO.at(first + r0), dO.row, O.at(first + r0), O.row, std::min<int64_t>(16, M - r0), E);
          }
          for (int64_t r = 0; r < M; ++r) {
            const int64_t i = first + r;
            probabilities_row(p + r * Sp, lim[r], kmax, sc, lse_h[i * lse.stride(2)], mk.at(i));
            score_grad_row(ds + r * Sp, p + r * Sp, lim[r], kmax, d[r], sc);
          }
          const auto cols_e = [&](int64_t, int64_t) { return E; };
          // dV += P^T dO and dK += dS^T Q over the keys this tile sees.
          product(kmax, p, 1, Sp, dO.at(first), dO.row, dV.base, dV.row, add, cols_e, seeing);
          product(kmax, ds, 1, Sp, Q.at(first), Q.row, dK.base, dK.row, add, cols_e, seeing);
          // dQ = dS K.
          product(M, ds, Sp, 1, K.base, K.row, dQ.at(first), dQ.row, false, cols_e,
                  [&](int64_t i0, int64_t R) { return std::pair<int64_t, int64_t>(0, seen(i0, R)); });
        }
      }
    }
  });
}

}  // namespace torchneuron::small_attention
