#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// The GEMM family on neuron (mm, addmm, bmm, baddbmm and their out= forms, which matmul,
// linear, their backward and Inductor's extern calls reach; addmv/mv, dot; convolution and
// its backward), routed by dtype so every precision runs at the host's full speed with
// TensorE's numerics.
//
// TensorE multiplies exactly and accumulates in fp32 (PSUM); the result is rounded once to
// the output dtype. For fp32 CPU's kernels already do that fast, so fp32 runs CPU's kernels
// bit for bit; so does bf16 where CPU has oneDNN's bf16 kernels at full rate (AVX-512 hosts; on
// AMX hosts the products of nn.Linear's forward with at most 256 rows run amx_gemm.h's kernel:
// gemm::amx_mm; where bf16 dot products run at half rate, gemm::bf16_half_rate, bf16 is routed
// as on hosts without them, and one to sixteen rows run gemv.h's kernels),
// and so do fp16 products where CPU's fp16 GEMMs are oneDNN's (AVX512-FP16 hosts; gemm.h). fp16 (and
// bf16 on hosts without AVX-512, where CPU's bf16 GEMM is a scalar loop) takes an exact host
// path: products exact (a 16-bit float product has at most 22 significant bits), fp32
// accumulation, one rounding. Which path depends on the host (docs/benchmarks.md):
//   - AVX-512 hosts (oneDNN usable): operands widened to fp32, oneDNN's fp32 GEMM (MKL's
//     sgemm on the AMD Zen 5 host is 2-5x slower). A bf16 split exact to fp32 accumulation
//     needs 3-4 bf16 GEMMs, slower than one fp32 GEMM at half bf16's rate; oneDNN's fp16
//     kernels need AVX512-FP16 or AMX, which these hosts lack.
//   - AVX2 hosts: MKL's mixed-precision GEMMs (cblas_gemm_f16f16f32, cblas_gemm_bf16bf16f32)
//     read the 16-bit operands directly at fp32 GEMM speed and return the fp32 accumulator.
#include <ATen/ExpandUtils.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/ConvUtils.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/addmv_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/dot_cpu_dispatch.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/result_type.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <limits>

#include "allocator.h"
#include "amx_gemm.h"
#include "cpu_features.h"
#include "enqueue.h"
#include "fusion.h"
#include "gemm.h"
#include "gemv.h"
#include "transpose.h"

// Exported by libtorch_cpu (TORCH_API) but its header is not installed: oneDNN's matmul on
// dense CPU tensors, result = alpha * mat1 @ mat2 + beta * result (fp32, bf16; 2-d or 3-d).
namespace at::native {
TORCH_API void mkldnn_matmul(const at::Tensor& mat1, const at::Tensor& mat2,
                             const at::Tensor& result, float beta, float alpha);
}

// MKL's mixed-precision GEMMs, exported by libtorch_cpu (torch links MKL in; no MKL header is
// installed). LP64 interface (32-bit ints); MKL_BF16 and MKL_F16 are 16-bit bit patterns.
// Declared weak: a torch built without MKL leaves them null and the fp32 route is taken.
extern "C" {
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                            float* c, int ldc) __attribute__((weak));
void cblas_gemm_f16f16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                          const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta,
                          float* c, int ldc) __attribute__((weak));
}

namespace torchneuron::gemm {

// oneDNN computes bf16 dot products natively only with AVX512-BF16 (AMX hosts have it too). On
// the AVX-512 CPUs without it (Intel Skylake-SP to Ice Lake, many cloud hosts) ATen still takes
// oneDNN's bf16 kernels, which then convert every operand: on a 2-core Ice Lake, mm 1024^3 in
// bf16 took 41 ms against 11.7 ms in fp32 (conv2d 2.9x, attention fwd+bwd 2.6x fp32's time).
bool cpu_fast_bf16() { return cpu_features::avx512bf16() && onednn_matmul_usable(); }

namespace {
// Whether ATen's CPU-capability table (cpuinfo) lists feature `k` for this host.
bool cpu_has(const char* k) {
  static const auto caps = at::cpu::get_cpu_capabilities();
  auto it = caps.find(k);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

std::atomic<bool> amx_enabled{true};
}  // namespace

bool cpu_fast_fp16() {
  static const bool isa = cpu_has("avx512_fp16") || cpu_has("amx_fp16");
  return isa && onednn_matmul_usable();
}

// AMX (Intel Sapphire Rapids and later) multiplies bf16 tiles into fp32: MKL's bf16 x bf16 ->
// fp32 GEMM uses it, returning the fp32 accumulator itself (1024^3 in 1.24-1.43 ms on 2 cores
// against 6.8 ms for an fp32 GEMM). AMX needs the kernel's permission for its tile state
// (init_amx asks).
static bool amx_host() {
  static const bool host = cpu_has("amx_bf16") && cpu_has("amx_tile") && at::cpu::init_amx();
  return host;
}
bool amx_tiles() { return amx_enabled.load(std::memory_order_relaxed) && amx_host(); }

// The host's capability, not amx_tiles()'s test switch: with AMX, oneDNN's own bf16 kernels
// multiply on tiles whatever neuron's kernels do.
namespace {
std::atomic<int> half_rate_override{-1};
}
bool bf16_half_rate() {
  static const bool host = cpu_fast_bf16() && cpu_has("avx512_fp16") && !amx_host();
  const int o = half_rate_override.load(std::memory_order_relaxed);
  return o < 0 ? host : (o == 1 && cpu_fast_bf16());
}
void set_bf16_half_rate(int value) { half_rate_override.store(value < 0 ? -1 : value != 0); }

bool amx_bf16() { return amx_tiles() && cblas_gemm_bf16bf16f32 != nullptr; }

void set_amx_enabled(bool on) { amx_enabled.store(on); }

// bf16 mm on AMX: amx_gemm.h's kernel against oneDNN's (ratio of times, 2 cores, B = W.t();
// thirty-seventh session, bf16 weights read in place): rows 1-64 x 4096 x 4096 0.55-0.70;
// 64 x 4096 x 11008 0.50; 256 x 1024 x 4096 0.93-0.97; 256 x 4096 x 4096 0.84; 256 x 4096 x
// 11008 0.79-0.82; 128 x 768 x 768 0.9-0.95; 256 x 64 x 64 0.6; 256 x 1024 x 1024 1.1 (kept: one
// rule); but 384 x 1024 x 1024 1.15, 512 x 1024 x 4096 1.17, 1024 x 1024 x 4096 1.27, 4096 x
// 1024 x 1024 1.5, 8192 x 512 x 512 2.0 (oneDNN's large-M kernels are faster).
bool amx_mm(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && a.dim() == 2 && b.dim() == 2 &&
         a.size(1) == b.size(0) && a.size(0) >= 1 && a.size(0) <= kAmxMmRows && b.size(1) >= 1 && a.size(1) >= 1 &&
         a.stride(1) == 1 && a.stride(0) >= a.size(1) && b.stride(0) == 1 && b.stride(1) >= b.size(0) &&
         !a.is_conj() && !a.is_neg() && !b.is_conj() && !b.is_neg() && amx_gemm::available();
}

bool amx_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
               const at::Scalar& alpha) {
  const bool ones = !beta.isComplex() && !alpha.isComplex() && beta.toDouble() == 1.0 && alpha.toDouble() == 1.0;
  return ones && amx_mm(a, b) && bias.scalar_type() == at::kBFloat16 && bias.dim() >= 1 && bias.dim() <= 2 &&
         bias.numel() == b.size(1) && bias.size(-1) == b.size(1) && bias.stride(-1) == 1 && !bias.is_conj() &&
         !bias.is_neg();
}

void amx_mm_out(const at::Tensor& o, const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias) {
  const bf16_gemm::Matrix ma{a.const_data_ptr(), a.stride(0), false, nullptr};
  const bf16_gemm::Matrix mb{b.const_data_ptr(), b.stride(1), true, nullptr};
  bf16_gemm::Output out;
  out.bf16 = static_cast<uint16_t*>(o.data_ptr());
  out.ld = o.stride(0);
  at::Tensor widened;  // the bias in fp32 (exact), as the epilogue adds it
  if (bias != nullptr) {
    widened = bias->reshape({-1}).to(at::kFloat);
    out.bias = widened.const_data_ptr<float>();
  }
  amx_gemm::gemm(a.size(0), b.size(1), a.size(1), ma, mb, out);
}

bool onednn_matmul_usable() {
  // ATen's mkldnn_matmul raises unless the CPU has these (mkldnn_bf16_device_check).
  static const bool isa = cpu_has("avx512_bw") && cpu_has("avx512_vl") && cpu_has("avx512_dq");
  return isa && at::globalContext().userEnabledMkldnn();
}

at::Tensor scratch(ZeroCopy& zc, c10::IntArrayRef sizes, c10::ScalarType dtype,
                   c10::IntArrayRef strides) {
  if (zc.queued()) {
    // A kernel running from the queue: the device allocator may itself run the queue (its
    // out-of-memory retry) and is not entered from there. Its call's arena (device memory,
    // ZeroCopy::set_scratch_arena) holds the temporaries, or else host memory (64-byte aligned,
    // as the pool's blocks are at least). A dense layout spans numel elements either way.
    const auto options = at::TensorOptions().dtype(dtype);
    const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
    if (void* p = zc.take_scratch(static_cast<size_t>(bytes))) {
      return strides.empty() ? at::from_blob(p, sizes, options) : at::from_blob(p, sizes, strides, options);
    }
    return strides.empty() ? at::empty(sizes, options) : at::empty_strided(sizes, strides, options);
  }
  return zc.in(pooled(zc, sizes, dtype, strides));
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

at::MemoryFormat conv_memory_format(const at::Tensor& input, const at::Tensor& weight) {
  const int64_t d = input.dim();
  if (d != 4 && d != 5) return at::MemoryFormat::Contiguous;
  const auto cl = d == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return input.suggest_memory_format() == cl || weight.suggest_memory_format() == cl ? cl
                                                                                      : at::MemoryFormat::Contiguous;
}

std::vector<int64_t> conv_strides(const at::Tensor& input, const at::Tensor& weight, c10::IntArrayRef sizes) {
  if (input.dim() == 3 && weight.dim() == 3 && sizes.size() == 3) {
    // Only the weight decides: ATen makes the input contiguous first.
    // (weight.unsqueeze(2).suggest_memory_format(), without a view op on the device tensor)
    const auto ws = weight.sizes(), wt = weight.strides();
    if (!c10::is_channels_last_strides_2d<int64_t>({ws[0], ws[1], 1, ws[2]}, {wt[0], wt[1], ws[2] * wt[2], wt[2]}))
      return strides_for(sizes, at::MemoryFormat::Contiguous);
    const auto s = c10::get_channels_last_strides_2d({sizes[0], sizes[1], 1, sizes[2]});
    return {s[0], s[1], s[3]};
  }
  return strides_for(sizes, conv_memory_format(input, weight));
}

void matmul_bf16(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, float beta,
                 float alpha) {
  at::native::mkldnn_matmul(a, b, out, beta, alpha);
}

namespace {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS_LAYOUT, CBLAS_TRANSPOSE

using MixedGemm = void (*)(int, int, int, int, int, int, float, const uint16_t*, int,
                           const uint16_t*, int, float, float*, int);

MixedGemm mixed_gemm(c10::ScalarType dt) {
  if (dt == at::kHalf) return cblas_gemm_f16f16f32;
  if (dt == at::kBFloat16) return cblas_gemm_bf16bf16f32;
  return nullptr;
}

bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

// How MKL reads a (rows x cols) operand (the last two dims of t): row-major with leading
// dimension ld, or transposed (column-major). Anything else is copied to a dense scratch.
struct Operand {
  at::Tensor t;
  int trans = kNoTrans;
  int64_t ld = 0;
};

Operand operand(ZeroCopy& zc, const at::Tensor& t) {
  const int64_t rows = t.size(-2), cols = t.size(-1), s0 = t.stride(-2), s1 = t.stride(-1);
  if (s1 == 1 && s0 >= std::max<int64_t>(1, cols)) return {t, kNoTrans, s0};
  if (s0 == 1 && s1 >= std::max<int64_t>(1, rows)) return {t, kTrans, s1};
  at::Tensor c = scratch(zc, t.sizes(), t.scalar_type());
  c.copy_(t);
  return {c, kNoTrans, std::max<int64_t>(1, cols)};
}
}  // namespace

const char* lowp_route() {
  if (onednn_matmul_usable() || cblas_gemm_f16f16f32 == nullptr || cblas_gemm_bf16bf16f32 == nullptr) {
    return "onednn-fp32";
  }
  return "mkl-mixed";
}

// Whether matmul_lowp_f32 runs MKL's mixed GEMM on a and b (into a contiguous accumulator or
// not) rather than exact fp32 copies and matmul_f32.
// MKL's mixed GEMMs convert internally and pay for it on small products: below 2^25
// multiply-adds exact fp32 copies and sgemm are faster (64x512x512: 0.7 vs 1.0 ms; 1024^3:
// 47-58 ms either way, mixed ahead at 512^3 and above; 1 thread, AVX2 host). Its fp16 GEMM
// converts more slowly than its bf16 one and loses up to 2^31 (1 thread, AVX2 host, ms for
// fp16 mixed / exact fp32 copies + sgemm / bf16 mixed: 1024x512x128 4.0 / 2.3 / 2.2;
// 128x1024x512 4.1 / 2.5 / 2.1; 1024^3 32.9 / 31.0 / 29.5; 2048^3 266 / 291 / 258): it
// made the fp16-AMP GPT step 1.24x the bf16 one.
// With AMX, MKL's bf16 GEMM is the fastest exact accumulator at every size (256^3: 25 us
// against 77 us for CPU's bf16 mm; 1024^3 1.43 ms against 6.8 ms for fp32 copies and sgemm).
bool mixed_route(const at::Tensor& a, const at::Tensor& b, bool contiguous_acc) {
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1), batch = a.dim() == 3 ? a.size(0) : 1;
  const bool amx = a.scalar_type() == at::kBFloat16 && amx_bf16();
  const int64_t min_macs = a.scalar_type() == at::kHalf ? (int64_t{1} << 31) : (int64_t{1} << 25);
  const bool large = amx || batch * m * n * k >= min_macs;
  return large && (amx || std::strcmp(lowp_route(), "mkl-mixed") == 0) && mixed_gemm(a.scalar_type()) != nullptr &&
         a.scalar_type() == b.scalar_type() && contiguous_acc && fits_int(m) && fits_int(n) && fits_int(k);
}

void matmul_lowp_f32(ZeroCopy& zc, const at::Tensor& a, const at::Tensor& b, const at::Tensor& acc,
                     float beta, float alpha) {
  const bool batched = a.dim() == 3;
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1), batch = batched ? a.size(0) : 1;
  MixedGemm gemm = mixed_gemm(a.scalar_type());
  if (!mixed_route(a, b, acc.is_contiguous() && acc.scalar_type() == at::kFloat)) {
    matmul_f32(upcast(zc, a), upcast(zc, b), acc, beta, alpha);
    return;
  }
  if (m == 0 || n == 0 || batch == 0) return;
  if (k == 0) {  // an empty sum: alpha * 0 + beta * acc
    if (beta == 0.0f) at::Tensor(acc).zero_();
    else at::Tensor(acc).mul_(beta);
    return;
  }
  const Operand A = operand(zc, a), B = operand(zc, b);
  TORCH_CHECK(fits_int(A.ld) && fits_int(B.ld), "matmul: operand strides too large for MKL's GEMM");
  const auto* pa = static_cast<const uint16_t*>(A.t.const_data_ptr());
  const auto* pb = static_cast<const uint16_t*>(B.t.const_data_ptr());
  auto* pc = static_cast<float*>(acc.data_ptr());
  const int64_t sa = batched ? A.t.stride(0) : 0, sb = batched ? B.t.stride(0) : 0;
  for (int64_t i = 0; i < batch; ++i) {
    gemm(kRowMajor, A.trans, B.trans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
         alpha, pa + i * sa, static_cast<int>(A.ld), pb + i * sb, static_cast<int>(B.ld), beta,
         pc + i * m * n, static_cast<int>(n));
  }
}

at::Tensor half_sums(ZeroCopy& zc, c10::IntArrayRef sizes, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor* self, float beta, float alpha) {
  at::Tensor acc = scratch(zc, sizes, at::kFloat);
  if (self != nullptr && beta != 0.0f) acc.copy_(self->expand(sizes));
  else beta = 0.0f;
  matmul_lowp_f32(zc, a, b, acc, beta, alpha);
  return acc;
}

void half_product(ZeroCopy& zc, const at::Tensor& o, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor* self, float beta, float alpha) {
  at::Tensor(o).copy_(half_sums(zc, o.sizes(), a, b, self, beta, alpha));  // the one rounding
}

}  // namespace torchneuron::gemm

namespace torchneuron {
namespace {

using gemm::half_product;

// The products' rule (gemm.h); convolution's sites below call gemm::routed.
using gemm::product_routed;

// Routed operands (fp16; bf16 on hosts without fast bf16 kernels) of one product, of one
// dtype and well-formed (anything else takes CPU's kernel, which also raises CPU's errors).
bool half_pair(const at::Tensor& a, const at::Tensor& b, int64_t dim) {
  return product_routed(a) && a.scalar_type() == b.scalar_type() && a.dim() == dim && b.dim() == dim &&
         a.size(-1) == b.size(-2) && (dim == 2 || a.size(0) == b.size(0)) &&
         !(a.scalar_type() == at::kBFloat16 && gemm::bf16_half_rate() && a.size(-2) < gemm::kBf16RoutedRows);
}


// oneDNN's bf16 matmul reads a column-major A (`grad_output.t() @ input`: every weight gradient
// of a linear layer) through a reorder it repeats for each block of B's columns, which costs
// more the wider B is. Where a row-major copy of A first (transpose.h, at memory speed) wins:
// B's columns >= kRowMajorColumns, or rows >= kRowMajorRows with columns >= 512; bf16 `mm`, 2
// threads, AMX host, time with the copy / without it (docs/benchmarks.md): 1024 x 1024 x 2048
// 0.64, 768 x 2048 x 3072 0.58, 4096 x 2048 x 3072 0.34, 2048 x 512 x 512 0.82, 256 x 256 x
// 2048 0.87, 64 x 2048 x 1536 0.83; but 1024 x 1024 x 1024 1.37, 512 x 512 x 512 1.6 and 768 x
// 2048 x 768 1.39, where oneDNN's kernel for a column-major A is faster than for a row-major one.
// oneDNN's sums for the two layouts are the same on most shapes and one bf16 ulp apart in a few
// elements on others (1024 x 1024 x 2048: 169 of 2 M), so these products are not CPU's bits.
constexpr int64_t kRowMajorColumns = 1536, kRowMajorRows = 2048, kRowMajorElements = 65536;
bool row_major_first(const at::Tensor& a, const at::Tensor& b) {
  const int64_t d = a.dim();
  if (a.scalar_type() != at::kBFloat16 || b.scalar_type() != at::kBFloat16 || product_routed(a) || d < 2 ||
      b.dim() != d || a.stride(d - 2) != 1 || a.stride(d - 1) != a.size(d - 2)) {
    return false;
  }
  const int64_t m = a.size(d - 2), n = b.size(d - 1);
  return m * a.size(d - 1) >= kRowMajorElements && (n >= kRowMajorColumns || (m >= kRowMajorRows && n >= 512));
}

// CPU's mm_out (bmm_out when batched). With `row` defined (a scratch of a's sizes and dtype, for
// row_major_first), A is first copied into it row-major.
void cpu_product(at::Tensor o, const at::Tensor& a, const at::Tensor& b, const at::Tensor& row, bool batched) {
  const at::Tensor& ra = row.defined() && transpose::try_copy(row, a) ? row : a;
  if (batched) at::cpu::bmm_out(o, ra, b);
  else at::cpu::mm_out(o, ra, b);
}

// The synchronous call's scratch for cpu_product (undefined where row_major_first says no).
at::Tensor row_scratch(ZeroCopy& zc, const at::Tensor& a, const at::Tensor& b) {
  return row_major_first(a, b) ? gemm::scratch(zc, a.sizes(), a.scalar_type()) : at::Tensor();
}
// A queued kernel's, in its arena (QueuedCall::arena, allocated at the call): the kernel may not
// enter the device pool, and host memory would fault its pages in on every call.
at::Tensor row_scratch(QueuedCall& q, const at::Tensor& a, const at::Tensor& b) {
  if (!row_major_first(a, b)) return at::Tensor();
  return q.arena(a.numel() * static_cast<int64_t>(a.element_size())).view(a.scalar_type()).view(a.sizes());
}

// Queues half_product. Its temporaries (the fp32 accumulator and, off MKL's mixed GEMM, the
// operands' exact fp32 copies) come from one device block allocated here, the kernel's scratch
// arena (ZeroCopy::set_scratch_arena): from host memory they cost their pages' faults on
// every call (a 4096 x 4096 weight's copy: 64 MiB).
// With `fusible` (mm's device result), Adaptive Eager may run it with the widening of an int8
// weight before it (fusion.cpp, MatmulKernel::kRouted), in the same arena.
void enqueue_half_product(QueuedCall& q, const char* name, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& o, const std::optional<at::Tensor>& self, float beta, float alpha,
                          const at::Tensor* fusible = nullptr) {
  const bool mixed = gemm::mixed_route(a, b, true);
  int64_t bytes = gemm::arena_bytes(o.numel());
  if (!mixed) bytes += gemm::arena_bytes(a.numel()) + gemm::arena_bytes(b.numel());
  at::Tensor arena = q.arena(bytes);
  auto record = fusible != nullptr && !mixed && a.scalar_type() == at::kBFloat16 && fusion::tiles_enabled()
                    ? fusion::matmul(*fusible, a, b, fusion::MatmulKernel::kRouted, arena)
                    : nullptr;
  q.enqueue(
      name,
      [a, b, o, self, beta, alpha, arena] {
        ZeroCopy zc(ZeroCopy::Queued{});
        zc.set_scratch_arena(arena);
        half_product(zc, o, a, b, self ? &*self : nullptr, beta, alpha);
      },
      std::move(record));
}

// ---- mm / addmm / bmm / baddbmm: results from the device pool ------------------------------
// The functional CPU kernels allocate results with the host allocator (fresh pages for large
// results on every call); the device's caching allocator avoids that.
//
// With the execution engine on (or a graph capturing) a product is queued (enqueue.h) when CPU's
// out= kernel can raise nothing: neuron operands of one device and floating dtype, shapes that
// multiply, a bias that broadcasts to the result, numbers the dtype holds. Its result is
// contiguous, as CPU's. Routed dtypes (fp16; bf16 on hosts without AVX512-BF16) are queued too:
// their kernel is the synchronous path's exact product (half_product), its fp32 temporaries
// taken from the host when it runs (scratch).
bool queueable_product(const at::Tensor& a, const at::Tensor& b, int64_t dim) {
  return may_enqueue() && a.is_privateuseone() && c10::isFloatingType(a.scalar_type()) &&
         queueable_like(a, a) && queueable_like(a, b) && a.dim() == dim && b.dim() == dim &&
         a.size(-1) == b.size(-2) && (dim == 2 || a.size(0) == b.size(0));
}

bool queueable_bias(const at::Tensor& self, const at::Tensor& a, c10::IntArrayRef out_sizes,
                    const at::Scalar& beta, const at::Scalar& alpha) {
  if (!queueable_like(a, self) || !at::is_expandable_to(self.sizes(), out_sizes) || beta.isComplex() ||
      alpha.isComplex()) {
    return false;
  }
  try {  // the kernel converts the numbers (an out-of-range one raises): raise at the call instead
    (void)beta.to<float>();
    (void)alpha.to<float>();
  } catch (const c10::Error&) {
    return false;  // the synchronous path raises CPU's error
  }
  return true;
}

bool gemv_kernel(const at::Tensor& t);

// A one-row product (a linear layer of a decode step with one sequence) runs gemv.h's
// matrix-vector kernel where it runs for the dtype (gemv_kernel): 1 x 4096 x 4096 with B =
// W.t(), 2 cores: bf16 on a half-rate host 1,392 -> 814 us, fp16 on AVX512-FP16 1,161 -> 778 us
// (oneDNN's GEMM on one row against a read of W at memory speed). B needs a unit stride.
bool row_gemv(const at::Tensor& a, const at::Tensor& b) {
  return a.dim() == 2 && b.dim() == 2 && a.size(0) == 1 && a.scalar_type() == b.scalar_type() &&
         a.size(1) == b.size(0) && (b.stride(0) == 1 || b.stride(1) == 1) && gemv_kernel(a);
}
// o (1 x n, contiguous) = round(beta * s + alpha * a @ b) as the matrix-vector product b.t() @ a[0];
// s (broadcast to 1 x n) only read with beta != 0. Not for alpha = 0: the kernel then reads no
// product (BLAS's gemv), where CPU's addmm still gives NaN for an inf one.
void row_gemv_out(const at::Tensor& o, const at::Tensor& a, const at::Tensor& b, const at::Tensor* s,
                  float beta, float alpha) {
  const int64_t n = b.size(1);
  const at::Tensor ov = o.view({n});
  const at::Tensor sv = s != nullptr && beta != 0.0f ? s->expand({1, n}).select(0, 0) : ov;
  // (row_gemv guarantees a layout the kernel reads)
  TORCH_INTERNAL_ASSERT(gemv::gemv(ov, sv, b.t(), a.select(0, 0), s != nullptr ? beta : 0.0f, alpha));
}

// A product of a few rows (decode steps of several sequences) with B = W.t() (nn.Linear's weight)
// runs gemv.h's few-row kernel where that kernel runs for the dtype: each weight row read
// once and widened in registers against 4 activation rows at a time. Against CPU's kernel (2
// cores, x @ W.t(), median of 7 x 20 calls, us): bf16 on a half-rate host, k = n = 4096: 2 rows
// 1,126 / 1,759, 4 1,523 / 2,345, 8 2,202 / 2,930, 16 3,542 / 4,543, but 32 8,194 / 7,845; fp16
// with AVX512-FP16 (oneDNN's fp16 kernel): 2 rows 1,085 / 2,451, 8 2,673 / 3,189, but 16 4,742 /
// 3,969. Hence up to 16 rows in bf16, 8 in fp16.
bool few_rows(const at::Tensor& a, const at::Tensor& b) {
  const int64_t most = a.scalar_type() == at::kBFloat16 ? gemv::kFewRowsBf16 : gemv::kFewRowsFp16;
  return a.dim() == 2 && b.dim() == 2 && a.size(0) >= 2 && a.size(0) <= most &&
         a.scalar_type() == b.scalar_type() && a.size(1) == b.size(0) && a.size(1) > 0 && b.stride(0) == 1 &&
         gemv_kernel(a);
}

// o = round(alpha * a @ b + beta * s) on the few-row kernel (few_rows guarantees its layout).
void few_rows_out(const at::Tensor& o, const at::Tensor* s, const at::Tensor& a, const at::Tensor& b, float beta,
                  float alpha) {
  TORCH_INTERNAL_ASSERT(gemv::few_rows(o, s, a, b.t(), beta, alpha));
}

at::Tensor mm_hot(const at::Tensor& self, const at::Tensor& mat2) {
  if (queueable_product(self, mat2, 2)) {
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), out;
    at::Tensor o = q.out(out, {a.size(0), b.size(1)}, a.scalar_type());
    // (bf16: Adaptive Eager may run these with the widening of an int8 weight before them and a
    // column product after, gemv::few_rows_bf16)
    const bool fusible = a.scalar_type() == at::kBFloat16 && fusion::tiles_enabled();
    if (row_gemv(a, b)) {
      q.enqueue("aten::mm", [a, b, o] { row_gemv_out(o, a, b, nullptr, 0.0f, 1.0f); },
                fusible ? fusion::matmul(out, self, mat2, fusion::MatmulKernel::kFewRows) : nullptr);
    } else if (few_rows(a, b)) {
      q.enqueue("aten::mm", [a, b, o] { few_rows_out(o, nullptr, a, b, 0.0f, 1.0f); },
                fusible ? fusion::matmul(out, self, mat2, fusion::MatmulKernel::kFewRows) : nullptr);
    } else if (half_pair(a, b, 2)) {
      enqueue_half_product(q, "aten::mm", a, b, o, std::nullopt, 0.0f, 1.0f, &out);
    } else if (gemm::amx_mm(a, b)) {
      q.enqueue("aten::mm", [a, b, o] { gemm::amx_mm_out(o, a, b); },
                fusible ? fusion::matmul(out, self, mat2, fusion::MatmulKernel::kAmx) : nullptr);
    } else {
      at::Tensor row = row_scratch(q, a, b);
      q.enqueue("aten::mm", [a, b, o, row] { cpu_product(o, a, b, row, false); });
    }
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2);
  zc.launch("aten::mm");
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != b.scalar_type()) return zc.out(at::cpu::mm(a, b));
  at::Tensor out = pooled(zc, {a.size(0), b.size(1)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (row_gemv(a, b)) row_gemv_out(o, a, b, nullptr, 0.0f, 1.0f);
  else if (few_rows(a, b)) few_rows_out(o, nullptr, a, b, 0.0f, 1.0f);
  else if (half_pair(a, b, 2)) half_product(zc, o, a, b, nullptr, 0.0f, 1.0f);
  else if (gemm::amx_mm(a, b)) gemm::amx_mm_out(o, a, b);
  else cpu_product(o, a, b, row_scratch(zc, a, b), false);
  zc.sync_inputs();
  return out;
}

at::Tensor addmm_hot(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  if (queueable_product(mat1, mat2, 2) && queueable_bias(self, mat1, {mat1.size(0), mat2.size(1)}, beta, alpha)) {
    QueuedCall q;
    at::Tensor s = q.in(self), a = q.in(mat1), b = q.in(mat2), out;
    at::Tensor o = q.out(out, {a.size(0), b.size(1)}, a.scalar_type());
    // (queueable_bias: the bias has the operands' dtype and broadcasts to the result)
    if (row_gemv(a, b) && alpha.toFloat() != 0.0f) {
      q.enqueue("aten::addmm", [s, a, b, o, beta = beta.toFloat(), alpha = alpha.toFloat()] {
        row_gemv_out(o, a, b, &s, beta, alpha);
      });
    } else if (few_rows(a, b) && alpha.toFloat() != 0.0f) {
      q.enqueue("aten::addmm", [s, a, b, o, beta = beta.toFloat(), alpha = alpha.toFloat()] {
        few_rows_out(o, &s, a, b, beta, alpha);
      });
    } else if (half_pair(a, b, 2)) {
      enqueue_half_product(q, "aten::addmm", a, b, o, s, beta.toFloat(), alpha.toFloat());
    } else if (gemm::amx_addmm(s, a, b, beta, alpha)) {
      q.enqueue("aten::addmm", [s, a, b, o] { gemm::amx_mm_out(o, a, b, &s); });
    } else {
      q.enqueue("aten::addmm", [s, a, b, o, beta, alpha]() mutable { at::cpu::addmm_out(o, s, a, b, beta, alpha); });
    }
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(mat1), b = zc.in(mat2);
  zc.launch("aten::addmm");
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != b.scalar_type()) {
    return zc.out(at::cpu::addmm(s, a, b, beta, alpha));
  }
  at::Tensor out = pooled(zc, {a.size(0), b.size(1)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  const bool bias_ok = s.scalar_type() == a.scalar_type() && at::is_expandable_to(s.sizes(), o.sizes());
  if (row_gemv(a, b) && bias_ok && alpha.toFloat() != 0.0f) {
    row_gemv_out(o, a, b, &s, beta.toFloat(), alpha.toFloat());
  } else if (few_rows(a, b) && bias_ok && alpha.toFloat() != 0.0f) {
    few_rows_out(o, &s, a, b, beta.toFloat(), alpha.toFloat());
  } else if (half_pair(a, b, 2) && bias_ok) {
    half_product(zc, o, a, b, &s, beta.toFloat(), alpha.toFloat());
  } else if (gemm::amx_addmm(s, a, b, beta, alpha)) {
    gemm::amx_mm_out(o, a, b, &s);
  } else {
    at::cpu::addmm_out(o, s, a, b, beta, alpha);
  }
  zc.sync_inputs();
  return out;
}

at::Tensor bmm_hot(const at::Tensor& self, const at::Tensor& mat2) {
  if (queueable_product(self, mat2, 3)) {
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), out;
    at::Tensor o = q.out(out, {a.size(0), a.size(1), b.size(2)}, a.scalar_type());
    if (half_pair(a, b, 3)) {
      enqueue_half_product(q, "aten::bmm", a, b, o, std::nullopt, 0.0f, 1.0f);
    } else {
      at::Tensor row = row_scratch(q, a, b);
      q.enqueue("aten::bmm", [a, b, o, row] { cpu_product(o, a, b, row, true); });
    }
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2);
  zc.launch("aten::bmm");
  if (a.dim() != 3 || b.dim() != 3 || a.scalar_type() != b.scalar_type()) return zc.out(at::cpu::bmm(a, b));
  at::Tensor out = pooled(zc, {a.size(0), a.size(1), b.size(2)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (half_pair(a, b, 3)) half_product(zc, o, a, b, nullptr, 0.0f, 1.0f);
  else cpu_product(o, a, b, row_scratch(zc, a, b), true);
  zc.sync_inputs();
  return out;
}

at::Tensor baddbmm_hot(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  if (queueable_product(batch1, batch2, 3) &&
      queueable_bias(self, batch1, {batch1.size(0), batch1.size(1), batch2.size(2)}, beta, alpha)) {
    QueuedCall q;
    at::Tensor s = q.in(self), a = q.in(batch1), b = q.in(batch2), out;
    at::Tensor o = q.out(out, {a.size(0), a.size(1), b.size(2)}, a.scalar_type());
    if (half_pair(a, b, 3)) {
      enqueue_half_product(q, "aten::baddbmm", a, b, o, s, beta.toFloat(), alpha.toFloat());
    } else {
      q.enqueue("aten::baddbmm", [s, a, b, o, beta, alpha]() mutable {
        at::cpu::baddbmm_out(o, s, a, b, beta, alpha);
      });
    }
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(batch1), b = zc.in(batch2);
  zc.launch("aten::baddbmm");
  if (a.dim() != 3 || b.dim() != 3 || a.scalar_type() != b.scalar_type()) {
    return zc.out(at::cpu::baddbmm(s, a, b, beta, alpha));
  }
  at::Tensor out = pooled(zc, {a.size(0), a.size(1), b.size(2)}, a.scalar_type());
  at::Tensor o = zc.in_output(out);
  if (half_pair(a, b, 3) && s.scalar_type() == a.scalar_type() && at::is_expandable_to(s.sizes(), o.sizes())) {
    half_product(zc, o, a, b, &s, beta.toFloat(), alpha.toFloat());
  } else {
    at::cpu::baddbmm_out(o, s, a, b, beta, alpha);
  }
  zc.sync_inputs();
  return out;
}

// out= forms (Inductor's extern kernels call these): fp16 computes the functional result and
// copies it into `out`; other dtypes run CPU's out= kernel on aliases, as the fallback would,
// queued (so compiled graphs stay asynchronous and can be recorded by a graph capture) when it
// can raise nothing: `out` already has the result's sizes and the operands' dtype (else CPU's
// kernel resizes it or raises), no element of it is written twice, and it shares no memory with
// the operands (a bias it is, in place, aside: addmm_ and baddbmm_ are out= calls on self).
bool half_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, int64_t dim) {
  return product_routed(out) && half_pair(a, b, dim);
}

bool queueable_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, c10::IntArrayRef sizes,
                   const at::Tensor* bias = nullptr) {
  return queueable_like(a, out) && out.sizes() == sizes && at::has_internal_overlap(out) == at::MemOverlap::No &&
         disjoint_memory(out, a) && disjoint_memory(out, b) &&
         (bias == nullptr || out.is_same(*bias) || disjoint_memory(out, *bias));
}

// Whether an out= product of a and b may run on the AMX kernel (gemm::amx_mm) into `out`: bf16,
// the result's sizes, rows of unit stride apart, disjoint from the operands (else CPU's kernel
// resizes, raises or reads what it writes). Inductor's extern calls then take the eager route.
bool amx_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  return gemm::amx_mm(a, b) && out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == a.size(0) &&
         out.size(1) == b.size(1) && out.stride(1) == 1 && out.stride(0) >= out.size(1) && !out.is_conj() &&
         !out.is_neg() && disjoint_memory(out, a) && disjoint_memory(out, b);
}

at::Tensor& copy_into(at::Tensor& out, const at::Tensor& r) {
  at::native::resize_output(out, r.sizes());
  out.copy_(r);
  return out;
}

// Products the one-row and few-row kernels take: their out= forms (Inductor's extern calls,
// ATen's _grouped_mm composite) take the functional route and copy its small result, so both
// forms run those kernels and give the same bits (the callers require out of a's dtype).
bool small_product(const at::Tensor& a, const at::Tensor& b) { return row_gemv(a, b) || few_rows(a, b); }

at::Tensor& mm_out(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  const bool half = half_out(out, self, mat2, 2);
  if ((half || small_product(self, mat2)) && out.scalar_type() == self.scalar_type()) {
    return copy_into(out, mm_hot(self, mat2));
  }
  const bool amx = amx_out(out, self, mat2);
  if (!half && queueable_product(self, mat2, 2) && queueable_out(out, self, mat2, {self.size(0), mat2.size(1)})) {
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), o = q.inout(out);
    at::Tensor row = amx ? at::Tensor() : row_scratch(q, a, b);
    if (amx) q.enqueue("aten::mm.out", [a, b, o] { gemm::amx_mm_out(o, a, b); });
    else q.enqueue("aten::mm.out", [a, b, o, row] { cpu_product(o, a, b, row, false); });
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2), o = zc.in_output(out);
  zc.launch("aten::mm.out");
  if (amx) gemm::amx_mm_out(o, a, b);
  else cpu_product(o, a, b, row_scratch(zc, a, b), false);
  zc.sync_inputs();
  return out;
}

at::Tensor& addmm_out(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  const bool half = half_out(out, mat1, mat2, 2);
  // (alpha = 0 keeps CPU's kernel: addmm_hot's one-row and few-row routes exclude it)
  const bool small = small_product(mat1, mat2) && !alpha.isComplex() && alpha.toDouble() != 0.0;
  if ((half || small) && self.scalar_type() == mat1.scalar_type() && out.scalar_type() == mat1.scalar_type()) {
    return copy_into(out, addmm_hot(self, mat1, mat2, beta, alpha));
  }
  const std::vector<int64_t> sizes = {mat1.size(0), mat2.size(1)};
  const bool amx = !out.is_same(self) && disjoint_memory(out, self) && amx_out(out, mat1, mat2) &&
                   gemm::amx_addmm(self, mat1, mat2, beta, alpha);
  if (!half && queueable_product(mat1, mat2, 2) && queueable_bias(self, mat1, sizes, beta, alpha) &&
      queueable_out(out, mat1, mat2, sizes, &self)) {
    QueuedCall q;
    at::Tensor s = out.is_same(self) ? at::Tensor() : q.in(self), a = q.in(mat1), b = q.in(mat2), o = q.inout(out);
    if (amx) {
      q.enqueue("aten::addmm.out", [s, a, b, o] { gemm::amx_mm_out(o, a, b, &s); });
      return out;
    }
    q.enqueue("aten::addmm.out", [s, a, b, o, beta, alpha]() mutable {
      at::cpu::addmm_out(o, s.defined() ? s : o, a, b, beta, alpha);
    });
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(mat1), b = zc.in(mat2), o = zc.in_output(out);
  zc.launch("aten::addmm.out");
  if (amx) gemm::amx_mm_out(o, a, b, &s);
  else at::cpu::addmm_out(o, s, a, b, beta, alpha);
  zc.sync_inputs();
  return out;
}

at::Tensor& bmm_out(const at::Tensor& self, const at::Tensor& mat2, at::Tensor& out) {
  const bool half = half_out(out, self, mat2, 3);
  if (half && out.scalar_type() == self.scalar_type()) return copy_into(out, bmm_hot(self, mat2));
  if (!half && queueable_product(self, mat2, 3) &&
      queueable_out(out, self, mat2, {self.size(0), self.size(1), mat2.size(2)})) {
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), o = q.inout(out);
    at::Tensor row = row_scratch(q, a, b);
    q.enqueue("aten::bmm.out", [a, b, o, row] { cpu_product(o, a, b, row, true); });
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2), o = zc.in_output(out);
  zc.launch("aten::bmm.out");
  cpu_product(o, a, b, row_scratch(zc, a, b), true);
  zc.sync_inputs();
  return out;
}

at::Tensor& baddbmm_out(const at::Tensor& self, const at::Tensor& batch1, const at::Tensor& batch2,
                        const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  const bool half = half_out(out, batch1, batch2, 3);
  if (half && self.scalar_type() == batch1.scalar_type() && out.scalar_type() == batch1.scalar_type()) {
    return copy_into(out, baddbmm_hot(self, batch1, batch2, beta, alpha));
  }
  const std::vector<int64_t> sizes = {batch1.size(0), batch1.size(1), batch2.size(2)};
  if (!half && queueable_product(batch1, batch2, 3) && queueable_bias(self, batch1, sizes, beta, alpha) &&
      queueable_out(out, batch1, batch2, sizes, &self)) {
    QueuedCall q;
    at::Tensor s = out.is_same(self) ? at::Tensor() : q.in(self), a = q.in(batch1), b = q.in(batch2),
               o = q.inout(out);
    q.enqueue("aten::baddbmm.out", [s, a, b, o, beta, alpha]() mutable {
      at::cpu::baddbmm_out(o, s.defined() ? s : o, a, b, beta, alpha);
    });
    return out;
  }
  ZeroCopy zc;
  at::Tensor s = zc.in(self), a = zc.in(batch1), b = zc.in(batch2), o = zc.in_output(out);
  zc.launch("aten::baddbmm.out");
  at::cpu::baddbmm_out(o, s, a, b, beta, alpha);
  zc.sync_inputs();
  return out;
}

// ---- matrix-vector and dot ----------------------------------------------------------------
// mv (CompositeExplicitAutograd) lands in addmv.out. A matrix-vector product (and dot) is bound
// by reading the matrix, and CPU's fp16/bf16 gemv and dot kernels already keep TensorE's
// contract (fp32 sums, one rounding: 100 % of the results equal to the once-rounded exact value
// at k = 4096, with or without beta) while reading half fp32's bytes (Ice Lake, mv 1024^2: fp16
// 78 us, bf16 96 us, against 250-278 us through an fp32 copy). So the 16-bit dtypes keep CPU's
// kernels wherever oneDNN is usable (AVX-512), and are routed (fp32 gemv, one rounding) only
// on the other hosts, where they were measured slow (AVX2; docs/benchmarks.md).
bool gemv_routed(const at::Tensor& t) {
  return (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) && !gemm::onednn_matmul_usable();
}

// Where ATen's fp16 GEMMs are oneDNN's (AVX512-FP16), so is its fp16 gemv, a matmul primitive on
// one column: 262 us for 1024^2 against 64 us in bf16. gemv.h reads the matrix directly
// (either layout) with the same contract.
// bf16 likewise where its dot products run at half rate (gemm.h, bf16_half_rate): CPU's bf16
// gemv took 309 us there for 1024^2.
bool gemv_kernel(const at::Tensor& t) {
  return ((t.scalar_type() == at::kHalf && gemm::cpu_fast_fp16()) ||
          (t.scalar_type() == at::kBFloat16 && gemm::bf16_half_rate())) &&
         gemv::available();
}

at::Tensor& addmv_out(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  ZeroCopy zc;
  at::Tensor s = zc.in(self), m = zc.in(mat), v = zc.in(vec), o = zc.in_output(out);
  zc.launch("aten::addmv.out");
  const auto dt = m.scalar_type();
  // operands of one dtype that multiply (anything else: CPU's kernel, which raises CPU's errors)
  const bool well_formed = v.scalar_type() == dt && s.scalar_type() == dt && o.scalar_type() == dt && m.dim() == 2 &&
                           v.dim() == 1 && m.size(1) == v.size(0) && at::is_expandable_to(s.sizes(), {m.size(0)});
  const bool half = well_formed && gemv_routed(m);
  if (well_formed && gemv_kernel(m)) {
    at::native::resize_output(o, {m.size(0)});
    if (gemv::gemv(o, s, m, v, beta.toFloat(), alpha.toFloat())) {
      zc.sync_inputs();
      return out;
    }
  }
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
  if (gemv_routed(a) && b.scalar_type() == a.scalar_type() && a.dim() == 1 && b.dim() == 1 && a.numel() == b.numel()) {
    return zc.out(at::cpu::dot(gemm::upcast(zc, a), gemm::upcast(zc, b)).to(a.scalar_type()));
  }
  return zc.out(at::cpu::dot(a, b));
}

// ---- convolution ----------------------------------------------------------------------
// at::_convolution sends devices it does not know to the "overrideable" entry points; run the
// CPU convolution (which picks mkldnn/slow paths itself) over aliases of the device memory.
// Routed dtypes (fp16: CPU 135x bf16's time; bf16 without AVX-512: 19x fp32's) run CPU's fp32
// convolution (oneDNN) on exact fp32 copies and round once. A 2-d convolution's copies are made
// channels-last: oneDNN's fp32 kernels run 2.6x faster on that layout than on NCHW
// (8x32x32x32, k3: 0.68 vs 1.78 ms). Widening in place and then transposing (transpose.h) beats
// CPU's copy doing both at once (0.03 + 0.09 vs 0.20 ms there).
at::Tensor upcast_conv(ZeroCopy& zc, const at::Tensor& t, bool channels_last) {
  at::Tensor wide = gemm::upcast(zc, t);
  if (!channels_last || t.dim() != 4 || wide.is_contiguous(at::MemoryFormat::ChannelsLast)) return wide;
  at::Tensor out = gemm::scratch(zc, t.sizes(), at::kFloat, c10::get_channels_last_strides_2d(t.sizes()));
  if (!transpose::try_copy(out, wide)) out.copy_(wide);
  return out;
}
// Queued (the engine on, or a graph capturing; enqueue.h) when input, weight and bias are neuron
// tensors of one unrouted floating dtype: at::_convolution checked their shapes before calling
// here, so the result's sizes (CPU's formula, ConvUtils.h) are all the kernel could get wrong.
// The kernel runs CPU's convolution and copies its result into the one allocated at the call
// (in neuron's layout, gemm::conv_strides; CPU has no out= convolution). The copy costs a pass over the output,
// ~2 % of a 3x3 convolution's time.
bool queueable_conv(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return may_enqueue() && input.is_privateuseone() && c10::isFloatingType(input.scalar_type()) && !gemm::routed(input) &&
         queueable_like(input, input) && queueable_like(input, weight) && queueable_opt(input, bias) &&
         input.dim() == weight.dim() && input.dim() >= 3 && input.numel() > 0 && weight.numel() > 0;
}
// A result of CPU's convolution in the layout neuron gives (gemm::conv_strides): CPU's own
// choice except for 3-d convolutions on its slow kernels (contiguous there).
at::Tensor in_conv_layout(const at::Tensor& t, const std::vector<int64_t>& strides, c10::ScalarType dtype) {
  bool same = t.scalar_type() == dtype;
  for (int64_t i = 0; same && i < t.dim(); ++i) same = t.size(i) == 1 || t.stride(i) == strides[i];
  if (same) return t;
  at::Tensor out = at::empty_strided(t.sizes(), strides, t.options().dtype(dtype));
  out.copy_(t);
  return out;
}
std::vector<int64_t> ints(c10::SymIntArrayRef v) { return C10_AS_INTARRAYREF_SLOW(v).vec(); }

at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                                    c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                    bool transposed, c10::SymIntArrayRef output_padding,
                                    c10::SymInt groups) {
  if (queueable_conv(input, weight, bias)) {
    const int64_t g = groups.expect_int();
    const auto st = ints(stride), pad = ints(padding), dil = ints(dilation), opad = ints(output_padding);
    const std::vector<int64_t> sizes =
        transposed ? at::native::conv_input_size(input.sizes(), weight.sizes(), pad, opad, st, dil, g)
                   : at::native::conv_output_size(input.sizes(), weight.sizes(), pad, st, dil);
    QueuedCall q;
    at::Tensor x = q.in(input), w = q.in(weight), out;
    std::optional<at::Tensor> b = q.in(bias);
    at::Tensor o = q.out(out, sizes, input.scalar_type(), gemm::conv_strides(input, weight, sizes));
    q.enqueue("aten::convolution_overrideable", [x, w, b, o, st, pad, dil, transposed, opad, g]() mutable {
      o.copy_(at::convolution(x, w, b, st, pad, dil, transposed, opad, g));
    });
    return out;
  }
  ZeroCopy zc;
  at::Tensor in = zc.in(input), w = zc.in(weight);
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) b = zc.in(*bias);
  zc.launch("aten::convolution_overrideable");
  zc.trace_meta("transposed", transposed ? "true" : "false");
  zc.trace_meta("groups", std::to_string(groups.expect_int()));
  const auto dt = in.scalar_type();
  const bool half = gemm::routed(in) && w.scalar_type() == dt && (!b || b->scalar_type() == dt);
  if (half) {
    const bool cl = !transposed && in.dim() == 4 && w.dim() == 4;
    in = upcast_conv(zc, in, cl);
    w = upcast_conv(zc, w, cl);
    if (b) b = gemm::upcast(zc, *b);
  }
  at::Tensor out = at::convolution_symint(in, w, b, stride, padding, dilation, transposed,
                                          output_padding, std::move(groups));
  return zc.out(in_conv_layout(out, gemm::conv_strides(input, weight, out.sizes()), dt));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::SymIntArrayRef stride, c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
    bool transposed, c10::SymIntArrayRef output_padding, c10::SymInt groups,
    std::array<bool, 3> output_mask) {
  if (queueable_conv(input, weight, std::nullopt) && queueable_like(input, grad_output) &&
      grad_output.dim() == input.dim()) {
    const int64_t g = groups.expect_int();
    const auto st = ints(stride), pad = ints(padding), dil = ints(dilation), opad = ints(output_padding);
    QueuedCall q;
    at::Tensor go = q.in(grad_output), x = q.in(input), w = q.in(weight), gi, gw, gb, gio, gwo, gbo;
    if (output_mask[0]) gio = q.out(gi, input.sizes(), input.scalar_type(), gemm::conv_strides(input, weight, input.sizes()));
    if (output_mask[1]) gwo = q.out(gw, weight.sizes(), input.scalar_type(), gemm::conv_strides(input, weight, weight.sizes()));
    if (output_mask[2]) gbo = q.out(gb, {grad_output.size(1)}, input.scalar_type());
    q.enqueue("aten::convolution_backward_overrideable",
              [go, x, w, gio, gwo, gbo, st, pad, dil, transposed, opad, g, output_mask]() mutable {
                const std::vector<int64_t> bias_sizes{go.size(1)};
                auto grads = at::convolution_backward(
                    go, x, w, output_mask[2] ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef(std::nullopt),
                    st, pad, dil, transposed, opad, g, output_mask);
                if (output_mask[0]) gio.copy_(std::get<0>(grads));
                if (output_mask[1]) gwo.copy_(std::get<1>(grads));
                if (output_mask[2]) gbo.copy_(std::get<2>(grads));
              });
    return std::make_tuple(gi, gw, gb);
  }
  ZeroCopy zc;
  at::Tensor go = zc.in(grad_output), in = zc.in(input), w = zc.in(weight);
  std::vector<c10::SymInt> bias_sizes{grad_output.sym_size(1)};
  zc.launch("aten::convolution_backward_overrideable");
  zc.trace_meta("transposed", transposed ? "true" : "false");
  zc.trace_meta("groups", std::to_string(groups.expect_int()));
  const auto dt = in.scalar_type();
  const bool half = gemm::routed(in) && go.scalar_type() == dt && w.scalar_type() == dt;
  if (half) {
    const bool cl = !transposed && in.dim() == 4 && w.dim() == 4;
    go = upcast_conv(zc, go, cl);
    in = upcast_conv(zc, in, cl);
    w = upcast_conv(zc, w, cl);
  }
  auto grads = at::convolution_backward_symint(
      go, in, w,
      output_mask[2] ? at::OptionalSymIntArrayRef(bias_sizes) : at::OptionalSymIntArrayRef(std::nullopt),
      stride, padding, dilation, transposed, output_padding, std::move(groups), output_mask);
  // In neuron's layout (CPU's fp32 kernel may have run on channels-last copies) and dtype.
  auto back = [&](const at::Tensor& g) {
    if (!g.defined()) return g;
    return zc.out(in_conv_layout(g, g.dim() == 1 ? std::vector<int64_t>{1} : gemm::conv_strides(input, weight, g.sizes()), dt));
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
