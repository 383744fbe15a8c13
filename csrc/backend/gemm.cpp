// The GEMM family on neuron (mm, addmm, bmm, baddbmm and their out= forms, which matmul,
// linear, their backward and Inductor's extern calls reach; addmv/mv, dot; convolution and
// its backward), routed by dtype so every precision runs at the host's full speed with
// TensorE's numerics.
//
// TensorE multiplies exactly and accumulates in fp32 (PSUM); the result is rounded once to
// the output dtype. For fp32 and bf16 CPU's kernels already do that fast (MKL sgemm, oneDNN
// bf16 with fp32 accumulation), so those dtypes run CPU's kernels bit for bit. For fp16 this
// CPU (no AVX512-FP16, no AMX) has only slow kernels (a 1024^2 mm: 2 s against 5 ms in
// bf16), so fp16 operands are widened to fp32 (exact: an fp16 product has 22 significant
// bits), multiplied in fp32 and rounded once. Measured alternatives (docs/benchmarks.md):
// a bf16 split needs 3-4 bf16 GEMMs for the same exactness, slower than one fp32 GEMM at half
// bf16's rate; oneDNN fp16 kernels need AVX512-FP16. fp32 goes through oneDNN rather than
// MKL above a size threshold: MKL's sgemm on this AMD CPU is 2-5x slower than oneDNN's.
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/addmv_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/dot_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include "allocator.h"
#include "gemm.h"

// Exported by libtorch_cpu (TORCH_API) but its header is not installed: oneDNN's matmul on
// dense CPU tensors, result = alpha * mat1 @ mat2 + beta * result (fp32, bf16; 2-d or 3-d).
namespace at::native {
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2,
                             const at::Tensor& result, float beta, float alpha);
}

namespace torchneuron::gemm {

bool onednn_matmul_usable() {
  // ATen's mkldnn_matmul raises unless the CPU has these (mkldnn_bf16_device_check).
  static const bool isa = [] {
    auto caps = at::cpu::get_cpu_capabilities();
    auto has = [&](const char* k) {
      auto it = caps.find(k);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    return has("avx512_bw") && has("avx512_vl") && has("avx512_dq");
  }();
  return isa && at::globalContext().userEnabledMkldnn();
}

at::Tensor scratch(ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype,
                   c10::IntArrayRef strides) {
  c10::OptionalDeviceGuard guard;
  if (zc.device() >= 0) {
    guard.reset_device(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(zc.device())));
  }
  const auto keys = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  at::Tensor dev = strides.empty()
      ? at::detail::empty_generic(sizes, device_allocator(), keys, dtype, std::nullopt)
      : at::detail::empty_strided_generic(sizes, strides, device_allocator(), keys, dtype);
  return zc.in(dev);
}

at::Tensor upcast(ZeroCopy& zc, const at::Tensor& t) {
  at::Tensor out = t.is_non_overlapping_and_dense() ? scratch(zc, t.sizes(), at::kFloat, t.strides())
                                                    : scratch(zc, t.sizes(), at::kFloat);
  out.copy_(t);
  return out;
}

// Measured on the 2-core AMD host (fp32, 1-2 threads): oneDNN 10.5 us vs MKL 0.9 us at 8^3,
// 12.8 vs 6.0 us at 64^3, 26.9 vs 38.7 us at 128^3, 156 vs 521 us at 64x512x512; MKL wins
// matrix-vector (1x1024x1024: 56 vs 113 us).
bool prefer_onednn(int64_t m, int64_t n, int64_t k, int64_t batch) {
  return m > 1 && n > 1 && k > 0 && batch * m * n * k >= (int64_t{1} << 18);
}

void matmul_f32(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                float alpha) {
  const bool batched = a.dim() == 3;
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1), batch = batched ? a.size(0) : 1;
  if (onednn_matmul_usable() && prefer_onednn(m, n, k, batch)) {
    at::native::mkldnn_matmul(a, b, out, beta, alpha);
    return;
  }
  at::Tensor o = out;  // CPU kernels take the result by non-const reference
  if (batched) at::cpu::baddbmm_out(o, out, a, b, beta, alpha);
  else at::cpu::addmm_out(o, out, a, b, beta, alpha);
}

void matmul_bf16(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                 float alpha) {
  at::native::mkldnn_matmul(a, b, out, beta, alpha);
}

}  // namespace torchneuron::gemm

namespace torchneuron {
namespace {

using gemm::via_fp32;

at::Tensor pooled(const ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype) {
  c10::OptionalDeviceGuard guard;
  if (zc.device() >= 0) {
    guard.reset_device(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(zc.device())));
  }
  return at::detail::empty_generic(sizes, device_allocator(),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype,
                                   std::nullopt);
}

// fp16 operands of one product, well-formed (anything else takes CPU's kernel, which also
// raises CPU's error messages).
bool half_pair(const at::Tensor& a, const at::Tensor& b, int64_t dim) {
  return via_fp32(a) && via_fp32(b) && a.dim() == dim && b.dim() == dim &&
         a.size(-1) == b.size(-2) && (dim == 2 || a.size(0) == b.size(0));
}

// o (fp16, CPU alias) = round(alpha * a @ b + beta * self) with fp32 products and sums.
void half_product(ZeroCopy& zc, const at::Tensor& o, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor* self, float beta, float alpha) {
  at::Tensor acc = gemm::scratch(zc, o.sizes(), at::kFloat);
  if (self != nullptr && beta != 0.0f) acc.copy_(self->expand(o.sizes()));
  else beta = 0.0f;
  gemm::matmul_f32(gemm::upcast(zc, a), gemm::upcast(zc, b), acc, beta, alpha);
  at::Tensor(o).copy_(acc);  // the one rounding
}

// ---- mm / addmm / bmm / baddbmm: results from the device pool ------------------------------
// The functional CPU kernels allocate results with the host allocator (fresh pages for large
// results on every call); the device's caching allocator avoids that.
at::Tensor mm_hot(const at::Tensor& self, const at::Tensor& mat2) {
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2);
  zc.launch("aten::mm");
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != b.scalar_type()) return zc.out(at::cpu::mm(a, b));
  at::Tensor out = pooled(zc, {a.size(0), b.size(1)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (half_pair(a, b, 2)) half_product(zc, o, a, b, nullptr, 0.0f, 1.0f);
  else at::cpu::mm_out(o, a, b);
  zc.sync_inputs();
  return out;
}

at::Tensor addmm_hot(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(mat1), b = zc.in(mat2);
  zc.launch("aten::addmm");
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != b.scalar_type()) {
    return zc.out(at::cpu::addmm(s, a, b, beta, alpha));
  }
  at::Tensor out = pooled(zc, {a.size(0), b.size(1)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (half_pair(a, b, 2) && via_fp32(s) && at::is_expandable_to(s.sizes(), o.sizes())) {
    half_product(zc, o, a, b, &s, beta.toFloat(), alpha.toFloat());
  } else {
    at::cpu::addmm_out(o, s, a, b, beta, alpha);
  }
  zc.sync_inputs();
  return out;
}

at::Tensor bmm_hot(const at::Tensor& self, const at::Tensor& mat2) {
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2);
  zc.launch("aten::bmm");
  if (a.dim() != 3 || b.dim() != 3 || a.scalar_type() != b.scalar_type()) return zc.out(at::cpu::bmm(a, b));
  at::Tensor out = pooled(zc, {a.size(0), a.size(1), b.size(2)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (half_pair(a, b, 3)) half_product(zc, o, a, b, nullptr, 0.0f, 1.0f);
  else at::cpu::bmm_out(o, a, b);
  zc.sync_inputs();
  return out;
}

at::Tensor baddbmm_hot(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(batch1), b = zc.in(batch2);
  zc.launch("aten::baddbmm");
  if (a.dim() != 3 || b.dim() != 3 || a.scalar_type() != b.scalar_type()) {
    return zc.out(at::cpu::baddbmm(s, a, b, beta, alpha));
  }
  at::Tensor out = pooled(zc, {a.size(0), a.size(1), b.size(2)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (half_pair(a, b, 3) && via_fp32(s) && at::is_expandable_to(s.sizes(), o.sizes())) {
    half_product(zc, o, a, b, &s, beta.toFloat(), alpha.toFloat());
  } else {
    at::cpu::baddbmm_out(o, s, a, b, beta, alpha);
  }
  zc.sync_inputs();
  return out;
}

// out= forms (Inductor's extern kernels call these): fp16 computes the functional result and
// copies it into `out`; other dtypes run CPU's out= kernel on aliases, as the fallback would.
bool half_out(const at::Tensor& out) { return out.scalar_type() == at::kHalf; }

at::Tensor& copy_into(at::Tensor& out, const at::Tensor& r) {
  at::native::resize_output(out, r.sizes());
  out.copy_(r);
  return out;
}

at::Tensor& mm_out(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  if (half_out(out) && half_pair(self, mat2, 2)) return copy_into(out, mm_hot(self, mat2));
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2), o = zc.in_output(out);
  zc.launch("aten::mm.out");
  at::cpu::mm_out(o, a, b);
  zc.sync_inputs();
  return out;
}

at::Tensor& addmm_out(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  if (half_out(out) && half_pair(mat1, mat2, 2) && via_fp32(self)) {
    return copy_into(out, addmm_hot(self, mat1, mat2, beta, alpha));
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(mat1), b = zc.in(mat2), o = zc.in_output(out);
  zc.launch("aten::addmm.out");
  at::cpu::addmm_out(o, s, a, b, beta, alpha);
  zc.sync_inputs();
  return out;
}

at::Tensor& bmm_out(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  if (half_out(out) && half_pair(self, mat2, 3)) return copy_into(out, bmm_hot(self, mat2));
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2), o = zc.in_output(out);
  zc.launch("aten::bmm.out");
  at::cpu::bmm_out(o, a, b);
  zc.sync_inputs();
  return out;
}

at::Tensor& baddbmm_out(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                        const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  if (half_out(out) && half_pair(batch1, batch2, 3) && via_fp32(self)) {
    return copy_into(out, baddbmm_hot(self, batch1, batch2, beta, alpha));
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(batch1), b = zc.in(batch2), o = zc.in_output(out);
  zc.launch("aten::baddbmm.out");
  at::cpu::baddbmm_out(o, s, a, b, beta, alpha);
  zc.sync_inputs();
  return out;
}

// ---- matrix-vector and dot ----------------------------------------------------------------
// mv (CompositeExplicitAutograd) lands in addmv.out. fp16: fp32 gemv, one rounding.
at::Tensor& addmv_out(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  ZeroCopy zc;
  at::Tensor s = zc.in(self), m = zc.in(mat), v = zc.in(vec), o = zc.in_output(out);
  zc.launch("aten::addmv.out");
  const bool half = via_fp32(m) && via_fp32(v) && via_fp32(s) && half_out(o) && m.dim() == 2 &&
                    v.dim() == 1 && m.size(1) == v.size(0) && at::is_expandable_to(s.sizes(), {m.size(0)});
  if (!half) {
    at::cpu::addmv_out(o, s, m, v, beta, alpha);
    zc.sync_inputs();
    return out;
  }
  at::Tensor acc = gemm::scratch(zc, {m.size(0)}, at::kFloat);
  const bool use_self = beta.toFloat() != 0.0f;
  if (use_self) acc.copy_(s.expand({m.size(0)}));
  at::cpu::addmv_out(acc, acc, gemm::upcast(zc, m), gemm::upcast(zc, v), use_self ? beta : at::Scalar(0),
                     alpha);
  at::native::resize_output(o, {m.size(0)});
  o.copy_(acc);
  zc.sync_inputs();
  return out;
}

at::Tensor addmv_hot(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  at::Tensor out = at::empty({0}, mat.options().dtype(at::result_type(self, mat)));
  return addmv_out(self, mat, vec, beta, alpha, out);
}

at::Tensor dot_hot(const at::Tensor& self, const at::Tensor& other) {
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(other);
  zc.launch("aten::dot");
  if (via_fp32(a) && via_fp32(b) && a.dim() == 1 && b.dim() == 1 && a.numel() == b.numel()) {
    return zc.out(at::cpu::dot(gemm::upcast(zc, a), gemm::upcast(zc, b)).to(at::kHalf));
  }
  return zc.out(at::cpu::dot(a, b));
}

// ---- convolution ----------------------------------------------------------------------
// at::_convolution sends devices it does not know to the "overrideable" entry points; run the
// CPU convolution (which picks mkldnn/slow paths itself) over aliases of the device memory.
// fp16 (CPU: 135x bf16's time) runs oneDNN's fp32 convolution on exact fp32 copies.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                                    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                    bool transposed, c10::SymIntArrayRef output_padding,
                                    c10::SymInt groups) {
  ZeroCopy zc;
  at::Tensor in = zc.in(input), w = zc.in(weight);
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) b = zc.in(*bias);
  zc.launch("aten::convolution_overrideable");
  zc.trace_meta("transposed", transposed ? "true" : "false");
  zc.trace_meta("groups", std::to_string(groups.expect_int()));
  const bool half = via_fp32(in) && via_fp32(w) && (!b || via_fp32(*b));
  if (half) {
    in = gemm::upcast(zc, in);
    w = gemm::upcast(zc, w);
    if (b) b = gemm::upcast(zc, *b);
  }
  at::Tensor out = at::convolution_symint(in, w, b, stride, padding, dilation, transposed,
                                          output_padding, std::move(groups));
  // The meta function (what torch.compile plans with) predicts a contiguous result for this
  // backend; CPU's mkldnn path returns channels_last for channels_last inputs.
  if (half) return zc.out(out.to(at::kHalf, /*non_blocking=*/false, /*copy=*/false,
                                  at::MemoryFormat::Contiguous));
  return zc.out(out.is_contiguous() ? out : out.contiguous());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool transposed, c10::SymIntArrayRef output_padding, c10::SymInt groups,
    std::array<bool, 3> output_mask) {
  ZeroCopy zc;
  at::Tensor go = zc.in(grad_output), in = zc.in(input), w = zc.in(weight);
  std::vector<c10::SymInt> bias_sizes{grad_output.sym_size(1)};
  zc.launch("aten::convolution_backward_overrideable");
  zc.trace_meta("transposed", transposed ? "true" : "false");
  zc.trace_meta("groups", std::to_string(groups.expect_int()));
  const bool half = via_fp32(go) && via_fp32(in) && via_fp32(w);
  if (half) {
    go = gemm::upcast(zc, go);
    in = gemm::upcast(zc, in);
    w = gemm::upcast(zc, w);
  }
  auto grads = at::convolution_backward_symint(
      go, in, w,
      output_mask[2] ? at::OptionalSymIntArrayRef(bias_sizes) : at::OptionalSymIntArrayRef(std::nullopt),
      stride, padding, dilation, transposed, output_padding, std::move(groups), output_mask);
  auto back = [&](const at::Tensor& g) {
    if (!g.defined()) return g;
    return zc.out(half ? g.to(at::kHalf) : g);
  };
  return std::make_tuple(back(std::get<0>(grads)), back(std::get<1>(grads)), back(std::get<2>(grads)));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("mm", TORCH_FN(mm_hot));
  m.impl("addmm", TORCH_FN(addmm_hot));
  m.impl("bmm", TORCH_FN(bmm_hot));
  m.impl("baddbmm", TORCH_FN(baddbmm_hot));
  m.impl("mm.out", TORCH_FN(mm_out));
  m.impl("addmm.out", TORCH_FN(addmm_out));
  m.impl("bmm.out", TORCH_FN(bmm_out));
  m.impl("baddbmm.out", TORCH_FN(baddbmm_out));
  m.impl("addmv", TORCH_FN(addmv_hot));
  m.impl("addmv.out", TORCH_FN(addmv_out));
  m.impl("dot", TORCH_FN(dot_hot));
  m.impl("convolution_overrideable", TORCH_FN(convolution_overrideable));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_overrideable));
}

}  // namespace torchneuron
