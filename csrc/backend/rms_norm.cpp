#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// RMSNorm as one kernel: `_fused_rms_norm` and `_fused_rms_norm_backward`, which `F.rms_norm` and
// `nn.RMSNorm` reach on every device but MPS (ATen's rms_norm calls `_fused_rms_norm` after its
// checks; CUDA and Trainium's TorchNeuron register kernels for it). Without a kernel the op runs its
// composite: upcast, pow, mean, add, rsqrt, two muls and a cast forward and about twenty ops
// backward, each a pass over the activations: 4096 x 1024 bf16, forward and backward, 15.5 ms
// on neuron (23.5 ms on CPU) against 2.5 ms for layer norm.
//
// The kernels compute what the composite does, in the composite's dtype (fp32 for fp16, bf16 and
// fp32; the fp64 path in double), per row of N normalized elements:
//   forward   r = 1 / sqrt(sum(x^2) / N + eps),  y = (x * r) * w, rounded once to x's dtype
//   backward  g = dy * w, s = sum((x * r) * g),  dx = (g - (x * r) * (s / N)) * r,
//             dw = sum over rows of dy * (x * r), each rounded once
// eps defaults to the computation dtype's epsilon, as the composite's. Row sums run in 16 fp32
// lanes (AVX-512) rather than ATen's cascade order, so results are those of CUDA's fused kernel
// in kind (fp32 accumulation, one rounding), within a unit in the last place of CPU's composite,
// not its bits. Rows are split over the intra-op threads; dw sums each run of rows into its
// own fp32 row and adds those rows in order (a fixed number of runs: the same bits with any
// thread count).
//
// The AVX-512 kernels take input, gradient and weight of one dtype (fp32, bf16, fp16), contiguous
// (other strides are copied first); fp64 takes a scalar loop of the same arithmetic. Anything
// else (a weight of another dtype, channels-last, complex, a host without AVX-512) runs the
// composite forward (`compositeimplicitautograd::_fused_rms_norm`) and the decomposition's
// backward in ATen ops.
#include <ATen/core/Tensor.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/native/layer_norm.h>
#include <ATen/ops/_fused_rms_norm_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sum.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "enqueue.h"
#include "half_vec.h"
#include "zero_copy.h"

namespace torchneuron::rmsnorm_detail {

constexpr char kFwd[] = "aten::_fused_rms_norm";
constexpr char kBwd[] = "aten::_fused_rms_norm_backward";

// ---- AVX-512 rows (fp32, bf16, fp16 storage; fp32 arithmetic) --------------------------------
using half_vec::Dt;
using half_vec::load;
using half_vec::store;

__attribute__((target("avx512f,avx512bw"))) void forward_rows(const void* x, const void* w, void* y, float* rstd,
                                                              int64_t begin, int64_t end, int64_t n, float eps,
                                                              Dt dt) {
  const int64_t es = dt == Dt::kF32 ? 4 : 2;
  for (int64_t row = begin; row < end; ++row) {
    const char* xr = static_cast<const char*>(x) + row * n * es;
    char* yr = static_cast<char*>(y) + row * n * es;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = load(xr, i, half_vec::lanes(i, n), dt);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps);
    rstd[row] = r;
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = half_vec::lanes(i, n);
      __m512 v = _mm512_mul_ps(load(xr, i, m, dt), rv);
      if (w != nullptr) v = _mm512_mul_ps(v, load(w, i, m, dt));
      store(yr, i, m, v, dt);
    }
  }
}

// dx for rows [begin, end) (when dx is not null) and this range's dw partial sums (when dwacc is
// not null; fp32, n values, added to).
__attribute__((target("avx512f,avx512bw"))) void backward_rows(const void* dy, const void* x, const float* rstd,
                                                               const void* w, void* dx, float* dwacc,
                                                               int64_t begin, int64_t end, int64_t n, Dt dt) {
  const int64_t es = dt == Dt::kF32 ? 4 : 2;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t row = begin; row < end; ++row) {
    const char* xr = static_cast<const char*>(x) + row * n * es;
    const char* gr = static_cast<const char*>(dy) + row * n * es;
    const __m512 rv = _mm512_set1_ps(rstd[row]);
    if (dx != nullptr) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = half_vec::lanes(i, n);
        __m512 g = load(gr, i, m, dt);
        if (w != nullptr) g = _mm512_mul_ps(g, load(w, i, m, dt));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(load(xr, i, m, dt), rv), g, acc);
      }
      const __m512 sv = _mm512_set1_ps(_mm512_reduce_add_ps(acc) * inv_n);
      char* dr = static_cast<char*>(dx) + row * n * es;
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = half_vec::lanes(i, n);
        __m512 g = load(gr, i, m, dt);
        if (w != nullptr) g = _mm512_mul_ps(g, load(w, i, m, dt));
        const __m512 xhat = _mm512_mul_ps(load(xr, i, m, dt), rv);
        store(dr, i, m, _mm512_mul_ps(_mm512_fnmadd_ps(xhat, sv, g), rv), dt);
      }
    }
    if (dwacc != nullptr) {
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = half_vec::lanes(i, n);
        const __m512 xhat = _mm512_mul_ps(load(xr, i, m, dt), rv);
        const __m512 a = _mm512_maskz_loadu_ps(m, dwacc + i);
        _mm512_mask_storeu_ps(dwacc + i, m, _mm512_fmadd_ps(load(gr, i, m, dt), xhat, a));
      }
    }
  }
}

// ---- fp64: the same arithmetic in double ------------------------------------------------------
void forward_rows_f64(const double* x, const double* w, double* y, double* rstd, int64_t begin, int64_t end,
                      int64_t n, double eps) {
  for (int64_t row = begin; row < end; ++row) {
    const double* xr = x + row * n;
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += xr[i] * xr[i];
    const double r = 1.0 / std::sqrt(s / static_cast<double>(n) + eps);
    rstd[row] = r;
    for (int64_t i = 0; i < n; ++i) y[row * n + i] = w != nullptr ? (xr[i] * r) * w[i] : xr[i] * r;
  }
}

void backward_rows_f64(const double* dy, const double* x, const double* rstd, const double* w, double* dx,
                       double* dwacc, int64_t begin, int64_t end, int64_t n) {
  for (int64_t row = begin; row < end; ++row) {
    const double *xr = x + row * n, *gr = dy + row * n, r = rstd[row];
    if (dx != nullptr) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += (xr[i] * r) * (w != nullptr ? gr[i] * w[i] : gr[i]);
      s /= static_cast<double>(n);
      for (int64_t i = 0; i < n; ++i) {
        const double g = w != nullptr ? gr[i] * w[i] : gr[i];
        dx[row * n + i] = (g - (xr[i] * r) * s) * r;
      }
    }
    if (dwacc != nullptr) {
      for (int64_t i = 0; i < n; ++i) dwacc[i] += gr[i] * (xr[i] * r);
    }
  }
}

// ---- dispatch -----------------------------------------------------------------------------------
// An optional weight (a queued kernel's capture too), or null when there is none.
const at::Tensor* defined(const std::optional<at::Tensor>& w) { return w.has_value() && w->defined() ? &*w : nullptr; }

// Whether the kernels take these tensors (after contiguous copies where needed): neuron tensors
// of one floating dtype they handle (a weight, if any, of the same dtype), the AVX-512 rows
// available where the dtype needs them, not channels-last (whose composite result keeps that
// layout), something to normalize.
bool direct(const at::Tensor& input, const std::optional<at::Tensor>& weight) {
  const auto dt = input.scalar_type();
  const bool vec = dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf;
  const auto format = input.suggest_memory_format();
  if (!(vec || dt == at::kDouble) || (vec && !cpu_features::avx512bw()) || !queueable_like(input, input) ||
      format == at::MemoryFormat::ChannelsLast || format == at::MemoryFormat::ChannelsLast3d || input.numel() == 0) {
    return false;
  }
  return defined(weight) == nullptr || queueable_like(input, *weight);
}

// The rows per task: about 64 KiB of input each, at least one row.
int64_t grain(int64_t n, int64_t element_size) { return std::max<int64_t>(1, 65536 / (n * element_size)); }

// y, rstd (CPU aliases) from x, w (null: none) over m rows of n.
void forward_kernel(const at::Tensor& y, const at::Tensor& rstd, const at::Tensor& x, const at::Tensor* w,
                    int64_t m, int64_t n, double eps) {
  const void* wp = w != nullptr ? w->const_data_ptr() : nullptr;
  if (x.scalar_type() == at::kDouble) {
    at::parallel_for(0, m, grain(n, 8), [&](int64_t b, int64_t e) {
      forward_rows_f64(x.const_data_ptr<double>(), static_cast<const double*>(wp), y.data_ptr<double>(),
                       rstd.data_ptr<double>(), b, e, n, eps);
    });
    return;
  }
  const Dt dt = half_vec::dt_of(x.scalar_type());
  at::parallel_for(0, m, grain(n, x.element_size()), [&](int64_t b, int64_t e) {
    forward_rows(x.const_data_ptr(), wp, y.data_ptr(), rstd.data_ptr<float>(), b, e, n, static_cast<float>(eps), dt);
  });
}

// dx, dw (CPU aliases; undefined: not asked for) from dy, x, rstd, w over m rows of n. The rows
// are cut into at most kChunks runs whatever the thread count, each with its own fp32 (fp64) row
// of dw partial sums, added in run order: dw's bits do not depend on the threads.
constexpr int64_t kChunks = 16;
void backward_kernel(const at::Tensor& dx, const at::Tensor& dw, const at::Tensor& dy, const at::Tensor& x,
                     const at::Tensor& rstd, const at::Tensor* w, int64_t m, int64_t n) {
  const bool f64 = x.scalar_type() == at::kDouble;
  const void* wp = w != nullptr ? w->const_data_ptr() : nullptr;
  void* dxp = dx.defined() ? dx.data_ptr() : nullptr;
  const int64_t chunks = std::min(m, kChunks), rows = (m + chunks - 1) / chunks;
  const int64_t parts = dw.defined() ? chunks : 0;
  std::vector<float> part32(f64 ? 0 : parts * n, 0.0f);
  std::vector<double> part64(f64 ? parts * n : 0, 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
    for (int64_t k = cb; k < ce; ++k) {
      const int64_t b = k * rows, e = std::min(m, b + rows);
      if (b >= e) continue;
      if (f64) {
        backward_rows_f64(dy.const_data_ptr<double>(), x.const_data_ptr<double>(), rstd.const_data_ptr<double>(),
                          static_cast<const double*>(wp), static_cast<double*>(dxp),
                          parts > 0 ? part64.data() + k * n : nullptr, b, e, n);
      } else {
        backward_rows(dy.const_data_ptr(), x.const_data_ptr(), rstd.const_data_ptr<float>(), wp, dxp,
                      parts > 0 ? part32.data() + k * n : nullptr, b, e, n, half_vec::dt_of(x.scalar_type()));
      }
    }
  });
  if (!dw.defined()) return;
  const auto opts = at::TensorOptions().dtype(f64 ? at::kDouble : at::kFloat);
  const at::Tensor partial = f64 ? at::from_blob(part64.data(), {parts, n}, opts)
                                 : at::from_blob(part32.data(), {parts, n}, opts);
  at::Tensor(dw).view({n}).copy_(partial.sum(0));  // the one rounding to the weight's dtype
}

std::pair<int64_t, int64_t> rows_cols(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                      const std::optional<at::Tensor>& weight) {
  at::native::_check_rms_norm_inputs_symint(input, c10::fromIntArrayRefSlow(normalized_shape),
                                            defined(weight) != nullptr ? *weight : at::Tensor());
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  int64_t m = 1, n = 1;
  for (const auto i : c10::irange(input.dim())) (i < axis ? m : n) *= input.size(i);
  return {m, n};
}

std::vector<int64_t> stat_shape(const at::Tensor& input, size_t normalized_ndim) {
  std::vector<int64_t> s(input.sizes().begin(), input.sizes().end() - static_cast<int64_t>(normalized_ndim));
  s.resize(input.dim(), 1);
  return s;
}

double eps_or_default(std::optional<double> eps, at::ScalarType t) {
  if (eps.has_value()) return *eps;
  return t == at::kDouble ? std::numeric_limits<double>::epsilon() : std::numeric_limits<float>::epsilon();
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                  const std::optional<at::Tensor>& weight,
                                                  std::optional<double> eps) {
  if (!direct(input, weight)) {
    return at::compositeimplicitautograd::_fused_rms_norm(input, normalized_shape, weight, eps);
  }
  const auto [m, n] = rows_cols(input, normalized_shape, weight);
  if (!input.is_contiguous() || (defined(weight) != nullptr && !weight->is_contiguous())) {
    // one copy each (queued like any op), then the kernel: far cheaper than the composite's passes
    std::optional<at::Tensor> wc;
    if (defined(weight) != nullptr) wc = weight->contiguous();
    return fused_rms_norm(input.contiguous(), normalized_shape, wc, eps);
  }
  const double e = eps_or_default(eps, input.scalar_type());
  const auto stat = stat_shape(input, normalized_shape.size());
  const bool w = defined(weight) != nullptr;
  if (may_enqueue()) {
    QueuedCall q;
    at::Tensor x = q.in(input), y, rstd;
    std::optional<at::Tensor> wa = q.in(weight);
    at::Tensor yo = q.out(y, x.sizes(), x.scalar_type()), ro = q.out(rstd, stat, at::toOpMathType(x.scalar_type()));
    q.enqueue(kFwd, [x, wa, yo, ro, m = m, n = n, e] { forward_kernel(yo, ro, x, defined(wa), m, n, e); });
    return {y, rstd};
  }
  ZeroCopy zc;
  at::Tensor x = zc.in(input), wa = w ? zc.in(*weight) : at::Tensor();
  zc.launch(kFwd);
  at::Tensor y = pooled(zc, x.sizes(), x.scalar_type()), rstd = pooled(zc, stat, at::toOpMathType(x.scalar_type()));
  forward_kernel(zc.in_output(y), zc.in_output(rstd), x, w ? &wa : nullptr, m, n, e);
  return {y, rstd};
}

// The decomposition's backward in ATen ops on the device (torch/_decomp: _fused_rms_norm_backward),
// for what the kernels do not take.
std::tuple<at::Tensor, at::Tensor> backward_composite(const at::Tensor& grad_out, const at::Tensor& input,
                                                      at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                      const std::optional<at::Tensor>& weight,
                                                      std::array<bool, 2> mask) {
  (void)rows_cols(input, normalized_shape, weight);
  TORCH_CHECK(!input.is_complex(), "_fused_rms_norm_backward: complex inputs are not supported on neuron (nor "
              "on CUDA); normalize the real and imaginary parts, or run rms_norm on the CPU");
  const auto ct = at::toOpMathType(input.scalar_type());
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  std::vector<int64_t> inner, outer;
  for (const auto i : c10::irange(input.dim())) (i < axis ? outer : inner).push_back(i);
  const at::Tensor g = grad_out.to(ct).contiguous(), x = input.to(ct).contiguous();
  const bool w = defined(weight) != nullptr;
  const at::Tensor gx = w ? g.mul(weight->to(ct)) : g;
  const at::Tensor r = rstd.reshape(stat_shape(input, normalized_shape.size()));
  const at::Tensor xhat = x.mul(r);
  at::Tensor dx, dw;
  if (mask[0]) {
    int64_t n = 1;
    for (const auto i : inner) n *= input.size(i);
    const at::Tensor s = xhat.mul(gx).sum(inner, /*keepdim=*/true);
    dx = gx.sub(xhat.div(static_cast<double>(n)).mul(s)).mul(r).to(input.scalar_type());
  }
  if (mask[1] && w) {
    const at::Tensor full = g.mul(xhat);
    dw = (outer.empty() ? full : full.sum(outer)).to(input.scalar_type());
  }
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor> fused_rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& input,
                                                           at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                           const std::optional<at::Tensor>& weight,
                                                           std::array<bool, 2> mask) {
  const bool w = defined(weight) != nullptr;
  const bool ok = direct(input, weight) && queueable_like(input, grad_out) && grad_out.sizes() == input.sizes() &&
                  rstd.is_privateuseone() && rstd.device() == input.device() &&
                  rstd.scalar_type() == at::toOpMathType(input.scalar_type());
  if (!ok) return backward_composite(grad_out, input, normalized_shape, rstd, weight, mask);
  const auto [m, n] = rows_cols(input, normalized_shape, weight);
  if (!grad_out.is_contiguous() || !input.is_contiguous() || !rstd.is_contiguous() ||
      (w && !weight->is_contiguous())) {
    // (y.sum().backward() passes an expanded gradient)
    std::optional<at::Tensor> wc;
    if (w) wc = weight->contiguous();
    return fused_rms_norm_backward(grad_out.contiguous(), input.contiguous(), normalized_shape, rstd.contiguous(), wc,
                                   mask);
  }
  TORCH_CHECK(rstd.numel() == m, "_fused_rms_norm_backward: rstd has ", rstd.numel(), " values for ", m,
              " rows; pass the rstd _fused_rms_norm returned for this input");
  const bool want_dw = mask[1] && w;
  if (may_enqueue()) {
    QueuedCall q;
    at::Tensor g = q.in(grad_out), x = q.in(input), r = q.in(rstd), dx, dw, dxo, dwo;
    std::optional<at::Tensor> wa = q.in(weight);
    if (mask[0]) dxo = q.out(dx, x.sizes(), x.scalar_type());
    if (want_dw) dwo = q.out(dw, weight->sizes(), x.scalar_type());
    q.enqueue(kBwd, [g, x, r, wa, dxo, dwo, m = m, n = n] {
      backward_kernel(dxo, dwo, g, x, r, defined(wa), m, n);
    });
    return {dx, dw};
  }
  ZeroCopy zc;
  at::Tensor g = zc.in(grad_out), x = zc.in(input), r = zc.in(rstd), wa = w ? zc.in(*weight) : at::Tensor();
  zc.launch(kBwd);
  at::Tensor dx, dw, dxo, dwo;
  if (mask[0]) dx = pooled(zc, x.sizes(), x.scalar_type()), dxo = zc.in_output(dx);
  if (want_dw) dw = pooled(zc, weight->sizes(), x.scalar_type()), dwo = zc.in_output(dw);
  backward_kernel(dxo, dwo, g, x, r, w ? &wa : nullptr, m, n);
  return {dx, dw};
}

}  // namespace torchneuron::rmsnorm_detail

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_rms_norm", TORCH_FN(torchneuron::rmsnorm_detail::fused_rms_norm));
  m.impl("_fused_rms_norm_backward", TORCH_FN(torchneuron::rmsnorm_detail::fused_rms_norm_backward));
}
