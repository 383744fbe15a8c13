#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Random kernels of the neuron device: every ATen op that draws random numbers, computed from
// counter-based Philox4x32-10 (philox.h) keyed by the generator's (seed, offset), as CUDA does.
//
// The contract (docs/architecture.md, "Random numbers"): an op at generator offset o (a multiple
// of 4) computes element i (in the tensor's logical row-major order) from the Philox words at
// offset o + i only, and advances the offset by numel rounded up to 4. So the numbers of a slice
// starting at element s are those of the same op run at offset o + s: DTensor's offset-based
// tracker shards random ops this way. Results do not depend on threads or chunking: every
// element is computed by the same code path whatever its position.
//
// Checks and the shape/dtype logic come from ATen's own templates (DistributionTemplates.h), as
// CPU and CUDA use them; only the kernels (the bit source and its transformation) are ours.
#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/OpMathType.h>
#include <ATen/ScalarOps.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/TransformationHelper.h>
#include <ATen/native/DistributionTemplates.h>
#include <ATen/native/Distributions.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/native/UnaryOps.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/leaky_relu.h>
#include <ATen/ops/multinomial_native.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "generator.h"
#include "cpu_features.h"
#include "enqueue.h"
#include "fallback.h"
#include "philox.h"
#include "zero_copy.h"

// Sleef's AVX2 float functions, exported by libtorch_cpu (ATen's vectorized CPU kernels use them).
// Every float log/sincos of a kernel goes through them when the CPU has AVX2, so an element's
// value never depends on whether it fell in a vector or a remainder step.
extern "C" {
struct SleefFloat8x2 {
  __m256 x, y;
};
__m256 Sleef_logf8_u10avx2(__m256);
SleefFloat8x2 Sleef_sincosf8_u10avx2(__m256);
}

// Elementwise transformation loops must vectorize (-O2 alone does not).
#pragma GCC optimize("O3")

namespace torchneuron {

// ---- Philox blocks ---------------------------------------------------------------------------
namespace philox {
namespace {

void fill_scalar(uint64_t seed, uint64_t first_block, uint32_t subsequence, int64_t nblocks,
                 uint32_t* words) {
  for (int64_t i = 0; i < nblocks; ++i) {
    const uint64_t b = first_block + static_cast<uint64_t>(i);
    uint32_t* c = words + 4 * i;
    c[0] = static_cast<uint32_t>(b);
    c[1] = static_cast<uint32_t>(b >> 32);
    c[2] = subsequence;
    c[3] = 0;
    block(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  }
}

// 8 blocks per step, structure of arrays: 32x32->64 products with _mm256_mul_epu32 on the even
// and odd lanes, then a 4x8 transpose to curand's word order.
__attribute__((target("avx2"), always_inline)) inline void mulhilo(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// G independent groups of 8 blocks per step: a Philox round is a dependent chain (multiply,
// then xor), so interleaving groups fills the multiplier's latency.
template <int G>
__attribute__((target("avx2"), always_inline)) inline void rounds_avx2(__m256i (&c0)[G], __m256i (&c1)[G],
                                                                       __m256i (&c2)[G], __m256i (&c3)[G],
                                                                       uint64_t seed) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int g = 0; g < G; ++g) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo(c0[g], m0, hi0, lo0);
      mulhilo(c2[g], m1, hi1, lo1);
      c0[g] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[g]), key0);
      c1[g] = lo1;
      c2[g] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[g]), key1);
      c3[g] = lo0;
    }
    k0 += kW0;
    k1 += kW1;
  }
}

__attribute__((target("avx2"))) int64_t fill_avx2(uint64_t seed, uint64_t first_block,
                                                  uint32_t subsequence, int64_t nblocks,
                                                  uint32_t* words) {
  constexpr int G = 4;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i bias = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  int64_t i = 0;
  for (; i + 8 * G <= nblocks; i += 8 * G) {
    __m256i c0[G], c1[G], c2[G], c3[G];
    for (int g = 0; g < G; ++g) {
      const uint64_t b = first_block + static_cast<uint64_t>(i + 8 * g);
      // Block counters b..b+7 as (lo, hi), carrying into hi where the low word wrapped.
      const __m256i lo_base = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(b)));
      c0[g] = _mm256_add_epi32(lo_base, lane);
      const __m256i wrapped =
          _mm256_cmpgt_epi32(_mm256_xor_si256(lo_base, bias), _mm256_xor_si256(c0[g], bias));
      c1[g] = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(b >> 32))), wrapped);
      c2[g] = _mm256_set1_epi32(static_cast<int>(subsequence));
      c3[g] = _mm256_setzero_si256();
    }
    rounds_avx2<G>(c0, c1, c2, c3, seed);
    for (int g = 0; g < G; ++g) {
      // 4x8 transpose to curand's word order (block-major, lanes 0..3).
      const __m256i t0 = _mm256_unpacklo_epi32(c0[g], c1[g]), t1 = _mm256_unpackhi_epi32(c0[g], c1[g]);
      const __m256i t2 = _mm256_unpacklo_epi32(c2[g], c3[g]), t3 = _mm256_unpackhi_epi32(c2[g], c3[g]);
      const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
      const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
      auto* out = reinterpret_cast<__m256i*>(words + 4 * (i + 8 * g));
      _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(u0, u1, 0x20));
      _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
      _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
      _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
    }
  }
  return i;
}

}  // namespace

void fill(uint64_t seed, uint64_t first_block, uint32_t subsequence, int64_t nblocks, uint32_t* words) {
  int64_t done = cpu_features::avx2() ? fill_avx2(seed, first_block, subsequence, nblocks, words) : 0;
  fill_scalar(seed, first_block + static_cast<uint64_t>(done), subsequence, nblocks - done, words + 4 * done);
}

}  // namespace philox

namespace {

// ---- float transcendental helpers (one code path per machine, see the Sleef note) ----------
// In place: x[k] = log(x[k]) for k < n; x has room for n rounded up to 8.
__attribute__((target("avx2"))) void log_avx2(float* x, int64_t n) {
  for (int64_t k = 0; k < n; k += 8) {
    _mm256_storeu_ps(x + k, Sleef_logf8_u10avx2(_mm256_loadu_ps(x + k)));
  }
}
__attribute__((target("avx2"))) void sincos_avx2(const float* t, float* s, float* c, int64_t n) {
  for (int64_t k = 0; k < n; k += 8) {
    const SleefFloat8x2 r = Sleef_sincosf8_u10avx2(_mm256_loadu_ps(t + k));
    _mm256_storeu_ps(s + k, r.x);
    _mm256_storeu_ps(c + k, r.y);
  }
}

void log_f32(float* x, int64_t n) {
  if (cpu_features::avx2()) {
    for (int64_t k = n; k < (n + 7) / 8 * 8; ++k) x[k] = 1.0f;  // padding lanes
    log_avx2(x, n);
  } else {
    for (int64_t k = 0; k < n; ++k) x[k] = std::log(x[k]);
  }
}
void sincos_f32(float* t, float* s, float* c, int64_t n) {
  if (cpu_features::avx2()) {
    for (int64_t k = n; k < (n + 7) / 8 * 8; ++k) t[k] = 0.0f;
    sincos_avx2(t, s, c, n);
  } else {
    for (int64_t k = 0; k < n; ++k) {
      s[k] = std::sin(t[k]);
      c[k] = std::cos(t[k]);
    }
  }
}

// ---- chunked generation ----------------------------------------------------------------------
constexpr int64_t kChunk = 512;  // elements per Philox batch (a multiple of 32 blocks: 4 AVX2 groups)
constexpr int64_t kGrain = 64;   // chunks per task: 32768 elements, CUDA-like work per thread
using Words = const uint32_t (*)[kChunk];

// Calls body(i0, n, words) over [0, numel) in chunks: words[j][k] is the subsequence-j word of
// element i0 + k (at generator position offset + i0 + k). Chunks run in parallel.
template <int J, class Body>
void for_each_chunk(uint64_t seed, uint64_t offset, int64_t numel, const Body& body) {
  const int64_t nchunks = (numel + kChunk - 1) / kChunk;
  at::parallel_for(0, nchunks, kGrain, [&](int64_t c0, int64_t c1) {
    alignas(64) uint32_t words[J][kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * kChunk;
      const int64_t n = std::min(kChunk, numel - i0);
      for (int j = 0; j < J; ++j) {
        philox::fill(seed, (offset + static_cast<uint64_t>(i0)) / 4, static_cast<uint32_t>(j), (n + 3) / 4, words[j]);
      }
      body(i0, n, words);
    }
  });
}

// A kernel's output: the CPU alias of a neuron tensor, written directly when contiguous, else
// through a contiguous temporary (so elements are always numbered in row-major order).
struct Output {
  at::Tensor alias, buf;
  explicit Output(at::Tensor cpu_alias) : alias(std::move(cpu_alias)) {
    buf = alias.is_contiguous() ? alias : at::empty(alias.sizes(), alias.options());
  }
  Output(ZeroCopy& zc, const at::TensorBase& t) : Output(zc.in_output(at::Tensor(t))) {}
  void finish() {
    if (!buf.is_same(alias)) alias.copy_(buf);
  }
};

// The op's device. A neuron generator also routes ops on CPU tensors here (generators carry a
// dispatch key): refuse them with CUDA's message rather than fill CPU memory from our stream.
c10::DeviceIndex index_of(const at::TensorBase& t) {
  TORCH_CHECK(t.is_privateuseone(), "Expected a '", c10::DeviceTypeName(t.device().type(), true),
              "' device type for generator but found 'neuron'");
  return t.device().index();
}

// Fills `alias` (a CPU alias of the op's tensor) through body_for(buf) (Output's buf).
template <int J, class Body>
void fill_with(const at::Tensor& alias, const PhiloxArgs& rng, const Body& body_for) {
  Output out(alias);
  const int64_t numel = out.buf.numel();
  const auto [seed, offset] = rng.get();
  if (numel > 0) for_each_chunk<J>(seed, offset, numel, body_for(out.buf));
  out.finish();
}

// Runs body(i0, n, words) for the elements of `self` with an offset range reserved on gen:
// queued when the engine is on or a graph is being captured (every argument error was raised by
// ATen's templates before the kernel is called; the offsets are reserved here, in program
// order, so the numbers are those a synchronous call draws), else now. body_for is copied into
// the queued kernel: it must hold what it uses by value.
template <int J, class Body>
void generate(const char* name, const at::TensorBase& self, const std::optional<at::Generator>& gen,
              const Body& body_for /* (at::Tensor& buf) -> chunk body */, bool queueable = true) {
  const c10::DeviceIndex device = index_of(self);
  if (queueable && may_enqueue()) {
    QueuedCall q;
    at::Tensor alias = q.inout(at::Tensor(self));
    const PhiloxArgs rng = reserve_philox(gen, device, static_cast<uint64_t>(self.numel()));
    q.enqueue(name, [alias, rng, body_for]() { fill_with<J>(alias, rng, body_for); });
    return;
  }
  ZeroCopy zc;
  at::Tensor alias = zc.in_output(at::Tensor(self));  // runs the queue (raises inside a capture)
  const PhiloxArgs rng = reserve_philox(gen, device, static_cast<uint64_t>(self.numel()));
  zc.launch(name);
  fill_with<J>(alias, rng, body_for);
}

inline uint64_t word64(Words w, int64_t k) {
  return (static_cast<uint64_t>(w[1][k]) << 32) | w[0][k];
}
// Uniform in (0, 1), never 0 or 1 (the midpoint of a 24- or 53-bit cell): for logs.
inline float open_f32(uint32_t w) { return (static_cast<float>(w >> 8) + 0.5f) * 0x1p-24f; }
inline double open_f64(uint64_t v) { return (static_cast<double>(v >> 11) + 0.5) * 0x1p-53; }

// Standard normals of one chunk by Box-Muller on element pairs (2m, 2m+1): the pair's words give
// u1 in (0, 1], u2 in [0, 1); z[2m] = r cos(2 pi u2), z[2m+1] = r sin(2 pi u2), r = sqrt(-2 log u1).
// Pairs start at even positions (offsets are multiples of 4), so an element's partner is fixed.
void normal_chunk_f32(const uint32_t* w, int64_t n, float* z) {
  const int64_t pairs = (n + 1) / 2;  // the last pair's partner word exists (whole blocks)
  alignas(64) float a[kChunk / 2 + 8], t[kChunk / 2 + 8], s[kChunk / 2 + 8], c[kChunk / 2 + 8];
  for (int64_t m = 0; m < pairs; ++m) {
    a[m] = 1.0f - static_cast<float>(w[2 * m] >> 8) * 0x1p-24f;
    t[m] = static_cast<float>(w[2 * m + 1] >> 8) * (0x1p-24f * 6.2831853071795864769f);
  }
  log_f32(a, pairs);
  sincos_f32(t, s, c, pairs);
  for (int64_t m = 0; m < pairs; ++m) {
    const float r = std::sqrt(-2.0f * a[m]);
    z[2 * m] = r * c[m];
    z[2 * m + 1] = r * s[m];
  }
}
void normal_chunk_f64(Words w, int64_t n, double* z) {
  for (int64_t m = 0; 2 * m < n; ++m) {
    const double u1 = 1.0 - static_cast<double>(word64(w, 2 * m) >> 11) * 0x1p-53;
    const double u2 = static_cast<double>(word64(w, 2 * m + 1) >> 11) * 0x1p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double th = 2.0 * c10::pi<double> * u2;
    z[2 * m] = r * std::cos(th);
    z[2 * m + 1] = r * std::sin(th);
  }
}

// Normal(mean, std) of acc_t through `map(z) -> value`, stored as scalar_t.
template <typename scalar_t, class Map>
void normal_fill(const char* name, const at::TensorBase& self, const std::optional<at::Generator>& gen,
                 const Map& map) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    generate<2>(name, self, gen, [=](at::Tensor& buf) {
      scalar_t* base = buf.data_ptr<scalar_t>();
      return [=](int64_t i0, int64_t n, Words w) {
        double z[kChunk];
        normal_chunk_f64(w, n, z);
        for (int64_t k = 0; k < n; ++k) base[i0 + k] = map(z[k]);
      };
    });
  } else {
    generate<1>(name, self, gen, [=](at::Tensor& buf) {
      scalar_t* base = buf.data_ptr<scalar_t>();
      return [=](int64_t i0, int64_t n, Words w) {
        alignas(64) float z[kChunk + 8];
        normal_chunk_f32(w[0], n, z);
        for (int64_t k = 0; k < n; ++k) base[i0 + k] = static_cast<scalar_t>(map(z[k]));
      };
    });
  }
}

// ---- kernels for ATen's templates ------------------------------------------------------------
// ATen's uniform_real: the low `digits` bits scaled to [0, 1); a value rounded up to `to`
// becomes `from`, as on CUDA, so the result stays in [from, to).
template <typename scalar_t>
void uniform_fill(const at::TensorBase& self, double from, double to, const std::optional<at::Generator>& gen) {
  using acc_t = at::dist_acctype<scalar_t>;
  const acc_t f = static_cast<acc_t>(from), range = static_cast<acc_t>(to - from);
  const scalar_t from_s = static_cast<scalar_t>(from), to_s = static_cast<scalar_t>(to);
  constexpr int digits = std::numeric_limits<scalar_t>::digits;
  constexpr acc_t scale = static_cast<acc_t>(1) / static_cast<acc_t>(uint64_t{1} << digits);
  if constexpr (std::is_same_v<scalar_t, double>) {
    generate<2>("aten::uniform_", self, gen, [=](at::Tensor& buf) {
      double* base = buf.data_ptr<double>();
      return [=](int64_t i0, int64_t n, Words w) {
        for (int64_t k = 0; k < n; ++k) {
          const double v = static_cast<double>(word64(w, k) & ((uint64_t{1} << 53) - 1)) * scale * range + f;
          base[i0 + k] = v == to_s ? from_s : v;
        }
      };
    });
  } else {
    generate<1>("aten::uniform_", self, gen, [=](at::Tensor& buf) {
      scalar_t* base = buf.data_ptr<scalar_t>();
      return [=](int64_t i0, int64_t n, Words w) {
        for (int64_t k = 0; k < n; ++k) {
          const auto bits = static_cast<int32_t>(w[0][k] & ((uint32_t{1} << digits) - 1));
          const scalar_t v = static_cast<scalar_t>(static_cast<acc_t>(bits) * scale * range + f);
          base[i0 + k] = v == to_s ? from_s : v;
        }
      };
    });
  }
}

template <typename RNG>
struct UniformKernel {
  void operator()(at::TensorIteratorBase& iter, double from, double to, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "uniform_", [&] {
      uniform_fill<scalar_t>(self, from, to, gen);
    });
  }
};

template <typename RNG>
struct NormalKernel {
  void operator()(const at::TensorBase& self, double mean, double std, std::optional<at::Generator> gen) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "normal_", [&] {
      using acc_t = at::dist_acctype<scalar_t>;
      const acc_t m = static_cast<acc_t>(mean), s = static_cast<acc_t>(std);
      normal_fill<scalar_t>("aten::normal_", self, gen, [=](acc_t z) { return z * s + m; });
    });
  }
};

template <typename RNG>
struct LogNormalKernel {
  void operator()(at::TensorIteratorBase& iter, double mean, double std, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "log_normal_", [&] {
      using acc_t = at::dist_acctype<scalar_t>;
      const acc_t m = static_cast<acc_t>(mean), s = static_cast<acc_t>(std);
      normal_fill<scalar_t>("aten::log_normal_", self, gen, [=](acc_t z) { return std::exp(z * s + m); });
    });
  }
};

// Ops built on one open uniform u in (0, 1) per element: u of 24 bits (float types) or 53 bits.
template <typename scalar_t, class Map>
void open_uniform_fill(const char* name, const at::TensorBase& self, const std::optional<at::Generator>& gen,
                       const Map& map /* acc_t u -> value */) {
  if constexpr (std::is_same_v<at::dist_acctype<scalar_t>, double>) {
    generate<2>(name, self, gen, [=](at::Tensor& buf) {
      scalar_t* base = buf.data_ptr<scalar_t>();
      return [=](int64_t i0, int64_t n, Words w) {
        for (int64_t k = 0; k < n; ++k) base[i0 + k] = static_cast<scalar_t>(map(open_f64(word64(w, k))));
      };
    });
  } else {
    generate<1>(name, self, gen, [=](at::Tensor& buf) {
      scalar_t* base = buf.data_ptr<scalar_t>();
      return [=](int64_t i0, int64_t n, Words w) {
        for (int64_t k = 0; k < n; ++k) base[i0 + k] = static_cast<scalar_t>(map(open_f32(w[0][k])));
      };
    });
  }
}

// -log(u) / lambda with u in (0, 1): never 0 and never inf (multinomial divides by it).
template <typename scalar_t>
void exponential_fill(const at::TensorBase& self, double lambda, const std::optional<at::Generator>& gen) {
  if constexpr (std::is_same_v<at::dist_acctype<scalar_t>, float>) {
    const float inv = static_cast<float>(1.0 / lambda);
    generate<1>("aten::exponential_", self, gen, [=](at::Tensor& buf) {
      scalar_t* base = buf.data_ptr<scalar_t>();
      return [=](int64_t i0, int64_t n, Words w) {
        alignas(64) float u[kChunk + 8];
        for (int64_t k = 0; k < n; ++k) u[k] = open_f32(w[0][k]);
        log_f32(u, n);
        for (int64_t k = 0; k < n; ++k) base[i0 + k] = static_cast<scalar_t>(-u[k] * inv);
      };
    });
  } else {
    const double inv = 1.0 / lambda;
    open_uniform_fill<scalar_t>("aten::exponential_", self, gen, [=](double u) { return -std::log(u) * inv; });
  }
}

template <typename RNG>
struct ExponentialKernel {
  void operator()(at::TensorIteratorBase& iter, double lambda, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "exponential_", [&] {
      exponential_fill<scalar_t>(self, lambda, gen);
    });
  }
};

template <typename RNG>
struct CauchyKernel {
  void operator()(at::TensorIteratorBase& iter, double median, double sigma, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "cauchy_", [&] {
      using acc_t = at::dist_acctype<scalar_t>;
      const acc_t med = static_cast<acc_t>(median), sig = static_cast<acc_t>(sigma);
      open_uniform_fill<scalar_t>("aten::cauchy_", self, gen, [=](acc_t u) {
        return at::transformation::cauchy<acc_t>(u, med, sig);
      });
    });
  }
};

template <typename RNG>
struct GeometricKernel {
  void operator()(at::TensorIteratorBase& iter, double p, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    // Computed in double for every dtype (integer outputs are allowed, as on CPU).
    const double denom = std::log1p(-p);
    AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, self.scalar_type(), "geometric_", [&] {
      generate<2>("aten::geometric_", self, gen, [=](at::Tensor& buf) {
        scalar_t* base = buf.data_ptr<scalar_t>();
        return [=](int64_t i0, int64_t n, Words w) {
          for (int64_t k = 0; k < n; ++k) {
            base[i0 + k] = static_cast<scalar_t>(std::ceil(std::log(open_f64(word64(w, k))) / denom));
          }
        };
      });
    });
  }
};

// random_(from, to), random_(to), random_(): ATen's integer transformations of 32 random bits,
// or 64 (two subsequences) when the range needs them, as CPU and CUDA choose.
template <typename scalar_t, bool Wide, class Map>
void int_fill(const at::TensorBase& self, const std::optional<at::Generator>& gen, const Map& map) {
  generate<Wide ? 2 : 1>("aten::random_", self, gen, [=](at::Tensor& buf) {
    scalar_t* base = buf.data_ptr<scalar_t>();
    return [=](int64_t i0, int64_t n, Words w) {
      for (int64_t k = 0; k < n; ++k) {
        if constexpr (Wide) base[i0 + k] = map(word64(w, k));
        else base[i0 + k] = map(w[0][k]);
      }
    };
  });
}

template <typename RNG>
struct RandomFromToKernel {
  void operator()(at::TensorIteratorBase& iter, uint64_t range, int64_t base, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    // CPU's dtypes, unsigned ones included (randint(..., dtype=torch.uint64)).
    AT_DISPATCH_V2(self.scalar_type(), "random_from_to", AT_WRAP([&] {
      if (range >= (uint64_t{1} << 32)) {
        int_fill<scalar_t, true>(self, gen, [=](uint64_t v) {
          return at::transformation::uniform_int_from_to<scalar_t>(v, range, base);
        });
      } else {
        int_fill<scalar_t, false>(self, gen, [=](uint32_t v) {
          return at::transformation::uniform_int_from_to<scalar_t>(v, range, base);
        });
      }
    }), AT_EXPAND(AT_ALL_TYPES), at::kBool, at::kHalf, at::kBFloat16, AT_EXPAND(AT_BAREBONES_UNSIGNED_TYPES));
  }
  // from = int64 min, to = None: the full 64-bit range.
  void operator()(at::TensorIteratorBase& iter, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "random_full_range", [&] {
      int_fill<scalar_t, true>(self, gen, [](uint64_t v) {
        return at::transformation::uniform_int_full_range<scalar_t>(v);
      });
    });
  }
};

template <typename RNG>
struct RandomKernel {
  void operator()(at::TensorIteratorBase& iter, std::optional<at::Generator> gen) {
    const at::TensorBase& self = iter.tensor_base(0);
    AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "random_", [&] {
      if constexpr (std::is_same_v<scalar_t, int64_t> || std::is_same_v<scalar_t, double>) {
        int_fill<scalar_t, true>(self, gen, [](uint64_t v) { return at::transformation::uniform_int<scalar_t>(v); });
      } else {
        int_fill<scalar_t, false>(self, gen, [](uint32_t v) { return at::transformation::uniform_int<scalar_t>(v); });
      }
    });
  }
};

// bernoulli: element = (word < p * 2^32), exact for every p representable in 32 bits.
inline uint64_t threshold(double p) {
  return p >= 1.0 ? (uint64_t{1} << 32) : static_cast<uint64_t>(p * 4294967296.0);
}

// keep[k] = (w[k] < t) as 32-bit compares (vectorizable); t = 2^32 keeps everything.
inline void keep_mask(const uint32_t* w, int64_t n, uint64_t t, bool* keep) {
  if (t > 0xFFFFFFFFull) {
    for (int64_t k = 0; k < n; ++k) keep[k] = true;
    return;
  }
  const auto t32 = static_cast<uint32_t>(t);
  for (int64_t k = 0; k < n; ++k) keep[k] = w[k] < t32;
}

template <typename RNG>
struct BernoulliScalarKernel {
  void operator()(const at::TensorBase& self, double p, std::optional<at::Generator> gen) {
    const uint64_t t = threshold(p);
    AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "bernoulli_scalar", [&] {
      generate<1>("aten::bernoulli_", self, gen, [=](at::Tensor& buf) {
        scalar_t* base = buf.data_ptr<scalar_t>();
        return [=](int64_t i0, int64_t n, Words w) {
          bool keep[kChunk];
          keep_mask(w[0], n, t, keep);
          for (int64_t k = 0; k < n; ++k) base[i0 + k] = static_cast<scalar_t>(keep[k]);
        };
      });
    });
  }
};

template <typename RNG>
struct BernoulliTensorKernel {
  void operator()(const at::TensorBase& self, const at::TensorBase& p_, std::optional<at::Generator> gen) {
    ZeroCopy pz;  // p may be a neuron or a CPU tensor, as on CUDA
    at::Tensor p = pz.in(at::Tensor(p_), /*allow_cpu=*/true).expand(self.sizes()).to(at::kDouble).contiguous();
    const double* pp = p.data_ptr<double>();
    AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, self.scalar_type(), "bernoulli_tensor", [&] {
      generate<1>("aten::bernoulli_", self, gen, [=](at::Tensor& buf) {
        scalar_t* base = buf.data_ptr<scalar_t>();
        return [=](int64_t i0, int64_t n, Words w) {
          for (int64_t k = 0; k < n; ++k) {
            const double pk = pp[i0 + k];
            TORCH_CHECK(pk >= 0.0 && pk <= 1.0, "bernoulli_ expects p to be in [0, 1], but got p=", pk);
            base[i0 + k] = static_cast<scalar_t>(static_cast<double>(w[0][k]) < pk * 4294967296.0);
          }
        };
      }, /*queueable=*/false);  // reads p now (a CPU copy of it): runs at the call
    });
  }
};

struct NeuronRNG {};  // the RNG tag ATen's templates carry (unused by our kernels)
namespace tmpl = at::native::templates;

at::Tensor& uniform_(at::Tensor& self, double from, double to, std::optional<at::Generator> gen) {
  return tmpl::uniform_impl_<UniformKernel, NeuronRNG>(self, from, to, gen);
}
at::Tensor& normal_(at::Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  return tmpl::normal_impl_<NormalKernel, NeuronRNG>(self, mean, std, gen);
}
at::Tensor normal_tf(const at::Tensor& mean, double std, std::optional<at::Generator> gen) {
  return tmpl::normal_impl<NormalKernel, NeuronRNG>(mean, std, gen);
}
at::Tensor normal_ft(double mean, const at::Tensor& std, std::optional<at::Generator> gen) {
  return tmpl::normal_impl<NormalKernel, NeuronRNG>(mean, std, gen);
}
at::Tensor normal_tt(const at::Tensor& mean, const at::Tensor& std, std::optional<at::Generator> gen) {
  return tmpl::normal_impl<NormalKernel, NeuronRNG>(mean, std, gen);
}
at::Tensor& normal_tf_out(const at::Tensor& mean, double std, std::optional<at::Generator> gen, at::Tensor& out) {
  return tmpl::normal_out_impl<NormalKernel, NeuronRNG>(out, mean, std, gen);
}
at::Tensor& normal_ft_out(double mean, const at::Tensor& std, std::optional<at::Generator> gen, at::Tensor& out) {
  return tmpl::normal_out_impl<NormalKernel, NeuronRNG>(out, mean, std, gen);
}
at::Tensor& normal_tt_out(const at::Tensor& mean, const at::Tensor& std, std::optional<at::Generator> gen,
                          at::Tensor& out) {
  return tmpl::normal_out_impl<NormalKernel, NeuronRNG>(out, mean, std, gen);
}
at::Tensor& log_normal_(at::Tensor& self, double mean, double std, std::optional<at::Generator> gen) {
  return tmpl::log_normal_impl_<LogNormalKernel, NeuronRNG>(self, mean, std, gen);
}
at::Tensor& exponential_(at::Tensor& self, double lambda, std::optional<at::Generator> gen) {
  return tmpl::exponential_impl_<ExponentialKernel, NeuronRNG>(self, lambda, gen);
}
at::Tensor& cauchy_(at::Tensor& self, double median, double sigma, std::optional<at::Generator> gen) {
  return tmpl::cauchy_impl_<CauchyKernel, NeuronRNG>(self, median, sigma, gen);
}
at::Tensor& geometric_(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  return tmpl::geometric_impl_<GeometricKernel, NeuronRNG>(self, p, gen);
}
at::Tensor& random_(at::Tensor& self, std::optional<at::Generator> gen) {
  return tmpl::random_impl<RandomKernel, NeuronRNG>(self, gen);
}
at::Tensor& random_from(at::Tensor& self, int64_t from, std::optional<int64_t> to, std::optional<at::Generator> gen) {
  return tmpl::random_from_to_impl<RandomFromToKernel, NeuronRNG>(self, from, to, gen);
}
at::Tensor& random_to(at::Tensor& self, int64_t to, std::optional<at::Generator> gen) {
  return random_from(self, 0, to, gen);
}
at::Tensor& bernoulli_float(at::Tensor& self, double p, std::optional<at::Generator> gen) {
  return tmpl::bernoulli_impl_<BernoulliScalarKernel, NeuronRNG>(self, p, gen);
}
at::Tensor& bernoulli_tensor(at::Tensor& self, const at::Tensor& p, std::optional<at::Generator> gen) {
  return tmpl::bernoulli_impl_<BernoulliTensorKernel, NeuronRNG>(self, p, gen);
}
at::Tensor& bernoulli_out(const at::Tensor& self, std::optional<at::Generator> gen, at::Tensor& out) {
  return tmpl::bernoulli_out_impl<BernoulliTensorKernel, NeuronRNG>(out, self, gen);
}

// ---- dropout ---------------------------------------------------------------------------------
// output = input * mask * scale (bool mask, scale = 1 / (1 - p)), one fused pass for contiguous
// floating inputs: the mask is bernoulli(1 - p) at the op's offset, the same numbers the unfused
// bernoulli_ gives. The scale multiplies in the accumulation type, as CUDA's kernel does (and
// as CPU's native_dropout_backward does; CPU's forward, input.mul(mask).mul_(scale) through the
// C++ Scalar overload, rounds the scale to bf16/fp16 first).
void dropout_kernel(const at::Tensor& x, const at::Tensor& o, const at::Tensor& m, const PhiloxArgs& rng, uint64_t t,
                    double scale) {
  const auto [seed, offset] = rng.get();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "native_dropout", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t s = static_cast<acc_t>(scale);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = o.data_ptr<scalar_t>();
    bool* mp = m.data_ptr<bool>();
    for_each_chunk<1>(seed, offset, x.numel(), [=](int64_t i0, int64_t n, Words w) {
      keep_mask(w[0], n, t, mp + i0);
      // (x * mask) * scale, as CPU rounds it (x * 0 keeps signed zeros and NaN).
      for (int64_t k = 0; k < n; ++k) {
        op[i0 + k] = static_cast<scalar_t>(static_cast<acc_t>(xp[i0 + k]) * static_cast<acc_t>(mp[i0 + k]) * s);
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) return {input, at::empty_like(input)};
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  const double p1m = 1.0 - p;
  const double scale = p1m == 0 ? 0.0 : 1.0 / p1m;
  if (!input.is_contiguous() || !at::isFloatingType(input.scalar_type())) {
    at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
    mask.bernoulli_(p1m);
    // The scale as a Python number is passed (the second operand): the same rounding as the fused
    // kernel's, whatever the input's layout.
    return {input.mul(mask).mul_(at::native::wrapped_scalar_tensor(scale)), mask};
  }
  TORCH_CHECK(0 <= p1m && p1m <= 1, "bernoulli_ expects p to be in [0, 1], but got p=", p1m);
  const uint64_t t = threshold(p1m);
  at::Tensor output, mask;
  // Queued with the engine on or inside a graph capture: the generator's offsets are reserved
  // here, in program order, so the numbers are those a synchronous call would draw (a recorded
  // kernel's, those of the replay's offsets: generate's comment).
  if (may_enqueue() && input.is_privateuseone()) {
    QueuedCall q;
    at::Tensor x = q.in(input);
    at::Tensor o = q.out(output, input.sizes(), input.scalar_type()), m = q.out(mask, input.sizes(), at::kBool);
    const PhiloxArgs rng = reserve_philox(std::nullopt, index_of(input), static_cast<uint64_t>(input.numel()));
    q.enqueue("aten::native_dropout", [=]() { dropout_kernel(x, o, m, rng, t, scale); });
    return {output, mask};
  }
  output = at::empty_like(input);
  mask = at::empty_like(input, input.options().dtype(at::kBool));
  ZeroCopy zc;
  at::Tensor x = zc.in(input), o = zc.in_output(output), m = zc.in_output(mask);
  const PhiloxArgs rng = reserve_philox(std::nullopt, index_of(input), static_cast<uint64_t>(input.numel()));
  zc.launch("aten::native_dropout");
  dropout_kernel(x, o, m, rng, t, scale);
  return {output, mask};
}

// Its backward, grad * mask * scale with CPU's roundings (the product with the mask, exact, then
// the scale in the accumulation type), queued for the dense arguments autograd passes; any other call takes
// CPU's kernel through the boxed fallback.
constexpr char kDropoutBackward[] = "aten::native_dropout_backward";
at::Tensor native_dropout_backward(const at::Tensor& grad, const at::Tensor& mask, double scale) {
  if (may_enqueue() && queueable_like(grad, grad) && at::isFloatingType(grad.scalar_type()) && grad.is_contiguous() &&
      mask.is_privateuseone() && mask.device() == grad.device() && mask.scalar_type() == at::kBool &&
      mask.layout() == c10::kStrided && mask.sizes() == grad.sizes() && mask.is_contiguous()) {
    QueuedCall q;
    at::Tensor g = q.in(grad), m = q.in(mask), out;
    at::Tensor o = q.out(out, grad.sizes(), grad.scalar_type());
    q.enqueue(kDropoutBackward, [g, m, o, scale]() {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "native_dropout_backward", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t s = static_cast<acc_t>(scale);  // a Python number, cast as TensorIterator casts it
        const scalar_t* gp = g.const_data_ptr<scalar_t>();
        const bool* mp = m.const_data_ptr<bool>();
        scalar_t* op = o.data_ptr<scalar_t>();
        at::parallel_for(0, g.numel(), 32768, [=](int64_t b, int64_t e) {
          for (int64_t k = b; k < e; ++k) {
            // grad * mask rounded (exact: grad, a signed zero or NaN), then * scale rounded
            const scalar_t gm = static_cast<scalar_t>(static_cast<acc_t>(gp[k]) * static_cast<acc_t>(mp[k]));
            op[k] = static_cast<scalar_t>(static_cast<acc_t>(gm) * s);
          }
        });
      });
    });
    return out;
  }
  return FromStack<at::Tensor>::get(via_fallback<kDropoutBackward>(grad, mask, scale));
}

// ---- rrelu ----------------------------------------------------------------------------------
at::Tensor& rrelu_with_noise_out(const at::Tensor& self, at::Tensor& noise, const at::Scalar& lower,
                                 const at::Scalar& upper, bool training, std::optional<at::Generator> gen,
                                 at::Tensor& out) {
  TORCH_CHECK(self.sym_sizes() == noise.sym_sizes(), "noise tensor shape must match self tensor shape. Got self.shape = ",
              self.sym_sizes(), " noise.shape = ", noise.sym_sizes());
  at::native::resize_output(out, self.sizes());
  if (!training) {
    const double negative_slope = (lower.to<double>() + upper.to<double>()) / 2;
    return at::leaky_relu_out(out, self, negative_slope);
  }
  // Slopes uniform in [lower, upper) for every element (counter-based: one offset per element).
  at::Tensor r = at::empty_like(self, at::MemoryFormat::Contiguous).uniform_(lower.to<double>(), upper.to<double>(), gen);
  at::Tensor negative = self.le(0);
  noise.copy_(at::where(negative, r, 1));
  out.copy_(at::where(negative, self * r, self));
  return out;
}
at::Tensor rrelu_with_noise(const at::Tensor& self, at::Tensor& noise, const at::Scalar& lower, const at::Scalar& upper,
                            bool training, std::optional<at::Generator> gen) {
  at::Tensor out = at::empty_like(self);
  return rrelu_with_noise_out(self, noise, lower, upper, training, gen, out);
}
at::Tensor& rrelu_with_noise_(at::Tensor& self, at::Tensor& noise, const at::Scalar& lower, const at::Scalar& upper,
                             bool training, std::optional<at::Generator> gen) {
  at::Tensor out = at::empty_like(self);
  rrelu_with_noise_out(self, noise, lower, upper, training, gen, out);
  return self.copy_(out);
}

// ---- randperm -------------------------------------------------------------------------------
// Fisher-Yates: position i swaps with j = (64 random bits of element i) mod (i + 1).
at::Tensor& randperm_out(int64_t n, std::optional<at::Generator> gen, at::Tensor& result) {
  TORCH_CHECK(n >= 0, "n must be non-negative, got", n);
  at::native::check_supported_max_int_with_precision(n, result);
  result.resize_({n});
  ZeroCopy zc;
  Output out(zc, result);
  const auto [seed, offset] = reserve_philox(gen, index_of(result), static_cast<uint64_t>(n)).get();
  zc.launch("aten::randperm");
  std::vector<int64_t> perm(static_cast<size_t>(n));
  std::vector<uint64_t> bits(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  if (n > 0) {
    for_each_chunk<2>(seed, offset, n, [&](int64_t i0, int64_t cnt, Words w) {
      for (int64_t k = 0; k < cnt; ++k) bits[i0 + k] = word64(w, k);
    });
  }
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(bits[i] % static_cast<uint64_t>(i + 1));
    std::swap(perm[i], perm[j]);
  }
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, result.scalar_type(), "randperm", [&] {
    scalar_t* base = out.buf.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) base[i] = static_cast<scalar_t>(perm[i]);
  });
  out.finish();
  return result;
}

// ---- multinomial with replacement (the rest of multinomial is ATen's: exponential_ + topk) ----
// Sample s of distribution d: u from the 53-bit word pair of element d * n_sample + s, then the
// first category whose cumulative weight exceeds u * total.
void multinomial_with_replacement(at::Tensor& result, const at::Tensor& self, int64_t n_sample,
                                  std::optional<at::Generator> gen) {
  const int64_t n_dist = self.dim() > 1 ? self.size(0) : 1;
  if (self.dim() > 1) result.resize_({n_dist, n_sample});
  else result.resize_({n_sample});
  ZeroCopy zc;
  at::Tensor probs = zc.in(self).to(at::kDouble).contiguous();
  Output out(zc, result);
  const int64_t n_categories = probs.size(-1);
  const double* pp = probs.data_ptr<double>();
  std::vector<double> cum(static_cast<size_t>(n_dist * n_categories));
  std::vector<int64_t> last_nonzero(static_cast<size_t>(n_dist));
  for (int64_t d = 0; d < n_dist; ++d) {
    double total = 0;
    int64_t last = 0;
    for (int64_t c = 0; c < n_categories; ++c) {
      const double v = pp[d * n_categories + c];
      TORCH_CHECK(!std::isnan(v) && !std::isinf(v), "invalid multinomial distribution (encountering probability entry = infinity or NaN)");
      TORCH_CHECK(v >= 0, "invalid multinomial distribution (encountering probability entry < 0)");
      total += v;
      if (v > 0) last = c;
      cum[d * n_categories + c] = total;
    }
    TORCH_CHECK(total > 0, "invalid multinomial distribution (sum of probabilities <= 0)");
    last_nonzero[d] = last;
  }
  const auto [seed, offset] = reserve_philox(gen, index_of(self), static_cast<uint64_t>(n_dist * n_sample)).get();
  zc.launch("aten::multinomial");
  int64_t* base = out.buf.data_ptr<int64_t>();
  for_each_chunk<2>(seed, offset, n_dist * n_sample, [&](int64_t i0, int64_t cnt, Words w) {
    for (int64_t k = 0; k < cnt; ++k) {
      const int64_t d = (i0 + k) / n_sample;
      const double* row = cum.data() + d * n_categories;
      const double x = static_cast<double>(word64(w, k) >> 11) * 0x1p-53 * row[n_categories - 1];
      int64_t c = std::upper_bound(row, row + n_categories, x) - row;
      base[i0 + k] = std::min(c, last_nonzero[d]);
    }
  });
  out.finish();
}

// ---- samplers with rejection: gamma, dirichlet, poisson, binomial -----------------------------
// Element i (position p = offset + i) draws its j-th word from subsequence j at p, as many as its
// rejection loop needs: still a function of (seed, p) alone.
struct ElementStream {
  uint64_t seed, p;
  uint32_t j = 0;
  uint32_t next() { return philox::word(seed, j++, p); }
  double uniform() {  // [0, 1), 53 bits
    const uint64_t hi = next(), lo = next();
    return static_cast<double>(((hi << 32) | lo) >> 11) * 0x1p-53;
  }
  double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * c10::pi<double> * u2);
  }
};

// Per element of `self`-shaped output: value = f(stream, i).
template <typename scalar_t, class F>
void per_element(const char* name, const at::Tensor& shape_of, at::Tensor& result, std::optional<at::Generator> gen,
                 const F& f) {
  ZeroCopy zc;
  Output out(zc, result);
  const int64_t numel = out.buf.numel();
  uint64_t seed, offset;  // (not a structured binding: C++17 lambdas cannot capture one)
  std::tie(seed, offset) = reserve_philox(gen, index_of(shape_of), static_cast<uint64_t>(numel)).get();
  zc.launch(name);
  scalar_t* base = out.buf.data_ptr<scalar_t>();
  at::parallel_for(0, numel, 2048, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      ElementStream s{seed, offset + static_cast<uint64_t>(i)};
      base[i] = f(s, i);
    }
  });
  out.finish();
}

template <typename scalar_t>
scalar_t gamma_one(ElementStream& s, scalar_t alpha) {
  auto uniform = [&s] { return s.uniform(); };
  auto normal = [&s] { return s.normal(); };
  BaseSampler<double, decltype(uniform)> standard_uniform(uniform);
  BaseSampler<double, decltype(normal)> standard_normal(normal);
  return sample_gamma<scalar_t, double, decltype(uniform), decltype(normal)>(alpha, standard_uniform,
                                                                                         standard_normal);
}

at::Tensor standard_gamma(const at::Tensor& alpha, std::optional<at::Generator> gen) {
  at::Tensor result = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  ZeroCopy az;
  at::Tensor a = az.in(alpha).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "_standard_gamma", [&] {
    const scalar_t* ap = a.data_ptr<scalar_t>();
    per_element<scalar_t>("aten::_standard_gamma", alpha, result, gen, [=](ElementStream& s, int64_t i) {
      const scalar_t sample = gamma_one<scalar_t>(s, ap[i]);
      return std::max(std::numeric_limits<scalar_t>::min(), sample);
    });
  });
  return result;
}

at::Tensor sample_dirichlet(const at::Tensor& alpha, std::optional<at::Generator> gen) {
  at::Tensor gamma = at::empty(alpha.sizes(), alpha.options().dtype(at::kDouble));
  ZeroCopy az;
  at::Tensor a = az.in(alpha).to(at::kDouble).contiguous();
  const double* ap = a.data_ptr<double>();
  per_element<double>("aten::_sample_dirichlet", alpha, gamma, gen, [=](ElementStream& s, int64_t i) {
    return std::max(std::numeric_limits<double>::min(), gamma_one<double>(s, ap[i]));
  });
  // Normalise along the last dimension, clamped into (0, 1) as CPU does.
  at::Tensor ratio = gamma / gamma.sum(-1, true);
  at::Tensor result = at::empty_like(alpha, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, alpha.scalar_type(), "_sample_dirichlet", [&] {
    const double lo = static_cast<double>(std::numeric_limits<scalar_t>::min());
    // the largest value below 1 (nexttoward(1, 0) in scalar_t)
    const double hi = 1.0 - static_cast<double>(std::numeric_limits<scalar_t>::epsilon()) / 2;
    result.copy_(ratio.clamp(lo, hi));
  });
  return result;
}

// Poisson: multiplication of uniforms below rate 10, Hoermann's PTRS transformed rejection above.
double poisson_one(ElementStream& s, double lambda) {
  if (lambda >= 10) {
    const double slam = std::sqrt(lambda), loglam = std::log(lambda);
    const double b = 0.931 + 2.53 * slam, a = -0.059 + 0.02483 * b;
    const double invalpha = 1.1239 + 1.1328 / (b - 3.4), vr = 0.9277 - 3.6224 / (b - 2);
    while (true) {
      const double u = s.uniform() - 0.5, v = s.uniform();
      const double us = 0.5 - std::fabs(u);
      const double k = std::floor((2 * a / us + b) * u + lambda + 0.43);
      if (us >= 0.07 && v <= vr) return k;
      if (k < 0 || (us < 0.013 && v > us)) continue;
      if (std::log(v) + std::log(invalpha) - std::log(a / (us * us) + b) <= -lambda + k * loglam - std::lgamma(k + 1)) {
        return k;
      }
    }
  }
  if (lambda == 0) return 0;
  const double enlam = std::exp(-lambda);
  double x = 0, prod = 1.0;
  while (true) {
    prod *= s.uniform();
    if (prod > enlam) x += 1;
    else return x;
  }
}

at::Tensor poisson(const at::Tensor& rates, std::optional<at::Generator> gen) {
  at::Tensor result = at::empty_like(rates, at::MemoryFormat::Contiguous);
  ZeroCopy rz;
  at::Tensor r = rz.in(rates).to(at::kDouble).contiguous();
  const double* rp = r.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rates.scalar_type(), "poisson", [&] {
    per_element<scalar_t>("aten::poisson", rates, result, gen, [=](ElementStream& s, int64_t i) {
      TORCH_CHECK(rp[i] >= 0, "invalid Poisson rate, expected rate to be non-negative");
      return static_cast<scalar_t>(poisson_one(s, rp[i]));
    });
  });
  return result;
}

at::Tensor binomial(const at::Tensor& count, const at::Tensor& prob, std::optional<at::Generator> gen) {
  at::Tensor result = at::empty_like(count, at::MemoryFormat::Contiguous);
  ZeroCopy bz;
  at::Tensor c = bz.in(count).contiguous();
  at::Tensor p = bz.in(prob).expand(count.sizes()).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, count.scalar_type(), "binomial", [&] {
    const scalar_t* cp = c.data_ptr<scalar_t>();
    at::Tensor pc = p.to(count.scalar_type());
    const scalar_t* pp = pc.data_ptr<scalar_t>();
    per_element<scalar_t>("aten::binomial", count, result, gen, [=](ElementStream& s, int64_t i) {
      auto uniform = [&s] { return s.uniform(); };
      BaseSampler<double, decltype(uniform)> standard_uniform(uniform);
      return sample_binomial<scalar_t, double, decltype(uniform)>(cp[i], pp[i], standard_uniform);
    });
  });
  return result;
}

}  // namespace
}  // namespace torchneuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(multinomial_with_replacement_stub, &torchneuron::multinomial_with_replacement)
}

// Every ATen op with a CPU random kernel (tests/device/test_random.py checks the list against the
// dispatcher): none reaches the boxed fallback, which refuses generator arguments.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace torchneuron;
  m.impl("uniform_", TORCH_FN(uniform_));
  m.impl("normal_", TORCH_FN(normal_));
  m.impl("normal.Tensor_float", TORCH_FN(normal_tf));
  m.impl("normal.float_Tensor", TORCH_FN(normal_ft));
  m.impl("normal.Tensor_Tensor", TORCH_FN(normal_tt));
  m.impl("normal.Tensor_float_out", TORCH_FN(normal_tf_out));
  m.impl("normal.float_Tensor_out", TORCH_FN(normal_ft_out));
  m.impl("normal.Tensor_Tensor_out", TORCH_FN(normal_tt_out));
  m.impl("log_normal_", TORCH_FN(log_normal_));
  m.impl("exponential_", TORCH_FN(exponential_));
  m.impl("cauchy_", TORCH_FN(cauchy_));
  m.impl("geometric_", TORCH_FN(geometric_));
  m.impl("random_", TORCH_FN(random_));
  m.impl("random_.from", TORCH_FN(random_from));
  m.impl("random_.to", TORCH_FN(random_to));
  m.impl("bernoulli_.float", TORCH_FN(bernoulli_float));
  m.impl("bernoulli_.Tensor", TORCH_FN(bernoulli_tensor));
  m.impl("bernoulli.out", TORCH_FN(bernoulli_out));
  m.impl("native_dropout", TORCH_FN(native_dropout));
  m.impl("native_dropout_backward", TORCH_FN(native_dropout_backward));
  m.impl("rrelu_with_noise", TORCH_FN(rrelu_with_noise));
  m.impl("rrelu_with_noise.out", TORCH_FN(rrelu_with_noise_out));
  m.impl("rrelu_with_noise_", TORCH_FN(rrelu_with_noise_));
  m.impl("randperm.generator_out", TORCH_FN(randperm_out));
  m.impl("multinomial", TORCH_FN(at::native::multinomial));
  m.impl("multinomial.out", TORCH_FN(at::native::multinomial_out));
  m.impl("_standard_gamma", TORCH_FN(standard_gamma));
  m.impl("_sample_dirichlet", TORCH_FN(sample_dirichlet));
  m.impl("poisson", TORCH_FN(poisson));
  m.impl("binomial", TORCH_FN(binomial));
}
