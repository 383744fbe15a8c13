#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// GELU's tanh approximation (`F.gelu(x, approximate="tanh")`: Gemma, and HF's
// "gelu_pytorch_tanh") with SLEEF's 3.5-ULP tanh. CPU's kernel evaluates the same formula with
// SLEEF's 1-ULP tanh, which runs double-float arithmetic: 4096 x 1024 fp32 took 3.4 ms forward
// on CPU against 0.8 ms for the exact (erf) GELU through oneDNN. Compiled kernels already take the
// 3.5-ULP routine (compile/inductor.py, TORCHNEURON_COMPILE_FAST_TANH); this is the same choice
// for eager ops. The arithmetic is ATen's, operation for operation (GeluKernel /
// GeluBackwardKernel's tanh branches, fp32 for bf16/fp16, rounded once), so results differ from
// CPU's only where tanh does (a few ulps of tanh). TORCHNEURON_FAST_TANH_GELU=0 restores CPU's
// kernel and its bits.
#include "gelu_tanh.h"

#include <ATen/Parallel.h>

#include <cstdlib>
#include <string>

#include "cpu_features.h"
#include "half_vec.h"

// libtorch_cpu exports SLEEF's AVX-512 routines (ATen's and Inductor's vectorized math call
// them); sleef.h declares them only when the whole file is compiled for AVX-512.
extern "C" __m512 Sleef_tanhf16_u35(__m512);

namespace torchneuron::gelu_tanh {
namespace {

using half_vec::Dt;
using half_vec::load;
using half_vec::store;

// ATen's constants: kBeta = sqrt(2) * (2 / sqrt(pi)) * 0.5, kKappa = 0.044715.
constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
constexpr float kKappa = 0.044715f;

__attribute__((target("avx512f,avx512bw"))) void forward_range(const void* a, void* o, int64_t b, int64_t e, Dt dt) {
  const __m512 beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa), half = _mm512_set1_ps(0.5f),
               one = _mm512_set1_ps(1.0f);
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = half_vec::lanes(i, e);
    const __m512 x = load(a, i, m, dt);
    const __m512 x_cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, x_cube)));
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, Sleef_tanhf16_u35(inner)));
    store(o, i, m, y, dt);
  }
}

__attribute__((target("avx512f,avx512bw"))) void backward_range(const void* g, const void* a, void* o, int64_t b,
                                                                int64_t e, Dt dt) {
  const __m512 beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa), half = _mm512_set1_ps(0.5f),
               one = _mm512_set1_ps(1.0f), three = _mm512_set1_ps(3.0f);
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = half_vec::lanes(i, e);
    const __m512 x = load(a, i, m, dt), dy = load(g, i, m, dt);
    const __m512 x_sq = _mm512_mul_ps(x, x);
    const __m512 x_cube = _mm512_mul_ps(x_sq, x);
    const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, x_cube)));
    const __m512 t = Sleef_tanhf16_u35(inner);
    const __m512 left = _mm512_mul_ps(half, x);
    const __m512 right = _mm512_add_ps(one, t);
    const __m512 left_derivative = _mm512_mul_ps(half, right);
    const __m512 right_derivative = _mm512_mul_ps(left, _mm512_sub_ps(one, _mm512_mul_ps(t, t)));
    const __m512 inner_derivative =
        _mm512_mul_ps(beta, _mm512_add_ps(one, _mm512_mul_ps(_mm512_mul_ps(three, kappa), x_sq)));
    const __m512 d = _mm512_add_ps(left_derivative, _mm512_mul_ps(right_derivative, inner_derivative));
    store(o, i, m, _mm512_mul_ps(dy, d), dt);
  }
}

// Elements per task: 32 Ki (CPU's TensorIterator grain).
constexpr int64_t kGrain = 32768;

}  // namespace

bool available(const at::Tensor& a, const at::Tensor* grad) {
  static const bool on = [] {
    const char* v = std::getenv("TORCHNEURON_FAST_TANH_GELU");
    return v == nullptr || std::string(v) != "0";
  }();
  const auto dt = a.scalar_type();
  return on && cpu_features::avx512bw() && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) &&
         a.is_contiguous() &&
         (grad == nullptr || (grad->scalar_type() == dt && grad->sizes() == a.sizes() && grad->is_contiguous()));
}

void forward(const at::Tensor& out, const at::Tensor& a) {
  const Dt dt = half_vec::dt_of(a.scalar_type());
  const void* src = a.const_data_ptr();
  void* dst = out.data_ptr();
  at::parallel_for(0, a.numel(), kGrain, [&](int64_t b, int64_t e) { forward_range(src, dst, b, e, dt); });
}

void backward(const at::Tensor& out, const at::Tensor& grad, const at::Tensor& a) {
  const Dt dt = half_vec::dt_of(a.scalar_type());
  const void *g = grad.const_data_ptr(), *src = a.const_data_ptr();
  void* dst = out.data_ptr();
  at::parallel_for(0, a.numel(), kGrain, [&](int64_t b, int64_t e) { backward_range(g, src, dst, b, e, dt); });
}

}  // namespace torchneuron::gelu_tanh
