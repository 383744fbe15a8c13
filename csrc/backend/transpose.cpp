#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Transposing copies (see transpose.h).
#include "transpose.h"

#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace torchneuron::transpose {
namespace {

// t's dims of size > 1 in memory order, outermost first. False unless t is dense and
// non-overlapping (then each dim's stride is the product of the sizes inside it, and every
// element lies in the numel slots from data_ptr up).
bool memory_order(const at::Tensor& t, c10::SmallVector<int64_t, 6>* order) {
  if (!t.is_non_overlapping_and_dense()) return false;
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (t.size(i) != 1) order->push_back(i);
  }
  std::sort(order->begin(), order->end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  return true;
}

// The copy as a stack of matrix transposes: src's memory order is batch dims, then P, then Q;
// dst's is the same batch dims, then Q, then P. In memory, src is batch x (P x Q) row-major and
// dst batch x (Q x P): 2-d transposes (P, Q one dim each), stacked ones, NCHW <-> NHWC (P = C,
// Q = H, W). Sets *batch, *p and *q to the sizes; false for any other pair of layouts.
bool as_transposes(const at::Tensor& dst, const at::Tensor& src, int64_t* batch, int64_t* p, int64_t* q) {
  c10::SmallVector<int64_t, 6> os, od;
  if (!memory_order(src, &os) || !memory_order(dst, &od) || os.size() != od.size()) return false;
  size_t b = 0;
  while (b < os.size() && os[b] == od[b]) ++b;
  const size_t rest = os.size() - b;
  for (size_t k = 1; k < rest; ++k) {  // P = os[b, b + k), Q = os[b + k, end)
    if (!std::equal(os.begin() + b + k, os.end(), od.begin() + b) ||
        !std::equal(os.begin() + b, os.begin() + b + k, od.begin() + b + (rest - k))) {
      continue;
    }
    *batch = *p = *q = 1;
    for (size_t i = 0; i < b; ++i) *batch *= src.size(os[i]);
    for (size_t i = b; i < b + k; ++i) *p *= src.size(os[i]);
    for (size_t i = b + k; i < os.size(); ++i) *q *= src.size(os[i]);
    return true;
  }
  return false;
}

// A B x B block: d[r * ld_d + c] = s[c * ld_s + r]. SSE2 unpack networks (every x86-64 CPU
// has SSE2): bytes 8 x 8, 16-bit 8 x 8, 32-bit 4 x 4; plain loops elsewhere.
template <class E> struct Block;
#if defined(__SSE2__)
template <> struct Block<uint8_t> {
  static constexpr int64_t B = 8;
  static void run(const uint8_t* s, int64_t ld_s, uint8_t* d, int64_t ld_d) {
    auto row = [&](int k) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + k * ld_s)); };
    const __m128i t0 = _mm_unpacklo_epi8(row(0), row(1)), t1 = _mm_unpacklo_epi8(row(2), row(3));
    const __m128i t2 = _mm_unpacklo_epi8(row(4), row(5)), t3 = _mm_unpacklo_epi8(row(6), row(7));
    const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);
    const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
    const __m128i v[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2), _mm_unpacklo_epi32(u1, u3),
                          _mm_unpackhi_epi32(u1, u3)};  // v[k] = columns 2k and 2k + 1
    for (int k = 0; k < 4; ++k) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d + 2 * k * ld_d), v[k]);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(d + (2 * k + 1) * ld_d), _mm_srli_si128(v[k], 8));
    }
  }
};
template <> struct Block<uint16_t> {
  static constexpr int64_t B = 8;
  static void run(const uint16_t* s, int64_t ld_s, uint16_t* d, int64_t ld_d) {
    auto row = [&](int k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k * ld_s)); };
    const __m128i t0 = _mm_unpacklo_epi16(row(0), row(1)), t1 = _mm_unpackhi_epi16(row(0), row(1));
    const __m128i t2 = _mm_unpacklo_epi16(row(2), row(3)), t3 = _mm_unpackhi_epi16(row(2), row(3));
    const __m128i t4 = _mm_unpacklo_epi16(row(4), row(5)), t5 = _mm_unpackhi_epi16(row(4), row(5));
    const __m128i t6 = _mm_unpacklo_epi16(row(6), row(7)), t7 = _mm_unpackhi_epi16(row(6), row(7));
    const __m128i u0 = _mm_unpacklo_epi32(t0, t2), u1 = _mm_unpackhi_epi32(t0, t2);
    const __m128i u2 = _mm_unpacklo_epi32(t1, t3), u3 = _mm_unpackhi_epi32(t1, t3);
    const __m128i u4 = _mm_unpacklo_epi32(t4, t6), u5 = _mm_unpackhi_epi32(t4, t6);
    const __m128i u6 = _mm_unpacklo_epi32(t5, t7), u7 = _mm_unpackhi_epi32(t5, t7);
    const __m128i lo[4] = {u0, u1, u2, u3}, hi[4] = {u4, u5, u6, u7};
    for (int k = 0; k < 4; ++k) {  // columns 2k and 2k + 1: rows 0-3 from lo, 4-7 from hi
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * k * ld_d), _mm_unpacklo_epi64(lo[k], hi[k]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + (2 * k + 1) * ld_d), _mm_unpackhi_epi64(lo[k], hi[k]));
    }
  }
};
template <> struct Block<uint32_t> {
  static constexpr int64_t B = 4;
  static void run(const uint32_t* s, int64_t ld_s, uint32_t* d, int64_t ld_d) {
    auto row = [&](int k) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k * ld_s)); };
    const __m128i t0 = _mm_unpacklo_epi32(row(0), row(1)), t1 = _mm_unpackhi_epi32(row(0), row(1));
    const __m128i t2 = _mm_unpacklo_epi32(row(2), row(3)), t3 = _mm_unpackhi_epi32(row(2), row(3));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + ld_d), _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * ld_d), _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 3 * ld_d), _mm_unpackhi_epi64(t1, t3));
  }
};
#else
template <class E> struct Block {
  static constexpr int64_t B = 8;
  static void run(const E* s, int64_t ld_s, E* d, int64_t ld_d) {
    for (int64_t r = 0; r < B; ++r) {
      for (int64_t c = 0; c < B; ++c) d[r * ld_d + c] = s[c * ld_s + r];
    }
  }
};
#endif

// prefetcht0 of the line at p, in an asm statement: GCC 12 may delete a loop whose only
// statements are __builtin_prefetch calls once inlined (C++ lets it drop a loop without side
// effects, and it counts a prefetch as none): prefetch_tile's loops vanished so.
inline void prefetch(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Tile t of a stack of rows x cols destinations cut into kTile-square tiles, tiles a matrix and
// col_tiles a row of them: matrix b, destination rows [i0, i0 + ni), columns [j0, j0 + nj).
struct Tile {
  int64_t b, i0, j0, ni, nj;
};
inline Tile tile_at(int64_t t, int64_t kTile, int64_t rows, int64_t cols, int64_t tiles, int64_t col_tiles) {
  const int64_t b = t / tiles, i0 = (t % tiles) / col_tiles * kTile, j0 = (t % col_tiles) * kTile;
  return {b, i0, j0, std::min(kTile, rows - i0), std::min(kTile, cols - j0)};
}

// Asks for every cache line of tile t's source and destination rows while the tile before it
// is transposed. Each row piece is one to four lines a page or more from the next, too short
// a run for the hardware prefetchers to follow, so without this every line is a demand miss.
// 1024 x 2048 and 2048 x 1024, 2 threads, results kept (their memory not in cache, as in a
// training step), us: fp8 420-560 -> 320-390, bf16 850-990 -> 560-620, fp32 1340-1410 ->
// 860-970; results freed at once (bench/layout.py, destination in cache): fp8 same, bf16 3-6 %
// and fp32 8-11 % faster. prefetchw for the destination measured slower (bf16 720-760), and
// prefetcht1 (second-level cache only) gains less (bf16 640-700).
template <class E>
void prefetch_tile(const E* src, E* dst, int64_t rows, int64_t cols, const Tile& tl) {
  const auto* s = reinterpret_cast<const char*>(src + tl.b * rows * cols);
  const auto* d = reinterpret_cast<const char*>(dst + tl.b * rows * cols);
  constexpr int64_t esize = sizeof(E);
  for (int64_t j = 0; j < tl.nj; ++j) {
    for (int64_t o = 0; o < tl.ni * esize; o += 64) prefetch(s + ((tl.j0 + j) * rows + tl.i0) * esize + o);
  }
  for (int64_t i = 0; i < tl.ni; ++i) {
    for (int64_t o = 0; o < tl.nj * esize; o += 64) prefetch(d + ((tl.i0 + i) * cols + tl.j0) * esize + o);
  }
}

// dst[b][i][j] = src[b][j][i] for b < batch, i < rows, j < cols: dst row-major rows x cols,
// src row-major cols x rows. Tile by tile (64 x 64): the tile's source rows are copied into `in`
// (contiguous reads), transposed block by block into `out` in registers, and `out`'s rows copied
// to dst (contiguous writes). Staging keeps the strided accesses in L1: straight from memory, the
// rows of a power-of-two leading dimension fall into one cache set and evict each other.
template <class E>
void transpose_stack(const E* src, E* dst, int64_t batch, int64_t rows, int64_t cols) {
  // 64 elements a side: shorter row pieces (32 floats, 128 bytes) measured ~1.5x slower, the
  // strided side's rows then costing a cache miss every two lines.
  constexpr int64_t kTile = 64;
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tiles = row_tiles * col_tiles;
  // Prefetch for matrices of 1 MiB or more: their row pieces lie a page or more apart. A batch of
  // small ones (attention heads, 256 x 64) is walked fast enough by the hardware prefetchers,
  // and the extra requests cost there (4 x 8 x 256 x 64 fp32: 110 -> 130-145 us when prefetched).
  const bool far = rows * cols * static_cast<int64_t>(sizeof(E)) >= (int64_t{1} << 20);
  // Tasks of 8 tiles (32 K elements) or more; a task's tiles run along a row of tiles.
  at::parallel_for(0, batch * tiles, 8, [&](int64_t t0, int64_t t1) {
    // Zeroed once: a partial tile's last blocks read zeros past its edge, not garbage.
    // `out` starts 320 bytes past a 4 KiB multiple from `in`: loads from one buffer right after
    // stores to the other at the same address modulo 4 KiB stall on a false dependency.
    constexpr int64_t kPad = 320 / sizeof(E);
    alignas(64) E bufs[2 * kTile * kTile + kPad] = {};
    E* in = bufs;
    E* out = bufs + kTile * kTile + kPad;
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, i0, j0, ni, nj] = tile_at(t, kTile, rows, cols, tiles, col_tiles);
      const E* s = src + b * rows * cols;
      E* d = dst + b * rows * cols;
      if (far && t + 1 < t1) prefetch_tile(src, dst, rows, cols, tile_at(t + 1, kTile, rows, cols, tiles, col_tiles));
      if (ni == kTile) {  // a constant size: the copies compile to a few vector moves
        for (int64_t j = 0; j < nj; ++j) std::memcpy(in + j * kTile, s + (j0 + j) * rows + i0, kTile * sizeof(E));
      } else {
        for (int64_t j = 0; j < nj; ++j) std::memcpy(in + j * kTile, s + (j0 + j) * rows + i0, ni * sizeof(E));
      }
      // Only the blocks the tile's ni x nj corner needs (a partial tile's rest is never copied out).
      for (int64_t jb = 0; jb < nj; jb += Block<E>::B) {
        for (int64_t ib = 0; ib < ni; ib += Block<E>::B) {
          Block<E>::run(in + jb * kTile + ib, kTile, out + ib * kTile + jb, kTile);
        }
      }
      if (nj == kTile) {
        for (int64_t i = 0; i < ni; ++i) std::memcpy(d + (i0 + i) * cols + j0, out + i * kTile, kTile * sizeof(E));
      } else {
        for (int64_t i = 0; i < ni; ++i) std::memcpy(d + (i0 + i) * cols + j0, out + i * kTile, nj * sizeof(E));
      }
    }
  });
}

}  // namespace

bool try_copy(const at::Tensor& dst, const at::Tensor& src) {
  if (src.scalar_type() != dst.scalar_type() || src.dim() < 2 || !src.sizes().equals(dst.sizes())) return false;
  if (src.is_conj() || dst.is_conj() || src.is_neg() || dst.is_neg() || src._is_zerotensor() ||
      dst._is_zerotensor() || src.layout() != at::kStrided || dst.layout() != at::kStrided) {
    return false;
  }
  int64_t batch, p, q;
  if (!as_transposes(dst, src, &batch, &p, &q)) return false;
  // Below 16 x 16 elements a side the tiles gain nothing over CPU's loop.
  if (p < 16 || q < 16) return false;
  const int64_t n = src.numel(), esize = static_cast<int64_t>(src.element_size());
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  auto* o = static_cast<char*>(dst.data_ptr());
  if (s < o + n * esize && o < s + n * esize) return false;  // shared bytes: CPU's overlap handling
  // dst (q x p) = src (p x q) transposed, matrix by matrix.
  const int64_t rows = q, cols = p;
  switch (esize) {
    case 1: transpose_stack(reinterpret_cast<const uint8_t*>(s), reinterpret_cast<uint8_t*>(o), batch, rows, cols); break;
    case 2: transpose_stack(reinterpret_cast<const uint16_t*>(s), reinterpret_cast<uint16_t*>(o), batch, rows, cols); break;
    case 4: transpose_stack(reinterpret_cast<const uint32_t*>(s), reinterpret_cast<uint32_t*>(o), batch, rows, cols); break;
    default: return false;
  }
  return true;
}

}  // namespace torchneuron::transpose
