// Kernels of torchneuron's vLLM platform. Paged KV for the NEURON_ATTN backend
// (torchneuron/vllm/attention.py): the KV-cache write and decode attention read the token-major
// paged cache in place through the block table. Rotary embedding in place (torchneuron/vllm/ops.py).
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
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <optional>
#include <cmath>
#include <vector>

#include "zero_copy.h"

namespace torchneuron {
namespace {

int64_t index_at(const at::Tensor& t, int64_t i) {
  // block tables and slot mappings arrive as int32 (vLLM's) or int64
  return t.scalar_type() == at::kInt ? static_cast<int64_t>(t.const_data_ptr<int32_t>()[i * t.stride(0)])
                                     : t.const_data_ptr<int64_t>()[i * t.stride(0)];
}

void check_cache(const at::Tensor& kv_cache, const char* op) {
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
// reduction without reassociation, so the dot products and value accumulations of decode
// attention ran scalar (measured: slower than CPU's flash SDPA on the gathered context). AVX2+FMA
// versions are chosen at run time; the scalar ones remain for other hosts.
float dot_scalar(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}
void axpy_scalar(float* y, float a, const float* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c) y[c] += a * x[c];
}
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), acc);
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  v = _mm_hadd_ps(v, v);
  v = _mm_hadd_ps(v, v);
  float s = _mm_cvtss_f32(v);
  for (; c < n; ++c) s += a[c] * b[c];
  return s;
}
__attribute__((target("avx2,fma"))) void axpy_avx2(float* y, float a, const float* x, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    _mm256_storeu_ps(y + c, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + c), _mm256_loadu_ps(y + c)));
  }
  for (; c < n; ++c) y[c] += a * x[c];
}
bool have_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#else
bool have_avx2() { return false; }
float dot_avx2(const float* a, const float* b, int64_t n) { return dot_scalar(a, b, n); }
void axpy_avx2(float* y, float a, const float* x, int64_t n) { axpy_scalar(y, a, x, n); }
#endif

// a row of the cache as fp32: the row itself for fp32, else widened into `buf`
template <typename T>
const float* as_float(const T* row, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    buf.resize(n);
    for (int64_t c = 0; c < n; ++c) buf[c] = static_cast<float>(row[c]);
    return buf.data();
  }
}

// ---- KV write ------------------------------------------------------------------------------
// kv_cache row `slot_mapping[i]` <- (key[i], value[i]) for every token i with slot >= 0
// (vLLM marks padding tokens with slot -1). key/value: [tokens, kv_heads, head] with a dense
// last dim; tokens beyond slot_mapping's length are padding and ignored.
template <typename T>
void kv_write_kernel(const at::Tensor& key, const at::Tensor& value, const at::Tensor& cache,
                     const at::Tensor& slots, int64_t n) {
  const int64_t kvh = cache.size(2), d = cache.size(3) / 2, rows = cache.size(0) * cache.size(1);
  T* base = cache.data_ptr<T>();
  const T* k = key.const_data_ptr<T>();
  const T* v = value.const_data_ptr<T>();
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

void paged_kv_write_cpu(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_cache.scalar_type(), op, [&] {
    kv_write_kernel<scalar_t>(key, value, kv_cache, slot_mapping, n);
  });
}

// ---- decode attention ----------------------------------------------------------------------
// out[r] = softmax(scale * q[r] K^T) V over the first seq_lens[r] cached tokens of request r,
// whose blocks are block_table[r, :]. One query token per request (decode): the new token's key
// and value are already in the cache, so no causal mask is needed beyond the length.
template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                   const at::Tensor& seq_lens, double scale, const at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t nblocks = cache.size(0), bs = cache.size(1), kvh = cache.size(2);
  const int64_t group = heads / kvh, max_blocks = block_table.size(1);
  const T* base = cache.const_data_ptr<T>();
  const T* qp = q.const_data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool bt32 = block_table.scalar_type() == at::kInt;
  const void* bt = block_table.const_data_ptr();
  const int64_t bt_stride = block_table.stride(0), bt_col = block_table.stride(1);
  const float sc = static_cast<float>(scale);
  const int64_t token_row = kvh * 2 * d;  // one token: every KV head's key then value
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, p, wide;
    const bool vec = have_avx2();
    auto dot = vec ? dot_avx2 : dot_scalar;
    auto axpy = vec ? axpy_avx2 : axpy_scalar;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t len = index_at(seq_lens, r);
      TORCH_CHECK(len >= 0 && len <= max_blocks * bs, "torchneuron::paged_decode_attention: "
                  "request ", r, " has ", len, " tokens but its block table row holds ",
                  max_blocks * bs);
      qf.resize(heads * d);
      for (int64_t hq = 0; hq < heads; ++hq) {
        const T* src = qp + r * q.stride(0) + hq * q.stride(1);
        for (int64_t c = 0; c < d; ++c) qf[hq * d + c] = static_cast<float>(src[c]) * sc;
      }
      p.resize(heads * std::max<int64_t>(len, 1));
      // Tokens in the outer loop: each token's row (all KV heads, keys then values) is one
      // contiguous run read front to back; walking one head across tokens instead strides by
      // the row size, which maps many rows onto the same L1 sets.
      auto token = [&](int64_t t) {
        const int64_t col = (t / bs) * bt_col;
        const int64_t blk = bt32 ? static_cast<const int32_t*>(bt)[r * bt_stride + col]
                                 : static_cast<const int64_t*>(bt)[r * bt_stride + col];
        TORCH_CHECK(blk >= 0 && blk < nblocks, "torchneuron::paged_decode_attention: request ", r,
                    " names block ", blk, " outside the KV cache (", nblocks, " blocks)");
        return as_float(base + (blk * bs + t % bs) * token_row, token_row, wide);
      };
      for (int64_t t = 0; t < len; ++t) {
        const float* row = token(t);
        for (int64_t hq = 0; hq < heads; ++hq) {
          p[hq * len + t] = dot(qf.data() + hq * d, row + (hq / group) * 2 * d, d);
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {  // softmax per query head
        float* ph = p.data() + hq * len;
        const float m = len ? *std::max_element(ph, ph + len) : 0.0f;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) {
          ph[t] = std::exp(ph[t] - m);
          sum += ph[t];
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // len 0: zeros
        for (int64_t t = 0; t < len; ++t) ph[t] *= inv;
      }
      acc.assign(heads * d, 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const float* row = token(t);
        for (int64_t hq = 0; hq < heads; ++hq) {
          axpy(acc.data() + hq * d, p[hq * len + t], row + (hq / group) * 2 * d + d, d);
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        T* dst = op + r * out.stride(0) + hq * out.stride(1);
        for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<T>(acc[hq * d + c]);
      }
    }
  });
}

void paged_decode_attention_cpu(const at::Tensor& query, const at::Tensor& kv_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens,
                                double scale, const at::Tensor& out) {
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
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), op, ": query dtype ",
              query.scalar_type(), " differs from the kv_cache's ", kv_cache.scalar_type());
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= query.size(0) &&
                  seq_lens.dim() == 1 && seq_lens.size(0) >= query.size(0),
              op, ": need a block_table row and a seq_len per request (", query.size(0),
              "), got block_table ", block_table.sizes(), " and seq_lens ", seq_lens.sizes());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), op, [&] {
    decode_kernel<scalar_t>(query, kv_cache, block_table, seq_lens, scale, out);
  });
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

void rotary_embedding_cpu(const at::Tensor& positions, const at::Tensor& query,
                          const std::optional<at::Tensor>& key, int64_t head_size,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  constexpr const char* op = "torchneuron::rotary_embedding_";
  check_index(positions, "positions", op);
  TORCH_CHECK(positions.dim() == 1, op, ": positions must be 1-d (flattened), got ", positions.sizes());
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) % 2 == 0 && cos_sin_cache.size(1) <= head_size,
              op, ": cos_sin_cache must be a contiguous [max_position, rotary_dim] tensor with an "
              "even rotary_dim <= head_size ", head_size, ", got ", cos_sin_cache.sizes());
  const int64_t tokens = positions.size(0);
  check_rotary_operand(query, tokens, head_size, cos_sin_cache, "query");
  if (key.has_value()) check_rotary_operand(*key, tokens, head_size, cos_sin_cache, "key");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), op, [&] {
    rotary_kernel<scalar_t>(positions, query, head_size, cos_sin_cache, is_neox);
    if (key.has_value()) rotary_kernel<scalar_t>(positions, *key, head_size, cos_sin_cache, is_neox);
  });
}

// ---- neuron: the same kernels over zero-copy aliases of device memory -----------------------
void paged_kv_write_neuron(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping) {
  ZeroCopy zc;
  at::Tensor k = zc.in(key), v = zc.in(value), s = zc.in(slot_mapping);
  at::Tensor c = zc.in_output(kv_cache);
  zc.launch("torchneuron::paged_kv_write");
  paged_kv_write_cpu(k, v, c, s);
  zc.sync_inputs();
}

void paged_decode_attention_neuron(const at::Tensor& query, const at::Tensor& kv_cache,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                   double scale, const at::Tensor& out) {
  ZeroCopy zc;
  at::Tensor q = zc.in(query), c = zc.in(kv_cache), bt = zc.in(block_table), sl = zc.in(seq_lens);
  at::Tensor o = zc.in_output(out);
  zc.launch("torchneuron::paged_decode_attention");
  paged_decode_attention_cpu(q, c, bt, sl, scale, o);
  zc.sync_inputs();
}

void rotary_embedding_neuron(const at::Tensor& positions, const at::Tensor& query,
                             const std::optional<at::Tensor>& key, int64_t head_size,
                             const at::Tensor& cos_sin_cache, bool is_neox) {
  ZeroCopy zc;
  at::Tensor p = zc.in(positions), c = zc.in(cos_sin_cache), q = zc.in_output(query);
  std::optional<at::Tensor> k;
  if (key.has_value()) k = zc.in_output(*key);
  zc.launch("torchneuron::rotary_embedding_");
  rotary_embedding_cpu(p, q, k, head_size, c, is_neox);
  zc.sync_inputs();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("paged_kv_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("rotary_embedding_(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()");
}

TORCH_LIBRARY_IMPL(torchneuron, CPU, m) {
  m.impl("paged_kv_write", TORCH_FN(paged_kv_write_cpu));
  m.impl("paged_decode_attention", TORCH_FN(paged_decode_attention_cpu));
  m.impl("rotary_embedding_", TORCH_FN(rotary_embedding_cpu));
}

TORCH_LIBRARY_IMPL(torchneuron, PrivateUse1, m) {
  m.impl("paged_kv_write", TORCH_FN(paged_kv_write_neuron));
  m.impl("paged_decode_attention", TORCH_FN(paged_decode_attention_neuron));
  m.impl("rotary_embedding_", TORCH_FN(rotary_embedding_neuron));
}

}  // namespace torchneuron
