// Adaptive Eager's interpreted kernel (fusion_interpreter.h).
#include "fusion_interpreter.h"

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <c10/util/SmallVector.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_features.h"
#include "fusion.h"

#if AT_MKL_ENABLED()
// MKL's vector sqrt (LP64, exported by libtorch_cpu), called with ATen's mode (ATen/cpu/vml.h):
// its result per element does not depend on how the array is cut into calls (eager_fusion.py).
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode);
extern "C" int MKL_Set_Num_Threads_Local(int nt);
#endif

// Each formula's roundings are written out (an FMA where ATen's kernel has one, none elsewhere):
// the compiler must not contract a product and a sum into an FMA on its own. (Popped at the end:
// a unity build may compile other files after this one.)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace torchneuron::fusion_interpreter {
namespace {

using fusion::Kind;

constexpr long long kVmlMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
constexpr int64_t kGrain = 32768;  // TensorIterator's grain (at::internal::GRAIN_SIZE)
constexpr int64_t kPair = 32;      // two 16-float vectors: a multiple of ATen's pair at any width it runs
constexpr int64_t kTile = 512;     // elements per tile: 2 KB a slot, in the first-level cache

struct Op {
  Kind kind;
  uint8_t slot[4];  // out, then inputs
  const float* s;   // its Python numbers
};

// One op over n (a multiple of 16) elements: the vector formulas of eager_fusion.py's KINDS
// (ATen's float32 kernels), operands x0.. the op's inputs, s0.. its numbers.
__attribute__((target("avx512f"))) void vector_op(const Op& op, float* out, const float* const* in, int64_t n) {
  const float* x0 = in[0];
  const float* x1 = in[1];
  const float* x2 = in[2];
  const __m512 s0 = _mm512_set1_ps(op.s != nullptr ? op.s[0] : 0.f);
  switch (op.kind) {
    case fusion::kAdd:  // fmadd(x1, s0, x0): ufunc add's a + alpha * b
      for (int64_t i = 0; i < n; i += 16) {
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(_mm512_loadu_ps(x1 + i), s0, _mm512_loadu_ps(x0 + i)));
      }
      break;
    case fusion::kAddScalar: {  // fmadd(s0, s1, x0)
      const __m512 s1 = _mm512_set1_ps(op.s[1]);
      for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(out + i, _mm512_fmadd_ps(s0, s1, _mm512_loadu_ps(x0 + i)));
      break;
    }
    case fusion::kMul:
      for (int64_t i = 0; i < n; i += 16) {
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(x0 + i), _mm512_loadu_ps(x1 + i)));
      }
      break;
    case fusion::kMulScalar:
      for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(x0 + i), s0));
      break;
    case fusion::kDiv:
      for (int64_t i = 0; i < n; i += 16) {
        _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_loadu_ps(x0 + i), _mm512_loadu_ps(x1 + i)));
      }
      break;
    case fusion::kDivScalar:
      for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_loadu_ps(x0 + i), s0));
      break;
    case fusion::kAddcmul:  // fmadd(s0 * x1, x2, x0): ATen's build contracts its s*t1*t2 + self
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 p = _mm512_mul_ps(s0, _mm512_loadu_ps(x1 + i));
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(p, _mm512_loadu_ps(x2 + i), _mm512_loadu_ps(x0 + i)));
      }
      break;
    case fusion::kAddcdiv:  // x0 + s0 * x1 / x2
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 q = _mm512_div_ps(_mm512_mul_ps(s0, _mm512_loadu_ps(x1 + i)), _mm512_loadu_ps(x2 + i));
        _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(x0 + i), q));
      }
      break;
    case fusion::kLerpScalar: {
      // LerpKernel.cpp's lerp_vec with a uniform weight w: |w| < 0.5 (false for NaN) picks
      // fmadd(w, end - start, start), else fmadd(w - 1, end - start, end).
      const float w = op.s[0];
      const bool low = std::fabs(w) < 0.5f;
      const __m512 coeff = _mm512_set1_ps(low ? w : w - 1.f);
      for (int64_t i = 0; i < n; i += 16) {
        const __m512 start = _mm512_loadu_ps(x0 + i), end = _mm512_loadu_ps(x1 + i);
        _mm512_storeu_ps(out + i, _mm512_fmadd_ps(coeff, _mm512_sub_ps(end, start), low ? start : end));
      }
      break;
    }
    case fusion::kSqrt:
#if AT_MKL_ENABLED()
      vmsSqrt(static_cast<int>(n), x0, out, kVmlMode);
#endif
      break;
    default: break;  // (fusion.cpp sends no other kind)
  }
}

// The vector part [lo, vend) of one thread's range, tile by tile and op by op. A slot's tile is
// read from device memory until an op writes it; then it lives where that op wrote it: device
// memory for a stored slot, the thread's scratch tile for an unstored one.
void run_range(const c10::SmallVector<Op, 32>& ops, float* const* buffers, size_t nbufs, const std::vector<bool>& unstored,
               int64_t lo, int64_t vend, float* scratch) {
  const float* at[256];  // (a group has at most 255 slots: fusion.cpp, kMaxSlots)
  for (int64_t i0 = lo; i0 < vend; i0 += kTile) {
    const int64_t n = std::min(kTile, vend - i0);
    for (size_t b = 0; b < nbufs; ++b) at[b] = buffers[b] + i0;
    for (const Op& op : ops) {
      const uint8_t arity = fusion::kArity[op.kind];
      const float* in[3] = {nullptr, nullptr, nullptr};
      for (uint8_t j = 1; j < arity; ++j) in[j - 1] = at[op.slot[j]];
      const uint8_t o = op.slot[0];
      float* out = unstored[o] ? scratch + static_cast<size_t>(o) * kTile : buffers[o] + i0;
      vector_op(op, out, in, n);
      at[o] = out;
    }
  }
}

}  // namespace

bool available() noexcept {
  static const bool yes = [] {
    const std::string cap = at::get_cpu_capability();
    return AT_MKL_ENABLED() && cpu_features::avx512bw() && (cap == "AVX2" || cap == "AVX512");
  }();
  return yes;
}

void run(const std::string& signature, float* const* buffers, const float* scalars, int64_t numel,
         int64_t* remainders) {
  const size_t nbufs = static_cast<uint8_t>(signature[0]);
  c10::SmallVector<Op, 32> ops;
  bool sqrt = false;
  const size_t end = fusion::for_each_op(signature, scalars, [&](Kind kind, const uint8_t* slots, const float* s) {
    Op op{kind, {}, fusion::kScalars[kind] > 0 ? s : nullptr};
    std::copy(slots, slots + fusion::kArity[kind], op.slot);
    sqrt = sqrt || kind == fusion::kSqrt;
    ops.push_back(op);
  });
  std::vector<bool> unstored(nbufs, false);
  for (size_t at = end + 1; at < signature.size(); ++at) unstored[static_cast<uint8_t>(signature[at])] = true;
  at::parallel_for(0, numel, kGrain, [&](int64_t lo, int64_t hi) {
    // As ATen's vectorized_loop: whole pairs of vectors here, the remainder by ATen's kernels.
    const int64_t vend = lo + (hi - lo) / kPair * kPair;
    thread_local std::vector<float> scratch;
    if (scratch.size() < nbufs * kTile) scratch.resize(nbufs * kTile);
#if AT_MKL_ENABLED()
    // MKL would open an OpenMP team of its own for each tile's sqrt called outside a parallel
    // region (a range below the grain runs on the caller): one MKL thread instead.
    const int mkl_threads = sqrt ? MKL_Set_Num_Threads_Local(1) : 0;
#endif
    run_range(ops, buffers, nbufs, unstored, lo, vend, scratch.data());
#if AT_MKL_ENABLED()
    if (sqrt) MKL_Set_Num_Threads_Local(mkl_threads);
#endif
    const int t = at::get_thread_num();
    remainders[2 * t] = vend;
    remainders[2 * t + 1] = hi;
  });
}

}  // namespace torchneuron::fusion_interpreter

#pragma GCC pop_options
