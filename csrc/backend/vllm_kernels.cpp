// Kernels of torchneuron's vLLM platform. Paged KV for the NEURON_ATTN backend
// (torchneuron/vllm/attention.py): the KV-cache write and decode attention read the token-major
// paged cache in place through the block table. Rotary embedding in place and RMSNorm (plain and
// fused with the residual add) for vLLM's layers (torchneuron/vllm/ops.py).
//
// Why C++: per decode step and layer, the torch-op route (gather every request's blocks with
// index_select, then SDPA over the padded, masked context) copied the whole context of the
// batch and ran CPU's flash kernel with one query row per request; measured on the 2-core host
// (16 requests, ~100 tokens of context, 8/4 heads of 32) that was ~0.9 ms per layer against
// ~0.3 ms for vLLM's own CPU kernel. These kernels read each cached key and value row once, in
// place, for all query heads sharing it (GQA), with fp32 accumulation in every dtype.
//
// Layout (NEURON_ATTN's, vLLM's LBNHC): kv_cache [num_blocks, block_size, kv_heads, 2 * head]
// contiguous; row (block, offset, kv head) holds the key (first `head` values) then the value.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <optional>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_features.h"
#include "enqueue.h"
#include "zero_copy.h"

namespace torchneuron {
namespace {

int64_t index_at(const at::Tensor& t, int64_t i) {
  // block tables and slot mappings arrive as int32 (vLLM's) or int64
  return t.scalar_type() == at::kInt ? static_cast<int64_t>(t.const_data_ptr<int32_t>()[i * t.stride(0)])
                                     : t.const_data_ptr<int64_t>()[i * t.stride(0)];
}

// The kernels' dtypes (fp32, fp64, fp16, bf16), checked at the call: a queued kernel's dispatch
// error would surface only at the next synchronization.
void check_floating(const at::Tensor& t, const char* what, const char* op) {
  const auto d = t.scalar_type();
  TORCH_CHECK(d == at::kFloat || d == at::kDouble || d == at::kHalf || d == at::kBFloat16, op, ": ", what,
              " must be float32, float64, float16 or bfloat16, got ", d);
}

bool fp8_cache(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
}

// A KV cache of the model's dtype, or an FP8 one (vLLM's kv_cache_dtype "fp8", "fp8_e4m3",
// "fp8_e5m2": codes written by the caller, keys and values dequantized by their scales here).
void check_cache(const at::Tensor& kv_cache, const char* op) {
  if (!fp8_cache(kv_cache)) check_floating(kv_cache, "kv_cache", op);
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous(), op,
              ": kv_cache must be a contiguous [num_blocks, block_size, kv_heads, 2 * head_size] "
              "tensor (NEURON_ATTN's token-major layout), got shape ", kv_cache.sizes(),
              " with strides ", kv_cache.strides());
  TORCH_CHECK(kv_cache.size(3) % 2 == 0, op, ": the last kv_cache dim holds key then value, so it "
              "must be even, got ", kv_cache.size(3));
}

void check_index(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", what,
              " must be int32 or int64, got ", t.scalar_type());
}


// ---- fp32 inner loops, vectorized ------------------------------------------------------------
// The extension is built for baseline x86-64 (SSE2) and GCC does not vectorize a float
// reduction without reassociation, so the dot products, exponentials and value accumulations of
// decode attention ran scalar (measured: 2.6x vLLM's CPU kernel in the model). AVX2+FMA
// versions are chosen at run time; the scalar ones remain for other hosts and for head sizes
// that are not a multiple of 8.
constexpr int kChunk = 8;  // cached tokens scored together: one AVX2 register of scores

// s[j] = q . k[j] for the kChunk key rows k[j]
void scores_scalar(const float* q, const float* const* k, int64_t d, float* s) {
  for (int j = 0; j < kChunk; ++j) {
    float a = 0.0f;
    for (int64_t c = 0; c < d; ++c) a += q[c] * k[j][c];
    s[j] = a;
  }
}
// s[j] = e^s[j] (the arguments are scores minus their running maximum: <= 0, or -inf)
void exp_scalar(float* s) {
  for (int j = 0; j < kChunk; ++j) s[j] = std::exp(s[j]);
}
// a = a * corr + sum_j p[j] v[j] over the first cnt value rows
void pv_scalar(float* a, float corr, const float* p, const float* const* v, int cnt, int64_t d) {
  for (int64_t c = 0; c < d; ++c) {
    float x = a[c] * corr;
    for (int j = 0; j < cnt; ++j) x += p[j] * v[j][c];
    a[c] = x;
  }
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* const* k, int64_t d,
                                                     float* s) {
  if (d % 8 != 0) return scores_scalar(q, k, d, s);
  __m256 acc[kChunk];
  for (int j = 0; j < kChunk; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
    for (int j = 0; j < kChunk; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + c), acc[j]);
  }
  // eight horizontal sums at once: pairwise hadds leave lane j of the two 128-bit halves
  // holding the partial sums of acc[j]
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 lo4 = _mm256_hadd_ps(h01, h23), hi4 = _mm256_hadd_ps(h45, h67);
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20),
                                   _mm256_permute2f128_ps(lo4, hi4, 0x31));
  _mm256_storeu_ps(s, sum);
}
// e^x by range reduction x = n ln2 + r, |r| <= ln2 / 2, and a degree-6 polynomial for e^r
// (Cephes' expf coefficients; within 2 ulp of std::exp). Arguments below -87.3 (including
// -inf) give 0: e^x is then below FLT_MIN and negligible against the softmax sum, which is >= 1.
__attribute__((target("avx2,fma"))) void exp_avx2(float* s) {
  const __m256 x0 = _mm256_loadu_ps(s);
  const __m256 x = _mm256_max_ps(x0, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  const __m256 live = _mm256_cmp_ps(x0, _mm256_set1_ps(-87.3f), _CMP_GT_OQ);
  _mm256_storeu_ps(s, _mm256_and_ps(y, live));
}
__attribute__((target("avx2,fma"))) void pv_avx2(float* a, float corr, const float* p,
                                                 const float* const* v, int cnt, int64_t d) {
  if (d % 8 != 0) return pv_scalar(a, corr, p, v, cnt, d);
  const __m256 cv = _mm256_set1_ps(corr);
  __m256 pj[kChunk];
  for (int j = 0; j < cnt; ++j) pj[j] = _mm256_set1_ps(p[j]);
  for (int64_t c = 0; c < d; c += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(a + c), cv);
    for (int j = 0; j < cnt; ++j) x = _mm256_fmadd_ps(pj[j], _mm256_loadu_ps(v[j] + c), x);
    _mm256_storeu_ps(a + c, x);
  }
}
#else
void scores_avx2(const float* q, const float* const* k, int64_t d, float* s) { scores_scalar(q, k, d, s); }
void exp_avx2(float* s) { exp_scalar(s); }
void pv_avx2(float* a, float corr, const float* p, const float* const* v, int cnt, int64_t d) {
  pv_scalar(a, corr, p, v, cnt, d);
}
#endif

// ---- KV write ------------------------------------------------------------------------------
// kv_cache row `slot_mapping[i]` <- (key[i], value[i]) for every token i with slot >= 0
// (vLLM marks padding tokens with slot -1). key/value: [tokens, kv_heads, head] with a dense
// last dim; tokens beyond slot_mapping's length are padding and ignored.
template <typename T>
void kv_write_kernel(const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache,
                     const at::Tensor& slots, int64_t n) {
  const int64_t kvh = cache.size(2), d = cache.size(3) / 2, rows = cache.size(0) * cache.size(1);
  T* base = static_cast<T*>(cache.data_ptr());
  const T* k = static_cast<const T*>(key.const_data_ptr());
  const T* v = static_cast<const T*>(value.const_data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = index_at(slots, i);
    if (slot < 0) continue;
    TORCH_CHECK(slot < rows, "torchneuron::paged_kv_write: slot ", slot, " of token ", i,
                " is outside the KV cache (", rows, " slots)");
    T* row = base + slot * kvh * 2 * d;
    for (int64_t h = 0; h < kvh; ++h) {
      std::copy_n(k + i * key.stride(0) + h * key.stride(1), d, row + h * 2 * d);
      std::copy_n(v + i * value.stride(0) + h * value.stride(1), d, row + h * 2 * d + d);
    }
  }
}

// Argument checks read metadata only (sizes, strides, dtypes), so a queued call raises them at
// the call; the kernels' value checks (slots, block ids, positions) run with the kernel.
void check_kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  constexpr const char* op = "torchneuron::paged_kv_write";
  check_cache(kv_cache, op);
  check_index(slot_mapping, "slot_mapping", op);
  const int64_t kvh = kv_cache.size(2), d = kv_cache.size(3) / 2;
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kvh && t->size(2) == d && t->stride(2) == 1, op,
                ": key and value must be [tokens, ", kvh, ", ", d,
                "] with a dense last dim (the cache's kv_heads and head_size), got shape ",
                t->sizes(), " with strides ", t->strides());
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(), op, ": key/value dtype ",
                t->scalar_type(), " differs from the kv_cache's ", kv_cache.scalar_type());
  }
  TORCH_CHECK(slot_mapping.dim() == 1, op, ": slot_mapping must be 1-d, got shape ", slot_mapping.sizes());
  const int64_t n = slot_mapping.size(0);
  TORCH_CHECK(key.size(0) >= n && value.size(0) >= n, op, ": ", n, " slots but only ", key.size(0),
              " key and ", value.size(0), " value rows");
}

void run_kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                  const at::Tensor& slot_mapping) {
  if (fp8_cache(kv_cache)) {  // FP8 codes (quantized by the caller): byte copies
    kv_write_kernel<uint8_t>(key, value, kv_cache, slot_mapping, slot_mapping.size(0));
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_cache.scalar_type(), "torchneuron::paged_kv_write", [&] {
    kv_write_kernel<scalar_t>(key, value, kv_cache, slot_mapping, slot_mapping.size(0));
  });
}

void paged_kv_write_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                        const at::Tensor& slot_mapping) {
  check_kv_write(key, value, kv_cache, slot_mapping);
  run_kv_write(key, value, kv_cache, slot_mapping);
}

// ---- decode attention ----------------------------------------------------------------------
// out[r] = softmax(scale * q[r] K^T) V over the first seq_lens[r] cached tokens of request r,
// whose blocks are block_table[r, :]. One query token per request (decode): the new token's key
// and value are already in the cache, so no causal mask is needed beyond the length.
//
// One pass over the context (online softmax, as flash attention does): tokens in chunks of
// kChunk, each chunk's rows located once through the block table and read front to back (a
// token's row holds every KV head's key then value: walking one head across tokens instead
// strides by the row size and maps many rows onto the same L1 sets); per query head the chunk's
// scores, their exponentials against the running maximum, and the rescaled value accumulation.
// fp32 accumulation in every dtype; half-precision rows are widened once per chunk.
// C is the cache's element type: T, or an FP8 type whose rows are widened with the key and
// value scales applied (each token row: per KV head, d key values then d value values).
template <typename T, typename C = T>
void decode_kernel(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, double scale, const at::Tensor& out, float k_scale = 1.0f,
                   float v_scale = 1.0f) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t nblocks = cache.size(0), bs = cache.size(1), kvh = cache.size(2);
  const int64_t group = heads / kvh, max_blocks = block_table.size(1);
  const C* base = static_cast<const C*>(cache.const_data_ptr());
  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool bt32 = block_table.scalar_type() == at::kInt;
  const void* bt = block_table.const_data_ptr();
  const int64_t bt_stride = block_table.stride(0), bt_col = block_table.stride(1);
  const float sc = static_cast<float>(scale);
  const int64_t token_row = kvh * 2 * d;  // one token: every KV head's key then value
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    const bool vec = cpu_features::avx2_fma();
    auto scores = vec ? scores_avx2 : scores_scalar;
    auto expv = vec ? exp_avx2 : exp_scalar;
    auto pv = vec ? pv_avx2 : pv_scalar;
    std::vector<float> qf(heads * d), acc(heads * d), mx(heads), sum(heads);
    std::vector<float> wide(std::is_same_v<C, float> ? 0 : kChunk * token_row);
    const float* rows[kChunk];
    const float* k[kChunk];
    const float* v[kChunk];
    float s[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = index_at(seq_lens, r);
      TORCH_CHECK(len >= 0 && len <= max_blocks * bs, "torchneuron::paged_decode_attention: "
                  "request ", r, " has ", len, " tokens but its block table row holds ",
                  max_blocks * bs);
      for (int64_t hq = 0; hq < heads; ++hq) {
        const T* src = qp + r * q.stride(0) + hq * q.stride(1);
        for (int64_t c = 0; c < d; ++c) qf[hq * d + c] = static_cast<float>(src[c]) * sc;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t t0 = 0; t0 < len; t0 += kChunk) {
        const int cnt = static_cast<int>(std::min<int64_t>(kChunk, len - t0));
        for (int j = 0; j < kChunk; ++j) {
          if (j >= cnt) {  // a short last chunk: score a valid row again (ignored)
            rows[j] = rows[cnt - 1];
            continue;
          }
          const int64_t t = t0 + j, col = (t / bs) * bt_col;
          const int64_t blk = bt32 ? static_cast<const int32_t*>(bt)[r * bt_stride + col]
                                   : static_cast<const int64_t*>(bt)[r * bt_stride + col];
          TORCH_CHECK(blk >= 0 && blk < nblocks, "torchneuron::paged_decode_attention: request ",
                      r, " names block ", blk, " outside the KV cache (", nblocks, " blocks)");
          const C* src = base + (blk * bs + t % bs) * token_row;
          if constexpr (std::is_same_v<C, float>) {
            rows[j] = src;
          } else if constexpr (std::is_same_v<C, T>) {
            float* w = wide.data() + j * token_row;
            for (int64_t c = 0; c < token_row; ++c) w[c] = static_cast<float>(src[c]);
            rows[j] = w;
          } else {  // FP8 codes: value * scale, in fp32
            float* w = wide.data() + j * token_row;
            for (int64_t h = 0; h < kvh; ++h) {
              for (int64_t c = 0; c < d; ++c) w[h * 2 * d + c] = static_cast<float>(src[h * 2 * d + c]) * k_scale;
              for (int64_t c = d; c < 2 * d; ++c) w[h * 2 * d + c] = static_cast<float>(src[h * 2 * d + c]) * v_scale;
            }
            rows[j] = w;
          }
        }
        for (int64_t hq = 0; hq < heads; ++hq) {
          const int64_t head_off = (hq / group) * 2 * d;
          for (int j = 0; j < kChunk; ++j) {
            k[j] = rows[j] + head_off;
            v[j] = k[j] + d;
          }
          scores(qf.data() + hq * d, k, d, s);
          float m = mx[hq];
          for (int j = 0; j < cnt; ++j) m = std::max(m, s[j]);
          // lanes past cnt repeat a valid row's score: finite, and never summed or used
          for (int j = 0; j < kChunk; ++j) s[j] -= m;
          expv(s);
          const float corr = std::exp(mx[hq] - m);  // 0 on the first chunk (mx = -inf)
          float psum = 0.0f;
          for (int j = 0; j < cnt; ++j) psum += s[j];
          sum[hq] = sum[hq] * corr + psum;
          mx[hq] = m;
          pv(acc.data() + hq * d, corr, s, v, cnt, d);
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        const float inv = sum[hq] > 0.0f ? 1.0f / sum[hq] : 0.0f;  // len 0: zeros
        T* dst = op + r * out.stride(0) + hq * out.stride(1);
        for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[hq * d + c] * inv);
      }
    }
  });
}

void check_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, const at::Tensor& out) {
  constexpr const char* op = "torchneuron::paged_decode_attention";
  check_cache(kv_cache, op);
  check_index(block_table, "block_table", op);
  check_index(seq_lens, "seq_lens", op);
  const int64_t kvh = kv_cache.size(2), d = kv_cache.size(3) / 2;
  TORCH_CHECK(query.dim() == 3 && query.size(2) == d && query.stride(2) == 1, op,
              ": query must be [requests, heads, ", d, "] with a dense last dim, got shape ",
              query.sizes(), " with strides ", query.strides());
  TORCH_CHECK(query.size(1) % kvh == 0, op, ": ", query.size(1), " query heads are not a multiple "
              "of the cache's ", kvh, " KV heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 &&
                  out.scalar_type() == query.scalar_type(),
              op, ": out must match query's shape ", query.sizes(), " and dtype ",
              query.scalar_type(), " with a dense last dim, got ", out.sizes(), " ",
              out.scalar_type());
  check_floating(query, "query", op);
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() || fp8_cache(kv_cache), op, ": query dtype ",
              query.scalar_type(), " differs from the kv_cache's ", kv_cache.scalar_type());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= query.size(0) &&
                  seq_lens.dim() == 1 && seq_lens.size(0) >= query.size(0),
              op, ": need a block_table row and a seq_len per request (", query.size(0),
              "), got block_table ", block_table.sizes(), " and seq_lens ", seq_lens.sizes());
}

void run_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, double scale, const at::Tensor& out, double k_scale,
                double v_scale) {
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "torchneuron::paged_decode_attention", [&] {
    if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) {
      decode_kernel<scalar_t, c10::Float8_e4m3fn>(query, kv_cache, block_table, seq_lens, scale, out, ks, vs);
    } else if (kv_cache.scalar_type() == at::kFloat8_e5m2) {
      decode_kernel<scalar_t, c10::Float8_e5m2>(query, kv_cache, block_table, seq_lens, scale, out, ks, vs);
    } else {
      decode_kernel<scalar_t>(query, kv_cache, block_table, seq_lens, scale, out);
    }
  });
}

void paged_decode_attention_cpu(const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens,
                                double scale, const at::Tensor& out, double k_scale, double v_scale) {
  check_decode(query, kv_cache, block_table, seq_lens, out);
  run_decode(query, kv_cache, block_table, seq_lens, scale, out, k_scale, v_scale);
}


// ---- rotary embedding, in place --------------------------------------------------------------
// vLLM's RotaryEmbedding (cos_sin_cache [max_position, rotary_dim]: cos halves then sin halves)
// applied in place to query and key ([tokens, heads * head_size] or [tokens, heads, head_size],
// each token's heads dense): the native torch route is ~25 small ops per layer (index_select,
// chunks, multiplies, cats) for a few kilobytes of data.
template <typename T>
void rotary_kernel(const at::Tensor& positions, const at::Tensor& x, int64_t head, const at::Tensor& cache,
                   bool neox) {
  const int64_t tokens = positions.size(0), heads = x.numel() / std::max<int64_t>(tokens * head, 1);
  const int64_t rot = cache.size(1), half = rot / 2, max_pos = cache.size(0);
  const T* cs = cache.const_data_ptr<T>();
  T* base = x.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t pos = index_at(positions, t);
    TORCH_CHECK(pos >= 0 && pos < max_pos, "torchneuron::rotary_embedding_: position ", pos,
                " of token ", t, " is outside the cos/sin cache (", max_pos, " positions)");
    const T* cosp = cs + pos * rot;
    const T* sinp = cosp + half;
    T* row = base + t * x.stride(0);
    for (int64_t h = 0; h < heads; ++h) {
      T* v = row + h * head;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float c = static_cast<float>(cosp[i]), s = static_cast<float>(sinp[i]);
        const float x1 = static_cast<float>(v[a]), x2 = static_cast<float>(v[b]);
        v[a] = static_cast<T>(x1 * c - x2 * s);
        v[b] = static_cast<T>(x2 * c + x1 * s);
      }
    }
  }
}

void check_rotary_operand(const at::Tensor& x, int64_t tokens, int64_t head, const at::Tensor& cache,
                          const char* what) {
  constexpr const char* op = "torchneuron::rotary_embedding_";
  TORCH_CHECK(x.dim() >= 2 && x.size(0) == tokens, op, ": ", what, " must be [", tokens,
              ", ...] (one row per position), got shape ", x.sizes());
  // each token's heads must be one dense run of memory (rows may be strided)
  int64_t expect = 1;
  for (int64_t dim = x.dim() - 1; dim >= 1; --dim) {
    TORCH_CHECK(x.size(dim) == 1 || x.stride(dim) == expect, op, ": ", what,
                " must be dense within each token, got strides ", x.strides(), " for shape ", x.sizes());
    expect *= x.size(dim);
  }
  TORCH_CHECK(expect % head == 0, op, ": ", what, " has ", expect, " values per token, not a multiple "
              "of head_size ", head);
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), op, ": ", what, " dtype ", x.scalar_type(),
              " differs from the cos_sin_cache's ", cache.scalar_type());
}

void check_rotary(const at::Tensor& positions, const at::Tensor& query,
                  const std::optional<at::Tensor>& key, int64_t head_size, const at::Tensor& cos_sin_cache) {
  constexpr const char* op = "torchneuron::rotary_embedding_";
  check_index(positions, "positions", op);
  check_floating(cos_sin_cache, "cos_sin_cache", op);
  TORCH_CHECK(positions.dim() == 1, op, ": positions must be 1-d (flattened), got ", positions.sizes());
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) % 2 == 0 && cos_sin_cache.size(1) <= head_size,
              op, ": cos_sin_cache must be a contiguous [max_position, rotary_dim] tensor with an "
              "even rotary_dim <= head_size ", head_size, ", got ", cos_sin_cache.sizes());
  const int64_t tokens = positions.size(0);
  check_rotary_operand(query, tokens, head_size, cos_sin_cache, "query");
  if (key.has_value()) check_rotary_operand(*key, tokens, head_size, cos_sin_cache, "key");
}

void run_rotary(const at::Tensor& positions, const at::Tensor& query, const std::optional<at::Tensor>& key,
                int64_t head_size, const at::Tensor& cos_sin_cache, bool is_neox) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "torchneuron::rotary_embedding_", [&] {
    rotary_kernel<scalar_t>(positions, query, head_size, cos_sin_cache, is_neox);
    if (key.has_value()) rotary_kernel<scalar_t>(positions, *key, head_size, cos_sin_cache, is_neox);
  });
}

void rotary_embedding_cpu(const at::Tensor& positions, const at::Tensor& query,
                          const std::optional<at::Tensor>& key, int64_t head_size,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  check_rotary(positions, query, key, head_size, cos_sin_cache);
  run_rotary(positions, query, key, head_size, cos_sin_cache, is_neox);
}


// ---- RMSNorm --------------------------------------------------------------------------------
// vLLM's IR ops rms_norm / fused_add_rms_norm (vllm/ir/ops/layernorm.py), whose native torch
// code is ~6 ops per call (casts, pow, mean, add, rsqrt, two multiplies), each paying the
// device's per-op dispatch for a few kilobytes. Same rounding steps as that code: the row in
// fp32 (plus the residual, fused), its mean square in fp32, x * rsqrt(var + eps) in fp32, rounded
// to the weight's dtype (= x's) before the multiply by the weight, the product rounded to x's
// dtype. Only the summation order of the mean square differs (vectorized reductions differ too).
// x: [rows, hidden] with dense rows; weight: [hidden] or absent.
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                   double eps, const at::Tensor& out) {
  const int64_t rows = x.size(0), h = x.size(1);
  const T* w = weight.defined() ? weight.const_data_ptr<T>() : nullptr;
  const T* xp = x.const_data_ptr<T>();
  T* rp = residual != nullptr ? residual->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* src = xp + r * x.stride(0);
      for (int64_t c = 0; c < h; ++c) xf[c] = static_cast<float>(src[c]);
      if (rp != nullptr) {  // x + residual in fp32; the residual keeps the rounded sum
        T* res = rp + r * residual->stride(0);
        for (int64_t c = 0; c < h; ++c) {
          xf[c] += static_cast<float>(res[c]);
          res[c] = static_cast<T>(xf[c]);
        }
      }
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent partial sums: vectorizable
      int64_t c = 0;
      for (; c + 8 <= h; c += 8) {
        for (int k = 0; k < 8; ++k) part[k] += xf[c + k] * xf[c + k];
      }
      float ss = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
      for (; c < h; ++c) ss += xf[c] * xf[c];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      T* dst = op + r * out.stride(0);
      for (int64_t k = 0; k < h; ++k) {
        const T y = static_cast<T>(xf[k] * inv);
        dst[k] = w ? static_cast<T>(static_cast<float>(y) * static_cast<float>(w[k])) : y;
      }
    }
  });
}

void check_rms_operand(const at::Tensor& t, const char* what, const char* op) {
  check_floating(t, what, op);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, op, ": ", what, " must be [rows, hidden] with a "
              "dense last dim, got shape ", t.sizes(), " with strides ", t.strides());
}

void check_rms_weight(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op) {
  if (!weight.has_value() || !weight->defined()) return;
  TORCH_CHECK(weight->dim() == 1 && weight->size(0) == x.size(1) && weight->is_contiguous(), op,
              ": weight must be a contiguous [", x.size(1), "] tensor, got shape ", weight->sizes());
  TORCH_CHECK(weight->scalar_type() == x.scalar_type(), op, ": weight dtype ", weight->scalar_type(),
              " differs from x's ", x.scalar_type(), " (vLLM's native code handles mixed dtypes)");
}

void check_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight) {
  constexpr const char* op = "torchneuron::rms_norm";
  check_rms_operand(x, "x", op);
  check_rms_weight(x, weight, op);
}

// residual: nullptr for rms_norm; out may be x (fused_add_rms_norm_: each row is read before it
// is written)
void run_rms_norm(const at::Tensor& x, const at::Tensor* residual, const std::optional<at::Tensor>& weight,
                  double eps, const at::Tensor& out) {
  const at::Tensor w = weight.has_value() && weight->defined() ? *weight : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "torchneuron::rms_norm", [&] {
    rms_norm_rows<scalar_t>(x, residual, w, eps, out);
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  check_rms_norm(x, weight);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  run_rms_norm(x, nullptr, weight, eps, out);
  return out;
}

void check_fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                              const std::optional<at::Tensor>& weight) {
  constexpr const char* op = "torchneuron::fused_add_rms_norm_";
  check_rms_operand(x, "x", op);
  check_rms_operand(residual, "residual", op);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), op,
              ": residual must match x (", x.sizes(), ", ", x.scalar_type(), "), got ",
              residual.sizes(), ", ", residual.scalar_type());
  check_rms_weight(x, weight, op);
}

void fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                            const std::optional<at::Tensor>& weight, double eps) {
  check_fused_add_rms_norm(x, residual, weight);
  run_rms_norm(x, &residual, weight, eps, x);
}

// ---- neuron: the same kernels over zero-copy aliases of device memory -----------------------
// With the execution engine on, a call whose tensors are all on one neuron device (enqueue.h's
// queueable_like / _opt / _index: values of the kernel's dtype, int32/int64 indices) is
// checked at the call and its kernel queued (QueuedCall, enqueue.h): no wait for the queue per
// layer and step, and the kernels can be captured in a graph (vLLM's decode graphs, whose
// replays read the block table, lengths, slots and positions vLLM wrote into its persistent
// buffers). Otherwise the kernel runs now over the aliases, after the queue.

void paged_kv_write_neuron(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping) {
  if (may_enqueue() && queueable_like(kv_cache, key) && queueable_like(kv_cache, value) &&
      queueable_index(kv_cache, slot_mapping)) {
    check_kv_write(key, value, kv_cache, slot_mapping);
    QueuedCall q;
    at::Tensor k = q.in(key), v = q.in(value), s = q.in(slot_mapping), c = q.inout(kv_cache);
    q.enqueue("torchneuron::paged_kv_write", [k, v, c, s] { run_kv_write(k, v, c, s); });
    return;
  }
  ZeroCopy zc;
  at::Tensor k = zc.in(key), v = zc.in(value), s = zc.in(slot_mapping);
  at::Tensor c = zc.in_output(kv_cache);
  zc.launch("torchneuron::paged_kv_write");
  paged_kv_write_cpu(k, v, c, s);
  zc.sync_inputs();
}

void paged_decode_attention_neuron(const at::Tensor& query, const at::Tensor& kv_cache,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                   double scale, const at::Tensor& out, double k_scale, double v_scale) {
  const bool cache_ok = fp8_cache(kv_cache) ? kv_cache.is_privateuseone() && kv_cache.device() == query.device()
                                            : queueable_like(query, kv_cache);
  if (may_enqueue() && cache_ok && queueable_like(query, out) && queueable_index(query, block_table) &&
      queueable_index(query, seq_lens)) {
    check_decode(query, kv_cache, block_table, seq_lens, out);
    QueuedCall q;
    at::Tensor qa = q.in(query), c = q.in(kv_cache), bt = q.in(block_table), sl = q.in(seq_lens);
    at::Tensor o = q.inout(out);
    q.enqueue("torchneuron::paged_decode_attention", [qa, c, bt, sl, scale, o, k_scale, v_scale] {
      run_decode(qa, c, bt, sl, scale, o, k_scale, v_scale);
    });
    return;
  }
  ZeroCopy zc;
  at::Tensor q = zc.in(query), c = zc.in(kv_cache), bt = zc.in(block_table), sl = zc.in(seq_lens);
  at::Tensor o = zc.in_output(out);
  zc.launch("torchneuron::paged_decode_attention");
  paged_decode_attention_cpu(q, c, bt, sl, scale, o, k_scale, v_scale);
  zc.sync_inputs();
}

void rotary_embedding_neuron(const at::Tensor& positions, const at::Tensor& query,
                             const std::optional<at::Tensor>& key, int64_t head_size,
                             const at::Tensor& cos_sin_cache, bool is_neox) {
  if (may_enqueue() && queueable_index(query, positions) && queueable_opt(query, key) &&
      queueable_like(query, cos_sin_cache)) {
    check_rotary(positions, query, key, head_size, cos_sin_cache);
    QueuedCall q;
    at::Tensor p = q.in(positions), c = q.in(cos_sin_cache), qa = q.inout(query);
    std::optional<at::Tensor> k;
    if (key.has_value()) k = q.inout(*key);
    q.enqueue("torchneuron::rotary_embedding_",
              [p, qa, k, head_size, c, is_neox] { run_rotary(p, qa, k, head_size, c, is_neox); });
    return;
  }
  ZeroCopy zc;
  at::Tensor p = zc.in(positions), c = zc.in(cos_sin_cache), q = zc.in_output(query);
  std::optional<at::Tensor> k;
  if (key.has_value()) k = zc.in_output(*key);
  zc.launch("torchneuron::rotary_embedding_");
  rotary_embedding_cpu(p, q, k, head_size, c, is_neox);
  zc.sync_inputs();
}

at::Tensor rms_norm_neuron(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  if (may_enqueue() && queueable_like(x, x) && queueable_opt(x, weight)) {
    check_rms_norm(x, weight);
    QueuedCall q;
    at::Tensor xa = q.in(x), result;
    std::optional<at::Tensor> w = q.in(weight);
    at::Tensor o = q.out(result, x.sizes(), x.scalar_type());
    q.enqueue("torchneuron::rms_norm", [xa, w, eps, o] { run_rms_norm(xa, nullptr, w, eps, o); });
    return result;
  }
  ZeroCopy zc;
  at::Tensor xa = zc.in(x);
  std::optional<at::Tensor> w;
  if (weight.has_value() && weight->defined()) w = zc.in(*weight);
  zc.launch("torchneuron::rms_norm");
  return zc.out(rms_norm_cpu(xa, w, eps));
}

void fused_add_rms_norm_neuron(const at::Tensor& x, const at::Tensor& residual,
                               const std::optional<at::Tensor>& weight, double eps) {
  if (may_enqueue() && queueable_like(x, residual) && queueable_opt(x, weight)) {
    check_fused_add_rms_norm(x, residual, weight);
    QueuedCall q;
    at::Tensor xa = q.inout(x), ra = q.inout(residual);
    std::optional<at::Tensor> w = q.in(weight);
    q.enqueue("torchneuron::fused_add_rms_norm_", [xa, ra, w, eps] { run_rms_norm(xa, &ra, w, eps, xa); });
    return;
  }
  ZeroCopy zc;
  at::Tensor xa = zc.in_output(x), ra = zc.in_output(residual);
  std::optional<at::Tensor> w;
  if (weight.has_value() && weight->defined()) w = zc.in(*weight);
  zc.launch("torchneuron::fused_add_rms_norm_");
  fused_add_rms_norm_cpu(xa, ra, w, eps);
  zc.sync_inputs();
}

// vLLM's weak_ref_tensor for neuron: a tensor over t's memory that does not own it. vLLM keeps
// the outputs of its captured graphs this way, so that the graph's memory pool (which holds the
// blocks while the graph lives) and not the reference decides how long they live. Not
// resizable; its storage carries no allocator.
at::Tensor weak_ref_tensor_neuron(const at::Tensor& t) {
  TORCH_CHECK(t.is_privateuseone() && t.layout() == c10::kStrided, "torchneuron::weak_ref_tensor: "
              "expects a strided neuron tensor, got ", t.device(), " ", t.layout());
  const c10::Storage& src = t.storage();
  c10::DataPtr ptr(const_cast<void*>(src.data()), t.device());
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), src.nbytes(),
                                                         std::move(ptr), /*allocator=*/nullptr,
                                                         /*resizable=*/false)),
      t.key_set(), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("weak_ref_tensor(Tensor input) -> Tensor");
  m.def("paged_kv_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, Tensor(a!) out, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("rotary_embedding_(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(torchneuron, CPU, m) {
  m.impl("paged_kv_write", TORCH_FN(paged_kv_write_cpu));
  m.impl("paged_decode_attention", TORCH_FN(paged_decode_attention_cpu));
  m.impl("rotary_embedding_", TORCH_FN(rotary_embedding_cpu));
  m.impl("rms_norm", TORCH_FN(rms_norm_cpu));
  m.impl("fused_add_rms_norm_", TORCH_FN(fused_add_rms_norm_cpu));
}

TORCH_LIBRARY_IMPL(torchneuron, PrivateUse1, m) {
  m.impl("paged_kv_write", TORCH_FN(paged_kv_write_neuron));
  m.impl("paged_decode_attention", TORCH_FN(paged_decode_attention_neuron));
  m.impl("rotary_embedding_", TORCH_FN(rotary_embedding_neuron));
  m.impl("rms_norm", TORCH_FN(rms_norm_neuron));
  m.impl("fused_add_rms_norm_", TORCH_FN(fused_add_rms_norm_neuron));
  m.impl("weak_ref_tensor", TORCH_FN(weak_ref_tensor_neuron));
}

}  // namespace torchneuron
