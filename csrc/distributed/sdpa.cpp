// Scaled-dot-product attention for the neuron device: the "efficient attention" entry points.
//
// Why: on PrivateUse1, F.scaled_dot_product_attention decomposes into math ops unless the
// device answers the fused-kernel choice. Context parallelism (and DTensor's SDPA strategies)
// only handle the fused ops (flash / efficient / cudnn), and flash on a non-CUDA device routes
// to the CPU-only flash op, so we answer EFFICIENT and implement
// _scaled_dot_product_efficient_attention and its backward. Neuron memory is host memory: the
// kernels compute in float32 on zero-copy CPU aliases and write into neuron outputs. The
// log-sum-exp is returned unpadded, shape (B, H, L). Dropout is not supported (the choice
// function sends such calls to the math path instead).
#include <ATen/ATen.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace torchneuron_sdpa {

using at::Tensor;

Tensor host(const Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return t;
  c10::Storage storage = t.storage();
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [storage](void*) {},
                       t.options().device(at::kCPU));
}

// Copy a CPU result into a fresh tensor on `like`'s device (same dtype as `dtype`).
Tensor to_device(const Tensor& cpu, const Tensor& like, at::ScalarType dtype) {
  Tensor out = at::empty(cpu.sizes(), like.options().dtype(dtype));
  host(out).copy_(cpu);
  return out;
}

int64_t choose(const Tensor& q, const Tensor& k, const Tensor& v,
               const std::optional<Tensor>& mask, double dropout_p, bool is_causal,
               std::optional<double> scale, bool enable_gqa) {
  bool ok = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && dropout_p == 0.0 &&
            q.size(1) == k.size(1) && k.size(1) == v.size(1) &&  // no GQA head broadcast
            (!mask.has_value() || mask->is_floating_point()) &&  // additive bias only
            q.is_floating_point();
  return static_cast<int64_t>(ok ? at::SDPBackend::efficient_attention : at::SDPBackend::math);
}

// scores (B,H,L,S) in float32, with scale, additive bias and top-left causal mask applied.
Tensor scores(const Tensor& q, const Tensor& k, const std::optional<Tensor>& bias, bool causal,
              double scale) {
  Tensor s = at::matmul(host(q).to(at::kFloat), host(k).to(at::kFloat).transpose(-2, -1));
  s.mul_(scale);
  if (bias.has_value() && bias->defined()) s.add_(host(*bias).to(at::kFloat));
  if (causal) {
    int64_t L = s.size(-2), S = s.size(-1);
    Tensor keep = at::ones({L, S}, s.options().dtype(at::kBool)).tril();
    s.masked_fill_(keep.logical_not(), -std::numeric_limits<float>::infinity());
  }
  return s;
}

// exp(s - lse), with fully masked rows (lse = -inf) giving zeros instead of NaN.
Tensor probs(const Tensor& s, const Tensor& lse) {
  Tensor p = at::exp(s - lse.unsqueeze(-1));
  return at::nan_to_num(p, 0.0, 0.0, 0.0);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_fwd(
    const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& bias,
    bool compute_lse, double dropout_p, bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "neuron efficient attention: dropout is not supported");
  double sc = sdp::calculate_scale(q, scale).expect_float();
  Tensor s = scores(q, k, bias, is_causal, sc);
  Tensor lse = at::logsumexp(s, -1);  // (B,H,L)
  Tensor out = at::matmul(probs(s, lse), host(v).to(at::kFloat));
  Tensor seed = at::zeros({}, q.options().dtype(at::kLong));
  Tensor offset = at::zeros({}, q.options().dtype(at::kLong));
  Tensor lse_dev = compute_lse ? to_device(lse, q, at::kFloat)
                               : at::empty({0}, q.options().dtype(at::kFloat));
  return {to_device(out, q, q.scalar_type()), lse_dev, seed, offset};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& seed,
    const Tensor& offset, double dropout_p, std::array<bool, 4> mask, bool is_causal,
    std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "neuron efficient attention: dropout is not supported");
  double sc = sdp::calculate_scale(q, scale).expect_float();
  std::optional<Tensor> b = bias.defined() ? std::optional<Tensor>(bias) : std::nullopt;
  Tensor s = scores(q, k, b, is_causal, sc);
  Tensor l = lse.numel() ? host(lse).to(at::kFloat) : at::logsumexp(s, -1);
  Tensor p = probs(s, l);
  Tensor dout = host(grad_out).to(at::kFloat);
  Tensor qf = host(q).to(at::kFloat), kf = host(k).to(at::kFloat), vf = host(v).to(at::kFloat);
  // Softmax backward: dS = P * (dP - rowsum(dO * O)).
  Tensor dp = at::matmul(dout, vf.transpose(-2, -1));
  Tensor delta = (dout * host(out).to(at::kFloat)).sum(-1, true);
  Tensor ds = p * (dp - delta);
  Tensor gq, gk, gv, gb;
  if (mask[0]) gq = to_device(at::matmul(ds, kf).mul_(sc), q, q.scalar_type());
  if (mask[1]) gk = to_device(at::matmul(ds.transpose(-2, -1), qf).mul_(sc), k, k.scalar_type());
  if (mask[2]) gv = to_device(at::matmul(p.transpose(-2, -1), dout), v, v.scalar_type());
  if (mask[3] && bias.defined()) gb = to_device(at::sum_to(ds, bias.sizes()), bias, bias.scalar_type());
  return {gq, gk, gv, gb};
}

}  // namespace torchneuron_sdpa

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchneuron_sdpa::choose)
}

namespace torchneuron_sdpa {

// Registered from the module's init rather than a static TORCH_LIBRARY_IMPL: torch already has
// a (non-functional) PrivateUse1 entry for these ops, so registering prints c10's "Overriding a
// previously registered kernel" warning, and at static-init time nothing can filter it. Here
// that one expected warning is dropped and every other warning passes through.
namespace {
struct DropOverrideWarning : c10::WarningHandler {
  c10::WarningHandler* prev;
  explicit DropOverrideWarning(c10::WarningHandler* p) : prev(p) {}
  void process(const c10::Warning& w) override {
    if (w.msg().find("Overriding a previously registered kernel") == std::string::npos)
      prev->process(w);
  }
};
}  // namespace

void register_kernels() {
  static std::unique_ptr<torch::Library> lib;
  if (lib) return;
  DropOverrideWarning handler(c10::WarningUtils::get_warning_handler());
  c10::WarningUtils::WarningHandlerGuard guard(&handler);
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                         std::optional<c10::DispatchKey>(c10::DispatchKey::PrivateUse1),
                                         __FILE__, __LINE__);
  lib->impl("_scaled_dot_product_efficient_attention", TORCH_FN(efficient_fwd));
  lib->impl("_scaled_dot_product_efficient_attention_backward", TORCH_FN(efficient_bwd));
}

}  // namespace torchneuron_sdpa
