// bf16 x bf16 -> fp32 GEMM on AMX tiles (see amx_gemm.h).
//
// Roles: AMX multiplies a row-major tile (16 rows x 32 bf16) by a tile in pair layout (16 k
// pairs x 16 columns x 2). B's columns (the weight's rows) are contiguous along k, so they are
// the row operand after a plain widening, and A (the activations, few at decode) is the one
// packed into pairs, once per call. The eight tile registers hold a 2 x 2 block of 16 x 16 fp32
// accumulators (32 weight rows x 32 activation rows), two weight tiles and two activation tiles.
//
// Work is split into tasks of (32 weight rows, a group of activation panels of 32 rows, the group
// sized so its packed rows stay in L2). A task walks k in chunks of 256: it widens its weight rows'
// chunk into `stage` (16 KiB, L1; one widening call for the block; bf16 weights are read in place
// instead, except a chunk past k's end or past the last weight row), then runs each panel of the
// group through the chunk, the accumulators parked in `sums` between chunks (kept in tiles when
// the group is one panel), and sends each finished 32 x 32 block through the epilogue, transposed
// back in registers. A panel's rows 0-15 and 16-31 are packed apart, so every activation tile is
// 1 KiB of consecutive bytes, and a panel of at most 16 rows (decode) runs half the products.
// Every tile is whole: k past its end is zeros in stage and in the packed panels, activation rows
// past m are zeros, weight rows past n are whatever stage held (their sums are not stored).
#include "amx_gemm.h"
#include "gemm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torchneuron::amx_gemm {

bool available() { return gemm::amx_tiles(); }

bool supports(const bf16_gemm::Matrix&, const bf16_gemm::Matrix& b) { return b.trans; }

#if defined(__x86_64__)
namespace {

// An int8 is exact in fp16, whose bits are the bf16 ones re-biased, 32 lanes at a time: for
// |v| >= 1 the fp16 exponent is 15-22 and the mantissa's low 3 bits are zero, so the bf16 bits
// are the fp16 ones without the sign, shifted right by 3, plus (127 - 15) << 7, with the sign put
// back; 0 stays 0. 25 % faster than widening through fp32 and vcvtne2ps2bf16 (16 M values from
// memory, one thread: 0.89 vs 1.19 ms), which at decode (one activation panel) is most of the
// kernel's time.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512fp16"))) inline __m512i bf16_of_int8(__m256i x) {
  const __m512i h = _mm512_castph_si512(_mm512_cvtepi16_ph(_mm512_cvtepi8_epi16(x)));
  const __m512i t = _mm512_srli_epi16(_mm512_slli_epi16(h, 1), 4);
  const __m512i e = _mm512_mask_add_epi16(t, _mm256_test_epi8_mask(x, x), t, _mm512_set1_epi16(0x3800));
  return _mm512_ternarylogic_epi32(e, h, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);  // e | (h & sign)
}

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl,avx512fp16"))) void widen_int8(const uint8_t* src, int64_t ld,
                                                                                int64_t rows, int64_t n,
                                                                                uint16_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* s = src + r * ld;
    uint16_t* d = dst + r * ldd;
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      _mm512_storeu_si512(d + j, bf16_of_int8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + j))));
    }
    if (j < n) {
      const __mmask32 m = static_cast<__mmask32>((1u << (n - j)) - 1);
      _mm512_mask_storeu_epi16(d + j, m, bf16_of_int8(_mm256_maskz_loadu_epi8(m, s + j)));
    }
  }
}

namespace {

constexpr int64_t kBlock = 32;  // weight rows of a task, activation rows of a panel
constexpr int64_t kStep = 32;   // k values of one tile row (64 bytes of bf16)
constexpr int64_t kChunk = 256;  // k values staged at a time: 32 rows x 256 bf16 = 16 KiB, in L1

// The LDTILECFG operand: palette 1, tiles 0-7 of 16 rows x 64 bytes. A constant in memory:
// GCC's _tile_loadconfig tells the compiler it reads 8 bytes of it, not 64.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
constexpr TileConfig kTiles{};

// The tile intrinsics are asm statements that declare no memory effects: a compiler barrier
// keeps the stores of stage before the tile loads and the tile stores before the reads of acc_t.
inline void barrier() { asm volatile("" ::: "memory"); }

// The first 64-byte boundary at or after p (buffers are allocated 64 bytes longer): a tile row
// that straddles two cache lines costs two loads.
template <class T>
T* aligned(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// out (rows of ldo floats) = the transpose of the 16 x 16 block at in (rows of ldi floats):
// unpacks pair rows within 128-bit lanes, then two rounds of lane shuffles gather each column.
__attribute__((target("avx512f"))) void transpose16(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m512 r[16], t[16], u[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ldi);
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // u[4g + q]: rows 4g..4g+3 of columns q, q + 4, q + 8, q + 12 (one per 128-bit lane)
#pragma GCC unroll 4
  for (int g = 0; g < 16; g += 4) {
    const __m512d t0 = _mm512_castps_pd(t[g]), t1 = _mm512_castps_pd(t[g + 1]);
    const __m512d t2 = _mm512_castps_pd(t[g + 2]), t3 = _mm512_castps_pd(t[g + 3]);
    u[g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0x88), v1 = _mm512_shuffle_f32x4(u[q], u[4 + q], 0xDD);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0x88);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], 0xDD);
    _mm512_storeu_ps(out + (q + 0) * ldo, _mm512_shuffle_f32x4(v0, w0, 0x88));
    _mm512_storeu_ps(out + (q + 4) * ldo, _mm512_shuffle_f32x4(v1, w1, 0x88));
    _mm512_storeu_ps(out + (q + 8) * ldo, _mm512_shuffle_f32x4(v0, w0, 0xDD));
    _mm512_storeu_ps(out + (q + 12) * ldo, _mm512_shuffle_f32x4(v1, w1, 0xDD));
  }
}

// stage[r][0:32 steps] = bf16 values k in [k0, k0 + 32 steps) of weight row n0 + r (B's
// column), r < min(32, n - n0): one widening call for the block (or bf16 copied), zeros past k.
void stage_rows(const bf16_gemm::Matrix& b, int64_t n0, int64_t n, int64_t k0, int64_t kc, int64_t steps,
                uint16_t* stage) {
  const int64_t rows = std::clamp<int64_t>(n - n0, 0, kBlock), width = steps * kStep;
  if (b.widen != nullptr) {
    b.widen(static_cast<const uint8_t*>(b.p) + n0 * b.ld + k0, b.ld, rows, kc, stage, kChunk);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(stage + r * kChunk, static_cast<const uint16_t*>(b.p) + (n0 + r) * b.ld + k0,
                  static_cast<size_t>(kc) * 2);
    }
  }
  // k padding must be zeros on both sides (0 x a stale Inf is NaN); rows past n may hold
  // anything: their sums are never stored.
  if (kc < width) {
    for (int64_t r = 0; r < rows; ++r) std::fill(stage + r * kChunk + kc, stage + r * kChunk + width, 0);
  }
}

// The packed activations: panel p (32 rows) at data + p * panel, its rows 0-15 then its rows
// 16-31, each as [k pair][16 rows][2] (the values at k and k + 1 side by side: AMX's pair layout).
struct Packed {
  uint16_t* data;
  int64_t panel;  // uint16 per panel
};

// One task: weight rows [n0, n0 + 32) against activation panels [p0, p1).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void task(int64_t n0, int64_t p0, int64_t p1,
                                                                        int64_t m, int64_t n, int64_t k,
                                                                        const Packed& pa, const bf16_gemm::Matrix& b,
                                                                        const bf16_gemm::Output& out) {
  const int64_t steps = std::max<int64_t>(1, (k + kStep - 1) / kStep);
  // One panel: its accumulators stay in tiles over all of k; more: each panel's are parked in
  // `sums` between chunks.
  const bool resident = p1 - p0 == 1;
  thread_local std::vector<uint16_t> stage_buf(kChunk * kBlock + 32);
  thread_local std::vector<float> sums_buf;
  if (!resident && static_cast<int64_t>(sums_buf.size()) < (p1 - p0) * kBlock * kBlock + 16) {
    sums_buf.resize(static_cast<size_t>((p1 - p0) * kBlock * kBlock + 16));
  }
  uint16_t* stage = aligned(stage_buf.data());
  float* sums = aligned(sums_buf.data());
  alignas(64) float acc_t[kBlock * kBlock];  // [weight row][activation row]
  alignas(64) float acc[kBlock * kBlock];    // [activation row][weight row]: the result's layout
  const uint16_t* w = stage;
  int64_t ldw = kChunk;  // uint16 between w's rows
  const int64_t half = steps * kStep * 16;  // uint16 from a panel's rows 0-15 to its rows 16-31
  for (int64_t s0 = 0; s0 < steps; s0 += kChunk / kStep) {
    const int64_t k0 = s0 * kStep, cs = std::min(kChunk / kStep, steps - s0);
    const bool last = s0 + cs == steps;
    barrier();  // this chunk's stage stores after the last chunk's tile loads
    const int64_t kc = std::clamp<int64_t>(k - k0, 0, cs * kStep);
    // bf16 rows whose chunk is whole are loaded as tiles where they lie: a copy into stage cost
    // 10-35 % of a product with few rows (16 x 4096 x 4096: 0.86 -> 0.74 ms), which reads each weight
    // value once. The tails are staged: tiles are whole, and k past its end must read zeros.
    if (b.widen == nullptr && kc == cs * kStep && n0 + kBlock <= n) {
      w = static_cast<const uint16_t*>(b.p) + n0 * b.ld + k0;
      ldw = b.ld;
    } else {
      stage_rows(b, n0, n, k0, kc, cs, stage);
      w = stage;
      ldw = kChunk;
    }
    barrier();
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* x = pa.data + p * pa.panel + s0 * 16 * 32;
      float* park = resident ? nullptr : sums + (p - p0) * kBlock * kBlock;
      if (s0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else if (!resident) {
        _tile_loadd(0, park, kBlock * 4);
        _tile_loadd(1, park + 16, kBlock * 4);
        _tile_loadd(2, park + 16 * kBlock, kBlock * 4);
        _tile_loadd(3, park + 16 * kBlock + 16, kBlock * 4);
      }
      if (m - p * kBlock > 16) {
        for (int64_t s = 0; s < cs; ++s) {
          _tile_loadd(4, w + s * kStep, ldw * 2);               // weight rows 0-15
          _tile_loadd(5, w + 16 * ldw + s * kStep, ldw * 2);  // weight rows 16-31
          _tile_loadd(6, x + s * 16 * 32, 64);         // activation rows 0-15
          _tile_loadd(7, x + half + s * 16 * 32, 64);  // activation rows 16-31
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else {  // activation rows 16-31 are padding (a few tokens): half the products
        for (int64_t s = 0; s < cs; ++s) {
          _tile_loadd(4, w + s * kStep, ldw * 2);
          _tile_loadd(5, w + 16 * ldw + s * kStep, ldw * 2);
          _tile_loadd(6, x + s * 16 * 32, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
        }
      }
      if (!last && resident) continue;
      float* dst = last ? acc_t : park;
      _tile_stored(0, dst, kBlock * 4);
      _tile_stored(1, dst + 16, kBlock * 4);
      _tile_stored(2, dst + 16 * kBlock, kBlock * 4);
      _tile_stored(3, dst + 16 * kBlock + 16, kBlock * 4);
      barrier();
      if (!last) continue;
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 2; ++j) {
          transpose16(acc_t + (i * 16) * kBlock + j * 16, kBlock, acc + (j * 16) * kBlock + i * 16, kBlock);
        }
      }
      const int64_t m0 = p * kBlock;
      bf16_gemm::epilogue(acc, kBlock, m0, std::min(kBlock, m - m0), n0, std::min(kBlock, n - n0), out);
    }
  }
}

// One product's plan: its packed activations, panel groups and tasks (blocks x groups, the
// weight block varying fastest: a thread's consecutive tasks share one group's packed rows in L2).
struct Plan {
  const Product* p;
  int64_t steps, panel, panels, group, blocks, tasks;
  Packed packed;
};

Plan plan(const Product& pr) {
  Plan pl{};
  pl.p = &pr;
  pl.steps = std::max<int64_t>(1, (pr.k + kStep - 1) / kStep);
  pl.panel = pl.steps * kStep * kBlock;  // uint16 per packed panel, zero-padded: a multiple of 64 bytes
  pl.panels = (pr.m + kBlock - 1) / kBlock;
  // Panels per group: their packed rows within ~1 MiB, so a group stays in L2 while the weight
  // blocks stream past it (each group widens the weight again: fewer, larger groups are better).
  pl.group = std::clamp<int64_t>((int64_t{1} << 20) / (pl.panel * 2), 1, pl.panels);
  pl.blocks = (pr.n + kBlock - 1) / kBlock;
  pl.tasks = pl.blocks * ((pl.panels + pl.group - 1) / pl.group);
  return pl;
}

// k values packed by one unit of work: a panel is packed in slices, so that the one panel of a
// decode product is packed by every thread (one thread took 4 % of a 16 x 4096 x 4096 int8 call
// while the other waited).
constexpr int64_t kPackSlice = 1024;

// Packs k [k0, k0 + kPackSlice) of panel q of a product's activations; the last slice writes the
// zeros past k's pairs.
void pack(const Plan& pl, int64_t q, int64_t k0, uint16_t* base) {
  const Product& pr = *pl.p;
  uint16_t* dst = base + q * pl.panel;
  const int64_t kc = std::min(kPackSlice, pr.k - k0);
  // pack_pairs32 fills (kc + 1) / 2 pairs
  const int64_t pairs = pl.steps * kStep / 2, first = k0 / 2, written = (kc + 1) / 2;
  thread_local std::vector<uint16_t> both;  // [pair][32 rows][2]
  if (static_cast<int64_t>(both.size()) < written * 64) both.resize(static_cast<size_t>(written * 64));
  if (kc > 0) bf16_gemm::pack_pairs32(pr.a, q * kBlock, pr.m, k0, kc, both.data());
  // Rows 0-15 then rows 16-31, each [pair][16 rows][2]: a tile is 1 KiB of consecutive bytes.
  for (int64_t h = 0; h < 2; ++h) {
    uint16_t* half = dst + h * pairs * 32;
    for (int64_t kk = 0; kk < written; ++kk) {
      std::memcpy(half + (first + kk) * 32, both.data() + kk * 64 + h * 32, 64);
    }
    if (k0 + kPackSlice >= pr.k) std::fill(half + (first + written) * 32, half + pairs * 32, 0);
  }
}

// Tasks [t0, t1) of all the plans' tasks, numbered plan after plan.
__attribute__((target("amx-tile,amx-bf16"))) void tasks(int64_t t0, int64_t t1, const std::vector<Plan>& plans) {
  _tile_loadconfig(&kTiles);
  size_t i = 0;
  int64_t first = 0;  // number of plans[i]'s first task
  for (int64_t t = t0; t < t1; ++t) {
    while (t - first >= plans[i].tasks) first += plans[i++].tasks;
    const Plan& pl = plans[i];
    const int64_t g = (t - first) / pl.blocks, blk = (t - first) % pl.blocks;
    const Product& pr = *pl.p;
    task(blk * kBlock, g * pl.group, std::min(pl.panels, (g + 1) * pl.group), pr.m, pr.n, pr.k, pl.packed, pr.b,
         pr.out);
  }
  _tile_release();  // the tile state is large: leave it free for context switches
}

void run(const std::vector<Product>& products) {
  std::vector<Plan> plans;
  int64_t packed_size = 0, panels = 0, total = 0;
  for (const Product& pr : products) {
    if (pr.m <= 0 || pr.n <= 0) continue;
    plans.push_back(plan(pr));
    packed_size += plans.back().panels * plans.back().panel;
    panels += plans.back().panels;
    total += plans.back().tasks;
  }
  if (plans.empty()) return;
  // The activations in pair layout, shared by every task. Kept per calling thread: a fresh buffer
  // would be zero-filled and page-faulted on every call.
  thread_local std::vector<uint16_t> packed;
  if (static_cast<int64_t>(packed.size()) < packed_size + 32) packed.resize(static_cast<size_t>(packed_size + 32));
  uint16_t* base = aligned(packed.data());
  struct Slice {
    size_t plan;
    int64_t panel, k0;
  };
  std::vector<Slice> slices;  // every (plan, panel, k slice) to pack
  slices.reserve(static_cast<size_t>(panels));
  for (size_t i = 0; i < plans.size(); ++i) {
    plans[i].packed = Packed{base, plans[i].panel};
    base += plans[i].panels * plans[i].panel;
    for (int64_t q = 0; q < plans[i].panels; ++q) {
      int64_t k0 = 0;
      do {
        slices.push_back(Slice{i, q, k0});
        k0 += kPackSlice;
      } while (k0 < plans[i].p->k);
    }
  }
  at::parallel_for(0, static_cast<int64_t>(slices.size()), 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const Slice& sl = slices[static_cast<size_t>(s)];
      pack(plans[sl.plan], sl.panel, sl.k0, plans[sl.plan].packed.data);
    }
  });
  at::parallel_for(0, total, 1, [&](int64_t t0, int64_t t1) { tasks(t0, t1, plans); });
}

// Rows [r0, r1) of a product: the same B, A's and the result's rows from r0.
Product rows_of(const Product& p, int64_t r0, int64_t r1) {
  Product s = p;
  s.m = r1 - r0;
  const int64_t width = p.a.widen != nullptr ? 1 : 2;  // bytes of an element of A
  s.a.p = static_cast<const char*>(p.a.p) + r0 * (p.a.trans ? 1 : p.a.ld) * width;
  if (s.out.f32 != nullptr) s.out.f32 += r0 * p.out.ld;
  else s.out.bf16 += r0 * p.out.ld;
  if (s.out.row_scale != nullptr) s.out.row_scale += r0;
  return s;
}

// The packed activations are a buffer kept per calling thread: bounded, so a large product runs
// as slices of rows (each packed, then multiplied) and the buffer stays below ~16 MiB.
constexpr int64_t kPackedBytes = int64_t{16} << 20;

}  // namespace

void gemm(const std::vector<Product>& products) {
  TORCH_INTERNAL_ASSERT(available());
  std::vector<Product> batch;
  int64_t bytes = 0;
  for (const Product& p : products) {
    TORCH_INTERNAL_ASSERT(supports(p.a, p.b));
    const int64_t row_bytes = std::max<int64_t>(1, (p.k + kStep - 1) / kStep) * kStep * 2;  // packed, per row
    const int64_t rows = std::max<int64_t>(kBlock, kPackedBytes / row_bytes / kBlock * kBlock);
    for (int64_t r0 = 0; r0 < p.m; r0 += rows) {
      const int64_t r1 = std::min(p.m, r0 + rows), need = (r1 - r0 + kBlock - 1) / kBlock * kBlock * row_bytes;
      if (!batch.empty() && bytes + need > kPackedBytes) {
        run(batch);
        batch.clear();
        bytes = 0;
      }
      batch.push_back(r0 == 0 && r1 == p.m ? p : rows_of(p, r0, r1));
      bytes += need;
    }
  }
  run(batch);
}

void gemm(int64_t m, int64_t n, int64_t k, const bf16_gemm::Matrix& a, const bf16_gemm::Matrix& b,
          const bf16_gemm::Output& out) {
  gemm({Product{m, n, k, a, b, out}});
}
#else
void gemm(const std::vector<Product>&) {}
void gemm(int64_t, int64_t, int64_t, const bf16_gemm::Matrix&, const bf16_gemm::Matrix&, const bf16_gemm::Output&) {}
void widen_int8(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*, int64_t) {}
#endif

}  // namespace torchneuron::amx_gemm
