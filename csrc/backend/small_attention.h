// Scaled-dot-product attention of short sequences in fp32, forward and backward, each head's
// whole score matrix held in cache (small_attention.cpp). CPU's flash kernel tiles for long
// sequences and calls a GEMM per 32-query block; at the sequence lengths of small models (a
// few hundred keys) those calls and its full-width causal blocks cost 1.5-3x this kernel's time.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace torchneuron::small_attention {

// Whether the host runs the kernel (AVX-512) and it is enabled (set_enabled; on by default).
bool available();
// Testing and measurement: false sends every call to CPU's flash kernel, true back.
void set_enabled(bool enabled);

// Whether forward and backward take these operands and are faster than CPU's flash kernel:
// fp32 q (B, H, L, E), k and v (B, Hk, S, E) with H a multiple of Hk (grouped-query attention:
// query head h reads key/value head h / (H / Hk)), unit stride along E, an additive fp32 mask or
// none (2-d (L, S) or 4-d, broadcast over any dim but the keys, unit stride along them),
// 16 <= L, S <= 512 causal or 256 not (to 512 with a mask that leaves at most 60 % of the
// scores: its values are read, so call this where they are computed), E <= 128, an AVX-512 host.
bool applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
             bool is_causal);

// out (B, H, L, E) and lse (B, H, L) of any strides with unit stride along E: softmax(q k^T *
// scale + mask) v and its log-sum-exp per query, causal as SDPA's is_causal (query i sees keys
// 0..i). A query whose keys are all masked (-inf) gets CPU's flash kernel's zeros (out and lse).
void forward(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q, const at::Tensor& k,
             const at::Tensor& v, const std::optional<at::Tensor>& mask, bool is_causal, double scale);

// The gradients of q, k and v (overwritten; k's and v's summed over their query heads) from the
// forward's out and lse.
void backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& gv, const at::Tensor& go,
              const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& lse, const std::optional<at::Tensor>& mask, bool is_causal, double scale);

}  // namespace torchneuron::small_attention
