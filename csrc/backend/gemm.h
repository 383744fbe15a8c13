// TensorE precision for host GEMMs (see gemm.cpp): what the GEMM family, convolution and
// attention share when a dtype has no fast exact CPU kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include "zero_copy.h"

namespace torchneuron::gemm {

// Whether CPU's own bf16 GEMM and convolution kernels are fast on this host: oneDNN's bf16
// kernels, which ATen uses only with AVX-512 (mkldnn_bf16_device_check), on a CPU with native
// bf16 dot products (AVX512-BF16). Without AVX-512 (e.g. AVX2-only AMD Zen 3) CPU's bf16 mm is
// a scalar loop: 1024^2 takes 9 s against 0.07 s in fp32; with AVX-512 but no AVX512-BF16
// (Intel Ice Lake) oneDNN emulates bf16 at 3.5x fp32's time.
bool cpu_fast_bf16();

// Whether the CPU's native bf16 dot products (AVX512-BF16's VDPBF16PS) run at about half an fp32
// GEMM's rate: Intel cores of the Sapphire Rapids class (AVX512-FP16) whose AMX tiles are absent
// or not granted (a VM hiding them), where VDPBF16PS issues on one port and FMA on two. oneDNN's
// bf16 kernels there (2 cores, Intel Xeon model 207): mm 1024^3 14.5 ms against 9.2-9.9 ms in
// fp32; conv2d forward + backward 13.9 ms against 10.2 ms and causal attention forward +
// backward 87 ms against 50 ms on exact fp32 copies. bf16 then takes the exact route (routed(),
// product_routed()), but for products of fewer than kBf16RoutedRows rows, where oneDNN's bf16
// kernel, reading half the bytes of an fp32 copy, is as fast or faster (16 x 4096 x 4096: 4.3-5.1
// against 8.1-8.5 ms; at 64 rows the two meet).
bool bf16_half_rate();
constexpr int64_t kBf16RoutedRows = 64;
// Testing: 1 routes as such a host (where oneDNN's bf16 kernels exist), 0 as another, -1 as this
// host is.
void set_bf16_half_rate(int value);

// Whether CPU's fp16 GEMMs are oneDNN's on this host: ATen takes them only with AVX512-FP16 or
// AMX-FP16 (mkldnn_fp16_device_check), and they accumulate in fp32 there (TensorE's contract):
// mm 1024^3 6.9 ms against 10.3 ms for exact fp32 copies and an fp32 GEMM (AMX host).
bool cpu_fast_fp16();

// Convolution and attention in `t`'s dtype leave CPU's kernel for an exact host path (products
// exact, fp32 accumulation, one rounding, as TensorE runs them): fp16 always (CPU's fp16
// kernels are 10-400x slower than bf16 without AVX512-FP16/AMX, and even with AVX512-FP16 its
// fp16 convolution backward took 214 ms against 2.9 ms); bf16 where CPU's bf16 kernels are slow
// (!cpu_fast_bf16() or bf16_half_rate()).
inline bool routed(const at::Tensor& t) {
  return t.scalar_type() == at::kHalf ||
         (t.scalar_type() == at::kBFloat16 && (!cpu_fast_bf16() || bf16_half_rate()));
}

// The same for the products (mm, addmm, bmm, baddbmm, their out= forms, _grouped_mm): as
// routed(), except that fp16 keeps CPU's kernels where they are oneDNN's (cpu_fast_fp16()). On
// bf16_half_rate() hosts the products' call sites also keep CPU's kernels below
// kBf16RoutedRows rows (gemm.cpp, half_pair), but for one to sixteen rows with B = W.t(), which
// run gemv.h's kernels (gemm.cpp, row_gemv and few_rows).
inline bool product_routed(const at::Tensor& t) {
  return (t.scalar_type() == at::kHalf && !cpu_fast_fp16()) ||
         (t.scalar_type() == at::kBFloat16 && (!cpu_fast_bf16() || bf16_half_rate()));
}

// A CPU tensor over a fresh buffer from the device's caching allocator (no page faults for
// large temporaries, unlike host allocations). `zc` keeps the buffer alive for the op.
at::Tensor scratch(ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype,
                   c10::IntArrayRef strides = {});

// The bytes a scratch of `numel` elements (fp32 unless `element_size` says otherwise) takes in a
// queued kernel's arena (ZeroCopy::set_scratch_arena: 64-byte aligned).
inline int64_t arena_bytes(int64_t numel, int64_t element_size = 4) {
  return (numel * element_size + 63) / 64 * 64;
}

// An exact fp32 copy of `t` (fp16/bf16/fp32) in a scratch buffer, keeping a dense layout
// (a transposed operand stays transposed, which oneDNN reads without a reorder).
at::Tensor upcast(ZeroCopy& zc, const at::Tensor& t);

// out = alpha * (a @ b) + beta * out over fp32 CPU tensors, 2-d or 3-d (batched), through
// oneDNN where it is usable and faster than MKL (see gemm.cpp). beta == 0 ignores `out`.
void matmul_f32(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                float alpha);

// Whether oneDNN's bf16/fp32 matmul can run on this CPU (ATen checks the same ISA).
bool onednn_matmul_usable();

// Whether a (batch x) m x k @ k x n product is large enough for oneDNN to beat MKL (oneDNN has
// ~10 us of fixed cost per call; MKL wins on tiny and matrix-vector shapes).
bool prefer_onednn(int64_t m, int64_t n, int64_t k, int64_t batch = 1);

// out = alpha * (a @ b) + beta * out with a, b bf16 and out bf16 through oneDNN: fp32
// accumulation, alpha/beta applied in fp32, one rounding. Requires onednn_matmul_usable().
void matmul_bf16(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                 float alpha);

// acc = alpha * (a @ b) + beta * acc with a, b fp16 or bf16 (one dtype; 2-d or 3-d, any
// strides) and acc a contiguous fp32 CPU tensor: exact products, fp32 accumulation, no
// rounding to a/b's dtype (TensorE's PSUM). With oneDNN usable (AVX-512): exact fp32 copies
// and matmul_f32; otherwise MKL's mixed-precision GEMMs (cblas_gemm_bf16bf16f32 /
// cblas_gemm_f16f16f32, fp32 accumulation and result) read the 16-bit operands directly.
// beta == 0 ignores acc's contents.
void matmul_lowp_f32(ZeroCopy& zc, const at::Tensor& a, const at::Tensor& b, const at::Tensor& acc,
                     float beta, float alpha);

// o (CPU alias, a's dtype) = round(alpha * a @ b + beta * self) with exact products and fp32 sums
// (matmul_lowp_f32 into an fp32 scratch, then one rounding; self read only with beta != 0): the
// routed products' kernel. b may also be int8 (exact in fp32: Adaptive Eager's widened weights).
void half_product(ZeroCopy& zc, const at::Tensor& o, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor* self, float beta, float alpha);
// half_product's unrounded sums (an fp32 scratch of `sizes`), for a caller with its own epilogue.
at::Tensor half_sums(ZeroCopy& zc, c10::IntArrayRef sizes, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor* self, float beta, float alpha);

// Whether matmul_lowp_f32 multiplies a and b with MKL's mixed-precision GEMM (reading the 16-bit
// operands) rather than exact fp32 copies of them, for an fp32 accumulator contiguous or not.
bool mixed_route(const at::Tensor& a, const at::Tensor& b, bool contiguous_acc);

// Whether the CPU multiplies bf16 tiles on AMX (and MKL's bf16 x bf16 -> fp32 GEMM, which uses
// it, is linked): then matmul_lowp_f32 runs bf16 operands on that GEMM at any size, and fp8
// GEMMs widen their codes to bf16 for it (scaled_mm.cpp). set_amx_enabled(false), for tests,
// makes the host look as if it had no AMX.
bool amx_bf16();
void set_amx_enabled(bool on);

// Whether a bf16 `mm` of these neuron operands runs amx_gemm.h's kernel instead of CPU's
// (oneDNN's): an AMX host, A's rows and B's columns contiguous along k (B = nn.Linear's
// weight.t()), at most kAmxMmRows rows, where it takes 0.5-1.1x oneDNN's time (gemm.cpp). Its
// fp32 sums run along k in TDPBF16PS's order; oneDNN's differ on some shapes (a few elements
// one bf16 ulp apart), so these products are not CPU's bits.
constexpr int64_t kAmxMmRows = 256;
bool amx_mm(const at::Tensor& a, const at::Tensor& b);
// The same for `addmm(bias, a, b)` with beta and alpha 1 and a bf16 bias of n values along the
// rows (nn.Linear's): its fp32 sums plus the bias in fp32, rounded once, as oneDNN's addmm.
bool amx_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
               const at::Scalar& alpha);
// o (bf16, contiguous) = a @ b (+ bias) on that kernel (requires amx_mm(a, b) / amx_addmm).
void amx_mm_out(const at::Tensor& o, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias = nullptr);

// Whether the CPU has AMX's bf16 tiles and the OS granted their state (amx_gemm.h's kernel runs
// them itself; MKL not needed). set_amx_enabled(false) turns this off too.
bool amx_tiles();

// Which host path matmul_lowp_f32 takes: "onednn-fp32" or "mkl-mixed" (bf16 operands on an AMX
// host take MKL's GEMM either way).
const char* lowp_route();

// The layout of a convolution's result and gradients on neuron (torch.compile plans with the
// same answer: torchneuron/_conv_layout.py). CPU's rule for 2-d convolutions, in every dtype and
// on either kernel (oneDNN or the slow path): channels-last when the input or the weight
// suggests it, else contiguous. 3-d convolutions take the same rule with ChannelsLast3d, as
// CUDA's cuDNN and CPU's oneDNN path do (CPU's slow 3-d kernels, which it takes for fp16,
// fp64 and a batch of one in fp32, return contiguous results: values are the same).
at::MemoryFormat conv_memory_format(const at::Tensor& input, const at::Tensor& weight);

// The strides of a convolution result or gradient of `sizes` for that input and weight. A 1-d
// convolution is a 2-d one over a height of 1 (ATen views the contiguous input and the weight
// so): a weight whose 2-d view suggests channels-last gives (N, C, L) strides (L*C, 1, C).
std::vector<int64_t> conv_strides(const at::Tensor& input, const at::Tensor& weight,
                                  c10::IntArrayRef sizes);

}  // namespace torchneuron::gemm
