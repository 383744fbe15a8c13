// scaled_dot_product_attention on neuron.
//
// SDPA picks its kernel through a DispatchStub that PrivateUse1 must fill, else every call
// decomposes into the math path (different numerics from CPU, many small ops). Neuron asks
// CPU's own selection logic. Where CPU would take its flash kernel, neuron reports the
// "efficient attention" backend and implements that op with CPU's flash kernels: the numbers
// are CPU's, and the op is one DTensor knows how to shard (context parallelism).
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/library.h>

#include "zero_copy.h"

namespace torchneuron {
namespace {

std::optional<at::Tensor> alias_opt(ZeroCopy& zc, const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) return zc.in(*t);
  return std::nullopt;
}

// FakeTensors (tracing) and symbolic shapes have no bytes to alias.
bool opaque(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.is_meta() ||
         t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

int64_t neuron_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                          std::optional<double> scale, bool enable_gqa) {
  if (opaque(q) || opaque(k) || opaque(v) || (mask.has_value() && mask->defined() && opaque(*mask))) {
    // While tracing, decide from metadata what CPU's selection decides for ordinary inputs:
    // its flash kernel for 4-d float inputs without dropout.
    const auto dt = q.scalar_type();
    const bool flash = at::globalContext().userEnabledFlashSDP() && dropout_p == 0.0 && q.dim() == 4 &&
                       k.dim() == 4 && v.dim() == 4 && q.sym_size(1) == k.sym_size(1) &&
                       (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
    return static_cast<int64_t>(flash ? sdp::SDPBackend::efficient_attention : sdp::SDPBackend::math);
  }
  ZeroCopy zc;
  // CPU's selection looks at requires_grad (a trainable mask needs the math path); aliases are
  // fresh leaves, so carry the flag over.
  auto aliased = [&zc](const at::Tensor& t) {
    at::Tensor a = zc.in(t);
    if (t.requires_grad()) a.requires_grad_(true);
    return a;
  };
  std::optional<at::Tensor> m;
  if (mask.has_value() && mask->defined()) m = aliased(*mask);
  const int64_t cpu_choice = at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), aliased(q), aliased(k), aliased(v), m, dropout_p,
      is_causal, scale, enable_gqa);
  const bool same_heads = q.dim() < 3 || k.dim() < 3 || q.size(-3) == k.size(-3);
  if (cpu_choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention) && dropout_p == 0.0 &&
      same_heads) {
    return static_cast<int64_t>(sdp::SDPBackend::efficient_attention);
  }
  return cpu_choice;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_bias, bool compute_log_sumexp, double dropout_p,
    bool is_causal, std::optional<double> scale) {
  TORCH_CHECK(dropout_p == 0.0, "neuron's efficient attention supports dropout_p == 0 only; "
              "scaled_dot_product_attention picks another kernel when dropout is used");
  ZeroCopy zc;
  at::Tensor q = zc.in(query), k = zc.in(key), v = zc.in(value);
  auto bias = alias_opt(zc, attn_bias);
  track_hot("aten::_scaled_dot_product_efficient_attention");
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                     bias, scale);
  // Output laid out as the op's meta function says, (B, L, H, E) viewed as (B, H, L, E), so
  // compiled graphs see the strides they planned for. The logsumexp stays (B, H, L): context
  // parallelism merges it with the output row by row, which the meta's padding to a multiple
  // of 32 would break (the neuron compile backend does not lower this op; see compile.md).
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = v.size(3);
  at::Tensor res = at::empty({B, L, H, E}, out.options()).transpose(1, 2);
  res.copy_(out);
  at::Tensor lse_out = compute_log_sumexp ? lse : at::empty({B, H, 0}, lse.options());
  // No RNG is involved (no dropout): seed and offset are zeros, as 0-dim int64 like CUDA's.
  auto opts = at::TensorOptions().dtype(at::kLong).device(query.device());
  return {zc.out(res), zc.out(lse_out), at::zeros({}, opts), at::zeros({}, opts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& attn_bias, const at::Tensor& out,
    const at::Tensor& logsumexp, const at::Tensor& philox_seed, const at::Tensor& philox_offset,
    double dropout_p, std::array<bool, 4> grad_input_mask, bool is_causal,
    std::optional<double> scale) {
  TORCH_CHECK(!(grad_input_mask[3] && attn_bias.defined()),
              "neuron attention cannot differentiate with respect to attn_mask; detach the mask "
              "(masks are rarely trainable) or compute attention explicitly");
  ZeroCopy zc;
  at::Tensor go = zc.in(grad_out), q = zc.in(query), k = zc.in(key), v = zc.in(value);
  at::Tensor o = zc.in(out);
  at::Tensor lse = zc.in(logsumexp);
  std::optional<at::Tensor> bias;
  if (attn_bias.defined()) bias = zc.in(attn_bias);
  track_hot("aten::_scaled_dot_product_efficient_attention_backward");
  auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      go, q, k, v, o, lse, dropout_p, is_causal, bias, scale);
  return {zc.out(gq), zc.out(gk), zc.out(gv), at::Tensor()};
}

}  // namespace

}  // namespace torchneuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchneuron::neuron_sdp_choice)
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // The op form answers what the stub answers (SDPA itself calls the stub).
  m.impl("_fused_sdp_choice", TORCH_FN(torchneuron::neuron_sdp_choice));
  m.impl("_scaled_dot_product_efficient_attention", TORCH_FN(torchneuron::efficient_attention));
  m.impl("_scaled_dot_product_efficient_attention_backward",
         TORCH_FN(torchneuron::efficient_attention_backward));
}
