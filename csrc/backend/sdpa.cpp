#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// scaled_dot_product_attention on neuron.
//
// SDPA picks its kernel through a DispatchStub that PrivateUse1 must fill, else every call
// decomposes into the math path (different numerics from CPU, many small ops). Neuron asks
// CPU's own selection logic. Where CPU would take its flash kernel, neuron reports the
// "efficient attention" backend and implements that op with CPU's flash kernels: the numbers
// are CPU's, and the op is one DTensor knows how to shard (context parallelism).
//
// fp16 (and bf16 on hosts without AVX-512) runs CPU's fp32 flash kernel on exact fp32 copies
// and rounds the outputs once: TensorE accumulates in fp32 and such CPUs have no fast kernels
// for those dtypes (CPU's fp16 flash attention forward+backward took 4x its bf16 time; bf16 on
// an AVX2 host 4.5x fp32's). The compiled path's
// _scaled_dot_product_flash_attention_for_cpu (and backward) gets the same treatment.
#include "cpu_stub.h"  // before DispatchStub.h: CPU's flash attention stubs are called below
#include <ATen/native/DispatchStub.h>
#include <ATen/OpMathType.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_efficient_attention_backward.h>
#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_fused_sdp_choice_ops.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/library.h>

#include <cmath>

#include "enqueue.h"
#include "gemm.h"
#include "small_attention.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

std::optional<at::Tensor> alias_opt(ZeroCopy& zc, const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined()) return zc.in(*t);
  return std::nullopt;
}

// CPU's flash kernels on aliases; fp16 through exact fp32 copies, each output rounded once to
// fp16 in the layout CPU's fp16 kernel returns (the logsumexp is fp32 either way).
// Routed: fp16 everywhere; bf16 too on hosts without AVX-512, where CPU's bf16 flash
// backward is a scalar-GEMM path (4x8x256x64 causal fwd+bwd: 335 ms against 75 ms in fp32).
bool attention_routed(const at::Tensor& t) { return gemm::routed(t); }

bool half_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return attention_routed(q) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type();
}

at::Tensor round_to(const at::Tensor& t, c10::ScalarType dt) {
  at::Tensor r = at::empty_like(t, t.options().dtype(dt));
  r.copy_(t);
  return r;
}

// The arena bytes of these tensors' exact fp32 copies (and a routed mask's).
int64_t copies_bytes(std::initializer_list<at::Tensor> ts, const std::optional<at::Tensor>& mask) {
  int64_t bytes = 0;
  for (const at::Tensor& t : ts) bytes += gemm::arena_bytes(t.numel());
  if (mask.has_value() && mask->defined() && attention_routed(*mask)) bytes += gemm::arena_bytes(mask->numel());
  return bytes;
}

std::optional<at::Tensor> upcast_opt(ZeroCopy& zc, const std::optional<at::Tensor>& t) {
  if (t.has_value() && t->defined() && attention_routed(*t)) return gemm::upcast(zc, *t);
  return t;
}

// SDPA's scale: the given one, else 1 / sqrt(E) (sdp::calculate_scale).
double scale_of(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

// fp32 attention of short sequences (and the exact fp32 copies of routed dtypes) runs
// small_attention.h's kernel where it is faster than CPU's flash kernel (0.35-0.8x its time).
bool small(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double dropout_p,
           const std::optional<at::Tensor>& mask, bool is_causal) {
  return dropout_p == 0.0 && small_attention::applies(q, k, v, mask, is_causal);
}

// The backward's kernel also needs fp32 grad_out and out (it reads them as fp32 rows).
bool small_backward(const at::Tensor& go, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& o, double dropout_p, const std::optional<at::Tensor>& mask, bool is_causal) {
  return small(q, k, v, dropout_p, mask, is_causal) && go.scalar_type() == at::kFloat && o.scalar_type() == at::kFloat;
}

// CPU's flash op, or small_attention's kernel with its results laid out as the op lays them out:
// the output like q (empty_like), the logsumexp (B, L, H) viewed (B, H, L).
std::tuple<at::Tensor, at::Tensor> host_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double dropout_p, bool is_causal,
                                                const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  if (small(q, k, v, dropout_p, mask, is_causal)) {
    at::Tensor out = at::empty_like(q);
    if (out.stride(3) == 1) {
      at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options()).transpose(1, 2);
      small_attention::forward(out, lse, q, k, v, mask, is_causal, scale_of(q, scale));
      return {out, lse};
    }
  }
  return at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, mask, scale);
}

// Likewise for the backward: the gradients (B, L, H, E) viewed (B, H, L, E).
std::tuple<at::Tensor, at::Tensor, at::Tensor> host_backward(
    const at::Tensor& go, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, double dropout_p, bool is_causal, const std::optional<at::Tensor>& mask,
    std::optional<double> scale) {
  if (small_backward(go, q, k, v, o, dropout_p, mask, is_causal)) {
    auto bhle = [](const at::Tensor& t) {
      return at::empty({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options()).transpose(1, 2);
    };
    at::Tensor gq = bhle(q), gk = bhle(k), gv = bhle(v);
    small_attention::backward(gq, gk, gv, go, q, k, v, o, lse, mask, is_causal, scale_of(q, scale));
    return {gq, gk, gv};
  }
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(go, q, k, v, o, lse, dropout_p, is_causal, mask,
                                                                  scale);
}

std::tuple<at::Tensor, at::Tensor> flash_forward(ZeroCopy& zc, const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, double dropout_p, bool is_causal,
                                                 const std::optional<at::Tensor>& mask,
                                                 std::optional<double> scale) {
  if (!half_attention(q, k, v)) return host_forward(q, k, v, dropout_p, is_causal, mask, scale);
  auto [out, lse] = host_forward(gemm::upcast(zc, q), gemm::upcast(zc, k), gemm::upcast(zc, v), dropout_p,
                                 is_causal, upcast_opt(zc, mask), scale);
  return {round_to(out, q.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_backward(
    ZeroCopy& zc, const at::Tensor& go, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& o, const at::Tensor& lse, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& mask, std::optional<double> scale) {
  if (!(half_attention(q, k, v) && go.scalar_type() == q.scalar_type() && o.scalar_type() == q.scalar_type())) {
    return host_backward(go, q, k, v, o, lse, dropout_p, is_causal, mask, scale);
  }
  auto [gq, gk, gv] = host_backward(gemm::upcast(zc, go), gemm::upcast(zc, q), gemm::upcast(zc, k),
                                    gemm::upcast(zc, v), gemm::upcast(zc, o), lse, dropout_p, is_causal,
                                    upcast_opt(zc, mask), scale);
  const auto dt = q.scalar_type();
  return {round_to(gq, dt), round_to(gk, dt), round_to(gv, dt)};
}

// Whether CPU's flash kernel accepts the mask of 4-d q and k: none, or float32 or q's dtype, 2-d
// (L, S) or 4-d, broadcastable to (B, H, L, S). Masks it rejects keep the synchronous path, where
// CPU's checks raise at the call (queued, they raised at the next synchronization).
bool mask_accepted(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& mask) {
  if (!mask.has_value() || !mask->defined()) return true;
  const at::Tensor& m = *mask;
  return (m.scalar_type() == at::kFloat || m.scalar_type() == q.scalar_type()) && (m.dim() == 2 || m.dim() == 4) &&
         at::is_expandable_to(m.sizes(), {q.size(0), q.size(1), q.size(2), k.size(2)});
}

// CPU's flash kernels (the stubs behind its functional ops) writing straight into results the
// caller laid out: the functional ops take theirs from the host allocator (fresh pages for a
// large one), and the queued kernels then copied them into the device's (per attention layer
// and training step: the output and three gradients). Taken where the functional op would run
// these stubs on these arguments, i.e. not for routed dtypes (their exact fp32 route) and
// only when CPU's argument checks pass (else the functional op runs and raises them).
bool direct_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask) {
  if (half_attention(q, k, v) || !c10::isFloatingType(q.scalar_type()) || q.dim() != 4 || k.dim() != 4 ||
      v.dim() != 4 || q.size(3) != v.size(3) || k.size(3) != v.size(3)) {
    return false;
  }
  return mask_accepted(q, k, mask);
}

// out (B, H, L, Ev) and lse (B, H, L) of any layout with unit stride in E, as CPU's
// _scaled_dot_product_flash_attention_cpu fills its own (it views them (B, L, H, .)).
void flash_forward_into(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, bool is_causal, const std::optional<at::Tensor>& mask,
                        std::optional<double> scale) {
  if (small(q, k, v, 0.0, mask, is_causal)) {
    small_attention::forward(out, lse, q, k, v, mask, is_causal, scale_of(q, scale));
    return;
  }
  at::native::flash_attention_kernel(c10::kCPU, out.transpose(1, 2), lse.transpose(1, 2), q, k, v, 0.0, is_causal,
                                     mask, scale);
}

// The gradients (B, H, L, E) laid out (B, L, H, E), as CPU's backward allocates them (zeroed:
// the kernel accumulates into them).
void flash_backward_into(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& go,
                         const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                         const at::Tensor& lse, bool is_causal, const std::optional<at::Tensor>& mask,
                         std::optional<double> scale) {
  if (small_backward(go, q, k, v, o, 0.0, mask, is_causal)) {
    small_attention::backward(gq, gk, gv, go, q, k, v, o, lse, mask, is_causal, scale_of(q, scale));
    return;
  }
  at::Tensor gq_t = gq.transpose(1, 2), gk_t = gk.transpose(1, 2), gv_t = gv.transpose(1, 2);
  gq_t.zero_();
  gk_t.zero_();
  gv_t.zero_();
  at::native::flash_attention_backward_kernel(c10::kCPU, gq_t, gk_t, gv_t, go.transpose(1, 2), q.transpose(1, 2),
                                              k.transpose(1, 2), v.transpose(1, 2), o.transpose(1, 2),
                                              lse.transpose(1, 2), 0.0, is_causal, mask, scale);
}

// torch.func's wrappers: grad's TensorWrapper and vmap's BatchedTensor.
const c10::DispatchKeySet kFuncTorchKeys{c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::FuncTorchBatched};

// Tensors whose bytes cannot be aliased: Python subclasses, meta/fake tensors, symbolic
// shapes, and torch.func's wrappers (grad's TensorWrapper and vmap's BatchedTensor have no
// storage; SDPA, a composite op, calls the selection before they are unwrapped).
bool opaque(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.key_set().has_any(kFuncTorchKeys) || t.is_meta() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

int64_t neuron_sdp_choice(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                          std::optional<double> scale, bool enable_gqa) {
  if (opaque(q) || opaque(k) || opaque(v) || (mask.has_value() && mask->defined() && opaque(*mask))) {
    // While tracing, decide from metadata what CPU's selection decides for ordinary inputs:
    // its flash kernel for 4-d float inputs without dropout or a mask that requires grad.
    // Traced with FakeTensors (a FakeTensorMode active), it is reported as flash, so the traced
    // graph holds the kernel CPU's graphs hold,
    // _scaled_dot_product_flash_attention_for_cpu, whose meta function describes what neuron
    // runs; efficient attention's meta pads the logsumexp to a multiple of 32, which neuron's
    // kernel does not (context parallelism merges it row by row), so a graph tracing it
    // failed its stride checks (Inductor's attention pattern matcher rewrites an explicit
    // softmax(q k^T) v into SDPA and traces it here: HF MobileViT under torch.compile).
    // Other subclasses (DTensor's wrappers in eager context parallelism) get efficient
    // attention, the op DTensor knows how to shard.
    const auto dt = q.scalar_type();
    const bool has_mask = mask.has_value() && mask->defined();
    const bool flash = at::globalContext().userEnabledFlashSDP() && dropout_p == 0.0 && q.dim() == 4 &&
                       k.dim() == 4 && v.dim() == 4 && q.sym_size(1) == k.sym_size(1) &&
                       (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) &&
                       !(has_mask && (mask->requires_grad() || is_causal));
    // torch.func's transforms get CPU's kernel too (its batching rules and derivatives are
    // what they apply on CPU; efficient attention's backward has no batching rule).
    const bool cpu_kernel =
        c10::impl::TorchDispatchModeTLS::get_mode(c10::impl::TorchDispatchModeKey::FAKE).has_value() ||
        q.key_set().has_any(kFuncTorchKeys) || k.key_set().has_any(kFuncTorchKeys) || v.key_set().has_any(kFuncTorchKeys);
    if (!flash) return static_cast<int64_t>(sdp::SDPBackend::math);
    return static_cast<int64_t>(cpu_kernel ? sdp::SDPBackend::flash_attention : sdp::SDPBackend::efficient_attention);
  }
  // Backends CPU does not have, chosen as CUDA would: with math disabled, dropout goes to
  // efficient attention (sdpa_kernel(FLASH_ATTENTION), (EFFICIENT_ATTENTION) or
  // (CUDNN_ATTENTION) with dropout: CPU's flash kernel has none), and so do efficient or cuDNN
  // attention without flash (CPU has neither kernel: "No viable backend"). Neuron's efficient op
  // takes 4-d floating q, k, v with one head count, as CUDA's does.
  const auto& ctx = at::globalContext();
  const bool fused_other = ctx.userEnabledMemEfficientSDP() || ctx.userEnabledCuDNNSDP();
  if (!ctx.userEnabledMathSDP() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
      q.size(1) == k.size(1) && k.size(1) == v.size(1) && at::isFloatingType(q.scalar_type()) &&
      (dropout_p > 0.0 ? ctx.userEnabledFlashSDP() || fused_other : fused_other && !ctx.userEnabledFlashSDP())) {
    return static_cast<int64_t>(sdp::SDPBackend::efficient_attention);
  }
  // CPU's selection reads metadata only, so the aliases need not wait for queued kernels.
  ZeroCopy zc{ZeroCopy::Queued{}};
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
  // CPU's flash kernel reads a float32 mask of float64 attention as float64 data (torch 2.13: the
  // output off by O(1), silently); its math path promotes the mask. Neuron takes the math path.
  if (cpu_choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention) && m.has_value() &&
      q.scalar_type() == at::kDouble && m->is_floating_point() && m->scalar_type() != at::kDouble) {
    return static_cast<int64_t>(sdp::SDPBackend::math);
  }
  const bool same_heads = q.dim() < 3 || k.dim() < 3 || q.size(-3) == k.size(-3);
  if (cpu_choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention) && dropout_p == 0.0 &&
      same_heads) {
    return static_cast<int64_t>(sdp::SDPBackend::efficient_attention);
  }
  return cpu_choice;
}

// Queued attention (the execution engine on, enqueue.h): 4-d neuron q, k, v (and mask) of one
// floating dtype (routed dtypes run the synchronous path's exact kernels, flash_forward and
// flash_backward, with their fp32 copies in host scratch), shapes CPU's kernel accepts. Results are laid out as the synchronous path lays them out: the
// output (B, L, H, E) viewed as (B, H, L, E), the logsumexp (B, L, H) viewed as (B, H, L) in
// fp32 (fp64 for fp64), the gradients of q, k, v as CPU's flash backward returns them,
// (B, L, H, E) viewed as (B, H, L, E). k and v may have fewer heads than q, a divisor of its
// count (grouped-query attention, which CPU's flash kernels take; the efficient op checks that
// the counts are equal).
bool queueable_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const std::optional<at::Tensor>& mask) {
  return may_enqueue() && queueable_like(q, q) && queueable_like(q, k) && queueable_like(q, v) &&
         c10::isFloatingType(q.scalar_type()) && q.dim() == 4 && k.dim() == 4 &&
         v.dim() == 4 && q.size(0) == k.size(0) && q.size(0) == v.size(0) && k.size(1) == v.size(1) &&
         (k.size(1) == q.size(1) || (k.size(1) > 0 && q.size(1) % k.size(1) == 0)) && k.size(2) == v.size(2) &&
         q.size(3) == k.size(3) &&
         (!mask.has_value() || !mask->defined() || (mask->is_privateuseone() && mask->device() == q.device() &&
                                                   mask->layout() == c10::kStrided)) &&
         mask_accepted(q, k, mask);
}

// (B, H, L, E) laid out as (B, L, H, E).
std::vector<int64_t> bhle_strides(const at::Tensor& t) {
  const int64_t H = t.size(1), L = t.size(2), E = t.size(3);
  return {L * H * E, E, H * E, 1};
}

// The queued forward of both attention ops: CPU's flash kernel writing an output (B, H, L, Ev)
// laid out (B, L, H, Ev), or with `out_strides` if given, and a logsumexp (B, H, L) laid out
// (B, L, H) if `keep_lse` (else an empty (B, H, 0) one, as the efficient op returns without
// compute_log_sumexp); routed dtypes copy their exact route's results into them.
std::tuple<at::Tensor, at::Tensor> enqueue_forward(const char* name, const at::Tensor& query, const at::Tensor& key,
                                                   const at::Tensor& value, const std::optional<at::Tensor>& mask,
                                                   bool is_causal, std::optional<double> scale,
                                                   c10::IntArrayRef out_strides, bool keep_lse) {
  const int64_t B = query.size(0), H = query.size(1), L = query.size(2), E = value.size(3);
  const auto acc = at::toOpMathType(query.scalar_type());  // CPU's logsumexp dtype
  QueuedCall q;
  at::Tensor qa = q.in(query), ka = q.in(key), va = q.in(value), out, lse;
  std::optional<at::Tensor> ma = q.in(mask);
  at::Tensor oo = q.out(out, {B, H, L, E}, query.scalar_type(),
                        out_strides.empty() ? std::vector<int64_t>{L * H * E, E, H * E, 1} : out_strides.vec());
  at::Tensor lo = keep_lse ? q.out(lse, {B, H, L}, acc, {L * H, 1, H}) : q.out(lse, {B, H, 0}, acc);
  const bool direct = direct_flash(query, key, value, mask);
  // A routed dtype's exact fp32 copies (gemm.h, arena_bytes).
  at::Tensor arena = q.arena(half_attention(query, key, value) ? copies_bytes({query, key, value}, mask) : 0);
  q.enqueue(name, [qa, ka, va, ma, oo, lo, is_causal, scale, keep_lse, direct, B, H, L, arena] {
    if (direct) {
      // Without keep_lse the logsumexp goes to host scratch (the efficient op may not return it).
      at::Tensor l = keep_lse ? lo : at::empty({B, L, H}, lo.options()).transpose(1, 2);
      flash_forward_into(oo, l, qa, ka, va, is_causal, ma, scale);
      return;
    }
    ZeroCopy zc(ZeroCopy::Queued{});
    zc.set_scratch_arena(arena);
    auto [o, l] = flash_forward(zc, qa, ka, va, 0.0, is_causal, ma, scale);
    at::Tensor(oo).copy_(o);
    if (keep_lse) at::Tensor(lo).copy_(l);
  });
  return {out, lse};
}

// The queued backward of both: the arguments besides q, k, v the kernel reads are neuron tensors
// it accepts; the gradients laid out as CPU's flash backward returns them.
bool queueable_backward(const at::Tensor& query, const at::Tensor& grad_out, const at::Tensor& out,
                        const at::Tensor& logsumexp) {
  return queueable_like(query, grad_out) && queueable_like(query, out) && grad_out.sizes() == out.sizes() &&
         logsumexp.is_privateuseone() && logsumexp.device() == query.device() && logsumexp.dim() == 3;
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> enqueue_backward(
    const char* name, const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& mask, bool is_causal, std::optional<double> scale) {
  QueuedCall q;
  at::Tensor go = q.in(grad_out), qa = q.in(query), ka = q.in(key), va = q.in(value), oa = q.in(out),
             la = q.in(logsumexp), gq, gk, gv;
  std::optional<at::Tensor> ma = q.in(mask);
  at::Tensor gqo = q.out(gq, query.sizes(), query.scalar_type(), bhle_strides(query));
  at::Tensor gko = q.out(gk, key.sizes(), key.scalar_type(), bhle_strides(key));
  at::Tensor gvo = q.out(gv, value.sizes(), value.scalar_type(), bhle_strides(value));
  const bool direct = direct_flash(query, key, value, mask);
  at::Tensor arena =
      q.arena(half_attention(query, key, value) ? copies_bytes({grad_out, query, key, value, out}, mask) : 0);
  q.enqueue(name, [go, qa, ka, va, oa, la, ma, gqo, gko, gvo, is_causal, scale, direct, arena] {
    if (direct) {
      flash_backward_into(gqo, gko, gvo, go, qa, ka, va, oa, la, is_causal, ma, scale);
      return;
    }
    ZeroCopy zc(ZeroCopy::Queued{});
    zc.set_scratch_arena(arena);
    auto [a, b, c] = flash_backward(zc, go, qa, ka, va, oa, la, 0.0, is_causal, ma, scale);
    at::Tensor(gqo).copy_(a);
    at::Tensor(gko).copy_(b);
    at::Tensor(gvo).copy_(c);
  });
  return {gq, gk, gv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> efficient_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_bias, bool compute_log_sumexp, double dropout_p,
    bool is_causal, std::optional<double> scale) {
  if (dropout_p > 0.0) {
    // CUDA's memory-efficient kernel with dropout as neuron implements it (kernels/attention.py,
    // [B, L, H, E] views): the keep mask drawn from the default generator, its (seed, offset)
    // returned for the backward to draw it again. The logsumexp is padded to 32 queries, as the
    // op's meta function says.
    auto r = at::_efficient_attention_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                              attn_bias, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                                              dropout_p, is_causal ? 1 : 0, compute_log_sumexp, scale);
    return {std::get<0>(r).transpose(1, 2), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
  }
  if (queueable_attention(query, key, value, attn_bias) && query.size(1) == key.size(1)) {
    auto [out, lse] = enqueue_forward("aten::_scaled_dot_product_efficient_attention", query, key, value, attn_bias,
                                      is_causal, scale, /*out_strides=*/{}, compute_log_sumexp);
    auto opts = at::TensorOptions().dtype(at::kLong).device(query.device());
    return {out, lse, at::zeros({}, opts), at::zeros({}, opts)};
  }
  ZeroCopy zc;
  at::Tensor q = zc.in(query), k = zc.in(key), v = zc.in(value);
  auto bias = alias_opt(zc, attn_bias);
  zc.launch("aten::_scaled_dot_product_efficient_attention");
  zc.trace_meta("is_causal", is_causal ? "true" : "false");
  // Output laid out as the op's meta function says, (B, L, H, E) viewed as (B, H, L, E), so
  // compiled graphs see the strides they planned for. The logsumexp stays (B, H, L): context
  // parallelism merges it with the output row by row, which the meta's padding to a multiple
  // of 32 would break (the neuron compile backend does not lower this op; see compile.md).
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = v.size(3);
  at::Tensor res = at::empty({B, L, H, E}, q.options()).transpose(1, 2), lse;
  if (dropout_p == 0.0 && direct_flash(q, k, v, bias)) {
    lse = at::empty({B, L, H}, q.options().dtype(at::toOpMathType(q.scalar_type()))).transpose(1, 2);
    flash_forward_into(res, lse, q, k, v, is_causal, bias, scale);
  } else {
    auto [o, l] = flash_forward(zc, q, k, v, dropout_p, is_causal, bias, scale);
    res.copy_(o);
    lse = l;
  }
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
  const std::optional<at::Tensor> mask = attn_bias.defined() ? std::optional<at::Tensor>(attn_bias) : std::nullopt;
  if (dropout_p > 0.0) {  // the forward's kernel (above): the mask drawn again from philox_seed/offset
    auto t = [](const at::Tensor& x) { return x.transpose(1, 2); };
    auto [gq, gk, gv, gb] = at::_efficient_attention_backward(
        t(grad_out), t(query), t(key), t(value), mask, t(out), std::nullopt, std::nullopt, query.size(2), key.size(2),
        logsumexp, dropout_p, philox_seed, philox_offset, is_causal ? 1 : 0, /*bias_requires_grad=*/false, scale);
    return {t(gq), t(gk), t(gv), at::Tensor()};
  }
  if (queueable_attention(query, key, value, mask) && query.size(1) == key.size(1) &&
      queueable_backward(query, grad_out, out, logsumexp)) {
    auto [gq, gk, gv] = enqueue_backward("aten::_scaled_dot_product_efficient_attention_backward", grad_out, query,
                                         key, value, out, logsumexp, mask, is_causal, scale);
    return {gq, gk, gv, at::Tensor()};
  }
  ZeroCopy zc;
  at::Tensor go = zc.in(grad_out), q = zc.in(query), k = zc.in(key), v = zc.in(value);
  at::Tensor o = zc.in(out);
  at::Tensor lse = zc.in(logsumexp);
  std::optional<at::Tensor> bias;
  if (attn_bias.defined()) bias = zc.in(attn_bias);
  zc.launch("aten::_scaled_dot_product_efficient_attention_backward");
  zc.trace_meta("is_causal", is_causal ? "true" : "false");
  auto [gq, gk, gv] = flash_backward(zc, go, q, k, v, o, lse, dropout_p, is_causal, bias, scale);
  return {zc.out(gq), zc.out(gk), zc.out(gv), at::Tensor()};
}

// The ops compiled graphs call (sdpa.py pins them), and eager SDPA where the efficient op does not
// apply (grouped-query attention: Hugging Face's Llama passes enable_gqa); through the fallback
// fp16 took CPU's kernel. Queued like the efficient op, for q laid out (B, H, L, E) or as
// (B, L, H, E) viewed so, k and v with H a multiple of theirs: CPU's output takes q's layout,
// its logsumexp is (B, L, H) viewed as (B, H, L), its gradients (B, L, H, E) viewed so.
// CPU's output is laid out like q (empty_like: q's strides if q is dense, else dense strides in
// q's stride order: a (B, L, 3, H, E) projection's q view gives (B, L, H, E)); queued when that
// layout keeps E unit-strided (flash_forward_into's contract) and Ev == E. Empty if not queueable.
std::vector<int64_t> queueable_flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const std::optional<at::Tensor>& mask, double dropout_p) {
  if (dropout_p != 0.0 || !queueable_attention(q, k, v, mask) || q.numel() == 0 || q.size(3) != v.size(3)) return {};
  std::vector<int64_t> strides = preserved_strides(q);
  if (strides[3] != 1) return {};
  return strides;
}

std::tuple<at::Tensor, at::Tensor> flash_attention_for_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double dropout_p,
    bool is_causal, const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  const std::vector<int64_t> out_strides = queueable_flash(query, key, value, attn_mask, dropout_p);
  if (!out_strides.empty()) {
    return enqueue_forward("aten::_scaled_dot_product_flash_attention_for_cpu", query, key, value, attn_mask,
                           is_causal, scale, out_strides, /*keep_lse=*/true);
  }
  ZeroCopy zc;
  at::Tensor q = zc.in(query), k = zc.in(key), v = zc.in(value);
  auto mask = alias_opt(zc, attn_mask);
  zc.launch("aten::_scaled_dot_product_flash_attention_for_cpu");
  zc.trace_meta("is_causal", is_causal ? "true" : "false");
  auto [out, lse] = flash_forward(zc, q, k, v, dropout_p, is_causal, mask, scale);
  return {zc.out(out), zc.out(lse)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_for_cpu_backward(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& out, const at::Tensor& logsumexp, double dropout_p,
    bool is_causal, const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  if (!queueable_flash(query, key, value, attn_mask, dropout_p).empty() &&
      queueable_backward(query, grad_out, out, logsumexp)) {
    return enqueue_backward("aten::_scaled_dot_product_flash_attention_for_cpu_backward", grad_out, query, key, value,
                            out, logsumexp, attn_mask, is_causal, scale);
  }
  ZeroCopy zc;
  at::Tensor go = zc.in(grad_out), q = zc.in(query), k = zc.in(key), v = zc.in(value);
  at::Tensor o = zc.in(out), lse = zc.in(logsumexp);
  auto mask = alias_opt(zc, attn_mask);
  zc.launch("aten::_scaled_dot_product_flash_attention_for_cpu_backward");
  zc.trace_meta("is_causal", is_causal ? "true" : "false");
  auto [gq, gk, gv] = flash_backward(zc, go, q, k, v, o, lse, dropout_p, is_causal, mask, scale);
  return {zc.out(gq), zc.out(gk), zc.out(gv)};
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
  m.impl("_scaled_dot_product_flash_attention_for_cpu",
         TORCH_FN(torchneuron::flash_attention_for_cpu));
  m.impl("_scaled_dot_product_flash_attention_for_cpu_backward",
         TORCH_FN(torchneuron::flash_attention_for_cpu_backward));
}
