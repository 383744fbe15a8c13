#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Adaptive Eager's precompiled kernel (tile_fusion.h).
#include "tile_fusion.h"
#include "cpu_features.h"
#include "fp8.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/SmallVector.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace torchneuron::tile_fusion {
namespace {

// Elements per tile: 4 KiB per float32 slot, so the slots of a tile stay in the first-level
// cache from one step to the next.
constexpr int64_t kTile = 1024;
// TensorIterator's grain (at::internal::GRAIN_SIZE): ranges below it run on the calling thread.
constexpr int64_t kGrain = 32768;

// ---- one step over n elements ----------------------------------------------------------------
// Scalar forms: the tails of the vector loops, and hosts without AVX2.
inline float widen1(uint16_t b) { return c10::detail::f32_from_bits(b); }
// ATen's scalar clamp: std::min(std::max(a, lo), hi) (a NaN passes through with its bits).
inline float clamp1(float a, float lo, float hi) {
  const float m = a < lo ? lo : a;
  return hi < m ? hi : m;
}

void widen_scalar(const uint16_t* a, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = widen1(a[i]);
}
void scale_scalar(const float* a, float s, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] * s;
}
void clamp_scalar(const float* a, float lo, float hi, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = clamp1(a[i], lo, hi);
}
// o = a with the sign bits cleared; true if some value was a NaN (exponent all ones, mantissa
// not zero: a magnitude above infinity's bits).
template <class U> bool abs_scalar(const U* a, U* o, int64_t n) {
  constexpr U kMagnitude = static_cast<U>(static_cast<U>(~U{0}) >> 1);
  constexpr U kInf = sizeof(U) == 2 ? U{0x7F80} : static_cast<U>(0x7F800000u);
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    o[i] = a[i] & kMagnitude;
    nan = nan || o[i] > kInf;
  }
  return nan;
}
// The running max `m` of n values (bfloat16 when Bf16, else float32); NaN sets *nan instead.
template <bool Bf16> float max_scalar(const void* a, int64_t n, float m, bool* nan) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = Bf16 ? widen1(static_cast<const uint16_t*>(a)[i]) : static_cast<const float*>(a)[i];
    if (v != v) *nan = true;
    else if (v > m) m = v;
  }
  return m;
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) void widen_avx512(const uint16_t* a, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    _mm512_storeu_si512(o + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  widen_scalar(a + i, o + i, n - i);
}
__attribute__((target("avx512f"))) void scale_avx512(const float* a, float s, float* o, int64_t n) {
  const __m512 v = _mm512_set1_ps(s);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(a + i), v));
  scale_scalar(a + i, s, o + i, n - i);
}
// ATen's vector clamp is min(hi, max(lo, a)) with the bounds first: max_ps/min_ps return their
// second operand when either is NaN, so a NaN `a` passes through, as in the scalar form.
__attribute__((target("avx512f"))) void clamp_avx512(const float* a, float lo, float hi, float* o, int64_t n) {
  const __m512 l = _mm512_set1_ps(lo), h = _mm512_set1_ps(hi);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, _mm512_min_ps(h, _mm512_max_ps(l, _mm512_loadu_ps(a + i))));
  clamp_scalar(a + i, lo, hi, o + i, n - i);
}
__attribute__((target("avx512f,avx512bw"))) bool abs_avx512(const void* a, void* o, int64_t bytes, bool bf16) {
  const __m512i mask = bf16 ? _mm512_set1_epi16(0x7FFF) : _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i inf = bf16 ? _mm512_set1_epi16(0x7F80) : _mm512_set1_epi32(0x7F800000);
  const auto* src = static_cast<const char*>(a);
  auto* dst = static_cast<char*>(o);
  uint64_t nan = 0;
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m512i m = _mm512_and_si512(_mm512_loadu_si512(src + i), mask);
    nan |= bf16 ? _mm512_cmpgt_epi16_mask(m, inf) : _mm512_cmpgt_epi32_mask(m, inf);
    _mm512_storeu_si512(dst + i, m);
  }
  const bool tail = bf16 ? abs_scalar(reinterpret_cast<const uint16_t*>(src + i), reinterpret_cast<uint16_t*>(dst + i), (bytes - i) / 2)
                         : abs_scalar(reinterpret_cast<const uint32_t*>(src + i), reinterpret_cast<uint32_t*>(dst + i), (bytes - i) / 4);
  return nan != 0 || tail;
}
// max_ps(v, m) returns m when v is NaN; the unordered compare notes the NaN.
template <bool Bf16>
__attribute__((target("avx512f"))) float max_avx512(const void* a, int64_t n, float m, bool* nan) {
  __m512 acc = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v;
    if constexpr (Bf16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + i));
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      v = _mm512_loadu_ps(static_cast<const float*>(a) + i);
    }
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    acc = _mm512_max_ps(v, acc);
  }
  if (unordered != 0) *nan = true;
  const void* rest = Bf16 ? static_cast<const void*>(static_cast<const uint16_t*>(a) + i)
                          : static_cast<const void*>(static_cast<const float*>(a) + i);
  return max_scalar<Bf16>(rest, n - i, _mm512_reduce_max_ps(acc), nan);
}
// The max of |a| over n values (bfloat16 when Bf16, else float32) with `m` (>= 0 or -inf): an
// abs read only by a max, in one pass. With the sign bit cleared, non-NaN floats order as their
// bits do as unsigned integers, so the max is an integer max of the masked bits, and a NaN is a
// masked value above infinity's bits: *nan is set exactly when the two steps apart would see one.
template <bool Bf16>
__attribute__((target("avx512f,avx512bw"))) float absmax_avx512(const void* a, int64_t n, float m, bool* nan) {
  using U = std::conditional_t<Bf16, uint16_t, uint32_t>;
  constexpr int64_t kLanes = 64 / sizeof(U);
  const auto* p = static_cast<const U*>(a);
  __m512i acc = _mm512_setzero_si512();
  const __m512i mask = Bf16 ? _mm512_set1_epi16(0x7FFF) : _mm512_set1_epi32(0x7FFFFFFF);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512i v = _mm512_and_si512(_mm512_loadu_si512(p + i), mask);
    acc = Bf16 ? _mm512_max_epu16(acc, v) : _mm512_max_epu32(acc, v);
  }
  uint32_t bits = 0;
  alignas(64) U lanes[kLanes];
  _mm512_store_si512(lanes, acc);
  for (const U b : lanes) bits = std::max<uint32_t>(bits, b);
  constexpr U kMagnitude = static_cast<U>(static_cast<U>(~U{0}) >> 1);
  for (; i < n; ++i) bits = std::max<uint32_t>(bits, static_cast<U>(p[i] & kMagnitude));
  const uint32_t f32 = Bf16 ? bits << 16 : bits;
  if (f32 > 0x7F800000u) {
    *nan = true;
    return m;
  }
  float v;
  std::memcpy(&v, &f32, 4);
  return std::max(m, v);
}
__attribute__((target("avx2"))) void widen_avx2(const uint16_t* a, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  widen_scalar(a + i, o + i, n - i);
}
__attribute__((target("avx2"))) void scale_avx2(const float* a, float s, float* o, int64_t n) {
  const __m256 v = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), v));
  scale_scalar(a + i, s, o + i, n - i);
}
__attribute__((target("avx2"))) void clamp_avx2(const float* a, float lo, float hi, float* o, int64_t n) {
  const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_min_ps(h, _mm256_max_ps(l, _mm256_loadu_ps(a + i))));
  clamp_scalar(a + i, lo, hi, o + i, n - i);
}
#endif

enum class Isa { Scalar, Avx2, Avx512 };
Isa isa() {
#if defined(__x86_64__)
  static const Isa i = cpu_features::avx512bw() ? Isa::Avx512 : cpu_features::avx2() ? Isa::Avx2 : Isa::Scalar;
  return i;
#else
  return Isa::Scalar;
#endif
}

void widen(const uint16_t* a, float* o, int64_t n, Isa k) {
#if defined(__x86_64__)
  if (k == Isa::Avx512) return widen_avx512(a, o, n);
  if (k == Isa::Avx2) return widen_avx2(a, o, n);
#endif
  widen_scalar(a, o, n);
}
void scale(const float* a, float s, float* o, int64_t n, Isa k) {
#if defined(__x86_64__)
  if (k == Isa::Avx512) return scale_avx512(a, s, o, n);
  if (k == Isa::Avx2) return scale_avx2(a, s, o, n);
#endif
  scale_scalar(a, s, o, n);
}
bool abs(const void* a, void* o, int64_t n, bool bf16, Isa k) {
#if defined(__x86_64__)
  if (k == Isa::Avx512) return abs_avx512(a, o, n * (bf16 ? 2 : 4), bf16);
#endif
  return bf16 ? abs_scalar(static_cast<const uint16_t*>(a), static_cast<uint16_t*>(o), n)
              : abs_scalar(static_cast<const uint32_t*>(a), static_cast<uint32_t*>(o), n);
}
float max(const void* a, int64_t n, bool bf16, float m, bool* nan, Isa k) {
#if defined(__x86_64__)
  if (k == Isa::Avx512) return bf16 ? max_avx512<true>(a, n, m, nan) : max_avx512<false>(a, n, m, nan);
#endif
  return bf16 ? max_scalar<true>(a, n, m, nan) : max_scalar<false>(a, n, m, nan);
}
void clamp(const float* a, float lo, float hi, float* o, int64_t n, Isa k) {
#if defined(__x86_64__)
  if (k == Isa::Avx512) return clamp_avx512(a, lo, hi, o, n);
  if (k == Isa::Avx2) return clamp_avx2(a, lo, hi, o, n);
#endif
  clamp_scalar(a, lo, hi, o, n);
}

// A thread's tiles of the unstored slots (64-byte aligned, grown as needed, kept).
float* scratch(size_t nslots) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buf;
  thread_local size_t have = 0;
  if (have < nslots) {
    buf.reset(static_cast<float*>(std::aligned_alloc(64, nslots * kTile * sizeof(float))));
    TORCH_CHECK(buf != nullptr, "Adaptive Eager: out of host memory for a fused kernel's tiles");
    have = nslots;
  }
  return buf.get();
}

// Runs of steps done in registers, not through the tiles: an abs read only by the max after it
// (amax), and a scaling cast (widen, scale, clamp, narrow: any run of them ending in the narrow,
// two steps or more). Their intermediates must be unstored and read by no other step.
enum class Fused : uint8_t { None, AbsMax, ScaledNarrow };
struct Segment {
  Fused kind = Fused::None;
  size_t first = 0, count = 1;  // steps [first, first + count)
  int scale = -1, clamp = -1;   // the run's Scale and Clamp steps (ScaledNarrow)
};

// Whether the value step `writer` puts in its slot is an intermediate only step `writer + 1`
// reads: read by no later step before a step overwrites the slot (slots are memory: a later
// kernel's output may take a dead intermediate's), and unstored unless overwritten (a stored
// slot's last value is what memory must hold).
bool private_link(const Step* steps, size_t nsteps, const Slot* slots, size_t writer) {
  const uint8_t slot = steps[writer].out;
  if (writer + 1 >= nsteps || steps[writer + 1].in != slot) return false;
  auto writes = [&](size_t j) { return steps[j].op != Op::Max && steps[j].out == slot; };
  bool overwritten = writes(writer + 1);
  for (size_t j = writer + 2; j < nsteps && !overwritten; ++j) {
    if (steps[j].in == slot) return false;
    overwritten = writes(j);
  }
  return overwritten || !slots[slot].stored;
}

c10::SmallVector<Segment, 8> plan(const Step* steps, size_t nsteps, const Slot* slots, bool absmax, bool narrow) {
  c10::SmallVector<Segment, 8> out;
  for (size_t i = 0; i < nsteps;) {
    Segment seg{Fused::None, i, 1};
    if (absmax && steps[i].op == Op::Abs && i + 1 < nsteps && steps[i + 1].op == Op::Max &&
        private_link(steps, nsteps, slots, i)) {
      seg = {Fused::AbsMax, i, 2};
    } else if (narrow) {  // widen? scale? clamp? then narrow, each feeding only the next
      size_t j = i;
      Segment run{Fused::ScaledNarrow, i, 0};
      if (steps[j].op == Op::Widen) ++j;
      if (j < nsteps && steps[j].op == Op::Scale) run.scale = static_cast<int>(j++);
      if (j < nsteps && steps[j].op == Op::Clamp) run.clamp = static_cast<int>(j++);
      bool linked = j < nsteps && steps[j].op == Op::Narrow && j > i;
      for (size_t w = i; linked && w < j; ++w) linked = private_link(steps, nsteps, slots, w);
      if (linked) {
        run.count = j + 1 - i;
        seg = run;
      }
    }
    out.push_back(seg);
    i += seg.count;
  }
  return out;
}

}  // namespace

void run(const Step* steps, size_t nsteps, const Slot* slots, size_t nslots, int64_t numel, bool* redo) {
  const Isa k = isa();
  // Scale factors are read once: every kernel that writes them ran before this group.
  c10::SmallVector<float, 8> values(nsteps, 0.f);
  for (const auto i : c10::irange(nsteps)) {
    if (steps[i].op == Op::Scale) values[i] = *steps[i].value;
  }
  // Max steps' running maxima and Max/Abs steps' NaN flags: kept per range while it runs (a
  // shared array written per tile would bounce its cache line between the cores), then merged.
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  std::vector<float> maxima(nsteps, kLowest);
  std::vector<char> nans(nsteps, 0);
  std::mutex merge;
  const auto segments = plan(steps, nsteps, slots, k == Isa::Avx512, fp8::scaled_narrow_available());
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    float* tiles = scratch(nslots);
    c10::SmallVector<float, 8> local_max(nsteps, kLowest);
    c10::SmallVector<char, 8> local_nan(nsteps, 0);
    c10::SmallVector<char*, 16> at(nslots);  // where each slot's values of the current tile are
    for (int64_t t0 = begin; t0 < end; t0 += kTile) {
      const int64_t n = std::min(kTile, end - t0);
      for (const auto s : c10::irange(nslots)) {
        at[s] = static_cast<char*>(slots[s].data) + t0 * static_cast<int64_t>(c10::elementSize(slots[s].dtype));
      }
      for (const Segment& seg : segments) {
        const size_t i = seg.first;
        const Step& st = steps[i];
        if (seg.kind == Fused::AbsMax) {
          const size_t mx = i + 1;
          bool nan = false;
          const bool bf16 = slots[st.in].dtype == at::kBFloat16;
          local_max[mx] = bf16 ? absmax_avx512<true>(at[st.in], n, local_max[mx], &nan)
                               : absmax_avx512<false>(at[st.in], n, local_max[mx], &nan);
          local_nan[mx] |= static_cast<char>(nan);  // (the abs is unstored: nothing of it to redo)
          continue;
        }
        if (seg.kind == Fused::ScaledNarrow) {
          const Step& last = steps[i + seg.count - 1];
          const Slot& out = slots[last.out];
          uint8_t* dst = out.stored ? static_cast<uint8_t*>(out.data) + t0
                                    : reinterpret_cast<uint8_t*>(tiles + last.out * kTile);
          const float* scale = seg.scale >= 0 ? &values[seg.scale] : nullptr;
          const bool clamped = seg.clamp >= 0;
          const float bounds[2] = {clamped ? steps[seg.clamp].lo : 0.f, clamped ? steps[seg.clamp].hi : 0.f};
          fp8::scaled_narrow(at[st.in], slots[st.in].dtype == at::kBFloat16, scale, clamped ? bounds : nullptr, dst,
                             out.dtype == at::kFloat8_e4m3fn, n);
          at[last.out] = reinterpret_cast<char*>(dst);
          continue;
        }
        if (st.op == Op::Max) {
          bool nan = false;
          local_max[i] = max(at[st.in], n, slots[st.in].dtype == at::kBFloat16, local_max[i], &nan, k);
          local_nan[i] |= static_cast<char>(nan);
          continue;
        }
        const Slot& out = slots[st.out];
        char* dst = out.stored ? static_cast<char*>(out.data) + t0 * static_cast<int64_t>(c10::elementSize(out.dtype))
                               : reinterpret_cast<char*>(tiles + st.out * kTile);
        const char* src = at[st.in];
        switch (st.op) {
          case Op::Widen:
            widen(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<float*>(dst), n, k);
            break;
          case Op::Narrow:
            fp8::convert(src, at::kFloat, dst, out.dtype, n);
            break;
          case Op::Scale:
            scale(reinterpret_cast<const float*>(src), values[i], reinterpret_cast<float*>(dst), n, k);
            break;
          case Op::Clamp:
            clamp(reinterpret_cast<const float*>(src), st.lo, st.hi, reinterpret_cast<float*>(dst), n, k);
            break;
          case Op::Abs:
            if (abs(src, dst, n, out.dtype == at::kBFloat16, k)) local_nan[i] = 1;
            break;
          case Op::Max:
            break;  // (above)
        }
        at[st.out] = dst;
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (const auto i : c10::irange(nsteps)) {
      maxima[i] = std::max(maxima[i], local_max[i]);
      nans[i] |= local_nan[i];
    }
  });
  for (const auto i : c10::irange(nsteps)) {
    const Step& st = steps[i];
    const float m = maxima[i];
    redo[i] = nans[i] != 0 || (st.op == Op::Max && m == 0.f);
    if (st.op != Op::Max || redo[i]) continue;
    if (slots[st.in].dtype == at::kBFloat16) {
      uint32_t u;
      std::memcpy(&u, &m, 4);
      const auto b = static_cast<uint16_t>(u >> 16);  // a bfloat16 value: exact
      std::memcpy(st.result, &b, 2);
    } else {
      std::memcpy(st.result, &m, 4);
    }
  }
}

}  // namespace torchneuron::tile_fusion
