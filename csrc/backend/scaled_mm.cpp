#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Low-precision GEMMs on neuron: fp8 torch._scaled_mm and int8 torch._int_mm.
//
// TensorE multiplies fp8 exactly and accumulates in fp32. Every float8_e4m3fn and float8_e5m2
// value is a bf16 value (3 or 2 mantissa bits, exponents well inside bf16's range), so an fp8
// GEMM is a bf16 GEMM on exactly converted operands (fp8.h): products exact, fp32 accumulation.
// CPU's own _scaled_mm (without AMX) widens to fp32 through a scalar conversion and runs
// MKL's sgemm: 5-7x a bf16 matmul. Here, in order of preference:
//   - on an AMX host with B column-major (any scaling but the DeepSeek block ones): amx_gemm.h's
//     kernel reads the fp8 codes (the weight widened in cache, the activations packed once) and
//     its epilogue applies alpha, the row/column scales and the bias and rounds once;
//   - bf16 output with tensor-wise scales (and no bias or a bf16 bias), large enough for
//     oneDNN: exact bf16 copies (fp8.h's vectorized conversion) into one oneDNN bf16
//     GEMM whose epilogue applies scale_a * scale_b (and adds the bias) and rounds once;
//   - anything else on an AMX host (gemm::amx_bf16()) with 128 rows or more: exact bf16
//     copies into MKL's bf16 x bf16 -> fp32 GEMM (AMX tiles), then the epilogue over its fp32
//     accumulator;
//   - anything else where the CPU has AVX512-BF16: bf16_gemm.h's kernel reads the fp8 codes
//     (widened while packed) and applies alpha, the row/column scales and the bias to its fp32
//     sums, writing a bf16/fp32 result itself (other dtypes round from its fp32 result);
//   - otherwise the fp32 accumulator from MKL's bf16 x bf16 -> fp32 GEMM (hosts without
//     oneDNN) or an fp32 GEMM on exact fp32 copies, then the epilogue in fp32, one rounding.
// use_fast_accum is accepted and ignored: PSUM accumulates in fp32 either way.
// Semantics otherwise follow CPU's kernel (scale_result divides an fp8 output, the default
// output dtype is mat_a's).
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_int_mm_cpu_dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "allocator.h"
#include "amx_gemm.h"
#include "bf16_gemm.h"
#include "enqueue.h"
#include "cpu_features.h"
#include "fp8.h"
#include "gemm.h"
#include "gemv.h"

namespace torchneuron {
namespace {

// Exact copy of an fp8 tensor as bf16 or fp32 in a scratch buffer of the same dense layout
// (fp8.h's conversion: c10's values).
at::Tensor widen_fp8(ZeroCopy& zc, const at::Tensor& t, c10::ScalarType to) {
  const at::Tensor src = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  at::Tensor dst = gemm::scratch(zc, src.sizes(), to, src.strides());
  const auto* in = static_cast<const uint8_t*>(src.const_data_ptr());
  auto* out = static_cast<char*>(dst.data_ptr());
  const int64_t width = dst.element_size();
  at::parallel_for(0, src.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    fp8::convert(in + begin, src.scalar_type(), out + begin * width, to, end - begin);
  });
  return dst;
}

bool fp8(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat8_e4m3fn || t.scalar_type() == at::kFloat8_e5m2;
}

// Off the fused kernel, acc (fp32, contiguous) = alpha * a @ b over exactly widened fp8 operands
// (2-d or 3-d), the fp32 accumulator itself: MKL's bf16 x bf16 -> fp32 GEMM on AMX hosts and on
// hosts without oneDNN (AVX2: same speed as a bf16 matmul there), else an fp32 GEMM (oneDNN) on
// fp32 copies.
bool mixed_route() { return gemm::amx_bf16() || std::strcmp(gemm::lowp_route(), "mkl-mixed") == 0; }

// Whether an fp8 GEMM reads its codes in a kernel of ours (widened in cache, the epilogue on
// its fp32 sums), and which:
//  - amx_gemm.h's AMX kernel wherever AMX tiles are usable and B's columns run along k (B
//    column-major: nn.Linear's weight.t(), the layout _scaled_mm requires on CUDA), at every
//    size (AMX host, row-wise -> bf16, ratio to a bf16 matmul of the shape: 16x4096x4096 0.68,
//    1024^3 0.61, 2048^3 1.08; MKL's AMX GEMM on widened copies was 11.1, 1.0 and 1.5);
//  - else bf16_gemm.h's AVX512-BF16 kernel, unless AMX is there and the product has rows enough
//    for MKL's AMX GEMM to pay for widening B to bf16 and packing it (AMX / this kernel, ms:
//    1024^3 2.16 / 10.6, 64x4096x4096 13.7 / 13.1, 16x4096x4096 12.3 / 4.7).
constexpr int64_t kAmxMinRows = 128;
bool columns_along_k(const at::Tensor& b) { return b.stride(-2) == 1 && b.stride(-1) != 1; }
bool amx_kernel(const at::Tensor& b) { return amx_gemm::available() && columns_along_k(b); }
//  On hosts whose bf16 dot products run at half rate (gemm.h, bf16_half_rate: no AMX there)
//  products of kBf16RoutedRows rows or more take exact fp32 copies and an fp32 GEMM instead, as
//  bf16 products do (2 cores, row-wise -> bf16, ms, this kernel / fp32 copies: 1024^3 15.1 /
//  11.9, 2048^3 111 / 72.5, 256x1024x4096 13.9 / 11.5; but 16x4096x4096 5.2 / 22.4); fewer
//  rows keep this kernel, tensor-wise -> bf16 too (oneDNN's bf16 GEMM on widened copies there:
//  16x4096x4096 15-19 ms).
//  On those hosts up to gemv::kFewRowsBf16 rows with B column-major take gemv.h's
//  few-row kernel instead (fp32 FMAs over the codes widened in cache; 16 x 4096 x 4096
//  row-wise -> bf16: this kernel 5.3 ms, the bf16 baseline on the few-row kernel 3.5).
bool few_rows_fp8(int64_t rows, const at::Tensor& b) {
  return gemm::bf16_half_rate() && rows <= gemv::kFewRowsBf16 && b.dim() == 2 && b.stride(0) == 1 &&
         !amx_kernel(b) && gemv::available();
}
// acc (rows x n fp32, contiguous) = alpha * a @ b on the few-row kernel where few_rows_fp8 says
// it runs and the kernel takes the shape (not an empty one); false, acc untouched, otherwise.
bool few_rows_accumulate(const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, float alpha) {
  return few_rows_fp8(a.size(0), b) && gemv::few_rows_f32(acc, a, b.t(), alpha);
}
// (grouped GEMMs have no few-row path: `few` false)
bool fused_route(int64_t rows, const at::Tensor& b, bool few = true) {
  if (few && few_rows_fp8(rows, b)) return false;
  if (gemm::bf16_half_rate() && rows >= gemm::kBf16RoutedRows && !amx_kernel(b)) return false;
  return amx_kernel(b) || (bf16_gemm::available() && (!gemm::amx_bf16() || rows < kAmxMinRows));
}

// An fp8 operand widened exactly to the dtype the host GEMM reads (bf16 or fp32).
at::Tensor widen_for_gemm(ZeroCopy& zc, const at::Tensor& t) {
  return widen_fp8(zc, t, mixed_route() ? at::kBFloat16 : at::kFloat);
}

// acc = alpha * a @ b for operands from widen_for_gemm (or slices of them).
void accumulate_widened(ZeroCopy& zc, const at::Tensor& a, const at::Tensor& b, const at::Tensor& acc,
                        float alpha) {
  if (a.scalar_type() == at::kBFloat16) gemm::matmul_lowp_f32(zc, a, b, acc, 0.0f, alpha);
  else gemm::matmul_f32(a, b, acc, 0.0f, alpha);
}

void fp32_accumulate(ZeroCopy& zc, const at::Tensor& a, const at::Tensor& b, const at::Tensor& acc,
                     float alpha) {
  accumulate_widened(zc, widen_for_gemm(zc, a), widen_for_gemm(zc, b), acc, alpha);
}

// ---- The fused route: fp8 codes straight into bf16_gemm.h's kernel --------------------------
// Where the AVX512-BF16 kernel runs, an fp8 GEMM reads the codes themselves (widened exactly
// while packed, in cache) and its epilogue applies alpha, the row/column scales and the bias to
// each finished tile and rounds it once: no widened copies, no m x n fp32 accumulator, no
// separate scale pass. Its products come in the order of the unfused epilogue (scaled_epilogue
// and the tensor ops below), with the same rounding.
template <bool E4M3>
void widen_codes(const uint8_t* src, int64_t ld, int64_t rows, int64_t n, uint16_t* dst, int64_t ldd) {
  fp8::widen_rows_bf16(src, ld, E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2, rows, n, dst, ldd);
}

// A 2-d fp8 tensor as the kernel reads it: either dimension of unit stride, read in place (any
// leading dimension, 0 for a broadcast row or column: the operand is only read); another layout
// is copied to a contiguous tensor held in `keep`.
bf16_gemm::Matrix fp8_matrix(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  bf16_gemm::Matrix mt;
  mt.widen = t.scalar_type() == at::kFloat8_e4m3fn ? widen_codes<true> : widen_codes<false>;
  if (t.stride(1) == 1) {
    mt.p = t.const_data_ptr();
    mt.ld = t.stride(0);
  } else if (t.stride(0) == 1) {
    mt.p = t.const_data_ptr();
    mt.ld = t.stride(1);
    mt.trans = true;
  } else {
    keep.push_back(t.contiguous());
    mt.p = keep.back().const_data_ptr();
    mt.ld = t.size(1);
  }
  return mt;
}

// The product o (2-d, bf16 or fp32, unit column stride) = epilogue(a @ b) for fp8 a and b as the
// kernels take it; rs/cs/bias may be null (see bf16_gemm::Output), copies of odd layouts go to keep.
amx_gemm::Product fused_product(const at::Tensor& o, const at::Tensor& a, const at::Tensor& b, float alpha,
                                const float* rs, const float* cs, const float* bias, std::vector<at::Tensor>& keep) {
  TORCH_INTERNAL_ASSERT(o.dim() == 2 && (o.stride(1) == 1 || o.size(1) <= 1));
  amx_gemm::Product p{a.size(0), b.size(1), a.size(1), fp8_matrix(a, keep), fp8_matrix(b, keep), {}};
  if (o.scalar_type() == at::kBFloat16) p.out.bf16 = static_cast<uint16_t*>(o.data_ptr());
  else p.out.f32 = o.data_ptr<float>();
  p.out.ld = o.stride(0);
  p.out.alpha = alpha;
  p.out.row_scale = rs;
  p.out.col_scale = cs;
  p.out.bias = bias;
  return p;
}

// Runs fused_product(...) on the AMX kernel (amx_kernel(b)) or the AVX512-BF16 one.
void fused_scaled_mm(const at::Tensor& o, const at::Tensor& a, const at::Tensor& b, float alpha, const float* rs,
                     const float* cs, const float* bias) {
  std::vector<at::Tensor> keep;
  const amx_gemm::Product p = fused_product(o, a, b, alpha, rs, cs, bias, keep);
  if (amx_kernel(b)) amx_gemm::gemm(p.m, p.n, p.k, p.a, p.b, p.out);
  else bf16_gemm::gemm(p.m, p.n, p.k, p.a, p.b, p.out);
}

// o = round(acc * row_scale[i] * col_scale[j]) for acc (M x N, contiguous fp32) and o 2-d of
// acc's sizes: per block of rows, the scales are applied in place while the block is in cache,
// then CPU's vectorized copy rounds it once into o, the blocks shared by the intra-op threads
// (one parallel region: each copy runs serially inside it). The products are formed in the
// order the unfused acc.mul_(rows).mul_(cols) used, so the bits are the same; either scale may
// be null.
#if defined(__x86_64__)
__attribute__((target("avx2"))) void scale_rows_cols_avx2(float* acc, int64_t rows, int64_t N,
                                                          const float* rs, const float* cs) {
  for (int64_t i = 0; i < rows; ++i) {
    float* a = acc + i * N;
    const float r = rs ? rs[i] : 1.0f;
    const __m256 rv = _mm256_set1_ps(r);
    int64_t j = 0;
    for (; j + 8 <= N; j += 8) {
      __m256 v = _mm256_loadu_ps(a + j);
      if (rs) v = _mm256_mul_ps(v, rv);
      if (cs) v = _mm256_mul_ps(v, _mm256_loadu_ps(cs + j));
      _mm256_storeu_ps(a + j, v);
    }
    for (; j < N; ++j) {
      float v = a[j];
      if (rs) v = v * r;
      if (cs) v = v * cs[j];
      a[j] = v;
    }
  }
}
#endif

void scale_rows_cols(float* acc, int64_t rows, int64_t N, const float* rs, const float* cs) {
#if defined(__x86_64__)
  if (cpu_features::avx2()) {
    scale_rows_cols_avx2(acc, rows, N, rs, cs);
    return;
  }
#endif
  for (int64_t i = 0; i < rows; ++i) {
    float* a = acc + i * N;
    const float r = rs ? rs[i] : 1.0f;
    if (cs && rs) {
      for (int64_t j = 0; j < N; ++j) a[j] = (a[j] * r) * cs[j];
    } else if (cs) {
      for (int64_t j = 0; j < N; ++j) a[j] = a[j] * cs[j];
    } else if (rs) {
      for (int64_t j = 0; j < N; ++j) a[j] = a[j] * r;
    }
  }
}

void scaled_epilogue(const at::Tensor& acc, const float* rs, const float* cs, const at::Tensor& o) {
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_INTERNAL_ASSERT(acc.is_contiguous() && acc.scalar_type() == at::kFloat && o.dim() == 2);
  float* p = acc.data_ptr<float>();
  const int64_t block = std::max<int64_t>(1, (int64_t{16} << 10) / std::max<int64_t>(1, N));  // 64 KiB of acc
  at::parallel_for(0, M, block, [&](int64_t begin, int64_t end) {
    for (int64_t i0 = begin; i0 < end; i0 += block) {
      const int64_t i1 = std::min(end, i0 + block);
      scale_rows_cols(p + i0 * N, i1 - i0, N, rs ? rs + i0 : nullptr, cs);
      at::Tensor(o).slice(0, i0, i1).copy_(acc.slice(0, i0, i1));
    }
  });
}

// Contiguous fp32 data of a scale vector (row-wise scales are tiny: a copy if needed).
at::Tensor dense_scale(const at::Tensor& s) { return s.contiguous(); }

// ---- DeepSeek-style block scaling -------------------------------------------------------------
// torch 2.13's _scaled_mm takes three block configurations (CUDA: sm90), fp32 scales, K in blocks
// of 128: activation scales per row and K block (1x128) or per 128 rows and K block (128x128),
// weight scales per K block and column (1x128) or per K block and 128 columns (128x128). Each K
// block's product is summed in fp32 (PSUM), scaled by its two block scales and added to an fp32
// total (the promotion DeepGEMM and TensorE do per block), then the bias, one rounding.
enum class Blockwise { kNone, k1x128_128x128, k1x128_1x128, k128x128_1x128 };

int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

Blockwise blockwise_kind(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb) {
  if (sa.dim() != 2 || sb.dim() != 2) return Blockwise::kNone;
  const int64_t M = a.size(0), Kb = ceil_div(a.size(1), 128), N = b.size(1);
  if (sa.size(1) != Kb || sb.size(0) != Kb) return Blockwise::kNone;
  if (sa.size(0) == M && sb.size(1) == ceil_div(N, 128)) return Blockwise::k1x128_128x128;
  if (sa.size(0) == M && sb.size(1) == N) return Blockwise::k1x128_1x128;
  if (sa.size(0) == ceil_div(M, 128) && sb.size(1) == N) return Blockwise::k128x128_1x128;
  return Blockwise::kNone;
}

// acc (fp32 [M, N]) = the block-scaled product; the caller adds the bias and rounds.
void blockwise_accumulate(ZeroCopy& zc, const at::Tensor& acc, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& sa, const at::Tensor& sb, Blockwise kind) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), Kb = ceil_div(K, 128), Nb = ceil_div(N, 128);
  if (Kb == 0) {
    at::Tensor(acc).zero_();
    return;
  }
  const at::Tensor aw = widen_for_gemm(zc, a), bw = widen_for_gemm(zc, b);
  const at::Tensor sac = sa.contiguous(), sbc = sb.contiguous();
  const float* SA = sac.const_data_ptr<float>();
  const float* SB = sbc.const_data_ptr<float>();
  const at::Tensor part = Kb > 1 ? gemm::scratch(zc, {M, N}, at::kFloat) : acc;
  std::vector<float> rs(static_cast<size_t>(M)), cs(static_cast<size_t>(N));
  for (int64_t kb = 0; kb < Kb; ++kb) {
    const int64_t k0 = kb * 128, k1 = std::min(K, k0 + 128);
    const at::Tensor dst = kb == 0 ? acc : part;
    accumulate_widened(zc, aw.slice(1, k0, k1), bw.slice(0, k0, k1), dst, 1.0f);
    for (int64_t m = 0; m < M; ++m) {
      rs[m] = kind == Blockwise::k128x128_1x128 ? SA[(m / 128) * Kb + kb] : SA[m * Kb + kb];
    }
    for (int64_t n = 0; n < N; ++n) {
      cs[n] = kind == Blockwise::k1x128_128x128 ? SB[kb * Nb + n / 128] : SB[kb * N + n];
    }
    scale_rows_cols(dst.data_ptr<float>(), M, N, rs.data(), cs.data());
    if (kb > 0) at::Tensor(acc).add_(part);
  }
}

// ---- _scaled_mm ----------------------------------------------------------------------------
// Row-wise scaling: scale_a [M, 1] and scale_b [1, N].
bool rowwise_scales(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb) {
  return sa.dim() == 2 && sa.size(0) == a.size(0) && sa.size(1) == 1 && sb.dim() == 2 && sb.size(0) == 1 &&
         sb.size(1) == b.size(1);
}

void check_scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa,
                     const at::Tensor& sb, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& scale_result) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, "_scaled_mm: mat_a and mat_b must be matrices, got ",
                    a.dim(), "-d and ", b.dim(), "-d");
  TORCH_CHECK_VALUE(a.size(1) == b.size(0), "_scaled_mm: mat_a and mat_b shapes cannot be multiplied (",
                    a.size(0), "x", a.size(1), " and ", b.size(0), "x", b.size(1), ")");
  TORCH_CHECK_VALUE(fp8(a) && fp8(b), "_scaled_mm: mat_a and mat_b must be float8_e4m3fn or float8_e5m2, got ",
                    a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK_VALUE(sa.scalar_type() == at::kFloat && sb.scalar_type() == at::kFloat,
                    "_scaled_mm: scale_a and scale_b must be float32, got ", sa.scalar_type(), " and ",
                    sb.scalar_type());
  const bool tensorwise = sa.numel() == 1 && sb.numel() == 1;
  const bool rowwise = rowwise_scales(a, b, sa, sb);
  const int64_t M = a.size(0), Kb = ceil_div(a.size(1), 128), N = b.size(1);
  TORCH_CHECK_VALUE(tensorwise || rowwise || blockwise_kind(a, b, sa, sb) != Blockwise::kNone,
                    "_scaled_mm: invalid scaling configuration: use tensor-wise scales (one element "
                    "each), row-wise scales of shape (", M, ", 1) and (1, ", N, "), or block scales: (",
                    M, ", ", Kb, ") and (", Kb, ", ", ceil_div(N, 128), ") for 1x128 activation and "
                    "128x128 weight blocks, (", M, ", ", Kb, ") and (", Kb, ", ", N, ") for 1x128 and "
                    "1x128, (", ceil_div(M, 128), ", ", Kb, ") and (", Kb, ", ", N, ") for 128x128 and "
                    "1x128; got ", sa.sizes(), " and ", sb.sizes());
  TORCH_CHECK_VALUE(!bias || bias->numel() == b.size(1), "_scaled_mm: bias must have ", b.size(1),
                    " elements, got ", bias ? bias->numel() : 0);
  TORCH_CHECK_VALUE(!scale_result || (scale_result->numel() == 1 && scale_result->scalar_type() == at::kFloat),
                    "_scaled_mm: scale_result must be a float32 scalar");
}

// The host path of a non-blockwise fp8 GEMM (scaled_mm_into), from metadata alone: the fused
// kernels (fused_route), oneDNN's bf16 GEMM on widened copies (tensor-wise -> bf16 where oneDNN's
// bf16 kernels are fast), or an fp32 accumulator (the few-row kernel, or fp32 copies).
enum class Route { kFused, kOnednnBf16, kAccumulate };
Route route_of(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
               const std::optional<at::Tensor>& bias, c10::ScalarType dt) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const bool tensorwise = sa.numel() == 1 && sb.numel() == 1;
  const bool onednn_bf16 = dt == at::kBFloat16 && tensorwise && (!bias || bias->scalar_type() == at::kBFloat16) &&
                           gemm::cpu_fast_bf16() && gemm::prefer_onednn(M, N, K) && !amx_kernel(b) &&
                           !gemm::bf16_half_rate();
  if (onednn_bf16) return Route::kOnednnBf16;
  return fused_route(M, b) ? Route::kFused : Route::kAccumulate;
}

// The scratch scaled_mm_into takes on its route (gemm.h, arena_bytes), for a queued call's arena:
// the fused kernels none with a bf16 or fp32 result (else the fp32 accumulator), oneDNN's route
// the widened bf16 copies, the accumulating route the accumulator and, off the few-row kernel,
// fp32 copies; a blockwise GEMM the accumulator and copies (an upper bound).
int64_t scratch_bytes(const at::Tensor& a, const at::Tensor& b, const at::Tensor& sa, const at::Tensor& sb,
                      const std::optional<at::Tensor>& bias, c10::ScalarType dt) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const int64_t acc = gemm::arena_bytes(M * N), copies = gemm::arena_bytes(M * K) + gemm::arena_bytes(K * N);
  const bool tensorwise = sa.numel() == 1 && sb.numel() == 1;
  if (!tensorwise && !rowwise_scales(a, b, sa, sb) && blockwise_kind(a, b, sa, sb) != Blockwise::kNone) {
    return acc + copies;
  }
  switch (route_of(a, b, sa, sb, bias, dt)) {
    case Route::kFused: return dt == at::kBFloat16 || dt == at::kFloat ? 0 : acc;
    case Route::kOnednnBf16: return gemm::arena_bytes(M * K, 2) + gemm::arena_bytes(K * N, 2);
    case Route::kAccumulate: break;
  }
  return acc + (few_rows_fp8(M, b) ? 0 : copies);
}

void scaled_mm_into(ZeroCopy& zc, const at::Tensor& o, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& sa, const at::Tensor& sb, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& scale_result) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  const bool tensorwise = sa.numel() == 1 && sb.numel() == 1;
  // (row-wise first: with one K block, 1x128 x 128x128 scales are [M, 1] and [1, ceil(N / 128)])
  const bool rowwise = rowwise_scales(a, b, sa, sb);
  const Blockwise block = tensorwise || rowwise ? Blockwise::kNone : blockwise_kind(a, b, sa, sb);
  if (block != Blockwise::kNone) {
    const bool fp8_result = o.scalar_type() == at::kFloat8_e4m3fn || o.scalar_type() == at::kFloat8_e5m2;
    const at::Tensor acc = o.scalar_type() == at::kFloat && o.is_contiguous() ? o : gemm::scratch(zc, {M, N}, at::kFloat);
    blockwise_accumulate(zc, acc, a, b, sa, sb, block);
    if (bias) at::Tensor(acc).add_(bias->to(at::kFloat).reshape({1, N}));
    if (scale_result && fp8_result) at::Tensor(acc).mul_(1.0f / scale_result->item<float>());
    if (!acc.is_same(o)) at::Tensor(o).copy_(acc);  // the one rounding
    return;
  }
  const float alpha = tensorwise ? sa.item<float>() * sb.item<float>() : 1.0f;
  const auto dt = o.scalar_type();
  const Route route = route_of(a, b, sa, sb, bias, dt);
  const bool onednn_bf16 = route == Route::kOnednnBf16;
  const bool fp8_out = dt == at::kFloat8_e4m3fn || dt == at::kFloat8_e5m2;
  if (route == Route::kFused) {
    // The kernel's epilogue applies alpha, the scales and the bias, and writes a bf16 or fp32
    // result itself; another dtype is rounded from its fp32 result.
    const bool direct = dt == at::kBFloat16 || dt == at::kFloat;
    const at::Tensor acc = direct ? o : gemm::scratch(zc, {M, N}, at::kFloat);
    const at::Tensor rs = tensorwise ? at::Tensor() : dense_scale(sa), cs = tensorwise ? at::Tensor() : dense_scale(sb);
    const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    auto data = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; };
    fused_scaled_mm(acc, a, b, alpha, data(rs), data(cs), data(bf));
    if (direct) return;
    if (scale_result && fp8_out) at::Tensor(acc).mul_(1.0f / scale_result->item<float>());
    at::Tensor(o).copy_(acc);  // the one rounding
    return;
  }
  if (onednn_bf16) {
    float beta = 0.0f;
    if (bias) {
      at::Tensor(o).copy_(bias->reshape({1, N}).expand({M, N}));
      beta = 1.0f;
    }
    gemm::matmul_bf16(widen_fp8(zc, a, at::kBFloat16), widen_fp8(zc, b, at::kBFloat16), o, beta, alpha);
    return;
  }
  at::Tensor acc = gemm::scratch(zc, {M, N}, at::kFloat);
  if (!few_rows_accumulate(acc, a, b, alpha)) fp32_accumulate(zc, a, b, acc, alpha);
  const bool plain = !bias && !(scale_result && fp8_out);
  if (!tensorwise && plain) {  // row-wise scales and the rounding in one cache-blocked pass
    const at::Tensor rs = dense_scale(sa), cs = dense_scale(sb);
    scaled_epilogue(acc, rs.const_data_ptr<float>(), cs.const_data_ptr<float>(), o);
    return;
  }
  if (!tensorwise) {
    acc.mul_(sa);
    acc.mul_(sb);
  }
  if (bias) acc.add_(bias->reshape({1, N}));
  if (scale_result && fp8_out) acc.mul_(1.0f / scale_result->item<float>());
  at::Tensor(o).copy_(acc);  // the one rounding
}

// A neuron operand of a queued low-precision GEMM (any dtype: fp8 codes, fp32 scales, a bias).
bool queueable_operand(const at::Tensor& ref, const at::Tensor& t) {
  return t.is_privateuseone() && t.device() == ref.device() && t.layout() == c10::kStrided && !t.is_conj() &&
         !t.is_neg();
}

bool queueable_operand(const at::Tensor& ref, const std::optional<at::Tensor>& t) {
  return !t.has_value() || !t->defined() || queueable_operand(ref, *t);
}

// With the execution engine on (or a graph capturing: vLLM's decode graphs of FP8 models) the
// GEMM is queued when every operand is a neuron tensor of one device: check_scaled_mm reads
// metadata only, so every error is raised at the call, and the kernel reads the scales' values
// when it runs, after the queued kernels that computed them (a dynamic activation scale).
// The product goes into `out` (an existing neuron tensor of the result's shape and dtype, written
// in place) or, with `out` undefined, into a new result of `dtype`; returns the result.
at::Tensor run_scaled_mm(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scale_result, c10::ScalarType dtype, at::Tensor out) {
  const char* name = out.defined() ? "aten::_scaled_mm.out" : "aten::_scaled_mm";
  if (may_enqueue() && queueable_operand(self, self) && queueable_operand(self, mat2) &&
      queueable_operand(self, scale_a) && queueable_operand(self, scale_b) && queueable_operand(self, bias) &&
      queueable_operand(self, scale_result)) {
    check_scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result);
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), sa = q.in(scale_a), sb = q.in(scale_b);
    const std::optional<at::Tensor> bi = q.in(bias), sr = q.in(scale_result);
    at::Tensor o = out.defined() ? q.into(out) : q.out(out, {a.size(0), b.size(1)}, dtype);
    at::Tensor arena = q.arena(scratch_bytes(a, b, sa, sb, bi, o.scalar_type()));
    q.enqueue(name, [a, b, sa, sb, bi, sr, o, arena] {
      ZeroCopy zc(ZeroCopy::Queued{});
      zc.set_scratch_arena(arena);
      scaled_mm_into(zc, o, a, b, sa, sb, bi, sr);
    });
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2), sa = zc.in(scale_a), sb = zc.in(scale_b);
  std::optional<at::Tensor> bi, sr;
  if (bias.has_value() && bias->defined()) bi = zc.in(*bias);
  if (scale_result.has_value() && scale_result->defined()) sr = zc.in(*scale_result);
  at::Tensor o = out.defined() ? zc.in_output(out) : at::Tensor();
  zc.launch(name);
  check_scaled_mm(a, b, sa, sb, bi, sr);
  if (!out.defined()) {
    out = pooled(zc, {a.size(0), b.size(1)}, dtype);
    o = zc.in_output(out);
  }
  scaled_mm_into(zc, o, a, b, sa, sb, bi, sr);
  zc.sync_inputs();
  return out;
}

at::Tensor scaled_mm(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& scale_a,
                     const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& scale_result,
                     std::optional<c10::ScalarType> out_dtype, bool use_fast_accum) {
  return run_scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result, out_dtype.value_or(self.scalar_type()),
                       at::Tensor());
}

at::Tensor& scaled_mm_out(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& scale_a,
                          const at::Tensor& scale_b, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& scale_result,
                          std::optional<c10::ScalarType> out_dtype, bool use_fast_accum, at::Tensor& out) {
  TORCH_CHECK_VALUE(!out_dtype || *out_dtype == out.scalar_type(),
                    "_scaled_mm: out_dtype must match the output's dtype (", out.scalar_type(), ")");
  // A contiguous neuron `out` of the result's shape (torch.compile's extern call passes one) is
  // written in place; anything else (resizing, another layout, an alias of an input) takes a
  // result and a copy.
  const bool direct = self.dim() == 2 && mat2.dim() == 2 && out.is_privateuseone() && out.device() == self.device() &&
                      out.dim() == 2 && out.size(0) == self.size(0) && out.size(1) == mat2.size(1) &&
                      out.is_contiguous() && !out.is_conj() && !out.is_neg() &&
                      at::get_overlap_status(out, self) == at::MemOverlapStatus::No &&
                      at::get_overlap_status(out, mat2) == at::MemOverlapStatus::No &&
                      (!bias || !bias->defined() || at::get_overlap_status(out, *bias) == at::MemOverlapStatus::No);
  if (!direct) {
    at::Tensor r = scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result, out.scalar_type(), use_fast_accum);
    at::native::resize_output(out, r.sizes());
    out.copy_(r);
    return out;
  }
  run_scaled_mm(self, mat2, scale_a, scale_b, bias, scale_result, out.scalar_type(), out);
  return out;
}

// ---- _scaled_grouped_mm -------------------------------------------------------------------
// torch 2.13's documented semantics (CUDA's kernel and its meta function; CPU has no kernel):
// e4m3fn operands, mat_a row-major, mat_b column-major, float32 row-wise scales, bf16 output,
// no bias or scale_result. Four layouts, groups cut by `offs` (cumulative int32 ends):
//   2d x 3d: a (M, K), b (G, K, N), offs over M;  scale_a (M,),   scale_b (G, N) -> (M, N)
//   3d x 3d: a (G, M, K), b (G, K, N), no offs;   scale_a (G, M), scale_b (G, N) -> (G, M, N)
//   3d x 2d: a (G, M, K), b (K, N), offs over N;  scale_a (G, M), scale_b (N,)   -> (M, N)
//   2d x 2d: a (M, K), b (K, N), offs over K;     scale_a (G*M,), scale_b (G*N,) -> (G, M, N)
// Each group: exact fp8 products, fp32 accumulation, scale_a[row] * scale_b[col] applied to
// the accumulator, one rounding to bf16. Rows/columns no group covers are zero (CUDA leaves
// them unwritten); an empty K range gives zeros.
void check_grouped(bool ok, const std::string& msg) { TORCH_CHECK_VALUE(ok, "_scaled_grouped_mm: ", msg); }

std::vector<int64_t> group_ends(const std::optional<at::Tensor>& offs, int64_t groups_expected,
                                int64_t extent, const char* what) {
  const at::Tensor o = offs->to(at::kLong).contiguous();  // a CPU alias: no device sync needed
  std::vector<int64_t> ends(o.const_data_ptr<int64_t>(), o.const_data_ptr<int64_t>() + o.numel());
  if (groups_expected >= 0) {
    check_grouped(static_cast<int64_t>(ends.size()) == groups_expected,
                  "offs must have one entry per group (" + std::to_string(groups_expected) + "), got " +
                      std::to_string(ends.size()));
  }
  int64_t prev = 0;
  for (int64_t e : ends) {
    check_grouped(e >= prev && e <= extent,
                  std::string("offs must be non-decreasing group ends within the ") + what + " (" +
                      std::to_string(extent) + "), got " + c10::str(o));
    prev = e;
  }
  return ends;
}

at::Tensor scaled_grouped_mm(const at::Tensor& self, const at::Tensor& mat2, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const std::optional<at::Tensor>& offs,
                             const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& scale_result,
                             std::optional<c10::ScalarType> out_dtype, bool use_fast_accum) {
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2), sa = zc.in(scale_a), sb = zc.in(scale_b);
  std::optional<at::Tensor> of;
  if (offs.has_value() && offs->defined()) of = zc.in(*offs);
  zc.launch("aten::_scaled_grouped_mm");
  check_grouped(a.scalar_type() == at::kFloat8_e4m3fn && b.scalar_type() == at::kFloat8_e4m3fn,
                std::string("expected float8_e4m3fn inputs, got ") + c10::toString(a.scalar_type()) + " and " +
                    c10::toString(b.scalar_type()));
  check_grouped((a.dim() == 2 || a.dim() == 3) && (b.dim() == 2 || b.dim() == 3),
                "mat_a and mat_b must be 2-d or 3-d, got " + std::to_string(a.dim()) + "-d and " +
                    std::to_string(b.dim()) + "-d");
  if (sa.scalar_type() == at::kFloat8_e8m0fnu || sb.scalar_type() == at::kFloat8_e8m0fnu) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "_scaled_grouped_mm: MXFP8 (float8_e8m0fnu block scales) is not "
                                       "implemented on neuron; use float32 row-wise scales");
  }
  check_grouped(sa.scalar_type() == at::kFloat && sb.scalar_type() == at::kFloat,
                "scale_a and scale_b must be float32 (row-wise scales)");
  check_grouped(!(bias.has_value() && bias->defined()), "bias is not supported (as on CUDA)");
  check_grouped(!(scale_result.has_value() && scale_result->defined()), "scale_result is not supported (as on CUDA)");
  check_grouped(!out_dtype || *out_dtype == at::kBFloat16, "out_dtype must be torch.bfloat16");
  check_grouped(a.stride(-1) == 1 && a.stride(-2) > 1,
                "mat_a must be row-major in its last two dimensions (got strides " + c10::str(a.strides()) + ")");
  check_grouped(b.stride(-2) == 1 && b.stride(-1) > 1,
                "mat_b must be column-major in its last two dimensions, e.g. weight.transpose(-2, -1) (got strides " +
                    c10::str(b.strides()) + ")");
  check_grouped(a.size(-1) == b.size(-2) || (a.dim() == 2 && b.dim() == 2),
                "contraction dimension of mat_a and mat_b must match (" + c10::str(a.sizes()) + " and " +
                    c10::str(b.sizes()) + ")");
  const bool a2 = a.dim() == 2, b2 = b.dim() == 2;
  check_grouped((a2 || b2) == of.has_value(),
                of ? "offs must be None for 3-d x 3-d inputs" : "offs is required when an input is 2-d");
  if (of) {
    check_grouped(of->dim() == 1 && of->scalar_type() == at::kInt, "offs must be a 1-d int32 tensor");
  }
  auto check_scale = [&](const at::Tensor& s, const char* name, const at::Tensor& mat, int64_t expect_dim,
                         std::vector<int64_t> expect_shape) {
    check_grouped(s.dim() == expect_dim && s.sizes().vec() == expect_shape,
                  std::string(name) + " must have shape " + c10::str(c10::IntArrayRef(expect_shape)) +
                      " for " + std::to_string(mat.dim()) + "-d operands, got " + c10::str(s.sizes()));
  };
  at::Tensor out, o;
  // One group: og = round((ag @ bg) * rs[i] * cs[j]). The fused route reads the fp8 slices; the
  // unfused one widens both operands once (`aw`, `bw`, sliced like a and b) and accumulates in fp32.
  // (rows per group: a's rows over the groups for a 2-d a, a group's rows for a 3-d one)
  const bool fused = fused_route(a2 ? a.size(0) / std::max<int64_t>(1, b2 ? 1 : b.size(0)) : a.size(1), b, false);
  const at::Tensor aw = fused ? a : widen_for_gemm(zc, a), bw = fused ? b : widen_for_gemm(zc, b);
  // On the AMX kernel the groups run together once all are known (one pair of parallel regions).
  const bool batched = fused && amx_kernel(b);
  std::vector<amx_gemm::Product> groups;
  std::vector<at::Tensor> keep;
  auto product = [&](const at::Tensor& ag, const at::Tensor& bg, const float* rs, const float* cs,
                     const at::Tensor& og) {
    if (batched) {
      groups.push_back(fused_product(og, ag, bg, 1.0f, rs, cs, nullptr, keep));
      return;
    }
    // A group of a few rows (an expert's tokens in an MoE decode step) on a half-rate host: the
    // few-row kernel, as _scaled_mm takes it, with the codes widened in cache.
    if (fused && few_rows_fp8(ag.size(0), bg)) {
      at::Tensor acc = gemm::scratch(zc, {ag.size(0), bg.size(1)}, at::kFloat);
      if (few_rows_accumulate(acc, ag, bg, 1.0f)) {
        scaled_epilogue(acc, rs, cs, og);
        return;
      }
    }
    if (fused) {
      fused_scaled_mm(og, ag, bg, 1.0f, rs, cs, nullptr);
      return;
    }
    at::Tensor acc = gemm::scratch(zc, {ag.size(0), bg.size(1)}, at::kFloat);
    accumulate_widened(zc, ag, bg, acc, 1.0f);
    scaled_epilogue(acc, rs, cs, og);
  };
  if (a2 && !b2) {  // 2d x 3d
    const int64_t M = a.size(0), G = b.size(0), N = b.size(2);
    check_scale(sa, "scale_a", a, 1, {M});
    check_scale(sb, "scale_b", b, 2, {G, N});
    const auto ends = group_ends(of, G, M, "rows of mat_a");
    const at::Tensor sad = dense_scale(sa), sbd = dense_scale(sb);
    out = pooled(zc, {M, N}, at::kBFloat16);
    o = zc.in_output(out);
    o.zero_();
    int64_t start = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t end = ends[g];
      if (end > start) {
        product(aw.slice(0, start, end), bw[g], sad.const_data_ptr<float>() + start, sbd[g].const_data_ptr<float>(),
                o.slice(0, start, end));
      }
      start = end;
    }
  } else if (!a2 && !b2) {  // 3d x 3d
    const int64_t G = a.size(0), M = a.size(1), N = b.size(2);
    check_grouped(b.size(0) == G, "mat_a and mat_b must have the same number of groups");
    check_scale(sa, "scale_a", a, 2, {G, M});
    check_scale(sb, "scale_b", b, 2, {G, N});
    out = pooled(zc, {G, M, N}, at::kBFloat16);
    o = zc.in_output(out);
    const at::Tensor sad = dense_scale(sa), sbd = dense_scale(sb);
    if (fused) {
      for (int64_t g = 0; g < G; ++g) {
        product(aw[g], bw[g], sad[g].const_data_ptr<float>(), sbd[g].const_data_ptr<float>(), o[g]);
      }
    } else {  // the unfused route accumulates every group in one batched GEMM
      at::Tensor acc = gemm::scratch(zc, {G, M, N}, at::kFloat);
      accumulate_widened(zc, aw, bw, acc, 1.0f);
      for (int64_t g = 0; g < G; ++g) {
        scaled_epilogue(acc[g], sad[g].const_data_ptr<float>(), sbd[g].const_data_ptr<float>(), o[g]);
      }
    }
  } else if (!a2 && b2) {  // 3d x 2d
    const int64_t G = a.size(0), M = a.size(1), N = b.size(1);
    check_scale(sa, "scale_a", a, 2, {G, M});
    check_scale(sb, "scale_b", b, 1, {N});
    const auto ends = group_ends(of, G, N, "columns of mat_b");
    const at::Tensor sad = dense_scale(sa), sbd = dense_scale(sb);
    out = pooled(zc, {M, N}, at::kBFloat16);
    o = zc.in_output(out);
    o.zero_();
    int64_t start = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t end = ends[g];
      if (end > start) {
        product(aw[g], bw.slice(1, start, end), sad[g].const_data_ptr<float>(), sbd.const_data_ptr<float>() + start,
                o.slice(1, start, end));
      }
      start = end;
    }
  } else {  // 2d x 2d
    const int64_t M = a.size(0), N = b.size(1);
    check_grouped(a.size(1) == b.size(0), "contraction dimension of mat_a and mat_b must match (" +
                                              c10::str(a.sizes()) + " and " + c10::str(b.sizes()) + ")");
    const int64_t G = of->numel();
    check_scale(sa, "scale_a", a, 1, {G * M});
    check_scale(sb, "scale_b", b, 1, {G * N});
    const auto ends = group_ends(of, -1, a.size(1), "contraction dimension");
    const at::Tensor sad = dense_scale(sa), sbd = dense_scale(sb);
    out = pooled(zc, {G, M, N}, at::kBFloat16);
    o = zc.in_output(out);
    int64_t start = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t end = ends[g];
      if (end > start) {
        product(aw.slice(1, start, end), bw.slice(0, start, end), sad.const_data_ptr<float>() + g * M,
                sbd.const_data_ptr<float>() + g * N, o[g]);
      } else {
        o[g].zero_();
      }
      start = end;
    }
  }
  if (batched) amx_gemm::gemm(groups);
  (void)use_fast_accum;  // PSUM accumulates in fp32 either way
  zc.sync_inputs();
  return out;
}

// ---- _int_mm: CPU's kernel (oneDNN s8s8s32, integer VNNI: exact in int32) with its result
// from the device pool on AVX-512 hosts; through the boxed fallback it paid a host allocation
// per call.
// Without AVX-512 (no VNNI either) CPU's kernel is oneDNN's reference loop: 1024^3 takes 5 s,
// 71x a bf16 matmul. There an exact fp32 route: int8 products are integers of magnitude <=
// 2^14, so over a K-chunk of 1024 every partial sum is an integer <= 2^24, exact in fp32 in
// any summation order; chunks are summed in int32 (wrapping like CPU's int32 accumulator).
constexpr int64_t kExactChunk = 1024;

void int_mm_via_fp32(ZeroCopy& zc, const at::Tensor& o, const at::Tensor& a, const at::Tensor& b) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor af = gemm::scratch(zc, a.sizes(), at::kFloat), bf = gemm::scratch(zc, b.sizes(), at::kFloat);
  af.copy_(a);
  bf.copy_(b);
  at::Tensor acc = gemm::scratch(zc, {M, N}, at::kFloat);
  at::Tensor out = o;
  if (K == 0) {
    out.zero_();
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kExactChunk) {
    const int64_t k1 = std::min(K, k0 + kExactChunk);
    gemm::matmul_f32(af.slice(1, k0, k1), bf.slice(0, k0, k1), acc, 0.0f, 1.0f);
    if (k0 == 0) out.copy_(acc);  // integers: the conversion is exact
    else out.add_(acc.to(at::kInt));
  }
}

// Queued as _scaled_mm, for valid operands (int8 matrices that multiply); others run the
// synchronous path, which raises CPU's errors.
at::Tensor int_mm(const at::Tensor& self, const at::Tensor& mat2) {
  if (may_enqueue() && queueable_operand(self, self) && queueable_operand(self, mat2) && self.dim() == 2 &&
      mat2.dim() == 2 && self.scalar_type() == at::kChar && mat2.scalar_type() == at::kChar &&
      self.size(1) == mat2.size(0)) {
    QueuedCall q;
    at::Tensor a = q.in(self), b = q.in(mat2), out;
    at::Tensor o = q.out(out, {a.size(0), b.size(1)}, at::kInt);
    q.enqueue("aten::_int_mm", [a, b, o]() mutable {
      ZeroCopy zc(ZeroCopy::Queued{});
      if (gemm::onednn_matmul_usable()) at::cpu::_int_mm_out(o, a, b);
      else int_mm_via_fp32(zc, o, a, b);
    });
    return out;
  }
  ZeroCopy zc;
  at::Tensor a = zc.in(self), b = zc.in(mat2);
  zc.launch("aten::_int_mm");
  if (a.dim() != 2 || b.dim() != 2 || a.scalar_type() != at::kChar || b.scalar_type() != at::kChar ||
      a.size(1) != b.size(0)) {
    return zc.out(at::cpu::_int_mm(a, b));  // CPU's checks and messages
  }
  at::Tensor out = pooled(zc, {a.size(0), b.size(1)}, at::kInt);
  at::Tensor o = zc.in_output(out);
  if (gemm::onednn_matmul_usable()) at::cpu::_int_mm_out(o, a, b);
  else int_mm_via_fp32(zc, o, a, b);
  zc.sync_inputs();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_scaled_mm", TORCH_FN(scaled_mm));
  m.impl("_scaled_mm.out", TORCH_FN(scaled_mm_out));
  m.impl("_int_mm", TORCH_FN(int_mm));
  m.impl("_scaled_grouped_mm", TORCH_FN(scaled_grouped_mm));
}

}  // namespace torchneuron
